"""Lower the BPU partitions of a converted model (``convert_fx``) to :class:`BpuProgram` data.

The converted graph is the source of truth: a node belongs to a BPU
partition when ``node.meta[META_PLACEMENT] == BPU`` and
``node.meta[META_PARTITION]`` names it (``gm.meta[GM_PARTITIONS]`` lists
node names from before convert, which erased the folded output observers,
so it is not used for membership).  The partition's inputs and outputs are
computed here from the graph edges: an input is a value made outside the
partition and read inside (a float for a ``quantize``, or a QTensor from
another BPU partition); an output is a value made inside and read outside.

Every parameter is read from the converted module: q_weight, the int32
bias, ``M``/``n``, add multipliers, lookup tables.  Where a converted module
computes its multipliers inside ``fixed_point`` on each call (cat, average
pool), the lowering calls the same ``fixed_point`` code once with the same
arguments, so the integers are identical.

This module is the driver: the partition boundary, the value specs and the walk.
How each converted module becomes a program op is a rule of its family in
:mod:`qcompiler.backends.bpu.lowering`, which sees the node through a
:class:`LoweringContext`.  A node that has no BPU op kind raises
:class:`~qcompiler.errors.UnsupportedOpError` naming the node and op.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu.lowering.common import dtype_name
from qcompiler.backends.bpu.lowering.registry import rule_for  # runs the lowering package: registers the rules
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec, encode_index
from qcompiler.errors import ConfigError, InternalError, UnsupportedOpError
from qcompiler.ir.meta import BPU, META_OP, META_PARTITION, placement, shape
from qcompiler.ir.ops import Binding, bind
from qcompiler.ir.partitions import partitions
from qcompiler.nn import quantized as qnn

__all__ = ["lower_partition", "lower_bpu_partitions", "bpu_partition_names", "partition_boundary", "LoweringContext"]


def _is_bpu(node: fx.Node) -> bool:
    return placement(node) == BPU and node.meta.get(META_PARTITION) is not None


def bpu_partition_names(gm: fx.GraphModule) -> list[str]:
    """Names of the BPU partitions that still have nodes, in the recorded partition order."""
    seen: list[str] = []
    for node in gm.graph.nodes:
        if _is_bpu(node) and node.meta[META_PARTITION] not in seen:
            seen.append(node.meta[META_PARTITION])
    recorded = [p.name for p in partitions(gm) if p.name in seen]
    return recorded + [n for n in seen if n not in recorded]


def partition_boundary(gm: fx.GraphModule, name: str) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """``(nodes, inputs, outputs)`` of BPU partition ``name`` from the graph edges, in graph order.

    ``inputs`` are producers outside the partition read by its nodes (order of
    first use); ``outputs`` are partition nodes with a user outside it.
    """
    nodes = [n for n in gm.graph.nodes if _is_bpu(n) and n.meta[META_PARTITION] == name]
    if not nodes:
        raise ConfigError(f"no BPU partition named {name!r}; BPU partitions: "
                          + (", ".join(bpu_partition_names(gm)) or "none"))
    members = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    return nodes, inputs, outputs


# ---------------------------------------------------------------------------- value specs


class _Specs:
    """Quantization of node values (memoized): what each converted module produces."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.memo: dict[fx.Node, ValueSpec] = {}

    def module(self, node: fx.Node) -> Optional[nn.Module]:
        return self.gm.get_submodule(node.target) if node.op == "call_module" else None

    def of(self, node: fx.Node) -> ValueSpec:
        if node in self.memo:
            return self.memo[node]
        spec = self._compute(node)
        self.memo[node] = spec
        return spec

    def _compute(self, node: fx.Node) -> ValueSpec:
        m = self.module(node)
        name = node.name
        if not _is_bpu(node) or m is None or isinstance(m, qnn.DeQuantize):
            return ValueSpec(name, "f32")
        if isinstance(m, qnn.Quantize):
            return ValueSpec(name, dtype_name(m.dtype), m.scale)
        if isinstance(m, qnn.QuantizedWeightLayer):
            if m.out_scale is None:
                return ValueSpec(name, "qint32", m.acc_scale.float().tolist(), self._hp_axis(node, m))
            return ValueSpec(name, dtype_name(m.out_dtype), float(m.out_scale))
        if isinstance(m, qnn.QuantizedSameScale):
            src = node.args[0] if node.args else None
            if not isinstance(src, fx.Node):
                raise UnsupportedOpError(f"node '{name}' ({m.qc_op}): its input is not a BPU value")
            s = self.of(src)
            return ValueSpec(name, s.dtype, s.scale, s.axis)
        if isinstance(m, qnn.QuantizedLookup):
            return ValueSpec(name, dtype_name(m.table.dtype), m.out_scale)
        if hasattr(m, "out_scale") and hasattr(m, "out_dtype"):
            return ValueSpec(name, dtype_name(m.out_dtype), float(m.out_scale))
        return ValueSpec(name, "f32")

    @staticmethod
    def _hp_axis(node: fx.Node, m: qnn.QuantizedWeightLayer) -> int:
        if m.kind != "linear":
            return 1
        shp = shape(node)
        return (len(shp) - 1) if shp else -1


# ---------------------------------------------------------------------------- lowering


def lower_bpu_partitions(converted_gm: fx.GraphModule) -> dict[str, BpuProgram]:
    """Every BPU partition of a converted model as a program, keyed by partition name."""
    return {name: lower_partition(converted_gm, name) for name in bpu_partition_names(converted_gm)}


