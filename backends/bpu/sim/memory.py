"""Scratch memory and layouts: per-thread reusable buffers, and the channels-last test."""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch


class Workspace:
    """Reusable scratch buffers (one per key and dtype), so large temporaries are not
    re-allocated (and page-faulted) on every call.  Never returned to the caller.

    The buffers are per thread, so one simulator can run in several threads at once (the
    batch split of ``qcompiler.parallel``): each thread gets its own set."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def _bufs(self) -> dict[tuple[str, torch.dtype], torch.Tensor]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        return bufs

    def get(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        bufs = self._bufs
        buf = bufs.get((key, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            bufs[(key, dtype)] = buf
        return buf[:n].view(tuple(shape))

    def clear(self) -> None:
        self._bufs.clear()


def nhwc(x: torch.Tensor) -> bool:
    """``x`` is a 4-d tensor laid out channels-last and not also contiguous (a 1-channel or 1x1
    tensor is both: it counts as contiguous)."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
