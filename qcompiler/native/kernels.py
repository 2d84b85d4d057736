"""Typed entry points of the native kernels (``kernels.c``), called on tensors' ``data_ptr()``.

Each wrapper checks dtypes, contiguity and sizes before handing raw pointers to C, and raises
:class:`~qcompiler.errors.ConfigError` naming the argument on misuse (a wrong pointer would
be a crash or a silent wrong answer).  ``None`` from :func:`requant_rows` / :func:`histogram_abs`
never happens: callers ask :func:`~qcompiler.native.build.native_enabled` first and keep their
torch path otherwise.

The C kernels hold no state and write only their output buffers; ctypes releases the GIL
around each call, so several threads may run them at once.
"""

from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from qcompiler.errors import ConfigError
from qcompiler.native.build import library

__all__ = ["Requant", "DepthwiseConv", "requant_columns", "requant_rows", "histogram_abs", "histogram_abs_minmax", "rows_minmax", "FUSED_MAX", "MAX_SHIFT", "INT64_LIMIT"]

MAX_SHIFT = 62
INT64_LIMIT = 1 << 62  # |products| and the fused sum stay below this in the int64 kernel

_I64, _F64 = ctypes.c_int64, ctypes.c_double
_P = ctypes.c_void_p
_ACC = {torch.float32: "f32", torch.float64: "f64"}
_INT = {torch.int8: "i8", torch.int16: "i16"}
_FNS: dict[tuple[int, str], object] = {}  # (id of the library, name) -> the typed function


def _fn(name: str, argtypes: tuple, restype=ctypes.c_int):
    lib = library()
    if lib is None:
        raise ConfigError(f"native kernel {name}: the native kernels are off; check native_enabled() first")
    f = _FNS.get((id(lib), name))
    if f is None:
        f = getattr(lib, name)
        f.argtypes, f.restype = list(argtypes), restype
        _FNS[(id(lib), name)] = f
    return f


def _ok(rc: int) -> None:
    if rc != 0:
        raise MemoryError("native requantization: out of memory for its per-channel tables")


