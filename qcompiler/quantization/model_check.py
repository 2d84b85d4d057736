"""Model structure check for calibration / QAT models (``check_qat_model``).

Five findings, as in the accuracy-debugging guide:

1. unfused patterns: chains of ``PATTERNS`` (``qcompiler.passes.fuse``) still present as
   separate call nodes on the BPU (e.g. a conv whose output is used twice before its BN);
2. how often each module is called in one forward (forward hooks on every leaf module,
   or, with ``run_forward=False``, counted from the graph): shared and never-called modules;
3. each layer's output qconfig (input dtype, output dtype, ch_axis, observer);
4. each weight's qconfig (dtype, qscheme, ch_axis, observer);
5. abnormal qconfigs (missing output quantizer, int8/int16 boundaries, per-tensor weights,
   per-channel activations, fake quant disabled in a QAT model, shared quantizers...).

The model is never modified: a forward runs on a deep copy.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from tabulate import tabulate

from qcompiler.atomic_write import write_file
from qcompiler.batches import fresh_args
from qcompiler.ir.meta import BPU, GM_KIND, META_OP, META_STUB, placement, shape
from qcompiler.ir.ops import node_op
from qcompiler.ir.tracer import trace
from qcompiler.nn.fused import FusedModule
from qcompiler.nn.qat import has_weight_layer
from qcompiler.passes.fuse import PATTERNS
from qcompiler.passes.insert_observers import CONSTANT_QUANT
from qcompiler.quantization.fake_quantize import FakeQuantize, FakeQuantizeBase
from qcompiler.quantization.observer import ObserverBase

__all__ = ["ModelCheckResult", "Anomaly", "check_qat_model", "RESULT_FILE"]

RESULT_FILE = "model_check_result.txt"
_QUANTIZERS = (FakeQuantizeBase, ObserverBase)
_BASE_OPS = ("conv2d", "conv_transpose2d", "linear")
# ops that keep their input's grid (same set as insert_observers)
_SCALE_PRESERVING = frozenset({
    "relu", "max_pool2d", "identity", "dropout", "reshape", "flatten",
    "permute", "transpose", "getitem", "size", "dequant",
})
_FLOAT = "torch.float32"


@dataclass(frozen=True)
class Anomaly:
    """One abnormal finding: where, what kind, and a human-readable message."""

    where: str
    kind: str
    message: str


@dataclass
class ModelCheckResult:
    unfused: list[dict] = field(default_factory=list)  # {"nodes": [...], "pattern": str, "reason": str}
    call_counts: dict[str, int] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)
    never_called: list[str] = field(default_factory=list)
    layer_qconfigs: list[dict] = field(default_factory=list)
    weight_qconfigs: list[dict] = field(default_factory=list)
    abnormal: list[Anomaly] = field(default_factory=list)

    @property
    def has_anomalies(self) -> bool:
        return bool(self.unfused or self.abnormal)

    def anomaly_table(self) -> str:
        rows = [(u["nodes"][0], "unfused", f"{u['pattern']}: {u['reason']}") for u in self.unfused]
        rows += [(a.where, a.kind, a.message) for a in self.abnormal]
        return tabulate(rows, headers=["Where", "Kind", "Message"], tablefmt="psql") if rows else ""

    def summary(self, limit: int = 5) -> str:
        """One line per anomaly (at most ``limit``), for warnings."""
        items = [f"unfused {u['pattern']} at {' -> '.join(u['nodes'])} ({u['reason']})" for u in self.unfused]
        items += [f"{a.kind} at {a.where}: {a.message}" for a in self.abnormal]
        more = f"; and {len(items) - limit} more" if len(items) > limit else ""
        return "; ".join(items[:limit]) + more

    def text(self) -> str:
        parts = []
        if self.unfused:
            rows = [(" -> ".join(u["nodes"]), u["pattern"], u["reason"]) for u in self.unfused]
            parts.append("Fusable modules are listed below (not fused):\n"
                         + tabulate(rows, headers=["nodes", "pattern", "reason"]))
        else:
            parts.append("No unfused patterns.")
        if self.shared or self.never_called:
            rows = [(name, n) for name, n in self.call_counts.items() if n != 1]
            parts.append("Modules not called exactly once (0: never called, >1: shared):\n"
                         + tabulate(rows, headers=["name", "called times"]))
        else:
            parts.append("All modules in the model run exactly once.")
        cols = ["Module Name", "Module Type", "Input dtype", "out dtype", "ch_axis", "observer"]
        parts.append("Each layer out qconfig:\n" + tabulate(
            [[r[k] for k in ("name", "type", "input_dtype", "output_dtype", "ch_axis", "observer")]
             for r in self.layer_qconfigs], headers=cols, tablefmt="psql"))
        cols = ["Module Name", "Module Type", "weight dtype", "qscheme", "ch_axis", "observer"]
        parts.append("Weight qconfig:\n" + tabulate(
            [[r[k] for k in ("name", "type", "dtype", "qscheme", "ch_axis", "observer")]
             for r in self.weight_qconfigs], headers=cols, tablefmt="psql"))
        if self.abnormal:
            parts.append("Abnormal qconfigs:\n" + tabulate(
                [(a.where, a.kind, a.message) for a in self.abnormal], headers=["Where", "Kind", "Message"],
                tablefmt="psql"))
        else:
            parts.append("No abnormal qconfigs.")
        return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------- helpers


def _type_str(m: Any) -> str:
    t = m if isinstance(m, type) else type(m)
    return f"{t.__module__}.{t.__qualname__}"


def _observer_name(q: nn.Module) -> str:
    obs = q.activation_post_process if isinstance(q, FakeQuantizeBase) else q
    return type(obs).__name__


def _quantizer_modules(model: nn.Module) -> set[int]:
    """ids of modules inside quantizers (observers of fake quants): not layers of their own."""
    inside = set()
    for m in model.modules():
        if isinstance(m, _QUANTIZERS):
            inside.update(id(c) for c in m.modules() if c is not m)
    return inside


def leaf_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules a forward calls as a whole: graph call targets (GraphModule), else modules
    with no children or with their own parameters; quantizers count as leaves."""
    out: dict[str, nn.Module] = {}
    if isinstance(model, fx.GraphModule):
        for n in model.graph.nodes:
            if n.op == "call_module" and n.target not in out:
                out[n.target] = model.get_submodule(n.target)
        called_ids = {id(m) for m in out.values()}
    else:
        called_ids = set()
    skip: set[int] = set()
    for name, m in model.named_modules(remove_duplicate=True):
        if m is model or id(m) in skip:
            continue
        own = bool(m._parameters) or isinstance(m, (_QUANTIZERS, FusedModule)) or has_weight_layer(m)
        if id(m) in called_ids or own or not list(m.children()):
            if id(m) not in called_ids:
                # inside a called module (graph case) it runs as part of its owner
                if isinstance(model, fx.GraphModule) and _under_called(name, out):
                    continue
                out[name] = m
            skip.update(id(c) for c in m.modules() if c is not m)
    return out


