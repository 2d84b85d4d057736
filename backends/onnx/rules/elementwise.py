"""Element-wise rules: activations, unary functions, binary arithmetic and comparisons, where.

Families that differ only in the ONNX op type are rows of :data:`UNARY`, :data:`BINARY` and
:data:`COMPARE`, registered in a loop."""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import numpy as np
import torch.fx as fx
from onnx import TensorProto

from qcompiler.backends.onnx.context import (
    FLOAT_TYPES,
    NodeContext,
    Tensor,
    is_tensor,
)
from qcompiler.backends.onnx.registry import emits, register
from qcompiler.backends.onnx.rules.common import F32, I64, _as_tensor, _norm_axis, _onnx_dtype
from qcompiler.ir.ops import clamp_bounds

SELU_ALPHA = 1.6732632423543772848170429916717


SELU_SCALE = 1.0507009873554804934193349852946


def unary(onnx_op: str, **attrs):
    def rule(ctx: NodeContext) -> Tensor:
        return ctx.make(onnx_op, [ctx.x()], **attrs)
    rule.__name__ = onnx_op.lower()
    return rule


@emits("identity", "dropout")
def identity(ctx: NodeContext):
    v = ctx.value(ctx.arg(0, "input"))
    if is_tensor(v):
        return ctx.identity(v)
    return v  # identity of a container / python value: nothing to compute


@emits("float")
def to_float(ctx: NodeContext) -> Tensor:
    return ctx.make("Cast", [ctx.x()], to=F32, dtype=F32)


@emits("relu")
def relu(ctx: NodeContext) -> Tensor:
    return ctx.make("Relu", [ctx.x()])


def clip(ctx: NodeContext, x: str, lo: Optional[float], hi: Optional[float], tag: Optional[str] = None) -> Tensor:
    dt = ctx.dtype(x)
    lo_t = ctx.const("min", lo, dt) if lo is not None else ""
    hi_t = ctx.const("max", hi, dt) if hi is not None else ""
    ins = [x, lo_t, hi_t]
    while ins and ins[-1] == "":
        ins.pop()
    return ctx.make("Clip", ins, tag=tag)


@emits("clamp")
def clamp(ctx: NodeContext) -> Tensor:
    """clamp / clip / clamp_min / hardtanh with any bounds (``qcompiler.ir.ops.clamp_bounds``)."""
    bounds = clamp_bounds(ctx.node, ctx.emitter.modules)
    if bounds is None:
        raise ctx.unsupported("clamp arguments not understood (pass the bounds as numbers)")
    if any(isinstance(v, fx.Node) for v in bounds):
        raise ctx.unsupported("clamp with tensor bounds")
    return clip(ctx, ctx.x(), *bounds)


@emits("relu6")
def relu6(ctx: NodeContext) -> Tensor:
    return clip(ctx, ctx.x(), 0.0, 6.0)


@emits("leaky_relu")
def leaky_relu(ctx: NodeContext) -> Tensor:
    slope = ctx.kw(negative_slope=0.01)["negative_slope"]
    return ctx.make("LeakyRelu", [ctx.x()], alpha=float(slope))


def prelu_slope_shape(slope: np.ndarray, rank: int) -> np.ndarray:
    """PyTorch applies the slope along dim 1; ONNX PRelu broadcasts numpy-style
    (trailing dims): a per-channel slope becomes (C, 1, ..., 1)."""
    slope = slope.reshape(-1)
    if slope.size == 1 or rank < 2:
        return slope
    return slope.reshape((slope.size,) + (1,) * (rank - 2))