def lower_partition(converted_gm: fx.GraphModule, partition_name: str) -> BpuProgram:
    """The BPU program of one partition of a ``convert_fx`` model."""
    gm = converted_gm
    nodes, ins, outs = partition_boundary(gm, partition_name)
    specs = _Specs(gm)
    inputs = []
    for a in ins:
        s = specs.of(a)
        inputs.append(ValueSpec(a.name, s.dtype, s.scale, s.axis))
    ops = [_lower_node(partition_name, specs, n) for n in nodes]
    out_specs = {op.output: op.out_spec() for op in ops}
    outputs = [out_specs[n.name] for n in outs]
    # float inputs must only be read by quantize (a quantized op on a float is a convert bug)
    float_inputs = {v.name for v in inputs if v.is_float}
    for op in ops:
        bad = [i for i in op.inputs if i in float_inputs]
        if bad and op.kind not in ("quantize", "dequantize"):
            raise UnsupportedOpError(
                f"node '{op.output}' ({op.kind}) in {partition_name}: reads the float value "
                f"'{bad[0]}' from outside the partition; only a quantize can take a float input")
    return BpuProgram(partition_name, inputs, outputs, ops)


class LoweringContext:
    """One node as its lowering rule (:mod:`qcompiler.backends.bpu.lowering`) sees it: the converted
    module, the node's arguments, the quantization of its inputs and output, and errors naming it."""

    def __init__(self, partition: str, specs: _Specs, node: fx.Node) -> None:
        self.partition, self.specs, self.node = partition, specs, node
        self.module = specs.module(node)

    def fail(self, why: str) -> UnsupportedOpError:
        """An error naming the node, its op, its module and the partition, saying ``why``."""
        node, m = self.node, self.module
        what = type(m).__name__ if m is not None else f"{node.op} {getattr(node.target, '__name__', node.target)}"
        return UnsupportedOpError(
            f"node '{node.name}' (op '{node.meta.get(META_OP)}', {what}) in BPU partition {self.partition}: {why}")

    # -------------------------------------------------------------- arguments

    def arg(self, index: int, name: Optional[str] = None, default: Any = None) -> Any:
        """Positional argument ``index``, else keyword ``name``, else ``default`` (an operand)."""
        args = self.node.args
        if index < len(args):
            return args[index]
        return self.node.kwargs.get(name, default) if name is not None else default

    def rest(self) -> tuple[list, dict]:
        """The arguments after the input, as written: positional ones, and keywords."""
        return list(self.node.args[1:]), dict(self.node.kwargs)

    @cached_property
    def args(self) -> Binding:
        """Every argument by name (:func:`qcompiler.ir.ops.bind`: a same-scale module's stored call or
        float module, else the signature of its op), with the defaults; UnsupportedOpError on too many,
        unknown or missing ones."""
        binding = bind(self.node, {self.node.target: self.module} if self.module is not None else {})
        if binding is None:
            raise self.fail("its arguments cannot be read by name (no op of the registry)")
        return binding

    def constant_args(self, values) -> None:
        """Fails when one of ``values`` (or an element of one) is computed at run time."""
        for v in values:
            if isinstance(v, fx.Node) or (isinstance(v, (list, tuple)) and any(isinstance(x, fx.Node) for x in v)):
                raise self.fail(f"argument {v!r} is computed at run time; BPU layout ops need static arguments")

    def index(self, idx: Any) -> Any:
        """A static getitem index as program data."""
        try:
            return encode_index(idx)
        except ConfigError as e:
            raise self.fail(str(e)) from None

    # -------------------------------------------------------------- values

    def spec(self, arg: fx.Node) -> ValueSpec:
        """The quantization of value ``arg`` (f32 for a float)."""
        return self.specs.of(arg)

    def value(self, arg: Any, what: str = "input") -> str:
        """The name of graph value ``arg``."""
        if not isinstance(arg, fx.Node):
            raise self.fail(f"{what} {arg!r} is not a graph value")
        return arg.name

    def quantized(self, arg: Any, what: str = "input") -> ValueSpec:
        """The quantization of ``arg``, which must be a quantized BPU value."""
        name = self.value(arg, what)
        s = self.specs.of(arg)
        if s.is_float:
            raise self.fail(f"{what} '{name}' is a float value, not a quantized BPU value")
        return s

    def per_tensor(self, arg: Any, what: str = "input") -> ValueSpec:
        """The quantization of ``arg``, which must be quantized per tensor."""
        s = self.quantized(arg, what)
        if s.per_channel:
            raise self.fail(f"{what} '{arg.name}' is a per-channel int32 (high-precision) value; "
                            f"only a dequantize can read it")
        return s

    def out(self) -> dict:
        """The output's quantization as op attributes."""
        spec = self.specs.of(self.node)
        return {"out_dtype": spec.dtype, "out_scale": spec.scale, "out_axis": spec.axis}

    def emit(self, kind: str, inputs: list[str], attrs: dict, tensors: Optional[dict] = None) -> BpuOp:
        """The program op computing this node."""
        return BpuOp(kind, inputs, self.node.name, attrs, tensors or {})


def _lower_node(partition: str, specs: _Specs, node: fx.Node) -> BpuOp:
    """The op of one partition node, by the rule registered for its converted module."""
    ctx = LoweringContext(partition, specs, node)
    if not isinstance(ctx.module, qnn.QuantizedModule):
        raise ctx.fail("not a converted fixed-point module; no BPU op kind for it "
                       "(was the model converted with convert_fx?)")
    rule = rule_for(ctx)
    op = rule.fn(ctx)
    if op.kind not in rule.emits:
        raise InternalError(f"node '{node.name}' in BPU partition {partition}: {rule.name} emitted a "
                            f"'{op.kind}', which it does not declare")
    return op
