"""Post-training static quantization (PTQ) of a zoo model in FX mode, end to end.

    python examples/ptq_fx.py [--model resnet18] [--march bayes] [--observer histogram-mse]
                              [--calib-batches 8] [--image-size 64] [--weight-rounding]

The flow of the classic FX-mode PTQ walkthrough, with qcompiler's staged API:

1. build the float model and trace it: ``prepare_calibration_fx`` returns a
   calibration model whose observers record activation ranges (its outputs
   are exactly the float model's);
2. calibrate: run it in ``eval()`` under ``torch.no_grad()`` over a
   ``DataLoader`` of representative images;
3. optionally (``--weight-rounding``) ``optimize_weight_rounding`` re-rounds
   the weights on the calibration images (same scales; each layer's output
   error on the data is made smallest), then ``convert_fx`` turns it into the
   fixed-point model (int8 weights and activations, int32 accumulators, as the
   BPU computes);
4. evaluate: output SQNR of the fixed-point model against the float model on
   held-out images.

Zoo models have random weights, so there is no accuracy to measure; the
output SQNR (``20*log10(||f|| / ||f - q||)``) says how close the fixed-point
model tracks the float one.  The data are deterministic "smooth noise"
images (random low-resolution noise, upsampled and blurred), which have the
spatial correlation of natural images.  Before quantizing, the BatchNorm
statistics of the random model are re-estimated on such images (as if it had
been trained on them), so every layer sees activations of the scale a
trained network produces; ``--no-bn-reestimate`` skips that.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

import qcompiler.zoo as zoo
from qcompiler.errors import QCompilerWarning
from qcompiler.ir.meta import GM_MARCH
from qcompiler.ir.partitions import summary_line
from qcompiler.march import March
from qcompiler.quantization import (
    OBSERVERS,
    convert_fx,
    get_default_calib_qconfig,
    optimize_weight_rounding,
    prepare_calibration_fx,
)

IMAGE_MODELS = ("resnet18", "resnet50", "mobilenet_v2", "unet", "hybrid")


class SmoothNoiseImages(Dataset):
    """``length`` deterministic smooth-noise images ``(channels, size, size)``; item ``i`` is seeded by ``i``.

    Each image sums Gaussian noise drawn on 4x4, 8x8 and 16x16 grids,
    upsampled bilinearly to ``size`` (coarse grids weigh more), then blurs it
    with a 5-tap Gaussian and normalises every channel to mean 0, std 1.
    Items are ``(image, 0)`` pairs, like a labelled dataset.
    """

    def __init__(self, length: int, size: int = 64, channels: int = 3, seed: int = 0) -> None:
        self.length, self.size, self.channels, self.seed = length, size, channels, seed
        k = torch.exp(-0.5 * torch.arange(-2.0, 3.0) ** 2)
        k = k / k.sum()
        self.kh = k.reshape(1, 1, 1, 5).repeat(channels, 1, 1, 1)
        self.kv = k.reshape(1, 1, 5, 1).repeat(channels, 1, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        img = torch.zeros(1, self.channels, self.size, self.size)
        for level, r in enumerate(r for r in (4, 8, 16) if r <= self.size):
            noise = torch.randn(1, self.channels, r, r, generator=g)
            img += F.interpolate(noise, size=(self.size, self.size), mode="bilinear",
                                 align_corners=False) / (level + 1)
        img = F.pad(img, (2, 2, 2, 2), mode="reflect")
        img = F.conv2d(F.conv2d(img, self.kh, groups=self.channels), self.kv, groups=self.channels)[0]
        img = (img - img.mean(dim=(1, 2), keepdim=True)) / img.std(dim=(1, 2), keepdim=True).clamp_min(1e-6)
        return img, 0


class _Slice(Dataset):
    """Items ``start .. start + length - 1`` of ``base`` (disjoint calibration / test sets)."""

    def __init__(self, base: Dataset, start: int, length: int) -> None:
        self.base, self.start, self.length = base, start, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        return self.base[self.start + i]


@torch.no_grad()
def reestimate_bn(model: nn.Module, loader: DataLoader) -> nn.Module:
    """Reset every BatchNorm's running stats and re-estimate them (cumulative average) on ``loader``."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average over all batches
    model.train()
    for x, _ in loader:
        model(x)
    for m, momentum in zip(bns, momenta):
        m.momentum = momentum
    return model.eval()


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """``20 * log10(||ref|| / ||ref - test||)`` (inf when identical)."""
    ref, test = ref.double().flatten(), test.double().flatten()
    err = float((ref - test).norm())
    return math.inf if err == 0.0 else 20.0 * math.log10(float(ref.norm()) / err)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="resnet18", choices=IMAGE_MODELS, help="zoo model (image models)")
    p.add_argument("--march", default=None, choices=[m.value for m in March],
                   help="BPU generation (default: the process-wide default march)")
    p.add_argument("--observer", default="histogram-mse", choices=list(OBSERVERS),
                   help="activation calibration observer")
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches")
    p.add_argument("--weight-rounding", action="store_true",
                   help="re-round the weights on the calibration images before convert_fx")
    p.add_argument("--batch-size", type=int, default=4, help="images per batch")
    p.add_argument("--image-size", type=int, default=64, help="image side (zoo models are built for 224)")
    p.add_argument("--eval-images", type=int, default=8, help="held-out images for the SQNR")
    p.add_argument("--bn-batches", type=int, default=20,
                   help="batches for re-estimating BN statistics (0 = keep the zoo's)")
    p.add_argument("--no-bn-reestimate", dest="bn_batches", action="store_const", const=0,
                   help="keep the zoo model's BatchNorm statistics")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no printing")
    args = p.parse_args(argv)
    for name in ("calib_batches", "batch_size", "image_size", "eval_images"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the PTQ flow; returns the numbers it prints (``sqnr_db``, ``partitions``, ...)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.quiet else print
    t0 = time.perf_counter()

    # -- 1. float model and data ---------------------------------------------------
    model = zoo.get(args.model)  # eval mode, deterministic random weights
    channels = zoo.spec(args.model).input_shape[1]
    n_calib = args.calib_batches * args.batch_size
    n_bn = args.bn_batches * args.batch_size
    # one stream of images, cut into disjoint calibration / held-out / BN sets
    images = SmoothNoiseImages(n_calib + args.eval_images + n_bn, args.image_size, channels)
    calib_loader = DataLoader(_Slice(images, 0, n_calib), batch_size=args.batch_size, shuffle=False)
    eval_loader = DataLoader(_Slice(images, n_calib, args.eval_images), batch_size=args.batch_size)
    if n_bn:
        bn_loader = DataLoader(_Slice(images, n_calib + args.eval_images, n_bn), batch_size=args.batch_size)
        reestimate_bn(model, bn_loader)

    # -- 2. prepare: trace, place, fuse, attach observers --------------------------
    example = zoo.example_inputs(args.model, image_size=args.image_size)
    qconfig_dict = {"": get_default_calib_qconfig(observer=args.observer)}
    with warnings.catch_warnings():
        # models with CPU ops (e.g. "hybrid") are prepared as hybrid models either way
        warnings.simplefilter("ignore", QCompilerWarning)
        calib_model = prepare_calibration_fx(model, qconfig_dict, example_inputs=example, march=args.march)

    # -- 3. calibrate: eval mode, no grad, over the DataLoader ---------------------
    calib_model.eval()
    with torch.no_grad():
        for x, _ in tqdm(calib_loader, desc=f"calibrating ({args.observer})", unit="batch",
                         disable=args.quiet, leave=False):
            calib_model(x)

    # -- 4. (optional) re-round the weights, then convert to the fixed-point model -
    if args.weight_rounding:
        optimize_weight_rounding(calib_model, [x for x, _ in calib_loader], progress=not args.quiet)
    quantized = convert_fx(calib_model)

    # -- 5. evaluate on held-out images -------------------------------------------
    floats, fixed = [], []
    with torch.no_grad():
        for x, _ in eval_loader:
            floats.append(model(x))
            fixed.append(quantized(x).float())
    f, q = torch.cat(floats), torch.cat(fixed)
    result = {
        "model": args.model,
        "march": str(calib_model.meta.get(GM_MARCH)),
        "observer": args.observer,
        "weight_rounding": args.weight_rounding,
        "image_size": args.image_size,
        "calib_images": n_calib,
        "eval_images": args.eval_images,
        "sqnr_db": sqnr_db(f, q),
        "max_abs_err": float((f - q).abs().max()),
        "partitions": summary_line(calib_model),
        "seconds": time.perf_counter() - t0,
    }
    if f.dim() == 2:  # classifier: how often the fixed-point model keeps the float top-1
        result["top1_agreement"] = float((f.argmax(1) == q.argmax(1)).float().mean())
    say(f"model {result['model']} (march {result['march']}, {args.image_size}x{args.image_size}, "
        f"observer {args.observer}{' + weight rounding' if args.weight_rounding else ''}, {n_calib} calibration / {args.eval_images} held-out images)")
    say(f"output SQNR of the int8 model vs float: {result['sqnr_db']:.2f} dB "
        f"(max |error| {result['max_abs_err']:.4g})")
    if "top1_agreement" in result:
        say(f"top-1 agreement with float: {result['top1_agreement']:.0%}")
    say(result["partitions"])
    say(f"done in {result['seconds']:.1f} s")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
