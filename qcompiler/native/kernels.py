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
from typing import Optional

import torch

from qcompiler.errors import ConfigError
from qcompiler.native.build import library

__all__ = ["requant_rows", "histogram_abs", "MAX_SHIFT", "INT64_LIMIT"]

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


def requant_rows(acc: torch.Tensor, M: torch.Tensor, n: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
                 other: Optional[torch.Tensor] = None, Mb: int = 0, nb: int = 0, acc_bound: int = 1 << 31) -> None:
    """``out[p, c] = clamp(round_half_even(acc[p, c] * M[c] / 2**n[c] [+ other[p, c] * Mb / 2**nb]), lo, hi)``,
    exactly, in integer arithmetic.

    ``acc`` (P, O) float32/float64 holding integers with ``|acc| <= acc_bound``; ``M``/``n`` int64 (O,);
    ``other`` (P, O) int8/int16; ``out`` (P, O) int8/int16.  Shifts in [0, 62]; ``|acc_bound * M|`` and
    ``|128 or 32768 * Mb|`` below 2**62 (checked here).  The fused sum runs in int64 when its bound
    fits, else in 128-bit integers.
    """
    _check(acc, "requant_rows: acc", _ACC)
    if acc.dim() != 2:
        raise ConfigError(f"requant_rows: acc must be (rows, channels), got shape {tuple(acc.shape)}")
    P, O = acc.shape
    _check(M, "requant_rows: M", (torch.int64,), (O,))
    _check(n, "requant_rows: n", (torch.int64,), (O,))
    _check(out, "requant_rows: out", _INT, (P, O))
    if not -(1 << 62) < lo <= hi < 1 << 62:
        raise ConfigError(f"requant_rows: bad clamp range [{lo}, {hi}]")
    n_lo, n_hi = (int(n.min()), int(n.max())) if O else (0, 0)
    m_max = int(M.abs().max()) if O else 0
    if n_lo < 0 or n_hi > MAX_SHIFT or (other is not None and not 0 <= nb <= MAX_SHIFT):
        raise ConfigError(f"requant_rows: shifts must be in [0, {MAX_SHIFT}], got n in [{n_lo}, {n_hi}], nb={nb}")
    if acc_bound * m_max >= INT64_LIMIT:
        raise ConfigError(f"requant_rows: |acc| <= {acc_bound} times M up to {m_max} may reach 2**62")
    if other is None:
        f = _fn(f"qc_requant_{_ACC[acc.dtype]}_{_INT[out.dtype]}", (_P, _I64, _I64, _P, _P, _I64, _I64, _P))
        _ok(f(acc.data_ptr(), P, O, M.data_ptr(), n.data_ptr(), lo, hi, out.data_ptr()))
        return
    _check(other, "requant_rows: other", _INT, (P, O))
    b_bound = 1 << (8 * other.element_size() - 1)
    if b_bound * abs(Mb) >= INT64_LIMIT:
        raise ConfigError(f"requant_rows: the fused operand's multiplier {Mb} is too large")
    s = max(n_hi, nb)
    wide = acc_bound * m_max * 2 ** (s - n_lo) + b_bound * abs(Mb) * 2 ** (s - nb) >= INT64_LIMIT
    f = _fn(f"qc_requant_add_{_ACC[acc.dtype]}_{_INT[other.dtype]}_{_INT[out.dtype]}",
            (_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int, _P))
    _ok(f(acc.data_ptr(), P, O, M.data_ptr(), n.data_ptr(), other.data_ptr(), int(Mb), int(nb), lo, hi, int(wide),
          out.data_ptr()))


def histogram_abs(x: torch.Tensor, per_unit: float, hist: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> None:
    """``hist[floor(|x| * per_unit)] += 1`` for every float32 value of ``x`` (contiguous), exactly
    ``torch.bincount`` of the float64 product's floor, added to the float64 ``hist`` (1-d, contiguous).

    The caller guarantees ``|x| * per_unit < hist.numel()`` and no NaN (the observer's range and
    finite check); ``per_unit`` must be positive.
    """
    _check(x, "histogram_abs: x", (torch.float32,))
    _check(hist, "histogram_abs: hist", (torch.float64,))
    if hist.dim() != 1 or not hist.numel():
        raise ConfigError(f"histogram_abs: hist must be a non-empty 1-d tensor, got shape {tuple(hist.shape)}")
    if not per_unit > 0.0:
        raise ConfigError(f"histogram_abs: per_unit must be positive, got {per_unit}")
    nbins = hist.numel()
    ways = 4 if nbins <= 1 << 14 else 1
    if scratch is None or scratch.numel() < ways * nbins or scratch.dtype != torch.int64:
        scratch = torch.empty(ways * nbins, dtype=torch.int64)
    _check(scratch, "histogram_abs: scratch", (torch.int64,))
    f = _fn("qc_hist_abs_f32", (_P, _I64, _F64, _I64, _I64, _P, _P), None)
    f(x.data_ptr(), x.numel(), float(per_unit), nbins, ways, scratch.data_ptr(), hist.data_ptr())
