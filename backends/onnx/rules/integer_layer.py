"""Integer-exact weight layers in the ONNX export of a converted model.

A converted conv2d / linear (``qcompiler.nn.quantized.QuantizedWeightLayer``) computes
``clamp(round_half_even(acc * M / 2**n [+ other * Mb / 2**nb]))`` on an exact int32
accumulator ``acc = sum(q_in * q_w) + bias``. A float32 Conv over dequantized values
approximates that: its rounding error (~1e-5 LSB) flips a result that lies near a rounding
tie by one LSB, and later layers spread the flip. So the export computes what the BPU
computes, with opset-10/11 integer ops:

* ``ConvInteger`` / ``MatMulInteger`` of the int8 input codes (the int8 tensor before the
  input's DequantizeLinear) and the int8 weight codes give the int32 accumulator exactly;
  the int32 bias is an integer ``Add``.
* requantization, in float64 where that is provably exact (``exact_in_float64``: the
  simulator's own bound), else in int64:

  - float64: ``Cast(double)``, ``Mul`` by ``M * 2**-n`` (exact), [``Add`` of
    ``Cast(other) * (Mb * 2**-nb)``], ``Round`` (half to even, as the BPU);
  - int64: ``p = acc * M``; ``r = Mod(p, 2**n)`` (``fmod=0``: ``r >= 0``),
    ``q = (p - r) / 2**n`` (exact), ``q + (r > 2**(n-1) or (r == 2**(n-1) and q odd))``; a
    fused add splits both terms like ``fixed_point.round_scaled_sum``.
* the clamp to the out dtype, narrowed by the fused relu / relu6 (``Max`` / ``Min`` on
  float64: opset-11 Clip has no double and Max/Min no int64; both are exact on integers,
  and rounding a larger int64 to float64 is monotone, so the clamp decides the same), then
  ``Cast(int8)`` and ``DequantizeLinear(codes, s_out, 0)``.

A high-precision output (the int32 accumulator) is ``Cast(float) * acc_scale``, what
``QTensor.dequantize`` computes. :func:`float_form_reason` says which layers keep the
float form (conv-transpose: opset 11 has no ConvTransposeInteger; int16 values or weights:
ConvInteger reads 8-bit integers only).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from onnx import TensorProto

from qcompiler.backends.bpu.onednn_conv import exact_in_float64
from qcompiler.backends.onnx.context import NodeContext, Tensor
from qcompiler.backends.onnx.rules.common import _ntuple
from qcompiler.backends.onnx.rules.conv import _pads
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

I64, F64 = TensorProto.INT64, TensorProto.DOUBLE
_INT_KINDS = ("conv2d", "linear")
# bits of the largest output magnitude the clamp keeps (qmax + 1 = 2**7), as the simulator's bound
_OUT_BITS = {"qint8": 7}
# test hook: "int64" evaluates every requantization in int64 (the float64 form is used only where exact)
FORCE_FORM: Optional[str] = None


def float_form_reason(ctx: NodeContext, m: qnn.QuantizedWeightLayer) -> Optional[str]:
    """Why ``m`` cannot be exported integer-exact (None: it can)."""
    if m.kind not in _INT_KINDS:
        return f"{m.kind}: opset 11 has no integer form of it (no ConvTransposeInteger)"
    if m.q_weight.dtype != torch.int8:
        return "int16 weights: ConvInteger / MatMulInteger read 8-bit integers (an int8 cast would wrap them)"
    if m.out_scale is not None and m.out_dtype not in _OUT_BITS:
        return f"{m.out_dtype} output: opset-11 QuantizeLinear / DequantizeLinear hold 8-bit integers only"
    x = ctx.x()
    if ctx.quant.grid.get(x, (None, None))[1] != "qint8":
        return "its input is not an int8 tensor of the graph (ConvInteger / MatMulInteger read 8-bit integers)"
    if m.with_add and ctx.quant.grid.get(ctx.tensor(ctx.arg(1, "other")), (None, None))[1] != "qint8":
        return "its fused add operand is not an int8 tensor of the graph"
    return None


def integer_weight_layer(ctx: NodeContext, m: qnn.QuantizedWeightLayer) -> Tensor:
    """The layer on integers (module docstring); returns its dequantized output (or, for a
    high-precision output, ``float32(acc) * acc_scale``)."""
    path = ctx.path
    x = ctx.quant.codes_of(ctx, ctx.x(), f"{path}.input")
    w = ctx.initializer(f"{path}.weight", m.q_weight.numpy().astype(np.int8))
    ctx.quant.weights[w] = {"scales": [float(np.float32(s)) for s in m.w_scale.reshape(-1).tolist()],
                            "axis": 0, "dtype": "qint8"}
    acc = _accumulate(ctx, m, x, w)
    shape = _channel_shape(m)
    entry = {"kind": m.kind, "input": x, "weight": w, "bias": None, "accumulator": None}
    if m.bias is not None:
        b = ctx.initializer(f"{path}.bias", m.bias.numpy().astype(np.int32).reshape(shape))
        ctx.quant.weights[b] = {"scales": [float(s) for s in m.acc_scale.reshape(-1).tolist()],
                                "axis": len(shape) - 1 if m.kind == "linear" else 1, "dtype": "qint32"}
        acc = ctx.make("Add", [acc, b], tag="bias", dtype=TensorProto.INT32)
        entry["bias"] = b
    entry["accumulator"] = acc
    if m.out_scale is None:  # the int32 accumulator, dequantized as QTensor.dequantize does
        scale = ctx.initializer(f"{path}.acc_scale", m.acc_scale.float().numpy().reshape(shape))
        y = ctx.make("Mul", [ctx.make("Cast", [acc], tag="acc_float", to=TensorProto.FLOAT,
                                      dtype=TensorProto.FLOAT), scale], tag="dequantize")
        ctx.quant.high_precision_output(ctx, y)
        entry.update(multiplier=None, shift=None, axis=m.channel_axis, other=None, add=None, clamp=None,
                     rounding=None, evaluated_in=None, output=None)
        ctx.quant.integer_layers[y] = entry
        return y
    lo, hi = m.output_clamp()
    other, add = None, None
    if m.with_add:
        other = ctx.quant.codes_of(ctx, ctx.tensor(ctx.arg(1, "other")), f"{path}.other")
        add = (other, int(m.Mb.reshape(-1)[0]), int(m.nb.reshape(-1)[0]))
    codes, how = requantize(ctx, acc, m.M, m.n, shape, lo, hi, m.out_dtype, add)
    entry.update(multiplier=m.M.reshape(-1).tolist(), shift=m.n.reshape(-1).tolist(),
                 axis=m.channel_axis, other=other,
                 add=None if add is None else {"multiplier": add[1], "shift": add[2]},
                 clamp=[lo, hi], rounding="half_to_even", evaluated_in=how, output=codes)
    y = ctx.quant.dequantize_codes(ctx, codes, m.out_scale, m.out_dtype, path)
    ctx.quant.integer_layers[y] = entry
    return y


def _accumulate(ctx: NodeContext, m: qnn.QuantizedWeightLayer, x: str, w: str) -> Tensor:
    """The exact int32 accumulator without bias (ConvInteger / MatMulInteger)."""
    if m.kind == "linear":
        wt = ctx.make("Transpose", [w], tag="weight_t", perm=[1, 0])
        return ctx.make("MatMulInteger", [x, wt], dtype=TensorProto.INT32)
    g = m.geometry
    kernel = list(m.q_weight.shape[2:])
    dil = _ntuple(g["dilation"], len(kernel))
    return ctx.make("ConvInteger", [x, w], dtype=TensorProto.INT32, kernel_shape=kernel,
                    strides=_ntuple(g["stride"], len(kernel)), pads=_pads(ctx, g["padding"], kernel, dil),
                    dilations=dil, group=int(g["groups"]))


def _channel_shape(m: qnn.QuantizedWeightLayer) -> tuple[int, ...]:
    """The shape a per-output-channel parameter broadcasts with against the accumulator."""
    o = int(m.q_weight.shape[0])
    return (o,) if m.kind == "linear" else (1, o, 1, 1)


def requantize(ctx: NodeContext, acc: str, M: torch.Tensor, n: torch.Tensor, shape: tuple[int, ...],
               lo: int, hi: int, out_dtype: str, add: Optional[tuple[str, int, int]] = None
               ) -> tuple[Tensor, str]:
    """int8 ``clamp(round_half_even(acc * M / 2**n [+ other * Mb / 2**nb]), lo, hi)`` of the int32
    ``acc``, bit for bit as ``fixed_point`` (``add = (other int8 tensor, Mb, nb)``).

    Returns the int8 tensor and how it was evaluated (``"float64"`` or ``"int64"``)."""
    channels = int(np.prod(shape))
    M = np.broadcast_to(M.to(torch.int64).reshape(-1).numpy(), (channels,))
    n = np.broadcast_to(n.to(torch.int64).reshape(-1).numpy(), (channels,))
    other_max = 0.0 if add is None else float(abs(fp.qrange("qint8")[0]) * abs(np.ldexp(float(add[1]), -add[2])))
    nb = 0 if add is None else add[2]
    if FORCE_FORM != "int64" and exact_in_float64(int(n.max()), _OUT_BITS[out_dtype], other_max, nb):
        y, how = _requantize_f64(ctx, acc, M, n, shape, add), "float64"
    else:
        y, how = _requantize_i64(ctx, acc, M, n, shape, add), "int64"
    y = ctx.make("Max", [y, ctx.const("lo", float(lo), F64)], tag="clamp_lo")
    y = ctx.make("Min", [y, ctx.const("hi", float(hi), F64)], tag="clamp_hi")
    return ctx.make("Cast", [y], tag="codes", to=TensorProto.INT8, dtype=TensorProto.INT8), how


def _requantize_f64(ctx, acc, M, n, shape, add) -> Tensor:
    """round(fl(fl(acc * M*2**-n) + other * Mb*2**-nb)): exact under ``exact_in_float64``."""
    f = ctx.const("multiplier", np.ldexp(M.astype(np.float64), -n).reshape(shape), F64)
    t = ctx.make("Mul", [ctx.make("Cast", [acc], tag="acc_double", to=F64, dtype=F64), f], tag="scaled")
    if add is not None:
        other, Mb, nb = add
        o = ctx.make("Cast", [other], tag="other_double", to=F64, dtype=F64)
        o = ctx.make("Mul", [o, ctx.const("add_multiplier", np.ldexp(float(Mb), -nb), F64)], tag="other_scaled")
        t = ctx.make("Add", [t, o], tag="add")
    return ctx.make("Round", [t], tag="round")


def _divmod_pow2(ctx, p: str, n: np.ndarray, shape, tag: str) -> tuple[Tensor, Tensor]:
    """floor(p / 2**n) and p mod 2**n (in [0, 2**n)) of an int64 tensor, exactly."""
    d = ctx.const(f"{tag}_divisor", np.left_shift(np.int64(1), n).reshape(shape), I64)
    r = ctx.make("Mod", [p, d], tag=f"{tag}_rem", fmod=0)
    q = ctx.make("Div", [ctx.make("Sub", [p, r], tag=f"{tag}_floor"), d], tag=f"{tag}_quot")
    return q, r


def _round_up(ctx, q: str, r: str, n: np.ndarray, shape) -> Tensor:
    """``q + 1`` where the remainder ``r`` of ``/ 2**n`` rounds up (half to even), else ``q``."""
    # half = 2**(n-1); for n = 0 the remainder is always 0, so any half > 0 leaves q as is
    half = ctx.const("half", np.where(n > 0, np.left_shift(np.int64(1), np.maximum(n - 1, 0)), 1).reshape(shape),
                     I64)
    odd = ctx.make("Equal", [ctx.make("Mod", [q, ctx.const("two", 2, I64)], tag="parity", fmod=0),
                             ctx.const("one", 1, I64)], tag="odd", dtype=TensorProto.BOOL)
    tie = ctx.make("And", [ctx.make("Equal", [r, half], tag="at_half", dtype=TensorProto.BOOL), odd], tag="tie")
    up = ctx.make("Or", [ctx.make("Greater", [r, half], tag="above_half", dtype=TensorProto.BOOL), tie], tag="up")
    return ctx.make("Add", [q, ctx.make("Cast", [up], tag="up_int", to=I64, dtype=I64)], tag="rounded")


def _requantize_i64(ctx, acc, M, n, shape, add) -> Tensor:
    """The rounding of ``fixed_point.rounding_shift`` / ``round_scaled_sum`` in int64 ops;
    |acc * M| < 2**62 (int32 times a 31-bit multiplier), every remainder sum < 2**62."""
    p = ctx.make("Mul", [ctx.make("Cast", [acc], tag="acc_int64", to=I64, dtype=I64),
                         ctx.const("multiplier_int", M.reshape(shape), I64)], tag="product")
    if add is None:
        q, r = _divmod_pow2(ctx, p, n, shape, "shift")
        s = n
    else:
        other, Mb, nb = add
        s = np.maximum(n, nb)
        qa, ra = _divmod_pow2(ctx, p, n, shape, "shift")
        tb = ctx.make("Mul", [ctx.make("Cast", [other], tag="other_int64", to=I64, dtype=I64),
                              ctx.const("add_multiplier_int", Mb, I64)], tag="other_product")
        qb, rb = _divmod_pow2(ctx, tb, np.array(nb), (), "add_shift")
        ra = ctx.make("Mul", [ra, ctx.const("align", np.left_shift(np.int64(1), s - n).reshape(shape), I64)],
                      tag="rem_aligned")
        rb = ctx.make("Mul", [rb, ctx.const("add_align", np.left_shift(np.int64(1), s - nb).reshape(shape), I64)],
                      tag="add_rem_aligned")
        carry, r = _divmod_pow2(ctx, ctx.make("Add", [ra, rb], tag="rem_sum"), s, shape, "carry")
        q = ctx.make("Add", [ctx.make("Add", [qa, qb], tag="quot_sum"), carry], tag="quot")
    return ctx.make("Cast", [_round_up(ctx, q, r, s, shape)], tag="rounded_double", to=F64, dtype=F64)
