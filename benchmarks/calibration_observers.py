"""Where one calibration batch's time goes beside the float forward: the observers, timed inside
the calibration model.

    python benchmarks/calibration_observers.py [--threads 2] [--models resnet18,mobilenet_v2] [--repeat 5]

For each model, the same data as ``benchmarks/compile_time.py`` (``--calib-batches`` smooth-noise
batches of ``--batch``): per round, the float model's eval forward over the batches, then a fresh
calibration model (``prepare_calibration_fx``, histogram-mse activations, per-channel weights)
over the same batches with ``HistogramObserver.forward`` and ``PerChannelMinMaxObserver.forward``
wrapped in a timer.  Each column is the best of ``--repeat`` rounds (after a warm-up round), per
batch.  On a shared machine the float forward at 2 threads swings with the load (torch's two
intra-op threads wait for the second core); the observers' own times are the steadier measure.
The page-fault columns (minor faults per batch, the median over the rounds) show the other cause of
its swings: glibc gives freed activation memory back to the kernel and faults it in again on the next
allocation, tens of thousands of 4 KiB pages a batch at this size (see docs/performance.md,
"Calibration at 2 threads").
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler.zoo as zoo  # noqa: E402
from benchmarks.compile_time import calib_data  # noqa: E402
from qcompiler.compiled import calibration_batches  # noqa: E402
from qcompiler.quantization import observer, prepare_calibration_fx  # noqa: E402

KINDS = {"histogram observers": observer.HistogramObserver, "weight observers": observer.PerChannelMinMaxObserver}


def _timed(spent: dict) -> None:
    """Wrap each observer kind's forward to add its time to ``spent[kind]``."""
    for kind, cls in KINDS.items():
        real = cls.forward

        def forward(self, x, _real=real, _kind=kind):
            t0 = time.perf_counter()
            try:
                return _real(self, x)
            finally:
                spent[_kind] += time.perf_counter() - t0

        cls.forward = forward


def measure(name: str, args) -> tuple[dict[str, float], dict[str, float]]:
    (x,) = zoo.example_inputs(name, image_size=args.image_size)
    data = calib_data(name, args.image_size, args.calib_batches, args.batch)
    model = zoo.get(name).eval()
    batches = calibration_batches(data, (x,))
    spent = dict.fromkeys(KINDS, 0.0)
    _timed(spent)
    best: dict[str, float] = {}
    faults: dict[str, list[int]] = {"float forward": [], "calibration": []}
    for r in range(args.repeat + 1):
        with torch.no_grad():
            f0, t0 = _minor_faults(), time.perf_counter()
            for b in data:
                model(b)
            fwd, f_fwd = time.perf_counter() - t0, _minor_faults() - f0
            cal = prepare_calibration_fx(model, example_inputs=(x,), hybrid=True).eval()
            for k in spent:
                spent[k] = 0.0
            f0, t0 = _minor_faults(), time.perf_counter()
            for b in batches:
                cal(*b)
            calib, f_cal = time.perf_counter() - t0, _minor_faults() - f0
        if r:  # round 0 warms up
            for k, v in {"float forward": fwd, "calibration": calib, **spent}.items():
                best[k] = min(best.get(k, float("inf")), v / len(data))
            faults["float forward"].append(f_fwd // len(data))
            faults["calibration"].append(f_cal // len(data))
    return best, {k: statistics.median(v) for k, v in faults.items()}


def _minor_faults() -> int:
    """Minor page faults of this process so far (a page the kernel hands out again, zeroed)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--calib-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows = []
    for name in args.models.split(","):
        b, faults = measure(name, args)
        rows.append((name, *(f"{b[k] * 1e3:.1f}" for k in ("float forward", "calibration", *KINDS)),
                     f"{b['calibration'] / b['float forward']:.2f}x", f"{faults['float forward']:.0f}",
                     f"{faults['calibration']:.0f}"))
    print(f"{torch.get_num_threads()} threads, best of {args.repeat} per column, ms per batch of "
          f"{args.batch}x3x{args.image_size}x{args.image_size}; load average {os.getloadavg()[0]:.2f}")
    print(tabulate(rows, headers=["model", "float forward", "calibration", *KINDS, "calibration / float",
                                  "page faults: float", "page faults: calibration"]))


if __name__ == "__main__":
    main()
