"""The fast quantize: one native pass over a float32 input for a per-tensor scale."""

from __future__ import annotations

import math
from typing import Callable

import torch

from qcompiler.backends.bpu.native.kernels import quantize_f32
from qcompiler.backends.bpu.sim.bounds import STORAGE
from qcompiler.backends.bpu.sim.registry import REFERENCE, KernelSpec, fast_kernel
from qcompiler.quantization import fixed_point as fp


@fast_kernel("quantize")
def _fast_quantize(k: KernelSpec) -> Callable:
    """With the native kernels and a per-tensor scale: one native pass over a contiguous float32
    input (:func:`~qcompiler.backends.bpu.native.kernels.quantize_f32`, exactly ``fp.quantize``); any other input
    takes ``fp.quantize``."""
    scale, dtype = k.attrs["out_scale"], k.attrs["out_dtype"]
    st = STORAGE.get(dtype)
    s = torch.as_tensor(scale, dtype=torch.float32)
    if not k.native or st not in (torch.int8, torch.int16) or s.numel() != 1 or not (
            math.isfinite(float(s)) and float(s) > 0):
        return REFERENCE["quantize"](k)
    s32 = float(s.reshape(()))

    def quantize(x):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            return fp.quantize(x, scale, dtype)
        if x.dim() == 4 and x.shape[1] > 1:  # channels-last, what the native convs read
            out = torch.empty((x.shape[0], *x.shape[2:], x.shape[1]), dtype=st).permute(0, 3, 1, 2)
        else:
            out = torch.empty(x.shape, dtype=st)
        quantize_f32(x, s32, out)
        return out
    return quantize
