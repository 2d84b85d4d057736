"""Rules of the quantized graph: quantizers and stubs of a prepared model, and the fixed-point
modules of a converted model (keyed by module class), plus quantized constants."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from onnx import TensorProto

from qcompiler.backends.onnx.context import (
    Call,
    NodeContext,
    Tensor,
    is_tensor,
    to_numpy,
)
from qcompiler.backends.onnx.registry import emits, emits_module, op_rule
from qcompiler.backends.onnx.rules.conv import _pads, conv, conv_transpose, linear_op
from qcompiler.backends.onnx.rules.elementwise import clip, identity, prelu_slope_shape
from qcompiler.backends.onnx.rules.integer_layer import float_form_reason, integer_weight_layer, requantize
from qcompiler.backends.onnx.rules.pool import avg_pool, resize
from qcompiler.compat import torch_ao as ao
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fake_quantize import FakeQuantizeBase
from qcompiler.quantization.fixed_point import dtype_name
from qcompiler.quantization.observer import ObserverBase
from qcompiler.quantization.stubs import DeQuantStub, QuantStub


def quantized_constant(ctx: NodeContext, name: str, q: torch.Tensor, scale: float) -> Tensor:
    """A constant's dequantized integers ``q * scale`` (one scale) as a float initializer; the
    scale goes to the sidecar's weights when quantizing (weights and biases use
    ``QuantState._store_weight`` / ``_store_bias``)."""
    t = ctx.initializer(name, to_numpy((q.double() * float(scale)).float()))
    if ctx.quant.quantize:
        ctx.quant.weights[t] = {"scales": [float(scale)], "axis": None, "dtype": dtype_name(q.dtype)}
    return t


@emits_module(qnn.QuantizedConstantOperand)
def converted_constant_operand(ctx: NodeContext) -> Tensor:
    """QuantizedConstantOperand: the float op on the dequantized feature map and the constant
    (an initializer ``q * s``, listed in the sidecar like a weight), quantized once at the
    output scale (the BPU's one requantization)."""
    m, path = ctx.module, ctx.path
    y = _integer_constant_operand(ctx, m)
    if y is not None:
        return y
    c = quantized_constant(ctx, f"{path}.constant", m.constant, m.const_scale)
    ins = [ctx.x(), c] if m.const_index == 1 else [c, ctx.x()]
    if m.qc_op != "mul" and abs(m.alpha) != 1.0:  # alpha scales operand 1; its sign is in add/sub
        ins[1] = ctx.make("Mul", [ins[1], ctx.const("alpha", abs(m.alpha))], tag="alpha")
    y = ctx.make({"add": "Add", "sub": "Sub", "mul": "Mul"}[m.qc_op], ins)
    return ctx.quant.quantize_point(ctx, y, m.out_scale, m.out_dtype, path)


def _integer_constant_operand(ctx: NodeContext, m: qnn.QuantizedConstantOperand) -> Optional[Tensor]:
    """An int8 feature map and a constant of int8 integers: the simulator's one rounding of
    ``q0 * M0 / 2**n0 +- q1 * M1 / 2**n1`` (add / sub) or ``requantize(qx * qc)`` (mul), the constant
    an int8 initializer (listed in the sidecar like a weight). None otherwise."""
    c = m.constant
    codes = _int8_codes(ctx, [ctx.x()], m.out_dtype)
    if codes is None or c.numel() == 0 or c.is_floating_point() or int(c.min()) < -128 or int(c.max()) > 127:
        return None
    const = ctx.initializer(f"{ctx.path}.constant", c.numpy().astype(np.int8))
    ctx.quant.weights[const] = {"scales": [float(m.const_scale)], "axis": None, "dtype": "qint8"}
    a, b = (codes[0], const) if m.const_index == 1 else (const, codes[0])
    if m.qc_op == "mul":
        wide = [ctx.make("Cast", [t], tag="int32", to=TensorProto.INT32, dtype=TensorProto.INT32) for t in (a, b)]
        y = _requantized_codes(ctx, ctx.make("Mul", wide, tag="product"), m.M, m.n, m.out_dtype)
    else:
        M0, n0, M1, n1 = m.params
        y = _requantized_codes(ctx, a, M0, n0, m.out_dtype, add=(b, -M1 if m.qc_op == "sub" else M1, n1))
    return _dequantized(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedConstant)
def converted_constant(ctx: NodeContext) -> Tensor:
    """QuantizedConstant: its dequantized integers as an initializer (scale in the sidecar)."""
    m = ctx.module
    return quantized_constant(ctx, f"{ctx.path}.value", m.value, m.out_scale)


@emits_module(qnn.QuantizedDiv)
def converted_div(ctx: NodeContext) -> Tensor:
    """QuantizedDiv of int8 values: ``round_half_even(qa * f[qb])`` with ``f = M * 2**-n`` the
    simulator's reciprocal table (``Gather`` by the divisor's code), a divisor 0 saturating to
    ``sign(qa) * 128``, clamped: float64 is exact here (an 8-bit code times a 31-bit multiplier).
    Else Div of the dequantized operands, quantized at the output scale (a zero divisor gives +-inf,
    which QuantizeLinear saturates like the BPU; 0/0 is NaN there, 0 on the BPU)."""
    m = ctx.module
    codes = _int8_codes(ctx, [ctx.tensor(ctx.arg(0, "input")), ctx.tensor(ctx.arg(1, "other"))], m.out_dtype)
    if codes is not None and m.b_dtype == "qint8":
        F64, I64 = TensorProto.DOUBLE, TensorProto.INT64
        qa, qb = codes
        table = ctx.const("reciprocal", np.ldexp(m.M.double().numpy(), -m.n.numpy()), F64)
        index = ctx.make("Add", [ctx.make("Cast", [qb], tag="divisor", to=I64, dtype=I64), ctx.const("offset", 128, I64)],
                         tag="index")
        a = ctx.make("Cast", [qa], tag="dividend", to=F64, dtype=F64)
        t = ctx.make("Round", [ctx.make("Mul", [a, ctx.make("Gather", [table, index], tag="factor", axis=0)],
                                        tag="scaled")], tag="round")
        zero = ctx.make("Equal", [index, ctx.const("zero_index", 128, I64)], tag="zero", dtype=TensorProto.BOOL)
        t = ctx.make("Where", [zero, ctx.make("Mul", [ctx.make("Sign", [a], tag="sign"), ctx.const("qmax1", 128.0, F64)],
                                              tag="saturated"), t], tag="select")
        lo, hi = fp.qrange(m.out_dtype)
        t = ctx.make("Max", [t, ctx.const("lo", float(lo), F64)], tag="clamp_lo")
        t = ctx.make("Min", [t, ctx.const("hi", float(hi), F64)], tag="clamp_hi")
        y = ctx.make("Cast", [t], tag="codes", to=TensorProto.INT8, dtype=TensorProto.INT8)
        return _dequantized(ctx, y, m.out_scale, m.out_dtype)
    y = ctx.make("Div", [ctx.tensor(ctx.arg(0, "input")), ctx.tensor(ctx.arg(1, "other"))])
    return ctx.quant.quantize_point(ctx, y, m.out_scale, m.out_dtype, ctx.path)


@emits_module(QuantStub, *ao.QUANT_STUB_TYPES)
@emits("quant")
def quant_stub(ctx: NodeContext):
    """A QuantStub: its ``activation_post_process`` quantizes (Identity in a float export)."""
    apq = getattr(ctx.module, "activation_post_process", None) if ctx.module is not None else None
    path = f"{ctx.path}.activation_post_process" if ctx.path else ctx.node.name
    return ctx.quant.activation_point(ctx, ctx.x(), apq, path, always_node=True)


@emits_module(DeQuantStub, *ao.DEQUANT_STUB_TYPES, qnn.DeQuantize)
@emits("dequant")
def dequant_stub(ctx: NodeContext):
    return identity(ctx)


@emits_module(FakeQuantizeBase, ObserverBase)
def fake_quant_node(ctx: NodeContext) -> Tensor:
    """A quantizer called from the graph (boundary observer, output observer)."""
    return ctx.quant.activation_point(ctx, ctx.x(), ctx.module, ctx.path, always_node=True)


def _out(ctx: NodeContext, y: str, scale: Optional[float], dtype: str) -> Tensor:
    if scale is None:
        return y
    return ctx.quant.quantize_point(ctx, y, scale, dtype, ctx.path)


# ---------------------------------------------------------------------------------------------------------
# integer rescaling: a float op between Q/DQ rounds float32(q * s_in) / s_out, which a near-tie
# of q * M / 2**n puts on the other side (issue 37: squeezenet's cats). Where every value is int8,
# the rules below compute the BPU's integers instead, with integer_layer.requantize.


def _int8_codes(ctx: NodeContext, values: list, out_dtype: str) -> Optional[list[Tensor]]:
    """The int8 tensors holding the integers of ``values`` (emitted values), or None: not quantizing,
    an int8 output not asked for, or a value that is not an int8 tensor of the graph (an int16 value
    is float in opset 11; such an op keeps its float form)."""
    if not ctx.quant.quantize or out_dtype != "qint8":
        return None
    if not all(is_tensor(v) and ctx.quant.grid.get(v, (None, None))[1] == "qint8" for v in values):
        return None
    return [ctx.quant.codes_of(ctx, v, f"{ctx.path}.input{i}") for i, v in enumerate(values)]


def _requantized_codes(ctx: NodeContext, acc: str, M, n, out_dtype: str, shape: tuple = (),
                       add: Optional[tuple[str, int, int]] = None, top: Optional[int] = None) -> Tensor:
    """int8 ``clamp(round_half_even(acc * M / 2**n [+ other * Mb / 2**nb]))`` of the integer tensor
    ``acc`` (the clamp's top lowered to ``top``): the simulator's requantization bit for bit
    (``integer_layer.requantize``)."""
    lo, hi = fp.qrange(out_dtype)
    hi = hi if top is None else min(hi, top)
    return requantize(ctx, acc, torch.as_tensor(M), torch.as_tensor(n), shape, lo, hi, out_dtype, add)[0]


def _dequantized(ctx: NodeContext, codes: str, scale: float, dtype: str) -> Tensor:
    return ctx.quant.dequantize_codes(ctx, codes, scale, dtype, ctx.path)


@emits_module(qnn.Quantize)
def converted_quantize(ctx: NodeContext) -> Tensor:
    m = ctx.module
    x = ctx.x()
    if ctx.dtype(x) == TensorProto.BOOL:  # a bool entering the BPU (a mask): its 0/1 as float, as torch casts
        x = ctx.make("Cast", [x], tag="bool_as_float", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT)
    return ctx.quant.quantize_point(ctx, x, m.scale, m.dtype, ctx.path, always_node=True)


@emits_module(qnn.Requantize)
def converted_requantize(ctx: NodeContext) -> Tensor:
    """Requantize: the int8 codes times ``M / 2**n``, rounded as the BPU; else (int16) the dequantized
    input quantized again at the output scale."""
    m = ctx.module
    codes = _int8_codes(ctx, [ctx.x()], m.out_dtype)
    if codes is not None:
        return _dequantized(ctx, _requantized_codes(ctx, codes[0], m.M, m.n, m.out_dtype), m.out_scale, m.out_dtype)
    return ctx.quant.quantize_point(ctx, ctx.x(), m.out_scale, m.out_dtype, ctx.path, always_node=True)


@emits_module(qnn.QuantizedWeightLayer)
def converted_weight_layer(ctx: NodeContext) -> Tensor:
    """Quantizing: integer-exact (``rules/integer_layer.py``) where opset 11 can express it, else
    (and in a float view) the float layer on the dequantized input, listed under ``float_layers``."""
    m: qnn.QuantizedWeightLayer = ctx.module
    if ctx.quant.quantize:
        why = float_form_reason(ctx, m)
        if why is None:
            return integer_weight_layer(ctx, m)
        ctx.quant.float_layers[ctx.prefix] = why
    axis = 1 if m.kind == "conv_transpose2d" else 0
    q, g = m.q_weight, m.geometry
    w = ctx.quant._store_weight(ctx, ctx.path, q, m.w_scale, axis, g.get("groups", 1),
                                "qint16" if q.dtype == torch.int16 else "qint8")
    b = None
    if m.bias is not None:  # acc_scale: one per output channel (or one), as the bias
        b = ctx.quant._store_bias(ctx, ctx.path, m.bias.double(), m.acc_scale.double())
    x = ctx.x()
    if m.kind == "conv2d":
        y = conv(ctx, x, w, b, tuple(q.shape), g["stride"], g["padding"], g["dilation"], g["groups"])
    elif m.kind == "linear":
        y = linear_op(ctx, x, w, b, ctx.rank())
    else:
        y = conv_transpose(ctx, x, w, b, tuple(q.shape), g["stride"], g["padding"], g["output_padding"],
                                 g["dilation"], g["groups"])
    if m.with_add:
        y = ctx.make("Add", [y, ctx.tensor(ctx.arg(1, "other"))], tag="add")
    if m.act == "relu":
        y = ctx.make("Relu", [y], tag="relu")
    elif m.act == "relu6":
        y = clip(ctx, y, 0.0, 6.0, tag="relu6")
    if m.out_scale is None:
        ctx.quant.high_precision_output(ctx, y)
        return y
    return _out(ctx, y, m.out_scale, m.out_dtype)


def _with_call(ctx: NodeContext, call: Call):
    """Run a float rule on a substitute call (same node, names and partition)."""
    saved = ctx.call
    ctx.call = call
    try:
        rule = op_rule(ctx.op)
        if rule is None:
            raise ctx.unsupported("no float rule for the converted op")
        return rule(ctx)
    finally:
        ctx.call = saved


def _function_call(ctx: NodeContext, args: tuple, kwargs: Optional[dict] = None) -> Call:
    return Call("call_function", None, tuple(args), dict(kwargs or {}))


@emits_module(qnn.QuantizedAdd, qnn.QuantizedMul, qnn.QuantizedMatmul)
def converted_binary(ctx: NodeContext) -> Tensor:
    """QuantizedAdd / QuantizedMul / QuantizedMatmul on int8 values: the BPU's integers
    (:func:`_integer_binary`); else the float op on the dequantized operands, quantized once at the
    output scale."""
    m = ctx.module
    y = _integer_binary(ctx, m)
    if y is not None:
        return y
    alpha = getattr(m, "alpha", 1.0)  # QuantizedAdd: the traced call's alpha, folded on the BPU
    y = _with_call(ctx, _function_call(ctx, ctx.call.args[:2], {"alpha": alpha} if alpha != 1.0 else None))
    return _out(ctx, y, m.out_scale, m.out_dtype)


def _integer_binary(ctx: NodeContext, m) -> Optional[Tensor]:
    """add / sub: one rounding of ``qa * Ma / 2**na +- qb * Mb / 2**nb``; mul: ``requantize(qa * qb)``
    (a number operand: ``requantize(sign * q)``); matmul: ``requantize(MatMulInteger(qa, qb))``.
    None where an operand is not an int8 tensor."""
    args = [ctx.value(a) for a in ctx.call.args[:2]]
    if isinstance(m, qnn.QuantizedMul) and not all(is_tensor(a) for a in args):  # a * number
        codes = _int8_codes(ctx, [a for a in args if is_tensor(a)], m.out_dtype)
        if codes is None:
            return None
        acc = codes[0]
        M = m.M * m.sign
        return _dequantized(ctx, _requantized_codes(ctx, acc, M, m.n, m.out_dtype), m.out_scale, m.out_dtype)
    codes = _int8_codes(ctx, args, m.out_dtype)
    if codes is None:
        return None
    qa, qb = codes
    if isinstance(m, qnn.QuantizedAdd):
        Ma, na, Mb, nb = m.params
        add = (qb, -Mb if m.sub else Mb, nb)
        y = _requantized_codes(ctx, qa, Ma, na, m.out_dtype, add=add)
    elif isinstance(m, qnn.QuantizedMul):
        wide = [ctx.make("Cast", [q], tag="int32", to=TensorProto.INT32, dtype=TensorProto.INT32) for q in codes]
        y = _requantized_codes(ctx, ctx.make("Mul", wide, tag="product"), m.M, m.n, m.out_dtype)
    else:
        acc = ctx.make("MatMulInteger", [qa, qb], dtype=TensorProto.INT32)
        y = _requantized_codes(ctx, acc, m.M, m.n, m.out_dtype)
    return _dequantized(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedCat)
def converted_cat(ctx: NodeContext) -> Tensor:
    """QuantizedCat: each int8 input requantized to the output scale with the simulator's multiplier
    and shift (``fixed_point.cat_params``; an input at the output scale is copied), then a Concat
    of the codes. Else (int16) the float Concat quantized at the output scale."""
    m = ctx.module
    dim = ctx.arg(1, "dim", 0)
    values = ctx.value(ctx.arg(0, "tensors"))
    codes = _int8_codes(ctx, list(values), m.out_dtype) if isinstance(values, (list, tuple)) else None
    if codes is not None:
        params = fp.cat_params(m.in_scales, m.out_scale, mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
        parts = [q if M == 1 << n else _requantized_codes(ctx, q, M, n, m.out_dtype)
                 for q, (M, n) in zip(codes, params)]
        y = ctx.make("Concat", parts, axis=int(dim)) if len(parts) > 1 else parts[0]
        return _dequantized(ctx, y, m.out_scale, m.out_dtype)
    y = _with_call(ctx, _function_call(ctx, (ctx.arg(0, "tensors"), dim)))
    return _out(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedLookup)
def converted_lookup(ctx: NodeContext) -> Tensor:
    """A lookup table, exact: ``Gather(table, int64(q) - qmin)``, the table (int8 or int16, as the
    simulator holds it) an initializer the sidecar lists. ``q``: an int8 input's codes; an int16
    input (float in opset 11) quantized in the graph as the BPU's entry does, ``clamp(round_half_even(
    float32(x) / float32(s)))``, which gives back ``q`` exactly from a dequantized int16 ``float32(q * s)``.
    An int8 output feeds its DequantizeLinear; an int16 one is ``float32(T) * float32(s)`` (as
    ``QTensor.dequantize``), listed as ``qint16``. Not quantizing (a float view), or an input off any
    grid: the float function with the table's arguments (pow's exponent, gelu's ``approximate``, elu's
    ``alpha``), quantized at the output."""
    m = ctx.module
    out_dtype = dtype_name(m.table.dtype)
    index = _lookup_index(ctx, m) if ctx.quant.quantize else None
    if index is None:
        args = (ctx.call.args[0],) if m.exponent is None else (ctx.call.args[0], m.exponent)
        y = _with_call(ctx, _function_call(ctx, args, getattr(m, "arguments", None)))
        return _out(ctx, y, m.out_scale, out_dtype)
    np_dtype, onnx_dtype = (np.int16, TensorProto.INT16) if out_dtype == "qint16" else (np.int8, TensorProto.INT8)
    table = ctx.initializer(f"{ctx.path}.table", m.table.numpy().astype(np_dtype))
    ctx.quant.weights[table] = {"scales": [float(m.out_scale)], "axis": None, "dtype": out_dtype}
    y = ctx.make("Gather", [table, index], tag="lookup", axis=0, dtype=onnx_dtype)
    if out_dtype == "qint8":
        return _dequantized(ctx, y, m.out_scale, out_dtype)
    values = ctx.make("Mul", [ctx.make("Cast", [y], tag="table_value", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT),
                              ctx.const("out_scale", np.float32(m.out_scale))], tag="dequantize")
    return ctx.quant.quantize_point(ctx, values, m.out_scale, out_dtype, ctx.path)


def _lookup_index(ctx: NodeContext, m: qnn.QuantizedLookup) -> Optional[Tensor]:
    """``int64(q) - qmin`` of the lookup's input codes (see :func:`converted_lookup`), or None when
    the input is on no grid of the lookup's input type."""
    I64 = TensorProto.INT64
    x = ctx.x()
    scale, dtype = ctx.quant.grid.get(x, (None, None))
    if dtype != m.in_dtype:
        return None
    lo, hi = fp.qrange(dtype)
    if dtype == "qint8":
        q = ctx.quant.codes_of(ctx, x, f"{ctx.path}.input0")
        if q is None:
            return None
    else:
        t = ctx.make("Round", [ctx.make("Div", [x, ctx.const("in_scale", np.float32(scale))], tag="scaled")],
                     tag="round")
        q = ctx.make("Clip", [t, ctx.const("qmin", float(lo)), ctx.const("qmax", float(hi))], tag="codes")
    codes = ctx.make("Cast", [q], tag="index", to=I64, dtype=I64)
    return ctx.make("Add", [codes, ctx.const("offset", -lo, I64)], tag="offset_index", dtype=I64)


def _integer_avg_pool(ctx: NodeContext, m: qnn.QuantizedAvgPool) -> Optional[Tensor]:
    """The exact int32 window sums (a depthwise ``ConvInteger`` with int8 ones, zero padding counted;
    a ``ReduceSum`` for a global pool), requantized by the simulator's ``(M, n)``. None where the
    input is not a 4-d int8 tensor."""
    shape = ctx.shape()
    codes = _int8_codes(ctx, [ctx.x()], m.out_dtype) if shape is not None and len(shape) == 4 else None
    if codes is None:
        return None
    (q,) = codes
    if m.kernel is None:
        wide = ctx.make("Cast", [q], tag="int32", to=TensorProto.INT32, dtype=TensorProto.INT32)
        acc = ctx.make("ReduceSum", [wide], tag="sum", axes=[2, 3], keepdims=1)
        M, n = fp.global_avg_pool_params(shape[2] * shape[3], m.in_scale, m.out_scale, mult_bits=qnn.MULT_BITS,
                                         max_shift=qnn.MAX_SHIFT)
    else:
        k = list(fp._pair(m.kernel))
        ones = ctx.const("window", np.ones((shape[1], 1, *k), np.int8), TensorProto.INT8)
        acc = ctx.make("ConvInteger", [q, ones], tag="sum", dtype=TensorProto.INT32, kernel_shape=k,
                       strides=list(fp._pair(m.stride if m.stride is not None else m.kernel)),
                       pads=_pads(ctx, m.padding, k, [1, 1]), group=shape[1])
        M, n = fp.avg_pool_params(k, m.in_scale, m.out_scale, mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    y = _requantized_codes(ctx, acc, M, n, m.out_dtype)
    out = ctx.out_shape()
    if m.kernel is None and not (m.keepdim or (out is not None and len(out) == 4)):
        y = ctx.make("Squeeze", [y], tag="squeeze", axes=[2, 3])
    return _dequantized(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedAvgPool)
def converted_avg_pool(ctx: NodeContext) -> Tensor:
    """Average pools on int8 values: integer sums and the BPU's requantization
    (:func:`_integer_avg_pool`); else the float pool quantized at the output scale."""
    m: qnn.QuantizedAvgPool = ctx.module
    y = _integer_avg_pool(ctx, m)
    if y is not None:
        return y
    x = ctx.x()
    if m.kernel is None:
        out = ctx.out_shape()
        if m.keepdim or (out is not None and len(out) == 4):
            y = ctx.make("GlobalAveragePool", [x])
        else:
            y = ctx.make("Squeeze", [ctx.make("GlobalAveragePool", [x])], tag="squeeze", axes=[2, 3])
    else:
        y = avg_pool(ctx, x, m.kernel, m.stride, m.padding, False, True)
    return _out(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedResize)
def converted_resize(ctx: NodeContext) -> Tensor:
    """Nearest resize of int8 codes: the int8 Resize (a selection), then what the simulator computes,
    ``clamp(round_half_even(float64(q) * (s_in / s_out)))`` (``Cast(double)``, ``Mul``, ``Round``: the
    same float64 operations). Bilinear (float64 interpolation; opset-11 Resize has no double) and
    int16 keep the float Resize quantized at the output scale."""
    m: qnn.QuantizedResize = ctx.module
    codes = _int8_codes(ctx, [ctx.x()], m.out_dtype) if m.mode == "nearest" else None
    if codes is not None:
        q = resize(ctx, codes[0], m.mode, m.align_corners, size=list(m.size))
        if m.in_scale != m.out_scale:
            lo, hi = fp.qrange(m.out_dtype)
            v = ctx.make("Cast", [q], tag="double", to=TensorProto.DOUBLE, dtype=TensorProto.DOUBLE)
            v = ctx.make("Mul", [v, ctx.const("ratio", m.in_scale / m.out_scale, TensorProto.DOUBLE)], tag="scaled")
            v = ctx.make("Round", [v], tag="round")
            v = ctx.make("Max", [v, ctx.const("lo", float(lo), TensorProto.DOUBLE)], tag="clamp_lo")
            v = ctx.make("Min", [v, ctx.const("hi", float(hi), TensorProto.DOUBLE)], tag="clamp_hi")
            q = ctx.make("Cast", [v], tag="codes", to=TensorProto.INT8, dtype=TensorProto.INT8)
        return _dequantized(ctx, q, m.out_scale, m.out_dtype)
    y = resize(ctx, ctx.x(), m.mode, m.align_corners, size=list(m.size))
    return _out(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedPReLU)
def converted_prelu(ctx: NodeContext) -> Tensor:
    """prelu / leaky_relu on integers: positives scaled by Mp/2^np (= s_in/s_out), negatives by
    Mn/2^nn (= slope * s_in/s_out). The float slope the integer model applies is their ratio."""
    m: qnn.QuantizedPReLU = ctx.module
    codes = _int8_codes(ctx, [ctx.x()], m.out_dtype)
    if codes is not None:  # the simulator's integers: requantize by (Mp, np) where q >= 0, else (Mn, nn)
        (q,) = codes
        shape = (1, m.Mn.numel()) + (1,) * (ctx.rank() - 2) if m.Mn.numel() > 1 else ()  # slope per channel
        pos = _requantized_codes(ctx, q, m.Mp, m.np_, m.out_dtype, top=m.top)
        neg = _requantized_codes(ctx, q, m.Mn, m.nn_, m.out_dtype, shape, top=m.top)
        negative = ctx.make("Less", [q, ctx.const("zero", 0, TensorProto.INT8)], tag="negative", dtype=TensorProto.BOOL)
        y = ctx.make("Where", [negative, neg, pos], tag="select", dtype=TensorProto.INT8)
        return _dequantized(ctx, y, m.out_scale, m.out_dtype)
    pos = float(m.Mp) / 2.0 ** float(m.np_)
    slope = (m.Mn.double() / torch.pow(2.0, m.nn_.double())) / pos
    x = ctx.x()
    arr = prelu_slope_shape(to_numpy(slope.float()), ctx.rank())
    y = ctx.make("PRelu", [x, ctx.initializer(f"{ctx.path}.slope", arr)])
    return _out(ctx, y, m.out_scale, m.out_dtype)


@emits_module(qnn.QuantizedSameScale)
def converted_same_scale(ctx: NodeContext):
    """relu, relu6, max pool, layout ops, identities on integers: the float op (the grid is kept).

    ``QuantizedSameScale`` says what it computes: a function, a method name or the float
    module it replaced (max pool, flatten); the rule emits that call.
    """
    m: qnn.QuantizedSameScale = ctx.module
    args, kwargs = ctx.call.args, ctx.call.kwargs
    if m.float_module is not None:
        call = Call("call_module", None, args, kwargs, m.float_module, ctx.path)
    elif m.method is not None:
        call = Call("call_method", m.method, args, kwargs)
    elif m.function is not None:
        call = Call("call_function", m.function, args, kwargs)
    else:
        call = Call("call_function", None, args[:1], {})  # identity / dropout / relu
    src = ctx.value(args[0]) if args else None
    y = _with_call(ctx, call)
    if is_tensor(src) and src in ctx.quant.grid and is_tensor(y):
        scale, dtype = ctx.quant.grid[src]
        if ctx.op == "relu6":  # clamps at round(6 / s) * s, back on the grid
            return ctx.quant.quantize_point(ctx, y, scale, dtype, ctx.path)
        ctx.quant.grid[y] = (scale, dtype)
    return y


# ---------------------------------------------------------------------------------------------------------
# layer_norm (nash): fixed_point.int_layer_norm in int64 ops


def _ln_round_shift(ctx: NodeContext, v: str, divisor: str, half: str, tag: str) -> Tensor:
    """``round_half_even(v / divisor)`` of int64 ``v`` (any sign) by a power of two ``divisor >= 2``
    (``half = divisor / 2``), as ``fixed_point.rounding_shift``: ``r = Mod(v, divisor)`` (fmod=0:
    ``r >= 0``), ``q = (v - r) / divisor`` (exact), ``q + (r > half or (r == half and q odd))``."""
    I64, B = TensorProto.INT64, TensorProto.BOOL
    r = ctx.make("Mod", [v, divisor], tag=f"{tag}_rem", fmod=0)
    q = ctx.make("Div", [ctx.make("Sub", [v, r], tag=f"{tag}_floor"), divisor], tag=f"{tag}_quot")
    odd = ctx.make("Equal", [ctx.make("Mod", [q, ctx.const(f"{tag}_two", 2, I64)], tag=f"{tag}_parity", fmod=0),
                             ctx.const(f"{tag}_one", 1, I64)], tag=f"{tag}_odd", dtype=B)
    tie = ctx.make("And", [ctx.make("Equal", [r, half], tag=f"{tag}_at_half", dtype=B), odd], tag=f"{tag}_tie")
    up = ctx.make("Or", [ctx.make("Greater", [r, half], tag=f"{tag}_above_half", dtype=B), tie], tag=f"{tag}_up")
    return ctx.make("Add", [q, ctx.make("Cast", [up], tag=f"{tag}_up_int", to=I64, dtype=I64)], tag=f"{tag}_rounded")


def _ln_input_codes(ctx: NodeContext, m: qnn.QuantizedLayerNorm) -> Tensor:
    """The input's integer codes as int64: an int8 value's codes (``codes_of``); an int16 value (a float
    in opset 11) quantized as ``fixed_point.quantize`` does, ``clamp(Round(x / s_in))`` in float32."""
    I64, F32 = TensorProto.INT64, TensorProto.FLOAT
    x = ctx.x()
    if m.in_dtype == "qint8" and ctx.quant.grid.get(x, (None, None))[1] == "qint8":
        q = ctx.quant.codes_of(ctx, x, f"{ctx.path}.input")
    else:
        lo, hi = fp.qrange(m.in_dtype)
        q = ctx.make("Round", [ctx.make("Div", [x, ctx.const("in_scale", m.in_scale, F32)], tag="in_scaled")],
                     tag="in_round")
        q = ctx.make("Min", [ctx.make("Max", [q, ctx.const("in_lo", float(lo), F32)], tag="in_clamp_lo"),
                             ctx.const("in_hi", float(hi), F32)], tag="in_clamp_hi")
    return ctx.make("Cast", [q], tag="in_codes", to=I64, dtype=I64)


@emits_module(qnn.QuantizedLayerNorm)
def converted_layer_norm(ctx: NodeContext) -> Tensor:
    """QuantizedLayerNorm: ``fixed_point.int_layer_norm`` step by step in exact int64 ops (ReduceSum,
    Mul, Sub, a Greater ladder for the exponent, Gather from the rsqrt table and the power-of-two
    tables, Div only on non-negative values or exact multiples), so onnxruntime gives the simulator's
    integers; int8 output as DequantizeLinear of the codes, int16 (float in opset 11) as
    ``float32(code) * s_out``. Not quantizing: the float layer norm with the kept gamma / beta."""
    m: qnn.QuantizedLayerNorm = ctx.module
    if not ctx.quant.quantize:
        return _float_layer_norm(ctx, m)
    I64, F64, B = TensorProto.INT64, TensorProto.DOUBLE, TensorProto.BOOL
    rank = ctx.rank()
    axes = list(range(rank - m.dims, rank))
    group = int(np.prod(m.normalized_shape))
    T, F_, Z = fp.LN_RSQRT_BITS, fp.LN_RSQRT_FRAC, fp.LN_NORM_FRAC
    q = _ln_input_codes(ctx, m)
    s1 = ctx.make("ReduceSum", [q], tag="sum", axes=axes, keepdims=1)
    s2 = ctx.make("ReduceSum", [ctx.make("Mul", [q, q], tag="square")], tag="sum_squares", axes=axes, keepdims=1)
    v = ctx.make("Sub", [ctx.make("Mul", [s2, ctx.const("group", group, I64)], tag="n_sum_squares"),
                         ctx.make("Mul", [s1, s1], tag="sum_squared")], tag="variance_units")
    w = ctx.make("Add", [v, ctx.const("eps_units", m.eps_units, I64)], tag="variance_eps")
    one = ctx.const("one", 1, I64)
    w = ctx.make("Where", [ctx.make("Less", [w, one], tag="below_one", dtype=B), one, w], tag="variance_floor")
    # p = #{j in 1..31: W >= 4**j}
    ladder = ctx.const("ladder", np.array([(1 << (2 * j)) - 1 for j in range(1, 32)], np.int64), I64)
    above = ctx.make("Greater", [ctx.make("Unsqueeze", [w], tag="variance_col", axes=[rank]), ladder],
                     tag="ladder_above", dtype=B)
    p = ctx.make("ReduceSum", [ctx.make("Cast", [above], tag="ladder_int", to=I64, dtype=I64)], tag="exponent",
                 axes=[rank], keepdims=0)
    ps = np.arange(32)
    up = ctx.const("up_pow", np.left_shift(np.int64(1), np.maximum(T - 2 * ps, 0)).astype(np.int64), I64)
    down = ctx.const("down_pow", np.left_shift(np.int64(1), np.maximum(2 * ps - T, 0)).astype(np.int64), I64)
    t = ctx.make("Div", [ctx.make("Mul", [w, ctx.make("Gather", [up, p], tag="up", axis=0)], tag="lifted"),
                         ctx.make("Gather", [down, p], tag="down", axis=0)], tag="top_bits")
    index = ctx.make("Sub", [t, ctx.const("table_base", 1 << T, I64)], tag="table_index")
    table = ctx.const("rsqrt_table", fp.layer_norm_rsqrt_table().numpy(), I64)
    r = ctx.make("Gather", [table, index], tag="rsqrt", axis=0)
    d = ctx.make("Sub", [ctx.make("Mul", [q, ctx.const("group_d", group, I64)], tag="n_codes"), s1], tag="centered")
    shifts = ps + (F_ - Z)
    div_z = ctx.make("Gather", [ctx.const("z_pow", np.left_shift(np.int64(1), shifts).astype(np.int64), I64), p],
                     tag="z_divisor", axis=0)
    half_z = ctx.make("Gather", [ctx.const("z_half", np.left_shift(np.int64(1), shifts - 1).astype(np.int64), I64),
                                 p], tag="z_half_of", axis=0)
    z = _ln_round_shift(ctx, ctx.make("Mul", [d, r], tag="scaled"), div_z, half_z, "z")
    n = m.n.numpy().astype(np.int64) + Z
    acc = ctx.make("Add", [ctx.make("Mul", [z, ctx.const("multiplier", m.M.numpy(), I64)], tag="gamma"),
                           ctx.const("bias_codes", m.B.numpy(), I64)], tag="beta")
    y = _ln_round_shift(ctx, acc, ctx.const("out_pow", np.left_shift(np.int64(1), n), I64),
                        ctx.const("out_half", np.left_shift(np.int64(1), n - 1), I64), "out")
    lo, hi = fp.qrange(m.out_dtype)
    y = ctx.make("Cast", [y], tag="out_double", to=F64, dtype=F64)  # |y| < 2**46: exact
    y = ctx.make("Min", [ctx.make("Max", [y, ctx.const("lo", float(lo), F64)], tag="clamp_lo"),
                         ctx.const("hi", float(hi), F64)], tag="clamp_hi")
    if m.out_dtype == "qint8":
        codes = ctx.make("Cast", [y], tag="codes", to=TensorProto.INT8, dtype=TensorProto.INT8)
        return _dequantized(ctx, codes, m.out_scale, m.out_dtype)
    y = ctx.make("Mul", [ctx.make("Cast", [y], tag="codes_float", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT),
                         ctx.const("out_scale", m.out_scale, TensorProto.FLOAT)], tag="dequantize")
    return ctx.quant.quantize_point(ctx, y, m.out_scale, m.out_dtype, ctx.path)


def _float_layer_norm(ctx: NodeContext, m: qnn.QuantizedLayerNorm) -> Tensor:
    """The float layer norm (mean, variance, eps, gamma, beta) on the float input."""
    x = ctx.x()
    axes = list(range(-m.dims, 0))
    mean = ctx.make("ReduceMean", [x], tag="mean", axes=axes, keepdims=1)
    d = ctx.make("Sub", [x, mean], tag="centered")
    var = ctx.make("ReduceMean", [ctx.make("Mul", [d, d], tag="squared")], tag="var", axes=axes, keepdims=1)
    std = ctx.make("Sqrt", [ctx.make("Add", [var, ctx.const("eps", m.eps)], tag="var_eps")], tag="std")
    y = ctx.make("Div", [d, std], tag="normalized")
    if m.weight is not None:
        y = ctx.make("Mul", [y, ctx.param(m, "weight", ctx.path)], tag="scaled")
    if m.bias is not None:
        y = ctx.make("Add", [y, ctx.param(m, "bias", ctx.path)], tag="shifted")
    return y


# --- softmax (nash)


def _softmax_input_codes(ctx: NodeContext, x: Tensor) -> Optional[Tensor]:
    """The int64 codes of the softmax input ``x``: an int8 value's codes; an int16 value (float in
    opset 11) quantized at its grid as the BPU entry does, ``clamp(round_half_even(x / s))`` in float32
    (exact when ``x`` is ``float32(q * s)`` or the float the BPU quantized); None when not quantizing
    or ``x`` has no grid."""
    if not ctx.quant.quantize or not is_tensor(x):
        return None
    scale, dtype = ctx.quant.grid.get(x, (None, None))
    I64 = TensorProto.INT64
    if dtype == "qint8":
        q = ctx.quant.codes_of(ctx, x, f"{ctx.path}.input0")
    elif dtype == "qint16":
        lo, hi = fp.qrange(dtype)
        t = ctx.make("Round", [ctx.make("Div", [x, ctx.const("in_scale", scale)], tag="scaled")], tag="round")
        q = ctx.make("Clip", [t, ctx.const("lo", float(lo)), ctx.const("hi", float(hi))], tag="codes")
    else:
        return None
    return ctx.make("Cast", [q], tag="input_codes", to=I64, dtype=I64)


def _softmax_sum(ctx: NodeContext, m, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(d, E, S)`` of ``fixed_point.int_softmax`` on the int64 codes ``q``: ``d = max - q``,
    ``E = table[min(d, len - 1)]`` (Gather of an int64 initializer), ``S = ReduceSum(E)`` (keepdims)."""
    I64 = TensorProto.INT64
    last = int(m.table.numel()) - 1
    d = ctx.make("Sub", [ctx.make("ReduceMax", [q], tag="max", axes=[m.dim], keepdims=1), q], tag="distance")
    index = d
    if last < fp.qrange(m.in_dtype)[1] - fp.qrange(m.in_dtype)[0]:
        cap = ctx.const("last_index", last, I64)
        index = ctx.make("Where", [ctx.make("Greater", [d, cap], tag="past_table", dtype=TensorProto.BOOL), cap, d],
                         tag="index")
    table = ctx.initializer(f"{ctx.path}.table", m.table.numpy().astype(np.int64))
    e = ctx.make("Gather", [table, index], tag="exp", axis=0)
    return d, e, ctx.make("ReduceSum", [e], tag="sum", axes=[m.dim], keepdims=1)


def _softmax_out(ctx: NodeContext, m, y: Tensor) -> Tensor:
    """The int64 codes ``y`` (already within the output type's range) as the output value."""
    if m.out_dtype == "qint8":
        codes = ctx.make("Cast", [y], tag="codes", to=TensorProto.INT8, dtype=TensorProto.INT8)
        return _dequantized(ctx, codes, m.out_scale, m.out_dtype)
    f = ctx.make("Mul", [ctx.make("Cast", [y], tag="float_codes", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT),
                         ctx.const("out_scale", m.out_scale)], tag="dequantize")
    return ctx.quant.quantize_point(ctx, f, m.out_scale, m.out_dtype, ctx.path)


@emits_module(qnn.QuantizedSoftmax)
def converted_softmax(ctx: NodeContext) -> Tensor:
    """QuantizedSoftmax in exact int64 ops, ``fixed_point.int_softmax`` step for step: ReduceMax, Sub,
    Greater / Where (the table's clamp), Gather of the exponential table, ReduceSum, Mul, Add and Div of
    non-negatives (floor), the clamp at qmax; int8 codes into DequantizeLinear, int16 ones as
    ``float32(q) * float32(s)`` (float in opset 11, grid in the sidecar). Not quantizing, or an input
    with no grid: the float Softmax, quantized at the output scale."""
    m = ctx.module
    q = _softmax_input_codes(ctx, ctx.x())
    if q is None:
        y = _with_call(ctx, _function_call(ctx, (ctx.call.args[0], m.dim)))
        return _out(ctx, y, m.out_scale, m.out_dtype)
    I64 = TensorProto.INT64
    _, e, S = _softmax_sum(ctx, m, q)
    den = ctx.make("Mul", [S, ctx.const("two_pow_n", 1 << m.n, I64)], tag="divisor")
    num = ctx.make("Add", [ctx.make("Mul", [e, ctx.const("M", m.M, I64)], tag="scaled_exp"),
                           ctx.make("Div", [den, ctx.const("two", 2, I64)], tag="half_divisor")], tag="numerator")
    y = ctx.make("Div", [num, den], tag="quotient")
    hi = ctx.const("qmax", fp.qrange(m.out_dtype)[1], I64)
    y = ctx.make("Where", [ctx.make("Greater", [y, hi], tag="over", dtype=TensorProto.BOOL), hi, y], tag="clamp")
    return _softmax_out(ctx, m, y)


@emits_module(qnn.QuantizedLogSoftmax)
def converted_log_softmax(ctx: NodeContext) -> Tensor:
    """QuantizedLogSoftmax in exact int64 ops, ``fixed_point.int_log_softmax`` step for step: softmax's
    ``d``, ``E``, ``S``; the exponent ``c`` as a count of Greater against ``2**j - 1`` (j = 17..32, a
    ReduceSum over an Unsqueeze'd axis), the rounded 15-bit mantissa by Div of non-negatives by a
    Gather'd power of 2, both log tables by Gather, ``-((w + 2**(n-1)) // 2**n)`` and the clamp at qmin.
    Not quantizing, or an input with no grid: the float LogSoftmax, quantized at the output scale."""
    m = ctx.module
    q = _softmax_input_codes(ctx, ctx.x())
    if q is None:
        y = _with_call(ctx, _function_call(ctx, (ctx.call.args[0], m.dim)))
        return _out(ctx, y, m.out_scale, m.out_dtype)
    I64, B = TensorProto.INT64, fp.LOG_SOFTMAX_MANTISSA_BITS
    d, _, S = _softmax_sum(ctx, m, q)
    rank = ctx.rank()
    below = ctx.const("pow2_minus_1", [(1 << j) - 1 for j in range(17, 33)], I64)
    over = ctx.make("Greater", [ctx.make("Unsqueeze", [S], tag="sum_column", axes=[rank]), below], tag="at_least",
                    dtype=TensorProto.BOOL)
    c = ctx.make("ReduceSum", [ctx.make("Cast", [over], tag="counts", to=I64, dtype=I64)], tag="exponent",
                 axes=[rank], keepdims=0)
    shifts = [fp.SOFTMAX_EXP_BITS - B + k for k in range(17)]
    step = ctx.make("Gather", [ctx.const("pow2_shift", [1 << s for s in shifts], I64), c], tag="step", axis=0)
    half = ctx.make("Gather", [ctx.const("pow2_shift_half", [1 << (s - 1) for s in shifts], I64), c], tag="half_step",
                    axis=0)
    r = ctx.make("Sub", [ctx.make("Div", [ctx.make("Add", [S, half], tag="rounded_sum"), step], tag="mantissa_one"),
                         ctx.const("one", 1 << B, I64)], tag="mantissa")
    log_k = ctx.make("Gather", [ctx.initializer(f"{ctx.path}.log_k", m.log_k.numpy()), c], tag="log_exponent", axis=0)
    log_f = ctx.make("Gather", [ctx.initializer(f"{ctx.path}.log_f", m.log_f.numpy()), r], tag="log_mantissa", axis=0)
    w = ctx.make("Add", [ctx.make("Add", [log_k, log_f], tag="log_sum"),
                         ctx.make("Mul", [d, ctx.const("M", m.M, I64)], tag="scaled_distance")], tag="negated")
    w = ctx.make("Div", [ctx.make("Add", [w, ctx.const("half", (1 << m.n) >> 1, I64)], tag="rounding"),
                         ctx.const("two_pow_n", 1 << m.n, I64)], tag="rounded")
    y = ctx.make("Neg", [w], tag="codes_wide")
    lo = ctx.const("qmin", fp.qrange(m.out_dtype)[0], I64)
    y = ctx.make("Where", [ctx.make("Less", [y, lo], tag="under", dtype=TensorProto.BOOL), lo, y], tag="clamp")
    return _softmax_out(ctx, m, y)


# ---------------------------------------------------------------------------------------------------------
# nash: reductions over any dims (qnn.QuantizedReduce)

_REDUCE_ONNX = {"sum": "ReduceSum", "mean": "ReduceSum", "amax": "ReduceMax", "amin": "ReduceMin"}


@emits_module(qnn.QuantizedReduce)
def converted_reduce(ctx: NodeContext) -> Tensor:
    """sum / mean / amax / amin over the module's dims.

    int8 values: the codes widened to int32, ``ReduceSum`` (the BPU's exact int32 sum) requantized by the
    module's ``(M, n)`` (a mean's ``1 / count`` is in ``M``), or ``ReduceMax`` / ``ReduceMin`` narrowed
    back to int8: the simulator's integers bit for bit. Else (an int16 value is float in opset 11):
    amax / amin on the dequantized values, still exact (the largest value is the largest code times
    the one scale, and the grid is kept); sum / mean as the float ``ReduceSum`` / ``ReduceMean``
    quantized at the output scale, which may differ from the BPU by one code near a rounding tie."""
    m: qnn.QuantizedReduce = ctx.module
    dims, keep = list(m.dims), int(m.keepdim)
    selecting = m.qc_op in fp.SELECTING_MODES
    codes = _int8_codes(ctx, [ctx.x()], m.out_dtype)
    if codes is not None:
        wide = ctx.make("Cast", [codes[0]], tag="int32", to=TensorProto.INT32, dtype=TensorProto.INT32)
        r = ctx.make(_REDUCE_ONNX[m.qc_op], [wide], tag=m.qc_op, axes=dims, keepdims=keep)
        if selecting:
            y = ctx.make("Cast", [r], tag="codes", to=TensorProto.INT8, dtype=TensorProto.INT8)
        else:
            y = _requantized_codes(ctx, r, m.M, m.n, m.out_dtype)
        return _dequantized(ctx, y, m.out_scale, m.out_dtype)
    x = ctx.x()
    if selecting:
        y = ctx.make(_REDUCE_ONNX[m.qc_op], [x], tag=m.qc_op, axes=dims, keepdims=keep)
        if is_tensor(x) and x in ctx.quant.grid:
            ctx.quant.grid[y] = ctx.quant.grid[x]
        return y
    y = ctx.make("ReduceSum" if m.qc_op == "sum" else "ReduceMean", [x], tag=m.qc_op, axes=dims, keepdims=keep)
    return _out(ctx, y, m.out_scale, m.out_dtype)


# --- masked_softmax (nash)


@emits_module(qnn.QuantizedMaskedSoftmax)
def converted_masked_softmax(ctx: NodeContext) -> Tensor:
    """QuantizedMaskedSoftmax in exact int64 ops, ``fixed_point.int_masked_softmax`` step for step: the
    kept positions (the mask's dequantized 0/1 against 0.5, Not for the fill polarity), ReduceMax of
    ``Where(keep, q, -2**40)``, ``d`` clamped to the table, Gather, ``Where(keep, E, 0)``, ReduceSum, the
    divisor ``S << n`` (1 where S = 0), Div of non-negatives and the clamp. Not quantizing, or an input
    with no grid: the float masked_softmax rule, quantized at the output scale."""
    m = ctx.module
    q = _softmax_input_codes(ctx, ctx.x())
    mask_arg = ctx.arg(1, "mask")
    if q is None:
        y = _with_call(ctx, _function_call(ctx, (ctx.call.args[0], mask_arg, m.dim, m.fill_mask_is_true)))
        return _out(ctx, y, m.out_scale, m.out_dtype)
    I64, B = TensorProto.INT64, TensorProto.BOOL
    mask = ctx.tensor(mask_arg, TensorProto.FLOAT)
    filled = ctx.make("Greater", [mask, ctx.const("half", 0.5)], tag="mask_set", dtype=B)
    keep = ctx.make("Not", [filled], tag="keep", dtype=B) if m.fill_mask_is_true else filled
    keep = ctx.make("Expand", [keep, ctx.make("Shape", [q], tag="shape", dtype=I64)], tag="keep_full", dtype=B)
    floor = ctx.const("floor", -(1 << 40), I64)
    mx = ctx.make("ReduceMax", [ctx.make("Where", [keep, q, floor], tag="kept", dtype=I64)], tag="max",
                  axes=[m.dim], keepdims=1)
    d = ctx.make("Sub", [mx, q], tag="distance")
    zero = ctx.const("zero", 0, I64)
    d = ctx.make("Where", [ctx.make("Less", [d, zero], tag="below", dtype=B), zero, d], tag="nonneg")
    cap = ctx.const("last_index", int(m.table.numel()) - 1, I64)
    d = ctx.make("Where", [ctx.make("Greater", [d, cap], tag="past_table", dtype=B), cap, d], tag="index")
    table = ctx.initializer(f"{ctx.path}.table", m.table.numpy().astype(np.int64))
    e = ctx.make("Where", [keep, ctx.make("Gather", [table, d], tag="exp", axis=0), zero], tag="kept_exp")
    den = ctx.make("Mul", [ctx.make("ReduceSum", [e], tag="sum", axes=[m.dim], keepdims=1),
                           ctx.const("two_pow_n", 1 << m.n, I64)], tag="divisor")
    num = ctx.make("Add", [ctx.make("Mul", [e, ctx.const("M", m.M, I64)], tag="scaled_exp"),
                           ctx.make("Div", [den, ctx.const("two", 2, I64)], tag="half_divisor")], tag="numerator")
    one = ctx.const("one", 1, I64)
    den = ctx.make("Where", [ctx.make("Less", [den, one], tag="empty_row", dtype=B), one, den], tag="divisor_1")
    y = ctx.make("Div", [num, den], tag="quotient")
    hi = ctx.const("qmax", fp.qrange(m.out_dtype)[1], I64)
    y = ctx.make("Where", [ctx.make("Greater", [y, hi], tag="over", dtype=B), hi, y], tag="clamp")
    return _softmax_out(ctx, m, y)
