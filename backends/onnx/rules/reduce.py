"""Reduction rules: sum / mean / prod, max / min (with indices), amax / amin, argmax / argmin,
std / var (and their ``_mean`` pairs), norms, cumsum, logsumexp, all / any.

torch's conventions kept: ``dim=None`` (or ``()``) reduces every dim to a 0-d result; integer
and bool inputs of ``sum`` / ``prod`` / ``cumsum`` accumulate in int64; indices are int64.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch.fx as fx
from onnx import TensorProto

from qcompiler.backends.onnx.context import (
    FLOAT_TYPES,
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits, register
from qcompiler.backends.onnx.rules.common import I64, _norm_axis, _onnx_dtype
from qcompiler.ir.ops import REQUIRED

BOOL = TensorProto.BOOL


def _axes(ctx: NodeContext, dim: Any, rank: int) -> Optional[list[int]]:
    """Sorted reduction axes, or None for every dim (``dim`` None, ``()`` or ``[]``)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        raise ctx.unsupported(f"dim={dim!r} (reduction dims must be python ints)")
    return sorted({_norm_axis(int(d), rank) for d in dims})


def _reduce(ctx: NodeContext, op_type: str, x: str, axes: Optional[list[int]], keepdim: bool,
            tag: Optional[str] = None, dtype: Optional[int] = None) -> Tensor:
    """``op_type`` (a Reduce* op) over ``axes`` (None: all, giving a 0-d result without keepdim)."""
    attrs: dict[str, Any] = dict(keepdims=int(bool(keepdim)))
    if axes is not None:
        attrs["axes"] = list(axes)
    return ctx.make(op_type, [x], tag=tag, dtype=dtype, **attrs)


def _input(ctx: NodeContext, dtype: Any, promote_int: bool = False) -> Tensor:
    """The input, cast to ``dtype`` (a torch dtype) when given; integer / bool inputs to int64
    when ``promote_int`` (torch's sum / prod / cumsum accumulate there)."""
    x = ctx.x()
    if dtype is not None:
        to = _onnx_dtype(ctx, dtype)
        return x if ctx.dtype(x) == to else ctx.make("Cast", [x], tag="cast_dtype", to=to, dtype=to)
    if promote_int and ctx.dtype(x) not in FLOAT_TYPES and ctx.dtype(x) != I64:
        return ctx.make("Cast", [x], tag="cast_int64", to=I64, dtype=I64)
    return x


def _float_input(ctx: NodeContext, what: str) -> Tensor:
    x = ctx.x()
    if ctx.dtype(x) not in FLOAT_TYPES:
        raise ctx.unsupported(f"{what} of a non-float tensor (torch computes it for floating point only)")
    return x


@emits("mean", since=11)
def mean(ctx: NodeContext):
    rank = ctx.rank()
    kw = ctx.kw(dim=None, keepdim=False, dtype=None)
    x = _input(ctx, kw["dtype"])
    keepdim = bool(kw["keepdim"])
    axes = _axes(ctx, kw["dim"], rank)
    if rank == 4 and axes == [2, 3]:  # mean over H, W: a global average pool
        if keepdim:
            return ctx.make("GlobalAveragePool", [x])
        g = ctx.make("GlobalAveragePool", [x], tag="global_avg_pool")
        return ctx.make("Squeeze", [g], axes=[2, 3])
    if rank == 0:
        return ctx.identity(x)
    return _reduce(ctx, "ReduceMean", x, list(range(rank)) if axes is None else axes, keepdim)


def _simple_reduction(op_type: str, promote_int: bool):
    def rule(ctx: NodeContext) -> Tensor:
        rank = ctx.rank()
        kw = ctx.kw(dim=None, keepdim=False, dtype=None)
        x = _input(ctx, kw["dtype"], promote_int)
        if rank == 0:
            return ctx.identity(x)
        return _reduce(ctx, op_type, x, _axes(ctx, kw["dim"], rank), kw["keepdim"])
    rule.__qualname__ = rule.__name__ = f"reduce_{op_type.lower()}"
    return rule


emits("sum", since=11)(_simple_reduction("ReduceSum", promote_int=True))


