"""Embedding rules: ``nn.Embedding`` / ``F.embedding`` as Gather; ``nn.EmbeddingBag`` /
``F.embedding_bag`` composed from Gather, Where and a reduction (opset 11 has no bag op).

A bag reduction is a masked reduction over a ``[bags, tokens, dim]`` view:

* 2-D indices ``[bags, n]`` (no offsets): the gathered rows are already that view; the mask
  is ``[bags, n, 1]``.
* 1-D indices with ``offsets``: the gathered rows ``[1, tokens, dim]`` broadcast against a
  membership mask ``[bags, tokens, 1]``, ``mask[b, t] = start[b] <= t < end[b]``.

Tokens at ``padding_idx`` leave the mask. ``sum`` is ReduceSum over the masked rows (times
``per_sample_weights``), ``mean`` divides by ``max(count, 1)``, ``max`` is ReduceMax over the
rows with ``-inf`` outside the bag; an empty bag gives zeros in every mode, as torch does.
"""

from __future__ import annotations

from typing import Optional

from onnx import TensorProto

from qcompiler.backends.onnx.context import (
    INT64_MAX,
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import F32, I64
from qcompiler.ir.ops import REQUIRED

BAG_MODES = ("sum", "mean", "max")
BOOL = TensorProto.BOOL


@emits("embedding")
def embedding(ctx: NodeContext) -> Tensor:
    idx = ctx.x()
    kw = ctx.kw(weight=REQUIRED, padding_idx=None, max_norm=None)
    if kw["max_norm"] is not None:
        raise ctx.unsupported("Embedding with max_norm (renormalizes the weight in forward)")
    w = ctx.tensor(kw["weight"])
    return ctx.make("Gather", [w, idx], axis=0, dtype=ctx.dtype(w))


def _bag_args(ctx: NodeContext) -> dict:
    """F.embedding_bag's arguments by name; a module call gives offsets and per_sample_weights
    positionally (its forward is ``(input, offsets, per_sample_weights)``)."""
    kw = ctx.kw(weight=REQUIRED, offsets=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, mode="mean",
                sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None)
    if ctx.module is not None:
        kw.update(offsets=ctx.arg(1, "offsets", None), per_sample_weights=ctx.arg(2, "per_sample_weights", None))
    if kw["max_norm"] is not None:
        raise ctx.unsupported("EmbeddingBag with max_norm (renormalizes the weight in forward)")
    if kw["mode"] not in BAG_MODES:
        raise ctx.unsupported(f"EmbeddingBag mode {kw['mode']!r} (torch knows {', '.join(BAG_MODES)})")
    if kw["per_sample_weights"] is not None and kw["mode"] != "sum":
        raise ctx.unsupported(f"per_sample_weights with mode {kw['mode']!r} (torch allows them only with 'sum')")
    return kw


def _membership(ctx: NodeContext, idx: str, offsets: str, include_last: bool) -> str:
    """``[bags, tokens, 1]`` bool: token t is in bag b when ``start[b] <= t < end[b]``."""
    ax0 = ctx.const("axis0", [0], I64)
    if include_last:  # offsets has bags + 1 entries: the last one ends the last bag
        starts = ctx.make("Slice", [offsets, ctx.const("zero", [0], I64), ctx.const("minus1", [-1], I64), ax0],
                          tag="bag_starts")
    else:  # the last bag ends at the last token
        starts = offsets
    tokens = ctx.make("Shape", [idx], tag="tokens", dtype=I64)
    rest = ctx.make("Slice", [offsets, ctx.const("one", [1], I64), ctx.const("end", [INT64_MAX], I64), ax0],
                    tag="bag_next")
    ends = rest if include_last else ctx.make("Concat", [rest, tokens], tag="bag_ends", axis=0)
    pos = ctx.make("Range", [ctx.const("pos0", 0, I64), ctx.make("Squeeze", [tokens], tag="n_tokens", axes=[0]),
                             ctx.const("pos_step", 1, I64)], tag="positions", dtype=I64)
    col = ctx.const("to_column", [-1, 1], I64)
    before = ctx.make("Less", [pos, ctx.make("Reshape", [starts, col], tag="starts_col")], tag="before", dtype=BOOL)
    inside = ctx.make("Less", [pos, ctx.make("Reshape", [ends, col], tag="ends_col")], tag="not_after", dtype=BOOL)
    member = ctx.make("And", [ctx.make("Not", [before], tag="from_start", dtype=BOOL), inside], tag="member",
                      dtype=BOOL)
    return ctx.make("Unsqueeze", [member], tag="member3", axes=[2], dtype=BOOL)


def _without_padding(ctx: NodeContext, mask: Optional[str], idx: str, kw: dict, mask_shape: list[int]
                     ) -> Optional[str]:
    """``mask`` (or everything) and-ed with ``idx != padding_idx``, reshaped to ``mask_shape``."""
    pad = kw["padding_idx"]
    if pad is None:
        return mask
    if pad < 0:  # torch counts a negative padding_idx from the end of the table
        rows = ctx.shape(kw["weight"])
        if rows is None:
            raise ctx.unsupported("a negative padding_idx needs the weight's shape (run shape propagation first)")
        pad += rows[0]
    keep = ctx.make("Not", [ctx.make("Equal", [idx, ctx.const("padding_idx", pad, I64)], tag="is_pad",
                                     dtype=BOOL)], tag="not_pad", dtype=BOOL)
    keep = ctx.make("Reshape", [keep, ctx.const("pad_shape", mask_shape, I64)], tag="keep", dtype=BOOL)
    return keep if mask is None else ctx.make("And", [mask, keep], tag="member_kept", dtype=BOOL)


def _reduce(ctx: NodeContext, mode: str, rows: str, mask: Optional[str]) -> str:
    """Reduce ``rows`` ``[bags | 1, tokens, dim]`` over the tokens in ``mask`` ``[bags, tokens, 1]``."""
    if mask is None:
        return ctx.make({"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax"}[mode], [rows], tag="bag_" + mode,
                        axes=[1], keepdims=0)
    count = ctx.make("ReduceSum", [ctx.make("Cast", [mask], tag="member_f", to=F32, dtype=F32)], tag="count",
                     axes=[1], keepdims=0)
    if mode == "max":
        low = ctx.make("Where", [mask, rows, ctx.const("minus_inf", float("-inf"), F32)], tag="masked")
        top = ctx.make("ReduceMax", [low], tag="bag_max", axes=[1], keepdims=0)
        empty = ctx.make("Equal", [count, ctx.const("zero_f", 0.0, F32)], tag="empty", dtype=BOOL)
        return ctx.make("Where", [empty, ctx.const("zero_row", 0.0, F32), top], tag="bag")
    total = ctx.make("ReduceSum", [ctx.make("Where", [mask, rows, ctx.const("zero_f", 0.0, F32)], tag="masked")],
                     tag="bag_sum", axes=[1], keepdims=0)
    if mode == "sum":
        return total
    return ctx.make("Div", [total, ctx.make("Max", [count, ctx.const("one_f", 1.0, F32)], tag="count1")], tag="bag")


@emits("embedding_bag")
def embedding_bag(ctx: NodeContext) -> Tensor:
    kw = _bag_args(ctx)
    rank, w = ctx.rank(), ctx.tensor(kw["weight"])
    if (rank == 1) != (kw["offsets"] is not None) or rank not in (1, 2):
        raise ctx.unsupported(f"EmbeddingBag takes 1-D indices with offsets or 2-D indices without; got "
                              f"{rank}-D indices {'with' if kw['offsets'] is not None else 'without'} offsets")
    idx = ctx.x(I64)
    rows = ctx.make("Gather", [w, idx], tag="rows", axis=0, dtype=ctx.dtype(w))  # [tokens, dim] | [bags, n, dim]
    if kw["per_sample_weights"] is not None:
        psw = ctx.make("Unsqueeze", [ctx.tensor(kw["per_sample_weights"])], tag="psw", axes=[rank])
        rows = ctx.make("Mul", [rows, psw], tag="weighted")
    mask = None
    if rank == 1:
        rows = ctx.make("Unsqueeze", [rows], tag="rows3", axes=[0])
        mask = _membership(ctx, idx, ctx.tensor(kw["offsets"], I64), kw["include_last_offset"])
    mask = _without_padding(ctx, mask, idx, kw, [1, -1, 1] if rank == 1 else [0, -1, 1])
    return _reduce(ctx, kw["mode"], rows, mask)