def _under_called(name: str, called: dict[str, nn.Module]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in called for i in range(1, len(parts)))


def _holds_quantizer(m: nn.Module) -> bool:
    if isinstance(m, _QUANTIZERS):
        return True
    return any(isinstance(getattr(m, a, None), _QUANTIZERS) for a in ("activation_post_process", "weight_fake_quant"))


def _count_calls(model: nn.Module, example_inputs: Any) -> dict[str, int]:
    """Calls per leaf module in one forward of a deep copy (hooks, no_grad).

    A copy, because its observers must record (an uncalibrated QAT model has no scales) and
    train-mode BNs update; in the model's own mode, the one a float model is traced in here.
    """
    work = copy.deepcopy(model)
    leaves = leaf_modules(work)
    counts = {name: 0 for name in leaves}
    handles = []
    for name, m in leaves.items():
        def hook(mod, args, out, name=name):
            counts[name] += 1
        handles.append(m.register_forward_hook(hook))
    try:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        with torch.no_grad():
            work(*fresh_args(args))  # the example is the user's: a model may change its input in place
    finally:
        for h in handles:
            h.remove()
    return counts


def _static_counts(gm: fx.GraphModule) -> dict[str, int]:
    leaves = leaf_modules(gm)
    counts = {name: 0 for name in leaves}
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target in counts:
            counts[n.target] += 1
    return counts


# --------------------------------------------------------------------------- unfused patterns


# a fused module's parts in pattern order: a BN folds before the add, the activation comes last
_STAGE = {"batch_norm": 1, "batch_norm1d": 1, "add": 2}


def _already_fused(module: Optional[nn.Module]) -> set[str]:
    if isinstance(module, FusedModule):
        return set(module.fused_from)
    return set()


