"""Calibration on several threads gives bit for bit the one-thread state, and the native
per-channel min/max equals torch's (docs/performance.md, "Calibration on both cores").

At ``torch.get_num_threads() > 1`` the histogram observers bin a large batch on torch's own OpenMP
team (``qc_hist_abs_f32_mt`` through ``GOMP_parallel``; without it, the native pool
``qc_run_rows``): the threads take chunks of values from a shared counter, each counts into its
own partial histogram, and the integer partial counts are added.  These tests hold both paths to
the torch reference (``bincount`` of the float64 floor) and to the one-thread result, for random
data, chunk sizes, thread counts and batch splits, with torch.equal.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.native import openmp
from qcompiler.native.build import disabled, native_enabled
from qcompiler.native.kernels import (
    NO_RANGE,
    HistogramState,
    histogram_abs,
    histogram_abs_grow,
    histogram_abs_minmax,
    rows_minmax,
    rows_minmax_merge,
)
from qcompiler.quantization import observer as observer_module
from qcompiler.quantization import prepare_calibration_fx
from qcompiler.quantization.observer import (
    HistogramObserver,
    MovingAveragePerChannelMinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
)
from qcompiler.quantization.qconfig import get_default_calib_qconfig

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None)
needs_native = pytest.mark.skipif(not native_enabled(), reason="native kernels are off")
ROOT = Path(__file__).resolve().parent.parent
needs_omp = pytest.mark.skipif(openmp.parallel_entry() is None, reason="torch's OpenMP runtime not found")


@pytest.fixture
def torch_threads():
    """Set torch's intra-op threads for a test; restored after it."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def _data(numel: int, exponent: int, zeros: float, seed: int) -> torch.Tensor:
    """Gaussian values times 2**exponent with about a ``zeros`` fraction of exact zeros (a ReLU's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 2.0 ** exponent
    return torch.where(torch.rand(numel, generator=g) < zeros, torch.zeros(()), x)


# ---------------------------------------------------------------------------- the native kernel


@needs_native
@SETTINGS
@given(st.integers(1, 20000), st.integers(-130, 120), st.sampled_from([2, 3, 1000, 4096, 1 << 15]),
       st.integers(1, 7), st.integers(1, 5000), st.booleans(), st.sampled_from([0.0, 0.5, 0.95]),
       st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_threaded_histogram_equals_the_torch_reference(numel, exponent, nbins, threads, chunk, omp, zeros, pow2,
                                                       seed):
    """Any thread count and chunk size, on torch's OpenMP team or the native pool, gives the
    bincount of the exact floor and min/max of x, bit for bit; a non-power-of-two per_unit takes
    the float64 product."""
    x = _data(numel, exponent, zeros, seed)
    amax = float(x.abs().max())
    if amax == 0.0:
        return
    r = math.ldexp(1.0, math.frexp(amax)[1])
    per_unit = nbins / r if pow2 else (nbins - 0.5) / r
    base = torch.arange(nbins, dtype=torch.float64)  # counts are added to what is there
    hist = base.clone()
    mm = histogram_abs_minmax(x, per_unit, hist, threads, chunk, omp)
    want = torch.bincount(torch.floor(x.abs().double() * per_unit).long(), minlength=nbins).double()
    assert torch.equal(hist, base + want)
    assert mm == (float(x.min()), float(x.max()))
    plain = base.clone()
    histogram_abs(x, per_unit, plain, threads, chunk, omp)
    assert torch.equal(plain, hist)
    one = base.clone()
    assert histogram_abs_minmax(x, per_unit, one, 1) == mm
    assert torch.equal(one, hist)


@needs_native
@pytest.mark.parametrize("omp", [True, False])
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("bad", [8.0, float("nan"), float("-inf")])
def test_a_bad_value_in_any_chunk_leaves_the_histogram_unchanged(omp, threads, bad):
    n, chunk = 3001, 500
    for where in (0, chunk - 1, chunk, 3 * chunk + 7, n - 2, n - 1):
        x = torch.rand(n) * 7.9
        x[where] = bad
        hist = torch.arange(4096, dtype=torch.float64)
        assert histogram_abs_minmax(x, 4096 / 8.0, hist, threads, chunk, omp) is None, where
        with pytest.raises(ConfigError, match="NaN or at least the range"):
            histogram_abs(x, 4096 / 8.0, hist, threads, chunk, omp)
        assert torch.equal(hist, torch.arange(4096, dtype=torch.float64)), where


@needs_native
def test_more_threads_than_values_and_bad_thread_counts():
    x = torch.tensor([0.5, -3.0])
    for omp in (True, False):
        hist = torch.zeros(8, dtype=torch.float64)
        assert histogram_abs_minmax(x, 8 / 4.0, hist, 64, 1, omp) == (-3.0, 0.5)
        assert hist.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="threads must be a positive int"):
            histogram_abs(x, 2.0, hist, threads)
    for chunk in (0, -3, 2.0, False):
        with pytest.raises(ConfigError, match="chunk must be a positive int"):
            histogram_abs(x, 2.0, hist, 2, chunk)


@needs_native
@pytest.mark.parametrize("omp", [True, False] if openmp.parallel_entry() is not None else [False])
def test_a_split_where_both_threads_binned_equals_one_thread(torch_threads, omp):
    """Every part bins at least its first chunk, so the random tests above always add several
    partials; which *thread* runs a part depends on scheduling (a late helper leaves its part to
    the caller).  Here calls are repeated until one reports (``used``) that two threads binned
    values at once, and every call's histogram and min/max must be the one-thread result."""
    torch_threads(2)
    x = _data(1 << 21, 3, 0.5, 11)
    per_unit = 4096 / 64.0  # every |x| below 64 (a range of 32 had values past it: every call stopped early)
    one = torch.zeros(4096, dtype=torch.float64)
    want = histogram_abs_minmax(x, per_unit, one, 1)
    assert want is not None and int(one.sum()) == x.numel()
    seen = []
    for _ in range(40):
        torch.mm(torch.rand(128, 128), torch.rand(128, 128))  # as in calibration: right after a torch op
        used, hist = [], torch.zeros(4096, dtype=torch.float64)
        assert histogram_abs_minmax(x, per_unit, hist, 2, 4096, omp, used) == want
        assert torch.equal(hist, one)
        seen += used
        if used == [2]:
            break
    else:  # every result was checked; only the overlap was not seen (the other core stayed busy)
        pytest.skip(f"the second thread never binned a chunk in 40 calls (threads per call: {seen})")


