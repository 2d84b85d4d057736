"""Indexing rules: ``x[...]`` with ints, slices, None, Ellipsis and index tensors (``getitem``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx as fx

from qcompiler.backends.onnx.context import (
    INT64_MAX,
    NodeContext,
    Tensor,
    is_tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64


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
        elif isinstance(it, fx.Node) and plan.gather is None:
            plan.gather = (d, ctx.tensor(it, I64))
            d, out_dim = d + 1, out_dim + 1
        else:
            raise ctx.unsupported(f"index {it!r}")
    return plan


def _apply_index(ctx: NodeContext, x: str, plan: _IndexPlan) -> Tensor:
    """The plan's nodes; the last one is the FX node's main (untagged) node."""
    y = x
    last = not plan.squeeze and not plan.unsqueeze and plan.gather is None
    if plan.starts:
        y = ctx.make("Slice", [y, ctx.const("starts", plan.starts, I64), ctx.const("ends", plan.ends, I64),
                               ctx.const("axes", plan.axes, I64), ctx.const("steps", plan.steps, I64)],
                     tag=None if last else "slice")
    if plan.squeeze:
        last = not plan.unsqueeze and plan.gather is None
        y = ctx.make("Squeeze", [y], tag=None if last else "squeeze", axes=plan.squeeze)
    if plan.gather is not None:
        axis, index = plan.gather
        axis -= sum(1 for s in plan.squeeze if s < axis)
        y = ctx.make("Gather", [y, index], tag=None if not plan.unsqueeze else "gather", axis=axis)
    if plan.unsqueeze:
        y = ctx.make("Unsqueeze", [y], axes=plan.unsqueeze)
    return ctx.identity(x) if y == x else y


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
