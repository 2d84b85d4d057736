"""Helpers the rule families share: argument coercion, axes, dtypes, circular padding."""

from __future__ import annotations

from typing import Any, Sequence

from onnx import TensorProto

from qcompiler.backends.onnx.context import (
    TORCH_TO_ONNX,
    NodeContext,
    Tensor,
    is_tensor,
)

F32 = TensorProto.FLOAT


I64 = TensorProto.INT64


def _ntuple(v: Any, n: int) -> list[int]:
    if isinstance(v, (list, tuple)):
        if len(v) == 1 and n > 1:
            return [int(v[0])] * n
        return [int(e) for e in v]
    return [int(v)] * n


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _onnx_dtype(ctx: NodeContext, dtype: Any) -> int:
    if dtype in TORCH_TO_ONNX:
        return TORCH_TO_ONNX[dtype]
    raise ctx.unsupported(f"dtype {dtype!r}")


def _as_tensor(ctx: NodeContext, v: Any, dt: int, tag: str) -> Tensor:
    if is_tensor(v):
        if ctx.dtype(v) != dt:
            return ctx.make("Cast", [v], tag=f"cast_{tag}", to=dt, dtype=dt)
        return v
    if isinstance(v, (bool, int, float)):
        return ctx.const(f"const_{tag}", v, dt)
    raise ctx.unsupported(f"operand of type {type(v).__name__}")


def _arg_or_none(ctx: NodeContext, i: int) -> Any:
    return ctx.call.args[i] if i < len(ctx.call.args) else None


def _circular_pad(ctx: NodeContext, x: str, begins: Sequence[int], ends: Sequence[int]) -> Tensor:
    """Wrap-around padding (Pad-11 has no circular mode): per axis, the last ``begins[d]`` and the
    first ``ends[d]`` elements concatenated around the input."""
    for d, (before, after) in enumerate(zip(begins, ends)):
        if not before and not after:
            continue
        axis = ctx.const(f"circ_axis{d}", [d], I64)
        parts = []
        if before:
            parts.append(ctx.make("Slice", [x, ctx.const(f"circ_b{d}", [-before], I64),
                                            ctx.const(f"circ_end{d}", [2**62], I64), axis], tag=f"circ_before{d}"))
        parts.append(x)
        if after:
            parts.append(ctx.make("Slice", [x, ctx.const(f"circ_zero{d}", [0], I64),
                                            ctx.const(f"circ_a{d}", [after], I64), axis], tag=f"circ_after{d}"))
        x = ctx.make("Concat", parts, tag=f"circ_pad{d}", axis=d)
    return x
