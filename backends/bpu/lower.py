"""Lower the BPU partitions of a converted model (``convert_fx``) to :class:`BpuProgram` data.

The converted graph is the source of truth: a node belongs to a BPU
partition when ``node.meta["qc_placement"] == "bpu"`` and
``node.meta["qc_partition"]`` names it (``gm.meta["qc_partitions"]`` lists
node names from before convert, which erased the folded output observers,
so it is not used for membership).  The partition's inputs and outputs are
computed here from the graph edges: an input is a value made outside the
partition and read inside (a float for a ``quantize``, or a QTensor from
another BPU partition); an output is a value made inside and read outside.

Every parameter is read from the converted module: q_weight, the int32
bias, ``M``/``n``, add multipliers, lookup tables.  Where a converted module
computes its multipliers inside ``fixed_point`` on each call (cat, average
pool), the lowering calls the same ``fixed_point`` code once with the same
arguments, so the integers are identical.  A node that has no BPU op kind
raises :class:`~qcompiler.errors.UnsupportedOpError` naming the node and op.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec, encode_index
from qcompiler.errors import ConfigError, UnsupportedOpError
from qcompiler.ir.meta import BPU, META_OP, META_PARTITION, placement, shape
from qcompiler.ir.partitions import partitions
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

__all__ = ["lower_partition", "lower_bpu_partitions", "bpu_partition_names", "partition_boundary"]

_DTYPE_NAMES = {torch.int8: "qint8", torch.qint8: "qint8", torch.int16: "qint16", torch.int32: "qint32",
                torch.qint32: "qint32"}


def _dtype_name(d: Any) -> str:
    if isinstance(d, str) and d in ("qint8", "qint16", "qint32"):
        return str(d)
    name = _DTYPE_NAMES.get(d) if isinstance(d, torch.dtype) else None
    if name is None:
        raise ConfigError(f"unsupported BPU integer type {d!r}; expected qint8, qint16 or qint32")
    return name


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
            return ValueSpec(name, _dtype_name(m.dtype), m.scale)
        if isinstance(m, qnn.QuantizedWeightLayer):
            if m.out_scale is None:
                return ValueSpec(name, "qint32", m.acc_scale.float().tolist(), self._hp_axis(node, m))
            return ValueSpec(name, _dtype_name(m.out_dtype), float(m.out_scale))
        if isinstance(m, qnn.QuantizedSameScale):
            src = node.args[0] if node.args else None
            if not isinstance(src, fx.Node):
                raise UnsupportedOpError(f"node '{name}' ({m.qc_op}): its input is not a BPU value")
            s = self.of(src)
            return ValueSpec(name, s.dtype, s.scale, s.axis)
        if isinstance(m, qnn.QuantizedLookup):
            return ValueSpec(name, _dtype_name(m.table.dtype), m.out_scale)
        if hasattr(m, "out_scale") and hasattr(m, "out_dtype"):
            return ValueSpec(name, _dtype_name(m.out_dtype), float(m.out_scale))
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
    lowering = _Lowering(gm, partition_name, specs)
    ops = [lowering.lower(n) for n in nodes]
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


class _Lowering:
    def __init__(self, gm: fx.GraphModule, partition: str, specs: _Specs) -> None:
        self.gm, self.partition, self.specs = gm, partition, specs

    # -------------------------------------------------------------- helpers

    def fail(self, node: fx.Node, why: str) -> UnsupportedOpError:
        m = self.specs.module(node)
        what = type(m).__name__ if m is not None else f"{node.op} {getattr(node.target, '__name__', node.target)}"
        op = node.meta.get(META_OP)
        return UnsupportedOpError(
            f"node '{node.name}' (op '{op}', {what}) in BPU partition {self.partition}: {why}")

    def value(self, node: fx.Node, arg: Any, what: str = "input") -> str:
        if not isinstance(arg, fx.Node):
            raise self.fail(node, f"{what} {arg!r} is not a graph value")
        return arg.name

    def quantized(self, node: fx.Node, arg: Any, what: str = "input") -> ValueSpec:
        name = self.value(node, arg, what)
        s = self.specs.of(arg)
        if s.is_float:
            raise self.fail(node, f"{what} '{name}' is a float value, not a quantized BPU value")
        return s

    def per_tensor(self, node: fx.Node, arg: Any, what: str = "input") -> ValueSpec:
        s = self.quantized(node, arg, what)
        if s.per_channel:
            raise self.fail(node, f"{what} '{arg.name}' is a per-channel int32 (high-precision) value; "
                                  f"only a dequantize can read it")
        return s

    @staticmethod
    def out(spec: ValueSpec) -> dict:
        return {"out_dtype": spec.dtype, "out_scale": spec.scale, "out_axis": spec.axis}

    def constant_args(self, node: fx.Node, values) -> None:
        for v in values:
            if isinstance(v, fx.Node) or (isinstance(v, (list, tuple)) and any(isinstance(x, fx.Node) for x in v)):
                raise self.fail(node, f"argument {v!r} is computed at run time; BPU layout ops need "
                                      f"static arguments")

    # -------------------------------------------------------------- dispatch

    def lower(self, node: fx.Node) -> BpuOp:
        m = self.specs.module(node)
        if not isinstance(m, qnn.QuantizedModule):
            raise self.fail(node, "not a converted fixed-point module; no BPU op kind for it "
                                  "(was the model converted with convert_fx?)")
        for cls, fn in (
            (qnn.Quantize, self._quantize), (qnn.DeQuantize, self._dequantize), (qnn.Requantize, self._requantize),
            (qnn.QuantizedWeightLayer, self._weight_layer), (qnn.QuantizedAdd, self._add),
            (qnn.QuantizedMul, self._mul), (qnn.QuantizedConstantOperand, self._constant_operand),
            (qnn.QuantizedDiv, self._div), (qnn.QuantizedConstant, self._constant),
            (qnn.QuantizedCat, self._cat), (qnn.QuantizedMatmul, self._matmul),
            (qnn.QuantizedLookup, self._lut), (qnn.QuantizedAvgPool, self._avg_pool),
            (qnn.QuantizedResize, self._resize), (qnn.QuantizedPReLU, self._prelu),
            (qnn.QuantizedSameScale, self._same_scale),
        ):
            if type(m) is cls:
                return fn(node, m)
        raise self.fail(node, f"no BPU op kind for {type(m).__name__}")

    # -------------------------------------------------------------- ops

    def _quantize(self, node, m: qnn.Quantize) -> BpuOp:
        src = node.args[0] if node.args else None
        name = self.value(node, src)
        if not self.specs.of(src).is_float:
            raise self.fail(node, f"quantize of '{name}', which is already quantized")
        spec = self.specs.of(node)
        return BpuOp("quantize", [name], node.name, self.out(spec))

    def _dequantize(self, node, m: qnn.DeQuantize) -> BpuOp:
        src = node.args[0] if node.args else None
        self.quantized(node, src)
        return BpuOp("dequantize", [src.name], node.name, {})

    def _requantize(self, node, m: qnn.Requantize) -> BpuOp:
        x = node.args[0] if node.args else None
        spec = self.per_tensor(node, x)
        if (spec.scale, spec.dtype) != (m.in_scale, _dtype_name(m.in_dtype)):
            raise self.fail(node, f"input {spec.describe()} differs from the module's (scale {m.in_scale!r}, "
                                  f"{m.in_dtype})")
        return BpuOp("requantize", [x.name], node.name, {"in_scale": m.in_scale, **self.out(self.specs.of(node))},
                     {"M": m.M.reshape(()), "n": m.n.reshape(())})

    def _weight_layer(self, node, m: qnn.QuantizedWeightLayer) -> BpuOp:
        x = node.args[0] if node.args else None
        in_spec = self.per_tensor(node, x)
        if abs(in_spec.scale - m.in_scale) > 0:
            raise self.fail(node, f"input scale {in_spec.scale!r} differs from the layer's in_scale {m.in_scale!r}")
        inputs = [x.name]
        if m.with_add:
            other = node.args[1] if len(node.args) > 1 else None
            self.per_tensor(node, other, "add operand")
            inputs.append(other.name)
        g = m.geometry
        attrs: dict[str, Any] = {}
        if m.kind in ("conv2d", "conv_transpose2d"):
            attrs.update(stride=list(fp._pair(g["stride"])), padding=fp.padding_attr(g["padding"]),
                         dilation=list(fp._pair(g["dilation"])), groups=int(g["groups"]))
            if m.kind == "conv_transpose2d":
                attrs["output_padding"] = list(fp._pair(g["output_padding"]))
        hp = m.out_scale is None
        attrs.update(high_precision=hp, act=m.act, with_add=bool(m.with_add), in_scale=float(m.in_scale))
        spec = self.specs.of(node)
        tensors = {"weight": m.q_weight}
        if m.bias is not None:
            tensors["bias"] = m.bias
        if not hp:
            tensors.update(M=m.M, n=m.n)
            if m.with_add:
                tensors.update(Mb=m.Mb.reshape(()), nb=m.nb.reshape(()))
            if m.act == "relu6":
                attrs["act_max"] = _relu6_top(m.out_scale, m.out_dtype)
        elif m.with_add or m.act:
            raise self.fail(node, "a high-precision (int32) output cannot have a fused add or activation")
        attrs.update(self.out(spec))
        return BpuOp(m.kind, inputs, node.name, attrs, tensors)

    def _add(self, node, m: qnn.QuantizedAdd) -> BpuOp:
        a, b = node.args[0], node.args[1]
        self.per_tensor(node, a, "operand a")
        self.per_tensor(node, b, "operand b")
        Ma, na, Mb, nb = (torch.tensor(int(v), dtype=torch.int64) for v in m.params)
        return BpuOp("sub" if m.sub else "add", [a.name, b.name], node.name, self.out(self.specs.of(node)),
                     {"Ma": Ma, "na": na, "Mb": Mb, "nb": nb})

    def _mul(self, node, m: qnn.QuantizedMul) -> BpuOp:
        a, b = node.args[0], node.args[1]
        attrs = self.out(self.specs.of(node))
        tensors = {"M": m.M.reshape(()), "n": m.n.reshape(())}
        if isinstance(a, fx.Node) and isinstance(b, fx.Node):
            self.per_tensor(node, a, "operand a")
            self.per_tensor(node, b, "operand b")
            return BpuOp("mul", [a.name, b.name], node.name, attrs, tensors)
        q = a if isinstance(a, fx.Node) else b
        self.per_tensor(node, q)
        const = m.constant if m.constant is not None else (b if q is a else a)
        attrs.update(const=float(const), sign=int(m.sign))
        return BpuOp("mul", [q.name], node.name, attrs, tensors)

    def _constant_operand(self, node, m: qnn.QuantizedConstantOperand) -> BpuOp:
        """add / sub / mul with a constant: one input, the integers as tensor 'constant'."""
        x = node.args[0] if node.args else None
        spec = self.per_tensor(node, x)
        if spec.scale != m.x_scale:
            raise self.fail(node, f"input scale {spec.scale!r} differs from the module's {m.x_scale!r}")
        attrs = {"constant_index": m.const_index, "constant_scale": m.const_scale, **self.out(self.specs.of(node))}
        if m.qc_op == "mul":
            tensors = {"M": torch.tensor(m.M, dtype=torch.int64), "n": torch.tensor(m.n, dtype=torch.int64)}
        else:
            tensors = {k: torch.tensor(v, dtype=torch.int64) for k, v in zip(("Ma", "na", "Mb", "nb"), m.params)}
        tensors["constant"] = m.constant
        return BpuOp(m.qc_op, [x.name], node.name, attrs, tensors)

    def _constant(self, node, m: qnn.QuantizedConstant) -> BpuOp:
        return BpuOp("constant", [], node.name, self.out(self.specs.of(node)), {"value": m.value})

    def _div(self, node, m: qnn.QuantizedDiv) -> BpuOp:
        a, b = node.args[0], node.args[1]
        sa = self.per_tensor(node, a, "dividend")
        sb = self.per_tensor(node, b, "divisor")
        if (sa.scale, sb.scale, sb.dtype) != (m.sa, m.sb, _dtype_name(m.b_dtype)):
            raise self.fail(node, f"operand quantization ({sa.describe()}, {sb.describe()}) differs from the "
                                  f"module's (scales {m.sa!r}, {m.sb!r}, divisor {m.b_dtype})")
        attrs = {"a_scale": m.sa, "b_scale": m.sb, "b_dtype": sb.dtype, **self.out(self.specs.of(node))}
        return BpuOp("div", [a.name, b.name], node.name, attrs, {"M": m.M, "n": m.n})

    def _cat(self, node, m: qnn.QuantizedCat) -> BpuOp:
        tensors_arg = node.args[0] if node.args else node.kwargs.get("tensors")
        if not isinstance(tensors_arg, (list, tuple)):
            raise self.fail(node, "cat of a non-list argument")
        names = []
        for i, t in enumerate(tensors_arg):
            s = self.per_tensor(node, t, f"input {i}")
            if s.scale != m.in_scales[i]:
                raise self.fail(node, f"input {i} scale {s.scale!r} differs from the module's {m.in_scales[i]!r}")
            names.append(t.name)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        self.constant_args(node, [dim])
        # the multipliers int_cat computes on every call, computed once the same way
        so = fp._f64(m.out_scale, "out_scale")
        Ms, ns = [], []
        for i, s in enumerate(m.in_scales):
            M, n = fp.requant_params(fp._f64(s, f"in_scales[{i}]") / so, mult_bits=qnn.MULT_BITS,
                                     max_shift=qnn.MAX_SHIFT)
            Ms.append(int(M))
            ns.append(int(n))
        attrs = {"dim": int(dim), **self.out(self.specs.of(node))}
        return BpuOp("cat", names, node.name, attrs,
                     {"M": torch.tensor(Ms, dtype=torch.int64), "n": torch.tensor(ns, dtype=torch.int64)})

    def _matmul(self, node, m: qnn.QuantizedMatmul) -> BpuOp:
        a, b = node.args[0], node.args[1]
        self.per_tensor(node, a, "operand a")
        self.per_tensor(node, b, "operand b")
        return BpuOp("matmul", [a.name, b.name], node.name, self.out(self.specs.of(node)),
                     {"M": m.M.reshape(()), "n": m.n.reshape(())})

    def _lut(self, node, m: qnn.QuantizedLookup) -> BpuOp:
        x = node.args[0]
        s = self.per_tensor(node, x)
        if s.dtype != _dtype_name(m.in_dtype):
            raise self.fail(node, f"table is for {m.in_dtype} input but '{x.name}' is {s.dtype}")
        return BpuOp("lut", [x.name], node.name, {"fn": m.qc_op, "in_dtype": s.dtype, **self.out(self.specs.of(node))},
                     {"table": m.table})

    def _avg_pool(self, node, m: qnn.QuantizedAvgPool) -> BpuOp:
        x = node.args[0]
        self.per_tensor(node, x)
        out = self.out(self.specs.of(node))
        if m.kernel is None:
            return BpuOp("global_avg_pool", [x.name], node.name,
                         {"in_scale": m.in_scale, "keepdim": bool(m.keepdim), **out})
        kh, kw = fp._pair(m.kernel)
        stride = fp._pair(m.stride if m.stride is not None else m.kernel)
        M, n = fp.requant_params(fp._f64(m.in_scale, "in_scale") / (kh * kw * fp._f64(m.out_scale, "out_scale")),
                                 mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
        return BpuOp("avg_pool2d", [x.name], node.name,
                     {"kernel_size": [kh, kw], "stride": list(stride), "padding": fp.padding_attr(m.padding), **out},
                     {"M": M.reshape(()), "n": n.reshape(())})

    def _resize(self, node, m: qnn.QuantizedResize) -> BpuOp:
        x = node.args[0]
        self.per_tensor(node, x)
        kind = {"nearest": "resize_nearest", "bilinear": "resize_bilinear"}.get(m.mode)
        if kind is None:
            raise self.fail(node, f"resize mode {m.mode!r} (nearest and bilinear are supported)")
        attrs = {"size": [int(s) for s in m.size], "in_scale": m.in_scale, **self.out(self.specs.of(node))}
        if kind == "resize_bilinear":
            attrs["align_corners"] = bool(m.align_corners)
        return BpuOp(kind, [x.name], node.name, attrs)

    def _prelu(self, node, m: qnn.QuantizedPReLU) -> BpuOp:
        x = node.args[0]
        self.per_tensor(node, x)
        if m.qc_op == "relu6":  # a relu6 with its own output scale: requantize, then clamp
            return BpuOp("relu6", [x.name], node.name, {"max": int(m.top), **self.out(self.specs.of(node))},
                         {"M": m.Mp.reshape(()), "n": m.np_.reshape(())})
        per_channel = m.Mn.numel() > 1
        return BpuOp(m.qc_op, [x.name], node.name, {"axis": 1 if per_channel else None, **self.out(self.specs.of(node))},
                     {"Mp": m.Mp.reshape(()), "np": m.np_.reshape(()),
                      "Mn": m.Mn.reshape(-1) if per_channel else m.Mn.reshape(()),
                      "nn": m.nn_.reshape(-1) if per_channel else m.nn_.reshape(())})

    # -------------------------------------------------------------- same-scale ops

    def _same_scale(self, node, m: qnn.QuantizedSameScale) -> BpuOp:
        x = node.args[0] if node.args else None
        spec = self.per_tensor(node, x)
        out = self.out(self.specs.of(node))
        op = m.qc_op
        if op == "relu":
            return BpuOp("relu", [x.name], node.name, out)
        if op == "relu6":
            return BpuOp("relu6", [x.name], node.name, {"max": _relu6_top(spec.scale, spec.dtype), **out})
        kind, attrs = self._layout(node, m)
        return BpuOp(kind, [x.name], node.name, {**attrs, **out})

    def _layout(self, node: fx.Node, m: qnn.QuantizedSameScale) -> tuple[str, dict]:
        """(kind, attrs) of a layout / pooling op, from the callable convert stored on the module."""
        op = m.qc_op
        args, kwargs = list(node.args[1:]), dict(node.kwargs)
        self.constant_args(node, args + list(kwargs.values()))
        method, module = m.method, m.float_module
        if m.function is None and method is None and module is None:
            if op in ("identity", "dropout"):
                return "identity", {}
            raise self.fail(node, f"cannot tell what the converted '{op}' computes")
        target = method if method is not None else m.function
        if op in ("identity", "dropout"):
            if op == "dropout" and kwargs.get("training", args[1] if len(args) > 1 else False):
                raise self.fail(node, "dropout in training mode")
            return "identity", {}
        if op == "max_pool2d":
            return "max_pool2d", self._max_pool_attrs(node, module, args, kwargs)
        if op == "flatten":
            if module is not None:
                return "flatten", {"start_dim": int(module.start_dim), "end_dim": int(module.end_dim)}
            names = ["start_dim", "end_dim"]
            vals = _bind(node, names, args, kwargs, {"start_dim": 0, "end_dim": -1}, self)
            return "flatten", {"start_dim": int(vals["start_dim"]), "end_dim": int(vals["end_dim"])}
        if op == "reshape":
            name = target if isinstance(target, str) else getattr(target, "__name__", "")
            if name in ("reshape", "view"):
                shp = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
                if "shape" in kwargs:
                    shp = kwargs["shape"]
                return "reshape", {"shape": [int(s) for s in shp]}
            if name == "squeeze":
                dim = args[0] if args else kwargs.get("dim")
                if isinstance(dim, (list, tuple)):
                    raise self.fail(node, "squeeze over several dims")
                return "squeeze", {"dim": None if dim is None else int(dim)}
            if name == "unsqueeze":
                dim = args[0] if args else kwargs["dim"]
                return "unsqueeze", {"dim": int(dim)}
            raise self.fail(node, f"reshape spelled {name!r}")
        if op == "permute":
            dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
            if "dims" in kwargs:
                dims = kwargs["dims"]
            return "permute", {"dims": [int(d) for d in dims]}
        if op == "transpose":
            vals = _bind(node, ["dim0", "dim1"], args, kwargs, {}, self)
            return "transpose", {"dim0": int(vals["dim0"]), "dim1": int(vals["dim1"])}
        if op == "getitem":
            if target is not operator.getitem:
                raise self.fail(node, "getitem spelled differently than operator.getitem")
            try:
                return "getitem", {"index": encode_index(args[0])}
            except ConfigError as e:
                raise self.fail(node, str(e)) from None
        raise self.fail(node, f"no BPU op kind for '{op}'")

    def _max_pool_attrs(self, node, module, args, kwargs) -> dict:
        if module is not None:
            if module.return_indices:
                raise self.fail(node, "max_pool2d with return_indices")
            k = fp._pair(module.kernel_size)
            s = fp._pair(module.stride if module.stride is not None else module.kernel_size)
            return {"kernel_size": list(k), "stride": list(s), "padding": list(fp._pair(module.padding)),
                    "dilation": list(fp._pair(module.dilation)), "ceil_mode": bool(module.ceil_mode)}
        names = ["kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"]
        v = _bind(node, names, args, kwargs,
                  {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False}, self)
        if v["return_indices"]:
            raise self.fail(node, "max_pool2d with return_indices")
        k = fp._pair(v["kernel_size"])
        s = fp._pair(v["stride"]) if v["stride"] not in (None, [], ()) else k
        return {"kernel_size": list(k), "stride": list(s), "padding": list(fp._pair(v["padding"])),
                "dilation": list(fp._pair(v["dilation"])), "ceil_mode": bool(v["ceil_mode"])}


def _bind(node, names, args, kwargs, defaults, lowering) -> dict:
    if len(args) > len(names):
        raise lowering.fail(node, f"too many arguments {args!r}")
    vals = dict(defaults)
    vals.update(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise lowering.fail(node, f"unknown argument {k}={v!r}")
        vals[k] = v
    missing = [n for n in names if n not in vals]
    if missing:
        raise lowering.fail(node, f"missing argument(s) {', '.join(missing)}")
    return vals


def _relu6_top(scale: float, dtype: str) -> int:
    """The upper clamp fixed_point.relu6 uses for ``scale`` (computed by fixed_point itself)."""
    _, qmax = fp.qrange(dtype)
    return int(fp.relu6(torch.tensor([qmax], dtype=torch.int64), scale, dtype)[0])
