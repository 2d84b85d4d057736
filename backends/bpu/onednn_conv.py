"""Exact int8 convolutions through oneDNN, and the requantization epilogue in channels-last.

oneDNN's quantized convolution (``torch.ops.onednn.qconv2d_pointwise``, the x86 int8 kernel
torch.ao and inductor use) computes an int32 accumulator with VNNI and reorders nothing: it
reads channels-last uint8 activations and does the im2col inside the kernel.  Asked for a
**float32 output at scale 1** (input scale 1, weight scales 1, output scale 1), it returns
``float32(acc + bias)``, which is the exact integer when ``|acc + bias| < 2**24``.  Every
such sum is bounded statically by ``128 * max_o sum |w[o]| + max |bias|`` (the L1 bound of
the simulator's other kernels); a layer over that bound is split into input-channel chunks
that each fit (:class:`OnednnConv`).

The simulator's activations are int8 with zero point 0; oneDNN wants uint8 activations.
``q + 128`` (an XOR with 0x80 of the int8 bits) with zero point 128 is the same value, and
oneDNN subtracts the zero point exactly in int32, also in the zero padding (checked by
:func:`onednn_conv_available` and the property tests).

:class:`NhwcRequant` requantizes the float32 accumulator in float64, one rounding per
element, with no check for near-ties: its constructor proves that each float64 step is
exact for every value that the clamp does not decide anyway (see ``exact_in_float64``),
and refuses the layer otherwise (the simulator's tie-detecting epilogue takes it).
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from qcompiler.backends.bpu.native.kernels import Requant
from qcompiler.errors import InternalError
from qcompiler.native.build import native_enabled

__all__ = ["onednn_conv_available", "OnednnConv", "NhwcRequant", "exact_in_float64", "F32_EXACT"]

F32_EXACT = 1 << 24
# elements of one epilogue chunk (float64: 512 KiB, within a core's L2 cache)
CHUNK = 1 << 16
# 1.5 * 2**52: adding it rounds a float64 of magnitude below 2**51 to an integer (round half to even)
MAGIC = 6755399441055744.0
_ONEDNN: Optional[bool] = None

# (N, C, H, W, O, k, stride, padding, dilation, groups) of the self-test: 1x1, strided, padded,
# dilated, grouped, depthwise, 1-sized dims, batch > 1
_SELF_TEST = ((1, 1, 1, 1, 1, (1, 1), (1, 1), (0, 0), (1, 1), 1),
              (2, 3, 7, 5, 4, (3, 3), (2, 1), (1, 1), (1, 1), 1),
              (1, 8, 9, 9, 8, (3, 3), (1, 1), (1, 1), (1, 1), 8),
              (2, 6, 6, 8, 4, (3, 2), (1, 2), (1, 1), (2, 1), 2),
              (1, 16, 5, 5, 32, (1, 1), (2, 2), (0, 0), (1, 1), 1),
              (3, 5, 4, 3, 2, (2, 3), (1, 1), (1, 1), (1, 2), 1))


class _Scratch:
    """Fresh buffers (the self-test's stand-in for the simulator's workspace)."""

    def get(self, key: str, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def onednn_conv_available() -> bool:
    """True when oneDNN's int8 convolution gives exact accumulators on this machine.

    Checked once per process against float64 convolutions (exact here) on the shapes above,
    with extreme values (every input -128 or 127 where the weights are +-127) and random ones.
    """
    global _ONEDNN
    if _ONEDNN is None:
        _ONEDNN = _self_test()
    return _ONEDNN


def _self_test() -> bool:
    if not hasattr(torch.ops, "onednn") or not hasattr(torch.ops.onednn, "qconv2d_pointwise"):
        return False
    g = torch.Generator().manual_seed(20261123)
    try:
        for N, C, H, W, O, k, st, pad, dil, groups in _SELF_TEST:
            for how in ("extreme", "random"):
                if how == "extreme":
                    w = torch.where(torch.rand(O, C // groups, *k, generator=g) < 0.5, -127, 127).to(torch.int8)
                    x = torch.where(torch.rand(N, C, H, W, generator=g) < 0.5, -128, 127).to(torch.int8)
                else:
                    w = torch.randint(-128, 128, (O, C // groups, *k), dtype=torch.int8, generator=g)
                    x = torch.randint(-128, 128, (N, C, H, W), dtype=torch.int8, generator=g)
                bias = torch.randint(-1000, 1000, (O,), generator=g)
                want = F.conv2d(x.double(), w.double(), bias.double(), st, pad, dil, groups).to(torch.int64)
                conv = OnednnConv(w, bias, st, pad, dil, groups, [(0, C // groups)], _Scratch())
                if not torch.equal(conv(x).to(torch.int64), want):
                    return False
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False
    return True


class OnednnConv:
    """``conv2d(x, w) + bias`` of int8 ``x`` (any layout) as exact integers in float, channels-last.

    The input channels are split into chunks whose every partial sum stays below 2**24
    (``chunks``, from the L1 bound; one chunk for most layers): one prepacked oneDNN
    convolution per chunk, float32 results, summed in float64 (exact below 2**53) when there
    are several.  ``ws`` (``get(key, shape, dtype)``) supplies reusable scratch buffers.
    """

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor], stride, padding, dilation, groups: int,
                 chunks: Sequence[tuple[int, int]], ws) -> None:
        O = w.shape[0]
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.groups, self.ws = int(groups), ws
        if len(chunks) > 1 and self.groups != 1:
            raise InternalError("input-channel chunks need groups == 1")
        if w.dtype != torch.int8:  # w.to(torch.int8) would wrap int16 weights into wrong answers
            raise InternalError(f"oneDNN's int8 convolution takes int8 weights, got {w.dtype}; int16 weights "
                                f"(weight_dtype='qint16') run in the float GEMMs")
        self.w_scale = torch.ones(O, dtype=torch.float32)
        self.w_zp = torch.zeros(O, dtype=torch.int64)
        self.bias = None if bias is None else bias.to(torch.float32)  # exact below 2**24
        self.w, self.chunks = w, list(chunks)
        self.full = len(chunks) == 1
        self._packed: dict[tuple, list] = {}

    def _parts(self, shape: tuple) -> list:
        """(c0, c1, bias, weights prepacked for this input shape) per chunk; oneDNN picks its
        weight layout for the shape (prepacked without one, some layers reorder on every call)."""
        parts = self._packed.get(shape)
        if parts is None:
            parts = []
            for i, (c0, c1) in enumerate(self.chunks):
                x_shape = [shape[0], shape[1] if self.full else c1 - c0, shape[2], shape[3]]
                packed = torch.ops.onednn.qconv_prepack(self.w[:, c0:c1].contiguous(), self.w_scale, 1.0, 128,
                                                        self.stride, self.padding, self.dilation, self.groups, x_shape)
                parts.append((c0, c1, self.bias if i == 0 else None, packed))
            self._packed[shape] = parts
        return parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        N, C, H, W = x.shape
        xu = self.ws.get("onednn_x", (N, H, W, C), torch.uint8).permute(0, 3, 1, 2)
        torch.bitwise_xor(x.view(torch.uint8), 128, out=xu)  # q + 128, zero point 128
        acc = None
        for c0, c1, bias, packed in self._parts(tuple(x.shape)):
            part = xu if self.full else xu[:, c0:c1].contiguous(memory_format=torch.channels_last)
            y = torch.ops.onednn.qconv2d_pointwise(
                part, 1.0, 128, packed, self.w_scale, self.w_zp, bias, self.stride, self.padding,
                self.dilation, self.groups, 1.0, 0, torch.float32, "none", [], "")
            if self.full:
                return y
            if acc is None:
                acc = torch.empty(y.shape, dtype=torch.float64, memory_format=torch.channels_last).copy_(y)
            else:
                acc.add_(y)
        return acc


def exact_in_float64(n_max: int, out_bits: int, other_max: float = 0.0, nb: int = 0) -> bool:
    """Whether ``round(fl(fl(v * M * 2**-n) + o * Mb * 2**-nb))`` equals the exact rounding of
    ``v * M / 2**n + o * Mb / 2**nb`` for every result the clamp to ``[-2**b, 2**b)`` keeps.

    ``v * M`` is an integer: its float64 product is exact while ``|v * M / 2**n| < 2**(53-n)``;
    ``o * Mb`` (at most 16 + 31 bits) always is; the sum, a multiple of ``2**-max(n, nb)``, is
    exact while below ``2**(53 - max(n, nb))``.  A result the clamp keeps has ``|t| < 2**b + 1``,
    so its product term is below ``2**b + 1 + other_max``.  Where a product is inexact its true
    value is at least the power of two ``2**(53-n)``, so the rounded one is too (rounding is
    monotone) and both land beyond the clamp.  Without a fused add this is the simulator's
    ``n <= 53 - b`` rule.
    """
    bound = 2.0 ** out_bits + 1
    if other_max == 0.0:
        return n_max <= 53 - out_bits
    s = max(n_max, nb)
    return bound + other_max <= 2.0 ** (53 - n_max) and bound <= 2.0 ** (53 - s)


class NhwcRequant:
    """The epilogue of an exact float32 accumulator (bias included) in channels-last memory:
    ``clamp(round_half_even(acc * M[c] / 2**n[c] [+ other * Mb / 2**nb]))`` (+ relu / relu6),
    written as integers; or ``acc`` as int32 for a high-precision output.

    With the native kernels on (``native``; default :func:`~qcompiler.native.build.native_enabled`), one pass in C in
    integer arithmetic (:func:`~qcompiler.backends.bpu.native.kernels.requant_rows`: exact by construction,
    ``|acc| <= acc_bound``).  Otherwise evaluated in float64 -- multiply, round and clamp in three
    passes through ``MAGIC`` without a fused add; multiply, add, round, clamp and a cast with one --
    exact by :func:`exact_in_float64`, which the caller checks with :meth:`applies`.
    """

    def __init__(self, M: Optional[torch.Tensor], n: Optional[torch.Tensor], out_storage: torch.dtype,
                 lo: int = 0, hi: int = 0, add: Optional[tuple[int, int]] = None, acc_bound: int = 1 << 31,
                 native: Optional[bool] = None) -> None:
        self.out_storage, self.lo, self.hi = out_storage, lo, hi
        self.native = native_enabled() if native is None else bool(native)
        self._plans: dict = {}  # (channels, fused operand dtype) -> native Requant
        self.add, self.acc_bound = add, int(acc_bound)
        self.M64 = None if M is None else M.to(torch.int64).reshape(-1).contiguous()
        self.n64 = None if n is None else n.to(torch.int64).reshape(-1).contiguous()
        self.f = None if M is None else torch.ldexp(M.to(torch.float64), -n.to(torch.int64)).view(1, -1)
        self.f2 = None if add is None else math.ldexp(float(add[0]), -int(add[1]))  # exact
        # without a fused add: round and clamp on MAGIC + t (see __call__); MAGIC + lo/hi are exact
        self.magic = None
        if self.f is not None and add is None and sys.byteorder == "little":
            self.magic = torch.full_like(self.f, MAGIC)
            self.lo_m, self.hi_m = MAGIC + lo, MAGIC + hi

    @staticmethod
    def applies(n: torch.Tensor, out_dtype: str, other_amax: int = 0, add: Optional[tuple[int, int]] = None) -> bool:
        b = {"qint8": 7, "qint16": 15}.get(out_dtype)
        if b is None:
            return False
        if add is None:
            return exact_in_float64(int(n.max()), b)
        f2 = abs(math.ldexp(float(add[0]), -int(add[1])))
        return exact_in_float64(int(n.max()), b, other_amax * f2, int(add[1]))

    def __call__(self, acc: torch.Tensor, other: Optional[torch.Tensor] = None, ws=None) -> torch.Tensor:
        """``acc`` (N, O, H, W) channels-last; the result is channels-last too.  Rows of positions
        are processed in chunks of about ``CHUNK`` elements, so the float64 temporaries stay in cache."""
        N, O, H, W = acc.shape
        out = torch.empty((N, H, W, O), dtype=self.out_storage)
        a2, o2 = acc.permute(0, 2, 3, 1).reshape(-1, O), out.view(-1, O)
        if self.f is None:  # high precision: the int32 accumulator
            o2.copy_(a2)
            return out.permute(0, 3, 1, 2)
        b2 = None if other is None else other.permute(0, 2, 3, 1).reshape(-1, O)
        if self._native(a2, b2, o2):
            return out.permute(0, 3, 1, 2)
        P = a2.shape[0]
        R = max(1, CHUNK // O)
        f = self.f
        for r0 in range(0, P, R):
            r1 = min(P, r0 + R)
            t = ws.get("epi_nhwc", (r1 - r0, O), torch.float64) if ws is not None else \
                torch.empty((r1 - r0, O), dtype=torch.float64)
            if self.magic is not None:
                # MAGIC + acc * f lies in [2**52, 2**53) (ulp 1) for every unclamped result: the sum
                # rounds t to an integer, ties to even (MAGIC is even), and its low 32 bits are that
                # integer in two's complement; clamping MAGIC + t is clamping t (both monotone)
                torch.addcmul(self.magic, a2[r0:r1], f, out=t)
                t.clamp_(self.lo_m, self.hi_m)
                o2[r0:r1].copy_(t.view(torch.int32)[:, 0::2])
                continue
            torch.mul(a2[r0:r1], f, out=t)
            if b2 is not None:
                t.add_(b2[r0:r1], alpha=self.f2)  # other * f2 is exact; one rounding of the sum
            t.round_().clamp_(self.lo, self.hi)
            o2[r0:r1].copy_(t)
        return out.permute(0, 3, 1, 2)

    def _native(self, a2: torch.Tensor, b2: Optional[torch.Tensor], o2: torch.Tensor) -> bool:
        """The whole epilogue in one native pass, when the kernels are on and the operands fit them."""
        if not self.native or o2.dtype not in (torch.int8, torch.int16) or a2.dtype not in (
                torch.float32, torch.float64) or (b2 is not None and b2.dtype not in (torch.int8, torch.int16)):
            return False
        O = a2.shape[1]
        key = (O, None if b2 is None else b2.dtype)
        plan = self._plans.get(key)
        if plan is None:
            M, n = self.M64, self.n64
            if M.numel() != O or n.numel() != O:  # per-tensor parameters: one entry per channel
                M, n = M.expand(O).contiguous(), n.expand(O).contiguous()
            Mb, nb = self.add if b2 is not None else (0, 0)
            plan = self._plans[key] = Requant(M, n, self.lo, self.hi, self.acc_bound, key[1], Mb, nb)
        plan(a2 if a2.is_contiguous() else a2.contiguous(), o2,
             None if b2 is None else (b2 if b2.is_contiguous() else b2.contiguous()))
        return True
