"""The native row split (``QCOMPILER_NATIVE_THREADS``) off and on, alternating call by call in one process.

    python benchmarks/native_row_split.py [--models resnet18,mobilenet_v2,unet] [--repeat 20]

Only the simulator runs (no peer in the rotation whose spinning threads would take the second
core): for each model, threads 2 / batch 1 (the split's case), threads 1 / batch 1 and threads 2 /
batch 8 (where it must change nothing), best of ``--repeat`` calls each way, every output
``torch.equal`` to the first.  See docs/performance.md, "Batch 1 at 2 threads: the native row split".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import qcompiler.zoo as zoo  # noqa: E402
from benchmarks.simulator import calibration_batches, converted_model  # noqa: E402
from qcompiler.backends.bpu.lower import lower_bpu_partitions  # noqa: E402
from qcompiler.backends.bpu.native.gemm import ENV_THREADS  # noqa: E402
from qcompiler.runtime import Runtime  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,mobilenet_v2,unet")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    calib = calibration_batches(args.size)
    for name in args.models.split(","):
        torch.set_num_threads(2)
        q = converted_model(name, args.size, calib)
        ours = Runtime.simulated(q, lower_bpu_partitions(q))
        for t, b in [(2, 1), (1, 1), (2, 8)]:
            torch.set_num_threads(t)
            ours.threads = t
            x = zoo.example_inputs(name, batch=b, image_size=args.size)[0]
            best = {"off": float("inf"), "on": float("inf")}
            with torch.no_grad():
                ref = ours(x)
                for _ in range(args.repeat):
                    for mode in best:
                        if mode == "off":
                            os.environ[ENV_THREADS] = "1"
                        else:
                            os.environ.pop(ENV_THREADS, None)
                        t0 = time.perf_counter()
                        y = ours(x)
                        best[mode] = min(best[mode], time.perf_counter() - t0)
                        if not torch.equal(y, ref):
                            raise SystemExit(f"{name}: the output changed with the split {mode}")
            print(f"{name}  threads {t}  batch {b}:  off {best['off'] * 1e3:.2f} ms  on {best['on'] * 1e3:.2f} ms  "
                  f"on / off {best['on'] / best['off']:.3f}", flush=True)
        os.environ.pop(ENV_THREADS, None)


if __name__ == "__main__":
    main()
