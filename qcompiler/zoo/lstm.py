"""A token-sequence model: Embedding -> single-layer LSTM -> per-step Linear.

Covers integer inputs, a recurrent leaf module and nested tuple inputs and
outputs: ``forward(input, hidden)`` takes ``hidden = (h0, c0)`` and returns
``(logits, (h_n, c_n))``.  The LSTM result is indexed rather than unpacked so
``torch.fx.symbolic_trace`` produces plain ``getitem`` nodes.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from ._common import build, input_generator

__all__ = ["LSTMSeq", "lstm_seq", "example_inputs"]

LSTM_SEED = 12
INPUT_SEED = 1012
SEQ_LEN = 12
INPUT_SHAPE = (1, SEQ_LEN)

Hidden = Tuple[torch.Tensor, torch.Tensor]


class LSTMSeq(nn.Module):
    """``embedding`` -> ``lstm`` (batch_first) -> ``fc`` applied at every time step."""

    def __init__(self, vocab_size: int = 100, embed_dim: int = 32, hidden_size: int = 64,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden_size, batch_first=True)
        self.fc = nn.Linear(hidden_size, num_classes)

    def forward(self, input: torch.Tensor, hidden: Hidden) -> Tuple[torch.Tensor, Hidden]:
        x = self.embedding(input)
        result = self.lstm(x, hidden)
        out = result[0]
        state = result[1]
        logits = self.fc(out)
        return logits, (state[0], state[1])


def lstm_seq(vocab_size: int = 100, embed_dim: int = 32, hidden_size: int = 64,
             num_classes: int = 10) -> LSTMSeq:
    """LSTM sequence model in eval mode with deterministic weights."""
    return build(LSTM_SEED, lambda: LSTMSeq(vocab_size=vocab_size, embed_dim=embed_dim, hidden_size=hidden_size,
                                            num_classes=num_classes))


def example_inputs(batch: int = 1, seq_len: int = SEQ_LEN, vocab_size: int = 100,
                   hidden_size: int = 64, **_: object) -> tuple:
    """``(tokens, (h0, c0))``: int64 tokens ``(batch, seq_len)`` in ``[0, vocab_size)``, zero states ``(1, batch, hidden_size)``.

    Extra keyword arguments (model kwargs such as ``num_classes``) are ignored.
    """
    g = input_generator(INPUT_SEED)
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=g, dtype=torch.long)
    h0 = torch.zeros(1, batch, hidden_size)
    c0 = torch.zeros(1, batch, hidden_size)
    return (tokens, (h0, c0))
