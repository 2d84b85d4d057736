"""Observers: record the range of the tensors they see and pass them through unchanged.

Every observer is an ``nn.Module`` that returns its input object unchanged, so
an observed model computes exactly the float model's outputs.  From what it
saw it derives symmetric quantization parameters (DESIGN.md, "BPU numerics"):

* zero point always 0; ``scale = amax / qmax`` floored at float32 eps
  (:func:`qcompiler.quantization.fixed_point.symmetric_scale`);
* activations per tensor (``ch_axis == -1``), weights per output channel
  (``ch_axis`` 0, or 1 for a transposed conv);
* dtypes ``"qint8"`` ``[-128, 127]`` and ``"qint16"`` ``[-32768, 32767]``.

Common interface: ``calculate_qparams() -> (scale, zero_point)`` (float32 and
int64 tensors of shape ``[1]`` or ``[C]``), ``calculate_amax()`` (the clipping
threshold behind the scale), the attributes ``dtype``, ``quant_min``,
``quant_max``, ``ch_axis``, ``qscheme``, ``has_observed`` and a settable
``qc_name`` used in error messages.  An observer that sees NaN/Inf raises
:class:`CalibrationError` naming ``qc_name``; asking an observer that never
saw data for its qparams raises :class:`CalibrationError` too.

``HistogramObserver`` keeps a fixed-size histogram of ``|x|`` in one pass and
picks its clipping threshold by percentile, by minimum expected squared error
(``histogram-mse``) or by TensorRT-style KL divergence (``kl``); see its
docstring.  ``OBSERVERS`` maps the user-facing names to factories.

Scale-out: every observer's state is a function of the *multiset* of values
it saw, not of their order or split, and ``sync_ranks()`` reduces it exactly
over the ranks of the default ``torch.distributed`` group (min/max: MIN/MAX;
histograms: integer counts on a power-of-two grid, SUM).  So calibrating
shards on N ranks and syncing gives bit for bit the state of one process on
the union (docs/distributed.md).  A min/max observer with
``sync_each_batch = True`` (set by QAT's ``FakeQuantize``) reduces each batch's
extremes before using them, so a moving average stays identical on every rank.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn

from qcompiler import collectives
from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.native.build import native_enabled
from qcompiler.native.kernels import HistogramState, histogram_abs, rows_minmax, rows_minmax_merge
from qcompiler.native.openmp import parallel_entry
from qcompiler.quantization.fixed_point import dtype_name, qrange, symmetric_scale

__all__ = [
    "DTYPES",
    "check_dtype",
    "ObserverBase",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "HistogramObserver",
    "PercentileObserver",
    "OBSERVERS",
    "make_observer",
    "observer_name",
    "reduce_observers",
]

# the activation/weight dtypes a qconfig may ask for
DTYPES = ("qint8", "qint16")


def check_dtype(dtype, what: str = "dtype") -> str:
    """``dtype`` as one of :data:`DTYPES` (torch.qint8/int8/int16 accepted); else ConfigError."""
    name = dtype_name(dtype)
    if name not in DTYPES:
        raise ConfigError(f"{what}: unknown quantized dtype {dtype!r}; allowed: "
                          + ", ".join(repr(d) for d in DTYPES))
    return name


def resize_to_saved(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """Give the module's ``_resizable_buffers`` the shapes saved in ``state_dict`` before loading."""
    for name in module._resizable_buffers:
        key = prefix + name
        if key in state_dict and getattr(module, name).shape != state_dict[key].shape:
            getattr(module, name).resize_(state_dict[key].shape)


def _fmt_float(v: float) -> str:
    return f"{v:.4g}"


def _fmt_vec(t: torch.Tensor, edge: int = 3) -> str:
    """Short text of a small float vector: ``[-0.25, 0.5, 0.1]`` / ``[a, b, c, ..., x, y, z] (C=64)``."""
    vals = t.detach().flatten().tolist()
    if len(vals) <= 2 * edge + 2:
        return "[" + ", ".join(_fmt_float(v) for v in vals) + "]"
    head = ", ".join(_fmt_float(v) for v in vals[:edge])
    tail = ", ".join(_fmt_float(v) for v in vals[-edge:])
    return f"[{head}, ..., {tail}] (C={len(vals)})"


