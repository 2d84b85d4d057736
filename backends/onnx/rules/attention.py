"""nn.MultiheadAttention as MatMul / Softmax (opset 11 has no attention op).

Per head h: ``softmax(q_h k_h^T / sqrt(d) + mask) v_h`` with ``q = query W_q^T + b_q`` (likewise k, v),
the heads concatenated and projected by ``out_proj``. Sequence-first ``(L, N, E)`` or ``batch_first``
``(N, L, E)`` inputs; the averaged (or per-head) attention weights as the second output when
``need_weights``. Reshapes use 0 (copy the dim) and the head sizes only, so a CPU island keeps a dynamic
batch and sequence length. Refused (the island runs in torch): unbatched inputs, ``key_padding_mask``,
a boolean or 3-D ``attn_mask``, ``bias_k`` / ``bias_v``, ``add_zero_attn`` and ``is_causal``."""

from __future__ import annotations

import math

import numpy as np
import torch.nn as nn

from qcompiler.backends.onnx.context import NodeContext, Tensor
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64
from qcompiler.ir.meta import META_TENSOR


def _projection(ctx: NodeContext, m: nn.MultiheadAttention, x: Tensor, i: int, tag: str) -> Tensor:
    """x W_i^T + b_i, W_i the i-th third of in_proj_weight (or q/k/v_proj_weight)."""
    e = m.embed_dim
    if m._qkv_same_embed_dim:
        w = ctx.param(m, "in_proj_weight", ctx.path, transform=lambda a: np.ascontiguousarray(a[i * e:(i + 1) * e].T))
    else:
        attr = ("q_proj_weight", "k_proj_weight", "v_proj_weight")[i]
        w = ctx.param(m, attr, ctx.path, transform=lambda a: np.ascontiguousarray(a.T))
    y = ctx.make("MatMul", [x, w], tag=f"{tag}_matmul")
    if m.in_proj_bias is None:
        return y
    b = ctx.param(m, "in_proj_bias", ctx.path, transform=lambda a: a[i * e:(i + 1) * e])
    return ctx.make("Add", [y, b], tag=f"{tag}_bias")


def _heads(ctx: NodeContext, t: Tensor, heads: int, hd: int, batch_first: bool, tag: str) -> Tensor:
    """(L, N, E) / (N, L, E) -> (N, H, L, d)."""
    split = ctx.make("Reshape", [t, ctx.const(f"{tag}_split", [0, 0, heads, hd], I64)], tag=f"{tag}_split")
    return ctx.make("Transpose", [split], tag=f"{tag}_heads", perm=[0, 2, 1, 3] if batch_first else [1, 2, 0, 3])


def _refusal(ctx: NodeContext, m: nn.MultiheadAttention, kw: dict) -> str:
    if ctx.rank() != 3:
        return "an unbatched (2-D) input"
    if kw["key_padding_mask"] is not None:
        return "key_padding_mask"
    if kw["is_causal"]:
        return "is_causal=True"
    if m.bias_k is not None or m.bias_v is not None or m.add_zero_attn:
        return "bias_k / bias_v / add_zero_attn"
    mask = kw["attn_mask"]
    if mask is not None:
        shape = ctx.shape(mask)
        info = mask.meta.get(META_TENSOR) if hasattr(mask, "meta") else None
        if shape is None or len(shape) != 2 or getattr(info, "dtype", "f32") != "f32":
            return "an attn_mask that is not a 2-D float mask"
    return ""


@emits("multihead_attention", since=11)
def multihead_attention(ctx: NodeContext):
    m = ctx.module
    if not isinstance(m, nn.MultiheadAttention):
        raise ctx.unsupported("a functional multi-head attention (use nn.MultiheadAttention)")
    call = ctx.call
    names = ("key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal")
    defaults = (None, None, None, True, None, True, False)
    kw = {n: call.kwargs.get(n, call.args[i + 1] if i + 1 < len(call.args) else d)
          for i, (n, d) in enumerate(zip(names, defaults))}
    why = _refusal(ctx, m, kw)
    if why:
        raise ctx.unsupported(f"MultiheadAttention with {why}")
    heads, e = m.num_heads, m.embed_dim
    hd = e // heads
    bf = m.batch_first
    q = _heads(ctx, _projection(ctx, m, ctx.x(), 0, "q"), heads, hd, bf, "q")
    k = _heads(ctx, _projection(ctx, m, ctx.tensor(kw["key"]), 1, "k"), heads, hd, bf, "k")
    v = _heads(ctx, _projection(ctx, m, ctx.tensor(kw["value"]), 2, "v"), heads, hd, bf, "v")
    q = ctx.make("Mul", [q, ctx.const("scale", 1.0 / math.sqrt(hd))], tag="q_scaled")
    scores = ctx.make("MatMul", [q, ctx.make("Transpose", [k], tag="k_t", perm=[0, 1, 3, 2])], tag="scores")
    if kw["attn_mask"] is not None:
        scores = ctx.make("Add", [scores, ctx.tensor(kw["attn_mask"])], tag="masked")
    attn = ctx.make("Softmax", [scores], tag="softmax", axis=3)
    ctxv = ctx.make("MatMul", [attn, v], tag="context")  # (N, H, L, d)
    merged = ctx.make("Transpose", [ctxv], tag="merge", perm=[0, 2, 1, 3] if bf else [2, 0, 1, 3])
    merged = ctx.make("Reshape", [merged, ctx.const("merged_shape", [0, 0, e], I64)], tag="merged")
    out = ctx.make("MatMul", [merged, ctx.param(m.out_proj, "weight", f"{ctx.path}.out_proj",
                                                transform=lambda a: np.ascontiguousarray(a.T))], tag="out_matmul")
    if m.out_proj.bias is not None:
        out = ctx.make("Add", [out, ctx.param(m.out_proj, "bias", f"{ctx.path}.out_proj")], tag="out")
    if not kw["need_weights"]:
        return out, None
    weights = ctx.make("ReduceMean", [attn], tag="weights", axes=[1], keepdims=0) if kw["average_attn_weights"] \
        else ctx.make("Identity", [attn], tag="weights")
    return out, weights
