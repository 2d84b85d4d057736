"""Element-wise rules: activations, unary math, binary arithmetic and comparisons, where, the
softmax family.

Families that differ only in the ONNX op type are rows of :data:`UNARY`, :data:`FLOAT_UNARY`,
:data:`LOG_BASE`, :data:`ROUNDING`, :data:`BINARY`, :data:`EXTREMUM`, :data:`COMPARE` and :data:`SOFTMAX`,
registered in a loop."""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import numpy as np
import torch
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
from qcompiler.ir.ops import REQUIRED, clamp_bounds

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
    if not any(isinstance(v, fx.Node) for v in bounds):
        return clip(ctx, ctx.x(), *bounds)
    # a tensor bound (Clip-11 takes scalars only): Max with the lower, then Min with the upper
    x = ctx.x()
    dt = ctx.dtype(x)
    if dt not in FLOAT_TYPES:
        raise ctx.unsupported("clamp of an integer tensor with tensor bounds (opset 11 Max / Min take floats)")
    lo, hi = bounds
    if lo is not None:
        x = ctx.make("Max", [x, _as_tensor(ctx, ctx.value(lo), dt, "min")], tag="max" if hi is not None else None)
    if hi is not None:
        x = ctx.make("Min", [x, _as_tensor(ctx, ctx.value(hi), dt, "max")])
    return x


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


# spellings whose arguments after the input are (dim, dtype); F.softmax & co. have (dim, _stacklevel, dtype)
_DIM_DTYPE_FUNCTIONS = (torch.softmax, torch.log_softmax)


def _dim_dtype_spelling(ctx: NodeContext) -> bool:
    return ctx.call.method is not None or (ctx.call.kind == "call_function" and
                                           any(ctx.call.target is f for f in _DIM_DTYPE_FUNCTIONS))


def softmax_like(onnx_op: str, negate: bool = False):
    """softmax / log_softmax / softmin (softmax of -x) over any dim: Softmax-11 and LogSoftmax-11
    normalize over every dim from ``axis`` on, so another dim is moved last and back."""
    def rule(ctx: NodeContext) -> Tensor:
        x = ctx.x()
        rank = ctx.rank()
        if _dim_dtype_spelling(ctx):
            kw = ctx.kw(dim=None, dtype=None)
        else:
            kw = ctx.kw(dim=None, _stacklevel=3, dtype=None)  # F.softmax(input, dim, _stacklevel, dtype)
        if kw["dtype"] is not None:
            to = _onnx_dtype(ctx, kw["dtype"])
            x = ctx.make("Cast", [x], tag="cast", to=to, dtype=to)
        if negate:
            x = ctx.make("Neg", [x], tag="neg")
        axis = _softmax_dim(kw["dim"], rank)
        if axis == rank - 1:
            return ctx.make(onnx_op, [x], axis=rank - 1)
        perm = list(range(rank))
        perm[axis], perm[rank - 1] = perm[rank - 1], perm[axis]
        t = ctx.make("Transpose", [x], tag="to_last", perm=perm)
        s = ctx.make(onnx_op, [t], tag=onnx_op.lower(), axis=rank - 1)
        return ctx.make("Transpose", [s], perm=perm)
    rule.__name__ = onnx_op.lower() + ("_neg" if negate else "")
    return rule


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
        if rounding == "trunc":  # sign(q) * floor(|q|) (opset 11 has no Trunc)
            floor_abs = ctx.make("Floor", [ctx.make("Abs", [q], tag="abs")], tag="floor_abs")
            return ctx.make("Mul", [ctx.make("Sign", [q], tag="sign"), floor_abs])
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


def _float_input(ctx: NodeContext) -> Tensor:
    """The input as a float tensor: torch computes these functions of an integer tensor in float32."""
    x = ctx.x()
    if ctx.dtype(x) in FLOAT_TYPES:
        return x
    dt = ctx.out_dtype() if ctx.out_dtype() in FLOAT_TYPES else F32
    return ctx.make("Cast", [x], tag="to_float", to=dt, dtype=dt)