class ObserverBase(nn.Module):
    """Shared plumbing of all observers: dtype/range attributes, NaN checks, qparams.

    Subclasses implement ``_observe(x)`` (``x`` detached, finite, non-empty,
    floating point) and ``calculate_amax()`` (float32 ``[1]`` or ``[C]``).
    """

    # the tracer keeps observers as leaves; at a float -> BPU boundary an
    # observer marks where values get quantized
    qc_leaf = True
    qc_op = "quant"
    # buffers whose shape depends on the data (resized on load_state_dict)
    _resizable_buffers: tuple[str, ...] = ()

    def __init__(self, dtype="qint8", ch_axis: int = -1) -> None:
        super().__init__()
        self.dtype = check_dtype(dtype)
        self.quant_min, self.quant_max = qrange(self.dtype)
        self._ch_axis = ch_axis
        self.qc_name = ""
        # reduce each batch's statistics over the ranks before using them (QAT under DDP)
        self.sync_each_batch = False

    # -- attributes -------------------------------------------------------
    @property
    def ch_axis(self) -> int:
        return self._ch_axis

    @property
    def qscheme(self) -> torch.qscheme:
        return torch.per_tensor_symmetric if self.ch_axis < 0 else torch.per_channel_symmetric

    @property
    def has_observed(self) -> bool:
        """Did this observer see any (non-empty) data?"""
        raise NotImplementedError

    def _display_name(self) -> str:
        return self.qc_name or type(self).__name__

    # -- observing --------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            d = x.detach()
            if not d.is_floating_point():
                d = d.float()
            self._observe(d)
        return x

    def _observe(self, x: torch.Tensor) -> None:
        """Record ``x``; call :meth:`_check_finite` on the extremes computed from it first."""
        raise NotImplementedError

    def _repeat_is_noop(self) -> bool:
        """Would observing again a tensor this observer has just seen leave its state as it is?

        True for a plain running min/max (``CalibFakeQuantize`` then skips a weight it saw, unchanged,
        on the next batches); False for averages, histograms and per-batch syncs.
        """
        return False

    def _check_finite(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """CalibrationError unless the extremes ``lo``/``hi`` of the input (overall or per channel) are finite.

        ``torch.aminmax`` propagates NaN, so this is the input's NaN/Inf check without another
        pass over it (``torch.isfinite(x).all()`` cost more than the observing).
        """
        finite = (math.isfinite(float(lo)) and math.isfinite(float(hi)) if lo.numel() == 1
                  else bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()))
        if not finite:
            raise CalibrationError(
                f"observer {self._display_name()!r} saw NaN/Inf in its input; "
                f"check the data or the preceding layer"
            )

    def _extremes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.aminmax(x)``, checked finite."""
        lo, hi = torch.aminmax(x)
        self._check_finite(lo, hi)
        return lo, hi

    def sync_ranks(self) -> None:
        """Reduce the statistics over every rank of the default process group, exactly.

        Afterwards every rank holds the state one process would have after
        seeing all ranks' data. Idempotent. A no-op without a group (or with
        one rank). Every rank must call it, on the same observers, in the
        same order. :func:`reduce_observers` does the same for many
        observers with three collectives in all.
        """
        reduce_observers([self])

    # The reduction in three rounds, each one all_reduce over every observer's part
    # (reduce_observers): channel counts (MAX), extremes (MAX), histogram counts (SUM).
    def _sync_channels(self) -> int | None:
        """Round 0: this rank's channel count, for observers whose state is per channel."""
        return None

    def _sync_extremes(self) -> torch.Tensor:
        """Round 1 (MAX): ``[-min_val, max_val]`` flattened, float64 (exact for float32 values)."""
        return torch.cat([-self.min_val.detach().double().reshape(-1), self.max_val.detach().double().reshape(-1)])

    def _apply_extremes(self, t: torch.Tensor) -> None:
        n = self.min_val.numel()
        self.min_val = (-t[:n]).to(self.min_val.dtype).reshape(self.min_val.shape)
        self.max_val = t[n:2 * n].to(self.max_val.dtype).reshape(self.max_val.shape)

    def _sync_counts(self) -> torch.Tensor | None:
        """Round 2 (SUM): counts to add up over the ranks, float64 holding integers."""
        return None

    def _apply_counts(self, t: torch.Tensor) -> None:
        pass

    def _batch_extremes(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's min/max, reduced over the ranks when ``sync_each_batch`` is set."""
        if not (self.sync_each_batch and collectives.active()):
            return lo, hi
        both = collectives.all_reduce(torch.stack([-lo.float(), hi.float()]), collectives.MAX,
                                      f"the batch range of observer {self._display_name()!r}")
        return -both[0], both[1]

    # -- results ----------------------------------------------------------
    def _require_data(self) -> None:
        if not self.has_observed:
            raise CalibrationError(
                f"observer {self._display_name()!r} has not seen any data; run calibration "
                f"batches through the model before asking for its scale"
            )

    def calculate_amax(self) -> torch.Tensor:
        """The clipping threshold (max |x| kept): float32 ``[1]`` or ``[C]``."""
        raise NotImplementedError

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)``: ``amax / qmax`` (float32, floored at eps) and int64 zeros."""
        scale = symmetric_scale(self.calculate_amax(), self.dtype).reshape(-1)
        return scale, torch.zeros(scale.shape, dtype=torch.int64)

    def set_dtype(self, dtype) -> "ObserverBase":
        """Re-target the integer type (``qint8`` <-> ``qint16``) keeping the statistics seen.

        The statistics of every observer here do not depend on the dtype (only the
        threshold search does), so the result equals observing the same data with
        ``dtype`` from the start: mixed precision re-types calibrated observers in place."""
        self.dtype = check_dtype(dtype)
        self.quant_min, self.quant_max = qrange(self.dtype)
        return self

    def _dtype_repr(self) -> str:
        return "" if self.dtype == "qint8" else f", dtype={self.dtype}"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        resize_to_saved(self, state_dict, prefix)  # per-channel statistics start empty
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)


# ---------------------------------------------------------------------------
# min/max family


class MinMaxObserver(ObserverBase):
    """Running min/max of every tensor seen; symmetric scale on demand.

    It returns its input unchanged, so an observed model computes exactly the
    float model's outputs.
    """

    qc_leaf = True
    # at a float -> BPU boundary the observer marks where values get quantized
    qc_op = "quant"

    def __init__(self, dtype="qint8") -> None:
        super().__init__(dtype, ch_axis=-1)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def has_observed(self) -> bool:
        return bool(self.min_val <= self.max_val)

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi = self._batch_extremes(*self._extremes(x))
        self.min_val = torch.minimum(self.min_val, lo.float())
        self.max_val = torch.maximum(self.max_val, hi.float())

    def _repeat_is_noop(self) -> bool:
        return type(self)._observe is MinMaxObserver._observe and not self.sync_each_batch

    def calculate_amax(self) -> torch.Tensor:
        self._require_data()
        return torch.maximum(self.min_val.abs(), self.max_val.abs()).reshape(1)

    def calculate_scale(self) -> torch.Tensor:
        """0-dim symmetric scale (no data check: ``inf`` before any data)."""
        amax = torch.maximum(self.min_val.abs(), self.max_val.abs())
        return symmetric_scale(amax, self.dtype)

    def _seed_amax(self, amax: torch.Tensor) -> None:
        """Start from a known symmetric range (hand-over from calibration)."""
        a = amax.detach().float().abs().max().reshape(())
        self.min_val = -a
        self.max_val = a.clone()

    def extra_repr(self) -> str:
        return (f"min_val={_fmt_float(self.min_val.item())}, "
                f"max_val={_fmt_float(self.max_val.item())}{self._dtype_repr()}")


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of each batch's min and max (QAT activations).

    The first batch initialises the range; later batches update
    ``v <- v + averaging_constant * (batch_v - v)``.
    """

    def __init__(self, averaging_constant: float = 0.01, dtype="qint8") -> None:
        if not (isinstance(averaging_constant, (int, float)) and 0 < averaging_constant <= 1):
            raise ConfigError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}")
        super().__init__(dtype)
        self.averaging_constant = float(averaging_constant)

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi = self._batch_extremes(*self._extremes(x))
        lo, hi = lo.float(), hi.float()
        if not self.has_observed:
            self.min_val, self.max_val = lo.clone(), hi.clone()
        else:
            c = self.averaging_constant
            self.min_val = self.min_val + c * (lo - self.min_val)
            self.max_val = self.max_val + c * (hi - self.max_val)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", averaging_constant={self.averaging_constant:g}"
                                       if self.averaging_constant != 0.01 else "")


