"""Calibration on several threads gives bit for bit the one-thread state, and the native
per-channel min/max equals torch's (docs/performance.md, "Calibration").

With `observer.SPLIT_HISTOGRAM` (off by default: not measured faster) the histogram observers bin a large batch on ``torch.get_num_threads()`` native threads
(``qc_hist_abs_f32_mt``): each thread counts a contiguous part of the values into its own
partial histogram, and the integer partial counts are added.  These tests hold that to the
torch reference (``bincount`` of the float64 floor) and to the one-thread result, for random
data, thread counts (the split points ``N * t / threads``) and batch splits, with torch.equal.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.native.build import disabled, native_enabled
from qcompiler.native.kernels import histogram_abs, histogram_abs_minmax, rows_minmax
from qcompiler.quantization import observer as observer_module
from qcompiler.quantization import prepare_calibration_fx
from qcompiler.quantization.observer import HistogramObserver, ObserverBase, PerChannelMinMaxObserver
from qcompiler.quantization.qconfig import get_default_calib_qconfig

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None)
needs_native = pytest.mark.skipif(not native_enabled(), reason="native kernels are off")


def _data(numel: int, exponent: int, zeros: float, seed: int) -> torch.Tensor:
    """Gaussian values times 2**exponent with about a ``zeros`` fraction of exact zeros (a ReLU's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 2.0 ** exponent
    return torch.where(torch.rand(numel, generator=g) < zeros, torch.zeros(()), x)


# ---------------------------------------------------------------------------- the native kernel


@needs_native
@SETTINGS
@given(st.integers(1, 4000), st.integers(-130, 120), st.sampled_from([2, 3, 1000, 4096, 1 << 15]),
       st.integers(1, 7), st.sampled_from([0.0, 0.5, 0.95]), st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_threaded_histogram_equals_the_torch_reference(numel, exponent, nbins, threads, zeros, pow2, seed):
    """Any thread count (split points) gives the bincount of the exact floor and min/max of x,
    bit for bit; a non-power-of-two per_unit takes the float64 product."""
    x = _data(numel, exponent, zeros, seed)
    amax = float(x.abs().max())
    if amax == 0.0:
        return
    r = math.ldexp(1.0, math.frexp(amax)[1])
    per_unit = nbins / r if pow2 else (nbins - 0.5) / r
    base = torch.arange(nbins, dtype=torch.float64)  # counts are added to what is there
    hist = base.clone()
    mm = histogram_abs_minmax(x, per_unit, hist, threads)
    want = torch.bincount(torch.floor(x.abs().double() * per_unit).long(), minlength=nbins).double()
    assert torch.equal(hist, base + want)
    assert mm == (float(x.min()), float(x.max()))
    plain = base.clone()
    histogram_abs(x, per_unit, plain, threads)
    assert torch.equal(plain, hist)


@needs_native
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("bad", [8.0, float("nan"), float("-inf")])
def test_a_bad_value_in_any_part_leaves_the_histogram_unchanged(threads, bad):
    n = 3001
    for where in sorted({0, n * 1 // threads, n * (threads - 1) // threads - 1, n - 1}):
        x = torch.rand(n) * 7.9
        x[where] = bad
        hist = torch.arange(4096, dtype=torch.float64)
        assert histogram_abs_minmax(x, 4096 / 8.0, hist, threads) is None, where
        with pytest.raises(ConfigError, match="NaN or at least the range"):
            histogram_abs(x, 4096 / 8.0, hist, threads)
        assert torch.equal(hist, torch.arange(4096, dtype=torch.float64)), where


@needs_native
def test_more_threads_than_values_and_bad_thread_counts():
    x = torch.tensor([0.5, -3.0])
    hist = torch.zeros(8, dtype=torch.float64)
    assert histogram_abs_minmax(x, 8 / 4.0, hist, 64) == (-3.0, 0.5)
    assert hist.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="threads must be a positive int"):
            histogram_abs(x, 2.0, hist, threads)


# ---------------------------------------------------------------------------- the observers


def _assert_same(a: ObserverBase, b: ObserverBase) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    qa, qb = a.calculate_qparams(), b.calculate_qparams()
    assert torch.equal(qa[0], qb[0]) and torch.equal(qa[1], qb[1])


@needs_native
@settings(SETTINGS, max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(-20, 20), st.sampled_from([0.0, 0.5]),
                          st.integers(0, 2 ** 31 - 1), st.floats(0.0, 1.0)), min_size=1, max_size=5),
       st.integers(2, 5), st.integers(1, 700), st.sampled_from(["mse", "kl", "percentile"]))
def test_observers_on_threads_equal_one_thread_sequential(batches, threads, part, method):
    """Each batch binned on ``threads`` native threads (a part per ``part`` values), and each batch
    split at a random point into two batches, give the state and qparams of one thread seeing
    the batches whole."""
    data = [_data(n, e, z, s) for n, e, z, s, _ in batches]
    one = HistogramObserver(method=method)
    for x in data:
        one(x)
    many = HistogramObserver(method=method)
    calls = []
    real = observer_module.histogram_abs_minmax

    def spy(x, per_unit, hist, threads=1):
        calls.append(threads)
        return real(x, per_unit, hist, threads)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: threads)
        m.setattr(observer_module, "_NATIVE_PART", part)
        m.setattr(observer_module, "SPLIT_HISTOGRAM", True)
        m.setattr(observer_module, "histogram_abs_minmax", spy)
        for x, (*_, where) in zip(data, batches):
            k = int(where * x.numel())
            for piece in (x[:k], x[k:]):
                many(piece)
    _assert_same(one, many)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.conv3 = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.nn.functional.relu6(self.conv2(y))
        y = self.conv3(y) + y[:, :8]
        return self.fc(y.mean((2, 3)))


