"""Op catalogue: every op of torch's OpInfo database on qcompiler's CPU islands, beside torch.onnx + onnxruntime.

    OMP_NUM_THREADS=1 python benchmarks/op_catalogue.py [--ops NAME ...] [--samples N]
    OMP_NUM_THREADS=1 python benchmarks/op_catalogue.py --markdown docs/op_catalogue.md   # regenerate the doc

The ops are ``torch.testing._internal.common_methods_invocations.op_db`` (shipped in the torch wheel; importing
it needs ``expecttest``: ``pip install -e .[bench]``), every entry that supports float32 on the CPU. Per op,
the first ``--samples`` samples of ``op.sample_inputs("cpu", torch.float32)`` (default 1: the first sample is
the op's plain case, usually its smallest; later samples vary the arguments, so more samples measure more
argument combinations, at a linear cost in time). A sample becomes a tiny ``nn.Module`` (:class:`OpModule`):
its tensors (the input, tensor arguments, tensors inside lists) are the module's inputs, everything else
(ints, dims, dtypes, flags) is a constant of ``forward``.

Each sample runs three ways:

- eager: the module itself, the reference (run twice with different seeds: an op whose outputs differ is
  random, and only its output shapes and dtypes are compared);
- ours: ``qcompiler.compile`` with everything forced to the CPU (``hybrid_dict`` names the op module), so
  every node runs in a CPU island: onnxruntime through the ONNX opset-11 emitter, or eager torch where the
  emitter has no opset-11 form (the island's reason says why);
- theirs: ``torch.onnx.export(..., opset_version=11, dynamo=False)`` + onnxruntime.

An outcome is *correct* when every output tensor has the eager shape and dtype and its values are within
``rtol 1e-3`` / ``atol 1e-4`` (NaNs in the same places); *wrong* when it runs but is not correct (for us a
silent mismatch, the worst bug); *documented* when it raises a ``QCompilerError``; *raw* for any other
exception; *timeout* past the per-sample guard (``--timeout``, SIGALRM). Samples whose eager run fails are
left out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import onnxruntime
import torch
import torch.nn as nn
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_coverage import environment  # noqa: E402
from qcompiler.compiled import compile as qc_compile  # noqa: E402
from qcompiler.errors import QCompilerError  # noqa: E402

try:
    from torch.testing._internal.common_methods_invocations import op_db
except ImportError as exc:  # torch's test modules import test-only packages (expecttest)
    raise SystemExit(f"op_catalogue needs torch's test-only dependencies ({exc}); "
                     "install them with: pip install -e '.[bench]'") from None

RTOL, ATOL = 1e-3, 1e-4
TIMEOUT = 20.0  # seconds per sample and side
CORRECT, WRONG, DOCUMENTED, RAW, TIMEOUT_, CRASH = "correct", "wrong", "documented", "raw", "timeout", "crash"
OUTCOMES = (CORRECT, WRONG, DOCUMENTED, RAW, TIMEOUT_, CRASH)


# --- samples as modules ----------------------------------------------------------------------------------

def _flatten(v: Any, tensors: list[torch.Tensor]) -> Any:
    """``v`` with each tensor replaced by its index in ``tensors`` (a ``_Slot``), which collects them."""
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return _Slot(len(tensors) - 1)
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return type(v)(_flatten(x, tensors) for x in v)
    if isinstance(v, dict):
        return {k: _flatten(x, tensors) for k, x in v.items()}
    return v


@dataclass(frozen=True)
class _Slot:
    index: int


def _fill(v: Any, tensors: Sequence[Any]) -> Any:
    if isinstance(v, _Slot):
        return tensors[v.index]
    if isinstance(v, (list, tuple)):
        return type(v)(_fill(x, tensors) for x in v)
    if isinstance(v, dict):
        return {k: _fill(x, tensors) for k, x in v.items()}
    return v


class OpModule(nn.Module):
    """One OpInfo sample as a module: ``forward(t0, t1, ...)`` calls ``fn(input, *args, **kwargs)`` with the
    sample's tensors taken from the inputs and everything else as constants."""

    def __init__(self, fn: Callable, structure: tuple) -> None:
        super().__init__()
        self.fn, self.structure = fn, structure

    def call(self, *tensors: Any) -> Any:
        inp, args, kwargs = _fill(self.structure, tensors)
        return self.fn(inp, *args, **kwargs)


