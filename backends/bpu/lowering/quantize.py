"""Lowering of the values that enter, leave or change the integer grid: quantize, dequantize,
requantize, and constants."""

from __future__ import annotations

from qcompiler.backends.bpu.lowering.common import dtype_name, scalar_requant
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn


@lowers(qnn.Quantize, "quant", emits=("quantize",))
def quantize(ctx):
    """A float from outside the partition onto the node's grid."""
    src = ctx.arg(0)
    name = ctx.value(src)
    if not ctx.spec(src).is_float:
        raise ctx.fail(f"quantize of '{name}', which is already quantized")
    return ctx.emit("quantize", [name], ctx.out())


@lowers(qnn.DeQuantize, "dequant", emits=("dequantize",))
def dequantize(ctx):
    """A quantized value (per-tensor or per-channel int32) back to float."""
    src = ctx.arg(0)
    ctx.quantized(src)
    return ctx.emit("dequantize", [src.name], {})


@lowers(qnn.Requantize, "requantize", emits=("requantize",))
def requantize(ctx):
    """A quantized value from the module's input grid to its output grid."""
    m, x = ctx.module, ctx.arg(0)
    spec = ctx.per_tensor(x)
    if (spec.scale, spec.dtype) != (m.in_scale, dtype_name(m.in_dtype)):
        raise ctx.fail(f"input {spec.describe()} differs from the module's (scale {m.in_scale!r}, {m.in_dtype})")
    return ctx.emit("requantize", [x.name], {"in_scale": m.in_scale, **ctx.out()}, scalar_requant(m))


@lowers(qnn.QuantizedConstant, "constant", emits=("constant",))
def constant(ctx):
    """A constant BPU value: its integers."""
    return ctx.emit("constant", [], ctx.out(), {"value": ctx.module.value})
