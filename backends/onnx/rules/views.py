"""More layout and selection rules (the op-catalogue benchmark's): reshape_as / view_as, broadcast_to,
atleast_1d/2d/3d, hstack / vstack, constant_pad_nd, select (one index of a dim), take (flat indices),
masked_select (Compress of the flattened, broadcast input), fliplr / flipud, diff, cross,
broadcast_tensors, aten.slice, tril / triu, trace, ravel, outer, nonzero / argwhere and unique."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.fx as fx
from onnx import TensorProto

from qcompiler.backends.onnx.context import NodeContext, Tensor
from qcompiler.backends.onnx.registry import emits, register
from qcompiler.backends.onnx.rules.common import I64, _norm_axis
from qcompiler.backends.onnx.rules.layout import _dims_args, shape_tensor
from qcompiler.ir.ops import REQUIRED


@emits("reshape_as", since=11)
def reshape_as(ctx: NodeContext) -> Tensor:
    other = ctx.tensor(ctx.arg(1, "other"))
    return ctx.make("Reshape", [ctx.x(), ctx.make("Shape", [other], tag="shape", dtype=I64)])


@emits("broadcast_to", since=11)
def broadcast_to(ctx: NodeContext) -> Tensor:
    """Expand to ``size`` (torch's ``-1`` keeps that dim: 1 for Expand-11, which broadcasts both ways)."""
    dims = [1 if isinstance(d, int) and d == -1 else d for d in _dims_args(ctx, 1, "size")]
    return ctx.make("Expand", [ctx.x(), shape_tensor(ctx, dims)])


def _atleast(ctx: NodeContext, t: Any, rank: int, n: int, tag: str) -> Tensor:
    """torch.atleast_{n}d of one tensor of rank ``rank``: a 0-d becomes (1,...); a 1-D (k,) becomes
    (1, k) / (1, k, 1); a 2-D (a, b) becomes (a, b, 1) for n = 3."""
    x = ctx.tensor(t)
    if rank >= n:
        return ctx.make("Identity", [x], tag=tag)
    axes = {(0, 1): [0], (0, 2): [0, 1], (0, 3): [0, 1, 2], (1, 2): [0], (1, 3): [0, 2], (2, 3): [2]}[(rank, n)]
    return ctx.make("Unsqueeze", [x], tag=tag, axes=axes)


def atleast(n: int):
    def rule(ctx: NodeContext):
        args = ctx.call.args
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = args[0]
        outs = tuple(_atleast(ctx, a, ctx.rank(a), n, f"t{i}") for i, a in enumerate(args))
        return outs[0] if len(outs) == 1 and not isinstance(ctx.call.args[0], (list, tuple)) else outs
    rule.__name__ = f"atleast_{n}d"
    return rule


for _n in (1, 2, 3):
    register(f"atleast_{_n}d", atleast(_n))


def stack_along(kind: str):
    """hstack: Concat along dim 1 (dim 0 for 1-D inputs); vstack: atleast_2d, then Concat along dim 0."""
    def rule(ctx: NodeContext) -> Tensor:
        tensors = ctx.arg(0, "tensors")
        if isinstance(tensors, fx.Node):
            raise ctx.unsupported(f"{kind} of a tuple value (pass a list of tensors)")
        ranks = [ctx.rank(t) for t in tensors]
        if kind == "hstack":
            names = [_atleast(ctx, t, r, 1, f"t{i}") for i, (t, r) in enumerate(zip(tensors, ranks))]
            axis = 0 if max(ranks) <= 1 else 1
        else:
            names = [_atleast(ctx, t, r, 2, f"t{i}") for i, (t, r) in enumerate(zip(tensors, ranks))]
            axis = 0
        return ctx.make("Concat", names, axis=axis)
    rule.__name__ = kind
    return rule


register("hstack", stack_along("hstack"))
register("vstack", stack_along("vstack"))


@emits("constant_pad_nd", since=11)
def constant_pad_nd(ctx: NodeContext) -> Tensor:
    """torch.constant_pad_nd(x, pad, value): F.pad's constant mode; negative pads crop (a Slice)."""
    kw = ctx.kw(pad=REQUIRED, value=0)
    x, rank = ctx.x(), ctx.rank()
    pads = [int(p) for p in kw["pad"]]
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pads) // 2):
        begins[rank - 1 - i], ends[rank - 1 - i] = pads[2 * i], pads[2 * i + 1]
    if any(p < 0 for p in pads):
        axes = [d for d in range(rank) if begins[d] < 0 or ends[d] < 0]
        starts = [max(0, -begins[d]) for d in axes]
        stops = [ends[d] if ends[d] < 0 else 2 ** 62 for d in axes]
        x = ctx.make("Slice", [x, ctx.const("crop_starts", starts, I64), ctx.const("crop_ends", stops, I64),
                               ctx.const("crop_axes", axes, I64)], tag="crop")
        begins, ends = [max(0, p) for p in begins], [max(0, p) for p in ends]
    value = ctx.const("value", kw["value"], ctx.dtype(x))
    return ctx.make("Pad", [x, ctx.const("pads", begins + ends, I64), value], mode="constant")