@emits("prelu")
def prelu(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    if ctx.module is not None:
        slope = ctx.param(ctx.module, "weight", ctx.path, transform=lambda a: prelu_slope_shape(a, rank))
    else:
        w = ctx.arg(1, "weight")
        shape = ctx.shape(w)
        slope = ctx.tensor(w)
        if shape is not None and len(shape) == 1 and shape[0] > 1 and rank > 2:
            slope = ctx.make("Reshape", [slope, ctx.const("slope_shape", [shape[0]] + [1] * (rank - 2), I64)],
                             tag="slope")
    return ctx.make("PRelu", [x, slope])


@emits("selu")
def selu(ctx: NodeContext) -> Tensor:
    return ctx.make("Selu", [ctx.x()], alpha=SELU_ALPHA, gamma=SELU_SCALE)


@emits("elu")
def elu(ctx: NodeContext) -> Tensor:
    alpha = ctx.kw(alpha=1.0)["alpha"]
    return ctx.make("Elu", [ctx.x()], alpha=float(alpha))


@emits("gelu")
def gelu(ctx: NodeContext) -> Tensor:
    approx = ctx.kw(approximate="none")["approximate"]
    x = ctx.x()
    if approx == "tanh":  # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
        x3 = ctx.make("Pow", [x, ctx.const("three", 3.0)], tag="cube")
        inner = ctx.make("Add", [x, ctx.make("Mul", [x3, ctx.const("k", 0.044715)], tag="kx3")], tag="inner")
        t = ctx.make("Tanh", [ctx.make("Mul", [inner, ctx.const("c", math.sqrt(2.0 / math.pi))], tag="scaled")],
                     tag="tanh")
    elif approx == "none":  # 0.5 * x * (1 + erf(x / sqrt(2)))
        t = ctx.make("Erf", [ctx.make("Mul", [x, ctx.const("rsqrt2", 1.0 / math.sqrt(2.0))], tag="scaled")],
                     tag="erf")
    else:
        raise ctx.unsupported(f"gelu approximate={approx!r}")
    one_plus = ctx.make("Add", [t, ctx.const("one", 1.0)], tag="one_plus")
    half_x = ctx.make("Mul", [x, ctx.const("half", 0.5)], tag="half_x")
    return ctx.make("Mul", [half_x, one_plus])


@emits("silu")
def silu(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    return ctx.make("Mul", [x, ctx.make("Sigmoid", [x], tag="sigmoid")])


@emits("hardsigmoid")
def hardsigmoid(ctx: NodeContext) -> Tensor:
    return ctx.make("HardSigmoid", [ctx.x()], alpha=1.0 / 6.0, beta=0.5)


@emits("hardswish")
def hardswish(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    return ctx.make("Mul", [x, ctx.make("HardSigmoid", [x], tag="hardsigmoid", alpha=1.0 / 6.0, beta=0.5)])


def _softmax_dim(dim: Optional[int], rank: int) -> int:
    if dim is None:  # torch's legacy implicit dim
        dim = 0 if rank in (0, 1, 3) else 1
    return _norm_axis(int(dim), rank)


@emits("softmax")
def softmax(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    kw = ctx.kw(dim=None, _stacklevel=3, dtype=None)  # F.softmax(input, dim, _stacklevel, dtype)
    if kw["dtype"] is not None:
        to = _onnx_dtype(ctx, kw["dtype"])
        x = ctx.make("Cast", [x], tag="cast", to=to, dtype=to)
    axis = _softmax_dim(kw["dim"], rank)
    if axis == rank - 1:
        return ctx.make("Softmax", [x], axis=rank - 1)
    # Softmax-11 normalizes over all dims from `axis` on: move the dim last and back
    perm = list(range(rank))
    perm[axis], perm[rank - 1] = perm[rank - 1], perm[axis]
    t = ctx.make("Transpose", [x], tag="to_last", perm=perm)
    s = ctx.make("Softmax", [t], tag="softmax", axis=rank - 1)
    return ctx.make("Transpose", [s], perm=perm)


def _operands(ctx: NodeContext, names=("input", "other")) -> tuple[Any, Any]:
    a = ctx.value(ctx.arg(0, names[0]))
    b = ctx.value(ctx.arg(1, names[1]))
    return a, b


def _result_dtype(ctx: NodeContext, a: Any, b: Any, op: str) -> int:
    dt = ctx.out_dtype()
    if dt is not None:
        return dt
    types = [ctx.dtype(v) for v in (a, b) if is_tensor(v)]
    if any(t in FLOAT_TYPES for t in types) or any(isinstance(v, float) for v in (a, b)):
        return next((t for t in types if t in FLOAT_TYPES), F32)
    return types[0] if types else I64


def binary(onnx_op: str, py_op):
    def rule(ctx: NodeContext):
        a, b = _operands(ctx)
        alpha = ctx.arg(None, "alpha", None)
        rounding = ctx.arg(None, "rounding_mode", None) if onnx_op == "Div" else None
        if not is_tensor(a) and not is_tensor(b):  # python arithmetic (folded sizes)
            if alpha is not None:
                b = b * alpha
            r = py_op(a, b)
            if rounding == "floor":
                r = math.floor(r)
            elif rounding == "trunc":
                r = math.trunc(r)
            return r
        dt = _result_dtype(ctx, a, b, onnx_op)
        if onnx_op == "Div" and rounding is None and dt not in FLOAT_TYPES:
            dt = F32  # true division of integers is float in torch
        ta = _as_tensor(ctx, a, dt, "a")
        tb = _as_tensor(ctx, b, dt, "b")
        if alpha is not None and alpha != 1:
            tb = ctx.make("Mul", [tb, ctx.const("alpha", alpha, dt)], tag="alpha")
        if rounding is None:
            return ctx.make(onnx_op, [ta, tb])
        if dt not in FLOAT_TYPES:
            if rounding == "trunc":
                return ctx.make("Div", [ta, tb])  # ONNX integer Div truncates
            raise ctx.unsupported("integer division with rounding_mode='floor'")
        q = ctx.make("Div", [ta, tb], tag="div")
        if rounding == "floor":
            return ctx.make("Floor", [q])
        raise ctx.unsupported(f"rounding_mode={rounding!r} on floats")
    rule.__name__ = onnx_op.lower()
    return rule










def compare(onnx_op: str, negate: bool = False):
    """Greater / Less / Equal (bool); >=, <=, != as the negation of <, >, == (opset 11 has no
    GreaterOrEqual / LessOrEqual)."""
    def rule(ctx: NodeContext) -> Tensor:
        a, b = _operands(ctx)
        types = [ctx.dtype(v) for v in (a, b) if is_tensor(v)]
        dt = next((t for t in types if t in FLOAT_TYPES), types[0] if types else F32)
        ta, tb = _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b")
        if not negate:
            return ctx.make(onnx_op, [ta, tb], dtype=TensorProto.BOOL)
        c = ctx.make(onnx_op, [ta, tb], tag=onnx_op.lower(), dtype=TensorProto.BOOL)
        return ctx.make("Not", [c], dtype=TensorProto.BOOL)
    rule.__name__ = onnx_op.lower()
    return rule


@emits("where")
def where(ctx: NodeContext) -> Tensor:
    cond = ctx.tensor(ctx.arg(0, "condition"), TensorProto.BOOL)
    a, b = ctx.value(ctx.arg(1, "input")), ctx.value(ctx.arg(2, "other"))
    dt = ctx.out_dtype() or F32
    return ctx.make("Where", [cond, _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b")])


# op -> ONNX op type of a one-input, one-output node
UNARY = {"sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "erf": "Erf", "neg": "Neg", "abs": "Abs"}
# op -> (ONNX op type, the Python operator for two constants)
BINARY = {"add": ("Add", operator.add), "sub": ("Sub", operator.sub), "mul": ("Mul", operator.mul),
          "div": ("Div", operator.truediv)}
# op -> (ONNX op type, negate): GreaterOrEqual / LessOrEqual are opset 12, so ge = not(lt), le = not(gt)
COMPARE = {"gt": ("Greater", False), "lt": ("Less", False), "eq": ("Equal", False),
           "ge": ("Less", True), "le": ("Greater", True), "ne": ("Equal", True)}

for _op, _onnx_op in UNARY.items():
    register(_op, unary(_onnx_op))
for _op, (_onnx_op, _py_op) in BINARY.items():
    register(_op, binary(_onnx_op, _py_op))
for _op, (_onnx_op, _negate) in COMPARE.items():
    register(_op, compare(_onnx_op, negate=_negate))
