"""QuantStub / DeQuantStub: mark where float data enters and leaves the BPU.

They behave as identities in float mode; convert turns them into quantize /
dequantize.  torch.ao's stubs are accepted everywhere ours are.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class QuantStub(nn.Module):
    """Float -> quantized boundary. Identity until the model is converted."""

    qc_op = "quant"
    qc_leaf = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DeQuantStub(nn.Module):
    """Quantized -> float boundary. Identity until the model is converted."""

    qc_op = "dequant"
    qc_leaf = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