_TEAM_CHECK = """
import os, torch
from qcompiler.native.kernels import histogram_abs
torch.set_num_threads(2)
torch.mm(torch.rand(256, 256), torch.rand(256, 256))  # torch's OpenMP team exists
threads = lambda: len(os.listdir("/proc/self/task"))
x, hist = torch.rand(1 << 20) * 3.0, torch.zeros(4096, dtype=torch.float64)
before = threads()
histogram_abs(x, 4096 / 4.0, hist, 2)
team = threads()
histogram_abs(x, 4096 / 4.0, hist, 2, omp=False)
print(before, team, threads(), int(hist.sum().item()))
"""


@needs_omp
def test_the_split_runs_on_torchs_openmp_team():
    """In a fresh process: the split on torch's team starts no thread (torch's worker bins half),
    the native pool starts its helper (what the OpenMP path avoids)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _TEAM_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, team, pool, total = map(int, out.stdout.split())
    assert team == before and pool == before + 1 and total == 2 << 20


def test_parallel_entry_needs_torchs_openmp_backend_and_one_runtime(monkeypatch):
    """Not OpenMP (e.g. a native thread pool), or two OpenMP runtimes in the process (which one
    torch uses is unknown): None, and the observers bin on one thread."""
    monkeypatch.setattr(openmp, "_entry", openmp._MISSING)
    real = openmp._loaded_runtimes()
    if "parallel backend: OpenMP" in torch.__config__.parallel_info() and len(real) == 1:
        assert isinstance(openmp.parallel_entry(), int)
    monkeypatch.setattr(openmp, "_entry", openmp._MISSING)
    monkeypatch.setattr(openmp, "_loaded_runtimes", lambda: {"/a/libgomp.so.1", "/b/libiomp5.so"})
    assert openmp.parallel_entry() is None
    monkeypatch.setattr(openmp, "_entry", openmp._MISSING)
    monkeypatch.setattr(openmp, "_loaded_runtimes", lambda: set(real))
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: "ATen parallel backend: native thread pool")
    assert openmp.parallel_entry() is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert observer_module._native_threads(1 << 24) == 1


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
       st.integers(2, 5), st.integers(1, 700), st.integers(1, 400), st.booleans(),
       st.sampled_from(["mse", "kl", "percentile"]))
def test_observers_on_threads_equal_one_thread_sequential(batches, threads, part, chunk, omp, method):
    """Each batch binned on ``threads`` threads (from ``part`` values on, ``chunk`` values at a
    time), and each batch split at a random point into two batches, give the state and qparams of
    one thread seeing the batches whole."""
    data = [_data(n, e, z, s) for n, e, z, s, _ in batches]
    one = HistogramObserver(method=method)
    for x in data:
        one(x)
    many = HistogramObserver(method=method)
    calls = []
    real = HistogramState.observe

    def spy(state, x, threads=1):
        calls.append(threads)
        return real(state, x, threads, chunk, omp)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: threads)
        m.setattr(observer_module, "_NATIVE_PART", part)
        m.setattr(HistogramState, "observe", spy)
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
@needs_omp
@pytest.mark.parametrize("observer", ["histogram-mse", "percentile", "kl"])
def test_calibrating_a_model_on_two_threads_equals_one_thread(monkeypatch, torch_threads, observer):
    """The staged flow (the user calls the calibration model on batches) with torch on two threads:
    every observer's state and scale with the histograms split over torch's OpenMP team (a few
    hundred values at a time) equals the run with every histogram binned on one thread, bit for
    bit.  (The float forward stays on two threads in both runs: torch's own ops may round
    differently on one, e.g. this net's 1x1 conv output differs in its last bits.)"""
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(2, 3, 40, 40)
    batches = [torch.randn(4, 3, 40, 40) * s for s in (1.0, 3.0, 0.5, 2.0)]
    torch_threads(2)

    def calibrate(split: bool) -> dict:
        cal = prepare_calibration_fx(net, {"": get_default_calib_qconfig(observer=observer)},
                                     hybrid=True, example_inputs=(x,)).eval()
        calls = []
        real_grow, real_plain = HistogramState.observe, observer_module.histogram_abs

        def spy(real):
            def call(x, per_unit, hist, threads=1):
                calls.append(threads)
                return real(x, per_unit, hist, threads, 64)
            return call

        def spy_state(state, x, threads=1):
            calls.append(threads)
            return real_grow(state, x, threads, 64)

        with monkeypatch.context() as m:
            m.setattr(observer_module, "SPLIT_HISTOGRAM", split)
            m.setattr(observer_module, "_NATIVE_PART", 1000)
            m.setattr(HistogramState, "observe", spy_state)
            m.setattr(observer_module, "histogram_abs", spy(real_plain))
            with torch.no_grad():
                for b in batches:
                    cal(b)
        assert max(calls) == (2 if split else 1)  # the large batches were split on torch's two threads
        obs = {n: o for n, o in cal.named_modules() if isinstance(o, ObserverBase)}
        assert sum(isinstance(o, HistogramObserver) for o in obs.values()) >= 4
        assert sum(isinstance(o, PerChannelMinMaxObserver) for o in obs.values()) >= 3
        return obs

    one, two = calibrate(False), calibrate(True)
    assert one.keys() == two.keys()
    for name in one:
        _assert_same(one[name], two[name])


# ---------------------------------------------------------------------------- the growing histogram


def _grow_reference(x: torch.Tensor, e0: int, base: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The grid exponent and counts the one-pass kernel must give: ``base`` (counts on 2**e0) merged
    onto the final grid with the observer's torch rebinning, plus bincount of the exact float64 floor."""
    amax = float(x.abs().max())
    e = e0
    if amax > 0.0:
        need = math.frexp(amax)[1]
        e = need if e0 == NO_RANGE else max(e0, need)
    if e == NO_RANGE:
        out = base.clone()
        out[0] += x.numel()
        return e, out
    old = 0.0 if e0 == NO_RANGE else math.ldexp(1.0, e0)
    merged = HistogramObserver._rebinned(base, old, math.ldexp(1.0, e)).clone()
    n = base.numel()
    idx = torch.floor(x.abs().double() * (n / math.ldexp(1.0, e))).long()
    return e, merged + torch.bincount(idx, minlength=n).double()


@needs_native
@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(-140, 120), st.sampled_from([0.0, 0.5, 1.0])),
                min_size=1, max_size=4),
       st.one_of(st.just(None), st.integers(-150, 130)), st.sampled_from([2, 3, 1000, 4096, 1 << 15]),
       st.integers(1, 7), st.integers(1, 3000), st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_growing_histogram_equals_the_torch_reference(pieces, e0, nbins, threads, chunk, omp, seed):
    """The first-batch kernel (range found while binning, the counts merged onto a wider grid when a
    chunk needs one) gives the grid and counts of the two-pass torch path -- the old bins merged by
    the observer's rebinning, then the bincount of the exact floor on the final grid -- and min/max
    of x, bit for bit, for pieces of growing or shrinking magnitude (all-zero ones too), any grid on
    entry (none, below or above what x needs), thread count and chunk size."""
    x = torch.cat([_data(n, e, z, seed + i) for i, (n, e, z) in enumerate(pieces)])
    e0 = NO_RANGE if e0 is None else e0
    base = torch.zeros(nbins, dtype=torch.float64)
    if e0 == NO_RANGE:
        base[0] = 7.0  # zeros seen before: bin 0 only
    else:
        base += torch.arange(nbins, dtype=torch.float64)
    want_e, want = _grow_reference(x, e0, base)
    hist = base.clone()
    got = histogram_abs_grow(x, e0, hist, threads, chunk, omp)
    assert got is not None
    assert got == (want_e, float(x.min()), float(x.max()))
    assert torch.equal(hist, want)
    one = base.clone()
    assert histogram_abs_grow(x, e0, one, 1) == got and torch.equal(one, hist)  # one thread, one chunk


