"""Lowering of the piecewise-linear activations: relu and relu6 on the input's grid, relu6 with its own
output scale, and prelu / leaky_relu (a multiplier for each side of zero)."""

from __future__ import annotations

from qcompiler.backends.bpu.lowering.common import relu6_top
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn


@lowers(qnn.QuantizedSameScale, "relu", emits=("relu",))
def relu(ctx):
    """max(x, 0) on the input's grid."""
    x = ctx.arg(0)
    ctx.per_tensor(x)
    return ctx.emit("relu", [x.name], ctx.out())


@lowers(qnn.QuantizedSameScale, "relu6", emits=("relu6",))
def relu6(ctx):
    """relu6 on the input's grid: a clamp to the integer of 6.0 at the input's scale."""
    x = ctx.arg(0)
    spec = ctx.per_tensor(x)
    return ctx.emit("relu6", [x.name], {"max": relu6_top(spec.scale, spec.dtype), **ctx.out()})


@lowers(qnn.QuantizedPReLU, "relu6", emits=("relu6",))
def requantized_relu6(ctx):
    """A relu6 with its own output scale (e.g. after an add): requantize, then clamp."""
    m, x = ctx.module, ctx.arg(0)
    ctx.per_tensor(x)
    return ctx.emit("relu6", [x.name], {"max": int(m.top), **ctx.out()},
                    {"M": m.Mp.reshape(()), "n": m.np_.reshape(())})


@lowers(qnn.QuantizedPReLU, "prelu", "leaky_relu", emits=("prelu", "leaky_relu"))
def prelu(ctx):
    """One multiplier for x >= 0, one (per channel for a prelu with several slopes) for x < 0."""
    m, x = ctx.module, ctx.arg(0)
    ctx.per_tensor(x)
    per_channel = m.Mn.numel() > 1
    negative = (-1,) if per_channel else ()
    return ctx.emit(m.qc_op, [x.name], {"axis": 1 if per_channel else None, **ctx.out()},
                    {"Mp": m.Mp.reshape(()), "np": m.np_.reshape(()), "Mn": m.Mn.reshape(negative),
                     "nn": m.nn_.reshape(negative)})
