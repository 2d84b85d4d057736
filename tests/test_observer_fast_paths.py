"""The observers' fast paths against the slow exact code they replaced (hypothesis, torch.equal).

* ``HistogramObserver`` bins ``|x|`` in float32 (power-of-two bin counts) instead of a float64
  copy; the reference below is the previous float64 code, verbatim.
* Every observer checks NaN/Inf on the extremes it computes (``torch.aminmax`` propagates NaN)
  instead of ``torch.isfinite(x).all()``: a NaN/Inf anywhere in a large tensor must still raise.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.errors import CalibrationError
from qcompiler.native.build import disabled, native_enabled
from qcompiler.native.kernels import NO_RANGE, HistogramState
from qcompiler.quantization import observer as observer_module
from qcompiler.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PercentileObserver,
    PerChannelMinMaxObserver,
)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)


class ReferenceHistogram(HistogramObserver):
    """The float64 binning the fast path replaced."""

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(x)
        self.min_val = torch.minimum(self.min_val, lo.float())
        self.max_val = torch.maximum(self.max_val, hi.float())
        a = x.float().abs().flatten().double()
        amax = float(a.max())
        if amax > 0.0:
            self._grow(math.ldexp(1.0, math.frexp(amax)[1]))
        r = float(self.hist_max)
        if r == 0.0:
            self.histogram[0] += a.numel()
            return
        n = self.histogram.numel()
        idx = torch.floor(a * (n / r)).long()
        self.histogram += torch.bincount(idx, minlength=n).double()


@st.composite
def batches(draw):
    out = []
    for k in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 3000))
        exponent = draw(st.integers(-140, 120))  # subnormals to near the float32 maximum
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        x = torch.randn(n, generator=g) * 2.0 ** exponent
        if draw(st.booleans()):  # exact bin edges and zeros
            x = torch.round(x * 2.0 ** -exponent * 8) / 8 * 2.0 ** exponent
        if draw(st.booleans()):
            x = x.relu()
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16]))
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@SETTINGS
@given(xs=batches(), bins=st.sampled_from([2048, 1024, 2, 3, 1000, 2047, 1 << 14, 1 << 15]))
def test_histogram_binning_equals_the_float64_reference(native, xs, bins):
    """Both binning paths: the native one pass (when it builds here) and torch's."""
    if native and not native_enabled():
        pytest.skip("native kernels are off on this machine")
    fast, ref = HistogramObserver(bins=bins), ReferenceHistogram(bins=bins)
    with contextlib.nullcontext() if native else disabled():
        for x in xs:
            if not bool(torch.isfinite(x.float()).all()):  # float16 overflow of the drawn values
                return
            fast(x)
            ref(x)
    for name in ("histogram", "hist_max", "min_val", "max_val"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert torch.equal(fast.calculate_amax(), ref.calculate_amax())


def test_histogram_fast_path_is_taken_for_the_default_bins():
    # the reference pins the results; this pins that the default takes the float32 path
    x = torch.randn(1000)
    assert HistogramObserver._bin_index(x, 4096, 8.0).dtype == torch.int16
    assert HistogramObserver._bin_index(x, 2 ** 16, 8.0).dtype == torch.int32
    assert HistogramObserver._bin_index(x, 2000, 8.0).dtype == torch.int64


OBSERVERS = [MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver,
             MovingAveragePerChannelMinMaxObserver, HistogramObserver, PercentileObserver]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("make", OBSERVERS, ids=lambda c: c.__name__)
def test_one_bad_value_anywhere_in_a_large_tensor_raises(make, bad):
    # vectorized reductions: the bad value at the start, in the middle, in the tail of a chunk
    for where in (0, 12345, 4 * 64 * 64 * 16 - 1):
        o = make()
        x = torch.randn(4, 64, 64, 16)
        x.view(-1)[where] = bad
        with pytest.raises(CalibrationError, match="saw NaN/Inf"):
            o(x)
        assert not o.has_observed
        o(torch.randn(4, 64, 64, 16))  # and good data still goes in afterwards
        assert o.has_observed


@pytest.mark.parametrize("threads", [1, 2])
def test_bincount_split_over_two_threads_is_exact(threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        for numel in (observer_module._SPLIT_BINCOUNT - 1, observer_module._SPLIT_BINCOUNT, 3_000_001):
            index = torch.randint(0, 4096, (numel,), generator=g).to(torch.int16)
            index[-1] = 4095  # the tail of the second half
            index[0] = 0
            assert torch.equal(observer_module._bincount(index, 4096), torch.bincount(index, minlength=4096))
    finally:
        torch.set_num_threads(saved)


def test_split_bincount_makes_its_own_helper_after_a_fork(monkeypatch):
    # a forked child inherits the parent's pool object but not its thread: a pool recorded under
    # another pid must be replaced, not used (simulated: a shut-down pool under a foreign pid)
    from concurrent.futures import ThreadPoolExecutor

    dead = ThreadPoolExecutor(1)
    dead.shutdown()
    monkeypatch.setattr(observer_module, "_bincount_helper", (-1, dead))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        index = torch.randint(0, 4096, (observer_module._SPLIT_BINCOUNT,)).to(torch.int16)
        assert torch.equal(observer_module._bincount(index, 4096), torch.bincount(index, minlength=4096))
        assert observer_module._bincount_helper[1] is not dead
    finally:
        torch.set_num_threads(saved)


@SETTINGS
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_per_channel_extremes_equal_aminmax_along_the_channel(shape, axis, seed):
    # amin / amax replace torch.aminmax(dim=1), which is ~100x slower on CPU
    axis = axis % len(shape)
    g = torch.Generator().manual_seed(seed)
    o = PerChannelMinMaxObserver(ch_axis=axis)
    x = torch.randn(*shape, generator=g)
    o(x)
    lo, hi = torch.aminmax(x.movedim(axis, 0).reshape(shape[axis], -1), dim=1)
    assert torch.equal(o.min_val, lo) and torch.equal(o.max_val, hi)


@pytest.mark.skipif(not native_enabled(), reason="native kernels are off on this machine")
def test_float32_batches_take_the_one_pass_path_and_match_the_reference(monkeypatch):
    """Float32 batches are observed in one native pass (min, max and counts, the range widened on the
    way: the first batch, and one past the range); float16/64 take the two-pass torch path; the
    state equals the float64 reference throughout."""
    calls = []
    real = HistogramState.observe
    monkeypatch.setattr(HistogramState, "observe", lambda st, *a: calls.append(real(st, *a)) or calls[-1])
    g = torch.Generator().manual_seed(11)
    big = torch.randn(4, 8, 16, 16, generator=g) * 4
    fast, ref = HistogramObserver(), ReferenceHistogram()
    edge = torch.tensor([2.0 ** 3 - 2.0 ** -21, 0.0, -0.0, 2.0 ** -140, -1.5])  # just inside 2**3, zeros, subnormal
    feeds = [big, big.relu() / 3, edge, torch.randn(1000, generator=g) * 100,  # the last one grows the range
             big.double(), big.transpose(1, 3), (big / 7).half(), big[:, :, ::2]]
    for x in feeds:
        fast(x)
        ref(x)
        for name in ("histogram", "hist_max", "min_val", "max_val"):
            assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    # taken for feeds 1 (no range yet), 2, 3, 4 (past the range: grows it), 6 and 8 (non-contiguous
    # float32, copied); the observer's grid before and after each: 2**4 above |big| (< 16), 2**9 after feed 4
    assert [c[0] for c in calls] == [NO_RANGE, 4, 4, 4, 9, 9]
    assert [c[1] for c in calls] == [4, 4, 4, 9, 9, 9]
    assert torch.equal(fast.calculate_amax(), ref.calculate_amax())


@pytest.mark.skipif(not native_enabled(), reason="native kernels are off on this machine")
def test_the_native_state_follows_replaced_buffers_and_moves_the_extremes_in_place():
    """The native call reads and writes the observer's buffers through pointers taken for the buffer
    objects it was built for: the extremes move in place (the same objects), a buffer replaced by a
    new object (a loaded or seeded state) is the one written next, and with the kernels turned off
    the torch path gives the reference state."""
    g = torch.Generator().manual_seed(5)
    o, ref = HistogramObserver(), ReferenceHistogram()
    x1, x2 = torch.randn(3000, generator=g), torch.randn(3000, generator=g) * 3
    for x in (x1, x2):
        before = o.min_val, o.max_val
        o(x)
        ref(x)
        assert o.min_val is before[0] and o.max_val is before[1]  # in place
    o.min_val, ref.min_val = torch.tensor(100.0), torch.tensor(100.0)  # new objects, above the next minimum
    x3 = torch.randn(500, generator=g)
    o(x3)
    ref(x3)
    assert float(o.min_val) == float(x3.min())  # written into the new object, not the old one
    with disabled():
        x4 = torch.randn(700, generator=g) * 5
        o(x4)
        ref(x4)
    for name in ("histogram", "hist_max", "min_val", "max_val"):
        assert torch.equal(getattr(o, name), getattr(ref, name)), name


@pytest.mark.skipif(not native_enabled(), reason="native kernels are off on this machine")
@pytest.mark.parametrize("how", ["assign", "data"])
def test_a_buffer_that_changes_dtype_in_place_is_not_written_as_float32(how):
    """The same buffer objects turned float64 in place (``load_state_dict(assign=True)`` in swap mode, or
    ``.data =``) after the native state was built: the next batch takes the torch path and gives the right
    extremes (written through the old float32 view they came out as -2.0000014 / 1.0000002)."""
    o = HistogramObserver()
    o(torch.tensor([1.0, -2.0]))
    lo, hi = o.min_val, o.max_val
    if how == "assign":
        sd = {k: v.double() if k in ("min_val", "max_val") else v.clone() for k, v in o.state_dict().items()}
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            o.load_state_dict(sd, assign=True)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
    else:
        o.min_val.data, o.max_val.data = o.min_val.data.double(), o.max_val.data.double()
    assert o.min_val is lo and o.max_val is hi and o.min_val.dtype == torch.float64  # the same objects
    o(torch.tensor([100.0, -50.0]))
    assert float(o.min_val) == -50.0 and float(o.max_val) == 100.0


@pytest.mark.skipif(not native_enabled(), reason="native kernels are off on this machine")
def test_buffers_the_native_call_does_not_take_are_left_to_the_checked_path():
    """A ``hist_max`` that is not 0 or a power of two, or a float64 extreme (states loaded from
    elsewhere): the native call declines and changes nothing, and the observer takes its torch path."""
    o = HistogramObserver()
    o(torch.randn(1000) * 3)
    st = HistogramState.of(o.histogram, o.hist_max, o.min_val, o.max_val)
    assert st is not None
    o.hist_max.fill_(3.0)
    before = {k: getattr(o, k).clone() for k in ("histogram", "hist_max", "min_val", "max_val")}
    assert st.observe(torch.randn(100) * 10, 1) is None
    for k, v in before.items():
        assert torch.equal(getattr(o, k), v), k
    assert HistogramState.of(o.histogram, o.hist_max, o.min_val.double(), o.max_val) is None
    assert HistogramState.of(o.histogram.float(), o.hist_max, o.min_val, o.max_val) is None
    assert HistogramState.of(o.histogram[::2], o.hist_max, o.min_val, o.max_val) is None
    calls = []
    real = observer_module.HistogramObserver._observe_native
    o2 = HistogramObserver()
    o2.min_val = torch.tensor(float("inf"), dtype=torch.float64)  # a float64 state
    with pytest.MonkeyPatch.context() as m:
        m.setattr(observer_module.HistogramObserver, "_observe_native",
                  lambda self, x: calls.append(real(self, x)) or calls[-1])
        o2(torch.randn(200))
    assert calls == [False] and o2.has_observed  # declined, then observed by the torch path


@pytest.mark.skipif(not native_enabled(), reason="native kernels are off on this machine")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_bad_value_inside_the_range_still_raises_and_changes_nothing(bad):
    o = HistogramObserver()
    o(torch.randn(4, 64, 64, 16))  # sets the range: later batches try the one-pass path
    before = {k: getattr(o, k).clone() for k in ("histogram", "hist_max", "min_val", "max_val")}
    for where in (0, 12345, 4 * 64 * 64 * 16 - 1):
        x = torch.randn(4, 64, 64, 16) * 0.1
        x.view(-1)[where] = bad
        with pytest.raises(CalibrationError, match="saw NaN/Inf"):
            o(x)
        for k, v in before.items():
            assert torch.equal(getattr(o, k), v), k


@pytest.mark.skipif(not native_enabled(), reason="native kernels are off")
def test_the_native_histogram_uses_the_torch_threads_for_large_batches(monkeypatch):
    """A large batch (from _NATIVE_PART values on) is binned on as many threads as torch uses, a
    small one on one; the state is that of one thread either way.  (The split's runtime is made
    available to the observer here: torch's OpenMP team where the kernels find it, else the pool.)"""
    seen = []
    real = HistogramState.observe

    def spy(state, x, threads=1):
        seen.append(threads)
        return real(state, x, threads)

    monkeypatch.setattr(HistogramState, "observe", spy)
    monkeypatch.setattr(observer_module, "SPLIT_HISTOGRAM", True)
    monkeypatch.setattr(observer_module, "parallel_entry", lambda: 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    g = torch.Generator().manual_seed(3)
    big, small = torch.randn(8, 64, 32, 32, generator=g).relu(), torch.randn(4, 1000, generator=g)
    one, two = HistogramObserver(), HistogramObserver()
    for x in (big * 4.0, big, small):  # the first batch sets the range; the others are binned in range
        two(x)
    assert seen == [2, 2, 1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for x in (big * 4.0, big, small):
        one(x)
    assert seen == [2, 2, 1, 1, 1, 1]
    for k, v in one.state_dict().items():
        assert torch.equal(two.state_dict()[k], v), k
