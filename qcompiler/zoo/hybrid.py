"""The hybrid BPU/CPU QAT guide's example model, reproduced with its exact module names.

Mixes ops a BPU accelerates (1x1 convs) with ones that usually fall back to
CPU (PReLU, SELU), both as modules and as functional calls, and reuses one
``nn.Identity`` module twice; QuantStub/DeQuantStub mark the quantized region.
Registration order (quant, conv0, prelu, conv1, conv2, conv3, conv4, selu,
dequant, identity) is kept because per-module configs refer to these names.
"""

from __future__ import annotations

import torch
from torch import nn

from qcompiler.compat import torch_ao as ao
from qcompiler.quantization import stubs as _stubs

from ._common import build, input_generator

# The guide writes torch.ao's stubs; once torch drops them, ours stand in (same behaviour).
QuantStub = ao.QuantStub or _stubs.QuantStub
DeQuantStub = ao.DeQuantStub or _stubs.DeQuantStub

__all__ = ["HybridModel", "hybrid", "example_inputs"]

HYBRID_SEED = 3
INPUT_SEED = 1003
INPUT_SHAPE = (1, 3, 224, 224)


class _ConvBlock(nn.Module):
    """1x1 conv -> PReLU -> functional SELU."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.prelu = nn.PReLU()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.conv(input)
        x = self.prelu(x)
        return nn.functional.selu(x)


class _SeluModule(nn.Module):
    """SELU wrapped in a module so it can be configured by name."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.selu(input)


class HybridModel(nn.Module):
    """quant -> conv0 -> identity -> prelu -> selu -> conv1 block -> conv2 -> conv3 -> identity -> conv4 -> selu -> dequant."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv0 = nn.Conv2d(channels, channels, 1)
        self.prelu = nn.PReLU()
        self.conv1 = _ConvBlock(channels)
        self.conv2 = nn.Conv2d(channels, channels, 1)
        self.conv3 = nn.Conv2d(channels, channels, 1)
        self.conv4 = nn.Conv2d(channels, channels, 1)
        self.selu = _SeluModule()
        self.dequant = DeQuantStub()
        self.identity = nn.Identity()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.quant(input)
        x = self.conv0(x)
        x = self.identity(x)
        x = self.prelu(x)
        x = nn.functional.selu(x)
        x = self.conv1(x)
        x = self.conv2(x)
        x = self.conv3(x)
        x = self.identity(x)
        x = self.conv4(x)
        x = self.selu(x)
        return self.dequant(x)


def hybrid(channels: int = 3) -> HybridModel:
    """HybridModel in eval mode with deterministic (PyTorch default-init) weights."""
    return build(HYBRID_SEED, lambda: HybridModel(channels=channels))


def example_inputs(batch: int = 1, channels: int = 3, image_size: int = 224, **_: object) -> tuple:
    """One uniform ``[0, 1)`` batch ``(batch, channels, image_size, image_size)`` (``torch.rand``).

    Extra keyword arguments are ignored.
    """
    g = input_generator(INPUT_SEED)
    return (torch.rand(batch, channels, image_size, image_size, generator=g),)
