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
    """Per-step times of the guide's HybridModel (guide hybrid_dict, bayes) at 1x3x16x16, where the
    ops themselves cost little: a CPU island's time is mostly onnxruntime's per-call overhead.
    The same islands' FX nodes run in torch eager for comparison."""
    import qcompiler
    from qcompiler.zoo.hybrid import _SeluModule

    x = (torch.rand(1, 3, 16, 16),)
    cm = qcompiler.compile(zoo.get("hybrid"), x, march="bayes", progress=False,
                           hybrid_dict={"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]})
    spent = {s.name: 0.0 for s in cm.runtime.steps}
    calls = 50

    def timed(name, fn):
        def run(feeds):
            t = time.perf_counter()
            out = fn(feeds)
            spent[name] += time.perf_counter() - t
            return out
        return run

    cm.runtime._run = {k: timed(k, f) for k, f in cm.runtime._run.items()}
    for _ in range(5):
        cm(*x)
    for k in spent:
        spent[k] = 0.0
    t0 = time.perf_counter()
    for _ in range(calls):
        cm(*x)
    total = (time.perf_counter() - t0) / calls
    rows = [(s.name, s.kind, len(s.nodes), spent[s.name] / calls * 1e3) for s in cm.runtime.steps]
    cpu_time = sum(r[3] for r in rows if r[1] == "cpu") / 1e3
    # the same CPU nodes in torch eager (converted graph, float CPU ops)
    gm = cm.converted
    cpu_nodes = {n for s in cm.runtime.steps if s.kind == "cpu" for n in s.nodes}
    eager = 0.0

    class Timer(torch.fx.Interpreter):
        def run_node(self, n):
            nonlocal eager
            t = time.perf_counter()
            v = super().run_node(n)
            if n.name in cpu_nodes:
                eager += time.perf_counter() - t
            return v

    for _ in range(5):
        Timer(gm).run(*x)
    eager = 0.0
    for _ in range(calls):
        Timer(gm).run(*x)
    eager /= calls
    crossings = cm.boundary_edges()
    return rows, total, cpu_time, eager, crossings


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
    rows, total, cpu_time, eager, crossings = crossing_overhead(args.repeat)
    print()
    print(tabulate([(n, k, c, f"{t:.3f}") for n, k, c, t in rows],
                   headers=["HybridModel step (1x3x16x16)", "runs on", "ops", "ms per call"]))
    islands = sum(1 for r in rows if r[1] == "cpu")
    print(f"total {total * 1e3:.2f} ms per call; {islands} onnxruntime islands, {crossings} BPU<->CPU crossings")
    print(f"CPU islands: onnxruntime {cpu_time * 1e3:.3f} ms vs the same ops in torch eager {eager * 1e3:.3f} ms "
          f"({cpu_time / max(eager, 1e-9):.2f}x); onnxruntime time per crossing "
          f"{cpu_time / crossings * 1e3:.3f} ms (island work included), "
          f"{(cpu_time - eager) / crossings * 1e3:+.3f} ms against eager")

if __name__ == "__main__":
    main()
