"""The fast pools: integer max pools (one native pass, torch's quantized pool, or a running maximum)
and the global average pool with int32 sums and one native requantization."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from qcompiler.backends.bpu.native.kernels import (
    Requant,
    global_avg_pool_nhwc,
    global_avg_pool_nhwc_step,
    max_pool_nhwc,
    max_pool_nhwc_step,
)
from qcompiler.backends.bpu.sim.bounds import AMAX, I32, STORAGE
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.backends.bpu.sim.plan import Alloc, fresh
from qcompiler.backends.bpu.sim.reference import pool_geometry
from qcompiler.backends.bpu.sim.registry import REFERENCE, KernelSpec, fast_kernel
from qcompiler.compat.torch_private import as_qint8
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

# torch's quantized max pool vectorizes over channels: faster than the running maximum from
# 64 channels (resnet18's 3x3 pool: 1.5 -> 0.3 ms), slower with 16-32 (unet's 2x2 pools)
_QUANTIZED_POOL_MIN_CHANNELS = 64


@fast_kernel("max_pool2d")
def _fast_max_pool(k: KernelSpec) -> Callable:
    return _FastMaxPool(*pool_geometry(k), k.ws, native=k.native)


class _FastMaxPool:
    """Integer max pool as the running maximum of the kh*kw strided windows of a qmin-padded copy.

    Equal to ``F.max_pool2d``: torch requires padding <= kernel/2, so every
    window holds at least one real element, and a qmin pad never exceeds it.
    """

    def __init__(self, ks, st, pad, dil, ceil, ws: Workspace, native: bool = False) -> None:
        self.k, self.s, self.p, self.d = fp._pair(ks), fp._pair(st), fp._pair(pad), fp._pair(dil)
        self.ceil, self.ws, self.native = bool(ceil), ws, native

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.is_floating_point():
            return fp.int_max_pool2d(x, self.k, self.s, self.p, self.d, self.ceil)
        N, C, H, W = x.shape
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.k, self.s, self.p, self.d
        if 2 * ph > kh or 2 * pw > kw:  # torch rejects this; let it say so
            return fp.int_max_pool2d(x, self.k, self.s, self.p, self.d, self.ceil)
        Ho, Wo = fp.max_pool_out_size(H, kh, sh, ph, dh, self.ceil), fp.max_pool_out_size(W, kw, sw, pw, dw, self.ceil)
        if self._native(x):
            # one native pass, channels-last in and out (3-6x torch's quantized pool on resnet18's and
            # unet's pools, docs/performance.md)
            return max_pool_nhwc(x, self.k, self.s, self.p, self.d, (Ho, Wo))
        if x.dtype == torch.int8 and x.numel() and C >= _QUANTIZED_POOL_MIN_CHANNELS:
            try:
                return self._qint8(x)
            except (AttributeError, NotImplementedError, RuntimeError):
                pass  # a torch without (this form of) quantized tensors: the running maximum below
        need_h, need_w = (Ho - 1) * sh + dh * (kh - 1) + 1, (Wo - 1) * sw + dw * (kw - 1) + 1
        Hp, Wp = max(need_h, H + ph), max(need_w, W + pw)
        xc = x.transpose(0, 1)  # channel-major, like the conv outputs
        if (ph, pw) == (0, 0) and (Hp, Wp) == (H, W):
            xp = xc
        else:
            lo = torch.iinfo(x.dtype).min
            xp = self.ws.get("pool_pad", (C, N, Hp, Wp), x.dtype)
            xp.fill_(lo)
            xp[:, :, ph:ph + H, pw:pw + W].copy_(xc)
        out = None
        for i in range(kh):
            for j in range(kw):
                win = xp[:, :, i * dh: i * dh + sh * (Ho - 1) + 1: sh, j * dw: j * dw + sw * (Wo - 1) + 1: sw]
                out = win.clone(memory_format=torch.contiguous_format) if out is None else \
                    torch.maximum(out, win, out=out)
        return out.permute(1, 0, 2, 3)

    def _out_hw(self, x: torch.Tensor) -> tuple[int, int]:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.k, self.s, self.p, self.d
        return (fp.max_pool_out_size(x.shape[2], kh, sh, ph, dh, self.ceil),
                fp.max_pool_out_size(x.shape[3], kw, sw, pw, dw, self.ceil))

    def _native(self, x: torch.Tensor) -> bool:
        """Whether the call is one native pass (a channels-last int8/int16 input torch would pool)."""
        (kh, kw), (ph, pw) = self.k, self.p
        return (self.native and x.dim() == 4 and x.dtype in (torch.int8, torch.int16) and 2 * ph <= kh
                and 2 * pw <= kw and x.is_contiguous(memory_format=torch.channels_last))

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None where the call is not the
        native pass."""
        if not self._native(x):
            return None
        Ho, Wo = self._out_hw(x)
        out = alloc((x.shape[0], Ho, Wo, x.shape[1]), x.dtype).permute(0, 3, 1, 2)
        if not out.numel():
            return None
        return out, max_pool_nhwc_step(x, self.k, self.s, self.p, self.d, out)

    def _qint8(self, x: torch.Tensor) -> torch.Tensor:
        """torch's quantized max pool on the int8 values viewed as a qint8 tensor (scale 1, zero
        point 0, no copy): the same integer maxima (padding never wins, as above), in one
        vectorized channels-last pass.  torch warns that quantized tensors are deprecated."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            q = as_qint8(x)
            y = F.max_pool2d(q, self.k, self.s, self.p, self.d, ceil_mode=self.ceil)
        return y.int_repr()


@fast_kernel("global_avg_pool")
def _fast_global_avg_pool(k: KernelSpec) -> Callable:
    return _FastGlobalAvgPool(k)


class _FastGlobalAvgPool:
    """The reference's sums in int32 where ``amax * H * W < 2**31`` proves them in range, its
    ``(M, n)`` computed once per spatial size.  With the native kernels, a channels-last input
    (the native GEMM's output) is one native pass, sums and requantization
    (:func:`~qcompiler.backends.bpu.native.kernels.global_avg_pool_nhwc`, also a plan step); any other layout
    is summed by torch in place and requantized by one :class:`~qcompiler.backends.bpu.native.kernels.Requant`
    pass (the int32 sums are exact in float64; ``fp.requantize`` costs 0.15-0.3 ms in small torch
    ops), or by ``fp.requantize`` without the native kernels.  Both requantize as
    ``qc_requant_*`` does.  Else the reference."""

    def __init__(self, k: KernelSpec) -> None:
        a = k.attrs
        self.name, self.out_dtype, self.native = k.name, k.out_dtype, k.native
        self.s_in, self.s_out, self.keep = a["in_scale"], a["out_scale"], a["keepdim"]
        self.amax = AMAX[k.in_specs[0].dtype]
        self.in_storage = STORAGE.get(k.in_specs[0].dtype)
        self.st = STORAGE.get(k.out_dtype)
        self.lo, self.hi = fp.qrange(k.out_dtype)
        self.ref = REFERENCE["global_avg_pool"](k)
        self._params: dict[int, tuple[int, int]] = {}
        self._requants: dict[tuple[int, int], Optional[Requant]] = {}

    def _mn(self, hw: int) -> tuple[int, int]:
        if hw not in self._params:
            self._params[hw] = fp.global_avg_pool_params(hw, self.s_in, self.s_out, mult_bits=qnn.MULT_BITS,
                                                         max_shift=qnn.MAX_SHIFT)
        return self._params[hw]

    def _fits(self, hw: int) -> bool:
        """Whether the native requantization of these sums is exact (an int64 product, a shift <= 62)."""
        M, n = self._mn(hw)
        return (self.native and self.st in (torch.int8, torch.int16) and 0 <= n <= 62
                and self.amax * hw * abs(M) < 1 << 62)

    def _requant(self, hw: int, C: int) -> Optional[Requant]:
        if (hw, C) not in self._requants:
            M, n = self._mn(hw)
            self._requants[(hw, C)] = Requant(
                torch.full((C,), M, dtype=torch.int64), torch.full((C,), n, dtype=torch.int64), self.lo, self.hi,
                self.amax * hw) if self._fits(hw) else None
        return self._requants[(hw, C)]

    @staticmethod
    def _hw(x: torch.Tensor) -> int:
        return x.shape[-1] * x.shape[-2] if x.dim() >= 3 else 0

    def _exact_int32(self, x: torch.Tensor) -> bool:
        """Whether the int32 sums are proven (for the declared input type only) and not empty."""
        hw = self._hw(x)
        return bool(hw) and self.amax * hw < I32 and x.dtype == self.in_storage

    def _nhwc(self, x: torch.Tensor) -> bool:
        """After :meth:`_exact_int32`: whether the call is one native pass (a nonempty channels-last
        int8/int16 input, a requantization :meth:`_fits`)."""
        return (x.dim() == 4 and x.dtype in (torch.int8, torch.int16) and x.numel() > 0
                and x.is_contiguous(memory_format=torch.channels_last) and self._fits(self._hw(x)))

    def _shaped(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(*y.shape, 1, 1) if self.keep else y  # as QuantizedAvgPool (mean without keepdim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._exact_int32(x):
            return self.ref(x)
        hw = self._hw(x)
        M, n = self._mn(hw)
        if self._nhwc(x):
            return self._shaped(global_avg_pool_nhwc(x, M, n, self.lo, self.hi,
                                                     torch.empty(x.shape[:2], dtype=self.st)))
        sums = x.sum(dim=(-2, -1), dtype=torch.int32)
        rq = self._requant(hw, sums.shape[-1]) if sums.numel() else None
        if rq is None:
            y = fp.requantize(sums, M, n, self.out_dtype, op=self.name)
        else:
            y = torch.empty(sums.shape, dtype=self.st)
            rq(sums.to(torch.float64).reshape(-1, sums.shape[-1]), y.view(-1, sums.shape[-1]))
        return self._shaped(y)

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None where the call is not the
        native pass."""
        if not (self._exact_int32(x) and self._nhwc(x)):
            return None
        M, n = self._mn(self._hw(x))
        out = alloc(x.shape[:2], self.st)
        return self._shaped(out), global_avg_pool_nhwc_step(x, M, n, self.lo, self.hi, out)
