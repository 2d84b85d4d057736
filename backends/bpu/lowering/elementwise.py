"""Lowering of the element-wise arithmetic: add, sub, mul and div of two feature maps, and add, sub,
mul of a feature map and a constant."""

from __future__ import annotations

import torch
import torch.fx as fx

from qcompiler.backends.bpu.lowering.common import dtype_name, scalar_requant
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn

_ADD_MULTIPLIERS = ("Ma", "na", "Mb", "nb")


def _int64(values) -> dict:
    """An add's multipliers and shifts, one int64 scalar tensor each."""
    return {k: torch.tensor(int(v), dtype=torch.int64) for k, v in zip(_ADD_MULTIPLIERS, values)}


@lowers(qnn.QuantizedAdd, "add", "sub", emits=("add", "sub"))
def add(ctx):
    """a + b or a - b: each operand brought to the output scale by its own multiplier."""
    a, b = ctx.arg(0), ctx.arg(1)
    ctx.per_tensor(a, "operand a")
    ctx.per_tensor(b, "operand b")
    return ctx.emit(ctx.module.qc_op, [a.name, b.name], ctx.out(), _int64(ctx.module.params))


@lowers(qnn.QuantizedMul, "mul", emits=("mul",))
def mul(ctx):
    """a * b of two feature maps, or of a feature map and a Python number (its value and sign as attributes)."""
    m, a, b = ctx.module, ctx.arg(0), ctx.arg(1)
    attrs = ctx.out()
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        ctx.per_tensor(a, "operand a")
        ctx.per_tensor(b, "operand b")
        return ctx.emit("mul", [a.name, b.name], attrs, scalar_requant(m))
    q = a if isinstance(a, fx.Node) else b
    ctx.per_tensor(q)
    const = m.constant if m.constant is not None else (b if q is a else a)
    attrs.update(const=float(const), sign=int(m.sign))
    return ctx.emit("mul", [q.name], attrs, scalar_requant(m))


@lowers(qnn.QuantizedConstantOperand, "add", "sub", "mul", emits=("add", "sub", "mul"))
def constant_operand(ctx):
    """add / sub / mul with a constant: one input, the integers as tensor 'constant'."""
    m, x = ctx.module, ctx.arg(0)
    spec = ctx.per_tensor(x)
    if spec.scale != m.x_scale:
        raise ctx.fail(f"input scale {spec.scale!r} differs from the module's {m.x_scale!r}")
    attrs = {"constant_index": m.const_index, "constant_scale": m.const_scale, **ctx.out()}
    if m.qc_op == "mul":
        tensors = {"M": torch.tensor(m.M, dtype=torch.int64), "n": torch.tensor(m.n, dtype=torch.int64)}
    else:
        tensors = _int64(m.params)
    tensors["constant"] = m.constant
    return ctx.emit(m.qc_op, [x.name], attrs, tensors)


@lowers(qnn.QuantizedDiv, "div", emits=("div",))
def div(ctx):
    """a / b of two feature maps on the module's operand grids."""
    m, a, b = ctx.module, ctx.arg(0), ctx.arg(1)
    sa = ctx.per_tensor(a, "dividend")
    sb = ctx.per_tensor(b, "divisor")
    if (sa.scale, sb.scale, sb.dtype) != (m.sa, m.sb, dtype_name(m.b_dtype)):
        raise ctx.fail(f"operand quantization ({sa.describe()}, {sb.describe()}) differs from the "
                       f"module's (scales {m.sa!r}, {m.sb!r}, divisor {m.b_dtype})")
    attrs = {"a_scale": m.sa, "b_scale": m.sb, "b_dtype": sb.dtype, **ctx.out()}
    return ctx.emit("div", [a.name, b.name], attrs, {"M": m.M, "n": m.n})