@emits("prod", since=11)
def prod(ctx: NodeContext) -> Tensor:
    """``torch.prod(x)`` (every dim) / ``torch.prod(x, dim, keepdim)``: ReduceProd (one dim at a time in torch)."""
    rank = ctx.rank()
    kw = ctx.kw(dim=None, keepdim=False, dtype=None)
    x = _input(ctx, kw["dtype"], promote_int=True)
    if isinstance(kw["dim"], (list, tuple)):
        raise ctx.unsupported("prod over a list of dims (torch takes one int dim)")
    if rank == 0:
        return ctx.identity(x)
    return _reduce(ctx, "ReduceProd", x, _axes(ctx, kw["dim"], rank), kw["keepdim"])


@emits("amax", "amin", since=11)
def amax(ctx: NodeContext) -> Tensor:
    rank = ctx.rank()
    kw = ctx.kw(dim=(), keepdim=False)
    x = ctx.x()
    if rank == 0:
        return ctx.identity(x)
    return _reduce(ctx, "ReduceMax" if ctx.op == "amax" else "ReduceMin", x, _axes(ctx, kw["dim"], rank),
                   kw["keepdim"])


@emits("max", "min", since=11)
def max_min(ctx: NodeContext):
    """Three forms: ``torch.max(x)`` (0-d), ``torch.max(x, dim, keepdim)`` -> (values, indices),
    ``torch.max(x, other)`` (element-wise, broadcasting)."""
    is_max = ctx.op == "max"
    kw = ctx.kw(dim=None, keepdim=False)
    other = ctx.call.kwargs.get("other", kw["dim"])
    if isinstance(other, fx.Node):  # element-wise maximum / minimum of two tensors
        x = ctx.x()
        y = ctx.tensor(other, ctx.dtype(x))
        return ctx.make("Max" if is_max else "Min", [x, y])
    rank = ctx.rank()
    x = ctx.x()
    dim = kw["dim"]
    if dim is None:
        if rank == 0:
            return ctx.identity(x)
        return _reduce(ctx, "ReduceMax" if is_max else "ReduceMin", x, None, False)
    if not isinstance(dim, int):
        raise ctx.unsupported(f"dim={dim!r} (max / min with dim take one python int)")
    keep = bool(kw["keepdim"])
    if rank == 0:  # values and index 0 of a 0-d tensor
        return ctx.identity(x), ctx.const("index", 0, I64)
    axis = _norm_axis(dim, rank)
    values = _reduce(ctx, "ReduceMax" if is_max else "ReduceMin", x, [axis], keep)
    indices = ctx.make("ArgMax" if is_max else "ArgMin", [x], tag="indices", dtype=I64, axis=axis,
                       keepdims=int(keep))
    return values, indices


@emits("argmax", "argmin", since=11)
def argmax(ctx: NodeContext) -> Tensor:
    """ArgMax / ArgMin (int64, the first extreme as torch on CPU); ``dim=None`` flattens first."""
    rank = ctx.rank()
    kw = ctx.kw(dim=None, keepdim=False)
    x = ctx.x()
    op_type = "ArgMax" if ctx.op == "argmax" else "ArgMin"
    keep = bool(kw["keepdim"])
    if rank == 0:
        return ctx.const("index", 0, I64)
    if kw["dim"] is None:
        flat = ctx.make("Reshape", [x, ctx.const("flat", [-1], I64)], tag="flatten")
        y = ctx.make(op_type, [flat], tag="arg" if keep else None, dtype=I64, axis=0, keepdims=0)
        if keep:  # torch keeps every dim as size 1
            return ctx.make("Reshape", [y, ctx.const("ones", [1] * rank, I64)], dtype=I64)
        return y
    if not isinstance(kw["dim"], int):
        raise ctx.unsupported(f"dim={kw['dim']!r} (argmax / argmin take one python int)")
    return ctx.make(op_type, [x], dtype=I64, axis=_norm_axis(kw["dim"], rank), keepdims=int(keep))


def _var_args(ctx: NodeContext) -> tuple[Any, float, bool]:
    """``(dim, correction, keepdim)`` from every std / var form: ``(x, dim, unbiased, keepdim)``,
    ``(x, unbiased)``, ``(x, dim, *, correction, keepdim)``."""
    if ctx.module is not None:
        raise ctx.unsupported("std / var as a module")
    args = list(ctx.call.args[1:])
    kwargs = {k: v for k, v in ctx.call.kwargs.items() if k != "input"}
    if args and isinstance(args[0], bool):  # torch.var(x, unbiased)
        kwargs.setdefault("unbiased", args.pop(0))
    for name, v in zip(("dim", "unbiased", "keepdim"), args):
        kwargs[name] = v
    unknown = set(kwargs) - {"dim", "unbiased", "correction", "keepdim"}
    if unknown:
        raise ctx.unsupported(f"argument(s) {sorted(unknown)}")
    if "correction" in kwargs and kwargs["correction"] is not None:
        correction = kwargs["correction"]
        if not isinstance(correction, (int, float)):
            raise ctx.unsupported(f"correction={correction!r} (a python number)")
    else:
        correction = 1 if kwargs.get("unbiased", True) else 0
    return kwargs.get("dim"), float(correction), bool(kwargs.get("keepdim", False))


