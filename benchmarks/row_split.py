"""When does cutting one image's convolution into row bands pay?  (backends/bpu/sim/row_split.py)

    PYTHONPATH=$PWD python benchmarks/row_split.py [--repeat 20] [--workers 2]

For conv2d layers shaped like those of resnet18 / mobilenet_v2 / unet at 224x224 (and smaller
ones), batch 1: the fast simulator kernel computed whole on one worker vs cut into row bands
over ``--workers`` workers (the path a compiled model takes at batch 1 with 2 threads), each
the best of ``--repeat`` calls, same inputs, outputs checked equal.  The ratio against the
work per layer (``RowSplitConv.work``: multiply-adds plus ``OUTPUT_COST`` per output element) is
what ``row_split.MIN_WORK`` is set from (docs/performance.md).
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

from qcompiler import parallel
from qcompiler.backends.bpu.sim import row_split
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.bpu.sim.row_split import RowSplitConv

# (name, C, O, H=W, k, stride, groups)
LAYERS = [
    ("stem 7x7/2", 3, 64, 224, 7, 2, 1),
    ("3x3 64@56", 64, 64, 56, 3, 1, 1),
    ("3x3 128@28", 128, 128, 28, 3, 1, 1),
    ("3x3 256@14", 256, 256, 14, 3, 1, 1),
    ("3x3 512@7", 512, 512, 7, 3, 1, 1),
    ("1x1 64->128@28", 64, 128, 28, 1, 1, 1),
    ("1x1 32->16@112", 32, 16, 112, 1, 1, 1),
    ("1x1 96->24@56", 96, 24, 56, 1, 1, 1),
    ("1x1 16->96@112", 16, 96, 112, 1, 1, 1),
    ("1x1 160->960@7", 160, 960, 7, 1, 1, 1),
    ("1x1 24->144@56", 24, 144, 56, 1, 1, 1),
    ("dw 3x3 32@112", 32, 32, 112, 3, 1, 32),
    ("dw 3x3 144@56", 144, 144, 56, 3, 1, 144),
    ("dw 3x3 576@14", 576, 576, 14, 3, 1, 576),
    ("dw 3x3 960@7", 960, 960, 7, 3, 1, 960),
    ("3x3 16@224", 16, 16, 224, 3, 1, 1),
    ("3x3 32@112", 32, 32, 112, 3, 1, 1),
    ("3x3 8@32", 8, 8, 32, 3, 1, 1),
    ("3x3 16@16", 16, 16, 16, 3, 1, 1),
]


def conv_program(C: int, O: int, k: int, stride: int, groups: int) -> BpuProgram:
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-40, 41, (O, C // groups, k, k), generator=g, dtype=torch.int8)
    op = BpuOp("conv2d", ["x"], "y", {"stride": [stride, stride], "padding": [k // 2, k // 2], "dilation": [1, 1],
                                      "groups": groups, "high_precision": False, "act": "relu", "with_add": False,
                                      "in_scale": 0.05, "out_dtype": "qint8", "out_scale": 0.1, "out_axis": None},
               {"weight": w, "bias": torch.randint(-500, 500, (O,), generator=g, dtype=torch.int32),
                "M": torch.full((O,), 1 << 20, dtype=torch.int64), "n": torch.full((O,), 30, dtype=torch.int64)})
    return BpuProgram("bench", [ValueSpec("x", "qint8", 0.05)], [ValueSpec("y", "qint8", 0.1)], [op])


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for name, C, O, H, k, stride, groups in LAYERS:
        sim = BpuSimulator(conv_program(C, O, k, stride, groups))
        layer = next(fn for fn, *_ in sim._steps if isinstance(fn, RowSplitConv))
        x = torch.randint(-128, 128, (1, C, H, H), dtype=torch.int8).contiguous(memory_format=torch.channels_last)
        macs = layer.work(x.shape) - layer.O * layer.out_rows(H) * layer.out_cols(H) * row_split.OUTPUT_COST
        layer.min_work = 1 << 62
        whole = best(lambda: parallel.run_split(layer, (x,), args.workers), args.repeat)
        want = parallel.run_split(layer, (x,), args.workers)
        layer.enabled, layer.min_work = True, 0
        split = best(lambda: parallel.run_split(layer, (x,), args.workers), args.repeat)
        assert torch.equal(parallel.run_split(layer, (x,), args.workers), want)
        rows.append([name, f"{macs / 1e6:.1f}", f"{layer.work(x.shape) / 1e6:.1f}", f"{whole * 1e3:.3f}", f"{split * 1e3:.3f}", f"{split / whole:.2f}"])
    print(f"batch 1, {args.workers} workers, best of {args.repeat}; torch {torch.__version__}")
    print(tabulate(rows, headers=["layer", "MMACs", "M work", "whole ms", "bands ms", "bands / whole"], tablefmt="github"))


if __name__ == "__main__":
    main()