def _find_unfused(gm: fx.GraphModule) -> list[dict]:
    modules = dict(gm.named_modules(remove_duplicate=False))
    refs: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            refs[n.target] = refs.get(n.target, 0) + 1
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = node.meta.get(META_OP) or node_op(node, modules)
        if op not in _BASE_OPS:
            continue
        where = placement(node)
        if where is not None and where != BPU:
            continue
        fused = _already_fused(modules.get(node.target))
        # how far along base (+bn) (+add) (+act) the fused module already is: only later parts can join
        stage = max([_STAGE.get(p, 3) for p in fused - {op}], default=0)
        best: Optional[tuple[list[fx.Node], str]] = None
        for row in PATTERNS:
            if row.base != op or ("add" in fused and not row.add):
                continue
            chain, labels, cur = [node], [], node
            if row.bn and stage < 1:
                nxt = _user_with_op(cur, (row.bn,), modules, where)
                if nxt is not None:
                    chain.append(nxt)
                    labels.append(row.bn)
                    cur = nxt
            if row.add and "add" not in fused:
                if stage >= 2:
                    continue
                nxt = _user_with_op(cur, ("add",), modules, where, residual=True)
                if nxt is None:
                    continue
                chain.append(nxt)
                labels.append("add")
                cur = nxt
            if row.acts and stage < 3:
                nxt = _user_with_op(cur, row.acts, modules, where)
                if nxt is not None:
                    chain.append(nxt)
                    labels.append(node_op(nxt, modules) or "act")
            if len(chain) > 1 and (best is None or len(chain) > len(best[0])):
                best = (chain, str(row))
        if best is None:
            continue
        chain, pattern = best
        found.append({"nodes": [n.name for n in chain], "pattern": pattern,
                      "reason": _why_not_fused(chain, modules, refs)})
    return found


def _user_with_op(node: fx.Node, ops, modules, where, residual: bool = False) -> Optional[fx.Node]:
    """A user of ``node`` computing one of ``ops`` on its side; ``residual``: only an add of two tensors."""
    for user in node.users:
        if residual and not _adds_a_tensor(user, node):
            continue
        if user.op.startswith("call_") and (user.meta.get(META_OP) or node_op(user, modules)) in ops:
            if where is None or placement(user) in (None, where):
                return user
    return None


def _adds_a_tensor(add: fx.Node, value: fx.Node) -> bool:
    """True if ``add`` adds ``value`` once to another graph value (a residual add).

    ``x + 1.0`` or ``x + buffer`` (a constant) or ``x + x`` is no residual add: the fuse pass leaves it.
    """
    operands = list(add.args) + [add.kwargs[k] for k in ("input", "other") if k in add.kwargs]
    return operands.count(value) == 1 and any(isinstance(a, fx.Node) and a is not value and not _is_constant(a)
                                              for a in operands)


def _is_constant(node: fx.Node) -> bool:
    """A buffer / parameter read (``get_attr``), or the quantizer prepare put on one."""
    return node.op == "get_attr" or node.meta.get(META_STUB) == CONSTANT_QUANT


def _why_not_fused(chain: list[fx.Node], modules, refs) -> str:
    base = chain[0]
    if refs.get(base.target, 0) > 1:
        return f"module '{base.target}' is called by {refs[base.target]} nodes"
    for n in chain[:-1]:
        if len(n.users) > 1:
            users = ", ".join(u.name for u in n.users)
            return f"the output of '{n.name}' is used {len(n.users)} times ({users})"
    module = modules.get(base.target)
    if module is not None and (module._forward_hooks or module._forward_pre_hooks):
        return f"module '{base.target}' has hooks"
    if any(placement(n) is None for n in chain):
        return "not fused yet (float model)"
    for n in chain[1:]:
        if (n.meta.get(META_OP) or node_op(n, modules)) != "add":
            continue
        if n.kwargs:
            kw = ", ".join(f"{k}={v!r}" for k, v in n.kwargs.items())
            return f"'{n.name}' is called with {kw}: only a plain two-operand add fuses"
        shapes = [shape(a) for a in n.args if isinstance(a, fx.Node)]
        if len(shapes) == 2 and None not in shapes and shapes[0] != shapes[1]:
            return (f"'{n.name}' broadcasts {tuple(shapes[0])} with {tuple(shapes[1])}: only an add of "
                    f"two same-shape tensors fuses")
    return "the fuse pass did not match it (module class, shapes or operands)"


