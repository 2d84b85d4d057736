"""The simulator's plans (one C call per run of native layers) against op-by-op calls, and the split threshold.

    python benchmarks/native_plan.py [--models resnet18,mobilenet_v2,unet] [--batches 1,8] [--threads 1,2]
                                     [--min-work 0,16384,131072,1048576] [--repeat 20]

For each zoo model at 224x224 (converted as in benchmarks/simulator.py), a ``Runtime.simulated`` built
with ``QCOMPILER_NATIVE_PLAN=0`` (every layer a Python call and a ctypes call, ``op by op``) and one
with plans (``planned``), timed in rotation, best of ``--repeat`` after a lead-in call, outputs
``torch.equal``.  At 2 threads the planned runner is also timed at each ``--min-work`` (the
multiply-adds from which a step's rows are cut over torch's OpenMP team; ``MIN_WORK`` in
backends/bpu/native/plan.py is the default).  Ratios are planned / op by op (below 1: plans faster).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from tabulate import tabulate

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler.backends.bpu.native.plan as plan_mod  # noqa: E402
import qcompiler.zoo as zoo  # noqa: E402
from benchmarks.simulator import best_times, calibration_batches, converted_model, environment  # noqa: E402
from qcompiler.backends.bpu.native.plan import ENV_PLAN  # noqa: E402
from qcompiler.runtime import Runtime  # noqa: E402


def _runner(conv, threads: int, planned: bool) -> Runtime:
    saved = os.environ.get(ENV_PLAN)
    os.environ[ENV_PLAN] = "1" if planned else "0"
    try:
        return Runtime.simulated(conv, kernels="fast", threads=threads)
    finally:
        if saved is None:
            del os.environ[ENV_PLAN]
        else:
            os.environ[ENV_PLAN] = saved


def _with_min_work(runner: Runtime, x: torch.Tensor, min_work: int):
    def call():
        saved = plan_mod.MIN_WORK
        plan_mod.MIN_WORK = min_work
        try:
            return runner(x)
        finally:
            plan_mod.MIN_WORK = saved
    return call


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18,mobilenet_v2,unet")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--min-work", default="0,16384,131072,1048576")
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args(argv)
    print(environment())
    calib = calibration_batches(224)
    rows = []
    for name in a.models.split(","):
        conv = converted_model(name, 224, calib)
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            flat, planned = _runner(conv, threads, False), _runner(conv, threads, True)
            for batch in (int(b) for b in a.batches.split(",")):
                x = zoo.example_inputs(name, image_size=224)[0].repeat(batch, 1, 1, 1)
                with torch.no_grad():
                    want = conv(x)
                fns = {"op by op": lambda: flat(x), "planned": lambda: planned(x)}
                works = [int(w) for w in a.min_work.split(",")] if threads > 1 else []
                for w in works:
                    fns[f"min_work {w}"] = _with_min_work(planned, x, w)
                if not all(torch.equal(f(), want) for f in fns.values()):
                    raise SystemExit(f"{name} batch {batch}: a runner differs from the converted model")
                t = best_times(fns, a.repeat, lead_in=1)
                row = [name, batch, threads, f"{t['op by op'] * 1e3:.2f}", f"{t['planned'] * 1e3:.2f}",
                       f"{t['planned'] / t['op by op']:.2f}"]
                row.append(", ".join(f"{w}: {t[f'min_work {w}'] * 1e3:.2f}" for w in works) or "-")
                rows.append(row)
                print(tabulate([row], tablefmt="plain"), flush=True)
    print(tabulate(rows, headers=["model", "batch", "threads", "op by op ms", "planned ms", "planned / op by op",
                                  "planned ms by min_work"], tablefmt="github"))


if __name__ == "__main__":
    main()
