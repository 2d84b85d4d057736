"""QAT under DistributedDataParallel on scikit-learn's 8x8 digits, then convert and evaluate.

    torchrun --nproc_per_node 2 examples/qat_ddp.py      # 2 ranks (gloo on CPU, NCCL on GPUs)
    python examples/qat_ddp.py                           # the same script on one process

Needs scikit-learn (its digits ship with the package; nothing is downloaded).
Steps, on every rank:

1. train a small float CNN (seeded, the same on every rank; rank 0's weights
   are broadcast so the ranks provably start equal);
2. calibrate on this rank's share of the 256 calibration images
   (``qcompiler.distributed.shard``); ``prepare_qat_fx`` reduces the observers
   over the ranks, so QAT starts from the ranges of all 256 images;
3. QAT under ``DistributedDataParallel``: a ``DistributedSampler`` gives each
   rank ``64 / world`` images per step (the global batch stays 64); the fake
   quants reduce each batch's range over the ranks, so their scales are the
   same on every rank at every step;
4. ``convert_fx`` and ``qcompiler.distributed.evaluate``: the held-out images are
   split over the ranks and rank 0 prints the top-1 over all 450.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from qcompiler import collectives
from qcompiler.distributed import evaluate, is_main_process, join_torchrun, shard
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import FakeQuantize, set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.qconfig import (
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))


def digits():
    """The 1797 digits split 75/25 (stratified, random_state=0), normalised like benchmarks/accuracy.py."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = X.astype(np.float32).reshape(-1, 1, 8, 8) / 16.0
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    mean, std = Xtr.mean(), Xtr.std()
    return (torch.from_numpy((Xtr - mean) / std), torch.from_numpy(ytr).long(),
            torch.from_numpy((Xte - mean) / std), torch.from_numpy(yte).long())


def train_float(X: torch.Tensor, y: torch.Tensor, epochs: int) -> nn.Module:
    torch.manual_seed(0)
    model = DigitsCNN()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * math.ceil(len(X) / 64)))
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=g)
        for i in range(0, len(X), 64):
            idx = perm[i:i + 64]
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    if dist.is_initialized():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    return model.eval()


def qat_ddp(model: nn.Module, X: torch.Tensor, y: torch.Tensor, epochs: int) -> nn.Module:
    world = dist.get_world_size() if dist.is_initialized() else 1
    calib = shard(list(X[:256].split(32)))  # this rank's calibration batches
    cal = prepare_calibration_fx(model, {"": get_default_calib_qconfig(observer="histogram-mse")},
                                 example_inputs=(X[:1],))
    cal.eval()
    with torch.no_grad():
        for x in calib:
            cal(x)
    # the hand-over reduces the observers over the ranks: every rank starts from all 256 images
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig(), "module_name": [("fc", get_default_qat_out_qconfig())]})
    set_state(qat, "qat")
    qat.train()
    ddp = nn.parallel.DistributedDataParallel(qat) if dist.is_initialized() else qat
    data = TensorDataset(X, y)
    sampler = DistributedSampler(data, shuffle=True, seed=1) if dist.is_initialized() else None
    loader = DataLoader(data, batch_size=64 // world, sampler=sampler, shuffle=sampler is None,
                        generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    set_state(qat, "validation")
    return qat.eval()


def scales(model: nn.Module) -> torch.Tensor:
    """Every fake-quant scale, concatenated (to show they are equal on every rank)."""
    return torch.cat([m.scale.flatten() for m in model.modules() if isinstance(m, FakeQuantize)])


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30, help="float training epochs")
    p.add_argument("--qat-epochs", type=int, default=3)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    joined = join_torchrun()
    try:
        t0 = time.perf_counter()
        Xtr, ytr, Xte, yte = digits()
        model = train_float(Xtr, ytr, args.epochs)
        t_float = time.perf_counter()
        qat = qat_ddp(model, Xtr, ytr, args.qat_epochs)
        t_qat = time.perf_counter()
        converted = convert_fx(qat)
        test = DataLoader(TensorDataset(Xte, yte), batch_size=64)
        top1 = evaluate(converted, test, lambda out, t: float((out.float().argmax(1) == t).float().mean()))
        fp_top1 = evaluate(model, test, lambda out, t: float((out.argmax(1) == t).float().mean()))
        s = scales(qat)
        # qcompiler's gather, not dist.all_gather: it holds its tensors until gloo's worker lets go of
        # them, which a script about to exit must (qcompiler/collectives.py says why)
        same = [torch.equal(s, other) for other in collectives.all_gather_object(s, "comparing the scales")]
        result = {"world": dist.get_world_size() if dist.is_initialized() else 1, "top1": top1,
                  "float_top1": fp_top1, "scales_equal_on_all_ranks": all(same),
                  "qat_seconds": t_qat - t_float}
        if is_main_process() and not args.quiet:
            print(f"ranks {result['world']}: float top-1 {100 * fp_top1:.2f}%, int8 QAT top-1 {100 * top1:.2f}% "
                  f"on {len(Xte)} held-out digits; fake-quant scales equal on all ranks: {all(same)}; "
                  f"QAT {t_qat - t_float:.1f} s, total {time.perf_counter() - t0:.1f} s")
        return result
    finally:
        if joined:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