# --------------------------------------------------------------------------- qconfigs


def _is_graph_quantizer(node: fx.Node, module: Optional[nn.Module]) -> bool:
    return module is not None and isinstance(module, _QUANTIZERS)


def _output_quantizer(node: fx.Node, module: Optional[nn.Module]) -> Optional[nn.Module]:
    if module is None:
        return None
    if isinstance(module, _QUANTIZERS):
        return module
    q = getattr(module, "activation_post_process", None)
    return q if isinstance(q, _QUANTIZERS) else None


def _dtype_str(q: nn.Module) -> str:
    return str(q.dtype)


def _first_input(node: fx.Node) -> Optional[fx.Node]:
    ins = node.all_input_nodes
    return ins[0] if ins else None


def _layer_rows(gm: fx.GraphModule, result: ModelCheckResult, is_qat: bool) -> None:
    modules = dict(gm.named_modules(remove_duplicate=False))
    out_dtype: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out_dtype[node] = _FLOAT
            continue
        if not node.op.startswith("call_"):
            continue
        module = modules.get(node.target) if node.op == "call_module" else None
        op = node.meta.get(META_OP) or node_op(node, modules)
        src = _first_input(node)
        in_dtype = out_dtype.get(src, _FLOAT) if src is not None else _FLOAT
        q = _output_quantizer(node, module)
        name = node.target if node.op == "call_module" else node.name
        typ = _type_str(module) if module is not None else str(node.target if node.op == "call_method"
                                                              else getattr(node.target, "__name__", node.target))
        on_bpu = placement(node) == BPU
        if q is not None:
            dtype = _dtype_str(q)
            row = dict(name=name, type=typ, input_dtype=in_dtype, output_dtype=dtype, ch_axis=q.ch_axis,
                       observer=_observer_name(q))
            if q.ch_axis >= 0:
                result.abnormal.append(Anomaly(name, "per_channel_activation",
                                               f"activation quantizer has ch_axis={q.ch_axis}; activations "
                                               f"are quantized per tensor (ch_axis=-1)"))
            if in_dtype in ("qint8", "qint16") and dtype != in_dtype and on_bpu and op != "quant":
                result.abnormal.append(Anomaly(name, "mixed_dtype",
                                               f"{in_dtype} input, {dtype} output: an int8/int16 boundary"))
        elif op == "dequant" or (placement(node) is not None and not on_bpu):
            dtype = _FLOAT
            row = dict(name=name, type=typ, input_dtype=in_dtype, output_dtype=dtype, ch_axis="qconfig = None",
                       observer="")
        elif module is not None and has_weight_layer(module) and on_bpu:
            dtype = "qint32"  # declared high-precision output
            row = dict(name=name, type=typ, input_dtype=in_dtype, output_dtype="qint32 (high precision)",
                       ch_axis="qconfig = None", observer="")
            bad = [u.name for u in node.users if placement(u) == BPU and (u.meta.get(META_OP) or node_op(u, modules)) != "dequant"]
            if bad:
                result.abnormal.append(Anomaly(name, "high_precision_not_last",
                                               f"high-precision (int32) output feeds BPU op(s) {', '.join(bad)}; "
                                               f"only an output layer followed by a DeQuantStub may skip its quantizer"))
        else:
            dtype = in_dtype
            row = dict(name=name, type=typ, input_dtype=in_dtype, output_dtype=dtype, ch_axis="qconfig = None",
                       observer="")
            if on_bpu and op not in _SCALE_PRESERVING and op not in ("quant",) and node.meta.get(META_STUB) is None:
                observed = any(isinstance(modules.get(u.target), _QUANTIZERS) for u in node.users
                               if u.op == "call_module")
                users_ok = node.users and all((u.meta.get(META_OP) or node_op(u, modules)) == "dequant"
                                              for u in node.users)
                if not observed and not users_ok:
                    result.abnormal.append(Anomaly(name, "missing_output_quantizer",
                                                   f"BPU op {op or typ} has no output quantizer, is not a declared "
                                                   f"high-precision output and is not followed by a DeQuantStub"))
        out_dtype[node] = dtype
        result.layer_qconfigs.append(row)


