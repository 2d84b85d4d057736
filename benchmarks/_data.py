"""Shared data helpers for the benchmarks: deterministic smooth-noise images, BN re-estimation, SQNR.

Random weights plus i.i.d. Gaussian inputs make a poor stand-in for natural
images (no spatial correlation, no low-frequency energy).  ``SmoothNoise``
draws each image from its own seed: low-resolution Gaussian noise, upsampled
bilinearly to the full size and blurred with a small Gaussian kernel, then
normalised per image to zero mean and unit standard deviation per channel
(roughly what an ImageNet-normalised photo looks like to the first conv).

The images are the same as ``examples/ptq_fx.py``'s ``SmoothNoiseImages`` (that example
stays self-contained).  Also: ``reestimate_bn`` (re-estimate BatchNorm running statistics of a
random-weight model on such images) and ``sqnr_db``.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["SmoothNoise", "reestimate_bn", "sqnr_db", "stack"]


def _gaussian_kernel(sigma: float, radius: int) -> torch.Tensor:
    x = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


class SmoothNoise(Dataset):
    """``length`` deterministic smooth-noise images ``(channels, size, size)``; item i is seeded by ``seed + i``.

    Items are ``(image, 0)`` pairs so the dataset drops into loops written for
    labelled data.  ``low_res`` is the side of the noise grid before upsampling
    (several low-res grids are summed, coarse to fine, for a 1/f-like spectrum).
    """

    def __init__(self, length: int, size: int = 64, channels: int = 3, seed: int = 0,
                 low_res: tuple[int, ...] = (4, 8, 16), blur_sigma: float = 1.0) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.length, self.size, self.channels, self.seed = length, size, channels, seed
        self.low_res = tuple(r for r in low_res if r <= size) or (min(size, 4),)
        radius = max(1, int(round(2 * blur_sigma)))
        k = _gaussian_kernel(blur_sigma, radius)
        self._kh = k.reshape(1, 1, 1, -1).repeat(channels, 1, 1, 1)
        self._kv = k.reshape(1, 1, -1, 1).repeat(channels, 1, 1, 1)
        self._pad = radius

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        img = torch.zeros(1, self.channels, self.size, self.size)
        for level, r in enumerate(self.low_res):
            noise = torch.randn(1, self.channels, r, r, generator=g)
            up = F.interpolate(noise, size=(self.size, self.size), mode="bilinear", align_corners=False)
            img += up / (level + 1)  # coarse grids carry most energy
        # separable Gaussian blur (reflect padding keeps the borders like the interior)
        img = F.pad(img, (self._pad,) * 4, mode="reflect")
        img = F.conv2d(img, self._kh, groups=self.channels)
        img = F.conv2d(img, self._kv, groups=self.channels)
        img = img[0]
        mean = img.mean(dim=(1, 2), keepdim=True)
        std = img.std(dim=(1, 2), keepdim=True).clamp_min(1e-6)
        return (img - mean) / std, 0


def stack(ds: Dataset, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Items ``start:stop`` of ``ds`` as one batch tensor."""
    stop = len(ds) if stop is None else stop
    return torch.stack([ds[i][0] for i in range(start, stop)])


@torch.no_grad()
def reestimate_bn(model: nn.Module, batches: Iterable[torch.Tensor]) -> nn.Module:
    """Reset every BatchNorm's running stats and re-estimate them as a cumulative average.

    The model runs in train mode (BN uses and accumulates batch statistics,
    ``momentum=None``), under no_grad; it is returned in eval mode with the
    original momenta restored.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    for x in batches:
        model(x)
    for m, mom in zip(bns, momenta):
        m.momentum = mom
    return model.eval()


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """``20 * log10(||ref|| / ||ref - test||)`` over all elements (inf if identical)."""
    ref, test = ref.detach().double().flatten(), test.detach().double().flatten()
    err = (ref - test).norm()
    if err == 0:
        return float("inf")
    return float(20.0 * torch.log10(ref.norm() / err))