def op_module(fn: Callable, n_inputs: int, structure: tuple) -> OpModule:
    """An :class:`OpModule` whose ``forward`` takes exactly ``n_inputs`` named tensors (torch.fx and
    torch.onnx trace named positional parameters, not ``*args``)."""
    names = ", ".join(f"t{i}" for i in range(n_inputs))
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {names}):\n    return self.call({names})\n", namespace)  # noqa: S102
    cls = type("OpModule", (OpModule,), {"forward": namespace["forward"]})
    return cls(fn, structure)


class Wrapper(nn.Module):
    """The op module as a named child, so ``hybrid_dict={"module_name": ["op"]}`` forces every node to the CPU."""

    def __init__(self, op: nn.Module) -> None:
        super().__init__()
        self.op = op

    def forward(self, *args: Any) -> Any:  # replaced per instance below (fx needs named parameters)
        raise NotImplementedError


def wrapped(op: OpModule, n_inputs: int) -> nn.Module:
    names = ", ".join(f"t{i}" for i in range(n_inputs))
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {names}):\n    return self.op({names})\n", namespace)  # noqa: S102
    return type("Wrapper", (Wrapper,), {"forward": namespace["forward"]})(op)


@dataclass
class Case:
    """One sample of one op."""

    name: str  # op name, with its variant (``max.reduction_with_dim``), and ``#i`` for samples after the first
    fn: Callable
    inputs: tuple  # the sample's tensors
    structure: tuple  # (input, args, kwargs) with tensors replaced by slots

    def module(self) -> OpModule:
        return op_module(self.fn, len(self.inputs), self.structure)


def _op_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def float32_ops(names: Optional[Sequence[str]] = None) -> list[Any]:
    """The OpInfo entries that support float32 on the CPU (only ``names`` if given: op name with variant,
    or the plain name for all its variants)."""
    ops = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]
    if names:
        wanted = set(names)
        ops = [op for op in ops if {op.name, _op_name(op)} & wanted]
        unknown = wanted - {n for op in ops for n in (op.name, _op_name(op))}
        if unknown:
            raise SystemExit(f"unknown op(s): {', '.join(sorted(unknown))}")
    return ops


def cases_of(op: Any, samples: int = 1) -> list[Case]:
    """The first ``samples`` float32 CPU samples of ``op`` as cases (fewer if it has fewer; none if its
    sample generator fails)."""
    out = []
    torch.manual_seed(0)
    try:
        gen = op.sample_inputs("cpu", torch.float32, requires_grad=False)
        for i, sample in enumerate(gen):
            if i >= samples:
                break
            tensors: list[torch.Tensor] = []
            structure = _flatten((sample.input, tuple(sample.args), dict(sample.kwargs)), tensors)
            name = _op_name(op) + (f"#{i}" if i else "")
            out.append(Case(name, op.op, tuple(t.detach().clone() for t in tensors), structure))
    except Exception:  # a sample generator that needs something this machine lacks
        return out
    return out


# --- running ---------------------------------------------------------------------------------------------

class SampleTimeout(Exception):
    """The per-sample guard fired."""