def float_unary(onnx_op: str):
    """A one-input ONNX function of floats (Sqrt, Log, Sin...); an integer input is cast first."""
    def rule(ctx: NodeContext) -> Tensor:
        return ctx.make(onnx_op, [_float_input(ctx)])
    rule.__name__ = onnx_op.lower()
    return rule


def rounding(onnx_op: str):
    """Floor / Ceil / Round of floats; of an integer tensor, the identity (as torch)."""
    def rule(ctx: NodeContext) -> Tensor:
        x = ctx.x()
        if ctx.dtype(x) not in FLOAT_TYPES:
            return ctx.identity(x)
        return ctx.make(onnx_op, [x])
    rule.__name__ = onnx_op.lower()
    return rule


@emits("round", since=11)
def round_(ctx: NodeContext) -> Tensor:
    """torch.round(x, decimals=d): Round-11 rounds half to even like torch; decimals scale as torch
    does (``round(x * 10^d) / 10^d``, ``round(x / 10^-d) * 10^-d`` for d < 0)."""
    decimals = ctx.kw(decimals=0)["decimals"]
    x = ctx.x()
    if ctx.dtype(x) not in FLOAT_TYPES:
        return ctx.identity(x)
    if not decimals:
        return ctx.make("Round", [x])
    if not isinstance(decimals, int):
        raise ctx.unsupported(f"round decimals={decimals!r} (give a Python int)")
    dt = ctx.dtype(x)
    ten = ctx.const("ten_pow", 10.0 ** abs(decimals), dt)
    scale, unscale = ("Mul", "Div") if decimals > 0 else ("Div", "Mul")
    r = ctx.make("Round", [ctx.make(scale, [x, ten], tag="scaled")], tag="round")
    return ctx.make(unscale, [r, ten])


def log_base(base: float):
    def rule(ctx: NodeContext) -> Tensor:
        x = _float_input(ctx)
        return ctx.make("Div", [ctx.make("Log", [x], tag="ln"), ctx.const("ln_base", math.log(base), ctx.dtype(x))])
    rule.__name__ = f"log{base:g}"
    return rule


@emits("exp2", since=11)
def exp2(ctx: NodeContext) -> Tensor:
    x = _float_input(ctx)
    return ctx.make("Pow", [ctx.const("two", 2.0, ctx.dtype(x)), x])


@emits("square", since=11)
def square(ctx: NodeContext) -> Tensor:
    """x * x (torch.square of an integer stays an integer)."""
    x = ctx.x()
    return ctx.make("Mul", [x, x])


@emits("trunc", since=11)
def trunc(ctx: NodeContext) -> Tensor:
    """Round toward zero (opset 11 has no Trunc): sign(x) * floor(|x|), exact; the identity on integers."""
    x = ctx.x()
    if ctx.dtype(x) not in FLOAT_TYPES:
        return ctx.identity(x)
    floor_abs = ctx.make("Floor", [ctx.make("Abs", [x], tag="abs")], tag="floor_abs")
    return ctx.make("Mul", [ctx.make("Sign", [x], tag="sign"), floor_abs])


@emits("rsqrt", since=11)
def rsqrt(ctx: NodeContext) -> Tensor:
    return ctx.make("Reciprocal", [ctx.make("Sqrt", [_float_input(ctx)], tag="sqrt")])


