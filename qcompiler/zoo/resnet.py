"""ResNet-18 / ResNet-50 with torchvision's module names and structure.

Written from scratch so the compiler has realistic CNN workloads without a
torchvision dependency.  Module paths (``layer1.0.conv1``, ``layer2.0.downsample.0``,
``fc`` ...) and parameter counts match torchvision, so configs keyed on those
names carry over.  Differences that do not change structure: the residual add
is the out-of-place ``out = out + identity`` (an explicit graph node instead of
an in-place mutation) and ReLUs are not in-place.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Type, Union

import torch
from torch import nn

from ._common import build, kaiming_init_convs, normal_inputs, perturb_batchnorm

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "example_inputs"]

RESNET18_SEED = 18
RESNET50_SEED = 50
INPUT_SHAPE = (1, 3, 224, 224)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias (BN follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution with no bias (BN follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class _ResidualBlock(nn.Module):
    """What both blocks end with: the shortcut (``downsample`` of the input, or the input), the
    residual add and the ReLU."""

    downsample: Optional[nn.Module]
    relu: nn.Module

    def _add_shortcut(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class BasicBlock(_ResidualBlock):
    """Two 3x3 conv+BN layers with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self._add_shortcut(self.bn2(self.conv2(out)), x)


class Bottleneck(_ResidualBlock):
    """1x1 reduce, 3x3 (strided, "v1.5"), 1x1 expand x4, with residual (ResNet-50+)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self._add_shortcut(self.bn3(self.conv3(out)), x)


Block = Union[Type[BasicBlock], Type[Bottleneck]]


class ResNet(nn.Module):
    """Stem (conv1/bn1/relu/maxpool), four stages ``layer1..layer4``, avgpool, fc."""

    def __init__(self, block: Block, layers: Sequence[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: List[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


def _build(block: Block, layers: Sequence[int], num_classes: int, seed: int) -> ResNet:
    return build(seed, lambda: ResNet(block, layers, num_classes=num_classes), kaiming_init_convs, perturb_batchnorm)


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 (BasicBlock x [2, 2, 2, 2]); 11,689,512 params at 1000 classes."""
    return _build(BasicBlock, [2, 2, 2, 2], num_classes, RESNET18_SEED)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 (Bottleneck x [3, 4, 6, 3]); 25,557,032 params at 1000 classes."""
    return _build(Bottleneck, [3, 4, 6, 3], num_classes, RESNET50_SEED)


INPUT_SEED = 1000


def example_inputs(batch: int = 1, image_size: int = 224, **_: object) -> tuple:
    """One normal-distributed image batch ``(batch, 3, image_size, image_size)``.

    Extra keyword arguments (model kwargs such as ``num_classes``) are ignored.
    """
    return normal_inputs(INPUT_SEED, batch, 3, image_size, image_size)
