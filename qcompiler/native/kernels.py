"""Typed entry points of the calibration kernels (``kernels.c``), called on tensors' ``data_ptr()``:
the histograms of ``|x|`` and the per-row min/max the observers take, and the typed-function and
tensor checks every binding shares (the BPU simulator's are ``qcompiler.backends.bpu.native.kernels``).

Each wrapper checks dtypes, contiguity and sizes before handing raw pointers to C, and raises
:class:`~qcompiler.errors.ConfigError` naming the argument on misuse (a wrong pointer would
be a crash or a silent wrong answer).  ``None`` from :func:`histogram_abs` never happens: callers
ask :func:`~qcompiler.native.build.native_enabled` first and keep their torch path otherwise.

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
from qcompiler.native.openmp import parallel_entry

__all__ = ["histogram_abs", "histogram_abs_minmax", "histogram_abs_grow", "HistogramState", "NO_RANGE", "FUSED_MAX",
           "rows_minmax", "rows_minmax_merge"]

_I64, _F64 = ctypes.c_int64, ctypes.c_double
_P = ctypes.c_void_p
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


_F32_TINY, _F32_HUGE = 2.0 ** -126, 2.0 ** 127  # the normal float32 powers of two
FUSED_MAX = 1 << 30  # histogram_abs_minmax: up to this many values (one uint32 chunk: all or nothing)
HIST_MAX_THREADS = 16  # qc_hist_abs_f32_mt's cap (the native pool's QC_MAX_PARTS)
HIST_CHUNK = 1 << 14  # values a thread takes at a time in a split histogram (~10 us of binning)


def _histogram_call(x: torch.Tensor, per_unit: float, hist: torch.Tensor, mm,
                    threads: int, chunk: int, omp: bool, used: Optional[list]) -> int:
    for name, v in (("threads", threads), ("chunk", chunk)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"histogram_abs: {name} must be a positive int, got {v!r}")
    _check(x, "histogram_abs: x", (torch.float32,))
    _check(hist, "histogram_abs: hist", (torch.float64,))
    if hist.dim() != 1 or not hist.numel():
        raise ConfigError(f"histogram_abs: hist must be a non-empty 1-d tensor, got shape {tuple(hist.shape)}")
    if not per_unit > 0.0 or not math.isfinite(per_unit):
        raise ConfigError(f"histogram_abs: per_unit must be positive and finite, got {per_unit}")
    nbins = hist.numel()
    f32 = math.frexp(per_unit)[0] == 0.5 and _F32_TINY <= per_unit <= _F32_HUGE
    f = _fn("qc_hist_abs_f32_mt", (_P, _I64, _F64, ctypes.c_int, _I64, _P, _P, ctypes.c_int, _I64, _P, _P))
    n_used = ctypes.c_int32(0)
    rc = f(x.data_ptr(), x.numel(), float(per_unit), int(f32), nbins, hist.data_ptr(),
           mm, min(threads, HIST_MAX_THREADS), min(chunk, FUSED_MAX),
           parallel_entry() if omp and threads > 1 else None, ctypes.byref(n_used))
    if used is not None:
        used.append(n_used.value)
    if rc == -1:
        raise MemoryError("histogram_abs: out of memory for the counters")
    return rc


def histogram_abs(x: torch.Tensor, per_unit: float, hist: torch.Tensor, threads: int = 1,
                  chunk: int = HIST_CHUNK, omp: bool = True, used: Optional[list] = None) -> None:
    """``hist[floor(|x| * per_unit)] += 1`` for every float32 value of ``x`` (contiguous): exactly
    ``torch.bincount`` of the floor of the exact product, added to the float64 ``hist`` (1-d, contiguous).

    The caller guarantees ``|x| * per_unit < hist.numel()`` and no NaN (the observer's range and
    finite check; a value outside is a ConfigError, never counted); ``per_unit`` must be positive.  A power
    of-two ``per_unit`` in the normal float32 range is applied in float32 (exact), any other in
    float64 (exact: 24 + 21 bits).

    ``threads`` > 1 bins on up to that many threads (at most :data:`HIST_MAX_THREADS`): a parallel
    region of torch's own OpenMP runtime when ``omp`` and :func:`~qcompiler.native.openmp.parallel_entry`
    finds it (torch's spinning intra-op workers take the work at once), else the native pool
    (``qc_run_rows``).  The values are taken ``chunk`` at a time from a shared counter, and each
    thread's part counts into its own partial histogram; the partials are integer counts, so their
    sum is bit for bit the one-thread result, whoever took which chunk.  ``used`` (a list) gets the
    number of threads that binned values appended (for tests and benchmarks).
    """
    if _histogram_call(x, per_unit, hist, None, threads, chunk, omp, used) == -2:
        raise ConfigError(f"histogram_abs: a value of x is NaN or at least the range ({hist.numel()} / {per_unit}); "
                          f"the caller must widen the range first")


def histogram_abs_minmax(x: torch.Tensor, per_unit: float, hist: torch.Tensor, threads: int = 1,
                         chunk: int = HIST_CHUNK, omp: bool = True,
                         used: Optional[list] = None) -> Optional[tuple[float, float]]:
    """:func:`histogram_abs` and ``(min(x), max(x))`` in one pass, when every ``|x| * per_unit`` is
    below ``hist.numel()`` and no value is NaN; otherwise None and ``hist`` is unchanged (the caller
    computes the range and bins again).  At most :data:`FUSED_MAX` values.  ``threads``, ``chunk``,
    ``omp`` and ``used`` as in :func:`histogram_abs` (the min/max of the parts are combined: the same result)."""
    if x.numel() > FUSED_MAX:
        raise ConfigError(f"histogram_abs_minmax: at most {FUSED_MAX} values, got {x.numel()}")
    mm = (ctypes.c_float * 2)()  # (a ctypes array: no tensor allocated per call)
    if _histogram_call(x, per_unit, hist, mm, threads, chunk, omp, used) != 0:
        return None
    return mm[0], mm[1]


NO_RANGE = -(1 << 31)  # histogram_abs_grow: the exponent of "only zeros so far" (no grid yet)


def histogram_abs_grow(x: torch.Tensor, e0: int, hist: torch.Tensor, threads: int = 1, chunk: int = HIST_CHUNK,
                       omp: bool = True, used: Optional[list] = None) -> Optional[tuple[int, float, float]]:
    """Add the counts of ``|x|`` (float32, contiguous) to ``hist`` on a grid found in the same pass;
    ``(e, min(x), max(x))``.  ``hist`` (float64, 1-d, contiguous) holds counts on ``[0, 2**e0)`` with
    ``hist.numel()`` bins (``e0`` = :data:`NO_RANGE`: no grid yet, counts in bin 0 only); afterwards it
    holds them and every value of ``x`` on ``[0, 2**e)``, ``e`` the larger of ``e0`` and the exponent
    with ``max|x| < 2**e <= 2 max|x|`` (:data:`NO_RANGE` when ``e0`` is and every value is zero), the
    old bins merged ``i -> i >> (e - e0)``.  The counts equal merging ``hist`` so and adding
    :func:`histogram_abs` of ``x`` on that grid, bit for bit (a chunk binned before the grid grew has its
    bins merged the same way, exact on integer floors).  None, ``hist`` unchanged, when a value is NaN
    or infinite (the caller takes its checked path).  ``threads``, ``chunk``, ``omp`` and ``used`` as in
    :func:`histogram_abs`."""
    for name, v in (("threads", threads), ("chunk", chunk), ("e0", e0)):
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and name != "e0"):
            raise ConfigError(f"histogram_abs_grow: {name} must be a {'' if name == 'e0' else 'positive '}int, got {v!r}")
    if e0 != NO_RANGE and not -200 <= e0 <= 200:
        raise ConfigError(f"histogram_abs_grow: e0 must be NO_RANGE or in [-200, 200], got {e0}")
    _check(x, "histogram_abs_grow: x", (torch.float32,))
    _check(hist, "histogram_abs_grow: hist", (torch.float64,))
    if hist.dim() != 1 or not hist.numel():
        raise ConfigError(f"histogram_abs_grow: hist must be a non-empty 1-d tensor, got shape {tuple(hist.shape)}")
    f = _fn("qc_hist_abs_grow_f32", (_P, _I64, ctypes.c_int, _I64, _P, _P, _P, ctypes.c_int, _I64, _P, _P))
    mm = (ctypes.c_float * 2)()
    e, n_used = ctypes.c_int32(0), ctypes.c_int32(0)
    rc = f(x.data_ptr(), x.numel(), e0, hist.numel(), hist.data_ptr(), mm, ctypes.byref(e),
           min(threads, HIST_MAX_THREADS), min(chunk, FUSED_MAX), parallel_entry() if omp and threads > 1 else None,
           ctypes.byref(n_used))
    if used is not None:
        used.append(n_used.value)
    if rc == -1:
        raise MemoryError("histogram_abs_grow: out of memory for the counters")
    return None if rc else (e.value, mm[0], mm[1])


def _takes(hist: torch.Tensor, hist_max: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    """Whether ``qc_hist_observe_f32`` takes these buffers: float64 1-d non-empty counts, one float64
    ``hist_max``, one float32 ``min_val`` and ``max_val``, all contiguous on the CPU (attribute reads only)."""
    return (hist.dtype == torch.float64 and hist_max.dtype == torch.float64 and min_val.dtype == torch.float32
            and max_val.dtype == torch.float32 and hist.dim() == 1 and hist.numel() > 0 and hist_max.numel() == 1
            and min_val.numel() == 1 and max_val.numel() == 1 and hist.is_cpu and hist_max.is_cpu and min_val.is_cpu
            and max_val.is_cpu and hist.is_contiguous() and hist_max.is_contiguous() and min_val.is_contiguous()
            and max_val.is_contiguous())


class HistogramState:
    """One :class:`~qcompiler.quantization.observer.HistogramObserver`'s buffers as the native
    ``qc_hist_observe_f32`` reads and writes them: the histogram (float64, 1-d, contiguous), ``hist_max``
    (float64, one value), ``min_val`` and ``max_val`` (float32, one value each), all on the CPU.

    Built once per set of buffer objects, so a batch costs one native call and a few attribute reads:
    inside a model every tensor call around the native one cost 5-10 us (the convs in between evict the
    interpreter's and torch's code), 40-65 us an observer before.  The layouts are checked again and the
    pointers read on every call (:meth:`matches`): a buffer object can change its dtype, size or storage
    in place (``.data =``, ``torch.utils.swap_tensors``, ``load_state_dict(assign=True)`` in swap mode),
    and a float64 extreme written as float32 would be a wrong state with no error."""

    __slots__ = ("lib", "tensors", "_e", "_f")

    def __init__(self, lib: ctypes.CDLL, tensors: tuple) -> None:
        self.lib, self.tensors = lib, tensors
        self._e = (ctypes.c_int32 * 2)()  # (the call's e0 and e: one array per observer, no allocation per call)
        self._f = _fn("qc_hist_observe_f32", (_P, _I64, _I64, _P, _P, _P, _P, ctypes.c_int, _I64, _P, _P))

    @classmethod
    def of(cls, hist: torch.Tensor, hist_max: torch.Tensor, min_val: torch.Tensor,
           max_val: torch.Tensor) -> Optional["HistogramState"]:
        """The state of these buffers, or None where the native call does not apply (the kernels off,
        or a buffer of another dtype, device, size or layout: a state loaded from elsewhere)."""
        lib = library()
        if lib is None or not all(isinstance(t, torch.Tensor) for t in (hist, hist_max, min_val, max_val)):
            return None
        if not _takes(hist, hist_max, min_val, max_val):
            return None
        return cls(lib, (hist, hist_max, min_val, max_val))

    def matches(self, hist, hist_max, min_val, max_val) -> bool:
        """Whether these are the buffer objects this state was built for, still of the layouts it takes,
        with the library still loaded (False once the kernels are turned off or reloaded)."""
        t = self.tensors
        return (t[0] is hist and t[1] is hist_max and t[2] is min_val and t[3] is max_val
                and library() is self.lib and _takes(hist, hist_max, min_val, max_val))

    def observe(self, x: torch.Tensor, threads: int, chunk: int = HIST_CHUNK,
                omp: bool = True) -> Optional[tuple[int, int]]:
        """Bin ``x`` (float32, contiguous, on the CPU: the caller checks) into the state on a grid
        found in the same pass (:func:`histogram_abs_grow`'s counts; ``threads``, ``chunk`` and
        ``omp`` as there) and move ``min_val`` / ``max_val`` in place; ``(e0, e)``, the grid's
        exponent before and after (:data:`NO_RANGE`: none yet).  None, nothing changed, on a NaN / Inf
        in ``x`` or a ``hist_max`` that is not 0 or a power of two in ``[2**-200, 2**200]``."""
        h, hm, lo, hi = self.tensors
        rc = self._f(x.data_ptr(), x.numel(), h.numel(), h.data_ptr(), hm.data_ptr(), lo.data_ptr(), hi.data_ptr(),
                     min(threads, HIST_MAX_THREADS), min(chunk, FUSED_MAX),
                     parallel_entry() if omp and threads > 1 else None, self._e)
        if rc == -1:
            raise MemoryError("HistogramState.observe: out of memory for the counters")
        return None if rc else (self._e[0], self._e[1])


def rows_minmax_merge(x: torch.Tensor, old_lo: torch.Tensor,
                      old_hi: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``torch.minimum(old_lo, rows_minmax(x)[0])`` and ``torch.maximum(old_hi, rows_minmax(x)[1])`` in
    one native call, as two new float32 tensors (``old_lo``, ``old_hi``: float32, contiguous, one value per
    row of ``x``; of an equal pair +0 / -0 the old value is kept).  None when a value of ``x`` is NaN or an
    extreme infinite (the caller takes its checked torch path)."""
    return _rows_minmax(x, "rows_minmax_merge", (old_lo, old_hi))


def rows_minmax(x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Per-row ``(min, max)`` of a float32 ``x`` (rows, ...), contiguous, as two float32 tensors
    (one pass, native: what ``x.flatten(1).amin(1)`` / ``amax(1)`` give); None when a value is NaN
    or an extreme infinite (the caller takes its checked torch path)."""
    return _rows_minmax(x, "rows_minmax", None)


def _rows_minmax(x: torch.Tensor, what: str, old: Optional[tuple[torch.Tensor, torch.Tensor]]):
    """:func:`rows_minmax` (``old`` None) or :func:`rows_minmax_merge` (``old`` the running extremes)."""
    _check(x, f"{what}: x", (torch.float32,))
    if x.dim() < 1 or not x.shape[0] or not x.numel():
        raise ConfigError(f"{what}: x must have rows and values, got shape {tuple(x.shape)}")
    rows = x.shape[0]
    if old is not None:
        for name, t in zip(("old_lo", "old_hi"), old):
            _check(t, f"{what}: {name}", (torch.float32,))
            if t.numel() != rows:
                raise ConfigError(f"{what}: {name} must hold {rows} values (one per row), got {t.numel()}")
    lo, hi = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    f = _fn("qc_rows_minmax_f32", (_P, _I64, _I64, _P, _P, _P, _P))
    olds = (None, None) if old is None else (old[0].data_ptr(), old[1].data_ptr())
    if f(x.data_ptr(), rows, x.numel() // rows, *olds, lo.data_ptr(), hi.data_ptr()) != 0:
        return None
    return lo, hi
