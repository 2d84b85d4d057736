"""Embedding rules: ``nn.Embedding`` / ``F.embedding`` as Gather."""

from __future__ import annotations

from qcompiler.backends.onnx.context import (
    REQUIRED,
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits


@emits("embedding")
def embedding(ctx: NodeContext) -> Tensor:
    idx = ctx.x()
    kw = ctx.kw(weight=REQUIRED, padding_idx=None, max_norm=None)
    if kw["max_norm"] is not None:
        raise ctx.unsupported("Embedding with max_norm (renormalizes the weight in forward)")
    w = ctx.tensor(kw["weight"])
    return ctx.make("Gather", [w, idx], axis=0, dtype=ctx.dtype(w))