@emits("select", since=11)
def select(ctx: NodeContext) -> Tensor:
    """x.select(dim, index): Gather with a 0-d index drops the dim."""
    kw = ctx.kw(dim=REQUIRED, index=REQUIRED)
    rank = ctx.rank()
    index = ctx.value(kw["index"])
    if not isinstance(index, int):
        raise ctx.unsupported("a tensor index (give a Python int)")
    return ctx.make("Gather", [ctx.x(), ctx.const("index", index, I64)], axis=_norm_axis(int(kw["dim"]), rank))


@emits("take", since=11)
def take(ctx: NodeContext) -> Tensor:
    """x.take(index): the flattened input gathered at ``index`` (negative indices count from the end)."""
    flat = ctx.make("Reshape", [ctx.x(), ctx.const("flat", [-1], I64)], tag="flat")
    return ctx.make("Gather", [flat, ctx.tensor(ctx.arg(1, "index"), I64)], axis=0)


@emits("masked_select", since=11)
def masked_select(ctx: NodeContext) -> Tensor:
    """The elements of x where mask is true, flattened: both broadcast to one shape, then Compress."""
    x = ctx.x()
    mask = ctx.tensor(ctx.arg(1, "mask"), TensorProto.BOOL)
    zeros = ctx.make("Mul", [ctx.make("Cast", [x], tag="x_float", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT),
                             ctx.const("zero", np.float32(0))], tag="x_zeros")
    mask_f = ctx.make("Cast", [mask], tag="mask_float", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT)
    shape = ctx.make("Shape", [ctx.make("Add", [zeros, mask_f], tag="broadcast")], tag="shape", dtype=I64)
    xb = ctx.make("Expand", [x, shape], tag="x_expanded")
    mb = ctx.make("Expand", [mask, shape], tag="mask_expanded", dtype=TensorProto.BOOL)
    return ctx.make("Compress", [xb, mb])


def flip_dim(axis: int):
    """fliplr (dim 1) / flipud (dim 0): Slice with step -1."""
    def rule(ctx: NodeContext) -> Tensor:
        return ctx.make("Slice", [ctx.x(), ctx.const("starts", [-1], I64), ctx.const("ends", [-(2 ** 63)], I64),
                                  ctx.const("axes", [axis], I64), ctx.const("steps", [-1], I64)])
    return rule


register("fliplr", flip_dim(1))
register("flipud", flip_dim(0))


def _slice1(ctx: NodeContext, x: Tensor, axis: int, start: int, end: int, tag: str) -> Tensor:
    return ctx.make("Slice", [x, ctx.const(f"{tag}_start", [start], I64), ctx.const(f"{tag}_end", [end], I64),
                              ctx.const(f"{tag}_axis", [axis], I64)], tag=tag)


@emits("diff", since=11)
def diff(ctx: NodeContext) -> Tensor:
    """x[1:] - x[:-1] along ``dim``, ``n`` times, after concatenating ``prepend`` / ``append``."""
    kw = ctx.kw(n=1, dim=-1, prepend=None, append=None)
    rank = ctx.rank()
    axis = _norm_axis(int(kw["dim"]), rank)
    x = ctx.x()
    parts = [ctx.tensor(kw["prepend"])] if kw["prepend"] is not None else []
    parts += [x] + ([ctx.tensor(kw["append"])] if kw["append"] is not None else [])
    if len(parts) > 1:
        if any(ctx.rank(a) != rank for a in (kw["prepend"], kw["append"]) if a is not None):
            raise ctx.unsupported("prepend / append of another rank than the input (give tensors of its rank)")
        x = ctx.make("Concat", parts, tag="joined", axis=axis)
    for i in range(int(kw["n"])):
        hi, lo = _slice1(ctx, x, axis, 1, 2 ** 62, f"hi{i}"), _slice1(ctx, x, axis, 0, -1, f"lo{i}")
        dt = ctx.dtype(x)
        x = ctx.make("Xor" if dt == TensorProto.BOOL else "Sub", [hi, lo], tag=f"diff{i}",
                     dtype=dt)
    return ctx.make("Identity", [x])


