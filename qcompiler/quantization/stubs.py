"""QuantStub / DeQuantStub: mark where float data enters and leaves the BPU.

They behave as identities in float mode; convert turns them into quantize /
dequantize.  torch.ao's stubs are accepted everywhere ours are.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


class QuantStub(nn.Module):
    """Float -> quantized boundary. Identity until prepared; then its
    ``activation_post_process`` observes (calibration) or fake-quantizes (QAT) the input."""

    qc_op = "quant"
    qc_leaf = True

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apq = self.activation_post_process
        return apq(x) if apq is not None else x


class DeQuantStub(nn.Module):
    """Quantized -> float boundary. Until the model is converted it returns its input, in
    float32: an evaluated fake-quant model carries BPU values exactly in float64."""

    qc_op = "dequant"
    qc_leaf = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x