@needs_native
@pytest.mark.parametrize("threads, chunk", [(1, 1 << 30), (2, 100_003), (3, 262_137)])
@pytest.mark.parametrize("numel", [262_136, 262_137, 1_000_003])
def test_long_runs_of_one_bin_are_counted_past_the_uint16_copies(numel, threads, chunk):
    """Blocks whose neighbours repeat are counted through four uint16 copies drained every 262136 values
    (kernels.c, HIST_SUBS), others directly: a million values in one bin, a few bins, streams that
    switch between the two kinds of block, around the drain point, are counted exactly."""
    g = torch.Generator().manual_seed(numel)
    runs = torch.rand(numel // 64 + 1, generator=g).repeat_interleave(64)[:numel] * 0.99  # runs of 64
    spread = torch.rand(numel, generator=g) * 0.99
    mixed = torch.where((torch.arange(numel) // 1500) % 2 == 0, runs, spread)  # blocks of each kind
    for x in (torch.full((numel,), 0.75),
              torch.tensor([0.75, 0.25, 0.75, 0.5, 0.125, 0.75, 0.0]).repeat(numel // 7 + 1)[:numel], mixed):
        want = torch.bincount(torch.floor(x.double() * 4096).long(), minlength=4096).double()
        hist = torch.zeros(4096, dtype=torch.float64)
        histogram_abs(x, 4096.0, hist, threads, chunk)
        assert torch.equal(hist, want)
        grown = torch.zeros(4096, dtype=torch.float64)
        grown[0] = 1.0  # zeros seen before: no grid yet
        assert histogram_abs_grow(x, NO_RANGE, grown, threads, chunk) == (0, float(x.min()), float(x.max()))
        want[0] += 1.0
        assert torch.equal(grown, want)


@needs_native
@SETTINGS
@given(st.integers(1, 300_000), st.integers(1, 64), st.integers(-130, 120),
       st.sampled_from([2, 1000, 4096, 8192, 1 << 14]), st.integers(1, 4), st.integers(1, 200_000), st.booleans(),
       st.integers(0, 2 ** 31 - 1))
def test_runs_of_repeated_values_equal_the_torch_reference(numel, run, exponent, nbins, threads, chunk, omp, seed):
    """Values repeated in runs (neighbouring pixels), the blocks kernels.c counts through its uint16 copies:
    the plain and the growing kernel give the bincount of the exact floor, bit for bit, for any size,
    run length, bin count (with and without copies), thread count and chunk."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(numel // run + 1, generator=g) * 2.0 ** exponent).repeat_interleave(run)[:numel]
    amax = float(x.abs().max())
    if amax == 0.0:
        return
    r = math.ldexp(1.0, math.frexp(amax)[1])
    want = torch.bincount(torch.floor(x.abs().double() * (nbins / r)).long(), minlength=nbins).double()
    hist = torch.zeros(nbins, dtype=torch.float64)
    histogram_abs(x, nbins / r, hist, threads, chunk, omp)
    assert torch.equal(hist, want)
    grown = torch.zeros(nbins, dtype=torch.float64)
    e = math.frexp(amax)[1]
    assert histogram_abs_grow(x, NO_RANGE, grown, threads, chunk, omp) == (e, float(x.min()), float(x.max()))
    assert torch.equal(grown, want)


@needs_native
def test_a_grid_widened_after_a_drain_keeps_every_count():
    """Half a million values on a narrow grid (drained into the uint32 counts on the way), then one
    chunk that needs a grid 2**4 wider: the counts so far merge onto it, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(500_000, generator=g) * 0.9, torch.rand(50_000, generator=g) * 30.0 - 15.0])
    base = torch.arange(4096, dtype=torch.float64)
    want_e, want = _grow_reference(x, 0, base)
    hist = base.clone()
    assert histogram_abs_grow(x, 0, hist, 1, 300_001) == (want_e, float(x.min()), float(x.max()))
    assert want_e == 4 and torch.equal(hist, want)


@needs_native
@pytest.mark.parametrize("omp", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_bad_value_leaves_the_growing_histogram_unchanged(omp, bad):
    """NaN/Inf anywhere (the first chunk, a chunk edge, after the grid grew, the last value): None
    and the histogram untouched, on one and on several threads."""
    for threads in (1, 3):
        for where in (0, 99, 100, 2500, 4999):
            x = torch.linspace(-1.0, 1.0, 5000) * torch.linspace(1.0, 64.0, 5000)  # grows chunk by chunk
            x[where] = bad
            for e0 in (NO_RANGE, 2, 9):
                hist = torch.arange(64, dtype=torch.float64) if e0 != NO_RANGE else torch.zeros(64, dtype=torch.float64)
                before = hist.clone()
                assert histogram_abs_grow(x, e0, hist, threads, 100, omp) is None, (threads, where, e0)
                assert torch.equal(hist, before)


def test_growing_histogram_rejects_bad_arguments():
    x, hist = torch.ones(10), torch.zeros(8, dtype=torch.float64)
    for kwargs, match in (({"threads": 0}, "threads"), ({"chunk": 0}, "chunk"), ({"e0": 1000}, "e0"),
                          ({"e0": 1.5}, "e0")):
        with pytest.raises(ConfigError, match=match):
            histogram_abs_grow(x, kwargs.pop("e0", 0), hist, **kwargs)
    with pytest.raises(ConfigError, match="float32"):
        histogram_abs_grow(x.double(), 0, hist)
    with pytest.raises(ConfigError, match="contiguous"):
        histogram_abs_grow(torch.ones(4, 4).t(), 0, hist)
    with pytest.raises(ConfigError, match="1-d"):
        histogram_abs_grow(x, 0, torch.zeros(2, 2, dtype=torch.float64))


@needs_native
@settings(SETTINGS, max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(-30, 30), st.sampled_from([0.0, 0.5, 1.0]),
                          st.integers(0, 2 ** 31 - 1)), min_size=1, max_size=5),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from(["mse", "kl", "percentile"]))
def test_histogram_observer_native_equals_the_torch_path(batches, dtype, method):
    """An observer fed through the one-pass kernel (float32) has the state and qparams of one fed
    through the checked torch path (the native kernels off), batch after batch: first batches of
    zeros only, ranges that grow and shrink."""
    data = [_data(n, e, z, s).to(dtype) for n, e, z, s in batches]
    fast, slow = HistogramObserver(method=method), HistogramObserver(method=method)
    for x in data:
        fast(x)
        with disabled():
            slow(x)
        for name in ("histogram", "hist_max", "min_val", "max_val"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    if fast.has_observed:
        _assert_same(fast, slow)


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


@needs_native
@SETTINGS
@given(st.integers(1, 40), st.integers(1, 300), st.integers(-60, 60), st.sampled_from([0.0, 0.5]),
       st.integers(0, 2 ** 31 - 1), st.integers(0, 2 ** 31 - 1))
def test_rows_minmax_merge_equals_torch_minimum_maximum(rows, cols, exponent, zeros, seed, seed2):
    x = _data(rows * cols, exponent, zeros, seed).reshape(rows, cols)
    old_lo, old_hi = _data(rows, exponent, zeros, seed2), _data(rows, exponent, zeros, seed2 + 1)
    keep = (old_lo.clone(), old_hi.clone())
    lo, hi = rows_minmax_merge(x, old_lo, old_hi)
    assert torch.equal(lo, torch.minimum(old_lo, x.amin(1))) and torch.equal(hi, torch.maximum(old_hi, x.amax(1)))
    assert torch.equal(old_lo, keep[0]) and torch.equal(old_hi, keep[1])  # new tensors, the old untouched
    assert lo.data_ptr() != old_lo.data_ptr() and hi.data_ptr() != old_hi.data_ptr()
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y.view(-1)[seed % y.numel()] = bad
        assert rows_minmax_merge(y, old_lo, old_hi) is None
    with pytest.raises(ConfigError, match="one per row"):
        rows_minmax_merge(x, old_lo[:0], old_hi)


@needs_native
@SETTINGS
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 3),
       st.lists(st.sampled_from(["same", "scaled", "new", "data-write"]), min_size=1, max_size=5),
       st.integers(0, 2 ** 31 - 1))
def test_per_channel_observers_merged_pass_equals_the_torch_path(shape, axis, steps, seed):
    """A weight observer fed the same tensor every batch, a rescaled one, a new one, or one changed by a
    ``.data`` write (no version bump), through the merged native pass, has the state of the torch path
    (native off) after every batch; the moving-average observer keeps its own formula."""
    axis = axis % len(shape)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    fast, slow = PerChannelMinMaxObserver(ch_axis=axis), PerChannelMinMaxObserver(ch_axis=axis)
    avg_fast, avg_slow = MovingAveragePerChannelMinMaxObserver(0.3, axis), MovingAveragePerChannelMinMaxObserver(0.3, axis)
    for step in ["same"] + steps:
        if step == "scaled":
            w = w * 3.0
        elif step == "new":
            w = torch.randn(*shape, generator=g)
        elif step == "data-write":
            w.data[(0,) * len(shape)] = -50.0 if seed % 2 else 50.0
        fast(w)
        avg_fast(w)
        with disabled():
            slow(w)
            avg_slow(w)
        _assert_same(fast, slow)
        _assert_same(avg_fast, avg_slow)


@needs_native
def test_the_merged_weight_pass_is_taken_for_later_batches_only(monkeypatch):
    """The first batch (no running range), ch_axis 1, a moving average and sync_each_batch keep the
    checked path; later float32 ch_axis-0 batches take the one merged call; a NaN there still raises
    with the state unchanged."""
    calls = []
    real = observer_module.rows_minmax_merge
    monkeypatch.setattr(observer_module, "rows_minmax_merge", lambda *a: calls.append(1) or real(*a))
    w = torch.randn(8, 4, 3, 3)
    o = PerChannelMinMaxObserver()
    o(w)
    assert calls == []
    o(w * 2)
    assert calls == [1]
    for other in (PerChannelMinMaxObserver(ch_axis=1), MovingAveragePerChannelMinMaxObserver()):
        other(w)
        other(w)
    synced = PerChannelMinMaxObserver()
    synced.sync_each_batch = True
    synced(w)
    synced(w)
    o(w.double())
    assert calls == [1]
    before = {k: v.clone() for k, v in o.state_dict().items()}
    bad = w.clone()
    bad[3, 1, 2, 0] = float("nan")
    with pytest.raises(CalibrationError, match="saw NaN/Inf"):
        o(bad)
    assert calls == [1, 1]
    for k, v in before.items():
        assert torch.equal(o.state_dict()[k], v), k


def test_the_histogram_split_follows_torchs_threads(monkeypatch):
    """On torch's OpenMP team, as many threads as torch uses, from _NATIVE_PART values on."""
    monkeypatch.setattr(observer_module, "parallel_entry", lambda: 1234)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert observer_module._native_threads(1 << 24) == 2
    assert observer_module._native_threads(observer_module._NATIVE_PART) == 2
    assert observer_module._native_threads(observer_module._NATIVE_PART - 1) == 1
    monkeypatch.setattr(observer_module, "SPLIT_HISTOGRAM", False)
    assert observer_module._native_threads(1 << 24) == 1
    monkeypatch.setattr(observer_module, "SPLIT_HISTOGRAM", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert observer_module._native_threads(1 << 24) == 1
    monkeypatch.setattr(observer_module, "parallel_entry", lambda: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert observer_module._native_threads(1 << 24) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_does_not_use_the_openmp_team():
    """GNU OpenMP's team does not survive a fork (a parallel region there never returns): in a child
    forked after torch's team started, parallel_entry() is None and the histogram bins on one thread."""
    code = (
        "import os, torch\n"
        "from qcompiler.native import openmp\n"
        "from qcompiler.native.kernels import histogram_abs\n"
        "torch.set_num_threads(2)\n"
        "torch.ones(4_000_000).add_(1)\n"
        "parent = openmp.parallel_entry()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    h = torch.zeros(64, dtype=torch.float64)\n"
        "    histogram_abs(torch.rand(1 << 20), 64.0, h, threads=2)\n"
        "    print('child', openmp.parallel_entry(), int(h.sum()), flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent', parent is not None or openmp._find() is None, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert "child None 1048576" in out.stdout and "parent True" in out.stdout, out.stdout + out.stderr