@emits("cross", since=11)
def cross(ctx: NodeContext) -> Tensor:
    """a x b along ``dim`` (size 3): a[1,2,0] b[2,0,1] - a[2,0,1] b[1,2,0] (Gather along the dim)."""
    kw = ctx.kw(other=REQUIRED, dim=None)
    a, b = ctx.x(), ctx.tensor(kw["other"])
    shape = ctx.out_shape()
    if shape is None:
        raise ctx.unsupported("cross of tensors of unknown shape")
    if kw["dim"] is None:
        if ctx.op == "linalg_cross":
            kw["dim"] = -1
        else:
            kw["dim"] = next((d for d, n in enumerate(shape) if n == 3), None)
            if kw["dim"] is None:
                raise ctx.unsupported("no dim of size 3")
    axis = _norm_axis(int(kw["dim"]), len(shape))

    def rot(t: Tensor, idx: list[int], tag: str) -> Tensor:
        return ctx.make("Gather", [t, ctx.const(f"{tag}_idx", idx, I64)], tag=tag, axis=axis)
    first = ctx.make("Mul", [rot(a, [1, 2, 0], "a120"), rot(b, [2, 0, 1], "b201")], tag="first")
    second = ctx.make("Mul", [rot(a, [2, 0, 1], "a201"), rot(b, [1, 2, 0], "b120")], tag="second")
    return ctx.make("Sub", [first, second])


register("linalg_cross", cross)


@emits("broadcast_tensors", since=11)
def broadcast_tensors(ctx: NodeContext):
    """Every input expanded to the common shape (read at run time from a sum of zeros of each)."""
    args = ctx.call.args
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = args[0]
    names = [ctx.tensor(a) for a in args]
    acc = None
    for i, t in enumerate(names):
        z = ctx.make("Mul", [ctx.make("Cast", [t], tag=f"f{i}", to=TensorProto.FLOAT, dtype=TensorProto.FLOAT),
                             ctx.const(f"zero{i}", 0.0)], tag=f"zeros{i}")
        acc = z if acc is None else ctx.make("Add", [acc, z], tag=f"acc{i}")
    shape = ctx.make("Shape", [acc], tag="shape", dtype=I64)
    return tuple(ctx.make("Expand", [t, shape], tag=f"out{i}") for i, t in enumerate(names))


@emits("slice", since=11)
def slice_(ctx: NodeContext) -> Tensor:
    """aten.slice(x, dim, start, end, step): Slice (None bounds are the whole dim)."""
    kw = ctx.kw(dim=0, start=None, end=None, step=1)
    vals = [ctx.value(kw[k]) for k in ("start", "end", "step")]
    if any(v is not None and not isinstance(v, int) for v in vals):
        raise ctx.unsupported("slice bounds that are tensors")
    start, end, step = vals
    step = 1 if step is None else step
    start = 0 if start is None else start
    end = 2 ** 62 if end is None else min(end, 2 ** 62)
    axis = _norm_axis(int(kw["dim"]), ctx.rank())
    return ctx.make("Slice", [ctx.x(), ctx.const("starts", [start], I64), ctx.const("ends", [end], I64),
                              ctx.const("axes", [axis], I64), ctx.const("steps", [step], I64)])


def _row_col(ctx: NodeContext, x: Tensor) -> tuple[Tensor, Tensor]:
    """Row and column indices of the last two dims as (R, 1) and (1, C) int64 tensors, from the run-time
    shape (no size is baked in: a CPU island keeps its dynamic batch)."""
    shape = ctx.make("Shape", [x], tag="shape", dtype=I64)
    zero, one = ctx.const("zero", 0, I64), ctx.const("one", 1, I64)

    def size(i: int, tag: str) -> Tensor:
        return ctx.make("Squeeze", [ctx.make("Slice", [shape, ctx.const(f"{tag}_at", [i], I64),
                                                        ctx.const(f"{tag}_end", [i + 1 if i != -1 else 2 ** 62],
                                                                  I64)], tag=f"{tag}_slice", dtype=I64)],
                        tag=f"{tag}_size", axes=[0], dtype=I64)
    rows = ctx.make("Range", [zero, size(-2, "rows"), one], tag="rows", dtype=I64)
    cols = ctx.make("Range", [zero, size(-1, "cols"), one], tag="cols", dtype=I64)
    return (ctx.make("Unsqueeze", [rows], tag="row", axes=[1], dtype=I64),
            ctx.make("Unsqueeze", [cols], tag="col", axes=[0], dtype=I64))


