"""Arithmetic beyond the four operations, logic and casts (rules the op-catalogue benchmark asked for):
fmod / remainder / floor_divide, atan2, the reversed operators (``2 - x`` as ``x.__rsub__(2)``), lerp,
addcmul / addcdiv, logit, nan_to_num, the shrink family, the logical ops, isnan / isinf / isfinite,
dtype casts (``x.long()``, ``x.to(dtype)``), copysign, deg2rad / rad2deg, fmax / fmin, frac, logaddexp(2),
heaviside, xlogy / xlog1py, entr, ndtr, ldexp, hypot, float_power, isclose, expm1, erfc, sinc, signbit,
isposinf / isneginf and isreal.

Torch's type promotion is read from shape propagation (``ctx.out_dtype()``): operands are cast to the
result type first, as torch computes them."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from qcompiler.backends.onnx.context import FLOAT_TYPES, NodeContext, Tensor, is_tensor
from qcompiler.backends.onnx.registry import emits, register
from qcompiler.backends.onnx.rules.common import F32, _as_tensor
from qcompiler.backends.onnx.rules.elementwise import _operands, _result_dtype
from qcompiler.ir.ops import REQUIRED

BOOL = TensorProto.BOOL


def _pair(ctx: NodeContext, names=("input", "other")) -> tuple[Tensor, Tensor, int]:
    """Both operands as tensors of the result dtype (torch's promotion), and that dtype."""
    a, b = _operands(ctx, names)
    if not is_tensor(a) and not is_tensor(b):
        raise ctx.unsupported("both operands are Python numbers (nothing to compute on a tensor)")
    dt = _result_dtype(ctx, a, b, ctx.op)
    return _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b"), dt


@emits("fmod", since=11)
def fmod(ctx: NodeContext) -> Tensor:
    """C fmod: the remainder has the dividend's sign (Mod fmod=1, which floats require)."""
    a, b, _ = _pair(ctx)
    return ctx.make("Mod", [a, b], fmod=1)


def _remainder(ctx: NodeContext, a: Tensor, b: Tensor, dt: int) -> Tensor:
    """Python's modulo: the remainder has the divisor's sign. Integers: Mod fmod=0; floats: fmod, plus b
    where the fmod is non-zero and its sign differs from b's."""
    if dt not in FLOAT_TYPES:
        return ctx.make("Mod", [a, b], fmod=0)
    r = ctx.make("Mod", [a, b], tag="fmod", fmod=1)
    zero = ctx.const("zero", 0.0, dt)
    nonzero = ctx.make("Not", [ctx.make("Equal", [r, zero], tag="r_is_0", dtype=BOOL)], tag="r_nonzero", dtype=BOOL)
    differ = ctx.make("Xor", [ctx.make("Less", [r, zero], tag="r_neg", dtype=BOOL),
                              ctx.make("Less", [b, zero], tag="b_neg", dtype=BOOL)], tag="signs_differ", dtype=BOOL)
    fix = ctx.make("And", [nonzero, differ], tag="fix", dtype=BOOL)
    return ctx.make("Where", [fix, ctx.make("Add", [r, b], tag="r_plus_b"), r], dtype=dt)


@emits("remainder", since=11)
def remainder(ctx: NodeContext) -> Tensor:
    a, b, dt = _pair(ctx)
    return _remainder(ctx, a, b, dt)


@emits("floor_divide", since=11)
def floor_divide(ctx: NodeContext) -> Tensor:
    """floor(a / b); integers are divided in double (exact below 2^53) and floored, not truncated."""
    a, b, dt = _pair(ctx)
    if dt in FLOAT_TYPES:
        return ctx.make("Floor", [ctx.make("Div", [a, b], tag="div")])
    da = ctx.make("Cast", [a], tag="a_double", to=TensorProto.DOUBLE, dtype=TensorProto.DOUBLE)
    db = ctx.make("Cast", [b], tag="b_double", to=TensorProto.DOUBLE, dtype=TensorProto.DOUBLE)
    q = ctx.make("Floor", [ctx.make("Div", [da, db], tag="div")], tag="floor")
    return ctx.make("Cast", [q], to=dt, dtype=dt)


@emits("atan2", since=11)
def atan2(ctx: NodeContext) -> Tensor:
    """atan(y / x), moved by +-pi where x < 0 (by y's side, +pi for y = +0) and +-pi/2 where x == 0."""
    y, x, dt = _pair(ctx)
    if dt not in FLOAT_TYPES:
        dt = F32
        y, x = _as_tensor(ctx, y, dt, "y_float"), _as_tensor(ctx, x, dt, "x_float")
    zero = ctx.const("zero", 0.0, dt)
    base = ctx.make("Atan", [ctx.make("Div", [y, x], tag="ratio")], tag="atan")
    y_neg = ctx.make("Less", [y, zero], tag="y_neg", dtype=BOOL)
    pi = ctx.make("Where", [y_neg, ctx.const("minus_pi", -math.pi, dt), ctx.const("pi", math.pi, dt)], tag="pi",
                  dtype=dt)
    half_pi = ctx.make("Mul", [pi, ctx.const("half", 0.5, dt)], tag="half_pi")
    x_neg = ctx.make("Less", [x, zero], tag="x_neg", dtype=BOOL)
    left = ctx.make("Where", [x_neg, ctx.make("Add", [base, pi], tag="plus_pi"), base], tag="left", dtype=dt)
    x_zero = ctx.make("Equal", [x, zero], tag="x_zero", dtype=BOOL)
    y_zero = ctx.make("Equal", [y, zero], tag="y_zero", dtype=BOOL)
    axis = ctx.make("Where", [y_zero, zero, half_pi], tag="on_axis", dtype=dt)  # atan2(0, 0) = 0
    return ctx.make("Where", [x_zero, axis, left], dtype=dt)


def reversed_op(kind: str):
    """``x.__rsub__(c)`` = c - x (also ``torch.rsub(x, c, alpha)`` = c - alpha x), ``__rdiv__``, ``__rpow__``,
    ``__rmatmul__``, ``__rmod__``: the operands swapped."""
    onnx_op = {"rsub": "Sub", "rdiv": "Div", "rpow": "Pow", "rmatmul": "MatMul", "rmod": None}[kind]

    def rule(ctx: NodeContext) -> Tensor:
        a, b, dt = _pair(ctx)
        if kind == "rsub":
            alpha = ctx.arg(2, "alpha", 1)
            if alpha != 1:
                a = ctx.make("Mul", [a, ctx.const("alpha", alpha, dt)], tag="alpha")
        if kind == "rdiv" and dt not in FLOAT_TYPES:
            dt = ctx.out_dtype() or F32
            a, b = _as_tensor(ctx, a, dt, "a_float"), _as_tensor(ctx, b, dt, "b_float")
        if kind == "rmod":
            return _remainder(ctx, b, a, dt)
        if kind == "rpow" and dt not in FLOAT_TYPES:
            raise ctx.unsupported("an integer power (Pow-7 takes floats)")
        return ctx.make(onnx_op, [b, a])
    rule.__name__ = kind
    return rule


for _kind in ("rsub", "rdiv", "rpow", "rmatmul", "rmod"):
    register(_kind, reversed_op(_kind))


@emits("lerp", since=11)
def lerp(ctx: NodeContext) -> Tensor:
    """start + weight * (end - start)."""
    start, end = ctx.value(ctx.arg(0, "input")), ctx.value(ctx.arg(1, "end"))
    weight = ctx.value(ctx.arg(2, "weight"))
    dt = ctx.out_dtype() or F32
    s, e, w = (_as_tensor(ctx, v, dt, t) for v, t in ((start, "start"), (end, "end"), (weight, "weight")))
    step = ctx.make("Mul", [w, ctx.make("Sub", [e, s], tag="span")], tag="step")
    return ctx.make("Add", [s, step])


def addc(onnx_op: str):
    """addcmul / addcdiv: input + value * (t1 op t2)."""
    def rule(ctx: NodeContext) -> Tensor:
        dt = ctx.out_dtype() or F32
        x, t1, t2 = (_as_tensor(ctx, ctx.value(ctx.arg(i, n)), dt, n)
                     for i, n in ((0, "input"), (1, "tensor1"), (2, "tensor2")))
        value = ctx.arg(3, "value", 1)
        if not isinstance(value, (int, float)):
            raise ctx.unsupported("a tensor value (give a Python number)")
        prod = ctx.make(onnx_op, [t1, t2], tag=onnx_op.lower())
        if value != 1:
            prod = ctx.make("Mul", [prod, ctx.const("value", value, dt)], tag="scaled")
        return ctx.make("Add", [x, prod])
    rule.__name__ = "addc" + onnx_op.lower()
    return rule


register("addcmul", addc("Mul"))
register("addcdiv", addc("Div"))


@emits("logit", since=11)
def logit(ctx: NodeContext) -> Tensor:
    """log(p / (1 - p)), p clamped to [eps, 1 - eps] when eps is given."""
    eps = ctx.kw(eps=None)["eps"]
    x = ctx.x()
    dt = ctx.dtype(x)
    if eps is not None:
        x = ctx.make("Clip", [x, ctx.const("lo", eps, dt), ctx.const("hi", 1.0 - eps, dt)], tag="clamped")
    odds = ctx.make("Div", [x, ctx.make("Sub", [ctx.const("one", 1.0, dt), x], tag="one_minus")], tag="odds")
    return ctx.make("Log", [odds])


@emits("nan_to_num", since=11)
def nan_to_num(ctx: NodeContext) -> Tensor:
    """NaN -> nan (0), +inf -> posinf (the dtype's max), -inf -> neginf (its lowest)."""
    kw = ctx.kw(nan=0.0, posinf=None, neginf=None)
    x = ctx.x()
    dt = ctx.dtype(x)
    if dt not in FLOAT_TYPES:
        return ctx.identity(x)
    info = np.finfo(np.float64 if dt == TensorProto.DOUBLE else np.float32)
    pos = kw["posinf"] if kw["posinf"] is not None else float(info.max)
    neg = kw["neginf"] if kw["neginf"] is not None else float(info.min)
    y = ctx.make("Where", [ctx.make("IsNaN", [x], tag="isnan", dtype=BOOL), ctx.const("nan", kw["nan"], dt), x],
                 tag="no_nan", dtype=dt)
    y = ctx.make("Where", [ctx.make("IsInf", [x], tag="isposinf", dtype=BOOL, detect_negative=0),
                           ctx.const("posinf", pos, dt), y], tag="no_posinf", dtype=dt)
    return ctx.make("Where", [ctx.make("IsInf", [x], tag="isneginf", dtype=BOOL, detect_positive=0),
                              ctx.const("neginf", neg, dt), y], dtype=dt)


@emits("tanhshrink", since=11)
def tanhshrink(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    return ctx.make("Sub", [x, ctx.make("Tanh", [x], tag="tanh")])


@emits("hardshrink", since=11)
def hardshrink(ctx: NodeContext) -> Tensor:
    """x where |x| > lambd, else 0."""
    lambd = float(ctx.kw(lambd=0.5)["lambd"])
    x = ctx.x()
    dt = ctx.dtype(x)
    keep = ctx.make("Greater", [ctx.make("Abs", [x], tag="abs"), ctx.const("lambd", lambd, dt)], tag="keep",
                    dtype=BOOL)
    return ctx.make("Where", [keep, x, ctx.const("zero", 0.0, dt)], dtype=dt)


@emits("softshrink", since=11)
def softshrink(ctx: NodeContext) -> Tensor:
    """x - lambd above lambd, x + lambd below -lambd, else 0: x - clip(x, -lambd, lambd)."""
    lambd = float(ctx.kw(lambd=0.5)["lambd"])
    if lambd < 0:
        raise ctx.unsupported(f"softshrink lambd={lambd} (torch requires lambd >= 0)")
    x = ctx.x()
    dt = ctx.dtype(x)
    inside = ctx.make("Clip", [x, ctx.const("lo", -lambd, dt), ctx.const("hi", lambd, dt)], tag="clip")
    return ctx.make("Sub", [x, inside])


def logical(onnx_op: str):
    """And / Or / Xor / Not of the operands read as booleans (non-zero is true), as torch."""
    def rule(ctx: NodeContext) -> Tensor:
        names = ("input",) if onnx_op == "Not" else ("input", "other")
        ins = [_as_tensor(ctx, ctx.value(ctx.arg(i, n)), BOOL, n) if ctx.dtype(ctx.value(ctx.arg(i, n))) == BOOL
               or not is_tensor(ctx.value(ctx.arg(i, n))) else _truth(ctx, ctx.value(ctx.arg(i, n)), n)
               for i, n in enumerate(names)]
        return ctx.make(onnx_op, ins, dtype=BOOL)
    rule.__name__ = "logical_" + onnx_op.lower()
    return rule


def _truth(ctx: NodeContext, t: Tensor, tag: str) -> Tensor:
    """A tensor as booleans: x != 0 (Cast to bool would also make NaN true, like torch; this keeps it so)."""
    if ctx.dtype(t) == BOOL:
        return t
    zero = ctx.const(f"{tag}_zero", 0, ctx.dtype(t))
    return ctx.make("Not", [ctx.make("Equal", [t, zero], tag=f"{tag}_is_0", dtype=BOOL)], tag=f"{tag}_bool",
                    dtype=BOOL)


LOGICAL = {"logical_not": "Not", "logical_and": "And", "logical_or": "Or", "logical_xor": "Xor"}
for _op, _onnx_op in LOGICAL.items():
    register(_op, logical(_onnx_op))


def float_test(kind: str):
    """isnan / isinf / isfinite (all false / false / true on integers, as torch)."""
    def rule(ctx: NodeContext) -> Tensor:
        x = ctx.x()
        if ctx.dtype(x) not in FLOAT_TYPES:
            zeros = ctx.make("Equal", [x, x], tag="same", dtype=BOOL)  # all true, the input's shape
            return zeros if kind == "isfinite" else ctx.make("Not", [zeros], dtype=BOOL)
        if kind == "isnan":
            return ctx.make("IsNaN", [x], dtype=BOOL)
        if kind == "isinf":
            return ctx.make("IsInf", [x], dtype=BOOL)
        bad = ctx.make("Or", [ctx.make("IsNaN", [x], tag="nan", dtype=BOOL),
                              ctx.make("IsInf", [x], tag="inf", dtype=BOOL)], tag="not_finite", dtype=BOOL)
        return ctx.make("Not", [bad], dtype=BOOL)
    rule.__name__ = kind
    return rule


for _kind in ("isnan", "isinf", "isfinite"):
    register(_kind, float_test(_kind))


@emits("cast", since=11)
def cast(ctx: NodeContext) -> Tensor:
    """``x.long()``, ``x.to(dtype)``, ``x.type_as(y)``...: Cast to the dtype shape propagation recorded
    (``x.to(device)`` / to the same dtype is the identity)."""
    x = ctx.x()
    to = ctx.out_dtype()
    if to is None:
        raise ctx.unsupported("a cast whose result dtype is unknown (run shape propagation first)")
    if to == ctx.dtype(x):
        return ctx.identity(x)
    return ctx.make("Cast", [x], to=to, dtype=to)


# --- more element-wise functions of two operands or of floats ---------------------------------------------

def _floats(ctx: NodeContext, names=("input", "other")) -> tuple[Tensor, ...]:
    """The operands as tensors of the (float) result dtype."""
    vals = [ctx.value(ctx.arg(i, n)) for i, n in enumerate(names)]
    dt = ctx.out_dtype()
    if dt not in FLOAT_TYPES:
        dt = F32
    return tuple(_as_tensor(ctx, v, dt, n) for v, n in zip(vals, names)) + (dt,)


@emits("copysign", since=11)
def copysign(ctx: NodeContext) -> Tensor:
    """|a| with b's sign bit (-0.0 counts as negative: 1 / -0.0 < 0)."""
    a, b, dt = _floats(ctx)
    zero = ctx.const("zero", 0.0, dt)
    mag = ctx.make("Abs", [a], tag="abs")
    neg_zero = ctx.make("And", [ctx.make("Equal", [b, zero], tag="b_zero", dtype=BOOL),
                                ctx.make("Less", [ctx.make("Div", [ctx.const("one", 1.0, dt), b], tag="inv_b"), zero],
                                         tag="inv_neg", dtype=BOOL)], tag="neg_zero", dtype=BOOL)
    neg = ctx.make("Or", [ctx.make("Less", [b, zero], tag="b_neg", dtype=BOOL), neg_zero], tag="neg", dtype=BOOL)
    return ctx.make("Where", [neg, ctx.make("Neg", [mag], tag="minus"), mag], dtype=dt)


def scaled(factor: float):
    """deg2rad / rad2deg: a constant factor (integers computed in float32, as torch)."""
    def rule(ctx: NodeContext) -> Tensor:
        (x, dt) = _floats(ctx, ("input",))
        return ctx.make("Mul", [x, ctx.const("factor", factor, dt)])
    return rule


register("deg2rad", scaled(math.pi / 180.0))
register("rad2deg", scaled(180.0 / math.pi))


def nan_ignoring(onnx_op: str):
    """fmax / fmin: Max / Min, except that a NaN operand yields the other one."""
    def rule(ctx: NodeContext) -> Tensor:
        a, b, dt = _floats(ctx)
        m = ctx.make(onnx_op, [a, b], tag=onnx_op.lower())
        m = ctx.make("Where", [ctx.make("IsNaN", [b], tag="b_nan", dtype=BOOL), a, m], tag="b_nan_pick", dtype=dt)
        return ctx.make("Where", [ctx.make("IsNaN", [a], tag="a_nan", dtype=BOOL), b, m], dtype=dt)
    rule.__name__ = "f" + onnx_op.lower()
    return rule


register("fmax", nan_ignoring("Max"))
register("fmin", nan_ignoring("Min"))


@emits("frac", since=11)
def frac(ctx: NodeContext) -> Tensor:
    """x - trunc(x), trunc(x) = sign(x) * floor(|x|)."""
    x = ctx.x()
    t = ctx.make("Mul", [ctx.make("Sign", [x], tag="sign"),
                         ctx.make("Floor", [ctx.make("Abs", [x], tag="abs")], tag="floor_abs")], tag="trunc")
    return ctx.make("Sub", [x, t])


def logaddexp_base(base: float):
    """log(e^a + e^b) (base e) / log2(2^a + 2^b): m + log(1 + base^-(|a - b|)), m = max(a, b); a == b gives
    a + log(2) (so that inf and -inf stay themselves)."""
    def rule(ctx: NodeContext) -> Tensor:
        a, b, dt = _floats(ctx)
        ln_base = math.log(base)
        m = ctx.make("Max", [a, b], tag="max")
        d = ctx.make("Neg", [ctx.make("Abs", [ctx.make("Sub", [a, b], tag="diff")], tag="abs")], tag="neg_abs")
        e = ctx.make("Exp", [ctx.make("Mul", [d, ctx.const("ln_base", ln_base, dt)], tag="scaled")], tag="exp")
        tail = ctx.make("Div", [ctx.make("Log", [ctx.make("Add", [e, ctx.const("one", 1.0, dt)], tag="one_plus")],
                                         tag="log"), ctx.const("ln_base_div", ln_base, dt)], tag="tail")
        general = ctx.make("Add", [m, tail], tag="general")
        same = ctx.make("Add", [a, ctx.const("log_2", math.log(2.0) / ln_base, dt)], tag="same")
        return ctx.make("Where", [ctx.make("Equal", [a, b], tag="equal", dtype=BOOL), same, general], dtype=dt)
    return rule


register("logaddexp", logaddexp_base(math.e))
register("logaddexp2", logaddexp_base(2.0))


@emits("heaviside", since=11)
def heaviside(ctx: NodeContext) -> Tensor:
    """values where x == 0, else 1 for x > 0 and 0 below (and for NaN)."""
    x, values, dt = _floats(ctx, ("input", "values"))
    zero = ctx.const("zero", 0.0, dt)
    step = ctx.make("Cast", [ctx.make("Greater", [x, zero], tag="positive", dtype=BOOL)], tag="step", to=dt, dtype=dt)
    return ctx.make("Where", [ctx.make("Equal", [x, zero], tag="is_zero", dtype=BOOL), values, step], dtype=dt)


def x_log(log1p: bool):
    """xlogy(x, y) = x * log(y), special.xlog1py(x, y) = x * log1p(y): 0 where x == 0 (unless y is NaN)."""
    def rule(ctx: NodeContext) -> Tensor:
        x, y, dt = _floats(ctx)
        arg = ctx.make("Add", [y, ctx.const("one", 1.0, dt)], tag="one_plus") if log1p else y
        prod = ctx.make("Mul", [x, ctx.make("Log", [arg], tag="log")], tag="x_log")
        zero = ctx.const("zero", 0.0, dt)
        y_nan = ctx.make("IsNaN", [y], tag="y_nan", dtype=BOOL)
        x_zero = ctx.make("And", [ctx.make("Equal", [x, zero], tag="x_zero", dtype=BOOL),
                                  ctx.make("Not", [y_nan], tag="y_number", dtype=BOOL)], tag="zero_out", dtype=BOOL)
        return ctx.make("Where", [x_zero, zero, prod], dtype=dt)
    return rule


register("xlogy", x_log(False))
register("xlog1py", x_log(True))


@emits("entr", since=11)
def entr(ctx: NodeContext) -> Tensor:
    """-x ln x for x > 0, 0 at 0, -inf below 0 (NaN stays NaN)."""
    (x, dt) = _floats(ctx, ("input",))
    zero = ctx.const("zero", 0.0, dt)
    val = ctx.make("Neg", [ctx.make("Mul", [x, ctx.make("Log", [x], tag="log")], tag="x_log")], tag="value")
    val = ctx.make("Where", [ctx.make("Equal", [x, zero], tag="is_zero", dtype=BOOL), zero, val], tag="at_zero",
                   dtype=dt)
    return ctx.make("Where", [ctx.make("Less", [x, zero], tag="negative", dtype=BOOL),
                              ctx.const("minus_inf", -math.inf, dt), val], dtype=dt)


@emits("ndtr", since=11)
def ndtr(ctx: NodeContext) -> Tensor:
    """The standard normal CDF: (1 + erf(x / sqrt 2)) / 2."""
    (x, dt) = _floats(ctx, ("input",))
    e = ctx.make("Erf", [ctx.make("Mul", [x, ctx.const("rsqrt2", 1.0 / math.sqrt(2.0), dt)], tag="scaled")],
                 tag="erf")
    return ctx.make("Mul", [ctx.make("Add", [e, ctx.const("one", 1.0, dt)], tag="one_plus"),
                            ctx.const("half", 0.5, dt)])


@emits("ldexp", since=11)
def ldexp(ctx: NodeContext) -> Tensor:
    """x * 2^e."""
    x, e, dt = _floats(ctx)
    return ctx.make("Mul", [x, ctx.make("Pow", [ctx.const("two", 2.0, dt), e], tag="pow2")])


@emits("hypot", since=11)
def hypot(ctx: NodeContext) -> Tensor:
    a, b, _ = _floats(ctx)
    return ctx.make("Sqrt", [ctx.make("Add", [ctx.make("Mul", [a, a], tag="a2"), ctx.make("Mul", [b, b], tag="b2")],
                                      tag="sum")])


@emits("float_power", since=11)
def float_power(ctx: NodeContext) -> Tensor:
    """Pow in double (torch.float_power's result is float64)."""
    a, b = _operands(ctx, ("input", "exponent"))
    d = TensorProto.DOUBLE
    return ctx.make("Pow", [_as_tensor(ctx, a, d, "base"), _as_tensor(ctx, b, d, "exponent")], dtype=d)


@emits("isclose", since=11)
def isclose(ctx: NodeContext) -> Tensor:
    """|a - b| <= atol + rtol |b|, or a == b (infinities); NaNs equal only with equal_nan."""
    kw = ctx.kw(other=REQUIRED, rtol=1e-5, atol=1e-8, equal_nan=False)
    a, b = ctx.value(ctx.arg(0, "input")), ctx.value(kw["other"])
    dt = ctx.dtype(a) if is_tensor(a) and ctx.dtype(a) in FLOAT_TYPES else F32
    a, b = _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b")
    tol = ctx.make("Add", [ctx.const("atol", kw["atol"], dt),
                           ctx.make("Mul", [ctx.const("rtol", kw["rtol"], dt), ctx.make("Abs", [b], tag="abs_b")],
                                    tag="rel")], tag="tol")
    diff = ctx.make("Abs", [ctx.make("Sub", [a, b], tag="diff")], tag="abs_diff")
    close = ctx.make("Not", [ctx.make("Greater", [diff, tol], tag="far", dtype=BOOL)], tag="within", dtype=BOOL)
    close = ctx.make("And", [close, ctx.make("Not", [ctx.make("IsNaN", [diff], tag="diff_nan", dtype=BOOL)],
                                             tag="diff_number", dtype=BOOL)], tag="close", dtype=BOOL)
    out = ctx.make("Or", [close, ctx.make("Equal", [a, b], tag="equal", dtype=BOOL)],
                   tag=None if not kw["equal_nan"] else "close_or_equal", dtype=BOOL)
    if kw["equal_nan"]:
        both = ctx.make("And", [ctx.make("IsNaN", [a], tag="a_nan", dtype=BOOL),
                                ctx.make("IsNaN", [b], tag="b_nan", dtype=BOOL)], tag="both_nan", dtype=BOOL)
        out = ctx.make("Or", [out, both], dtype=BOOL)
    return out


@emits("expm1", since=11)
def expm1(ctx: NodeContext) -> Tensor:
    (x, dt) = _floats(ctx, ("input",))
    return ctx.make("Sub", [ctx.make("Exp", [x], tag="exp"), ctx.const("one", 1.0, dt)])


@emits("erfc", since=11)
def erfc(ctx: NodeContext) -> Tensor:
    (x, dt) = _floats(ctx, ("input",))
    return ctx.make("Sub", [ctx.const("one", 1.0, dt), ctx.make("Erf", [x], tag="erf")])


@emits("sinc", since=11)
def sinc(ctx: NodeContext) -> Tensor:
    """sin(pi x) / (pi x), 1 at x = 0."""
    (x, dt) = _floats(ctx, ("input",))
    px = ctx.make("Mul", [x, ctx.const("pi", math.pi, dt)], tag="pi_x")
    ratio = ctx.make("Div", [ctx.make("Sin", [px], tag="sin"), px], tag="ratio")
    zero = ctx.make("Equal", [x, ctx.const("zero", 0.0, dt)], tag="is_zero", dtype=BOOL)
    return ctx.make("Where", [zero, ctx.const("one", 1.0, dt), ratio], dtype=dt)


@emits("signbit", since=11)
def signbit(ctx: NodeContext) -> Tensor:
    """x < 0, or x is -0.0 (1 / x < 0); integers: x < 0."""
    x = ctx.x()
    dt = ctx.dtype(x)
    zero = ctx.const("zero", 0, dt)
    neg = ctx.make("Less", [x, zero], tag="negative" if dt in FLOAT_TYPES else None, dtype=BOOL)
    if dt not in FLOAT_TYPES:
        return neg
    neg_zero = ctx.make("And", [ctx.make("Equal", [x, zero], tag="is_zero", dtype=BOOL),
                                ctx.make("Less", [ctx.make("Div", [ctx.const("one", 1.0, dt), x], tag="inv"), zero],
                                         tag="inv_neg", dtype=BOOL)], tag="neg_zero", dtype=BOOL)
    return ctx.make("Or", [neg, neg_zero], dtype=BOOL)


def inf_side(positive: bool):
    """isposinf / isneginf: IsInf for one side (false on integers)."""
    def rule(ctx: NodeContext) -> Tensor:
        x = ctx.x()
        if ctx.dtype(x) not in FLOAT_TYPES:
            return ctx.make("Not", [ctx.make("Equal", [x, x], tag="same", dtype=BOOL)], dtype=BOOL)
        return ctx.make("IsInf", [x], dtype=BOOL, detect_positive=int(positive), detect_negative=int(not positive))
    return rule


register("isposinf", inf_side(True))
register("isneginf", inf_side(False))


@emits("isreal", since=11)
def isreal(ctx: NodeContext) -> Tensor:
    """Every element of a real tensor is real."""
    x = ctx.x()
    dt = ctx.dtype(x)
    if dt not in FLOAT_TYPES:
        return ctx.make("Equal", [x, x], dtype=BOOL)
    return ctx.make("Or", [ctx.make("Equal", [x, x], tag="same", dtype=BOOL),
                           ctx.make("IsNaN", [x], tag="nan", dtype=BOOL)], dtype=BOOL)
