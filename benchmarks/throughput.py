"""Throughput of a compiled model over a dataset: ``qcompiler.distributed.evaluate`` vs one call per batch.

    python benchmarks/throughput.py [--model resnet18] [--image-size 224] [--batch 32] [--batches 4] [--repeat 3]

* single call: ``cm(x)`` on one ready batch of ``--batch`` images (best of ``--repeat``, interleaved with the rest):
  the speed a user gets calling the model directly, per sample;
* evaluate: ``evaluate(cm, DataLoader(dataset, batch_size=--batch), metric)`` over
  ``--batches`` batches, with its progress bar (tqdm), on a dataset of ready tensors
  (``TensorDataset``) and on ``SmoothNoise``, which computes each image when it is read
  (the reader thread overlaps that with the model);
* both at 1 and at 2 torch threads: the gain from the second core.

Ratios ``evaluate / single call`` are samples/s over samples/s; the goal is >= 0.9 at batch 32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from tabulate import tabulate
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler  # noqa: E402
import qcompiler.zoo as zoo  # noqa: E402
from benchmarks._data import SmoothNoise  # noqa: E402
from qcompiler.distributed import evaluate  # noqa: E402


def top1(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.argmax(1) == targets).float().mean())


def best(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    x = zoo.example_inputs(args.model, image_size=args.image_size)
    n = args.batch * args.batches
    noise = SmoothNoise(n, size=args.image_size, channels=x[0].shape[1], seed=3)
    images = torch.stack([noise[i][0] for i in range(n)])
    ready = TensorDataset(images, torch.zeros(n, dtype=torch.long))
    cm = qcompiler.compile(zoo.get(args.model), x, calib_data=[images[:8]], progress=False)
    batch = images[:args.batch]
    rows, speeds = [], {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        cm(batch)  # warm-up
        runs = [(best(1, lambda: cm(batch)), best(1, lambda: evaluate(cm, DataLoader(ready, batch_size=args.batch), top1)),
                 best(1, lambda: evaluate(cm, DataLoader(noise, batch_size=args.batch), top1)))
                for _ in range(args.repeat)]  # interleaved, so a burst of load hits all three alike
        single = args.batch / min(r[0] for r in runs)
        on_ready = n / min(r[1] for r in runs)
        on_noise = n / min(r[2] for r in runs)
        speeds[threads] = (single, on_ready, on_noise)
        rows.append((threads, f"{single:.1f}", f"{on_ready:.1f}", f"{on_ready / single:.2f}x",
                     f"{on_noise:.1f}", f"{on_noise / single:.2f}x"))
    print(f"{args.model} {args.image_size}x{args.image_size}, batch {args.batch}, {n} samples per evaluate, "
          f"best of {args.repeat}; torch {torch.__version__}, qcompiler {qcompiler.__version__}, "
          f"{os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print(tabulate(rows, headers=["torch threads", "single call (samples/s)", "evaluate, ready tensors (samples/s)",
                                  "evaluate / single", "evaluate, SmoothNoise computed on read (samples/s)",
                                  "evaluate / single"]))
    if 1 in speeds and 2 in speeds:
        s1, s2 = speeds[1], speeds[2]
        print(f"second core: single call {s2[0] / s1[0]:.2f}x, evaluate on ready tensors {s2[1] / s1[1]:.2f}x, "
              f"on SmoothNoise {s2[2] / s1[2]:.2f}x the 1-thread samples/s")


if __name__ == "__main__":
    main()
