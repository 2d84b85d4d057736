"""BPU simulator speed vs float eager torch on the same inputs.

    python benchmarks/simulator.py [--models resnet18,mobilenet_v2] [--batches 1,8] [--size 224]
                                   [--repeat 10] [--threads N] [--no-profile]

For each zoo model: calibrate + QAT-prepare + ``convert_fx`` (on 224x224
inputs by default), lower every BPU partition, and time on the same input:

* ``float``      the float zoo model, eager torch (``torch.no_grad``);
* ``converted``  the converted fixed-point model (``qcompiler.nn.quantized``), eager;
* ``sim fast``   ``PartitionedRunner`` (all BPU partitions in the simulator with the
  fast exact kernels + the CPU nodes in torch); int8 x int8 -> int32 GEMMs where
  ``int8_gemm_available()`` (printed);
* ``sim f32``    the fast kernels with float32 GEMMs only (``int8_gemm=False``: what a
  machine without exact int8 GEMMs gets);
* ``sim fp``     ``kernels="fixed_point"`` (the fixed_point functions exactly as the
  converted modules call them).

Times are the best of ``--repeat`` runs after one warm-up (``time.perf_counter``), the
contenders run in rotation (the slow ``converted`` / ``sim fp`` get a third of the repeats);
the torch thread count is fixed and printed.  Every simulator output is
checked equal (``torch.equal``) to the converted model's.  With profiling on,
the fast simulator's time per op kind and the top aten kernels are printed for
the largest batch.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from functools import partial

import torch
from tabulate import tabulate

import qcompiler.zoo as zoo
from qcompiler.backends.bpu.lower import lower_bpu_partitions
from qcompiler.backends.bpu.simulator import PartitionedRunner, int8_gemm_available
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.quantization.convert import convert_fx


def converted_model(name: str, size: int, march: str = "bayes"):
    kw = dict(image_size=size)
    cal = prepare_calibration_fx(zoo.get(name), None, example_inputs=zoo.example_inputs(name, **kw),
                                 hybrid=True, march=march)
    cal.eval()
    with torch.no_grad():
        for b in range(2):
            cal(zoo.example_inputs(name, batch=2, **kw)[0] + 0.1 * b)
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return convert_fx(qat)


def best_times(fns: dict, repeat: int) -> dict:
    """Best-of-``repeat`` seconds of each callable, run in rotation (one warm-up each first).

    Rotating rather than timing one contender after the other keeps a change
    of machine load from favouring whichever ran in the quiet phase.
    """
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _timed(fn, kind: str, totals: dict):
    def timed(*args):
        t0 = time.perf_counter()
        r = fn(*args)
        totals[kind] += time.perf_counter() - t0
        return r
    return timed


def op_kind_profile(runner: PartitionedRunner, x: torch.Tensor) -> dict[str, float]:
    """Seconds per BPU op kind over one run (each op timed with perf_counter)."""
    totals: dict[str, float] = defaultdict(float)
    originals = {}
    for sim in runner.simulators.values():
        steps = []
        originals[sim] = sim._steps
        for (fn, ins, out, free), op in zip(sim._steps, sim.program.ops):
            kind = op.kind + ("+add" if op.attrs.get("with_add") else "") + (
                "(dw)" if op.kind == "conv2d" and op.attrs.get("groups", 1) > 1 else "")
            steps.append((_timed(fn, kind, totals), ins, out, free))
        sim._steps = steps
    try:
        t0 = time.perf_counter()
        runner(x)
        totals["(total)"] = time.perf_counter() - t0
    finally:
        for sim, steps in originals.items():
            sim._steps = steps
    return dict(totals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, input {args.size}x{args.size}, "
          f"best of {args.repeat}, exact int8 GEMM available: {int8_gemm_available()}")
    rows, profiles = [], {}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        q = converted_model(name, args.size)
        programs = lower_bpu_partitions(q)
        fast = PartitionedRunner(q, programs, kernels="fast")
        f32 = PartitionedRunner(q, programs, kernels="fast", int8_gemm=False)
        slow = PartitionedRunner(q, programs, kernels="fixed_point")
        print(f"{name}: converted + lowered in {time.perf_counter() - t0:.1f}s; BPU programs: "
              + ", ".join(f"{k} ({len(p.ops)} ops)" for k, p in programs.items()))
        f = zoo.get(name).eval()
        batches = [int(b) for b in args.batches.split(",")]
        for b in batches:
            x = zoo.example_inputs(name, batch=b, image_size=args.size)[0]
            with torch.no_grad():
                ref = q(x)
                for runner, label in ((fast, "fast"), (f32, "fast/f32"), (slow, "fixed_point")):
                    if not torch.equal(runner(x), ref):
                        raise SystemExit(f"{name} b{b}: simulator ({label}) output != converted model output")
                t = best_times({"float": partial(f, x), "fast": partial(fast, x), "f32": partial(f32, x)},
                               args.repeat)
                t.update(best_times({"conv": partial(q, x), "fp": partial(slow, x)}, max(2, args.repeat // 3)))
                t_float, t_conv, t_fast, t_f32, t_fp = t["float"], t["conv"], t["fast"], t["f32"], t["fp"]
            rows.append([name, b, f"{t_float * 1e3:.1f}", f"{t_conv * 1e3:.1f}", f"{t_fast * 1e3:.1f}",
                         f"{t_f32 * 1e3:.1f}", f"{t_fp * 1e3:.1f}", f"{t_fast / t_float:.2f}",
                         f"{t_f32 / t_float:.2f}", f"{t_fp / t_float:.2f}", f"{t_conv / t_float:.2f}"])
            if not args.no_profile and b == max(batches):
                with torch.no_grad():
                    kinds = op_kind_profile(fast, x)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        fast(x)
                profiles[(name, b)] = (kinds, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print()
    print(tabulate(rows, headers=["model", "batch", "float ms", "converted ms", "sim fast ms", "sim f32 ms",
                                  "sim fp ms", "fast/float", "f32/float", "fp/float", "converted/float"],
                   tablefmt="github"))
    for (name, b), (kinds, table) in profiles.items():
        total = kinds.pop("(total)")
        print(f"\n{name} batch {b}: fast simulator time per BPU op kind (run total {total * 1e3:.1f} ms)")
        print(tabulate(sorted(([k, f"{v * 1e3:.1f}", f"{v / total:.0%}"] for k, v in kinds.items()),
                              key=lambda r: -float(r[1])), headers=["op kind", "ms", "share"], tablefmt="github"))
        print(f"\n{name} batch {b}: top aten kernels (torch.profiler, fast simulator)")
        print(table)


if __name__ == "__main__":
    main()
