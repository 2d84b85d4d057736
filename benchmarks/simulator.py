"""BPU simulator speed vs the int8 runtimes a user would otherwise evaluate with, in one run.

    python benchmarks/simulator.py [--models resnet18,mobilenet_v2,unet] [--batches 1,8] [--march bayes]
                                   [--threads 1,2] [--size 224] [--repeat 10] [--no-profile]
                                   [--kernels fast|fixed_point] [--row-split]

For each zoo model, the same float weights are quantized three ways on the same
calibration batches (smooth-noise images, ``benchmarks/_data.py``), and timed on the
same input (``zoo.example_inputs``):

* ``ours``     the qcompiler simulator: ``Runtime.simulated`` (every BPU partition in
  the bit-exact fast simulator, every CPU partition in torch).  Its output must be
  ``torch.equal`` to the converted model's (the ``exact`` column; a mismatch stops the run).
  At N > 1 threads it runs as a user's compiled model does (``threads=N``): a batch of B is
  split into ``min(N, B)`` chunks on worker threads at one torch thread each (the ``split``
  column, ``N x B/N``); a batch of one runs in the calling thread, its native plans cutting
  each large layer's output rows over torch's OpenMP team (``rows/N``; with ``--row-split``
  (``row_split.ENABLED``, off by default) the op-by-op bands over idle workers instead,
  ``1 x rows/N``); ``ours whole`` is the same batch unsplit, its plans on one thread, at N
  torch threads, for comparison;
* ``ort``      onnxruntime int8: the float model exported to ONNX (``benchmarks/_float_onnx.py``), then
  ``onnxruntime.quantization.quantize_static`` (QDQ, uint8 activations, int8 per-channel
  weights, MinMax calibration on the same batches), ``intra_op_num_threads`` = the thread
  count, all graph optimizations;
* ``torch.ao`` torch.ao FX int8: ``prepare_fx`` with the ``x86`` default qconfig mapping,
  the same calibration, ``convert_fx`` (the ``x86`` quantized engine);
* ``float``    the float model in eager torch.

Each peer has its own accuracy (onnxruntime's and torch.ao's quantization differ from
ours); the point is speed on the same work.  ``torch.set_num_threads`` and onnxruntime's
``intra_op_num_threads`` are set to the same count.  Times are the best of ``--repeat``
calls after a warm-up, the four contenders in rotation, so a change of machine load hits
all of them alike; each timed call follows one untimed call of the same contender (``--lead-in``,
default 1), so it meets the machine as that contender's own previous call left it, as in a loop
over a validation set, not with the previous contender's pool threads still spinning; the ratio ``ours / min(ort, torch.ao)`` is what the goal is measured on
(<= 1.0).  With profiling on, the simulator's time per op kind (each op timed alone with
``perf_counter``) is printed for every model and batch at the first thread count.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler.zoo as zoo  # noqa: E402
from benchmarks import vit  # noqa: E402
from benchmarks._data import SmoothNoise, stack  # noqa: E402
from benchmarks._float_onnx import export_float_onnx  # noqa: E402
from qcompiler.backends.bpu.lower import lower_bpu_partitions  # noqa: E402
from qcompiler.backends.bpu.native.kernels import amx_enabled  # noqa: E402
from qcompiler.backends.bpu.sim import row_split  # noqa: E402
from qcompiler.backends.bpu.sim.gemm import int8_gemm_available  # noqa: E402
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state  # noqa: E402
from qcompiler.quantization.convert import convert_fx  # noqa: E402
from qcompiler.runtime import Runtime  # noqa: E402


def _whole(runner: Runtime, x: torch.Tensor):
    """The runner on the whole batch with torch's intra-op threads (no batch split).

    Timed after the rotation, not in it: alternating 2-thread calls in the main thread with
    1-thread calls in a worker made the worker's calls slower (measured: mobilenet_v2 batch 1,
    30 ms instead of 21, with no spinning thread in the process: the process's CPU time equals
    the wall time), as if oneDNN re-created its convolution primitives at each switch of the
    thread count."""
    saved, runner.threads = runner.threads, 1
    try:
        return runner(x)
    finally:
        runner.threads = saved

CALIB_BATCHES, CALIB_BATCH = 4, 4


def calibration_batches(size: int) -> list[torch.Tensor]:
    ds = SmoothNoise(CALIB_BATCHES * CALIB_BATCH, size=size, seed=7)
    return [stack(ds, i * CALIB_BATCH, (i + 1) * CALIB_BATCH) for i in range(CALIB_BATCHES)]


# models beside the zoo's: name -> (builder, example_inputs(batch=, image_size=))
EXTRA_MODELS = {"vit_b16": (vit.vit_b16, vit.example_inputs)}


def float_model(name: str) -> torch.nn.Module:
    return EXTRA_MODELS[name][0]() if name in EXTRA_MODELS else zoo.get(name).eval()


def model_inputs(name: str, batch: int = 1, image_size: int = 224) -> tuple:
    if name in EXTRA_MODELS:
        return EXTRA_MODELS[name][1](batch=batch, image_size=image_size)
    return zoo.example_inputs(name, batch=batch, image_size=image_size)


def converted_model(name: str, size: int, calib: list[torch.Tensor], march: str = "bayes"):
    cal = prepare_calibration_fx(float_model(name), None, example_inputs=model_inputs(name, image_size=size),
                                 hybrid=True, march=march)
    cal.eval()
    with torch.no_grad():
        for x in calib:
            cal(x)
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return convert_fx(qat)


def torch_ao_model(model: torch.nn.Module, x: torch.Tensor, calib: list[torch.Tensor]):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert
    from torch.ao.quantization.quantize_fx import prepare_fx

    torch.backends.quantized.engine = "x86"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model).eval(), get_default_qconfig_mapping("x86"), (x,))
        with torch.no_grad():
            for b in calib:
                prepared(b)
        return ao_convert(prepared)


class _Reader:
    """onnxruntime's CalibrationDataReader over the calibration batches."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self._it = iter([{"x": b.numpy()} for b in batches])

    def get_next(self):
        return next(self._it, None)


