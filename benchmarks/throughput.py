"""Throughput of a compiled model over a dataset: ``qcompiler.distributed.evaluate`` vs one call per batch.

    python benchmarks/throughput.py [--model resnet18] [--image-size 224] [--batch 32] [--batches 4] [--repeat 3]

* single call: ``cm(x)`` on one ready batch of ``--batch`` images (best of ``--repeat``, interleaved with the rest):
  the speed a user gets calling the model directly, per sample;
* evaluate: ``evaluate(cm, DataLoader(dataset, batch_size=--batch), metric)`` over
  ``--batches`` batches, with its progress bar (tqdm), on a dataset of ready tensors
  (``TensorDataset``) and on ``SmoothNoise``, which computes each image when it is read
  (the reader thread overlaps that with the model);
* per thread count N (``--threads``): ``cm.threads = N`` and ``torch.set_num_threads(N)``, so
  at N > 1 each batch is split over N worker threads at one torch thread each
  (``qcompiler.parallel``); and, for comparison, the whole batch at N torch threads
  (``cm.threads = 1``: what evaluate did before the split).

Ratios ``evaluate / single call`` are samples/s over samples/s (the goal: >= 0.9 at batch 32);
the last lines compare each configuration with 1 thread (the goal: the second core makes it faster).
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
    configs = []  # (label, torch threads, cm.threads)
    for t in (int(t) for t in args.threads.split(",")):
        configs.append((f"{t} thread{'s' if t > 1 else ''}" + (": batch split" if t > 1 else ""), t, t))
        if t > 1:
            configs.append((f"{t} torch threads, whole batch", t, 1))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows, speeds = [], {}
    for label, torch_threads, split_threads in configs:
        torch.set_num_threads(torch_threads)
        cm.threads = split_threads
        cm(batch)  # warm-up
        runs = [(best(1, lambda: cm(batch)), best(1, lambda: evaluate(cm, DataLoader(ready, batch_size=args.batch), top1)),
                 best(1, lambda: evaluate(cm, DataLoader(noise, batch_size=args.batch), top1)))
                for _ in range(args.repeat)]  # interleaved, so a burst of load hits all three alike
        single = args.batch / min(r[0] for r in runs)
        on_ready = n / min(r[1] for r in runs)
        on_noise = n / min(r[2] for r in runs)
        speeds[label] = (single, on_ready, on_noise)
        rows.append((label, f"{single:.1f}", f"{on_ready:.1f}", f"{on_ready / single:.2f}x",
                     f"{on_noise:.1f}", f"{on_noise / single:.2f}x"))
    print(f"{args.model} {args.image_size}x{args.image_size}, batch {args.batch}, {n} samples per evaluate, "
          f"best of {args.repeat}; torch {torch.__version__}, qcompiler {qcompiler.__version__}, "
          f"{os.cpu_count()} cores, Python {sys.version.split()[0]}; batch split: "
          f"{'yes' if cm.split_refusal is None else 'no (' + cm.split_refusal + ')'}; load average at start {load:.2f}")
    print(tabulate(rows, headers=["threads", "single call (samples/s)", "evaluate, ready tensors (samples/s)",
                                  "evaluate / single", "evaluate, SmoothNoise computed on read (samples/s)",
                                  "evaluate / single"]))
    base = speeds.get(configs[0][0]) if configs and configs[0][1] == 1 else None
    for label, (single, on_ready, on_noise) in speeds.items():
        if base is not None and label != configs[0][0]:
            print(f"{label} vs 1 thread: single call {single / base[0]:.2f}x, evaluate on ready tensors "
                  f"{on_ready / base[1]:.2f}x, on SmoothNoise {on_noise / base[2]:.2f}x the samples/s")


if __name__ == "__main__":
    main()