def _check(t: torch.Tensor, what: str, dtypes, shape: Optional[tuple] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ConfigError(f"{what}: dtype {t.dtype} is not one of {', '.join(str(d) for d in dtypes)}")
    if t.device.type != "cpu":
        raise ConfigError(f"{what}: must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        raise ConfigError(f"{what}: must be contiguous (row-major); call .contiguous() first")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ConfigError(f"{what}: shape {tuple(t.shape)} does not match {tuple(shape)}")


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


_F32_TINY, _F32_HUGE = 2.0 ** -126, 2.0 ** 127  # the normal float32 powers of two


FUSED_MAX = 1 << 30  # histogram_abs_minmax: up to this many values (one uint32 chunk: all or nothing)
HIST_MAX_THREADS = 64  # qc_hist_abs_f32_mt's cap


def _histogram_call(x: torch.Tensor, per_unit: float, hist: torch.Tensor, mm: Optional[torch.Tensor],
                    threads: int) -> int:
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ConfigError(f"histogram_abs: threads must be a positive int, got {threads!r}")
    _check(x, "histogram_abs: x", (torch.float32,))
    _check(hist, "histogram_abs: hist", (torch.float64,))
    if hist.dim() != 1 or not hist.numel():
        raise ConfigError(f"histogram_abs: hist must be a non-empty 1-d tensor, got shape {tuple(hist.shape)}")
    if not per_unit > 0.0 or not math.isfinite(per_unit):
        raise ConfigError(f"histogram_abs: per_unit must be positive and finite, got {per_unit}")
    nbins = hist.numel()
    f32 = math.frexp(per_unit)[0] == 0.5 and _F32_TINY <= per_unit <= _F32_HUGE
    f = _fn("qc_hist_abs_f32_mt", (_P, _I64, _F64, ctypes.c_int, _I64, _P, _P, ctypes.c_int))
    rc = f(x.data_ptr(), x.numel(), float(per_unit), int(f32), nbins, hist.data_ptr(),
           None if mm is None else mm.data_ptr(), min(threads, HIST_MAX_THREADS))
    if rc == -1:
        raise MemoryError("histogram_abs: out of memory for the counters (or a thread could not be started)")
    return rc


def histogram_abs(x: torch.Tensor, per_unit: float, hist: torch.Tensor, threads: int = 1) -> None:
    """``hist[floor(|x| * per_unit)] += 1`` for every float32 value of ``x`` (contiguous): exactly
    ``torch.bincount`` of the floor of the exact product, added to the float64 ``hist`` (1-d, contiguous).

    The caller guarantees ``|x| * per_unit < hist.numel()`` and no NaN (the observer's range and
    finite check; a value outside is a ConfigError, never counted); ``per_unit`` must be positive.  A power
    of-two ``per_unit`` in the normal float32 range is applied in float32 (exact), any other in
    float64 (exact: 24 + 21 bits).

    ``threads`` > 1 splits the values into that many contiguous parts binned at once on native
    threads, each into its own partial histogram; the partials are integer counts, so their sum
    is bit for bit the one-thread result (any split).
    """
    if _histogram_call(x, per_unit, hist, None, threads) == -2:
        raise ConfigError(f"histogram_abs: a value of x is NaN or at least the range ({hist.numel()} / {per_unit}); "
                          f"the caller must widen the range first")


def histogram_abs_minmax(x: torch.Tensor, per_unit: float, hist: torch.Tensor,
                         threads: int = 1) -> Optional[tuple[float, float]]:
    """:func:`histogram_abs` and ``(min(x), max(x))`` in one pass, when every ``|x| * per_unit`` is
    below ``hist.numel()`` and no value is NaN; otherwise None and ``hist`` is unchanged (the caller
    computes the range and bins again).  At most :data:`FUSED_MAX` values.  ``threads`` as in
    :func:`histogram_abs` (the min/max of the parts are combined: the same result)."""
    if x.numel() > FUSED_MAX:
        raise ConfigError(f"histogram_abs_minmax: at most {FUSED_MAX} values, got {x.numel()}")
    mm = torch.empty(2, dtype=torch.float32)
    if _histogram_call(x, per_unit, hist, mm, threads) != 0:
        return None
    lo, hi = mm.tolist()
    return lo, hi


def rows_minmax(x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Per-row ``(min, max)`` of a float32 ``x`` (rows, ...), contiguous, as two float32 tensors
    (one pass, native: what ``x.flatten(1).amin(1)`` / ``amax(1)`` give); None when a value is NaN
    or an extreme infinite (the caller takes its checked torch path)."""
    _check(x, "rows_minmax: x", (torch.float32,))
    if x.dim() < 1 or not x.shape[0] or not x.numel():
        raise ConfigError(f"rows_minmax: x must have rows and values, got shape {tuple(x.shape)}")
    rows = x.shape[0]
    lo, hi = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    f = _fn("qc_rows_minmax_f32", (_P, _I64, _I64, _P, _P))
    if f(x.data_ptr(), rows, x.numel() // rows, lo.data_ptr(), hi.data_ptr()) != 0:
        return None
    return lo, hi


class DepthwiseConv:
    """Exact depthwise int8 convolution (one filter per channel) with the requantization fused:
    ``clamp(round_half_even((conv(x, w) + bias) * M[c] / 2**n[c]), lo, hi)``, channels-last.

    ``w`` (C, 1, kh, kw) integer weights within int8, ``bias`` (C,) integers or None, ``M``/``n`` (C,).
    Checked once here: the int32 accumulator cannot wrap (``128 * max_c sum |w_c| + max |bias| < 2**31``)
    and ``|acc| * M`` stays below 2**62, shifts in [0, 62]; a layer outside is a ConfigError (callers
    test :meth:`fits` first).  A call takes ``x`` (N, H, W, C) int8 contiguous and returns (N, Ho, Wo, C).
    """

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor], stride, padding, dilation,
                 M: torch.Tensor, n: torch.Tensor, lo: int, hi: int, out_dtype: torch.dtype) -> None:
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
        M = M.to(torch.int64).reshape(-1).expand(C).contiguous()
        n = n.to(torch.int64).reshape(-1).expand(C).contiguous()
        self.plan = Requant(M, n, lo, hi, self.bound)  # checks shifts, M and the clamp range
        self.C, self.kh, self.kw = C, kh, kw
        self.w = w.to(torch.int32).reshape(C, kh * kw).t().contiguous()  # (kh*kw, C)
        self.bias = None if bias is None else bias.to(torch.int32).reshape(C).contiguous()
        self.geom = [int(v) for v in (*stride, *padding, *dilation)]
        self.out_dtype = out_dtype

    @staticmethod
    def acc_bound(w: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
        l1 = int(w.to(torch.int64).abs().flatten(1).sum(1).max()) if w.numel() else 0
        return 128 * l1 + (0 if bias is None or not bias.numel() else int(bias.to(torch.int64).abs().max()))

    def out_size(self, H: int, W: int) -> tuple[int, int]:
        sh, sw, ph, pw, dh, dw = self.geom
        return (H + 2 * ph - dh * (self.kh - 1) - 1) // sh + 1, (W + 2 * pw - dw * (self.kw - 1) - 1) // sw + 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check(x, "DepthwiseConv: x", (torch.int8,))
        if x.dim() != 4 or x.shape[3] != self.C:
            raise ConfigError(f"DepthwiseConv: x must be (N, H, W, {self.C}) channels-last, got {tuple(x.shape)}")
        N, H, W, C = x.shape
        Ho, Wo = self.out_size(H, W)
        if Ho <= 0 or Wo <= 0:
            raise ConfigError(f"DepthwiseConv: input {H}x{W} is smaller than the kernel")
        out = torch.empty((N, Ho, Wo, C), dtype=self.out_dtype)
        f = _fn(f"qc_dwconv_i8_{_INT[self.out_dtype]}", (_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P) + (_I64,) * 8
                + (_P, _P, _I64, _I64, _P))
        p = self.plan
        _ok(f(x.data_ptr(), N, H, W, C, self.w.data_ptr(), self.kh, self.kw,
              None if self.bias is None else self.bias.data_ptr(), *self.geom, Ho, Wo, p.M.data_ptr(), p.n.data_ptr(),
              p.lo, p.hi, out.data_ptr()))
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
