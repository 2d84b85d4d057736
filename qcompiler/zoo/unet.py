"""A small 3-level UNet for segmentation-style workloads.

Exercises what classification nets do not: skip connections joined with
``torch.cat``, max-pool downsampling and two flavours of upsampling
(functional bilinear ``interpolate`` on the deeper level, an ``nn.Upsample``
module with nearest mode on the shallower one).  Channels: base, 2*base,
4*base (16/32/64 by default); input 1x3x64x64 -> output 1x2x64x64.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import build, kaiming_init_convs, normal_inputs, perturb_batchnorm

__all__ = ["DoubleConv", "UNet", "unet", "example_inputs"]

UNET_SEED = 64
INPUT_SEED = 1064
INPUT_SHAPE = (1, 3, 64, 64)


class DoubleConv(nn.Module):
    """(3x3 conv, no bias -> BN -> ReLU) twice; keeps spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return x


class UNet(nn.Module):
    """enc1 -> pool1 -> enc2 -> pool2 -> bottleneck, then two up/cat/DoubleConv stages and a 1x1 head."""

    def __init__(self, in_channels: int = 3, num_classes: int = 2, base_channels: int = 16) -> None:
        super().__init__()
        c1, c2, c3 = base_channels, 2 * base_channels, 4 * base_channels
        self.enc1 = DoubleConv(in_channels, c1)
        self.pool1 = nn.MaxPool2d(2)
        self.enc2 = DoubleConv(c1, c2)
        self.pool2 = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(c2, c3)
        # Level 2 upsamples with F.interpolate(bilinear) in forward().
        self.dec2 = DoubleConv(c2 + c3, c2)
        # Level 1 upsamples with an nn.Upsample module.
        self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec1 = DoubleConv(c1 + c2, c1)
        self.head = nn.Conv2d(c1, num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(self.pool1(s1))
        b = self.bottleneck(self.pool2(s2))
        up = nn.functional.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False)
        d2 = self.dec2(torch.cat([s2, up], dim=1))
        up = self.up1(d2)
        d1 = self.dec1(torch.cat([s1, up], dim=1))
        return self.head(d1)


def unet(in_channels: int = 3, num_classes: int = 2, base_channels: int = 16) -> UNet:
    """Small UNet in eval mode with deterministic weights and perturbed BN stats."""
    return build(UNET_SEED, lambda: UNet(in_channels=in_channels, num_classes=num_classes,
                                         base_channels=base_channels), kaiming_init_convs, perturb_batchnorm)


def example_inputs(batch: int = 1, in_channels: int = 3, image_size: int = 64, **_: object) -> tuple:
    """One image batch ``(batch, in_channels, image_size, image_size)``; size must be divisible by 4.

    Extra keyword arguments (model kwargs such as ``num_classes``) are ignored.
    """
    return normal_inputs(INPUT_SEED, batch, in_channels, image_size, image_size)