@emits("std", "var", "std_mean", "var_mean", since=11)
def std_var(ctx: NodeContext):
    """Two-pass: ``sum((x - mean)^2) / max(0, n - correction)`` (sqrt for std); ``std_mean`` /
    ``var_mean`` give ``(std or var, mean)``. ``n`` is read from the input's shape at run time
    (a compiled model takes other batch sizes)."""
    dim, correction, keep = _var_args(ctx)
    rank = ctx.rank()
    if 0 in ctx.shape():
        raise ctx.unsupported(f"{ctx.op} of an empty tensor")
    x = _float_input(ctx, ctx.op)
    axes = _axes(ctx, dim, rank)
    axes = list(range(rank)) if axes is None else axes
    if rank == 0:  # one element, as a 1-D tensor reduced to 0-d again
        x, axes, keep = ctx.make("Unsqueeze", [x], tag="as_1d", axes=[0]), [0], False
    m = _reduce(ctx, "ReduceMean", x, axes, True, tag="mean")
    d = ctx.make("Sub", [x, m], tag="centered")
    sq = ctx.make("Mul", [d, d], tag="square")
    s = _reduce(ctx, "ReduceSum", sq, axes, keep, tag="sum_squares")
    dt = ctx.dtype(x)
    sizes = ctx.make("Gather", [ctx.make("Shape", [x], tag="shape", dtype=I64), ctx.const("axes", axes, I64)],
                     tag="reduced_sizes", dtype=I64, axis=0)
    n = ctx.make("Cast", [_reduce(ctx, "ReduceProd", sizes, None, False, tag="count")], tag="count_float",
                 to=dt, dtype=dt)
    denom = ctx.make("Max", [ctx.make("Sub", [n, ctx.const("correction", correction, dt)], tag="dof"),
                             ctx.const("zero", 0.0, dt)], tag="denominator")
    with_mean = ctx.op.endswith("_mean")
    if ctx.op.startswith("var"):
        out = ctx.make("Div", [s, denom], tag="var" if with_mean else None)
    else:
        out = ctx.make("Sqrt", [ctx.make("Div", [s, denom], tag="var")], tag="std" if with_mean else None)
    if not with_mean:
        return out
    return out, (m if keep else ctx.make("Squeeze", [m], tag="mean_out", axes=axes))


@emits("norm", "vector_norm", since=11)
def norm(ctx: NodeContext) -> Tensor:
    """Vector norms: ``torch.norm(x, p, dim, keepdim)`` (``p="fro"`` is 2), ``x.norm(...)``,
    ``torch.linalg.vector_norm(x, ord, dim, keepdim)``: ReduceL1 / ReduceL2, max / min of
    ``|x|`` for +-inf, a count of non-zeros for 0, else ``sum(|x|^p)^(1/p)``."""
    if ctx.op == "vector_norm":
        kw = ctx.kw(ord=2, dim=None, keepdim=False, dtype=None)
        p = kw["ord"]
    else:
        kw = ctx.kw(p="fro", dim=None, keepdim=False, out=None, dtype=None)
        p = kw["p"]
        if kw["out"] is not None:
            raise ctx.unsupported("out=")
    if isinstance(p, str):
        if p != "fro":
            raise ctx.unsupported(f"p={p!r} (a matrix norm; vector norms and 'fro' are emitted)")
        if isinstance(kw["dim"], (list, tuple)) and len(kw["dim"]) > 2:
            raise ctx.unsupported("p='fro' over more than 2 dims")
        p = 2
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise ctx.unsupported(f"p={p!r} (a python number)")
    rank = ctx.rank()
    x = _input(ctx, kw["dtype"])
    if ctx.dtype(x) not in FLOAT_TYPES:
        raise ctx.unsupported("the norm of a non-float tensor")
    axes = _axes(ctx, kw["dim"], rank)
    keep = kw["keepdim"]
    if rank == 0:  # one element, as a 1-D tensor reduced to 0-d again
        x, axes, keep = ctx.make("Unsqueeze", [x], tag="as_1d", axes=[0]), [0], False
    if p == 1:
        return _reduce(ctx, "ReduceL1", x, axes, keep)
    if p == 2:
        return _reduce(ctx, "ReduceL2", x, axes, keep)
    if math.isinf(p):
        a = ctx.make("Abs", [x], tag="abs")
        return _reduce(ctx, "ReduceMax" if p > 0 else "ReduceMin", a, axes, keep)
    if p == 0:
        nz = ctx.make("Cast", [ctx.make("Cast", [x], tag="nonzero", to=BOOL, dtype=BOOL)], tag="count",
                      to=ctx.dtype(x), dtype=ctx.dtype(x))
        return _reduce(ctx, "ReduceSum", nz, axes, keep)
    a = ctx.make("Abs", [x], tag="abs")
    powed = ctx.make("Pow", [a, ctx.const("p", float(p), ctx.dtype(x))], tag="pow")
    s = _reduce(ctx, "ReduceSum", powed, axes, keep, tag="sum")
    return ctx.make("Pow", [s, ctx.const("inv_p", 1.0 / float(p), ctx.dtype(x))])