@contextlib.contextmanager
def guard(seconds: float):
    """Raise :class:`SampleTimeout` after ``seconds`` (SIGALRM: the main thread, POSIX), and keep warnings
    and stray prints out of the table."""
    def fire(signum, frame):
        raise SampleTimeout(f"over {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def flat(v: Any) -> Optional[list[torch.Tensor]]:
    """The tensors of an output in order (tuples, lists, named tuples), or None if it holds anything else."""
    if isinstance(v, torch.Tensor):
        return [v.detach()]
    if isinstance(v, (tuple, list)):
        out = []
        for x in v:
            part = flat(x)
            if part is None:
                return None
            out += part
        return out
    return None


def compare(ref: list[torch.Tensor], got: Any, random: bool) -> Optional[str]:
    """None if ``got`` matches ``ref`` (shape, dtype, values within RTOL/ATOL; only shape and dtype for a
    random op), else what differs."""
    got_t = flat(got)
    if got_t is None:
        return f"output is a {type(got).__name__}, not tensors"
    if len(got_t) != len(ref):
        return f"{len(got_t)} output tensors, eager gives {len(ref)}"
    for i, (r, g) in enumerate(zip(ref, got_t)):
        if tuple(r.shape) != tuple(g.shape):
            return f"output {i}: shape {tuple(g.shape)}, eager {tuple(r.shape)}"
        if r.dtype != g.dtype:
            return f"output {i}: dtype {g.dtype}, eager {r.dtype}"
        if random or r.numel() == 0:
            continue
        if r.dtype == torch.bool or not (r.is_floating_point() or r.is_complex()):
            if not torch.equal(r, g):
                return f"output {i}: {int((r != g).sum())} of {r.numel()} values differ"
        elif not torch.allclose(g, r, rtol=RTOL, atol=ATOL, equal_nan=True):
            diff = (g.double() - r.double()).abs().nan_to_num(float("inf")).max()
            return f"output {i}: max abs diff {float(diff):.3g}"
    return None


ROOT = str(Path(__file__).resolve().parents[1]) + os.sep


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` with this checkout's path left out (the table is the same on every machine)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:240].replace(ROOT, '') if lines else ''}"


def _outcome(run: Callable[[], Any], ref: list[torch.Tensor], random: bool, timeout: float) -> tuple[str, str]:
    try:
        with guard(timeout):
            got = run()
    except SampleTimeout as exc:
        return TIMEOUT_, str(exc)
    except QCompilerError as exc:
        return DOCUMENTED, _first_line(exc)
    except Exception as exc:  # noqa: BLE001  (the benchmark counts every raw error)
        return RAW, _first_line(exc)
    why = compare(ref, got, random)
    return (CORRECT, "") if why is None else (WRONG, why)


def run_ours(case: Case) -> tuple[Any, list[str]]:
    """The sample through ``qcompiler.compile`` with every node on the CPU; the output and the kinds of the
    islands that ran it with their reasons (``cpu``: onnxruntime, ``torch``: eager torch, and why)."""
    model = wrapped(case.module(), len(case.inputs)).eval()
    cm = qc_compile(model, case.inputs, hybrid_dict={"module_name": ["op"]}, progress=False)
    return cm(*case.inputs), [(s.kind, s.reason) for s in cm.runtime.steps]


def run_theirs(case: Case) -> Any:
    """The sample through ``torch.onnx.export(opset_version=11, dynamo=False)`` + onnxruntime."""
    model = case.module().eval()
    names = [f"t{i}" for i in range(len(case.inputs))]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "op.onnx")
        torch.onnx.export(model, case.inputs, path, opset_version=11, dynamo=False, input_names=names)
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        sess = onnxruntime.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feeds = {i.name: case.inputs[names.index(i.name)].numpy() for i in sess.get_inputs()}
    return tuple(torch.from_numpy(o) for o in sess.run(None, feeds))


@dataclass
class Row:
    name: str
    ours: str = ""
    ours_detail: str = ""
    backend: str = ""  # the kinds of CPU islands that ran the sample: onnx, torch, or both
    theirs: str = ""
    theirs_detail: str = ""
    random: bool = False
    seconds: float = 0.0

    def set(self, side: str, outcome: str, detail: str, backend: str = "") -> None:
        setattr(self, side, outcome)
        setattr(self, f"{side}_detail", detail)
        if side == "ours":
            self.backend = backend


def eager_reference(case: Case, timeout: float) -> tuple[Optional[list[torch.Tensor]], bool]:
    """The eager outputs (None if the sample fails eagerly or returns something other than tensors) and
    whether the op is random: two seeds give different outputs, OpInfo wraps it in ``wrapper_set_seed``
    (it seeds torch's generator inside the call, a side effect no traced graph keeps), or it is an
    ``empty*`` op (uninitialized memory: no value is wrong)."""
    outs, random = [], False
    try:
        with guard(timeout), torch.no_grad():
            for seed in (0, 1):
                torch.manual_seed(seed)
                outs.append(flat(case.module()(*case.inputs)))
    except Exception:  # noqa: BLE001  (a sample eager torch cannot run is not a sample)
        return None, False
    random |= "wrapper_set_seed" in getattr(getattr(case.fn, "__code__", None), "co_names", ())
    random |= "empty" in case.name  # empty, new_empty, empty_strided...: the values are unspecified
    if outs[0] is None or any(t.layout != torch.strided for t in (*case.inputs, *outs[0])):
        return None, False  # not tensors, or sparse ones (neither ONNX nor the islands take sparse tensors)
    try:
        random = random or any(a.shape != b.shape or not torch.equal(a.nan_to_num(), b.nan_to_num())
                               for a, b in zip(outs[0], outs[1]))
    except Exception:  # noqa: BLE001  (e.g. complex half: no nan_to_num; neither side takes it anyway)
        return None, False
    return outs[0], random


def _collect(result: tuple[Any, list], into: list) -> Any:
    """run_ours' output, its island kinds appended to ``into``."""
    out, kinds = result
    into.extend(kinds)
    return out


def run_case(case: Case, *, timeout: float = TIMEOUT, sides: Sequence[str] = ("ours", "theirs"),
             report: Callable[[str, Optional[tuple]], None] = lambda side, result: None) -> Optional[Row]:
    """The given sides of one sample, in this process, or None if eager torch cannot run it. ``report(side,
    None)`` is called before a side runs and ``report(side, (outcome, detail, backend))`` after (the parent
    of a worker keeps what finished before a crash)."""
    t0 = time.perf_counter()
    ref, random = eager_reference(case, timeout)
    if ref is None:
        return None
    row = Row(case.name, random=random)
    for side in sides:
        report(side, None)
        torch.manual_seed(0)
        kinds: list[tuple[str, str]] = []
        call = (lambda ks=kinds: _collect(run_ours(case), ks)) if side == "ours" else (lambda: run_theirs(case))
        outcome, detail = _outcome(call, ref, random, timeout)
        backend = "+".join(sorted({"onnx" if k == "cpu" else k for k, _ in kinds if k != "bpu"}))
        why_torch = next((reason for k, reason in kinds if k == "torch"), "")
        if outcome == CORRECT and why_torch:  # why it is not in onnxruntime
            detail = why_torch.strip().splitlines()[0][:240]
        row.set(side, outcome, detail, backend)
        report(side, (outcome, detail, backend))
    row.seconds = time.perf_counter() - t0
    return row


# A sample can kill the process (onnxruntime dies of SIGFPE on some empty tensors), so samples run in a
# spawned worker; the parent starts a new one after a crash or a hang (hard guard: 3 x ``timeout`` per side)
# and records the side that was running as CRASH or TIMEOUT_.

def _rebuild(names: Sequence[str], samples: int) -> list[Case]:
    """The cases of the ops named ``names`` (``_op_name``), in that order: what a spawned worker runs.
    OpInfo callables are often lambdas, which do not pickle, so the worker rebuilds the cases
    (:func:`cases_of` is seeded, so they are the parent's)."""
    by_name: dict[str, Any] = {}
    for op in op_db:
        by_name.setdefault(_op_name(op), op)
    return [c for n in dict.fromkeys(names) for c in cases_of(by_name[n], samples)]


def _worker(conn, recipe: tuple[tuple[str, ...], int, tuple[str, ...]], timeout: float) -> None:
    names, samples, expected = recipe
    cases = _rebuild(names, samples)
    if tuple(c.name for c in cases) != expected:
        raise RuntimeError(f"the worker rebuilt other cases than the parent's: {[c.name for c in cases]} "
                           f"!= {list(expected)}")
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, sides = msg
        row = run_case(cases[index], timeout=timeout, sides=sides,
                       report=lambda side, result: conn.send(("side", (side, result))))
        conn.send(("row", row))


class Worker:
    """A spawned process running cases of a list, one request at a time. ``recipe`` is (op names,
    samples, case names): the worker rebuilds the cases from it (spawn, not fork: fork is not the
    default from Python 3.14 on, and forking a process that started torch's thread pools is unsafe)."""

    def __init__(self, recipe: tuple[tuple[str, ...], int, tuple[str, ...]], timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, recipe, timeout), daemon=True)
        self.proc.start()
        child.close()

    def ask(self, index: int, sides: Sequence[str], limit: float) -> tuple[Optional[Row], dict, str, Optional[str]]:
        """Run case ``index``: (row or None if eager torch cannot run it, {side: result} of the sides that
        finished, failure ("" / CRASH / TIMEOUT_), the side running when it failed)."""
        self.conn.send((index, tuple(sides)))
        results: dict[str, tuple] = {}
        running = None
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not self.conn.poll(left):
                    return None, results, TIMEOUT_, running
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                return None, results, CRASH, running
            if kind == "row":
                return value, results, "", None
            side, result = value
            if result is None:
                running, deadline = side, time.monotonic() + limit
            else:
                results[side], running = result, None

    def close(self) -> None:
        """Ask the worker to return (it then releases what it holds), kill it if it does not."""
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


def _run_isolated(cases: Sequence[Case], recipe: tuple[tuple[str, ...], int, tuple[str, ...]], timeout: float,
                  sides: Sequence[str], progress: Callable[[Row], None]) -> list[Row]:
    rows: list[Row] = []
    worker = Worker(recipe, timeout)
    try:
        for i, case in enumerate(cases):
            todo, row = list(sides), None
            while todo:
                got, results, failure, running = worker.ask(i, todo, timeout * 3 + 30)
                if not failure:
                    if got is not None and row is not None:  # the sides before the crash are in row
                        for side, result in results.items():
                            row.set(side, *result)
                    row = row if row is not None or got is None else got
                    break
                worker.close()
                worker = Worker(recipe, timeout)
                if running is None:  # it failed in the eager reference: not a sample
                    break
                row = row or Row(case.name)
                for side, result in results.items():
                    row.set(side, *result)
                row.set(running, failure, "the process died" if failure == CRASH
                        else f"no answer within {timeout * 3 + 30:.0f} s")
                todo = todo[todo.index(running) + 1:]
            if row is not None:
                rows.append(row)
                progress(row)
    finally:
        worker.close()
    return rows


def run(ops: Sequence[Any], *, samples: int = 1, timeout: float = TIMEOUT, theirs: bool = True,
        progress: bool = True) -> list[Row]:
    """Every sample of ``ops`` (the first ``samples`` of each) through both sides, in a worker process."""
    names = tuple(dict.fromkeys(_op_name(op) for op in ops))
    cases = _rebuild(names, samples)  # by name, exactly as the spawned worker rebuilds them
    recipe = (names, samples, tuple(c.name for c in cases))
    sides = ("ours", "theirs") if theirs else ("ours",)
    count = [0]

    def show(row: Row) -> None:
        count[0] += 1
        if progress:
            print(f"[{count[0]}/{len(cases)}] {row.name}: ours {row.ours} ({row.backend or '-'}), "
                  f"theirs {row.theirs or '-'} {row.ours_detail[:100]}", file=sys.stderr, flush=True)
    return _run_isolated(cases, recipe, timeout, sides, show)


# --- reporting -------------------------------------------------------------------------------------------

def counts(rows: Sequence[Row]) -> list[tuple[str, Any]]:
    ours, theirs = Counter(r.ours for r in rows), Counter(r.theirs for r in rows if r.theirs)
    n = len(rows)
    onnx_only = sum(r.ours == CORRECT and r.backend == "onnx" for r in rows)
    lines = [("samples (ops with a float32 CPU sample eager torch runs)", n)]
    for k in OUTCOMES:
        lines.append((f"qcompiler CPU islands: {k}", ours.get(k, 0)))
    lines.append(("qcompiler: correct, all in onnxruntime (no torch island)", onnx_only))
    lines.append(("qcompiler: correct, with a torch island", ours.get(CORRECT, 0) - onnx_only))
    if theirs:
        for k in OUTCOMES:
            lines.append((f"torch.onnx opset 11 + onnxruntime: {k}", theirs.get(k, 0)))
        both = sum(r.ours == CORRECT and r.theirs == CORRECT for r in rows)
        lines.append(("correct on both", both))
        lines.append(("correct for qcompiler only", sum(r.ours == CORRECT and r.theirs != CORRECT for r in rows)))
        lines.append(("correct for torch.onnx only", sum(r.ours != CORRECT and r.theirs == CORRECT for r in rows)))
    lines.append(("random ops (shapes and dtypes compared only)", sum(r.random for r in rows)))
    return lines


def failure_categories(rows: Sequence[Row], side: str = "ours") -> list[tuple[int, str, str]]:
    """(count, outcome: first line, ops) for every sample that is not correct on ``side``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        outcome, detail = getattr(r, side), getattr(r, f"{side}_detail")
        if outcome and outcome != CORRECT:
            key = detail if outcome in (DOCUMENTED, RAW) else ""
            groups.setdefault((outcome, key), []).append(r.name)
    out = [(len(v), f"{k[0]}: {k[1]}" if k[1] else k[0], ", ".join(v)) for k, v in groups.items()]
    return sorted(out, key=lambda t: (-t[0], t[1]))


HEADERS = ["op", "qcompiler", "islands", "torch.onnx", "qcompiler detail", "torch.onnx detail"]


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    return [[r.name + (" (random)" if r.random else ""), r.ours, r.backend, r.theirs, r.ours_detail[:120],
             r.theirs_detail[:120]] for r in rows]


def _md(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    return [[c.replace("|", "\\|") if isinstance(c, str) else c for c in row] for row in rows]


def markdown(rows: Sequence[Row], seconds: float, argv: Sequence[str], samples: int) -> str:
    cmd = "OMP_NUM_THREADS=1 python benchmarks/op_catalogue.py " + " ".join(argv)
    env = environment("docs/op_catalogue.md") + [("run time", f"{seconds:.0f} s"),
                                                 ("samples per op", str(samples))]
    parts = [
        "# Op catalogue: torch's OpInfo ops on qcompiler's CPU islands and on torch.onnx opset 11",
        "",
        "Generated by `benchmarks/op_catalogue.py` (do not edit by hand); regenerate with",
        "",
        f"    {cmd.strip()}",
        "",
        "Every op of `torch.testing._internal.common_methods_invocations.op_db` that supports float32 on the "
        "CPU; per op the first sample of `op.sample_inputs('cpu', torch.float32)` (the plain case), wrapped as "
        "a module whose inputs are the sample's tensors and whose other arguments are constants. *qcompiler*: "
        "`qcompiler.compile` with `hybrid_dict` forcing every node to the CPU, so each runs in a CPU island "
        "(onnxruntime through the opset-11 emitter, or eager torch where the emitter has no opset-11 form; "
        "the *islands* column). *torch.onnx*: `torch.onnx.export(opset_version=11, dynamo=False)` + "
        f"onnxruntime. Both compared with eager torch: same shapes and dtypes, values within rtol {RTOL} / "
        f"atol {ATOL}. *wrong* is a silent mismatch; *documented* a `QCompilerError`; *raw* any other "
        "exception. Random ops (two seeds differ in eager) compare shapes and dtypes only.",
        "",
        tabulate(env, headers=["", ""], tablefmt="github"),
        "",
        "## Counts",
        "",
        tabulate(_md(counts(rows)), headers=["", "samples"], tablefmt="github"),
        "",
        "Reading the counts: *correct* counts every CPU island; the like-for-like comparison with torch.onnx "
        "is *correct, all in onnxruntime* (the sample's ONNX form ran), while *with a torch island* means "
        "the emitter has no opset-11 form for a node (or its form failed `onnx.checker`), so that island ran "
        "in eager torch: right values, but no ONNX export for it. An op whose Python wrapper torch.fx cannot "
        "trace (data-dependent control flow, `Tensor.__radd__` called on a proxy, in-place random fills) "
        "runs whole in a torch island, with a warning (docs/stubs_and_tracing.md). The *documented* errors "
        "below are listed with their messages (e.g. a `ConfigError` for a sample with a batch of 0: compile "
        "calibrates on the example inputs and refuses an empty batch).",
        "",
        "## qcompiler: samples not correct",
        "",
        tabulate(_md(failure_categories(rows)), headers=["n", "outcome", "ops"], tablefmt="github")
        if failure_categories(rows) else "None.",
        "",
        "## torch.onnx opset 11: samples not correct (the peer, for comparison)",
        "",
        tabulate(_md(failure_categories(rows, "theirs")), headers=["n", "outcome", "ops"], tablefmt="github")
        if failure_categories(rows, "theirs") else "None.",
        "",
        "## Per op",
        "",
        tabulate(_md(table_rows(rows)), headers=HEADERS, tablefmt="github"),
        "",
    ]
    return "\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", metavar="NAME", help="only these ops (name, or name.variant)")
    parser.add_argument("--samples", type=int, default=1, metavar="N", help="samples per op (default 1: the first)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per sample and side")
    parser.add_argument("--ours-only", action="store_true", help="skip torch.onnx (faster)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the report as markdown to FILE")
    parser.add_argument("--quiet", action="store_true", help="no per-sample progress lines")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = run(float32_ops(args.ops), samples=args.samples, timeout=args.timeout, theirs=not args.ours_only,
               progress=not args.quiet)
    seconds = time.perf_counter() - t0
    print(tabulate(failure_categories(rows), headers=["n", "qcompiler outcome", "ops"], maxcolwidths=[None, 80, 80]))
    print()
    print(tabulate(counts(rows)))
    print(f"\n{seconds:.0f} s")
    if args.markdown:
        passed = list(argv if argv is not None else sys.argv[1:])
        Path(args.markdown).write_text(markdown(rows, seconds, passed, args.samples))


if __name__ == "__main__":
    main()