def ort_int8_model(model: torch.nn.Module, x: torch.Tensor, calib: list[torch.Tensor], folder: str):
    """Path of the QDQ u8s8 per-channel statically quantized ONNX model."""
    import onnxruntime.quantization as oq

    fp32 = os.path.join(folder, "float.onnx")
    pre = os.path.join(folder, "float_pre.onnx")
    q8 = os.path.join(folder, "int8.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_float_onnx(copy.deepcopy(model).eval(), x, fp32, batch_axis="n")
        oq.quant_pre_process(fp32, pre, skip_symbolic_shape=True)
        oq.quantize_static(pre, q8, _Reader(calib), quant_format=oq.QuantFormat.QDQ,
                           activation_type=oq.QuantType.QUInt8, weight_type=oq.QuantType.QInt8,
                           per_channel=True, calibrate_method=oq.CalibrationMethod.MinMax)
    return q8


def ort_session(path: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return lambda xn: sess.run(None, {"x": xn})[0]


def best_times(fns: dict, repeat: int, lead_in: int = 0) -> dict:
    """Best-of-``repeat`` seconds of each callable, run in rotation (one warm-up each first).

    ``lead_in`` > 0: each timed call follows that many untimed calls of the same callable, so it
    meets the machine as the contender's own previous call left it (its thread pool, its caches),
    as in a loop over a validation set, not as the previous contender left it (onnxruntime's and
    torch's pool threads keep spinning on the other core for a while after a call)."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            for _ in range(lead_in):
                fn()
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def op_kind(op) -> str:
    a = op.attrs
    kind = op.kind
    if kind == "conv2d":
        w = op.tensors["weight"]
        if int(a.get("groups", 1)) > 1:
            kind += "(dw)" if w.shape[1] == 1 else "(grouped)"
        else:
            kind += f"({w.shape[2]}x{w.shape[3]})"
    return kind + ("+add" if a.get("with_add") else "")


def op_kind_profile(runner: Runtime, x: torch.Tensor, repeat: int = 3) -> dict[str, float]:
    """Seconds per BPU op kind (best total of ``repeat`` runs): each op's time as the simulator
    records it (``BpuSimulator.step_times``: a plan's native steps timed in C, one by one); '(outside
    ops)' is the rest of the run (CPU nodes, boundary conversion, dispatch)."""
    best: dict[str, float] = {}
    kinds = {op.output: op_kind(op) for sim in runner.simulators.values() for op in sim.program.ops}
    try:
        for _ in range(repeat):
            times: dict[str, float] = {}
            for sim in runner.simulators.values():
                sim.step_times = times
            t0 = time.perf_counter()
            runner(x)
            total = time.perf_counter() - t0
            totals: dict[str, float] = defaultdict(float)
            for name, t in times.items():
                totals[kinds[name]] += t
            totals["(outside ops)"] = total - sum(totals.values())
            totals["(total)"] = total
            if not best or total < best["(total)"]:
                best = dict(totals)
    finally:
        for sim in runner.simulators.values():
            sim.step_times = None
    return best


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "?"
    except OSError:
        return "?"


def environment() -> str:
    import onnxruntime

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {_commit()}, "
            f"{cpu} ({os.cpu_count()} cpus, {torch.backends.cpu.get_cpu_capability()}), "
            f"python {platform.python_version()}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
            f"numpy {np.__version__}; exact int8 GEMM: {int8_gemm_available()}, on AMX tiles: {amx_enabled()}; "
            f"load average at start {load:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,mobilenet_v2,unet",
                    help="zoo models, or vit_b16 (benchmarks/vit.py; with --march nash)")
    ap.add_argument("--march", default="bayes", choices=("bayes", "bernoulli2", "nash"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kernels", default="fast", choices=("fast", "fixed_point"))
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--lead-in", type=int, default=1,
                    help="untimed calls of the same contender right before each timed call (see best_times)")
    ap.add_argument("--row-split", action="store_true",
                    help="cut one image's large convs into row bands on idle workers (row_split.ENABLED)")
    args = ap.parse_args()
    row_split.ENABLED = args.row_split  # read by each conv layer built below
    # torch.ao's quantized cat warns at every call that its inputs' scales differ (unet)
    warnings.filterwarnings("ignore", message="All inputs of this cat operator")
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    print(environment())
    print(f"input {args.size}x{args.size}, threads {threads}, best of {args.repeat} in rotation "
          f"(each after {args.lead_in} untimed call(s) of the same contender), "
          f"calibration {CALIB_BATCHES} batches of {CALIB_BATCH}")
    rows, profiles = [], {}
    calib = calibration_batches(args.size)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            torch.set_num_threads(max(threads))
            q = converted_model(name, args.size, calib, args.march)
            programs = lower_bpu_partitions(q)
            ours = Runtime.simulated(q, programs, kernels=args.kernels)
            f = float_model(name)
            x1 = model_inputs(name, image_size=args.size)[0]
            ao = torch_ao_model(f, x1, calib)
            os.makedirs(os.path.join(folder, name))
            onnx_path = ort_int8_model(f, x1, calib, os.path.join(folder, name))
            print(f"{name}: prepared in {time.perf_counter() - t0:.1f}s; BPU programs: "
                  + ", ".join(f"{k} ({len(p.ops)} ops)" for k, p in programs.items()))
            for t in threads:
                torch.set_num_threads(t)
                ours.threads = t
                ort_run = ort_session(onnx_path, t)
                for b in batches:
                    x = model_inputs(name, batch=b, image_size=args.size)[0]
                    xn = x.numpy()
                    with torch.no_grad():
                        exact = torch.equal(ours(x), q(x))
                        if not exact:
                            raise SystemExit(f"{name} batch {b}: simulator output != converted model output")
                        tm = best_times({"ours": partial(ours, x), "ort": partial(ort_run, xn),
                                         "ao": partial(ao, x), "float": partial(f, x)}, args.repeat, args.lead_in)
                        if t > 1:  # after, not in the rotation: see _whole
                            tm.update(best_times({"whole": partial(_whole, ours, x)}, args.repeat, args.lead_in))
                        if not args.no_profile and t == threads[0]:
                            profiles[(name, b)] = op_kind_profile(ours, x)
                    peer = min(tm["ort"], tm["ao"])
                    n = min(t, b)
                    split = "-" if t == 1 or ours.split_refusal is not None else \
                        (f"{n} x {b // n}" if b % n == 0 else f"{n} chunks") if n > 1 else \
                        (f"1 x rows/{t}" if row_split.ENABLED else f"rows/{t}")
                    whole = f"{tm['whole'] * 1e3:.1f}" if "whole" in tm else "-"
                    rows.append([name, b, t, split, f"{tm['ours'] * 1e3:.1f}", whole, f"{tm['ort'] * 1e3:.1f}",
                                 f"{tm['ao'] * 1e3:.1f}", f"{tm['float'] * 1e3:.1f}", f"{tm['ours'] / peer:.2f}",
                                 f"{tm['ours'] / tm['float']:.2f}", "yes" if exact else "NO"])
                    print("  " + "  ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(tabulate(rows, headers=["model", "batch", "threads", "split", "ours ms", "ours whole ms", "ort int8 ms",
                                  "torch.ao int8 ms",
                                  "float ms", "ours / faster int8", "ours / float", "exact"],
                   tablefmt="github"))
    for (name, b), kinds in profiles.items():
        total = kinds.pop("(total)")
        print(f"\n{name} batch {b}, {threads[0]} thread(s): simulator time per op kind (run total {total * 1e3:.1f} ms)")
        print(tabulate(sorted(([k, f"{v * 1e3:.1f}", f"{v / total:.0%}"] for k, v in kinds.items()),
                              key=lambda r: -float(r[1])), headers=["op kind", "ms", "share"], tablefmt="github"))


if __name__ == "__main__":
    main()
