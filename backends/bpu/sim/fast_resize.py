"""The fast resizes: nearest as a byte selection after the requantization, bilinear as one native
integer pass where its taps are exact dyadics."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from qcompiler.backends.bpu.native.kernels import BilinearResize, nearest_nhwc_step, nearest_taps
from qcompiler.backends.bpu.sim.memory import nhwc
from qcompiler.backends.bpu.sim.plan import Alloc, fresh
from qcompiler.backends.bpu.sim.registry import REFERENCE, KernelSpec, fast_kernel
from qcompiler.quantization import fixed_point as fp


@fast_kernel("resize_nearest")
def _fast_resize_nearest(k: KernelSpec) -> Callable:
    """:class:`_FastNearestResize` for int8 outputs of int8/int16 inputs, else the reference."""
    if fp.storage_dtype(k.out_dtype) != torch.int8 or k.in_specs[0].dtype not in ("qint8", "qint16"):
        return REFERENCE["resize_nearest"](k)
    return _FastNearestResize(k)


class _FastNearestResize:
    """Nearest resize of int8 values: the reference's per-element requantization
    ``clamp(round(float64(q) * ratio))`` on the (smaller) input, then torch's nearest resize of
    the bytes (a selection: the same source element per output position as in float64).  As a plan
    step (native kernels, channels-last input): one native pass selecting torch's source elements
    (:func:`~qcompiler.backends.bpu.native.kernels.nearest_taps`) and requantizing them with the same float64
    product, which commutes with the selection."""

    def __init__(self, k: KernelSpec) -> None:
        a = k.attrs
        self.size, self.ratio = tuple(a["size"]), a["in_scale"] / a["out_scale"]
        self.lo, self.hi = fp.qrange(k.out_dtype)
        self.st = fp.storage_dtype(k.out_dtype)
        self.reference = REFERENCE["resize_nearest"](k)
        self.native = k.native
        self._taps: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or not x.numel():
            return self.reference(x)
        st = self.st
        small = x if self.ratio == 1.0 and x.dtype == st else \
            torch.round(x.double() * self.ratio).clamp_(self.lo, self.hi).to(st)
        return F.interpolate(small.view(torch.uint8), size=self.size, mode="nearest").view(st)

    def _axis(self, n_in: int, n_out: int) -> torch.Tensor:
        key = (n_in, n_out)
        if key not in self._taps:
            self._taps[key] = nearest_taps(n_in, n_out)
        return self._taps[key]

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None off the native kernels or
        where the input is not channels-last int8/int16 (then torch's resize runs, op by op)."""
        if not (self.native and x.dim() == 4 and x.numel() and x.dtype in (torch.int8, torch.int16) and nhwc(x)
                and math.isfinite(self.ratio) and self.ratio > 0):
            return None
        N, C, H, W = x.shape
        Ho, Wo = (int(v) for v in self.size)
        out = alloc((N, Ho, Wo, C), self.st).permute(0, 3, 1, 2)
        if not out.numel() or not nhwc(out):  # (torch's output would be contiguous)
            return None
        ratio = None if self.ratio == 1.0 and x.dtype == self.st else self.ratio
        return out, nearest_nhwc_step(x, self._axis(H, Ho), self._axis(W, Wo), ratio, self.lo, self.hi, out)


@fast_kernel("resize_bilinear")
def _fast_resize_bilinear(k: KernelSpec) -> Callable:
    """Bilinear resize in one native integer pass (:class:`~qcompiler.backends.bpu.native.kernels.BilinearResize`)
    when the input's sizes give exact dyadic weights (factor-2 and other power-of-two ratios, equal
    sizes): then the reference's float64 value is a rational computed exactly in int32, rescaled
    by the same one float64 product.  Other inputs (and native off) take the reference."""
    a, out_dtype = k.attrs, k.out_dtype
    reference = REFERENCE["resize_bilinear"](k)
    st = fp.storage_dtype(out_dtype)
    if not k.native or st not in (torch.int8, torch.int16) or k.in_specs[0].dtype not in ("qint8", "qint16"):
        return reference
    lo, hi = fp.qrange(out_dtype)
    kernel = BilinearResize(a["size"], a["align_corners"], a["in_scale"] / a["out_scale"], lo, hi, st)
    return _FastBilinearResize(kernel, reference)


class _FastBilinearResize:
    """The native bilinear resize where :meth:`BilinearResize.exact_for` holds, else the reference."""

    def __init__(self, kernel: BilinearResize, reference: Callable) -> None:
        self.kernel, self.reference = kernel, reference

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x) if self.kernel.exact_for(x) else self.reference(x)

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None where the call is not one
        ``qc_resize_nhwc_*`` pass on ``x`` as it lies (inexact taps: the reference; other layouts)."""
        k = self.kernel
        if not k.exact_for(x) or k._layout(x) != "nhwc":
            return None
        out = alloc((x.shape[0], k.Ho, k.Wo, x.shape[1]), k.out_dtype).permute(0, 3, 1, 2)
        spec = k.step(x, out)
        return None if spec is None else (out, spec)