@needs_native
@pytest.mark.parametrize("observer", ["histogram-mse", "percentile", "kl"])
def test_calibrating_a_model_on_two_threads_equals_one_thread(monkeypatch, observer):
    """The staged flow (the user calls the calibration model on batches): with torch on two
    threads every observer's state and scale equals the one-thread run, bit for bit."""
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(2, 3, 40, 40)
    batches = [torch.randn(4, 3, 40, 40) * s for s in (1.0, 3.0, 0.5)]

    def calibrate(threads: int) -> dict:
        cal = prepare_calibration_fx(net, {"": get_default_calib_qconfig(observer=observer)},
                                     hybrid=True, example_inputs=(x,)).eval()
        calls = []
        real = observer_module.histogram_abs_minmax

        def spy(x, per_unit, hist, threads=1):
            calls.append(threads)
            return real(x, per_unit, hist, threads)

        with monkeypatch.context() as m:
            m.setattr(torch, "get_num_threads", lambda: threads)
            m.setattr(observer_module, "_NATIVE_PART", 1000)
            m.setattr(observer_module, "SPLIT_HISTOGRAM", True)
            m.setattr(observer_module, "histogram_abs_minmax", spy)
            with torch.no_grad():
                for b in batches:
                    cal(b)
        assert max(calls) == threads  # the large batches were split when torch had two threads
        obs = {n: o for n, o in cal.named_modules() if isinstance(o, HistogramObserver)}
        assert len(obs) >= 4
        return obs

    one, two = calibrate(1), calibrate(2)
    assert one.keys() == two.keys()
    for name in one:
        _assert_same(one[name], two[name])


# ---------------------------------------------------------------------------- per-channel weights


@needs_native
@SETTINGS
@given(st.integers(1, 40), st.integers(1, 300), st.integers(-60, 60), st.sampled_from([0.0, 0.5]),
       st.integers(0, 2 ** 31 - 1))
def test_rows_minmax_equals_torch_amin_amax(rows, cols, exponent, zeros, seed):
    x = _data(rows * cols, exponent, zeros, seed).reshape(rows, cols)
    lo, hi = rows_minmax(x)
    assert torch.equal(lo, x.amin(1)) and torch.equal(hi, x.amax(1))
    lo4, hi4 = rows_minmax(x.reshape(rows, 1, cols, 1))  # a conv weight: rows, then the rest
    assert torch.equal(lo4, lo) and torch.equal(hi4, hi)


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rows_minmax_reports_nan_and_inf_and_the_observer_raises(bad):
    for where in (0, 37, 9 * 50 - 1):
        w = torch.randn(9, 50)
        w.view(-1)[where] = bad
        assert rows_minmax(w) is None
        o = PerChannelMinMaxObserver()
        o(torch.randn(9, 50))
        before = {k: v.clone() for k, v in o.state_dict().items()}
        with pytest.raises(CalibrationError, match="saw NaN/Inf"):
            o(w)
        for k, v in before.items():
            assert torch.equal(o.state_dict()[k], v), k


@needs_native
def test_per_channel_observer_native_equals_torch_path():
    """The native per-row pass gives the torch path's state, for ch_axis 0 and 1 (both reach the
    native pass: the observer moves the channel axis first and reshapes to a contiguous copy)."""
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(16, 8, 3, 3, generator=g) * s for s in (1.0, 2.0, 0.25)]
    for axis in (0, 1):
        fast, slow = PerChannelMinMaxObserver(ch_axis=axis), PerChannelMinMaxObserver(ch_axis=axis)
        for w in ws:
            fast(w)
        with disabled():
            for w in ws:
                slow(w)
        _assert_same(fast, slow)
    with pytest.raises(ConfigError, match="rows_minmax"):
        rows_minmax(torch.zeros(0, 3))


def test_the_histogram_split_is_off_by_default():
    """Measured slower on both cores (see observer.SPLIT_HISTOGRAM): one native thread per batch."""
    assert observer_module.SPLIT_HISTOGRAM is False
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: 2)
        assert observer_module._native_threads(1 << 24) == 1
        m.setattr(observer_module, "SPLIT_HISTOGRAM", True)
        assert observer_module._native_threads(1 << 24) == 2