def triangle(upper: bool):
    """tril / triu: x where col - row <= diagonal (tril) / >= diagonal (triu), else 0."""
    def rule(ctx: NodeContext) -> Tensor:
        diagonal = ctx.kw(diagonal=0)["diagonal"]
        if not isinstance(diagonal, int):
            raise ctx.unsupported("a diagonal that is not a Python int")
        x = ctx.x()
        if ctx.rank() < 2:
            raise ctx.unsupported("an input of fewer than 2 dims")
        row, col = _row_col(ctx, x)
        offset = ctx.make("Sub", [col, row], tag="offset", dtype=I64)
        k = ctx.const("diagonal", diagonal, I64)
        drop = ctx.make("Less" if upper else "Greater", [offset, k], tag="drop", dtype=TensorProto.BOOL)
        zero = ctx.make("Cast", [ctx.const("zero_value", 0, I64)], tag="zero_x", to=ctx.dtype(x), dtype=ctx.dtype(x))
        return ctx.make("Where", [drop, zero, x], dtype=ctx.dtype(x))
    return rule


register("tril", triangle(False))
register("triu", triangle(True))


@emits("trace", since=11)
def trace(ctx: NodeContext) -> Tensor:
    """The sum of the diagonal of a 2-D tensor (integers sum in int64, as torch)."""
    x = ctx.x()
    if ctx.rank() != 2:
        raise ctx.unsupported("trace of a tensor that is not 2-D")
    row, col = _row_col(ctx, x)
    dt = ctx.out_dtype() or ctx.dtype(x)
    x = x if ctx.dtype(x) == dt else ctx.make("Cast", [x], tag="cast", to=dt, dtype=dt)
    zero = ctx.make("Cast", [ctx.const("zero_value", 0, I64)], tag="zero_x", to=dt, dtype=dt)
    diag = ctx.make("Where", [ctx.make("Equal", [row, col], tag="on_diagonal", dtype=TensorProto.BOOL), x, zero],
                    tag="diagonal", dtype=dt)
    return ctx.make("ReduceSum", [diag], keepdims=0)


@emits("ravel", since=11)
def ravel(ctx: NodeContext) -> Tensor:
    return ctx.make("Reshape", [ctx.x(), ctx.const("flat", [-1], I64)])


@emits("outer", since=11)
def outer(ctx: NodeContext) -> Tensor:
    """outer(a, b) = a[:, None] * b[None, :]."""
    a, b = ctx.x(), ctx.tensor(ctx.arg(1, "vec2"))
    return ctx.make("Mul", [ctx.make("Unsqueeze", [a], tag="col", axes=[1]),
                            ctx.make("Unsqueeze", [b], tag="row", axes=[0])])


@emits("nonzero", since=11)
def nonzero(ctx: NodeContext) -> Tensor:
    """torch.nonzero / argwhere: (n, ndim) int64 indices = NonZero's (ndim, n), transposed."""
    if ctx.kw(out=None, as_tuple=False)["as_tuple"]:
        raise ctx.unsupported("as_tuple=True")
    x = ctx.x()
    if ctx.rank() == 0:
        raise ctx.unsupported("a 0-d input")
    return ctx.make("Transpose", [ctx.make("NonZero", [x], tag="nonzero", dtype=I64)], perm=[1, 0], dtype=I64)


@emits("unique", since=11)
def unique(ctx: NodeContext):
    """torch.unique(x, sorted=True, return_inverse, return_counts) of the flattened input: Unique-11
    (sorted); the inverse indices take the input's shape."""
    kw = ctx.kw(sorted=True, return_inverse=False, return_counts=False, dim=None)
    if kw["dim"] is not None or not kw["sorted"]:
        raise ctx.unsupported("dim= or sorted=False (torch's unsorted order is not ONNX's first-occurrence order)")
    x = ctx.x()
    y, first, inverse, counts = ctx.make("Unique", [x], outputs=4, sorted=1)
    ctx.b.dtypes[first], ctx.b.dtypes[inverse], ctx.b.dtypes[counts] = I64, I64, I64
    out = [y]
    if kw["return_inverse"]:
        out.append(ctx.make("Reshape", [inverse, ctx.make("Shape", [x], tag="shape", dtype=I64)], tag="inverse",
                            dtype=I64))
    if kw["return_counts"]:
        out.append(counts)
    return y if len(out) == 1 else tuple(out)