@emits("aminmax", since=11)
def aminmax(ctx: NodeContext):
    """(min, max) over ``dim`` (every element without it)."""
    kw = ctx.kw(dim=None, keepdim=False)
    x = ctx.x()
    rank = ctx.rank()
    if rank == 0:
        return ctx.identity(x), ctx.make("Identity", [x], tag="max")
    axes = _axes(ctx, kw["dim"], rank)
    return (_reduce(ctx, "ReduceMin", x, axes, kw["keepdim"], tag="min"),
            _reduce(ctx, "ReduceMax", x, axes, kw["keepdim"], tag="max"))


@emits("linalg_norm", "matrix_norm", since=11)
def linalg_norm(ctx: NodeContext) -> Tensor:
    """torch.linalg.norm with ord None (the 2-norm of the flattened input, or of ``dim``) or 'fro', and
    torch.linalg.matrix_norm with 'fro' (over the last two dims): ReduceL2. Other orders (singular values,
    max row sums) are refused."""
    if ctx.op == "matrix_norm":
        kw = ctx.kw(ord="fro", dim=(-2, -1), keepdim=False, dtype=None)
    else:
        kw = ctx.kw(ord=None, dim=None, keepdim=False, dtype=None)
    if kw["ord"] not in (None, "fro"):
        raise ctx.unsupported(f"ord={kw['ord']!r} (None and 'fro' are emitted)")
    x = _input(ctx, kw["dtype"])
    if ctx.dtype(x) not in FLOAT_TYPES:
        raise ctx.unsupported("the norm of a non-float tensor")
    rank = ctx.rank()
    if rank == 0:
        return ctx.make("Abs", [x])
    return _reduce(ctx, "ReduceL2", x, _axes(ctx, kw["dim"], rank), kw["keepdim"])


@emits("cumsum", since=11)
def cumsum(ctx: NodeContext) -> Tensor:
    kw = ctx.kw(dim=REQUIRED, dtype=None)
    rank = ctx.rank()
    x = _input(ctx, kw["dtype"], promote_int=True)
    if rank == 0:
        return ctx.identity(x)
    if not isinstance(kw["dim"], int):
        raise ctx.unsupported(f"dim={kw['dim']!r} (a python int)")
    axis = ctx.const("axis", _norm_axis(kw["dim"], rank), I64)
    return ctx.make("CumSum", [x, axis])


@emits("logsumexp", since=11)
def logsumexp(ctx: NodeContext) -> Tensor:
    """``max + log(sum(exp(x - max)))`` (stable for large inputs, as torch)."""
    kw = ctx.kw(dim=(), keepdim=False)
    rank = ctx.rank()
    x = _float_input(ctx, "logsumexp")
    if rank == 0:
        return ctx.identity(x)
    axes = _axes(ctx, kw["dim"], rank)
    axes = list(range(rank)) if axes is None else axes
    m = _reduce(ctx, "ReduceMax", x, axes, True, tag="max")
    e = ctx.make("Exp", [ctx.make("Sub", [x, m], tag="shifted")], tag="exp")
    lse = ctx.make("Add", [ctx.make("Log", [_reduce(ctx, "ReduceSum", e, axes, True, tag="sum")], tag="log"), m],
                   tag="lse" if not kw["keepdim"] else None)
    if kw["keepdim"]:
        return lse
    return ctx.make("Squeeze", [lse], axes=axes)


