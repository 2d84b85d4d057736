"""Activation observers: record the range of a tensor, pass it through unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn


class MinMaxObserver(nn.Module):
    """Running min/max of every tensor seen; symmetric int8 scale on demand.

    It returns its input unchanged, so an observed model computes exactly the
    float model's outputs.
    """

    qc_leaf = True
    # at a float -> BPU boundary the observer marks where values get quantized
    qc_op = "quant"

    def __init__(self, quant_min: int = -128, quant_max: int = 127) -> None:
        super().__init__()
        self.quant_min, self.quant_max = quant_min, quant_max
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            d = x.detach()
            self.min_val = torch.minimum(self.min_val, d.min().float())
            self.max_val = torch.maximum(self.max_val, d.max().float())
        return x

    def calculate_scale(self) -> torch.Tensor:
        amax = torch.maximum(self.min_val.abs(), self.max_val.abs())
        return torch.clamp(amax / self.quant_max, min=torch.finfo(torch.float32).eps)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val.item():.4g}, max_val={self.max_val.item():.4g}"
