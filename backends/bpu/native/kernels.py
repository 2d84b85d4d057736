"""Typed entry points of the BPU simulator's native kernels (``backends/bpu/native/*.c``), called on
tensors' ``data_ptr()``: the exact requantization, the depthwise conv, resizes, pools, concatenation,
quantization, and the GEMM's switches (its class is :mod:`~qcompiler.backends.bpu.native.gemm`).

The wrappers check their tensors with the helpers of :mod:`qcompiler.native.kernels` (a
:class:`~qcompiler.errors.ConfigError` naming the argument, never a raw pointer to a wrong
buffer), and hold to its contract: callers ask :func:`~qcompiler.native.build.native_enabled`
first and keep their torch path otherwise; the kernels hold no state, and ctypes releases the GIL
around each call, so several threads may run them at once.
"""

from __future__ import annotations

import ctypes
import math
import os
from fractions import Fraction
from typing import Optional

import torch

from qcompiler.backends.bpu.native.plan import StepSpec
from qcompiler.errors import ConfigError
from qcompiler.native.build import library
from qcompiler.native.kernels import _check, _fn

__all__ = ["Requant", "DepthwiseConv", "BilinearResize", "bilinear_taps", "nearest_taps", "nearest_nhwc_step", "int32_requant", "requant_columns32", "requant_columns_step", "max_pool_nhwc", "max_pool_nhwc_step", "global_avg_pool_nhwc", "global_avg_pool_nhwc_step", "requant_columns", "requant_rows", "prepared_constants", "MAX_SHIFT", "INT64_LIMIT", "vnni_enabled", "ENV_VNNI", "amx_enabled", "amx_mode", "amx_calls", "set_amx", "quantize_f32", "abs_sums", "int8_acc_bound", "f64_epilogue"]

_I64, _F64, _P = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
MAX_SHIFT = 62
ENV_VNNI = "QCOMPILER_NATIVE_VNNI"  # "0" / "off": not the AVX512-VNNI kernels (benchmarks compare both paths)
INT64_LIMIT = 1 << 62  # |products| and the fused sum stay below this in the int64 kernel
_ACC = {torch.float32: "f32", torch.float64: "f64"}
_INT = {torch.int8: "i8", torch.int16: "i16"}