@emits("all", "any", since=11)
def all_any(ctx: NodeContext) -> Tensor:
    """As bool -> int32, ReduceMin (all) / ReduceMax (any), back to bool (opset 11 reduces no bools)."""
    kw = ctx.kw(dim=None, keepdim=False)
    rank = ctx.rank()
    x = ctx.x()
    b = x if ctx.dtype(x) == BOOL else ctx.make("Cast", [x], tag="as_bool", to=BOOL, dtype=BOOL)
    if rank == 0:
        return ctx.identity(b)
    i = ctx.make("Cast", [b], tag="as_int", to=TensorProto.INT32, dtype=TensorProto.INT32)
    r = _reduce(ctx, "ReduceMin" if ctx.op == "all" else "ReduceMax", i, _axes(ctx, kw["dim"], rank),
                kw["keepdim"], tag="reduce")
    out = ctx.out_dtype() or BOOL
    return ctx.make("Cast", [r], to=out, dtype=out)



def nan_reduction(kind: str):
    """nansum / nanmean: NaNs count as 0 (nansum) or are left out (nanmean: the sum over the count)."""
    def rule(ctx: NodeContext) -> Tensor:
        kw = ctx.kw(dim=None, keepdim=False, dtype=None)
        x = _input(ctx, kw["dtype"])
        rank = ctx.rank()
        if ctx.dtype(x) not in FLOAT_TYPES or rank == 0:
            raise ctx.unsupported(f"{kind} of a non-float or 0-d tensor")
        dt = ctx.dtype(x)
        axes = _axes(ctx, kw["dim"], rank)
        nan = ctx.make("IsNaN", [x], tag="nan", dtype=BOOL)
        clean = ctx.make("Where", [nan, ctx.const("zero", 0.0, dt), x], tag="clean", dtype=dt)
        s = _reduce(ctx, "ReduceSum", clean, axes, kw["keepdim"], tag=None if kind == "nansum" else "sum")
        if kind == "nansum":
            return s
        count = ctx.make("Cast", [ctx.make("Not", [nan], tag="number", dtype=BOOL)], tag="ones", to=dt, dtype=dt)
        return ctx.make("Div", [s, _reduce(ctx, "ReduceSum", count, axes, kw["keepdim"], tag="count")])
    rule.__name__ = kind
    return rule


register("nansum", nan_reduction("nansum"))
register("nanmean", nan_reduction("nanmean"))


@emits("count_nonzero", since=11)
def count_nonzero(ctx: NodeContext) -> Tensor:
    kw = ctx.kw(dim=None)
    x = ctx.x()
    rank = ctx.rank()
    nz = ctx.make("Not", [ctx.make("Equal", [x, ctx.const("zero", 0, ctx.dtype(x))], tag="is_zero", dtype=BOOL)],
                  tag="nonzero", dtype=BOOL)
    ones = ctx.make("Cast", [nz], tag="ones", to=I64, dtype=I64)
    if rank == 0:
        return ctx.identity(ones)
    return _reduce(ctx, "ReduceSum", ones, _axes(ctx, kw["dim"], rank) or list(range(rank)), False)


@emits("logcumsumexp", since=11)
def logcumsumexp(ctx: NodeContext) -> Tensor:
    """log(cumsum(exp(x - m))) + m along ``dim``, m the max over the dim (finite: -inf rows stay -inf)."""
    dim = ctx.kw(dim=REQUIRED)["dim"]
    x = ctx.x()
    rank = ctx.rank()
    if rank == 0 or ctx.dtype(x) not in FLOAT_TYPES:
        raise ctx.unsupported("logcumsumexp of a 0-d or non-float tensor")
    axis = _norm_axis(int(dim), rank)
    dt = ctx.dtype(x)
    m = ctx.make("ReduceMax", [x], tag="max", axes=[axis], keepdims=1)
    m = ctx.make("Where", [ctx.make("IsInf", [m], tag="max_inf", dtype=BOOL), ctx.const("zero", 0.0, dt), m],
                 tag="shift", dtype=dt)
    e = ctx.make("Exp", [ctx.make("Sub", [x, m], tag="shifted")], tag="exp")
    c = ctx.make("CumSum", [e, ctx.const("axis", axis, I64)], tag="cumsum")
    return ctx.make("Add", [ctx.make("Log", [c], tag="log"), m])