def _weight_rows(gm: nn.Module, result: ModelCheckResult, is_graph: bool) -> None:
    modules = dict(gm.named_modules(remove_duplicate=False))
    if is_graph:
        names = [n.target for n in gm.graph.nodes if n.op == "call_module"]
        names = list(dict.fromkeys(names))
    else:
        names = list(modules)
    for name in names:
        m = modules[name]
        if not has_weight_layer(m):
            continue
        base = m.op if isinstance(m, FusedModule) else m
        wfq = getattr(base, "weight_fake_quant", None)
        if wfq is None:
            if hasattr(base, "weight_fake_quant"):
                result.weight_qconfigs.append(dict(name=name, type=_type_str(m), dtype=_FLOAT, qscheme="-",
                                                   ch_axis="qconfig = None", observer=""))
                result.abnormal.append(Anomaly(name, "weight_not_quantized",
                                               "BPU weight layer without a weight quantizer"))
            continue
        result.weight_qconfigs.append(dict(name=name, type=_type_str(m), dtype=_dtype_str(wfq),
                                           qscheme=str(wfq.qscheme).replace("torch.", ""),
                                           ch_axis=wfq.ch_axis, observer=_observer_name(wfq)))
        if wfq.ch_axis < 0:
            result.abnormal.append(Anomaly(name, "per_tensor_weight",
                                           "weight is quantized per tensor; use per-channel (ch_axis=0) weights"))


def _disabled_fake_quants(model: nn.Module, result: ModelCheckResult) -> None:
    for name, m in model.named_modules():
        if isinstance(m, FakeQuantize) and int(m.fake_quant_enabled[0]) != 1:
            result.abnormal.append(Anomaly(name, "fake_quant_disabled",
                                           "fake quant is disabled in a QAT model"))


# --------------------------------------------------------------------------- entry point


def check_qat_model(
    model: nn.Module,
    example_inputs: Any = None,
    save_results: bool = False,
    out_dir: Optional[str] = None,
    *,
    run_forward: bool = True,
    verbose: bool = True,
    printed: bool = True,
) -> ModelCheckResult:
    """Check a calibration/QAT model (or a float one, which is traced) for structures and
    qconfigs that hurt quantized accuracy; see the module docstring.

    Prints the anomalies (a short table; ``verbose=False`` prints nothing when there are
    none; ``printed=False`` prints nothing at all, for a caller that reports the result its own way).
    ``save_results=True`` writes ``model_check_result.txt`` into ``out_dir``
    (default: the working directory). ``run_forward=False`` counts module calls from the
    graph instead of running ``example_inputs`` through a copy of the model.
    """
    if isinstance(model, fx.GraphModule):
        gm = model
    else:
        gm = trace(model, example_inputs=example_inputs)  # defaulted forward args not given: constants
    result = ModelCheckResult()
    result.unfused = _find_unfused(gm)

    if run_forward and example_inputs is not None:
        counts = _count_calls(model, example_inputs)
    else:
        counts = _static_counts(gm) if isinstance(model, fx.GraphModule) else {}
    result.call_counts = counts
    result.shared = {k: v for k, v in counts.items() if v > 1}
    result.never_called = [k for k, v in counts.items() if v == 0]
    mods = dict(model.named_modules(remove_duplicate=False))
    for name, n in result.shared.items():
        if name in mods and _holds_quantizer(mods[name]) and not isinstance(mods[name], _QUANTIZERS):
            result.abnormal.append(Anomaly(name, "shared_module",
                                           f"called {n} times but carries a quantizer: every call shares one "
                                           f"scale; use one module per call"))
    for name in result.never_called:
        if name in mods and _holds_quantizer(mods[name]):
            result.abnormal.append(Anomaly(name, "never_called",
                                           "module with a quantizer is never called: its observer never runs"))

    is_qat = any(isinstance(m, FakeQuantize) for m in model.modules()) and not (
        isinstance(model, fx.GraphModule) and model.meta.get(GM_KIND) == "calibration")
    _layer_rows(gm, result, is_qat)
    _weight_rows(gm, result, True)
    if is_qat:
        _disabled_fake_quants(model, result)

    table = result.anomaly_table() if printed else ""
    if table:
        print("check_qat_model found anomalies:\n" + table)
    elif verbose and printed:
        print("check_qat_model: no anomalies found.")
    if save_results:
        write_file(os.path.join(out_dir or os.getcwd(), RESULT_FILE), result.text().encode("utf-8"), "check_qat_model")
    return result