def vnni_enabled() -> bool:
    """Whether the native library is loaded, has AVX512-VNNI kernels for this CPU (``qc_gemm_vnni``), and
    ``QCOMPILER_NATIVE_VNNI`` does not turn those kernels off (the int8 GEMM, the VNNI depthwise conv)."""
    if os.environ.get(ENV_VNNI, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return library() is not None and _fn("qc_gemm_vnni", ())() == 1


def set_amx(on: bool, every_call: bool = False) -> bool:
    """Run the int8 GEMM on AMX tiles (``on``; where the CPU has AMX-INT8 and the OS grants the tile
    state) or on AVX512-VNNI vectors.  Tiles take the calls of at least 16 rows and 2**22
    multiply-adds (smaller ones stay faster on vectors), or every call with ``every_call`` (tests).
    Process-wide; the results are bit for bit the same either way (``backends/bpu/native/gemm_amx.c``, "AMX
    tiles").  The library starts with tiles on unless ``QCOMPILER_NATIVE_AMX=0``.  Returns whether tiles are
    in use now."""
    mode = (2 if every_call else 1) if on else 0
    return library() is not None and _fn("qc_gemm_amx_set", (ctypes.c_int,))(mode) != 0


def amx_enabled() -> bool:
    """Whether the int8 GEMM runs on AMX tiles (see :func:`set_amx`)."""
    return amx_mode() != 0


def amx_mode() -> int:
    """0: the GEMM on vectors; 1: on AMX tiles from 16 rows and 2**22 multiply-adds; 2: every call on tiles."""
    return int(_fn("qc_gemm_amx_set", (ctypes.c_int,))(-1)) if library() is not None else 0


def amx_calls() -> int:
    """How many GEMM calls (or parts of split ones) have run on AMX tiles in this process (tests)."""
    return int(_fn("qc_gemm_amx_calls", (), ctypes.c_int64)()) if library() is not None else 0


def _ok(rc: int) -> None:
    if rc != 0:
        raise MemoryError("native requantization: out of memory for its per-channel tables")


class Requant:
    """A prepared requantization: ``out[p, c] = clamp(round_half_even(acc[p, c] * M[c] / 2**n[c]
    [+ other[p, c] * Mb / 2**nb]), lo, hi)``, exactly, in integer arithmetic.

    The parameters are checked once here (shifts in [0, 62]; ``acc_bound * |M|`` and the fused
    operand's ``|other| * |Mb|`` below 2**62), so a call only checks its tensors.  The fused sum
    runs in int64 when its bound ``acc_bound * max|M| * 2**(s - min n) + max|other| * |Mb| *
    2**(s - nb)`` (``s = max(n, nb)``) fits, else in 128-bit integers.  ``other_dtype`` is the
    fused operand's storage (int8 / int16) or None without one.
    """

    def __init__(self, M: torch.Tensor, n: torch.Tensor, lo: int, hi: int, acc_bound: int = 1 << 31,
                 other_dtype: Optional[torch.dtype] = None, Mb: int = 0, nb: int = 0) -> None:
        _check(M, "requant_rows: M", (torch.int64,))
        _check(n, "requant_rows: n", (torch.int64,), tuple(M.shape))
        if M.dim() != 1:
            raise ConfigError(f"requant_rows: M and n must be 1-d (one entry per channel), got {tuple(M.shape)}")
        if not -(1 << 62) < lo <= hi < 1 << 62:
            raise ConfigError(f"requant_rows: bad clamp range [{lo}, {hi}]")
        O = M.numel()
        n_lo, n_hi = (int(n.min()), int(n.max())) if O else (0, 0)
        m_max = int(M.abs().max()) if O else 0
        if n_lo < 0 or n_hi > MAX_SHIFT or (other_dtype is not None and not 0 <= nb <= MAX_SHIFT):
            raise ConfigError(f"requant_rows: shifts must be in [0, {MAX_SHIFT}], got n in [{n_lo}, {n_hi}], nb={nb}")
        if acc_bound * m_max >= INT64_LIMIT:
            raise ConfigError(f"requant_rows: |acc| <= {acc_bound} times M up to {m_max} may reach 2**62")
        self.M, self.n, self.O = M, n, O
        self.lo, self.hi, self.Mb, self.nb, self.other_dtype = int(lo), int(hi), int(Mb), int(nb), other_dtype
        self.wide = 0
        if other_dtype is not None:
            if other_dtype not in _INT:
                raise ConfigError(f"requant_rows: other: dtype {other_dtype} is not one of torch.int8, torch.int16")
            b_bound = 1 << (8 * torch.empty(0, dtype=other_dtype).element_size() - 1)
            if b_bound * abs(Mb) >= INT64_LIMIT:
                raise ConfigError(f"requant_rows: the fused operand's multiplier {Mb} is too large")
            s = max(n_hi, nb)
            self.wide = int(acc_bound * m_max * 2 ** (s - n_lo) + b_bound * abs(Mb) * 2 ** (s - nb) >= INT64_LIMIT)

    def __call__(self, acc: torch.Tensor, out: torch.Tensor, other: Optional[torch.Tensor] = None) -> None:
        """``acc`` (P, O) float32/float64 holding integers within ``acc_bound``; ``out`` (P, O) int8/int16;
        ``other`` (P, O) of ``other_dtype`` when the plan has a fused add (else None)."""
        _check(acc, "requant_rows: acc", _ACC)
        if acc.dim() != 2 or acc.shape[1] != self.O:
            raise ConfigError(f"requant_rows: acc must be (rows, {self.O}), got shape {tuple(acc.shape)}")
        P = acc.shape[0]
        _check(out, "requant_rows: out", _INT, (P, self.O))
        if (other is None) != (self.other_dtype is None):
            raise ConfigError("requant_rows: other must be given exactly when the plan has a fused add")
        if other is None:
            f = _fn(f"qc_requant_{_ACC[acc.dtype]}_{_INT[out.dtype]}", (_P, _I64, _I64, _P, _P, _I64, _I64, _P))
            _ok(f(acc.data_ptr(), P, self.O, self.M.data_ptr(), self.n.data_ptr(), self.lo, self.hi, out.data_ptr()))
            return
        _check(other, "requant_rows: other", (self.other_dtype,), (P, self.O))
        f = _fn(f"qc_requant_add_{_ACC[acc.dtype]}_{_INT[other.dtype]}_{_INT[out.dtype]}",
                (_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int, _P))
        _ok(f(acc.data_ptr(), P, self.O, self.M.data_ptr(), self.n.data_ptr(), other.data_ptr(), self.Mb, self.nb,
              self.lo, self.hi, self.wide, out.data_ptr()))


def requant_rows(acc: torch.Tensor, M: torch.Tensor, n: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
                 other: Optional[torch.Tensor] = None, Mb: int = 0, nb: int = 0, acc_bound: int = 1 << 31) -> None:
    """One-off :class:`Requant`: ``out = clamp(round_half_even(acc * M / 2**n [+ other * Mb / 2**nb]), lo, hi)``
    per channel (the last dim), exactly."""
    if other is not None and not isinstance(other, torch.Tensor):
        raise ConfigError(f"requant_rows: other: expected a tensor, got {type(other).__name__}")
    plan = Requant(M, n, lo, hi, acc_bound, None if other is None else other.dtype, Mb, nb)
    plan(acc, out, other)


def prepared_constants(bias32: Optional[torch.Tensor], M: torch.Tensor, n: torch.Tensor, O: int, add: bool,
                       nb: int) -> torch.Tensor:
    """A layer's per-channel requantization constants as the GEMM and depthwise kernels take them in
    their last argument (``qc_gemm_prep``: ``qc_gemm_prep_bytes(O)`` bytes), built once instead of on
    every call.  ``M``/``n`` int64 contiguous (O,); ``bias32`` int32 (16 * ceil(O / 16),) for the GEMM's
    packed epilogue, None for the depthwise kernel (those tables are then left zero); ``add``/``nb``: a
    fused add and its shift."""
    pre = torch.empty(int(_fn("qc_gemm_prep_bytes", (_I64,), _I64)(O)), dtype=torch.uint8)
    _fn("qc_gemm_prep", (_P, _P, _P, _I64, ctypes.c_int, _I64, _P))(
        None if bias32 is None else bias32.data_ptr(), M.data_ptr(), n.data_ptr(), O, int(add), nb, pre.data_ptr())
    return pre


_QUANT = {torch.int8: ("qc_quantize_i8", -128, 127), torch.int16: ("qc_quantize_i16", -(1 << 15), (1 << 15) - 1)}


def quantize_f32(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out = clamp(round_half_even(x / scale))`` for a contiguous float32 ``x`` and a per-tensor
    float32 ``scale``, into ``out`` (int8 / int16, x's shape): exactly ``fixed_point.quantize`` (one
    pass: the float32 division, rounding half to even, the clamp).  ``out`` is contiguous, or, for a
    4-d ``x``, channels-last (an (N, C, H, W) view of (N, H, W, C) memory, the layout the native convs
    read: the values land there directly).  A NaN in ``x`` is a ConfigError, as there."""
    _check(x, "quantize_f32: x", (torch.float32,))
    nhwc = (x.dim() == 4 and isinstance(out, torch.Tensor) and out.dim() == 4 and not out.is_contiguous()
            and out.is_contiguous(memory_format=torch.channels_last))
    if nhwc:  # checked as the (N, H, W, C) memory it is
        N, C, H, W = x.shape
        _check(out.permute(0, 2, 3, 1), "quantize_f32: out (channels-last)", tuple(_QUANT), (N, H, W, C))
    else:
        _check(out, "quantize_f32: out", tuple(_QUANT), tuple(x.shape))
    s = float(scale)
    if not (math.isfinite(s) and s > 0.0) or float(torch.tensor(s, dtype=torch.float32)) != s:
        raise ConfigError(f"quantize_f32: scale must be a positive finite float32 value, got {scale!r}")
    name, lo, hi = _QUANT[out.dtype]
    if nhwc:
        f = _fn(name.replace("quantize", "quantize_nhwc"),
                (_P, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float, ctypes.c_float, _P))
        bad = f(x.data_ptr(), N, C, H * W, s, float(lo), float(hi), out.data_ptr())
        if bad < 0:
            raise MemoryError("quantize_f32: out of memory for its block buffer")
    else:
        f = _fn(name, (_P, _I64, ctypes.c_float, ctypes.c_float, ctypes.c_float, _P))
        bad = f(x.data_ptr(), x.numel(), s, float(lo), float(hi), out.data_ptr())
    if bad:
        raise ConfigError("quantize: the input contains NaN; it has no integer value")


ABS_SUMS_BLOCK = 1 << 17  # weights widened to int64 at a time by abs_sums (1 MiB)


def abs_sums(w: torch.Tensor, dims: tuple[int, ...] = (1,), signed: bool = False) -> torch.Tensor:
    """``w.to(torch.int64).abs().sum(dims)`` of an integer ``w`` with rows along dim 0, summed over
    ``dims`` (not empty, without 0), exactly, as int64; ``signed``: the plain sum instead of the sum
    of ``|w|``.  Widening a large layer whole cost 8 bytes a weight (16 with the ``abs``: the peak of a
    compile; ``sum(dtype=torch.int64)`` widens its whole input too), so rows are widened
    :data:`ABS_SUMS_BLOCK` weights at a time, each block freed before the next and the sums written
    into one output: small tensors kept between large blocks leave the freed blocks unusable to
    glibc (8 MiB blocks with a list of sums grew the resident set by 227 MiB on a 32 MiB weight)."""
    if w.dtype.is_floating_point or w.dim() < 2 or not dims or any(not 0 < d < w.dim() for d in dims):
        raise ConfigError(f"abs_sums: an integer tensor of rows, summed over dims other than 0; got {w.dtype}, "
                          f"shape {tuple(w.shape)}, dims {dims}")
    out = torch.empty(w.shape[:1] + tuple(d for i, d in enumerate(w.shape) if i and i not in dims),
                      dtype=torch.int64)
    step = max(1, ABS_SUMS_BLOCK // max(1, w[:1].numel()))
    for r in range(0, w.shape[0], step):
        block = w[r:r + step].to(torch.int64, copy=True)  # a copy: abs_ must not touch w
        torch.sum(block if signed else block.abs_(), dims, out=out[r:r + step])
        del block
    return out


def int8_acc_bound(w: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    """``128 * max_o sum |w[o]| + max |bias|`` (``w[o]`` all of output channel o's weights): a bound on
    every |accumulator| of a layer with int8 inputs, which the native kernels keep below 2**31."""
    l1 = int(abs_sums(w, tuple(range(1, w.dim()))).max()) if w.numel() else 0
    return 128 * l1 + (0 if bias is None or not bias.numel() else int(bias.to(torch.int64).abs().max()))


F64_EXACT = 1 << 53  # integers below this are exact in float64


def f64_epilogue(bound: int, M: torch.Tensor, n: torch.Tensor) -> int:
    """Which epilogue of the VNNI kernels is exact for a layer whose |accumulators| are at most ``bound``
    (no fused add): 2 when ``bound * |M[c]| / 2**n[c] < 2**31 - 1`` on every channel as well (float64
    products converted to int32 unclamped, clamped there), 1 when ``bound * max|M| < 2**53`` (float64
    products exact), else 0 (int64)."""
    if not M.numel() or bound * int(M.abs().max()) >= F64_EXACT:
        return 0
    return 2 if all(bound * abs(m) < ((1 << 31) - 1) << s for m, s in zip(M.tolist(), n.tolist())) else 1


class DepthwiseConv:
    """Exact depthwise int8 convolution (one filter per channel) with the requantization fused:
    ``clamp(round_half_even((conv(x, w) + bias) * M[c] / 2**n[c]), lo, hi)``, channels-last.

    ``w`` (C, 1, kh, kw) integer weights within int8, ``bias`` (C,) integers or None, ``M``/``n`` (C,).
    Checked once here: the int32 accumulator cannot wrap (``128 * max_c sum |w_c| + max |bias| < 2**31``)
    and ``|acc| * M`` stays below 2**62, shifts in [0, 62]; a layer outside is a ConfigError (callers
    check the same bounds first).  A call takes ``x`` (N, H, W, C) int8 contiguous and returns (N, Ho, Wo, C).
    """

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor], stride, padding, dilation,
                 M: torch.Tensor, n: torch.Tensor, lo: int, hi: int, out_dtype: torch.dtype,
                 vnni: Optional[bool] = None) -> None:
        C, one, kh, kw = w.shape
        if one != 1:
            raise ConfigError(f"DepthwiseConv: weight must be (C, 1, kh, kw), got {tuple(w.shape)}")
        if out_dtype not in _INT:
            raise ConfigError(f"DepthwiseConv: out_dtype must be torch.int8 or torch.int16, got {out_dtype}")
        self.bound = self.acc_bound(w, bias)
        if self.bound >= 1 << 31:
            raise ConfigError(f"DepthwiseConv: the accumulator bound {self.bound} reaches 2**31")
        if int(w.abs().max()) > 128:
            raise ConfigError("DepthwiseConv: weights must be int8 values")
        info = torch.iinfo(out_dtype)
        if not info.min <= int(lo) <= int(hi) <= info.max:  # the kernels narrow by saturation or by a cast
            raise ConfigError(f"DepthwiseConv: the clamp [{lo}, {hi}] must lie within {out_dtype}'s range "
                              f"[{info.min}, {info.max}]")
        M = M.to(torch.int64).reshape(-1).expand(C).contiguous()
        n = n.to(torch.int64).reshape(-1).expand(C).contiguous()
        self.plan = Requant(M, n, lo, hi, self.bound)  # checks shifts, M and the clamp range
        self.C, self.kh, self.kw = C, kh, kw
        self.w = w.to(torch.int32).reshape(C, kh * kw).t().contiguous()  # (kh*kw, C)
        self.bias = None if bias is None else bias.to(torch.int32).reshape(C).contiguous()
        self.geom = [int(v) for v in (*stride, *padding, *dilation)]
        self.out_dtype = out_dtype
        self._call: Optional[tuple] = None  # (function, weight pointer, bias pointer, constants), on first call
        self._step: Optional[tuple] = None  # (the step builder, constants), on first use
        # AVX512-VNNI (qc_dwconv4_*, gemm_vnni.c): int8 weights in groups of 4 taps of a row, (kh, G, Cp, 4)
        # with G = ceil(kw / 4), Cp = 16 * ceil(C / 16), zeros beyond kw and C; the kernel feeds x + 128 as
        # unsigned bytes, so the bias it starts from is bias - 128 * sum(w) (int32: |.| <= bound < 2**31)
        self.vnni = vnni_enabled() if vnni is None else bool(vnni)
        # the VNNI epilogue multiplies with vpmuldq, which reads only the low 32 bits of M; vpdpbusd
        # multiplies by signed bytes, so a weight of +128 stays on the scalar kernel
        self.vnni = self.vnni and (M.numel() == 0 or int(M.abs().max()) < 1 << 31) and int(w.max()) <= 127
        if self.vnni:
            G, Cp = -(-kw // 4), -(-C // 16) * 16
            w4 = torch.zeros(kh, G * 4, Cp, dtype=torch.int8)
            w4[:, :kw, :C] = w.reshape(C, kh, kw).permute(1, 2, 0)
            self.w4 = w4.view(kh, G, 4, Cp).transpose(2, 3).contiguous()
            b32 = torch.zeros(Cp, dtype=torch.int64)
            if bias is not None:
                b32[:C] = bias.to(torch.int64).reshape(C)
            b32[:C] -= 128 * abs_sums(w.reshape(C, -1), signed=True)
            self.b32 = b32.to(torch.int32)
            # the epilogue of qc_dwconv4_* (gemm_vnni.c): 2 / 1 float64, 0 int64, each where proven exact
            self.epilogue = f64_epilogue(self.bound, M, n)
            # the per-channel constants the kernel would otherwise build on every call, in every part of a
            # split one and for every sample: qc_gemm_prep, once (bias32 NULL: the GEMM's packed-epilogue
            # tables, which this kernel does not read, are left zero)
            self._pre = prepared_constants(None, self.plan.M, self.plan.n, C, False, 0)

    acc_bound = staticmethod(int8_acc_bound)

    def out_size(self, H: int, W: int) -> tuple[int, int]:
        sh, sw, ph, pw, dh, dw = self.geom
        return (H + 2 * ph - dh * (self.kh - 1) - 1) // sh + 1, (W + 2 * pw - dw * (self.kw - 1) - 1) // sw + 1

    def _geometry(self, x: torch.Tensor) -> tuple[int, int, int, int, int, int]:
        _check(x, "DepthwiseConv: x", (torch.int8,))
        if x.dim() != 4 or x.shape[3] != self.C:
            raise ConfigError(f"DepthwiseConv: x must be (N, H, W, {self.C}) channels-last, got {tuple(x.shape)}")
        N, H, W, C = x.shape
        Ho, Wo = self.out_size(H, W)
        if Ho <= 0 or Wo <= 0:
            raise ConfigError(f"DepthwiseConv: input {H}x{W} is smaller than the kernel")
        return N, H, W, C, Ho, Wo

    def step(self, x: torch.Tensor, out: torch.Tensor) -> Optional[StepSpec]:
        """The call as a plan step (:class:`~qcompiler.backends.bpu.native.plan.NativeSteps`) writing ``out``
        ((N, Ho, Wo, C) contiguous of the output type), or None off the VNNI path (the scalar
        kernel has no step form: the caller calls it)."""
        N, H, W, C, Ho, Wo = self._geometry(x)
        _check(out, "DepthwiseConv: out", (self.out_dtype,), (N, Ho, Wo, C))
        if not self.vnni:
            return None
        if self._step is None:
            p = self.plan
            args = ((_P, _P, _P) + (_I64,) * 4 + (_P, _I64, _I64, _P) + (_I64,) * 8
                    + (_P, _P, _I64, _I64, ctypes.c_int, _P, _P))
            self._step = _fn(f"qc_dwconv4_i8_{_INT[self.out_dtype]}_step", args), (p.M.data_ptr(), p.n.data_ptr(),
                                                                                   p.lo, p.hi, self.epilogue)
        f, consts = self._step
        return StepSpec(f, (x.data_ptr(), N, H, W, C, self.w4.data_ptr(), self.kh, self.kw, self.b32.data_ptr(),
                            *self.geom, Ho, Wo, *consts, out.data_ptr(), self._pre.data_ptr()), (self, x, out))

    def __call__(self, x: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """``parts > 1``: on the VNNI path, the N * Ho output rows are split over that many native
        threads (the caller's included; disjoint rows of the same computation, so the same bits)."""
        N, H, W, C, Ho, Wo = self._geometry(x)
        out = torch.empty((N, Ho, Wo, C), dtype=self.out_dtype)
        if self._call is None:  # the function and the constant arguments, once
            p = self.plan
            args = (_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P) + (_I64,) * 8 + (_P, _P, _I64, _I64)
            consts = (p.M.data_ptr(), p.n.data_ptr(), p.lo, p.hi)
            if self.vnni:
                name = f"qc_dwconv4_i8_{_INT[self.out_dtype]}"
                self._call = (_fn(name, args + (ctypes.c_int, _P, _P)), self.w4.data_ptr(), self.b32.data_ptr(),
                              consts + (self.epilogue,))
                self._call_mt = _fn(name + "_mt", args + (ctypes.c_int, _P, _P, ctypes.c_int))
            else:
                bptr = None if self.bias is None else self.bias.data_ptr()
                self._call = (_fn(f"qc_dwconv_i8_{_INT[self.out_dtype]}", args + (_P,)), self.w.data_ptr(), bptr,
                              consts)
        f, wptr, bptr, consts = self._call
        if self.vnni:
            pre = self._pre.data_ptr()
            if parts > 1:
                _ok(self._call_mt(x.data_ptr(), N, H, W, C, wptr, self.kh, self.kw, bptr, *self.geom, Ho, Wo,
                                  *consts, out.data_ptr(), pre, int(parts)))
            else:
                _ok(f(x.data_ptr(), N, H, W, C, wptr, self.kh, self.kw, bptr, *self.geom, Ho, Wo, *consts,
                      out.data_ptr(), pre))
            return out
        _ok(f(x.data_ptr(), N, H, W, C, wptr, self.kh, self.kw, bptr, *self.geom, Ho, Wo, *consts, out.data_ptr()))
        return out


def requant_columns(src: torch.Tensor, dst: torch.Tensor, col0: int, M: int, n: int, lo: int, hi: int) -> None:
    """``dst[:, col0:col0 + cols] = clamp(round_half_even(src * M / 2**n), lo, hi)``, exactly (int64):
    one input of a concatenation written into its columns.  ``src`` (rows, cols) and ``dst``
    (rows, total) int8/int16, contiguous; ``M``/``n`` integers with ``n`` in [0, 62] and
    ``|src| * |M| < 2**62``."""
    _check(src, "requant_columns: src", _INT)
    _check(dst, "requant_columns: dst", _INT)
    if src.dim() != 2 or dst.dim() != 2 or src.shape[0] != dst.shape[0] or not 0 <= col0 <= dst.shape[1] - src.shape[1]:
        raise ConfigError(f"requant_columns: src {tuple(src.shape)} does not fit dst {tuple(dst.shape)} at column {col0}")
    M, n = int(M), int(n)
    if not 0 <= n <= MAX_SHIFT or (1 << (8 * src.element_size() - 1)) * abs(M) >= INT64_LIMIT:
        raise ConfigError(f"requant_columns: multiplier {M} / shift {n} out of range")
    if not -(1 << 62) < lo <= hi < 1 << 62:
        raise ConfigError(f"requant_columns: bad clamp range [{lo}, {hi}]")
    f = _fn(f"qc_cat_{_INT[src.dtype]}_{_INT[dst.dtype]}", (_P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64), None)
    rows, cols = src.shape
    f(src.data_ptr(), rows, cols, dst.data_ptr() + col0 * dst.element_size(), dst.shape[1], M, n, lo, hi)


TAP_BITS = 7  # bilinear_taps: weights are integers over 2**TAP_BITS (the int32 kernel's |Y| <= 2**15 * 2**14)
_F64_TINY = 2.0 ** -1022


def bilinear_taps(n_in: int, n_out: int, align_corners: bool,
                  bits: int = TAP_BITS) -> Optional[tuple[torch.Tensor, ...]]:
    """The taps of one axis of torch's bilinear resize (``F.interpolate(size=...)``, no scale factor),
    as integers: ``(i0, i1, a0, a1)`` int32 tensors of length ``n_out`` with ``a0 + a1 = 2**bits``,
    so that output ``o`` is ``(a0[o] * x[i0[o]] + a1[o] * x[i1[o]]) / 2**bits`` exactly; or None when
    some weight is not a multiple of ``2**-bits`` (then torch's float64 weights are rounded and only
    torch reproduces its own result).

    Mirrors ATen's ``area_pixel_compute_scale`` / ``area_pixel_compute_source_index`` /
    ``compute_source_index_and_lambda`` in exact rationals: ``scale = (in-1)/(out-1)`` (align_corners,
    0 for one output) or ``in/out``; ``real = scale*o`` or ``max(scale*(o+1/2) - 1/2, 0)``; ``i0 =
    floor(real)``, ``i1 = i0 + 1`` below the last input, ``lambda1 = real - i0``; equal sizes copy.
    When the scale is a dyadic rational with a small denominator every one of these float64 steps
    is exact, so the rationals here are torch's float64 values (the property tests check it).

    One step is not float64: ATen takes the floor of ``real`` converted to float32 (and clamps
    ``lambda1`` to [0, 1]).  ``real`` is a multiple of ``2**-bits`` below ``n_in``, so the conversion
    is exact only while ``n_in * 2**bits <= 2**24``; a longer axis (over 131072 elements at 7 bits)
    could round ``real`` up to the next integer and move the tap, so it is refused."""
    if n_in <= 0 or n_out <= 0 or n_in > 1 << (24 - bits) or n_out >= 1 << 24:
        return None
    one = 1 << bits
    o = list(range(n_out))
    if n_in == n_out:
        i0, l1 = o, [Fraction(0)] * n_out
    else:
        if align_corners:
            scale = Fraction(n_in - 1, n_out - 1) if n_out > 1 else Fraction(0)
            real = [scale * k for k in o]
        else:
            scale = Fraction(n_in, n_out)
            real = [max(scale * (2 * k + 1) / 2 - Fraction(1, 2), Fraction(0)) for k in o]
        if scale.denominator & (scale.denominator - 1) or scale.denominator > one:  # not a dyadic p / 2**j
            return None
        i0 = [r.numerator // r.denominator for r in real]
        l1 = [r - i for r, i in zip(real, i0)]
    if any((l * one).denominator != 1 for l in l1):
        return None
    a1 = [int(l * one) for l in l1]
    i1 = [i + 1 if i < n_in - 1 else i for i in i0]
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_t(i0), as_t(i1), as_t([one - a for a in a1]), as_t(a1)


class BilinearResize:
    """Exact bilinear resize of int8/int16 values with torch's weights, rescaled and rounded:
    ``clamp(round_half_even(fl(bilinear(x) * ratio)), lo, hi)`` -- bit for bit what
    ``torch.round(F.interpolate(x.double(), size, mode="bilinear", align_corners=...) * ratio)
    .clamp(lo, hi)`` computes, for the input sizes whose taps are exact dyadics (:meth:`exact_for`).

    Why it is exact: with weights ``a/2**7`` (:func:`bilinear_taps`) every float64 step of torch's
    kernel (weights, products with integers below 2**15, sums of four) is exact whatever its order,
    so torch's float64 value is the rational ``Y / 2**14`` the C kernel computes as an int32 ``Y``.
    ``fl(Y * (ratio / 2**14))`` is then the same correctly rounded product as torch's
    ``fl(y * ratio)`` (``ratio / 2**14`` is exact: checked normal), clamped and rounded half to even.
    A call takes (N, C, H, W) int8/int16: channels-last memory gives channels-last output, memory
    whose H x W planes are contiguous (NCHW, or the simulator's C,N,H,W) gives contiguous NCHW,
    as torch's result."""

    def __init__(self, size, align_corners: bool, ratio: float, lo: int, hi: int, out_dtype: torch.dtype) -> None:
        if out_dtype not in _INT:
            raise ConfigError(f"BilinearResize: out_dtype must be torch.int8 or torch.int16, got {out_dtype}")
        if not -(1 << 31) <= lo <= hi < 1 << 31:
            raise ConfigError(f"BilinearResize: bad clamp range [{lo}, {hi}]")
        ratio = float(ratio)
        if not (math.isfinite(ratio) and ratio > 0):
            raise ConfigError(f"BilinearResize: ratio must be positive and finite, got {ratio}")
        self.Ho, self.Wo = (int(s) for s in size)
        self.align_corners, self.ratio, self.lo, self.hi, self.out_dtype = bool(align_corners), ratio, int(lo), int(hi), out_dtype
        self.rD = math.ldexp(ratio, -2 * TAP_BITS)
        self.scalable = self.rD >= _F64_TINY  # ratio / 2**14 exact (a normal number)
        self._taps: dict[tuple[int, int], Optional[tuple]] = {}

    def _axis(self, n_in: int, n_out: int) -> Optional[tuple]:
        key = (n_in, n_out)
        if key not in self._taps:
            self._taps[key] = bilinear_taps(n_in, n_out, self.align_corners)
        return self._taps[key]

    def exact_for(self, x: torch.Tensor) -> bool:
        """Whether :meth:`__call__` reproduces the reference on ``x``: int8/int16, 4-d, non-empty,
        a supported layout, and exact taps for its sizes."""
        return (self.scalable and isinstance(x, torch.Tensor) and x.dtype in _INT and x.dim() == 4
                and x.numel() > 0 and x.device.type == "cpu" and self._layout(x) is not None
                and self._axis(x.shape[2], self.Ho) is not None and self._axis(x.shape[3], self.Wo) is not None)

    @staticmethod
    def _layout(x: torch.Tensor) -> Optional[str]:
        H, W = x.shape[2:]
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            return "nhwc"
        if (W == 1 or x.stride(3) == 1) and (H == 1 or x.stride(2) == W):
            return "planes"
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.exact_for(x):
            raise ConfigError(f"BilinearResize: input {tuple(x.shape)} {x.dtype} (strides {x.stride()}) is not "
                              f"one this kernel reproduces exactly; check exact_for() first")
        N, C, H, W = x.shape
        Ho, Wo = self.Ho, self.Wo
        rows, cols = self._axis(H, Ho), self._axis(W, Wo)
        tail = (self.rD, self.lo, self.hi)
        kind = f"{_INT[x.dtype]}_{_INT[self.out_dtype]}"
        if self._layout(x) == "nhwc":
            out = torch.empty((N, Ho, Wo, C), dtype=self.out_dtype)
            f = _fn(f"qc_resize_nhwc_{kind}", (_P,) + (_I64,) * 6 + (_P,) * 8 + (_F64, _I64, _I64, _P))
            rc = f(x.data_ptr(), N, H, W, C, Ho, Wo, *(t.data_ptr() for t in rows + cols), *tail, out.data_ptr())
            result = out.permute(0, 3, 1, 2)
        else:
            out = torch.empty((N, C, Ho, Wo), dtype=self.out_dtype)
            sn = x.stride(0) if N > 1 else 0
            sc = x.stride(1) if C > 1 else 0
            f = _fn(f"qc_resize_planes_{kind}", (_P,) + (_I64,) * 8 + (_P,) * 8 + (_F64, _I64, _I64, _P))
            rc = f(x.data_ptr(), N, C, sn, sc, H, W, Ho, Wo, *(t.data_ptr() for t in rows + cols), *tail,
                   out.data_ptr())
            result = out
        if rc != 0:
            raise MemoryError("BilinearResize: out of memory for its row buffer")
        return result

    def step(self, x: torch.Tensor, out: torch.Tensor) -> Optional[StepSpec]:
        """The call as a plan step (:class:`~qcompiler.backends.bpu.native.plan.NativeSteps`) writing ``out``, an
        (N, C, Ho, Wo) view of (N, Ho, Wo, C) memory of the output type (what :meth:`__call__` returns
        for ``x``), when :meth:`__call__` would make one ``qc_resize_nhwc_*`` call on ``x`` as it lies
        (exact taps, channels-last memory); else None.  Its rows are the N * Ho output rows."""
        if not self.exact_for(x) or self._layout(x) != "nhwc":
            return None
        N, C, H, W = x.shape
        if not (isinstance(out, torch.Tensor) and out.dtype == self.out_dtype and out.shape == (N, C, self.Ho, self.Wo)
                and out.device.type == "cpu" and out.permute(0, 2, 3, 1).is_contiguous()):
            raise ConfigError(f"BilinearResize: out must be an (N, C, Ho, Wo) {self.out_dtype} tensor in "
                              f"channels-last memory, got {tuple(out.shape)} {out.dtype}")
        rows, cols = self._axis(H, self.Ho), self._axis(W, self.Wo)
        kind = f"{_INT[x.dtype]}_{_INT[self.out_dtype]}"
        f = _fn(f"qc_resize_nhwc_{kind}_step", (_P, _P, _P) + (_I64,) * 6 + (_P,) * 8 + (_F64, _I64, _I64, _P))
        return StepSpec(f, (x.data_ptr(), N, H, W, C, self.Ho, self.Wo, *(t.data_ptr() for t in rows + cols),
                            self.rD, self.lo, self.hi, out.data_ptr()), (self, x, out, rows, cols))


def _requant_all(q: torch.Tensor, M: int, n: int, lo: int, hi: int) -> torch.Tensor:
    """``clamp(round_half_even(q * M / 2**n), lo, hi)`` in int64 (Python-sized M and n; small q)."""
    x = q * M
    if n == 0:
        return x.clamp(lo, hi)
    return ((x + ((1 << (n - 1)) - 1) + ((x >> n) & 1)) >> n).clamp(lo, hi)


def int32_requant(M: int, n: int, in_dtype: torch.dtype, lo: int, hi: int) -> Optional[tuple[int, int]]:
    """A multiplier and shift ``(M32, n32)`` for int32 arithmetic (:func:`requant_columns32`) that
    requantize every value of ``in_dtype`` (int8/int16) exactly as ``(M, n)`` does, or None.

    ``clamp(round_half_even(q * M / 2**n), lo, hi)`` is a function of ``q`` alone, so a narrower
    multiplier ``M32 ~ M * 2**(n32 - n)`` is proven equal by evaluating both on the whole input type
    (256 or 65536 values) -- a proof by exhaustion.  ``n32`` is the largest shift whose products and
    rounding addend stay below 2**31 (``max|q| * |M32| + 2**(n32-1) < 2**31``), then a few smaller."""
    if in_dtype not in _INT:
        return None
    M, n = int(M), int(n)
    info = torch.iinfo(in_dtype)
    amax = -info.min
    q = torch.arange(info.min, info.max + 1, dtype=torch.int64)
    want = _requant_all(q, M, n, lo, hi)
    if M == 0:
        return (0, 0)
    tried = 0
    for n32 in range(30, -1, -1):
        m32 = round(Fraction(M, 1 << n) * (1 << n32)) if n32 < n else M << (n32 - n)
        if amax * abs(m32) + (1 << n32 >> 1) >= 1 << 31:
            continue
        if torch.equal(_requant_all(q, m32, n32, lo, hi), want):
            return (int(m32), n32)
        tried += 1
        if tried == 3:
            break
    return None


def requant_columns32(src: torch.Tensor, dst: torch.Tensor, col0: int, M32: int, n32: int, lo: int, hi: int) -> None:
    """:func:`requant_columns` in int32 arithmetic, for the ``(M32, n32)`` that :func:`int32_requant`
    proved equal to the int64 parameters on every value of ``src``'s type."""
    _check(src, "requant_columns32: src", _INT)
    _check(dst, "requant_columns32: dst", _INT)
    if src.dim() != 2 or dst.dim() != 2 or src.shape[0] != dst.shape[0] or not 0 <= col0 <= dst.shape[1] - src.shape[1]:
        raise ConfigError(f"requant_columns32: src {tuple(src.shape)} does not fit dst {tuple(dst.shape)} at column {col0}")
    M32, n32 = int(M32), int(n32)
    amax = 1 << (8 * src.element_size() - 1)
    if not 0 <= n32 <= 30 or amax * abs(M32) + (1 << n32 >> 1) >= 1 << 31:
        raise ConfigError(f"requant_columns32: multiplier {M32} / shift {n32} do not fit int32 for {src.dtype}")
    if not -(1 << 31) <= lo <= hi < 1 << 31:
        raise ConfigError(f"requant_columns32: bad clamp range [{lo}, {hi}]")
    f = _fn(f"qc_cat32_{_INT[src.dtype]}_{_INT[dst.dtype]}", (_P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64), None)
    rows, cols = src.shape
    f(src.data_ptr(), rows, cols, dst.data_ptr() + col0 * dst.element_size(), dst.shape[1], M32, n32, lo, hi)


def requant_columns_step(srcs, dst: torch.Tensor, params, lo: int, hi: int) -> StepSpec:
    """A whole concatenation as one plan step: ``srcs[i]`` (rows, cols_i) requantized into its
    columns of ``dst`` (rows, sum of cols_i), side by side in order, by the pass the direct calls use:
    ``params[i] = (M, n, None)`` for :func:`requant_columns`, ``(M32, n32, True)`` for
    :func:`requant_columns32` (the int32 parameters :func:`int32_requant` proved equal).  The same
    checks as those calls; the step's rows are dst's rows, every input per row."""
    _check(dst, "requant_columns_step: dst", _INT)
    if dst.dim() != 2 or not srcs or len(params) != len(srcs):
        raise ConfigError(f"requant_columns_step: dst {tuple(dst.shape)} must be (rows, cols), with one "
                          f"(M, n, int32) per input ({len(srcs)} inputs, {len(params)} parameters)")
    rows, kinds, col = dst.shape[0], [], 0
    for i, (src, (M, n, int32)) in enumerate(zip(srcs, params)):
        _check(src, f"requant_columns_step: input {i}", _INT)
        if src.dim() != 2 or src.shape[0] != rows:
            raise ConfigError(f"requant_columns_step: input {i} {tuple(src.shape)} does not fit dst {tuple(dst.shape)}")
        M, n, amax = int(M), int(n), 1 << (8 * src.element_size() - 1)
        fits32 = 0 <= n <= 30 and amax * abs(M) + (1 << n >> 1) < 1 << 31 and -(1 << 31) <= lo <= hi < 1 << 31
        if int32 and not fits32:
            raise ConfigError(f"requant_columns_step: input {i}: multiplier {M} / shift {n} do not fit int32")
        if not int32 and not (0 <= n <= MAX_SHIFT and amax * abs(M) < INT64_LIMIT and -(1 << 62) < lo <= hi < 1 << 62):
            raise ConfigError(f"requant_columns_step: input {i}: multiplier {M} / shift {n} out of range")
        kinds.append(2 * (src.dtype == torch.int16) + bool(int32))
        col += src.shape[1]
    if col != dst.shape[1]:
        raise ConfigError(f"requant_columns_step: the inputs' {col} columns do not fill dst {tuple(dst.shape)}")
    table = torch.tensor([[s.data_ptr() for s in srcs], [s.shape[1] for s in srcs], [int(p[0]) for p in params],
                          [int(p[1]) for p in params], kinds], dtype=torch.int64)
    f = _fn(f"qc_cat_{_INT[dst.dtype]}_step", (_P, _P, _I64) + (_P,) * 5 + (_I64,) * 3 + (_P, _I64))
    return StepSpec(f, (len(srcs), *(table[j].data_ptr() for j in range(5)), rows, int(lo), int(hi), dst.data_ptr(),
                        dst.shape[1]), (table, dst, *srcs))


def nearest_taps(n_in: int, n_out: int) -> torch.Tensor:
    """The source index of each of ``n_out`` positions along one axis of torch's nearest resize
    (``F.interpolate(size=..., mode="nearest")``), as int32: read off torch's own resize of the
    indices ``0..n_in-1`` (float64, exact), so they are torch's whatever its rule."""
    idx = torch.arange(n_in, dtype=torch.float64).view(1, 1, n_in, 1)
    src = torch.nn.functional.interpolate(idx, size=(n_out, 1), mode="nearest")
    return src.reshape(n_out).to(torch.int32)


def nearest_nhwc_step(x: torch.Tensor, hs: torch.Tensor, ws: torch.Tensor, ratio: Optional[float], lo: int, hi: int,
                      out: torch.Tensor) -> StepSpec:
    """A plan step of the nearest resize of channels-last ``x`` (an (N, C, H, W) view of (N, H, W, C)
    memory, int8/int16) into ``out`` (an (N, C, Ho, Wo) view of (N, Ho, Wo, C) memory, int8/int16):
    ``out[n, c, oh, ow] = r(x[n, c, hs[oh], ws[ow]])`` with r a copy (``ratio`` None: same dtype) or
    ``clamp(round_half_even(float64(q) * ratio), lo, hi)``.  ``hs`` / ``ws``: int32 source indices
    (:func:`nearest_taps`).  Its rows are the N * Ho output rows."""
    for t, what in ((x, "x"), (out, "out")):
        if not (isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype in _INT and t.device.type == "cpu"
                and t.permute(0, 2, 3, 1).is_contiguous()):
            raise ConfigError(f"nearest_nhwc_step: {what} must be a 4-d int8/int16 CPU tensor in channels-last memory")
    N, C, H, W = x.shape
    Ho, Wo = out.shape[2:]
    if out.shape[:2] != x.shape[:2] or hs.dtype != torch.int32 or ws.dtype != torch.int32 \
            or tuple(hs.shape) != (Ho,) or tuple(ws.shape) != (Wo,) or not (hs.is_contiguous() and ws.is_contiguous()):
        raise ConfigError(f"nearest_nhwc_step: x {tuple(x.shape)}, out {tuple(out.shape)} and the int32 indices "
                          f"({tuple(hs.shape)}, {tuple(ws.shape)}) do not fit")
    if (Ho and (int(hs.min()) < 0 or int(hs.max()) >= H)) or (Wo and (int(ws.min()) < 0 or int(ws.max()) >= W)):
        raise ConfigError(f"nearest_nhwc_step: a source index lies outside the input's {H}x{W}")
    if ratio is None and x.dtype != out.dtype:
        raise ConfigError(f"nearest_nhwc_step: a copy needs one dtype, got {x.dtype} into {out.dtype}")
    if ratio is not None and not (math.isfinite(ratio) and ratio > 0 and -(1 << 31) <= lo <= hi < 1 << 31):
        raise ConfigError(f"nearest_nhwc_step: bad ratio {ratio} or clamp range [{lo}, {hi}]")
    f = _fn(f"qc_nearest_nhwc_{_INT[x.dtype]}_{_INT[out.dtype]}_step",
            (_P, _P, _P) + (_I64,) * 6 + (_P, _P, _I64, _F64, _I64, _I64, _P))
    return StepSpec(f, (x.data_ptr(), N, H, W, C, Ho, Wo, hs.data_ptr(), ws.data_ptr(), int(ratio is None),
                        1.0 if ratio is None else float(ratio), int(lo), int(hi), out.data_ptr()), (x, out, hs, ws))


def max_pool_nhwc(x: torch.Tensor, kernel, stride, padding, dilation, out_hw) -> torch.Tensor:
    """Integer max pool of channels-last ``x`` (an (N, C, H, W) view of (N, H, W, C) memory, int8/int16):
    the maximum of each window's taps inside the input, the type's minimum where a window had none
    (as a minimum-padded copy gives).  Returns (N, C, Ho, Wo) in channels-last memory, the layout the
    native GEMM convs read and write.  ``out_hw`` is the caller's (Ho, Wo) (torch's output size rule,
    ceil mode included)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _INT or x.device.type != "cpu" \
            or not x.is_contiguous(memory_format=torch.channels_last):
        raise ConfigError("max_pool_nhwc: x must be a 4-d int8/int16 CPU tensor in channels-last memory")
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (tuple(int(v) for v in p) for p in (kernel, stride, padding, dilation))
    Ho, Wo = (int(v) for v in out_hw)
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0 or min(Ho, Wo) < 0:
        raise ConfigError(f"max_pool_nhwc: bad geometry kernel {kernel}, stride {stride}, padding {padding}, "
                          f"dilation {dilation}, output {out_hw}")
    N, C, H, W = x.shape
    out = torch.empty((N, Ho, Wo, C), dtype=x.dtype)
    if out.numel():
        f = _fn(f"qc_maxpool_nhwc_{_INT[x.dtype]}", (_P,) + (_I64,) * 14 + (_P,))
        _ok(f(x.data_ptr(), N, H, W, C, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo, out.data_ptr()))
    return out.permute(0, 3, 1, 2)


def max_pool_nhwc_step(x: torch.Tensor, kernel, stride, padding, dilation, out: torch.Tensor) -> StepSpec:
    """:func:`max_pool_nhwc` as a plan step writing ``out``, an (N, C, Ho, Wo) view of (N, Ho, Wo, C)
    memory of ``x``'s dtype (what :func:`max_pool_nhwc` returns)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _INT or x.device.type != "cpu" \
            or not x.is_contiguous(memory_format=torch.channels_last):
        raise ConfigError("max_pool_nhwc: x must be a 4-d int8/int16 CPU tensor in channels-last memory")
    N, C, H, W = x.shape
    if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or out.dim() != 4 or out.shape[:2] != x.shape[:2] \
            or not out.is_contiguous(memory_format=torch.channels_last):
        raise ConfigError(f"max_pool_nhwc: out must be an (N, C, Ho, Wo) {x.dtype} tensor in channels-last memory")
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (tuple(int(v) for v in p) for p in (kernel, stride, padding, dilation))
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ConfigError(f"max_pool_nhwc: bad geometry kernel {kernel}, stride {stride}, padding {padding}, "
                          f"dilation {dilation}")
    Ho, Wo = out.shape[2], out.shape[3]
    f = _fn(f"qc_maxpool_nhwc_{_INT[x.dtype]}_step", (_P, _P, _P) + (_I64,) * 14 + (_P,))
    return StepSpec(f, (x.data_ptr(), N, H, W, C, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo, out.data_ptr()), (x, out))


def _gap_args(x: torch.Tensor, M: int, n: int, lo: int, hi: int, out: torch.Tensor, what: str) -> tuple:
    """The checked arguments of ``qc_gap_nhwc_*``: the pointers and sizes, after the proofs the C
    kernel relies on (int32 sums, an int64 product)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _INT or x.device.type != "cpu" \
            or not x.is_contiguous(memory_format=torch.channels_last):
        raise ConfigError(f"{what}: x must be a 4-d int8/int16 CPU tensor in channels-last memory")
    N, C, H, W = x.shape
    _check(out, f"{what}: out", _INT, (N, C))
    M, n, lo, hi, P = int(M), int(n), int(lo), int(hi), H * W
    bound = (1 << (8 * x.element_size() - 1)) * P  # the largest |sum|
    if bound >= 1 << 31:
        raise ConfigError(f"{what}: {P} positions of {x.dtype} may sum past int32; the caller checks first")
    if not 0 <= n <= MAX_SHIFT or bound * abs(M) >= INT64_LIMIT:
        raise ConfigError(f"{what}: multiplier {M} / shift {n} do not fit int64 for sums up to {bound}")
    info = torch.iinfo(out.dtype)
    if not info.min <= lo <= hi <= info.max:
        raise ConfigError(f"{what}: clamp range [{lo}, {hi}] is not within {out.dtype}")
    return (x.data_ptr(), N, P, C, M, n, lo, hi, out.data_ptr())


def global_avg_pool_nhwc(x: torch.Tensor, M: int, n: int, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
    """Global average pool of channels-last ``x`` (an (N, C, H, W) view of (N, H, W, C) int8/int16
    memory) into ``out`` ((N, C) int8/int16, contiguous): ``out[b, c] = clamp(round_half_even(s * M /
    2**n), lo, hi)`` with ``s`` the exact sum of the sample's H * W values of channel c (what
    :class:`Requant` does to those sums).  Needs ``128 (32768 for int16) * H * W < 2**31`` and that
    bound times ``|M|`` below 2**62 (else :class:`~qcompiler.errors.ConfigError`).  Returns ``out``."""
    args = _gap_args(x, M, n, lo, hi, out, "global_avg_pool_nhwc")
    if out.numel():
        f = _fn(f"qc_gap_nhwc_{_INT[x.dtype]}_{_INT[out.dtype]}", (_P,) + (_I64,) * 7 + (_P,))
        _ok(f(*args))
    return out


def global_avg_pool_nhwc_step(x: torch.Tensor, M: int, n: int, lo: int, hi: int, out: torch.Tensor) -> StepSpec:
    """:func:`global_avg_pool_nhwc` as a plan step writing ``out`` (its rows: the samples)."""
    args = _gap_args(x, M, n, lo, hi, out, "global_avg_pool_nhwc")
    f = _fn(f"qc_gap_nhwc_{_INT[x.dtype]}_{_INT[out.dtype]}_step", (_P, _P, _P) + (_I64,) * 7 + (_P,))
    return StepSpec(f, args, (x, out))