@emits("log1p", since=11)
def log1p(ctx: NodeContext) -> Tensor:
    """log(1 + x) without losing the digits of a small x: ``log(u) * x / (u - 1)`` with u = 1 + x
    (exact where u == 1, then log1p(x) = x)."""
    x = _float_input(ctx)
    dt = ctx.dtype(x)
    one = ctx.const("one", 1.0, dt)
    u = ctx.make("Add", [x, one], tag="u")
    d = ctx.make("Sub", [u, one], tag="u_minus_1")
    ratio = ctx.make("Div", [ctx.make("Mul", [ctx.make("Log", [u], tag="log_u"), x], tag="x_log_u"), d], tag="ratio")
    exact = ctx.make("Or", [ctx.make("Equal", [d, ctx.const("zero", 0.0, dt)], tag="u_is_1", dtype=TensorProto.BOOL),
                            ctx.make("IsInf", [x], tag="x_is_inf", dtype=TensorProto.BOOL)],
                     tag="x_is_exact", dtype=TensorProto.BOOL)
    return ctx.make("Where", [exact, x, ratio], dtype=dt)


@emits("pow", since=11)
def pow_(ctx: NodeContext):
    """x ** e, torch.pow, Tensor.pow (tensor or Python-number base and exponent). Pow-7 takes floats
    of one type: an integer result is computed in double (exact below 2^53) and cast back."""
    base, exp = _operands(ctx, ("input", "exponent"))
    if not is_tensor(base) and not is_tensor(exp):
        return base ** exp  # python arithmetic (folded sizes)
    dt = _result_dtype(ctx, base, exp, "Pow")
    work = dt if dt in FLOAT_TYPES else TensorProto.DOUBLE
    y = ctx.make("Pow", [_as_tensor(ctx, base, work, "base"), _as_tensor(ctx, exp, work, "exponent")],
                 tag=None if work == dt else "pow")
    return y if work == dt else ctx.make("Cast", [y], to=dt, dtype=dt)


def extremum(onnx_op: str, compare_op: str):
    """torch.minimum / maximum: Min-8 / Max-8 take floats; integers pick with Less / Greater + Where."""
    def rule(ctx: NodeContext) -> Tensor:
        a, b = _operands(ctx)
        dt = _result_dtype(ctx, a, b, onnx_op)
        ta, tb = _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b")
        if dt in FLOAT_TYPES:
            return ctx.make(onnx_op, [ta, tb])
        pick = ctx.make(compare_op, [ta, tb], tag=compare_op.lower(), dtype=TensorProto.BOOL)
        return ctx.make("Where", [pick, ta, tb], dtype=dt)
    rule.__name__ = onnx_op.lower()
    return rule


