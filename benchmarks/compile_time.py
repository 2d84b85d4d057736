"""Compile time, calibration cost and peak memory side by side with torch.ao, plus the cost of each
BPU<->CPU crossing on the guide's HybridModel. One run, ratios printed.

    python benchmarks/compile_time.py [--repeat 3] [--image-size 224] [--calib-batches 4] [--batch 4]

Both sides calibrate on the same batches (``--calib-batches`` smooth-noise images of
``--batch`` each) with their histogram observers and get the same threads:

* ours: the body of ``qcompiler.compile`` stage by stage: ``prepare_calibration_fx``
  (trace, place, fuse, stubs, partition, observers: histogram-mse activations), calibration
  (eval forward over the batches), ``convert_fx`` and ``lower`` (BPU programs, ONNX islands);
* torch.ao: ``prepare_fx`` with ``get_default_qconfig_mapping("x86")`` (HistogramObserver
  activations, per-channel min/max weights), the same calibration, ``convert_fx``;
* float: the float model's eval forward over the same batches (what calibration is compared to).

Times are best of ``--repeat`` per stage (each stage's minimum over the runs), the sides run in
turn in each round after one warm-up round. Peak memory is
each side's whole compile in a fresh subprocess: VmHWM (the peak resident set, as ``ru_maxrss``
but per process image; torch's allocations included) after importing both libraries and building the model and data, so the
two processes start from the same baseline; "compile peak" is the peak minus the RSS just
before compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from tabulate import tabulate
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare_fx

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler  # noqa: E402
import qcompiler.zoo as zoo  # noqa: E402
from benchmarks._data import SmoothNoise  # noqa: E402
from qcompiler.compiled import calibration_batches, lower  # noqa: E402
from qcompiler.quantization import convert_fx, prepare_calibration_fx  # noqa: E402

MODELS = ("resnet18", "mobilenet_v2")


def calib_data(name: str, image_size: int, batches: int, batch: int) -> list[torch.Tensor]:
    (x,) = zoo.example_inputs(name, image_size=image_size)
    images = SmoothNoise(batches * batch, size=image_size, channels=x.shape[1], seed=1)
    return [torch.stack([images[b * batch + i][0] for i in range(batch)]) for b in range(batches)]


def ours(model, x: tuple, data: list) -> dict[str, float]:
    """Stage times of compile(model, x, calib_data=data)."""
    t = {}
    t0 = time.perf_counter()
    batches = calibration_batches(data, x)
    cal = prepare_calibration_fx(model, example_inputs=x, hybrid=True)
    cal.eval()
    t1 = time.perf_counter()
    with torch.no_grad():
        for b in batches:
            cal(*b)
    t2 = time.perf_counter()
    q = convert_fx(cal, inplace=True)
    t3 = time.perf_counter()
    lower(q, example_inputs=x)
    t4 = time.perf_counter()
    t.update(prepare=t1 - t0, calibrate=t2 - t1, convert=t3 - t2, lower=t4 - t3)
    return t


def peer(model, x: tuple, data: list) -> dict[str, float]:
    """Stage times of torch.ao prepare_fx + the same calibration + convert_fx."""
    t0 = time.perf_counter()
    prepared = ao_prepare_fx(model, get_default_qconfig_mapping("x86"), x)
    t1 = time.perf_counter()
    with torch.no_grad():
        for b in data:
            prepared(b)
    t2 = time.perf_counter()
    ao_convert_fx(prepared)
    t3 = time.perf_counter()
    return dict(prepare=t1 - t0, calibrate=t2 - t1, convert=t3 - t2, lower=0.0)


def float_forward(model, data: list) -> float:
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in data:
            model(b)
    return time.perf_counter() - t0


def memory_child(side: str, name: str, image_size: int, batches: int, batch: int, threads: int) -> None:
    """In a fresh process: compile once (after a small warm-up of both sides' code paths), print peak RSS JSON."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    x = zoo.example_inputs(name, image_size=image_size)
    data = calib_data(name, image_size, batches, batch)
    model = zoo.get(name).eval()
    rss_before = _current_rss()
    peak_before = _peak_rss()
    if side == "ours":
        qcompiler.compile(model, x, calib_data=data, progress=False)
    else:
        prepared = ao_prepare_fx(model, get_default_qconfig_mapping("x86"), x)
        with torch.no_grad():
            for b in data:
                prepared(b)
        ao_convert_fx(prepared)
    peak = _peak_rss()
    print(json.dumps({"rss_before": rss_before, "peak_before": peak_before, "peak": peak}))


def _peak_rss() -> int:
    """VmHWM: this process's peak resident set. (``ru_maxrss`` would do, but Linux carries the parent's
    peak over fork + exec into it, so a child of a large parent reports the parent's peak.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", side, "resnet18", "--image-size", str(args.image_size),
           "--calib-batches", str(args.calib_batches), "--batch", str(args.batch), "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def crossing_overhead(repeat: int):
    """Per-step times of the guide's HybridModel (guide hybrid_dict, bayes) at 1x3x16x16, where the
    ops themselves cost little: a CPU island's time is mostly onnxruntime's per-call overhead.
    The same islands' FX nodes run in torch eager for comparison."""
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
    ap.add_argument("--calib-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-crossings", action="store_true", help="skip the HybridModel crossing table")
    ap.add_argument("--memory-child", nargs=2, metavar=("SIDE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child, args.image_size, args.calib_batches, args.batch, args.threads)
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows, calib_rows = [], []
    for name in args.models.split(","):
        x = zoo.example_inputs(name, image_size=args.image_size)
        data = calib_data(name, args.image_size, args.calib_batches, args.batch)
        float_model = zoo.get(name).eval()
        float_forward(float_model, data[:1])  # warm-up: first calls of each side's code paths
        ours(zoo.get(name), x, data[:1])
        peer(zoo.get(name), x, data[:1])
        rounds = [(ours(zoo.get(name), x, data), peer(zoo.get(name), x, data), float_forward(float_model, data))
                  for _ in range(args.repeat)]  # interleaved: a burst of load from elsewhere hits all sides
        o = {k: min(r[0][k] for r in rounds) for k in rounds[0][0]}
        p = {k: min(r[1][k] for r in rounds) for k in rounds[0][1]}
        f = min(r[2] for r in rounds)
        for stage in ("prepare", "calibrate", "convert", "lower"):
            rows.append((name, stage, f"{o[stage]:.3f}", f"{p[stage]:.3f}" if stage != "lower" else "-",
                         f"{o[stage] / p[stage]:.2f}x" if stage != "lower" else "-"))
        to, tp = sum(o.values()), sum(p.values())
        rows.append((name, "total (compile)", f"{to:.3f}", f"{tp:.3f}", f"{to / tp:.2f}x"))
        n = len(data)
        calib_rows.append((name, f"{f / n * 1e3:.1f}", f"{o['calibrate'] / n * 1e3:.1f}",
                           f"{o['calibrate'] / f:.2f}x", f"{p['calibrate'] / n * 1e3:.1f}", f"{p['calibrate'] / f:.2f}x"))
    print(f"torch {torch.__version__}, qcompiler {qcompiler.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cores, best of {args.repeat} per stage; calibration: "
          f"{args.calib_batches} batches of {args.batch}x3x{args.image_size}x{args.image_size}")
    print(tabulate(rows, headers=["model", "stage", "ours (s)", "torch.ao (s)", "ours / torch.ao"]))
    print()
    print(tabulate(calib_rows, headers=["model", "float forward (ms/batch)", "ours calibration (ms/batch)",
                                        "ours / float", "torch.ao calibration (ms/batch)", "torch.ao / float"]))
    if not args.no_memory:
        mo, mp = measure_memory("ours", args), measure_memory("torch.ao", args)
        mib = 2 ** 20
        print()
        print("peak memory of one compile of resnet18, each side in a fresh subprocess (VmHWM: peak resident "
              "set incl. torch's allocations; baseline = RSS after imports, model and data)")
        print(tabulate([
            ("peak RSS (MiB)", f"{mo['peak'] / mib:.0f}", f"{mp['peak'] / mib:.0f}", f"{mo['peak'] / mp['peak']:.2f}x"),
            ("compile peak above baseline (MiB)", f"{(mo['peak'] - mo['rss_before']) / mib:.0f}",
             f"{(mp['peak'] - mp['rss_before']) / mib:.0f}",
             f"{(mo['peak'] - mo['rss_before']) / max(mp['peak'] - mp['rss_before'], 1):.2f}x"),
            ("baseline RSS (MiB)", f"{mo['rss_before'] / mib:.0f}", f"{mp['rss_before'] / mib:.0f}", "-"),
        ], headers=["resnet18", "ours", "torch.ao", "ours / torch.ao"]))
    if args.no_crossings:
        return
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
