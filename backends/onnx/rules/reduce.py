"""Reduction rules: mean over dims."""

from __future__ import annotations

from qcompiler.backends.onnx.context import (
    NodeContext,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import _norm_axis


@emits("mean")
def mean(ctx: NodeContext):
    x = ctx.x()
    rank = ctx.rank()
    kw = ctx.kw(dim=None, keepdim=False, dtype=None)
    dim, keepdim = kw["dim"], bool(kw["keepdim"])
    axes = list(range(rank)) if dim is None else [_norm_axis(int(d), rank) for d in (
        dim if isinstance(dim, (list, tuple)) else [dim])]
    if rank == 4 and sorted(axes) == [2, 3]:  # mean over H, W: a global average pool
        if keepdim:
            return ctx.make("GlobalAveragePool", [x])
        g = ctx.make("GlobalAveragePool", [x], tag="global_avg_pool")
        return ctx.make("Squeeze", [g], axes=[2, 3])
    return ctx.make("ReduceMean", [x], axes=axes, keepdims=int(keepdim))
