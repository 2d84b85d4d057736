"""MobileNetV2 with torchvision's module layout.

A depthwise-separable workload (grouped convs, ReLU6, linear bottlenecks,
residuals only where shapes match) for the compiler.  ``features`` holds a
stem ``ConvBNReLU`` (``features.0.{0,1,2}``), 17 ``InvertedResidual`` blocks
whose layers live in ``conv`` (``features.N.conv.*``) and a final 1x1
``ConvBNReLU`` (``features.18``); ``classifier`` is Dropout + Linear.  The
parameter count (3,504,872) matches torchvision.  ReLU6 is not in-place.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from qcompiler.errors import ConfigError

from ._common import build, normal_inputs, perturb_batchnorm

__all__ = ["ConvBNReLU", "InvertedResidual", "MobileNetV2", "mobilenet_v2", "example_inputs"]

MOBILENET_V2_SEED = 2
INPUT_SEED = 1002
INPUT_SHAPE = (1, 3, 224, 224)

# (expand ratio t, output channels c, repeats n, first stride s), as in the paper.
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    """Round a channel count to a multiple of ``divisor``, never dropping more than 10%."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + ReLU6 as children ``0``, ``1``, ``2``."""

    def __init__(self, in_planes: int, out_planes: int, kernel_size: int = 3,
                 stride: int = 1, groups: int = 1) -> None:
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_planes),
            nn.ReLU6(),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1, skipped when t == 1) -> depthwise 3x3 -> linear 1x1 projection."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ConfigError(f"InvertedResidual stride must be 1 or 2, got {stride}")
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: List[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU(inp, hidden_dim, kernel_size=1))
        layers.extend([
            ConvBNReLU(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ])
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 backbone (``features``) plus Dropout/Linear ``classifier``."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0,
                 dropout: float = 0.2, round_nearest: int = 8) -> None:
        super().__init__()
        input_channel = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: List[nn.Module] = [ConvBNReLU(3, input_channel, stride=2)]
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, output_channel, stride, expand_ratio=t))
                input_channel = output_channel
        features.append(ConvBNReLU(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(self.last_channel, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


def _init_weights(model: nn.Module) -> None:
    """torchvision's MobileNetV2 init: kaiming convs, unit BN, N(0, 0.01) linear."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


def mobilenet_v2(num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2) -> MobileNetV2:
    """MobileNetV2 in eval mode with deterministic weights and perturbed BN stats."""
    return build(MOBILENET_V2_SEED, lambda: MobileNetV2(num_classes=num_classes, width_mult=width_mult,
                                                        dropout=dropout), _init_weights, perturb_batchnorm)


def example_inputs(batch: int = 1, image_size: int = 224, **_: object) -> tuple:
    """One normal-distributed image batch ``(batch, 3, image_size, image_size)``.

    Extra keyword arguments (model kwargs such as ``num_classes``) are ignored.
    """
    return normal_inputs(INPUT_SEED, batch, 3, image_size, image_size)
