"""Arithmetic rules: add, sub and mul of two feature maps or of one and a constant (a number, or a
buffer / parameter quantized by its constant quantizer), div and matmul of two feature maps."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError, UnsupportedOpError
from qcompiler.ir.ops import is_number
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import Constant, ConvertContext
from qcompiler.passes.convert_rules.registry import converts


def _number(c) -> Constant:
    """A Python number as an exact constant: ``sign(c)`` at scale ``|c|`` (1.0 for 0)."""
    c = float(c)
    sign = (c > 0) - (c < 0)
    return Constant(torch.tensor(sign, dtype=torch.int8), abs(c) if c else 1.0, "qint8")


def _split_constant(ctx: ConvertContext, a: Any, b: Any) -> Optional[tuple[fx.Node, Constant, int]]:
    """(feature-map operand, constant, position of the constant) of a binary op whose operands
    are ``a, b``, or None when no operand is a quantized BPU value beside a constant."""
    for x, c, index in ((a, b, 1), (b, a, 0)):
        if isinstance(x, fx.Node) and x in ctx.qparams:
            if isinstance(c, fx.Node) and c in ctx.constants:
                return x, ctx.constants[c], index
            if is_number(c):
                return x, _number(c), index
    return None


def _alpha(ctx: ConvertContext) -> float:
    """add / sub's ``alpha`` (1 for mul): a finite, non-zero number, which the BPU folds into the
    second operand's multiplier."""
    alpha = ctx.args.get("alpha", 1)  # mul has none
    if not is_number(alpha) or alpha == 0 or not math.isfinite(alpha):
        raise UnsupportedOpError(
            f"{ctx.where}: {ctx.op} with alpha={alpha!r}: the BPU folds a finite, non-zero number into the "
            f"second operand's multiplier; compute the scaled operand separately (e.g. with a mul)"
        )
    return float(alpha)


@converts("add", "sub", "mul")
def add_sub_mul(ctx: ConvertContext) -> nn.Module:
    """``x * number`` has its own path; with a constant operand the constant moves into the module
    (the node keeps only the feature map); else both operands are quantized BPU values."""
    op, out, alpha = ctx.op, ctx.out, _alpha(ctx)
    a, b = ctx.args["input"], ctx.args["other"]
    sa, sb = ctx.scale_of(a), ctx.scale_of(b)
    number = b if sa is not None else a
    if op == "mul" and is_number(number) and (sa, sb) != (None, None):
        return qnn.QuantizedMul(sa if sa is not None else sb, None, out.scale, out.dtype, constant=float(number))
    split = _split_constant(ctx, a, b)
    if split is not None:
        x, const, index = split
        new = qnn.QuantizedConstantOperand(op, ctx.qparams[x].scale, const.q, const.scale, index, out.scale,
                                           out.dtype, alpha=alpha)
        ctx.node.args, ctx.node.kwargs = (x,), {}
        return new
    if sa is not None and sb is not None:
        if op == "mul":
            return qnn.QuantizedMul(sa, sb, out.scale, out.dtype)
        return qnn.QuantizedAdd(sa, sb, out.scale, out.dtype, sub=(op == "sub"), alpha=alpha)
    raise UnsupportedOpError(
        f"{ctx.where}: {op} needs a quantized BPU operand and the other a BPU value, a number or a "
        f"buffer/parameter (with its constant quantizer from prepare); prepare the model again, or "
        f"run this op on CPU (hybrid_dict)")


@converts("div")
def div(ctx: ConvertContext) -> qnn.QuantizedDiv:
    """A feature map divided by another (the BPU divides feature maps only)."""
    a, b = ctx.args["input"], ctx.args["other"]
    sa, sb = ctx.scale_of(a), ctx.scale_of(b)
    if sa is None or sb is None:
        raise UnsupportedOpError(f"{ctx.where}: div needs two quantized BPU operands (the BPU divides feature "
                                 f"maps); run this op on CPU (hybrid_dict)")
    try:
        return qnn.QuantizedDiv(sa, sb, ctx.qparams[b].dtype, ctx.out.scale, ctx.out.dtype)
    except ConfigError as e:
        raise ConfigError(f"{ctx.where}: {e}") from None


@converts("matmul")
def matmul(ctx: ConvertContext) -> qnn.QuantizedMatmul:
    """The product of two feature maps (``torch.bmm`` / ``torch.mm`` name the second ``mat2``)."""
    b = ctx.args["mat2"] if "mat2" in ctx.args else ctx.args["other"]
    return qnn.QuantizedMatmul(ctx.scale_of(ctx.args["input"]), ctx.scale_of(b), ctx.out.scale, ctx.out.dtype)