class PerChannelMinMaxObserver(ObserverBase):
    """Running min/max per channel along ``ch_axis`` (weights: output channels).

    ``ch_axis`` is 0 for conv/linear weights and 1 for transposed convs.
    Changing ``ch_axis`` clears the statistics.
    """

    _resizable_buffers = ("min_val", "max_val")

    def __init__(self, ch_axis: int = 0, dtype="qint8") -> None:
        if not isinstance(ch_axis, int) or isinstance(ch_axis, bool) or ch_axis < 0:
            raise ConfigError(f"per-channel observers need a channel axis >= 0, got ch_axis={ch_axis!r}")
        super().__init__(dtype, ch_axis=ch_axis)
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))

    @property
    def ch_axis(self) -> int:
        return self._ch_axis

    @ch_axis.setter
    def ch_axis(self, axis: int) -> None:
        if not isinstance(axis, int) or isinstance(axis, bool) or axis < 0:
            raise ConfigError(f"per-channel observers need a channel axis >= 0, got ch_axis={axis!r}")
        if axis != self._ch_axis:
            self._ch_axis = axis
            self.reset()

    def reset(self) -> None:
        """Forget everything seen."""
        self.min_val = torch.empty(0)
        self.max_val = torch.empty(0)

    @property
    def has_observed(self) -> bool:
        return self.min_val.numel() > 0

    def _batch_minmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        ax = self.ch_axis
        if x.dim() <= ax:
            raise ConfigError(
                f"observer {self._display_name()!r}: per-channel axis {ax} does not exist in an "
                f"input of shape {tuple(x.shape)}; set ch_axis to the channel dimension"
            )
        y = x.movedim(ax, 0).reshape(x.shape[ax], -1)
        if y.shape[1] == 0:
            return None
        if self.has_observed and self.min_val.numel() != y.shape[0]:
            raise CalibrationError(
                f"observer {self._display_name()!r} saw {y.shape[0]} channels along axis {ax} "
                f"but {self.min_val.numel()} before; one per-channel observer per tensor"
            )
        mm = None
        if y.dtype == torch.float32 and y.device.type == "cpu" and y.is_contiguous() and native_enabled():
            mm = rows_minmax(y)  # one native pass (a weight each batch: the torch ops' overhead was most of it)
        if mm is None:  # no native kernels, another layout/dtype, or a NaN/Inf (raised below)
            mm = y.amin(1), y.amax(1)  # torch.aminmax(y, dim=1) is ~100x slower on CPU (torch 2.13)
            self._check_finite(*mm)
        return self._batch_extremes(mm[0].float(), mm[1].float())

    def _observe(self, x: torch.Tensor) -> None:
        if self._observe_merged(x):
            return
        mm = self._batch_minmax(x)
        if mm is None:
            return
        lo, hi = mm
        if not self.has_observed:
            self.min_val, self.max_val = lo.clone(), hi.clone()
        else:
            self._merge(lo, hi)

    def _observe_merged(self, x: torch.Tensor) -> bool:
        """A float32 ``ch_axis=0`` tensor (a conv / linear weight, every calibration batch) in one native
        call: the rows' min/max (:func:`~qcompiler.native.kernels.rows_minmax`) on the first batch, merged
        with the running ones (:func:`~qcompiler.native.kernels.rows_minmax_merge`) on later ones: the
        values :meth:`_batch_minmax` and :meth:`_merge` give, as new tensors.  (The first batch's torch
        path took about eight tensor calls around the native one, each 5-10 us inside a model: 2-3 ms on
        mobilenet_v2's 53 weights.)  False (nothing changed) where that path must decide: a shape or
        layout it checks, a NaN/Inf (it raises), a moving average, ``sync_each_batch``."""
        lo, hi = self.min_val, self.max_val
        first = not lo.numel()
        if (self._ch_axis != 0 or x.dtype != torch.float32 or x.dim() == 0 or self.sync_each_batch
                or type(self)._merge is not _PLAIN_MERGE or x.device.type != "cpu" or not x.is_contiguous()
                or not native_enabled()):
            return False
        if not first and (x.shape[0] != lo.numel() or lo.dtype != torch.float32 or hi.dtype != torch.float32
                          or not (lo.is_contiguous() and hi.is_contiguous()) or lo.device.type != "cpu"
                          or hi.device.type != "cpu"):
            return False
        mm = rows_minmax(x) if first else rows_minmax_merge(x, lo, hi)
        if mm is None:
            return False
        self.min_val, self.max_val = mm
        return True

    def _repeat_is_noop(self) -> bool:
        return (type(self)._observe is PerChannelMinMaxObserver._observe and type(self)._merge is _PLAIN_MERGE
                and not self.sync_each_batch)

    def _merge(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Fold one batch's per-channel min/max into the running ones: the overall extremes."""
        self.min_val = torch.minimum(self.min_val, lo)
        self.max_val = torch.maximum(self.max_val, hi)

    def _sync_channels(self) -> int | None:
        return self.min_val.numel()

    def calculate_amax(self) -> torch.Tensor:
        self._require_data()
        return torch.maximum(self.min_val.abs(), self.max_val.abs())

    def _seed_amax(self, amax: torch.Tensor) -> None:
        a = amax.detach().float().abs().reshape(-1)
        self.min_val = -a
        self.max_val = a.clone()

    def extra_repr(self) -> str:
        if not self.has_observed:
            return f"ch_axis={self.ch_axis}, min_val=[], max_val=[]{self._dtype_repr()}"
        return (f"ch_axis={self.ch_axis}, min_val={_fmt_vec(self.min_val)}, "
                f"max_val={_fmt_vec(self.max_val)}{self._dtype_repr()}")


_PLAIN_MERGE = PerChannelMinMaxObserver._merge  # subclasses that merge otherwise keep the torch path


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel exponential moving average of min/max (QAT weights); first batch initialises."""

    def __init__(self, averaging_constant: float = 0.01, ch_axis: int = 0, dtype="qint8") -> None:
        if not (isinstance(averaging_constant, (int, float)) and 0 < averaging_constant <= 1):
            raise ConfigError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}")
        super().__init__(ch_axis, dtype)
        self.averaging_constant = float(averaging_constant)

    def _merge(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        c = self.averaging_constant
        self.min_val = self.min_val + c * (lo - self.min_val)
        self.max_val = self.max_val + c * (hi - self.max_val)


# ---------------------------------------------------------------------------
# histogram family


_F32_TINY, _F32_HUGE = 2.0 ** -126, 2.0 ** 127  # the normal float32 powers of two
_SPLIT_BINCOUNT = 1 << 19  # elements from which a bincount is split over two threads
_bincount_helper: Optional[tuple[int, ThreadPoolExecutor]] = None  # (pid, pool): a forked child makes its own


def _helper() -> ThreadPoolExecutor:
    """The one-thread pool that counts the first half of a large tensor (per process: a fork copies no threads)."""
    global _bincount_helper
    if _bincount_helper is None or _bincount_helper[0] != os.getpid():
        _bincount_helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="qcompiler-bincount"))
    return _bincount_helper[1]


_NATIVE_PART = 1 << 16  # values from which a histogram is split over threads (measured break-even ~2**15)
# Bin a large batch on torch's OpenMP team (torch.get_num_threads() threads), as the float forward
# runs: exact (integer partial counts), and measured faster at 2 threads.  Only on torch's own
# OpenMP runtime: a thread of our own waited for the core torch's spinning workers hold after each
# op (docs/performance.md, "Calibration on both cores").
SPLIT_HISTOGRAM = True


def _native_threads(numel: int) -> int:
    """Threads the native histogram of ``numel`` values is split over: 1, or with
    :data:`SPLIT_HISTOGRAM`, at least :data:`_NATIVE_PART` values and torch's OpenMP runtime found
    (:func:`~qcompiler.native.openmp.parallel_entry`), as many as torch uses
    (``torch.get_num_threads()``, what the float forward uses).  The result does not depend on it
    (``histogram_abs``: exact partial sums)."""
    if not SPLIT_HISTOGRAM or numel < _NATIVE_PART or parallel_entry() is None:
        return 1
    return torch.get_num_threads()


def _bincount(index: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(index, minlength=n)`` (1-d), on two threads for large inputs when torch may use two.

    torch's CPU bincount runs on one thread; the two halves are counted at once (the op releases
    the GIL) and added: integer counts, so the sum is exactly the one-thread result.
    """
    if index.numel() < _SPLIT_BINCOUNT or torch.get_num_threads() < 2:
        return torch.bincount(index, minlength=n)
    half = index.numel() // 2
    first = _helper().submit(torch.bincount, index[:half], None, n)
    second = torch.bincount(index[half:], minlength=n)
    return first.result() + second


# HistogramObserver -> its buffers as the native call takes them (outside the module: the state holds a
# ctypes function, which neither pickles nor deep-copies)
_NATIVE_STATES: "weakref.WeakKeyDictionary[HistogramObserver, HistogramState]" = weakref.WeakKeyDictionary()


class HistogramObserver(ObserverBase):
    """One-pass, fixed-memory histogram of ``|x|``; the clipping threshold is searched.

    Memory: ``histogram`` is ``2 * bins`` float64 counts over ``[0, hist_max)``
    where ``hist_max = 2**E`` is the smallest power of two *above* every
    ``|x|`` seen (0 while only zeros were seen; they sit in bin 0).  Bin ``i``
    covers ``[i*w, (i+1)*w)``, ``w = hist_max / (2*bins)``; values are binned
    as float32 ``|x|``, so ``|x| * (2*bins) / 2**E`` is exact.  Because
    ``max |x| >= hist_max / 2``, at least ``bins`` bins cover ``[0, max |x|]``.
    When a batch needs a larger ``E``, bins merge by the factor ``2**k``
    (old bin ``i`` -> ``i // 2**k``), and ``floor(floor(y) / 2**k) ==
    floor(y / 2**k)``, so the counts are exactly those of binning everything on
    the new grid from the start.  The state is therefore a function of the
    multiset of values seen, not of batch order or of how the data was split,
    and two histograms merge exactly (:meth:`sync_ranks`).  The buffers never
    change size.

    ``calculate_amax()`` (recomputed on each call) works on the bins up to the
    one holding ``max |x|`` (``bins`` to ``2*bins`` of them) and picks ``T``
    (``mse`` and ``kl`` pick a bin edge and scale it by ``max|x| / last edge``,
    so thresholds are not powers of two times small integers):

    * ``percentile``: the ``percentile``-th percentile of ``|x|``,
      interpolated linearly inside its bin;
    * ``mse``: for each candidate ``T`` = a bin's upper edge, with
      ``delta = T / qmax``, the expected squared error is the clipping error
      ``sum_{c_j > T} n_j (c_j - T)**2`` (bin centres ``c_j``) plus the
      rounding error of the kept values: ``c_j**2`` for bins that round to
      zero (``c_j < delta/2``, exact for e.g. ReLU zeros), ``delta**2/12``
      per element otherwise; the minimiser wins (computed with prefix sums,
      O(bins));
    * ``kl``: TensorRT's entropy calibration adapted to symmetric ``|x|``:
      for each candidate ``i`` from ``levels`` to the number of bins ``n``
      (``levels = qmax+1``: 128 for qint8, 32768 for qint16), the reference
      ``P`` is the first ``i`` bins with the outliers added to the last one,
      ``Q`` merges those ``i`` bins into ``levels`` groups and spreads each
      group's mass evenly over its non-empty bins; both are smoothed and the
      ``i`` minimising ``KL(P || Q)`` gives ``T = i * w``.  With
      ``n <= levels`` (qint16 with the default 2048 bins) the histogram is
      coarser than the integer grid, nothing can be gained by clipping and
      ``T = max |x|``.

    The threshold never exceeds the largest ``|x|`` seen.
    """

    METHODS = ("mse", "kl", "percentile")
    MAX_BINS = 1 << 20  # keeps |x| * 2 * bins exact in float64 for float32 |x|

    def __init__(self, method: str = "mse", bins: int = 2048, percentile: float = 99.99,
                 dtype="qint8") -> None:
        if method not in self.METHODS:
            raise ConfigError(f"HistogramObserver: unknown method {method!r}; allowed: "
                              + ", ".join(repr(m) for m in self.METHODS))
        if not isinstance(bins, int) or isinstance(bins, bool) or not 2 <= bins <= self.MAX_BINS:
            raise ConfigError(f"HistogramObserver: bins must be an int in [2, {self.MAX_BINS}], got {bins!r}")
        if not (isinstance(percentile, (int, float)) and 0 < percentile <= 100):
            raise ConfigError(f"HistogramObserver: percentile must be in (0, 100], got {percentile!r}")
        super().__init__(dtype, ch_axis=-1)
        self.method = method
        self.bins = bins
        self.percentile = float(percentile)
        self.register_buffer("histogram", torch.zeros(2 * bins, dtype=torch.float64))
        # 2**E above every |x| seen; 0 until a non-zero value is seen
        self.register_buffer("hist_max", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        # the histogram as of the last sync_ranks() (what all ranks already share)
        self._synced: torch.Tensor | None = None

    @property
    def has_observed(self) -> bool:
        return bool(self.min_val <= self.max_val)

    @property
    def max_abs(self) -> float:
        """Largest ``|x|`` seen (0.0 before any data)."""
        if not self.has_observed:
            return 0.0
        return max(abs(float(self.min_val)), abs(float(self.max_val)))

    # -- observing --------------------------------------------------------
    @staticmethod
    def _rebinned(h: torch.Tensor, old_max: float, new_max: float) -> torch.Tensor:
        """``h`` (range ``[0, old_max)``) on the grid of ``[0, new_max)``; both powers of two or 0."""
        if old_max == new_max or old_max == 0.0:
            return h  # equal grids; or only zeros so far, all in bin 0 on any grid
        n = h.numel()
        factor = int(round(new_max / old_max))
        if factor >= n:
            out = torch.zeros_like(h)
            out[0] = h.sum()
            return out
        return torch.zeros_like(h).index_add_(0, torch.arange(n, device=h.device) // factor, h)

    def _grow(self, new_max: float, histogram_done: bool = False) -> None:
        """Widen the range to ``new_max`` (a power of two >= ``hist_max``), merging bins exactly
        (``histogram_done``: ``histogram`` is on the new grid already, the native pass merged it)."""
        old = float(self.hist_max)
        if new_max <= old:
            return
        if not histogram_done:
            self.histogram.copy_(self._rebinned(self.histogram, old, new_max))
        if self._synced is not None:
            self._synced = self._rebinned(self._synced, old, new_max)
        self.hist_max.fill_(new_max)

    def _observe(self, x: torch.Tensor) -> None:
        if self._observe_native(x):
            return
        lo, hi = self._extremes(x)
        lo, hi = lo.float(), hi.float()
        self.min_val = torch.minimum(self.min_val, lo)
        self.max_val = torch.maximum(self.max_val, hi)
        low = float(lo)
        amax = max(-low, float(hi))  # max |x| of the float32 values
        if amax > 0.0:
            self._grow(math.ldexp(1.0, math.frexp(amax)[1]))  # amax < 2**E <= 2 * amax
        r = float(self.hist_max)
        if r == 0.0:
            self.histogram[0] += x.numel()
            return
        n = self.histogram.numel()
        if native_enabled() and x.device.type == "cpu" and self.histogram.is_contiguous():
            # one pass: floor(|x| * n / r) from the float64 product (exact, as _bin_index), counted in C
            a = x.float()
            histogram_abs(a if a.is_contiguous() else a.contiguous(), n / r, self.histogram.data,
                          _native_threads(a.numel()))
            return
        index = self._bin_index(x, n, r, nonnegative=low >= 0.0)
        self.histogram += _bincount(index, n).double()

    def _observe_native(self, x: torch.Tensor) -> bool:
        """A float32 batch in one native pass (:class:`~qcompiler.native.kernels.HistogramState`, the
        counts of :func:`~qcompiler.native.kernels.histogram_abs_grow`): its min, max and bin counts at
        once, the grid widened on the way when the batch reaches past ``hist_max`` (the first batch,
        or a wider one: chunk by chunk, the counts so far merged onto the wider grid), instead of a
        min/max pass and a binning pass.  The same state as the checked path below: the counts of
        every value seen on the grid of ``max(hist_max, 2**E)`` (``max|x| < 2**E <= 2 max|x|``), the
        running min/max (moved in place).  The native call reads ``hist_max`` and the extremes itself:
        no tensor call around it.  False (nothing changed) on a NaN/Inf (that path raises), where the
        native kernels are off, or for buffers it does not take (a ``hist_max`` that is not a power of
        two, another dtype or layout: a state loaded from elsewhere)."""
        b = self._buffers
        h, hm, lo, hi = b.get("histogram"), b.get("hist_max"), b.get("min_val"), b.get("max_val")
        st = _NATIVE_STATES.get(self)
        if st is None or not st.matches(h, hm, lo, hi):
            st = HistogramState.of(h, hm, lo, hi)
            if st is None:
                _NATIVE_STATES.pop(self, None)
                return False
            _NATIVE_STATES[self] = st
        if x.dtype != torch.float32 or not x.is_cpu:
            return False
        got = st.observe(x if x.is_contiguous() else x.contiguous(), _native_threads(x.numel()))
        if got is None:
            return False
        e0, e = got
        if e != e0:
            self._grow(math.ldexp(1.0, e), histogram_done=True)
        return True

    @staticmethod
    def _bin_index(x: torch.Tensor, n: int, r: float, nonnegative: bool = False) -> torch.Tensor:
        """``floor(|x| * per_unit)``, ``per_unit = n / r``, of the float32 values ``x`` (all ``|x| < r = 2**E``), exactly.

        With ``n`` a power of two (the default 2 * 2048 bins) ``per_unit`` is a power of two (a
        normal float32 unless the range is extreme, e.g. ``|x| < 2**-115``), so the float32 product
        is exact (below 1 it may round, but stays below 1: bin 0) and truncating it to an integer
        is the floor of a non-negative value: one pass in float32 instead of a float64 copy, and
        int16 indices (below ``n <= 2**15``; bincount reads them several times faster than int32).
        ``nonnegative`` (no value below zero, e.g. after a ReLU) skips the ``abs``. Otherwise the
        product is formed in float64 (24 + 21 bits, exact).
        """
        a = x.float()
        per_unit = n / r
        exact_in_float32 = math.frexp(per_unit)[0] == 0.5 and _F32_TINY <= per_unit <= _F32_HUGE
        if not exact_in_float32:
            return a.abs().double().mul_(per_unit).flatten().to(torch.int64)
        a = torch.mul(a, per_unit) if nonnegative else a.abs().mul_(per_unit)
        return a.flatten().to(torch.int16 if n <= 1 << 15 else torch.int32)


    def _sync_extremes(self) -> torch.Tensor:
        return torch.cat([super()._sync_extremes(), self.hist_max.detach().double().reshape(1)])

    def _apply_extremes(self, t: torch.Tensor) -> None:
        super()._apply_extremes(t[:-1])
        self._grow(float(t[-1]))  # every rank on the widest grid: bins then add up exactly

    def _sync_counts(self) -> torch.Tensor:
        # only what this rank saw since the last sync: a second sync adds nothing
        shared = self._synced if self._synced is not None else torch.zeros_like(self.histogram)
        return self.histogram.detach() - shared

    def _apply_counts(self, t: torch.Tensor) -> None:
        shared = self._synced if self._synced is not None else torch.zeros_like(self.histogram)
        # counts are integers in float64 (exact below 2**53): the sum does not depend on the order
        self.histogram.copy_(shared + t)
        self._synced = self.histogram.detach().clone()

    # -- thresholds -------------------------------------------------------
    def calculate_amax(self) -> torch.Tensor:
        self._require_data()
        top = self.max_abs
        r = float(self.hist_max)
        if top == 0.0 or r == 0.0:
            return torch.zeros(1)
        n = self.histogram.numel()
        w = r / n
        used = min(int(math.floor(top * (n / r))) + 1, n)  # up to the bin holding max |x|
        h = self.histogram.detach().cpu().numpy().astype(np.float64)[:used]
        if self.method == "percentile":
            t = self._percentile_threshold(h, w)
        else:
            # a bin edge i * w, stretched so that the last used edge is max |x| (a change below
            # 1 / bins): on the raw power-of-two grid the thresholds of two tensors would often
            # have simple ratios (2x, 3/2x), which makes exact rounding ties in requantization common
            edge = self._mse_threshold(h, w) if self.method == "mse" else self._kl_threshold(h, w)
            t = edge * (top / (used * w))
        t = min(t, top)
        if not t > 0.0:
            t = top
        return torch.tensor([t], dtype=torch.float32)

    def _percentile_threshold(self, h: np.ndarray, w: float) -> float:
        cum = np.cumsum(h)
        target = self.percentile / 100.0 * cum[-1]
        i = int(min(np.searchsorted(cum, target, side="left"), len(h) - 1))
        before = cum[i - 1] if i > 0 else 0.0
        frac = (target - before) / h[i] if h[i] > 0 else 1.0
        return (i + min(max(frac, 0.0), 1.0)) * w

    def _mse_threshold(self, h: np.ndarray, w: float) -> float:
        n = len(h)
        centres = (np.arange(n) + 0.5) * w
        t = (np.arange(n) + 1.0) * w  # candidate thresholds: upper bin edges
        cum0 = np.cumsum(h)
        cum1 = np.cumsum(h * centres)
        cum2 = np.cumsum(h * centres ** 2)
        # clipping error of the bins above candidate i: sum_{j>i} n_j (c_j - T_i)^2
        s0, s1, s2 = cum0[-1] - cum0, cum1[-1] - cum1, cum2[-1] - cum2
        clip = np.maximum(s2 - 2.0 * t * s1 + t * t * s0, 0.0)
        # rounding error of the kept bins j <= i
        delta = t / self.quant_max
        m = np.searchsorted(centres, delta / 2.0, side="left")  # bins with c_j < delta/2 round to 0
        m = np.minimum(m, np.arange(n) + 1)
        pad0, pad2 = np.concatenate(([0.0], cum0)), np.concatenate(([0.0], cum2))
        zero_err = pad2[m]
        rounded = cum0 - pad0[m]
        err = clip + zero_err + rounded * delta * delta / 12.0
        return float(t[int(np.argmin(err))])

    def _kl_threshold(self, h: np.ndarray, w: float) -> float:
        levels = self.quant_max + 1
        n = len(h)
        if n <= levels:
            return n * w
        if n > 1:
            # the spike of exact zeros (after ReLU) in bin 0 would dominate the divergence and
            # pull the threshold to about half the range: weigh it like its neighbour
            h = h.copy()
            h[0] = h[1]
        best_i, best_kl = n, math.inf
        tail = np.concatenate((np.cumsum(h[::-1])[::-1], [0.0]))  # tail[i] = sum h[i:]
        for i in range(levels, n + 1):
            sliced = h[:i]
            p = sliced.copy()
            p[i - 1] += tail[i]
            nonzero = p != 0
            starts = (np.arange(levels) * i) // levels
            group_sum = np.add.reduceat(sliced, starts)
            group_nz = np.add.reduceat(nonzero.astype(np.float64), starts)
            group_of = np.repeat(np.arange(levels), np.diff(np.append(starts, i)))
            q = np.where(nonzero, (group_sum / np.maximum(group_nz, 1.0))[group_of], 0.0)
            kl = _kl_divergence(p, q)
            if kl < best_kl:
                best_i, best_kl = i, kl
        return best_i * w

    def extra_repr(self) -> str:
        parts = [f"method={self.method}", f"bins={self.bins}"]
        if self.method == "percentile":
            parts.append(f"percentile={self.percentile:g}")
        if self.has_observed:
            parts.append(f"min_val={_fmt_float(self.min_val.item())}, "
                         f"max_val={_fmt_float(self.max_val.item())}")
        else:
            parts.append("empty")
        return ", ".join(parts) + self._dtype_repr()


def _smooth(p: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
    """Give empty bins a little mass taken evenly from the others (TensorRT/MXNet style)."""
    zero = p == 0
    n_zero = int(zero.sum())
    n_nonzero = p.size - n_zero
    if n_nonzero == 0:
        return None
    eps1 = eps * n_zero / n_nonzero
    return p + eps * zero - eps1 * ~zero


def _kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    ps, qs = _smooth(p), _smooth(q)
    if ps is None or qs is None:
        return math.inf
    ps, qs = ps / ps.sum(), qs / qs.sum()
    if (ps <= 0).any() or (qs <= 0).any():
        return math.inf
    return float(np.sum(ps * np.log(ps / qs)))


class PercentileObserver(HistogramObserver):
    """:class:`HistogramObserver` that clips at a percentile of ``|x|`` (default 99.99)."""

    def __init__(self, percentile: float = 99.99, bins: int = 2048, dtype="qint8") -> None:
        super().__init__(method="percentile", bins=bins, percentile=percentile, dtype=dtype)


# ---------------------------------------------------------------------------
# the user-facing names

OBSERVERS: dict[str, Callable[..., ObserverBase]] = {
    "minmax": MinMaxObserver,
    "percentile": PercentileObserver,
    "histogram-mse": functools.partial(HistogramObserver, method="mse"),
    "kl": functools.partial(HistogramObserver, method="kl"),
}


def observer_name(observer: ObserverBase) -> str:
    """The :data:`OBSERVERS` name an activation observer was made by (``"minmax"``, ``"kl"``...);
    a MinMax family or unknown observer counts as ``"minmax"``."""
    if isinstance(observer, PercentileObserver):
        return "percentile"
    if isinstance(observer, HistogramObserver):
        return {"mse": "histogram-mse", "kl": "kl", "percentile": "percentile"}.get(observer.method, "histogram-mse")
    return "minmax"


def make_observer(name: str, dtype="qint8") -> ObserverBase:
    """A fresh activation observer by name (``minmax``, ``percentile``, ``histogram-mse``, ``kl``)."""
    factory = OBSERVERS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError(f"unknown observer {name!r}; allowed: " + ", ".join(repr(k) for k in OBSERVERS))
    return factory(dtype=dtype)


# ---------------------------------------------------------------------------
# scale-out


def _all_reduce_parts(parts: list[torch.Tensor], op: str, what: str) -> list[torch.Tensor]:
    """Every part reduced over the ranks with one all_reduce of their concatenation."""
    if not parts:
        return []
    flat = collectives.all_reduce(torch.cat([p.reshape(-1) for p in parts]), op, what)
    return list(torch.split(flat, [p.numel() for p in parts]))


def reduce_observers(observers: list[ObserverBase]) -> None:
    """Reduce the state of ``observers`` over every rank, exactly, in three collectives.

    Every rank must pass the same observers in the same order (``sync_observers``
    checks the models agree first). Round 0 compares per-channel observers' channel
    counts (a rank that saw no data takes the others'), round 1 takes the extremes
    (min/max and histogram ranges, MAX), round 2 adds the histogram counts (SUM).
    One all_reduce per round keeps the cost independent of the number of
    observers (44 on resnet18). A no-op without a process group.
    """
    if not collectives.active() or not observers:
        return
    n = len(observers)
    chans = [(o, c) for o in observers if (c := o._sync_channels()) is not None]
    idle = set()
    if chans:
        sizes = torch.tensor([[c, -c if c else -(1 << 62)] for _, c in chans], dtype=torch.int64)
        sizes = collectives.all_reduce(sizes, collectives.MAX, f"the channel counts of {len(chans)} observers")
        for (o, c), (most, neg_fewest) in zip(chans, sizes.tolist()):
            if most == 0:
                idle.add(id(o))  # no rank saw data: nothing to reduce
            elif -neg_fewest != most:
                raise CalibrationError(
                    f"observer {o._display_name()!r} saw {-neg_fewest} channels on one rank and {most} on "
                    f"another; every rank must run the same model"
                )
            elif c == 0:
                o.min_val = torch.full((most,), float("inf"), device=o.min_val.device)
                o.max_val = torch.full((most,), float("-inf"), device=o.max_val.device)
    live = [o for o in observers if id(o) not in idle]
    for o, t in zip(live, _all_reduce_parts([o._sync_extremes() for o in live], collectives.MAX,
                                            f"the ranges of {n} observers")):
        o._apply_extremes(t)
    counted = [(o, p) for o in live if (p := o._sync_counts()) is not None]
    for (o, _), t in zip(counted, _all_reduce_parts([p for _, p in counted], collectives.SUM,
                                                    f"the histograms of {n} observers")):
        o._apply_counts(t)