@emits("softplus", since=11)
def softplus(ctx: NodeContext) -> Tensor:
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (as torch)."""
    kw = ctx.kw(beta=1.0, threshold=20.0)
    x = ctx.x()
    beta, threshold = float(kw["beta"]), float(kw["threshold"])
    bx = ctx.make("Mul", [x, ctx.const("beta", beta)], tag="beta_x") if beta != 1.0 else x
    sp = ctx.make("Softplus", [bx], tag="softplus")
    if beta != 1.0:
        sp = ctx.make("Div", [sp, ctx.const("beta", beta)], tag="over_beta")
    linear = ctx.make("Greater", [bx, ctx.const("threshold", threshold)], tag="linear", dtype=TensorProto.BOOL)
    return ctx.make("Where", [linear, x, sp], dtype=ctx.dtype(x))


@emits("mish", since=11)
def mish(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    return ctx.make("Mul", [x, ctx.make("Tanh", [ctx.make("Softplus", [x], tag="softplus")], tag="tanh")])


@emits("logsigmoid", since=11)
def logsigmoid(ctx: NodeContext) -> Tensor:
    """log(sigmoid(x)) = -softplus(-x), finite for large |x|."""
    x = ctx.x()
    return ctx.make("Neg", [ctx.make("Softplus", [ctx.make("Neg", [x], tag="neg_x")], tag="softplus")])


@emits("softsign", since=11)
def softsign(ctx: NodeContext) -> Tensor:
    return ctx.make("Softsign", [ctx.x()])


@emits("celu", since=11)
def celu(ctx: NodeContext) -> Tensor:
    """celu(x, a) = a * elu(x / a) (Celu is opset 12)."""
    alpha = float(ctx.kw(alpha=1.0, inplace=False)["alpha"])
    if alpha == 0:
        raise ctx.unsupported("celu with alpha=0 (torch divides by alpha)")
    x = ctx.x()
    if alpha == 1.0:
        return ctx.make("Elu", [x], alpha=1.0)
    e = ctx.make("Elu", [ctx.make("Div", [x, ctx.const("alpha", alpha)], tag="x_over_alpha")], tag="elu", alpha=1.0)
    return ctx.make("Mul", [e, ctx.const("alpha", alpha)])


@emits("threshold", since=11)
def threshold(ctx: NodeContext) -> Tensor:
    """x where x > threshold, else value."""
    kw = ctx.kw(threshold=REQUIRED, value=REQUIRED, inplace=False)
    x = ctx.x()
    dt = ctx.dtype(x)
    above = ctx.make("Greater", [x, _as_tensor(ctx, kw["threshold"], dt, "threshold")], tag="above",
                     dtype=TensorProto.BOOL)
    return ctx.make("Where", [above, x, _as_tensor(ctx, kw["value"], dt, "value")], dtype=dt)


@emits("glu", since=11)
def glu(ctx: NodeContext) -> Tensor:
    """a * sigmoid(b), a and b the halves of ``dim``."""
    dim = ctx.kw(dim=-1)["dim"]
    shape = ctx.shape()
    if shape is None:
        raise ctx.unsupported("glu needs the input's shape (run shape propagation first)")
    axis = _norm_axis(int(dim), len(shape))
    if shape[axis] % 2:
        raise ctx.unsupported(f"glu halves dim {dim}, whose size {shape[axis]} is odd")
    half = shape[axis] // 2
    a, b = ctx.make("Split", [ctx.x()], outputs=2, tag="halves", axis=axis, split=[half, half])
    return ctx.make("Mul", [a, ctx.make("Sigmoid", [b], tag="gate")])


# op -> ONNX op type of a one-input, one-output node
UNARY = {"sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "erf": "Erf", "neg": "Neg", "abs": "Abs",
         "sign": "Sign"}
# op -> ONNX op type of a function of floats (an integer input is cast to float32 first, as torch)
FLOAT_UNARY = {"sqrt": "Sqrt", "log": "Log", "sin": "Sin", "cos": "Cos", "tan": "Tan", "reciprocal": "Reciprocal",
               "asin": "Asin", "acos": "Acos", "atan": "Atan", "sinh": "Sinh", "cosh": "Cosh", "asinh": "Asinh",
               "acosh": "Acosh", "atanh": "Atanh"}
# op -> base: log_b(x) = Log(x) / ln(b)
LOG_BASE = {"log2": 2.0, "log10": 10.0}
# op -> ONNX op type that rounds floats (the identity on integers)
ROUNDING = {"floor": "Floor", "ceil": "Ceil"}
# op -> (ONNX op type on floats, comparison that picks the first operand on integers)
EXTREMUM = {"minimum": ("Min", "Less"), "maximum": ("Max", "Greater")}
# op -> (ONNX op type, negate the input first): softmin(x) = softmax(-x)
SOFTMAX = {"softmax": ("Softmax", False), "log_softmax": ("LogSoftmax", False), "softmin": ("Softmax", True)}
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
for _op, _onnx_op in FLOAT_UNARY.items():
    register(_op, float_unary(_onnx_op))
for _op, _base in LOG_BASE.items():
    register(_op, log_base(_base))
for _op, _onnx_op in ROUNDING.items():
    register(_op, rounding(_onnx_op))
for _op, (_onnx_op, _compare) in EXTREMUM.items():
    register(_op, extremum(_onnx_op, _compare))
for _op, (_onnx_op, _negate) in SOFTMAX.items():
    register(_op, softmax_like(_onnx_op, negate=_negate))
