"""Lowering of the matrix products: conv, transposed conv and linear layers with their int8 weights,
and matmul of two feature maps."""

from __future__ import annotations

from qcompiler.backends.bpu.lowering.common import relu6_top, scalar_requant
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

_LAYERS = ("conv2d", "conv_transpose2d", "linear")


def _geometry(m: qnn.QuantizedWeightLayer) -> dict:
    """Stride, padding, dilation and groups of a conv (and a transposed conv's output padding); none for linear."""
    if m.kind == "linear":
        return {}
    g = m.geometry
    attrs = dict(stride=list(fp._pair(g["stride"])), padding=fp.padding_attr(g["padding"]),
                 dilation=list(fp._pair(g["dilation"])), groups=int(g["groups"]))
    if m.kind == "conv_transpose2d":
        attrs["output_padding"] = list(fp._pair(g["output_padding"]))
    return attrs


@lowers(qnn.QuantizedWeightLayer, *_LAYERS, emits=_LAYERS)
def weight_layer(ctx):
    """A layer, with its fused add and activation; a high-precision one outputs per-channel int32."""
    m, x = ctx.module, ctx.arg(0)
    in_spec = ctx.per_tensor(x)
    if abs(in_spec.scale - m.in_scale) > 0:
        raise ctx.fail(f"input scale {in_spec.scale!r} differs from the layer's in_scale {m.in_scale!r}")
    inputs = [x.name]
    if m.with_add:
        other = ctx.arg(1)
        ctx.per_tensor(other, "add operand")
        inputs.append(other.name)
    hp = m.out_scale is None
    attrs = {**_geometry(m), "high_precision": hp, "act": m.act, "with_add": bool(m.with_add),
             "in_scale": float(m.in_scale)}
    tensors = {"weight": m.q_weight}
    if m.bias is not None:
        tensors["bias"] = m.bias
    if not hp:
        tensors.update(M=m.M, n=m.n)
        if m.with_add:
            tensors.update(Mb=m.Mb.reshape(()), nb=m.nb.reshape(()))
        if m.act == "relu6":
            attrs["act_max"] = relu6_top(m.out_scale, m.out_dtype)
    elif m.with_add or m.act:
        raise ctx.fail("a high-precision (int32) output cannot have a fused add or activation")
    return ctx.emit(m.kind, inputs, {**attrs, **ctx.out()}, tensors)


@lowers(qnn.QuantizedMatmul, "matmul", emits=("matmul",))
def matmul(ctx):
    """The exact integer product of two feature maps, requantized once."""
    a, b = ctx.arg(0), ctx.arg(1)
    ctx.per_tensor(a, "operand a")
    ctx.per_tensor(b, "operand b")
    return ctx.emit("matmul", [a.name, b.name], ctx.out(), scalar_requant(ctx.module))
