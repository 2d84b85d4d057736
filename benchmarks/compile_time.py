"""Compile time side by side: our prepare + convert + lower vs torch.ao prepare_fx + convert_fx,
and the cost of each BPU<->CPU crossing on the guide's HybridModel. One run, ratios printed.

    python benchmarks/compile_time.py [--repeat 3] [--image-size 224]

Calibration is excluded on both sides (one identical forward pass each, untimed), so the
numbers compare graph work: tracing, passes, conversion and, for us, lowering BPU
partitions to programs and CPU partitions to ONNX islands.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from tabulate import tabulate

import qcompiler.zoo as zoo
from qcompiler.compiled import lower
from qcompiler.quantization import convert_fx, prepare_calibration_fx


def best_of(repeat, fn):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def ours(model, x):
    t0 = time.perf_counter()
    cal = prepare_calibration_fx(model, example_inputs=x, hybrid=True)
    t_prepare = time.perf_counter() - t0
    cal.eval()
    with torch.no_grad():
        cal(*x)  # calibration (untimed)
    t1 = time.perf_counter()
    q = convert_fx(cal)
    t_convert = time.perf_counter() - t1
    t2 = time.perf_counter()
    lower(q)
    t_lower = time.perf_counter() - t2
    return t_prepare, t_convert, t_lower


def peer(model, x):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert
    from torch.ao.quantization.quantize_fx import prepare_fx

    t0 = time.perf_counter()
    prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), x)
    t_prepare = time.perf_counter() - t0
    with torch.no_grad():
        prepared(*x)
    t1 = time.perf_counter()
    ao_convert(prepared)
    return t_prepare, time.perf_counter() - t1


def crossing_overhead(repeat: int):
    """Time of the HybridModel compiled as is (5 crossings) vs all on the BPU (bernoulli2 runs PReLU;
    selu stays CPU), per crossing, at a small input so the op work is small."""
    import qcompiler

    x = (torch.rand(1, 3, 16, 16),)
    rows = []
    for march in ("bayes", "bernoulli2"):
        cm = qcompiler.compile(zoo.get("hybrid"), x, march=march, progress=False)
        for _ in range(3):
            cm(*x)
        t = best_of(repeat, lambda: [cm(*x) for _ in range(20)]) / 20
        rows.append((march, cm.boundary_edges(), t))
    (m1, e1, t1), (m2, e2, t2) = rows
    per = (t1 - t2) / (e1 - e2) if e1 != e2 else float("nan")
    return rows, per


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=224)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    rows = []
    for name in ("resnet18", "mobilenet_v2"):
        x = zoo.example_inputs(name, image_size=args.image_size)
        o = min((ours(zoo.get(name), x) for _ in range(args.repeat)), key=sum)
        p = min((peer(zoo.get(name), x) for _ in range(args.repeat)), key=sum)
        rows.append((name, f"{o[0]:.3f} + {o[1]:.3f} + {o[2]:.3f} = {sum(o):.3f}",
                     f"{p[0]:.3f} + {p[1]:.3f} = {sum(p):.3f}", f"{sum(o) / sum(p):.2f}x",
                     f"{(o[0] + o[1]) / sum(p):.2f}x"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeat}, "
          f"{args.image_size}x{args.image_size}")
    print(tabulate(rows, headers=["model", "ours: prepare + convert + lower (s)", "torch.ao: prepare_fx + convert_fx (s)",
                                  "ours / torch.ao", "ours without lower / torch.ao"]))
    cross, per = crossing_overhead(args.repeat)
    print()
    print(tabulate([(m, e, f"{t * 1e3:.2f}") for m, e, t in cross],
                   headers=["HybridModel 1x3x16x16 on", "BPU<->CPU crossings", "time per call (ms)"]))
    print(f"onnxruntime island overhead: about {per * 1e3:.2f} ms per extra BPU<->CPU crossing")


if __name__ == "__main__":
    main()
