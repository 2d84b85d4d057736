"""Indexing rules: ``x[...]`` with ints, slices, None, Ellipsis and index tensors (``getitem``), and
``x[...] = value`` (``setitem``); gather, index_select, masked_fill, scatter; topk, sort and argsort (TopK)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx as fx
from onnx import TensorProto

from qcompiler.backends.onnx.context import (
    INT64_MAX,
    NodeContext,
    Tensor,
    is_tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _norm_axis
from qcompiler.ir.meta import META_TENSOR, TensorInfo
from qcompiler.ir.ops import REQUIRED


@emits("getitem")
def getitem(ctx: NodeContext):
    obj = ctx.value(ctx.arg(0, None))
    idx = ctx.call.args[1]
    if isinstance(obj, (tuple, list)):
        return obj[ctx.value(idx)]
    if not is_tensor(obj):
        return obj[ctx.value(idx)]
    return _index_tensor(ctx, obj, idx)


@dataclass
class _IndexPlan:
    """``x[items]`` as ONNX does it: one Slice, then Squeeze, one Gather, Unsqueeze."""

    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    axes: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    squeeze: list = field(default_factory=list)  # input dims indexed by an int
    unsqueeze: list = field(default_factory=list)  # output dims added by None
    gather: Optional[tuple[int, Tensor]] = None  # (input dim, index tensor)

    def slice(self, dim: int, start: int, stop: int, step: int) -> None:
        self.starts.append(start)
        self.ends.append(stop)
        self.axes.append(dim)
        self.steps.append(step)


def _slice_bounds(ctx: NodeContext, it: slice) -> Optional[tuple[int, int, int]]:
    """``(start, stop, step)`` of a slice item, or None for the whole dim ``:``."""
    vals = [ctx.value(v) for v in (it.start, it.stop, it.step)]
    if any(v is not None and not isinstance(v, int) for v in vals):
        raise ctx.unsupported("slice bounds that are tensors")
    start, stop, step = vals
    step = 1 if step is None else step
    if step <= 0:
        raise ctx.unsupported("slices with a step <= 0")
    bounds = (0 if start is None else start, INT64_MAX if stop is None else stop, step)
    return None if bounds == (0, INT64_MAX, 1) else bounds


def _plan_index(ctx: NodeContext, items: list, rank: int) -> _IndexPlan:
    plan = _IndexPlan()
    specified = sum(1 for it in items if it is not None and it is not Ellipsis)
    d = out_dim = 0  # the input dim the next item indexes, the output dim it becomes
    for it in items:
        if it is Ellipsis:
            d += rank - specified
            out_dim += rank - specified
        elif it is None:
            plan.unsqueeze.append(out_dim)
            out_dim += 1
        elif isinstance(it, bool):
            raise ctx.unsupported("boolean indexing")
        elif isinstance(it, int):
            plan.slice(d, it, it + 1 if it != -1 else INT64_MAX, 1)
            plan.squeeze.append(d)
            d += 1
        elif isinstance(it, slice):
            bounds = _slice_bounds(ctx, it)
            if bounds is not None:
                plan.slice(d, *bounds)
            d, out_dim = d + 1, out_dim + 1
        elif isinstance(it, fx.Node) and _is_bool(it):  # a Gather would read its True / False as 1 / 0
            raise ctx.unsupported("a boolean mask index (the result's size depends on the mask's values)")
        elif isinstance(it, fx.Node) and plan.gather is None:
            plan.gather = (d, ctx.tensor(it, I64))
            d, out_dim = d + 1, out_dim + 1
        else:
            raise ctx.unsupported(f"index {it!r}")
    return plan


def _apply_index(ctx: NodeContext, x: str, plan: _IndexPlan, tag: Optional[str] = None) -> Tensor:
    """The plan's nodes; the last one is the FX node's main (untagged) node, or with ``tag`` every one is
    tagged ``<tag>_<step>`` (the index is part of a larger rule)."""
    def named(step: str, last: bool) -> Optional[str]:
        return f"{tag}_{step}" if tag is not None else (None if last else step)

    y = x
    last = not plan.squeeze and not plan.unsqueeze and plan.gather is None
    if plan.starts:
        y = ctx.make("Slice", [y, ctx.const(named("starts", False), plan.starts, I64),
                               ctx.const(named("ends", False), plan.ends, I64),
                               ctx.const(named("axes", False), plan.axes, I64),
                               ctx.const(named("steps", False), plan.steps, I64)],
                     tag=named("slice", last))
    if plan.squeeze:
        last = not plan.unsqueeze and plan.gather is None
        y = ctx.make("Squeeze", [y], tag=named("squeeze", last), axes=plan.squeeze)
    if plan.gather is not None:
        axis, index = plan.gather
        axis -= sum(1 for s in plan.squeeze if s < axis)
        y = ctx.make("Gather", [y, index], tag=named("gather", not plan.unsqueeze), axis=axis)
    if plan.unsqueeze:
        y = ctx.make("Unsqueeze", [y], tag=named("unsqueeze", True), axes=plan.unsqueeze)
    if y == x:
        return ctx.make("Identity", [x], tag=named("identity", True))
    return y


def _index_tensor(ctx: NodeContext, x: str, idx: Any) -> Tensor:
    if x in ctx.emitter.scalars:
        raise ctx.unsupported("indexing a 0-d tensor")
    items = list(idx) if isinstance(idx, tuple) else [idx]
    shape = ctx.shape(ctx.arg(0, None))
    if shape is None:
        if ctx.dtype(x) == I64 and len(items) == 1 and isinstance(items[0], int):  # a size() shape vector
            out = ctx.make("Gather", [x, ctx.const("index", items[0], I64)], axis=0, dtype=I64)
            ctx.emitter.scalars.add(out)
            return out
        raise ctx.unsupported("indexing a tensor of unknown shape")
    return _apply_index(ctx, x, _plan_index(ctx, items, len(shape)))


@emits("setitem", since=11)
def setitem(ctx: NodeContext) -> Tensor:
    """``x[index] = value`` as a new tensor (:func:`qcompiler.ir.setitem.setitem`), ``value`` in x's dtype.

    A boolean mask of x's shape with a number or a one-element value: Where.  ``...`` alone: the value
    expanded to x's shape.  Any other index getitem
    takes (ints, slices, None, Ellipsis, one index tensor): the flat positions of the elements it picks
    (a Range over x's size, shaped as x, indexed as getitem indexes x), the value expanded to their
    shape, both flattened, and ScatterElements into x flattened.  No position repeats except through a
    repeating index tensor, where torch keeps an unspecified one of the values too."""
    x = ctx.x()
    shape = ctx.shape(ctx.arg(0, None))
    if shape is None:
        raise ctx.unsupported("assigning into a tensor of unknown shape")
    index, value = ctx.call.args[1], ctx.call.args[2]
    dtype = ctx.dtype(x)
    items = list(index) if isinstance(index, tuple) else [index]
    if len(items) == 1 and isinstance(items[0], fx.Node) and _is_bool(items[0]):
        if ctx.shape(items[0]) != tuple(shape):
            raise ctx.unsupported("a boolean mask of another shape than the tensor assigned into")
        if isinstance(value, fx.Node) and (ctx.shape(value) is None or math.prod(ctx.shape(value)) != 1):
            raise ctx.unsupported("a masked assignment of a value with more than one element (one per "
                                  "True of the mask)")
        mask = ctx.tensor(items[0], TensorProto.BOOL)
        v = ctx.tensor(value, dtype)
        if isinstance(value, fx.Node) and ctx.shape(value) != ():
            v = ctx.make("Reshape", [v, ctx.const("scalar_shape", [], I64)], tag="value_0d")
        return ctx.make("Where", [mask, v, x], dtype=dtype)
    if items == [Ellipsis]:  # the whole tensor (a write back through a reshaped view)
        if isinstance(value, fx.Node) and (ctx.shape(value) is None or len(ctx.shape(value)) > len(shape)):
            raise ctx.unsupported("a value of unknown shape or of more dims than the tensor")
        return ctx.make("Expand", [ctx.tensor(value, dtype), ctx.make("Shape", [x], tag="shape", dtype=I64)])
    plan = _plan_index(ctx, items, len(shape))
    picked_rank = len(shape) - len(plan.squeeze) + len(plan.unsqueeze)
    if isinstance(value, fx.Node) and (ctx.shape(value) is None or len(ctx.shape(value)) > picked_rank):
        raise ctx.unsupported("a value of unknown shape or of more dims than the elements it is assigned to")
    x_shape = ctx.make("Shape", [x], tag="shape", dtype=I64)  # at run time: the batch may differ
    count = ctx.make("Size", [x], tag="count", dtype=I64)
    positions = ctx.make("Range", [ctx.const("zero", 0, I64), count, ctx.const("one", 1, I64)],
                         tag="positions", dtype=I64)
    positions = ctx.make("Reshape", [positions, x_shape], tag="positions_shaped")
    picked = _apply_index(ctx, positions, plan, tag="picked")
    updates = ctx.make("Expand", [ctx.tensor(value, dtype), ctx.make("Shape", [picked], tag="picked_shape",
                                                                    dtype=I64)], tag="updates")
    flat = ctx.const("flat", [-1], I64)
    out = ctx.make("ScatterElements", [ctx.make("Reshape", [x, flat], tag="x_flat"),
                                       ctx.make("Reshape", [picked, flat], tag="picked_flat"),
                                       ctx.make("Reshape", [updates, flat], tag="updates_flat")],
                   tag="scatter", axis=0)
    return ctx.make("Reshape", [out, x_shape])


def _is_bool(node: fx.Node) -> bool:
    info = node.meta.get(META_TENSOR)
    return isinstance(info, TensorInfo) and info.dtype == "bool"


# ---------------------------------------------------------------------------
# gather, index_select, masked_fill, scatter, topk, sort, argsort


def _index_input(ctx: NodeContext, a: Any) -> Tensor:
    if not isinstance(a, fx.Node):
        raise ctx.unsupported(f"index {a!r} (an index tensor is emitted)")
    return ctx.tensor(a, I64)


def _int_arg(ctx: NodeContext, kw: dict, name: str) -> int:
    v = kw[name]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ctx.unsupported(f"{name}={v!r} (a python int is emitted)")
    return v


def _rank_1(ctx: NodeContext, what: str) -> int:
    rank = ctx.rank()
    if rank == 0:
        raise ctx.unsupported(f"{what} of a 0-d tensor (Gather needs at least 1-D data)")
    return rank


@emits("gather", since=11)
def gather(ctx: NodeContext) -> Tensor:
    """``torch.gather(x, dim, index)``: GatherElements."""
    kw = ctx.kw(dim=REQUIRED, index=REQUIRED, sparse_grad=False)
    x = ctx.x()
    axis = _norm_axis(_int_arg(ctx, kw, "dim"), _rank_1(ctx, "gather"))
    if ctx.shape(kw["index"]) is None or len(ctx.shape(kw["index"])) != len(ctx.shape()):
        raise ctx.unsupported("an index of another rank than the input (torch allows it for an empty index; "
                              "GatherElements does not)")
    return ctx.make("GatherElements", [x, _index_input(ctx, kw["index"])], axis=axis)


@emits("index_select", since=11)
def index_select(ctx: NodeContext) -> Tensor:
    """Gather along ``dim``; a 0-d index keeps the dim (size 1), as torch."""
    kw = ctx.kw(dim=REQUIRED, index=REQUIRED)
    x = ctx.x()
    axis = _norm_axis(_int_arg(ctx, kw, "dim"), _rank_1(ctx, "index_select"))
    index = _index_input(ctx, kw["index"])
    if ctx.shape(kw["index"]) == ():
        index = ctx.make("Unsqueeze", [index], tag="index_1d", axes=[0])
    return ctx.make("Gather", [x, index], axis=axis)


@emits("masked_fill", since=11)
def masked_fill(ctx: NodeContext) -> Tensor:
    """``Where(mask, value, x)``; the value (a number or a 0-d tensor) in the input's dtype."""
    kw = ctx.kw(mask=REQUIRED, value=REQUIRED)
    x = ctx.x()
    if not isinstance(kw["mask"], fx.Node):
        raise ctx.unsupported("a mask that is not a tensor")
    mask = ctx.tensor(kw["mask"], TensorProto.BOOL)
    value = kw["value"]
    if isinstance(value, fx.Node) and ctx.shape(value) not in ((), None):
        raise ctx.unsupported("a value tensor that is not 0-d (torch takes a number or a 0-d tensor)")
    v = ctx.tensor(value, ctx.dtype(x))
    return ctx.make("Where", [mask, v, x], dtype=ctx.dtype(x))


@emits("scatter", since=11)
def scatter(ctx: NodeContext) -> Tensor:
    """``x.scatter(dim, index, src)`` / ``(dim, index, value)``: ScatterElements (no reduction in
    opset 11); a source larger than the index is cut to the index's shape, as torch reads it."""
    kw = ctx.kw(dim=REQUIRED, index=REQUIRED, src=None, value=None, reduce=None)
    if kw["reduce"] is not None:
        raise ctx.unsupported(f"reduce={kw['reduce']!r} (ScatterElements-11 has no reduction)")
    x = ctx.x()
    axis = _norm_axis(_int_arg(ctx, kw, "dim"), ctx.rank())
    index = _index_input(ctx, kw["index"])
    src = kw["src"] if kw["src"] is not None else kw["value"]
    if src is None:
        raise ctx.unsupported("scatter without src or value")
    ishape = ctx.shape(kw["index"])
    if isinstance(src, fx.Node):
        updates = ctx.tensor(src, ctx.dtype(x))
        sshape = ctx.shape(src)
        if ishape is None or sshape is None:
            raise ctx.unsupported("scatter of tensors of unknown shape")
        if tuple(sshape) != tuple(ishape):
            n = len(ishape)
            updates = ctx.make("Slice", [updates, ctx.const("src_starts", [0] * n, I64),
                                         ctx.const("src_ends", list(ishape), I64),
                                         ctx.const("src_axes", list(range(n)), I64)], tag="src")
    else:
        filled = ctx.tensor(src, ctx.dtype(x))
        updates = ctx.make("Expand", [filled, ctx.make("Shape", [index], tag="index_shape", dtype=I64)],
                           tag="src")
    return ctx.make("ScatterElements", [x, index, updates], axis=axis)


def _topk(ctx: NodeContext, x: str, k: Any, axis: int, largest: bool, tag=None) -> list[Tensor]:
    """TopK; ``k`` a python int or a 1-D int64 tensor of one element."""
    kt = ctx.const("k", [k], I64) if isinstance(k, int) else k
    return ctx.make("TopK", [x, kt], tag=tag, outputs=2, axis=axis, largest=int(largest), sorted=1)


def _typed_indices(ctx: NodeContext, pair: list[Tensor]) -> tuple[Tensor, Tensor]:
    values, indices = pair
    ctx.b.dtypes[indices] = I64
    return values, indices


@emits("topk", since=11)
def topk(ctx: NodeContext):
    """TopK -> (values, int64 indices). ``sorted=False`` gets the sorted result (torch leaves
    that order unspecified: any order is a correct answer, the sorted one is deterministic)."""
    kw = ctx.kw(k=REQUIRED, dim=-1, largest=True, sorted=True)
    x = ctx.x()
    rank = ctx.rank()
    if rank == 0:
        raise ctx.unsupported("topk of a 0-d tensor")
    k = _int_arg(ctx, kw, "k")
    return _typed_indices(ctx, _topk(ctx, x, k, _norm_axis(_int_arg(ctx, kw, "dim"), rank), bool(kw["largest"])))


def _sort_args(ctx: NodeContext) -> tuple[str, int, Tensor, bool]:
    """(input, axis, k = the size of that axis read at run time, descending)."""
    # torch.sort(input, dim=-1, descending=False, *, stable=False) / torch.sort(input, *, stable, dim, descending)
    kw = ctx.kw(dim=-1, descending=False, stable=False)
    x = ctx.x()
    rank = ctx.rank()
    if rank == 0:
        raise ctx.unsupported("sort of a 0-d tensor")
    axis = _norm_axis(_int_arg(ctx, kw, "dim"), rank)
    k = ctx.make("Gather", [ctx.make("Shape", [x], tag="shape", dtype=I64), ctx.const("axis", [axis], I64)],
                 tag="k", dtype=I64, axis=0)
    return x, axis, k, bool(kw["descending"])


@emits("sort", since=11)
def sort(ctx: NodeContext):
    """TopK over the whole dim; equal values keep their order (TopK-11 puts the lower index
    first), which is torch's ``stable=True`` and one of the orders ``stable=False`` allows."""
    x, axis, n, descending = _sort_args(ctx)
    return _typed_indices(ctx, _topk(ctx, x, n, axis, descending))


@emits("argsort", since=11)
def argsort(ctx: NodeContext) -> Tensor:
    x, axis, n, descending = _sort_args(ctx)
    _, indices = _typed_indices(ctx, _topk(ctx, x, n, axis, descending, tag="topk"))
    return ctx.identity(indices)
