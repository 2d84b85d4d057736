"""ModelProfiler: per-layer statistics of one or more forwards (the guide's ``statistic.txt``).

    with ModelProfiler(model, "./profiler_dir") as p:
        model(data)
    p.get_info_manager().table()        # writes statistic.txt, returns the text
    p.get_info_manager().tensorboard()  # histograms (needs tensorboard)

Forward hooks on every leaf module record, per call: index, op (module type), module
name, attr (input/output/weight/bias), dtype, scale (QTensor's, or the module's quantizer),
min, max, mean, var and shape. QTensors are dequantized for the statistics. Hooks are
removed on exit; outputs are unchanged (hooks return nothing).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from tabulate import tabulate

import qcompiler.ir
from qcompiler.atomic_write import write_file
from qcompiler.errors import ConfigError
from qcompiler.quantization.fake_quantize import FakeQuantize, FakeQuantizeBase
from qcompiler.quantization.model_check import leaf_modules
from qcompiler.quantization.qtensor import QTensor

__all__ = ["ModelProfiler", "CompiledModelProfiler", "HbirModelProfiler", "OpRunningInfoManager", "OpRecord",
           "STATISTIC_FILE"]

STATISTIC_FILE = "statistic.txt"
_TORCH_DIR = os.path.dirname(torch.__file__)
# the capture machinery (the tracer, the output-recording wrapper of qcompiler.ir.structure): its frames
# sit between fx and the model's forward in every stack trace
_CAPTURE_DIR = os.path.dirname(os.path.abspath(qcompiler.ir.__file__)) + os.sep
_TB_MISSING = "tensorboard is not installed: pip install qcompiler[tensorboard] or pip install tensorboard"


@dataclass
class OpRecord:
    index: int
    op: str
    module_type: type
    mod_name: str
    attr: str
    dtype: str
    scale: Optional[str]
    min: float
    max: float
    mean: float
    var: float
    shape: tuple
    stack: str = ""
    values: Optional[torch.Tensor] = None  # float copy, kept for histograms


def _fmt_scale(s: Any) -> Optional[str]:
    if s is None:
        return None
    t = torch.as_tensor(s).detach().float().reshape(-1)
    if t.numel() == 1:
        return f"{t.item():.7g}"
    vals = t.tolist()
    head = ", ".join(f"{v:.4g}" for v in vals[:3])
    return f"[{head}, ...] (C={len(vals)})" if len(vals) > 3 else f"[{head}]"


def _qscale(qt: QTensor) -> Any:
    try:
        return qt.q_scale()
    except Exception:
        return qt.q_per_channel_scales()


def _live_scale(q: Optional[nn.Module]) -> tuple[Optional[str], Optional[str]]:
    """(dtype, scale) of a quantizer that currently fake-quantizes, else (dtype, None)."""
    if not isinstance(q, FakeQuantizeBase):
        return None, None
    if isinstance(q, FakeQuantize) and getattr(q, "_has_qparams", False):
        return str(q.dtype), _fmt_scale(q.scale)
    return str(q.dtype), None


class OpRunningInfoManager:
    """The records of a profiling session; ``table()`` and ``tensorboard()`` present them."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.records: list[OpRecord] = []

    def _select(self, prefixes, types) -> list[OpRecord]:
        out = []
        for r in self.records:
            if prefixes and not any(r.mod_name.startswith(p) for p in prefixes):
                continue
            if types and not issubclass(r.module_type, tuple(types)):
                continue
            out.append(r)
        return out

    def table(self, out_dir: Optional[str] = None, prefixes: Optional[Sequence[str]] = None,
              types: Optional[Sequence[type]] = None, with_stack: bool = False) -> str:
        """Writes ``statistic.txt`` into ``out_dir`` (default: the profiler's) and returns its text."""
        headers = ["Index", "Op Name", "Mod Name", "Attr", "Dtype", "Scale", "Min", "Max", "Mean", "Var", "Shape"]
        if with_stack:
            headers.append("Stack")
        rows = []
        for r in self._select(prefixes, types):
            row = [r.index, r.op, r.mod_name, r.attr, r.dtype, r.scale or "", f"{r.min:.7f}", f"{r.max:.7f}",
                   f"{r.mean:.7f}", f"{r.var:.7f}", f"torch.Size({list(r.shape)})"]
            if with_stack:
                row.append(r.stack)
            rows.append(row)
        text = tabulate(rows, headers=headers, tablefmt="psql", disable_numparse=True) + "\n"
        write_file(os.path.join(out_dir or self.out_dir, STATISTIC_FILE), text.encode("utf-8"), "profiler")
        return text

    def tensorboard(self, out_dir: Optional[str] = None, prefixes: Optional[Sequence[str]] = None,
                    types: Optional[Sequence[type]] = None) -> str:
        """Per-layer histograms under ``out_dir`` (default ``<out_dir>/tensorboard``); returns the dir."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch raises ImportError when the tensorboard package is missing
            raise ConfigError(_TB_MISSING) from exc
        log_dir = out_dir or os.path.join(self.out_dir, "tensorboard")
        writer = SummaryWriter(log_dir=log_dir)
        try:
            for r in self._select(prefixes, types):
                if r.values is not None and r.values.numel():
                    writer.add_histogram(f"{r.index}_{r.mod_name or r.op}/{r.attr}", r.values, 0)
        finally:
            writer.close()
        return log_dir


class ModelProfiler:
    """Context manager recording per-layer statistics of the forwards run inside it."""

    def __init__(self, model: nn.Module, out_dir: str, with_stack: bool = True, keep_values: bool = True) -> None:
        self.model = model
        self.out_dir = out_dir
        self.with_stack = with_stack
        self.keep_values = keep_values
        self._manager = OpRunningInfoManager(out_dir)
        self._handles: list = []
        self._index = 0
        self._calls: dict[str, int] = {}
        self._node_stacks = self._graph_stacks(model)

    @staticmethod
    def _graph_stacks(model: nn.Module) -> dict[str, list[str]]:
        """Module target -> source line of each node calling it (FX ``stack_trace`` meta)."""
        out: dict[str, list[str]] = {}
        if isinstance(model, fx.GraphModule):
            for n in model.graph.nodes:
                if n.op == "call_module":
                    out.setdefault(n.target, []).append(_last_frame(n.stack_trace or n.meta.get("stack_trace")))
        return out

    def get_info_manager(self) -> OpRunningInfoManager:
        return self._manager

    def __enter__(self) -> "ModelProfiler":
        os.makedirs(self.out_dir, exist_ok=True)
        for name, m in leaf_modules(self.model).items():
            if isinstance(m, FakeQuantizeBase) and "." in name:
                continue  # quantizers inside layers are reported through their layer
            self._handles.append(m.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _stack(self, name: str) -> str:
        if not self.with_stack:
            return ""
        k = self._calls.get(name, 0)
        self._calls[name] = k + 1
        lines = self._node_stacks.get(name)
        if lines:
            return lines[k % len(lines)]
        for frame in inspect.stack()[2:]:  # the first frame outside torch.nn / this file
            f = frame.filename
            if "torch" + os.sep + "nn" in f or f == __file__:
                continue
            return f"{f}:{frame.lineno}"
        return ""

    def _hook(self, name: str):
        def hook(module, args, output):
            index = self._index
            self._index += 1
            typ = type(module)
            op = f"{typ.__module__}.{typ.__qualname__}"
            stack = self._stack(name)
            in_q = module.__dict__.get("_qc_input_quantizer")
            if in_q is None and hasattr(module, "op"):
                in_q = getattr(module.op, "__dict__", {}).get("_qc_input_quantizer")
            for i, a in enumerate(_tensors(args)):
                self._add(index, op, typ, name, "input" if i == 0 else f"input{i}", a, in_q if i == 0 else None, stack)
            for attr in ("weight", "bias"):
                t = getattr(module, attr, None)
                if isinstance(t, torch.Tensor):
                    self._add(index, op, typ, name, attr, t, None, stack)
            q_w = getattr(module, "q_weight", None)
            if isinstance(q_w, torch.Tensor):
                self._add_weight_q(index, op, typ, name, module, stack)
            out_q = module if isinstance(module, FakeQuantizeBase) else getattr(module, "activation_post_process", None)
            for i, o in enumerate(_tensors(output)):
                self._add(index, op, typ, name, "output" if i == 0 else f"output{i}", o, out_q if i == 0 else None,
                          stack)
        return hook

    def _add_weight_q(self, index, op, typ, name, module, stack) -> None:
        w_scale = module.w_scale
        shape = [1] * module.q_weight.dim()
        axis = 1 if getattr(module, "kind", "") == "conv_transpose2d" else 0
        if w_scale.numel() > 1:
            shape[axis] = -1
        w = module.q_weight.double() * w_scale.double().reshape(shape if w_scale.numel() > 1 else ())
        self._record(index, op, typ, name, "weight", w, "qint8", _fmt_scale(w_scale), stack)

    def _add(self, index, op, typ, name, attr, t, quantizer, stack) -> None:
        if isinstance(t, QTensor):
            self._record(index, op, typ, name, attr, t.dequantize(), str(t.dtype), _fmt_scale(_qscale(t)), stack)
            return
        dtype, scale = _live_scale(quantizer)
        if scale is None:
            dtype = str(t.dtype)
        self._record(index, op, typ, name, attr, t, dtype, scale, stack)

    def _record(self, index, op, typ, name, attr, t, dtype, scale, stack) -> None:
        v = t.detach().double()
        finite = v.numel() > 0
        self._manager.records.append(OpRecord(
            index=index, op=op, module_type=typ, mod_name=name, attr=attr, dtype=dtype, scale=scale,
            min=v.min().item() if finite else float("nan"), max=v.max().item() if finite else float("nan"),
            mean=v.mean().item() if finite else float("nan"),
            var=v.var(unbiased=False).item() if finite else float("nan"),
            shape=tuple(t.shape), stack=stack,
            values=v.float().cpu().flatten().clone() if self.keep_values else None,
        ))


class _ProfiledRuntime:
    """Stands in for a CompiledModel's runtime inside :class:`CompiledModelProfiler`: a call returns the
    runtime's outputs, and runs the converted graph on the same inputs under the profiler's hooks."""

    def __init__(self, runtime: Any, graph: fx.GraphModule) -> None:
        self._runtime, self._graph = runtime, graph

    def __call__(self, *args: Any) -> Any:
        out = self._runtime(*_copies(args))
        with torch.no_grad():
            self._graph(*_copies(args))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)


class CompiledModelProfiler(ModelProfiler):
    """:class:`ModelProfiler` for the model :func:`qcompiler.export` / :func:`qcompiler.compile` returns.

        with CompiledModelProfiler(compiled, "./hbir_dir") as p:
            compiled(data)
        p.get_info_manager().table()

    A call inside the block returns what the compiled runtime computes (BPU programs in the simulator,
    CPU islands in onnxruntime); the per-op records come from the converted fixed-point graph the
    runtime was lowered from, run on the same inputs, whose ops the programs match bit for bit
    (docs/design.md, the numerics contract). So the table has the rows ModelProfiler gives on that
    graph: one per op, with each QTensor's dtype and scale. A model loaded from an artifact has no such
    graph: a ConfigError. The guide's ``HbirModelProfiler`` is this class.
    """

    def __init__(self, model: Any, out_dir: str, with_stack: bool = True, keep_values: bool = True) -> None:
        graph = getattr(model, "converted", None)
        if not hasattr(model, "runtime") or not isinstance(graph, fx.GraphModule):
            what = ("a CompiledModel loaded from an artifact (it has no converted graph to record ops from); "
                    "profile the model qcompiler.compile / qcompiler.export returned"
                    if hasattr(model, "runtime") else type(model).__name__)
            raise ConfigError(f"CompiledModelProfiler takes the CompiledModel of qcompiler.export or "
                              f"qcompiler.compile, got {what}; for a torch model use ModelProfiler")
        super().__init__(graph, out_dir, with_stack=with_stack, keep_values=keep_values)
        self.compiled = model

    def __enter__(self) -> "CompiledModelProfiler":
        super().__enter__()
        self.compiled.runtime = _ProfiledRuntime(self.compiled.runtime, self.model)
        return self

    def __exit__(self, *exc) -> None:
        runtime = self.compiled.runtime
        if isinstance(runtime, _ProfiledRuntime):
            self.compiled.runtime = runtime._runtime
        super().__exit__(*exc)


HbirModelProfiler = CompiledModelProfiler  # the accuracy-debugging guide's name


def _copies(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(x: Any) -> list:
    if isinstance(x, (torch.Tensor, QTensor)):
        return [x]
    if isinstance(x, (tuple, list)):
        out = []
        for i in x:
            out.extend(_tensors(i))
        return out
    if isinstance(x, dict):
        out = []
        for i in x.values():
            out.extend(_tensors(i))
        return out
    return []


def _last_frame(stack_trace: Optional[str]) -> str:
    """``file:line`` of the first user frame of an FX stack trace (the model's forward)."""
    if not stack_trace:
        return ""
    last = ""
    for line in stack_trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            try:
                path, rest = line[6:].split('", line ', 1)
                if not path.startswith((_TORCH_DIR, _CAPTURE_DIR)):
                    return f"{path}:{rest.split(',')[0]}"
            except ValueError:
                continue
    return last
