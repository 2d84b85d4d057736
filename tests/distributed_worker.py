"""One rank of a distributed test: ``python tests/distributed_worker.py SCENARIO OUT_DIR``.

Launched by tests/test_distributed.py with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); WORLD_SIZE=1 runs the same code with
no process group (the single-process reference on the union of the shards).
Each scenario saves what it measured to ``OUT_DIR/rank<R>.pt``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import qcompiler
import qcompiler.distributed as qd
from qcompiler import collectives
from qcompiler.errors import QCompilerError
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import FakeQuantize, set_state
from qcompiler.quantization.mixed_precision import auto_int16
from qcompiler.quantization.observer import (
    OBSERVERS,
    MinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
    make_observer,
    reduce_observers,
)
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.qconfig import get_default_calib_qconfig, get_default_qat_qconfig
from qcompiler.tools.quant_analysis import QuantAnalysis

RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().eval()


EXAMPLE = (torch.zeros(1, 1, 8, 8),)
TEST = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(99))


def batches(n: int = 5) -> list[torch.Tensor]:
    """Batches of growing range and varying size, so histograms grow differently on each shard."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2 + i % 2, 1, 8, 8, generator=g) * (0.5 + i) for i in range(n)]


def observer_state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()
            if any(k.startswith(p) for p, m in model.named_modules() if isinstance(m, ObserverBase) and p)}


def scenario_calib() -> dict:
    """Per observer: synced observer state, qparams, converted outputs, compile outputs, QAT hand-over scales."""
    out = {}
    mine = qd.shard(batches())
    for name in OBSERVERS:
        cal = prepare_calibration_fx(net(), {"": get_default_calib_qconfig(observer=name)},
                                     example_inputs=EXAMPLE)
        with torch.no_grad():
            for b in mine:
                cal(b)
        conv = convert_fx(cal)
        qat = prepare_qat_fx(cal)
        synced = qd.sync_observers(cal)
        out[name] = {
            "observers": observer_state(synced),
            "qparams": {p: m.calculate_qparams()[0] for p, m in synced.named_modules()
                        if isinstance(m, ObserverBase) and m.has_observed},
            "converted": conv(TEST),
            "qat_scales": {p: m.scale.clone() for p, m in qat.named_modules() if isinstance(m, FakeQuantize)},
        }
        # sync_observers is idempotent: a second call changes nothing
        again = observer_state(qd.sync_observers(synced))
        assert all(torch.equal(again[k], v) for k, v in out[name]["observers"].items())
    cm = qcompiler.compile(net(), EXAMPLE, calib_data=mine, progress=False)
    out["compiled"] = cm(TEST)
    out["bare"] = bare_observers()
    return out


def bare_observers() -> dict:
    """reduce_observers on a mixed list: a per-channel observer only rank 0 feeds, one nobody feeds."""
    obs = [MinMaxObserver(), PerChannelMinMaxObserver(), make_observer("kl"), PerChannelMinMaxObserver(),
           make_observer("percentile", dtype="qint16")]
    for i, b in enumerate(batches()):
        if i % WORLD != RANK:
            continue
        obs[0](b)
        if i == 0:  # batch 0 is rank 0's: rank 1 holds an empty per-channel state
            obs[1](b.transpose(0, 1))
        obs[2](b)
        obs[4](b * 3)
    reduce_observers(obs)
    return {f"{i}.{k}": v.clone() for i, o in enumerate(obs) for k, v in o.state_dict().items()}


