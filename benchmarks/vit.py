"""ViT-B/16 for the simulator benchmark, from the zoo's explicit transformer block (no torchvision here).

The sizes of torchvision's ``vit_b_16`` (patch 16, width 768, 12 layers of 12 heads, MLP 3072, 224 x 224
input, 1000 classes, 86.6 M parameters, as torchvision's) with one difference: the image is
read out by the mean of the 196 patch tokens instead of a class token (the class token's
``expand(batch)`` needs the batch size at run time; the pooled form is the one of e.g. DeiT-style
"global pool" heads and does the same work, one token less). Seeded random weights: the benchmark
measures speed on the same work, not accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from qcompiler.zoo._common import build, input_generator
from qcompiler.zoo.transformer import TransformerBlock

PATCH, WIDTH, LAYERS, HEADS, MLP, CLASSES = 16, 768, 12, 12, 3072, 1000
SEED, INPUT_SEED = 16, 1016


class VisionTransformer(nn.Module):
    """Patch embedding (a 16 x 16 stride-16 conv), learned position embedding, ``layers`` pre-norm blocks,
    final LayerNorm, the mean over tokens and a linear head."""

    def __init__(self, image: int = 224, patch: int = PATCH, width: int = WIDTH, layers: int = LAYERS,
                 heads: int = HEADS, mlp: int = MLP, classes: int = CLASSES) -> None:
        super().__init__()
        self.tokens = (image // patch) ** 2
        self.patch = nn.Conv2d(3, width, patch, stride=patch)
        self.position = nn.Parameter(torch.randn(1, self.tokens, width) * 0.02)
        self.blocks = nn.Sequential(*(TransformerBlock(width, heads, mlp, self.tokens) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.blocks(t)).mean(dim=1))


def vit_b16(image: int = 224, **sizes: int) -> VisionTransformer:
    """ViT-B/16 (or smaller ``sizes`` for tests), eval mode, deterministic weights."""
    return build(SEED, lambda: VisionTransformer(image, **sizes))


def example_inputs(batch: int = 1, image_size: int = 224) -> tuple:
    """``(x,)``: a standard-normal image batch ``(batch, 3, image_size, image_size)``."""
    return (torch.randn(batch, 3, image_size, image_size, generator=input_generator(INPUT_SEED)),)
