"""One pre-norm transformer encoder block, spelled out op by op.

``nn.TransformerEncoderLayer`` hides attention inside a fused kernel; this block
writes LayerNorm, the q/k/v projections, the head split (reshape + transpose),
``torch.matmul`` scores scaled by a Python float, ``torch.softmax``, the
context matmul, head merge, output projection, residual adds and the GELU FFN
as separate graph nodes so each one can be observed and quantized.

All sizes are constructor constants (no ``x.shape`` reads), so the module is
``torch.fx.symbolic_trace``-able; the batch dimension is left to ``-1``.
The sequence length is therefore fixed at construction (``seq_len``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qcompiler.errors import ConfigError

from ._common import build, normal_inputs

__all__ = ["TransformerBlock", "transformer_block", "example_inputs"]

TRANSFORMER_SEED = 7
INPUT_SEED = 1007
INPUT_SHAPE = (1, 16, 64)


class TransformerBlock(nn.Module):
    """x + Attn(LN1(x)), then + FFN(LN2(.)); input/output ``(batch, seq_len, d_model)``."""

    def __init__(self, d_model: int = 64, num_heads: int = 4, ffn_dim: int = 128,
                 seq_len: int = 16) -> None:
        super().__init__()
        if d_model % num_heads != 0:
            raise ConfigError(
                f"transformer_block: d_model={d_model} must be divisible by num_heads={num_heads}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.seq_len = seq_len
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.ln1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        # (B, S, D) -> (B, S, H, Dh) -> (B, H, S, Dh)
        return t.reshape(-1, self.seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q = self._split_heads(self.q_proj(h))
        k = self._split_heads(self.k_proj(h))
        v = self._split_heads(self.v_proj(h))
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(attn, v)
        # (B, H, S, Dh) -> (B, S, H, Dh) -> (B, S, D)
        ctx = ctx.transpose(1, 2).reshape(-1, self.seq_len, self.d_model)
        x = x + self.out_proj(ctx)
        h = self.ln2(x)
        h = self.fc2(nn.functional.gelu(self.fc1(h)))
        return x + h


def transformer_block(d_model: int = 64, num_heads: int = 4, ffn_dim: int = 128,
                      seq_len: int = 16) -> TransformerBlock:
    """Transformer encoder block in eval mode with deterministic weights."""
    return build(TRANSFORMER_SEED, lambda: TransformerBlock(d_model=d_model, num_heads=num_heads, ffn_dim=ffn_dim,
                                                            seq_len=seq_len), _perturb_layernorms)


@torch.no_grad()
def _perturb_layernorms(model: TransformerBlock) -> None:
    """Non-trivial LayerNorm affine so LN handling is actually tested."""
    for ln in (model.ln1, model.ln2):
        ln.weight.copy_(1.0 + 0.1 * torch.randn(ln.weight.shape))
        ln.bias.copy_(0.1 * torch.randn(ln.bias.shape))


def example_inputs(batch: int = 1, seq_len: int = 16, d_model: int = 64, **_: object) -> tuple:
    """One float tensor ``(batch, seq_len, d_model)`` (standard normal).

    Extra keyword arguments (model kwargs such as ``num_heads``) are ignored.
    """
    return normal_inputs(INPUT_SEED, batch, seq_len, d_model)
