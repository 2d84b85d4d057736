"""The one ONNX emitter: FX nodes -> ONNX opset-11 nodes, for CPU islands and whole models.

``emit_graph`` emits a whole GraphModule (a float model, a ``qcompiler.partition``
output, a prepared calibration / QAT model, or a converted model);
``emit_subgraph`` emits a CPU island (a list of node names with the FX values
that cross its boundary). Both walk the graph in order and hand each call node
to the rule the registry (:mod:`.registry`) has for it: a rule keyed by the module class
(quantizers, stubs, converted fixed-point modules) wins, else the rule of the
node's canonical op (``node.meta[META_OP]`` / ``qcompiler.ir.ops.node_op``).
A node without a rule raises :class:`UnsupportedOpError` naming it.

Naming (and so the bytes) is deterministic:

* the ONNX node of an FX node is named ``<partition>/<node>`` (``bpu0/conv0``,
  ``cpu1/selu``) or ``<node>`` when the node has no partition; the extra
  nodes a rule needs are ``<that>/<tag>``;
* the tensor holding an FX node's value is named after the node; helper
  tensors ``<node>/<tag>``;
* parameters are initializers named by their module path (``conv1.op.weight``),
  quantizer scales ``<quantizer path>.scale``;
* the model has ``producer_name="qcompiler"``, a fixed producer version and
  no doc strings.

Quantization (Q/DQ pairs, dequantized weights, the sidecar table) is decided
by the :class:`~qcompiler.backends.onnx.quant.QuantState` the emitter carries:
with ``quantize=False`` every quantizer and stub is an ``Identity`` and the
weights are the float ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import onnx
import torch
import torch.fx as fx
import torch.nn as nn
from onnx import TensorProto, helper

from qcompiler.backends.onnx import rules  # importing it registers every rule family
from qcompiler.backends.onnx.context import (
    DTYPE_TO_ONNX,
    OPSET_VERSION,
    Call,
    GraphBuilder,
    NodeContext,
    Tensor,
    Value,
    call_of,
    is_tensor,
    to_numpy,
)
from qcompiler.backends.onnx.quant import QuantState
from qcompiler.backends.onnx.registry import rule_for
from qcompiler.errors import ConfigError, UnsupportedOpError
from qcompiler.ir.meta import GM_INPUT_SPEC, GM_OUTPUT_SPEC, META_OP, META_TENSOR, TensorInfo
from qcompiler.ir.ops import emit_op
from qcompiler.ir.structure import input_leaf_names
from qcompiler.ir.structure import leaf_names as spec_leaf_names

IR_VERSION = 7  # ONNX 1.8: what opset 11 shipped with; every onnxruntime reads it
PRODUCER_NAME = "qcompiler"
PRODUCER_VERSION = "0.1.0"  # fixed: the same model always gives the same bytes

# ---------------------------------------------------------------------------
# the emitter


@dataclass
class EmitResult:
    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    values: dict[str, Any] = field(default_factory=dict)  # FX node name -> final value names


class OnnxEmitter:
    """Emits FX nodes of one GraphModule; use :func:`emit_graph` / :func:`emit_subgraph`."""

    def __init__(self, gm: fx.GraphModule, *, quantize: bool = False) -> None:
        if not isinstance(gm, fx.GraphModule):
            raise ConfigError(f"the ONNX emitter takes a torch.fx.GraphModule, got {type(gm).__name__}")
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self._paths: dict[int, str] = {}
        for path, m in gm.named_modules(remove_duplicate=False):
            self._paths.setdefault(id(m), path)
        self.builder = GraphBuilder(reserved=(n.name for n in gm.graph.nodes))
        self.quant = QuantState(quantize)
        self.values: dict[fx.Node, Value] = {}
        self.onnx_nodes: dict[str, list[str]] = {}
        self.scalars: set[str] = set()  # 0-d int64 tensors (sizes), for reshape arguments

    # -- helpers for rules
    def path_of(self, module: nn.Module) -> str:
        return self._paths.get(id(module), type(module).__name__)

    def record_onnx_node(self, node: fx.Node, name: str) -> None:
        self.onnx_nodes.setdefault(node.name, []).append(name)

    def value_of(self, a: Any, user: Optional[fx.Node] = None) -> Value:
        if isinstance(a, fx.Node):
            if a not in self.values:
                if a.op == "get_attr":
                    self.values[a] = self._get_attr(a)
                else:
                    where = f" (used by '{user.name}')" if user is not None else ""
                    raise ConfigError(f"the value of FX node '{a.name}'{where} is not available: it is "
                                      f"neither emitted nor an input of the graph being emitted")
            return self.values[a]
        if isinstance(a, (list, tuple)):
            vals = [self.value_of(v, user) for v in a]
            return vals if type(a) is list else tuple(vals)
        if isinstance(a, dict):
            return {k: self.value_of(v, user) for k, v in a.items()}
        return a

    # -- graph pieces
    def _get_attr(self, node: fx.Node) -> Value:
        obj: Any = self.gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.Tensor):
            return self.builder.initializer(str(node.target), to_numpy(obj))
        return obj

    def _declare_input(self, name: str, info: Any, dynamic: dict[int, str]) -> onnx.ValueInfoProto:
        elem = DTYPE_TO_ONNX.get(info.dtype, TensorProto.FLOAT) if isinstance(info, TensorInfo) else TensorProto.FLOAT
        self.builder.dtypes[name] = elem
        shape = list(info.shape) if isinstance(info, TensorInfo) else None
        return _value_info(name, elem, shape, dynamic)

    def _emit_call(self, node: fx.Node, node_filter: Optional[Callable[[fx.Node], bool]]) -> None:
        call = call_of(node, self.modules)
        op = node.meta.get(META_OP) or emit_op(node, self.modules)
        ctx = NodeContext(self, node, call, op)
        if node_filter is not None and not node_filter(node):
            ins = [a for a in node.all_input_nodes]
            if len(ins) != 1:
                raise ctx.unsupported("node_filter skips it, but only single-input nodes can be skipped")
            self.values[node] = self.value_of(ins[0], node)
            return
        rule = rule_for(call.module, op, OPSET_VERSION)
        if rule is None:
            why = rules.NOT_EMITTED.get(op, "no emit rule for this op")
            raise ctx.unsupported(f"{why}; run it in a supported form or keep it out of the exported graph")
        start = len(self.builder.nodes)
        try:
            value = rule(ctx)
        except (UnsupportedOpError, ConfigError):
            raise
        except KeyError as exc:
            raise ctx.unsupported(f"missing argument {exc}") from None
        if is_tensor(value) and node.op == "call_function" and getattr(node.target, "__module__", None) in (
                "_operator", "operator") and any(is_tensor(self.values.get(a)) for a in node.all_input_nodes) \
                and all(self.values.get(a) in self.scalars for a in node.all_input_nodes
                        if is_tensor(self.values.get(a))):
            self.scalars.add(value)  # python arithmetic on sizes (x.size(0) * 2): a 0-d int, as its inputs
        if is_tensor(value) and value in self.builder.produced_since(start) and value != node.name \
                and node.name not in self.builder.used:
            self.builder.rename_in(start, value, node.name)
            self.quant.renamed(value, node.name)
            if value in self.scalars:
                self.scalars.add(node.name)
            value = Tensor(node.name)
        self.values[node] = value

    def _walk(self, nodes: Iterable[fx.Node], node_filter=None) -> None:
        for node in nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                if node not in self.values:
                    self.values[node] = self._get_attr(node)
                continue
            self._emit_call(node, node_filter)

    def _outputs(self, values: list[Value], infos: list[Any], names: list[str],
                 dynamic: dict[str, dict[int, str]]) -> list[onnx.ValueInfoProto]:
        """Graph outputs called ``names``: the producing node's output is renamed when it
        can be, else an Identity is added."""
        outs = []
        claimed: set[str] = set()
        for v, info, name in zip(values, infos, names):
            if is_tensor(v):
                v = Tensor(self.builder.final_name(v))  # an earlier output may have renamed it
            else:
                raise UnsupportedOpError(f"graph output '{name}' is not a tensor ({type(v).__name__}); "
                                         f"only tensor outputs can be exported")
            produced = any(v in n.output for n in self.builder.nodes)
            graph_input = v in self._graph_input_names
            if v == name and name not in claimed:
                final = v
            elif produced and not graph_input and v not in claimed and name not in self.builder.used \
                    and not self.builder.is_initializer(v):
                self.builder.rename_in(0, v, name)
                self.quant.renamed(v, name)
                self.values = {k: _rename_value(val, v, name) for k, val in self.values.items()}
                final = name
            else:
                t = self.builder.claim(name)
                nm = self.builder.node_name(f"{name}/identity")
                self.builder.add_node("Identity", [v], [t], nm, {})
                self.builder.dtypes[t] = self.builder.dtypes.get(v, TensorProto.FLOAT)
                final = t
            claimed.add(final)
            elem = self.builder.dtypes.get(final, TensorProto.FLOAT)
            if isinstance(info, TensorInfo):
                elem = DTYPE_TO_ONNX.get(info.dtype, elem)
            shape = list(info.shape) if isinstance(info, TensorInfo) else None
            outs.append(_value_info(final, elem, shape, dynamic.get(name, {})))
        return outs

    def _model(self, graph_name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.builder.nodes, graph_name, inputs, outputs,
                                  initializer=list(self.builder.initializers.values()))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET_VERSION)],
                                  producer_name=PRODUCER_NAME, producer_version=PRODUCER_VERSION)
        model.ir_version = IR_VERSION
        return model

    # -- entry points
    def emit_graph(self, *, input_names: Optional[Sequence[str]] = None,
                   output_names: Optional[Sequence[str]] = None,
                   node_filter: Optional[Callable[[fx.Node], bool]] = None,
                   input_infos: Optional[list[Any]] = None,
                   dynamic_axes: Optional[dict[str, dict[int, str]]] = None,
                   batch_axis: Optional[str] = None) -> EmitResult:
        """``batch_axis``: a label for dim 0 of every graph input and output that ``dynamic_axes``
        does not name (the caller has proven the graph per-sample along dim 0)."""
        dynamic = dict(dynamic_axes or {})
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        defaults, flat_infos = graph_input_leaves(self.gm)
        if input_infos is not None:
            if len(input_infos) != len(flat_infos):
                raise ConfigError(f"the model takes {len(flat_infos)} input tensor(s) "
                                  f"({', '.join(defaults)}), got {len(input_infos)}")
            flat_infos = list(input_infos)
        names = _check_names(input_names, defaults, "input_names")
        named = set(dynamic)
        if batch_axis is not None:
            dynamic.update({n: {0: batch_axis} for n in names if n not in named})
        self._graph_input_names = set()
        graph_inputs = []
        k = 0
        for ph in placeholders:
            info = ph.meta.get(META_TENSOR)
            tensors = []
            for _ in range(len(_flatten_info(info))):
                t = self.builder.claim(names[k])
                self._graph_input_names.add(t)
                check_dynamic_axes(names[k], dynamic.get(names[k], {}), flat_infos[k])
                graph_inputs.append(self._declare_input(t, flat_infos[k], dynamic.get(names[k], {})))
                tensors.append(t)
                k += 1
            self.values[ph] = _unflatten(info, iter(tensors)) if isinstance(info, (tuple, list)) else (
                tensors[0] if tensors else None)
        self._walk(self.gm.graph.nodes, node_filter)
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        out_vals = _flatten_value(self.value_of(out_node.args[0], out_node))
        out_infos = _flatten_info(out_node.meta.get(META_TENSOR))
        if len(out_infos) != len(out_vals):
            out_infos = [None] * len(out_vals)
        out_default = ["output"] if len(out_vals) == 1 else [f"output_{i}" for i in range(len(out_vals))]
        spec = self.gm.meta.get(GM_OUTPUT_SPEC)
        if spec is not None and spec.num_leaves == len(out_vals):  # named by where they sit: out, aux, 0.1
            out_default = spec_leaf_names(spec)
        out_names = _check_names(output_names, out_default, "output_names")
        if batch_axis is not None:
            dynamic.update({n: {0: batch_axis} for n in out_names if n not in named})
        for name in list(dynamic):
            if name not in names and name not in out_names:
                raise ConfigError(f"dynamic_axes names {name!r}, which is neither an input "
                                  f"({', '.join(names)}) nor an output ({', '.join(out_names)}); "
                                  f"use one of these names")
        for name, info in zip(out_names, out_infos):
            check_dynamic_axes(name, dynamic.get(name, {}), info)
        graph_outputs = self._outputs(out_vals, out_infos, out_names, dynamic)
        model = self._model(type(self.gm).__name__ or "graph", graph_inputs, graph_outputs)
        if any(dynamic.get(n) for n in names):
            _free_output_dims(model, {n: dynamic[n] for n in names if dynamic.get(n)}, dynamic)
        return EmitResult(model, [vi.name for vi in graph_inputs], [vi.name for vi in graph_outputs],
                          self._final_values())

    def emit_subgraph(self, node_names: Sequence[str], inputs: Sequence[str], outputs: Sequence[str], *,
                      dynamic_batch: bool = False) -> EmitResult:
        by_name = {n.name: n for n in self.gm.graph.nodes}
        for what, names in (("node", node_names), ("input", inputs), ("output", outputs)):
            missing = [n for n in names if n not in by_name]
            if missing:
                raise ConfigError(f"emit_subgraph: {what} name(s) {missing} are not nodes of the graph")
        chosen = set(node_names)
        outside = [n for n in outputs if n not in chosen and n not in inputs]
        if outside:
            raise ConfigError(f"emit_subgraph: output(s) {outside} are neither island nodes nor inputs")
        # dynamic_batch: the batch is dim 0 of most values but not all (an LSTM state is
        # (layers, batch, hidden)); the island's ops take their sizes from their inputs, so every
        # boundary dim is left free, dim 0 named "batch"
        dyn = _FreeDims({0: "batch"}) if dynamic_batch else {}
        self._graph_input_names = set()
        graph_inputs = []
        for name in inputs:
            node = by_name[name]
            info = node.meta.get(META_TENSOR)
            tensors = []
            for leaf_name, leaf in zip(leaf_names(name, info), _flatten_info(info)):
                t = self.builder.claim(leaf_name)
                graph_inputs.append(self._declare_input(t, leaf, dyn))
                tensors.append(t)
            self.values[node] = _unflatten(info, iter(tensors))
            self._graph_input_names.update(_flatten_value(self.values[node]))
        ordered = [n for n in self.gm.graph.nodes if n.name in chosen and n.name not in inputs]
        self._walk(ordered)
        out_vals, out_infos, out_names = [], [], []
        for name in outputs:
            node = by_name[name]
            vals = _flatten_value(self.values[node])
            infos = _flatten_info(node.meta.get(META_TENSOR))
            if len(infos) != len(vals):
                infos = [None] * len(vals)
            out_vals.extend(vals)
            out_infos.extend(infos)
            out_names.extend(leaf_names(name, self.values[node]))
        graph_outputs = self._outputs(out_vals, out_infos, out_names,
                                      {n: dyn for n in out_names} if dyn else {})
        model = self._model("island", graph_inputs, graph_outputs)
        return EmitResult(model, [vi.name for vi in graph_inputs], [vi.name for vi in graph_outputs],
                          self._final_values())

    def _final_values(self) -> dict[str, Any]:
        def fin(v):
            if is_tensor(v):
                return self.builder.final_name(v)
            if isinstance(v, (tuple, list)):
                return type(v)(fin(e) for e in v)
            return None
        return {n.name: fin(v) for n, v in self.values.items()}


def _rename_value(v: Value, old: str, new: str) -> Value:
    if is_tensor(v):
        return Tensor(new) if v == old else v
    if isinstance(v, (tuple, list)):
        return type(v)(_rename_value(e, old, new) for e in v)
    return v


class _FreeDims(dict):
    """Dynamic axes where every dim not named is unknown (symbolic) too."""


def _value_info(name: str, elem: int, shape: Optional[list], dynamic: dict[int, str]) -> onnx.ValueInfoProto:
    if shape is None:
        return helper.make_tensor_value_info(name, elem, None)
    dims: list[Any] = [None] * len(shape) if isinstance(dynamic, _FreeDims) else list(shape)
    for axis, label in dynamic.items():
        if -len(dims) <= axis < len(dims):
            dims[axis] = label
    return helper.make_tensor_value_info(name, elem, dims)


def graph_input_leaves(gm: fx.GraphModule) -> tuple[list[str], list[Any]]:
    """Default names and recorded TensorInfos (None where unknown) of the graph's input tensors,
    tuple inputs flattened (``hidden.0``, ``hidden.1``)."""
    names: list[str] = []
    infos: list[Any] = []
    for ph in gm.graph.nodes:
        if ph.op == "placeholder":
            info = ph.meta.get(META_TENSOR)
            names.extend(leaf_names(str(ph.target).lstrip("*"), info))
            infos.extend(_flatten_info(info))
    spec = gm.meta.get(GM_INPUT_SPEC)
    if spec is not None:  # keyword inputs by their keywords (input_ids, attention_mask)
        names = input_leaf_names(spec, names)
    return names, infos


def check_dynamic_axes(name: str, axes: dict[int, str], info: Any) -> None:
    """Every dynamic axis of graph input/output ``name`` exists in its recorded shape."""
    if not isinstance(info, TensorInfo):
        return
    rank = len(info.shape)
    bad = [a for a in axes if not -rank <= a < rank]
    if bad:
        raise ConfigError(f"dynamic_axes[{name!r}]: axis {bad[0]} does not exist in '{name}', whose shape is "
                          f"{tuple(info.shape)} (rank {rank}); use axes 0..{rank - 1}")


def _free_output_dims(model: onnx.ModelProto, input_axes: dict[str, dict[int, str]],
                      dynamic: dict[str, dict[int, str]]) -> None:
    """Output dims that follow dynamic input axes become symbolic (in place).

    Dynamic input axes may change output sizes too (the batch), so an output must not claim its
    traced size there, or onnxruntime warns and consumers allocate wrongly. ONNX shape inference
    with the inputs' symbolic dims tells which dims vary: they take the input's label when it
    propagates (``batch``), else ``<output>_dynamic_axes_<k+1>``; dims it leaves unknown are
    treated as varying. Axes the caller named in ``dynamic_axes`` keep their label.
    """
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for o in probe.graph.output:
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True).graph.output
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        inferred = []
    found = {o.name: list(o.type.tensor_type.shape.dim) for o in inferred if o.type.tensor_type.HasField("shape")}
    labels = {label for axes in input_axes.values() for label in axes.values()}
    for o in model.graph.output:
        if not o.type.tensor_type.HasField("shape"):
            continue
        dims = o.type.tensor_type.shape.dim
        declared = {a % len(dims) for a in dynamic.get(o.name, {})}
        got = found.get(o.name)
        if got is not None and len(got) != len(dims):
            got = None
        for k, d in enumerate(dims):
            g = got[k] if got is not None else None
            if k in declared or (g is not None and g.HasField("dim_value")):
                continue
            label = g.dim_param if g is not None and g.dim_param in labels else f"{o.name}_dynamic_axes_{k + 1}"
            d.Clear()
            d.dim_param = label


def leaf_names(base: str, structure: Any) -> list[str]:
    """Names of the leaves of a (nested) tuple value: ``v`` itself, or ``v.0``, ``v.1.0``, ``v.1.1``..."""
    if isinstance(structure, (tuple, list)):
        return [n for i, sub in enumerate(structure) for n in leaf_names(f"{base}.{i}", sub)]
    return [base]


def _flatten_info(info: Any) -> list[Any]:
    if isinstance(info, (tuple, list)):
        return [leaf for i in info for leaf in _flatten_info(i)]
    return [info]


def _flatten_value(v: Value) -> list[Any]:
    if isinstance(v, (tuple, list)):
        return [leaf for e in v for leaf in _flatten_value(e)]
    return [v]


def _unflatten(info: Any, leaves) -> Value:
    if isinstance(info, (tuple, list)):
        return tuple(_unflatten(i, leaves) for i in info)
    return next(leaves)


def _check_names(names: Optional[Sequence[str]], defaults: list[str], what: str) -> list[str]:
    if names is None:
        return list(defaults)
    names = list(names)
    if len(names) != len(defaults) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{what} must be {len(defaults)} non-empty strings (default: "
                          f"{defaults}), got {names!r}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{what} has duplicates: {names!r}")
    return names


# ---------------------------------------------------------------------------
# public API


def emit_graph(gm: fx.GraphModule, *, input_names: Optional[Sequence[str]] = None,
               output_names: Optional[Sequence[str]] = None,
               node_filter: Optional[Callable[[fx.Node], bool]] = None,
               quantize: bool = False) -> onnx.ModelProto:
    """A whole GraphModule as an ONNX opset-11 model.

    Placeholders become graph inputs (named after the forward arguments; a tuple
    argument ``hidden`` becomes ``hidden.0``, ``hidden.1``, nested ``v.1.0``), the output's (nested)
    tuple is flattened in order into ``output`` / ``output_0``, ``output_1``...
    ``node_filter(node) -> bool``: nodes it rejects are not emitted; each must have one
    input, whose value it passes on (e.g. drop stubs for a bare float graph).
    ``quantize=True`` emits the quantization of a prepared / converted model
    (see :mod:`qcompiler.backends.onnx.quant`); by default quantizers are Identities.
    """
    em = OnnxEmitter(gm, quantize=quantize)
    return em.emit_graph(input_names=input_names, output_names=output_names, node_filter=node_filter).model


def emit_subgraph(gm: fx.GraphModule, node_names: Sequence[str], inputs: Sequence[str],
                  outputs: Sequence[str], *, dynamic_batch: bool = False,
                  quantize: bool = False) -> onnx.ModelProto:
    """A CPU island: the nodes ``node_names`` of ``gm`` as an ONNX opset-11 model.

    ``inputs``/``outputs`` are the FX node names whose values cross the island
    boundary (e.g. ``Partition.inputs`` / ``.outputs``); they become graph inputs and
    outputs of the same names, with shapes and dtypes from ``node.meta[META_TENSOR]``
    (a tuple value ``v`` becomes ``v.0``, ``v.1``..., nested ones ``v.1.0``). ``dynamic_batch`` declares
    every boundary dim symbolic, dim 0 named ``"batch"`` (the batch is not always dim 0: an LSTM
    state is ``(layers, batch, hidden)``; the island's ops read sizes from their inputs).
    """
    em = OnnxEmitter(gm, quantize=quantize)
    return em.emit_subgraph(node_names, inputs, outputs, dynamic_batch=dynamic_batch).model


def emit_island(gm: fx.GraphModule, name: str, node_names: Sequence[str], inputs: Sequence[str],
                outputs: Sequence[str]) -> onnx.ModelProto:
    """The CPU island ``name`` as ONNX (:func:`emit_subgraph` with a dynamic batch), checked the way
    onnxruntime loads it (``onnx.checker`` full check: strict shape and type inference).

    Any failure is an :class:`UnsupportedOpError` that says why, which lowering answers by running the
    island in eager torch: a rule's refusal as it is, and else (a model the checker rejects, a rule that
    fails on arguments it did not foresee) one naming the island, so that a gap in the emitter costs speed,
    never a compile or a wrong answer (the reason shows in dumps and ``summary()``).
    """
    try:
        model = emit_subgraph(gm, node_names, inputs, outputs, dynamic_batch=True)
        onnx.checker.check_model(model, full_check=True)
    except UnsupportedOpError:
        raise
    except Exception as exc:  # noqa: BLE001  (any emitter or checker failure: the island runs in torch)
        lines = str(exc).strip().splitlines()
        raise UnsupportedOpError(
            f"CPU island {name} (nodes {', '.join(node_names)}): its ONNX form failed "
            f"({type(exc).__name__}: {lines[0][:300] if lines else ''})") from exc
    return model


__all__ = [
    "emit_graph",
    "emit_island",
    "emit_subgraph",
    "OnnxEmitter",
    "NodeContext",
    "Call",
    "Tensor",
    "EmitResult",
    "graph_input_leaves",
    "check_dynamic_axes",
    "OPSET_VERSION",
    "PRODUCER_NAME",
    "PRODUCER_VERSION",
]