def scenario_qat() -> dict:
    """Three DDP steps on different data per rank; the fake-quant state after each step."""
    torch.manual_seed(0)
    qat = prepare_qat_fx(net(), {"": get_default_qat_qconfig()}, example_inputs=EXAMPLE)
    model = nn.parallel.DistributedDataParallel(qat) if WORLD > 1 else qat
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    set_state(qat, "qat")
    qat.train()
    g = torch.Generator().manual_seed(10 + RANK)
    steps = []
    for _ in range(3):
        x, y = torch.randn(4, 1, 8, 8, generator=g) * (1 + RANK), torch.randint(0, 10, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append({k: v.clone() for k, v in qat.state_dict().items()})
    return {"steps": steps}


def _expect_error(fn) -> str:
    try:
        fn()
    except QCompilerError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def scenario_errors() -> dict:
    out = {}
    mine = qd.shard(batches())

    def calibrated(seed, observer):
        cal = prepare_calibration_fx(net(seed), {"": get_default_calib_qconfig(observer=observer)},
                                     example_inputs=EXAMPLE)
        with torch.no_grad():
            for b in mine:
                cal(b)
        return cal

    out["weights"] = _expect_error(lambda: convert_fx(calibrated(RANK, "minmax")))
    out["config"] = _expect_error(lambda: convert_fx(calibrated(0, "minmax" if RANK == 0 else "kl")))
    out["empty"] = _expect_error(lambda: qcompiler.compile(net(), EXAMPLE, calib_data=mine if RANK == 0 else [],
                                                           progress=False))
    pc = PerChannelMinMaxObserver()
    pc(torch.randn(3 + RANK, 5))
    out["channels"] = _expect_error(lambda: reduce_observers([MinMaxObserver(), pc]))
    # refused before any collective, on every rank: each rank would choose on its own shard
    out["auto_int16"] = _expect_error(lambda: auto_int16(
        prepare_calibration_fx(net(), example_inputs=EXAMPLE, march="bayes"), mine, budget=0.1))
    out["int16_budget"] = _expect_error(lambda: qcompiler.compile(net(), EXAMPLE, calib_data=mine, march="bayes",
                                                                  int16_budget=0.1, progress=False))
    out["ok"] = _expect_error(lambda: convert_fx(calibrated(0, "minmax")))  # the group still works
    return out


def scenario_die() -> dict:
    """Rank 1 dies after calibrating; the others must fail with a clear error, not hang."""
    cal = prepare_calibration_fx(net(), example_inputs=EXAMPLE)
    with torch.no_grad():
        for b in qd.shard(batches()):
            cal(b)
    if RANK == 1:
        os._exit(3)
    return {"error": _expect_error(lambda: convert_fx(cal))}


def scenario_stall() -> dict:
    """Rank 1 is stuck (alive, not dying) past the sync timeout; rank 0 must give up and say who is missing."""
    cal = prepare_calibration_fx(net(), example_inputs=EXAMPLE)
    with torch.no_grad():
        for b in qd.shard(batches()):
            cal(b)
    if RANK == 1:
        time.sleep(float(os.environ["STALL_SECONDS"]))
    t = time.perf_counter()
    return {"error": _expect_error(lambda: convert_fx(cal)), "waited": time.perf_counter() - t}


def scenario_analysis() -> dict:
    """Sharded sensitivity and auto_find_bad_case; sharded evaluate of the converted model."""
    cal = prepare_calibration_fx(net(), example_inputs=EXAMPLE)
    with torch.no_grad():
        for b in batches():  # every rank calibrates on all the data: the models are the same
            cal(b)
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    out_dir = Path(sys.argv[2]) / f"qa{RANK}"
    qa = QuantAnalysis(net(), qat, "fake_quant", out_dir=out_dir)
    bad = qa.auto_find_bad_case(batches(7), metric="SQNR")
    sens = qa.sensitivity("L1")
    data = torch.utils.data.TensorDataset(torch.randn(11, 1, 8, 8, generator=torch.Generator().manual_seed(5)),
                                          torch.arange(11) % 10)
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    acc = qd.evaluate(convert_fx(cal), loader, lambda o, t: (o.argmax(1) == t).sum().item())
    logits = qd.evaluate(net(), loader, lambda o, t: o)
    files = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    return {"bad": bad, "bad_case": qa.bad_case, "case_metrics": qa.case_metrics, "sens": sens,
            "acc": acc, "logits": logits, "files": files}


def scenario_collectives() -> dict:
    """qcompiler's collectives: what they return, and that gloo's workers have let go of it (see collectives.py)."""
    raw_held = 0  # dist.all_reduce: how often gloo still holds the tensor on return (first: ours follow)
    for i in range(300):
        t = torch.full((4,), float(i))
        dist.all_reduce(t)
        raw_held += t._use_count() > 1
    held, sums = 0, []
    for i in range(300):
        got = collectives.all_reduce(torch.full((4,), float(i + RANK)), collectives.SUM, "a test sum")
        held += got._use_count() > 1
        sums.append(got)
    objects = [None, {"rank": RANK, "t": torch.arange(3 + RANK)}, b"x" * (100_000 * (RANK + 1)), "é" * RANK]
    gathered = [collectives.all_gather_object(o, "a test gather") for o in objects]
    sent = [collectives.broadcast_object(o, src, "a test broadcast") for o in objects for src in (0, 1)]
    return {"held": held, "raw_held": raw_held, "sums": torch.stack(sums), "gathered": gathered, "sent": sent}


if __name__ == "__main__":
    torch.set_num_threads(1)
    if WORLD > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result = globals()[f"scenario_{sys.argv[1]}"]()
    torch.save(result, Path(sys.argv[2]) / f"rank{RANK}.pt")
