"""The native (C) kernels against the exact int64 references (hypothesis, torch.equal), their
argument checks, and the build: cache, atomic replacement, the fallback without a compiler."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bpu_reference import Tiny, geometry, weight_layer

from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.native import kernels
from qcompiler.backends.bpu.native.kernels import (
    DepthwiseConv,
    abs_sums,
    quantize_f32,
    requant_columns,
    requant_rows,
    vnni_enabled,
)
from qcompiler.backends.bpu.onednn_conv import NhwcRequant
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.native import build
from qcompiler.native.kernels import histogram_abs, histogram_abs_minmax
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

needs_native = pytest.mark.skipif(not build.native_enabled(), reason="native kernels are off on this machine")
needs_vnni = pytest.mark.skipif(not (build.native_enabled() and vnni_enabled()), reason="no AVX512-VNNI kernels here")
_OUT = {"qint8": torch.int8, "qint16": torch.int16}


@st.composite
def requant_cases(draw):
    P, O = draw(st.integers(1, 40)), draw(st.integers(1, 17))
    acc_bits = draw(st.sampled_from([0, 3, 12, 20, 24, 31]))
    acc_dtype = torch.float32 if acc_bits <= 24 and draw(st.booleans()) else torch.float64
    m_bits = draw(st.integers(0, min(30, 61 - acc_bits)))
    n_max = draw(st.integers(0, 61))
    add = draw(st.booleans())
    return dict(P=P, O=O, acc_bits=acc_bits, acc_dtype=acc_dtype, m_bits=m_bits, n_lo=draw(st.integers(0, n_max)),
                n_hi=n_max, out=draw(st.sampled_from(["qint8", "qint16"])), relu=draw(st.booleans()), add=add,
                b_dtype=draw(st.sampled_from([torch.int8, torch.int16])), mb_bits=draw(st.integers(0, 31)),
                nb=draw(st.integers(0, 61)), ties=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 31 - 1)))


def _requant_case(c):
    g = torch.Generator().manual_seed(c["seed"])
    P, O = c["P"], c["O"]
    bound = 1 << c["acc_bits"]
    acc = torch.randint(-bound, bound + 1, (P, O), generator=g)
    acc[0, 0] = -bound  # the extremes of the bound
    acc[-1, -1] = bound
    M = torch.randint(0, (1 << c["m_bits"]) + 1, (O,), generator=g)
    n = torch.randint(c["n_lo"], c["n_hi"] + 1, (O,), generator=g)
    if c["ties"]:  # x * M / 2**n exactly half-way between integers (both parities)
        M[:] = 1
        acc = (torch.randint(-64, 64, (P, O), generator=g) * 2 + 1) << torch.clamp(n - 1, min=0)
        acc = acc.clamp(-bound, bound)
    lo, hi = fp.qrange(c["out"])
    if c["relu"]:
        lo = 0
    other = Mb = None
    if c["add"]:
        b_hi = 127 if c["b_dtype"] == torch.int8 else 32767
        other = torch.randint(-b_hi - 1, b_hi + 1, (P, O), dtype=c["b_dtype"], generator=g)
        Mb = int(torch.randint(-(1 << c["mb_bits"]), (1 << c["mb_bits"]) + 1, (1,), generator=g))
    return acc, M, n, lo, hi, other, Mb, bound


@needs_native
@SETTINGS
@given(requant_cases())
def test_requant_rows_equals_the_int64_reference(c):
    acc, M, n, lo, hi, other, Mb, bound = _requant_case(c)
    out = torch.empty(acc.shape, dtype=_OUT[c["out"]])
    if other is None:
        requant_rows(acc.to(c["acc_dtype"]), M, n, lo, hi, out, acc_bound=bound)
        want = fp.requantize(acc, M, n, "qint32", axis=1).clamp(lo, hi)
    else:
        requant_rows(acc.to(c["acc_dtype"]), M, n, lo, hi, out, other, Mb, c["nb"], acc_bound=bound)
        want = fp.round_scaled_sum(acc * M, n, other.to(torch.int64) * Mb, c["nb"]).clamp(lo, hi)
    assert torch.equal(out.to(torch.int64), want)


@needs_native
@pytest.mark.parametrize("add", [False, True])
def test_requant_rows_rounds_half_to_even_at_every_shift(add):
    # every shift, values k + 1/2 for odd and even k, positive and negative: ties to even
    n = torch.arange(1, 41, dtype=torch.int64)
    k = torch.arange(-6, 6, dtype=torch.int64).view(-1, 1)
    acc = (2 * k + 1) << (n - 1)  # (k + 1/2) * 2**n
    M = torch.ones(40, dtype=torch.int64)
    half_even = torch.round((2 * k + 1).double() / 2).to(torch.int64).expand(-1, 40)
    zero = torch.zeros(acc.shape, dtype=torch.int8)
    # all shifts in one call (a fused add then takes the 128-bit loop: its bound uses the widest
    # shift gap), and one shift per call (the int64 loop)
    for cols in [slice(0, 40)] + [slice(i, i + 1) for i in range(40)]:
        a, o = acc[:, cols].contiguous().double(), torch.empty(acc[:, cols].shape, dtype=torch.int8)
        bound = int(acc[:, cols].abs().max())
        if add:
            requant_rows(a, M[cols], n[cols], -128, 127, o, zero[:, cols].contiguous(), 5, 3, acc_bound=bound)
        else:
            requant_rows(a, M[cols], n[cols], -128, 127, o, acc_bound=bound)
        assert torch.equal(o.to(torch.int64), half_even[:, cols])
        assert o[6, 0] == 0 and o[7, 0] == 2  # 0.5 -> 0, 1.5 -> 2


@needs_native
@pytest.mark.parametrize("bad", ["non-contiguous", "dtype", "shape", "shift", "bound", "other-dtype", "range"])
def test_requant_rows_refuses_bad_arguments(bad):
    acc, M, n = torch.zeros(4, 3), torch.ones(3, dtype=torch.int64), torch.full((3,), 4, dtype=torch.int64)
    out, other, kw = torch.empty(4, 3, dtype=torch.int8), None, {}
    lo, hi = -128, 127
    if bad == "non-contiguous":
        acc = torch.zeros(3, 4).t()
    elif bad == "dtype":
        acc = torch.zeros(4, 3, dtype=torch.int32)
    elif bad == "shape":
        out = torch.empty(3, 4, dtype=torch.int8)
    elif bad == "shift":
        n = torch.full((3,), 63, dtype=torch.int64)
    elif bad == "bound":
        M = torch.full((3,), 1 << 40, dtype=torch.int64)
    elif bad == "other-dtype":
        other = torch.zeros(4, 3, dtype=torch.int32)
        kw = dict(other=other, Mb=1, nb=1)
    elif bad == "range":
        lo, hi = 5, 4
    with pytest.raises(ConfigError, match="requant_rows"):
        requant_rows(acc, M, n, lo, hi, out, **kw)


@needs_native
def test_nhwc_requant_native_equals_its_float64_path():
    """The simulator's epilogue with the native pass and with the float64 torch passes, on a
    channels-last accumulator (per-channel and per-tensor parameters, fused add, relu)."""
    g = torch.Generator().manual_seed(0)
    acc = torch.randint(-(1 << 20), 1 << 20, (2, 24, 7, 5), generator=g).float().contiguous(
        memory_format=torch.channels_last)
    other = torch.randint(-128, 128, (2, 24, 7, 5), dtype=torch.int8, generator=g)
    for M, n in ((torch.randint(1 << 14, 1 << 15, (24,), generator=g), torch.randint(38, 43, (24,), generator=g)),
                 (torch.tensor(23456), torch.tensor(40))):
        for add, lo in ((None, -128), ((20011, 40), 0)):
            got = [NhwcRequant(M, n, torch.int8, lo, 127, add, acc_bound=1 << 20, native=nat)(
                acc, other if add else None) for nat in (True, False)]
            assert torch.equal(got[0], got[1])


@needs_native
@settings(SETTINGS, max_examples=100)
@given(st.integers(1, 5000), st.integers(-140, 120), st.sampled_from([2, 3, 1000, 4096, 1 << 15, 1 << 16]),
       st.sampled_from(["normal", "edges", "relu runs"]), st.integers(0, 2 ** 31 - 1))
def test_histogram_abs_equals_bincount_of_the_float64_floor(numel, exponent, nbins, values, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 2.0 ** exponent
    if values == "edges":  # exact bin edges
        x = torch.round(x * 2.0 ** -exponent * 8) / 8 * 2.0 ** exponent
    elif values == "relu runs":  # an activation's shape: half exact zeros (-0.0 too), runs of equal values
        x = torch.where(x > 0, x, torch.where(x < -1, -0.0, 0.0)).repeat_interleave(3)[:numel]
    amax = float(x.abs().max())
    if amax == 0.0 or not torch.isfinite(x).all():
        return
    r = math.ldexp(1.0, math.frexp(amax)[1])  # the observer's range: a power of two above max |x|
    per_unit = nbins / r
    hist = torch.arange(nbins, dtype=torch.float64)  # counts are added to what is there
    histogram_abs(x, per_unit, hist)
    want = torch.bincount(torch.floor(x.abs().double() * per_unit).long(), minlength=nbins).double()
    assert torch.equal(hist, torch.arange(nbins, dtype=torch.float64) + want)


@needs_native
@pytest.mark.parametrize("bad", [8.0, 100.0, float("nan"), float("inf"), float("-inf"), -8.0])
def test_a_value_outside_the_range_is_never_counted(bad):
    """|x| >= r or NaN: histogram_abs raises, histogram_abs_minmax returns None; hist unchanged."""
    for where in (0, 700, 1999):
        x = torch.rand(2000) * 7.9
        x[where] = bad
        hist = torch.arange(4096, dtype=torch.float64)
        with pytest.raises(ConfigError, match="NaN or at least the range"):
            histogram_abs(x, 4096 / 8.0, hist)
        assert histogram_abs_minmax(x, 4096 / 8.0, hist) is None
        assert torch.equal(hist, torch.arange(4096, dtype=torch.float64))
    x = torch.rand(2000) * 7.9 - 3.0
    hist = torch.zeros(4096, dtype=torch.float64)
    lo, hi = histogram_abs_minmax(x, 4096 / 8.0, hist)
    assert (lo, hi) == (float(x.min()), float(x.max())) and int(hist.sum()) == 2000


@settings(SETTINGS, max_examples=60)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.sampled_from([torch.int8, torch.int16, torch.int32,
                                                                              torch.int64]),
       st.booleans(), st.integers(1, 40), st.data())
def test_abs_sums_equals_the_whole_int64_sum_and_leaves_the_weight_as_it_is(shape, dtype, signed, block, data):
    """abs_sums widens a block of rows at a time (a small block here: several per weight); the sums are
    those of the whole weight widened to int64, and an int64 weight (which ``to(int64)`` does not copy) is
    not changed by the ``abs``."""
    dims = tuple(sorted(data.draw(st.sets(st.integers(1, len(shape) - 1), min_size=1))))
    info = torch.iinfo(dtype)
    w = torch.randint(max(info.min, -(1 << 40)), min(info.max, 1 << 40), tuple(shape), dtype=torch.int64).to(dtype)
    w[0].view(-1)[0] = info.min  # the most negative value: its abs does not fit the type itself
    before = w.clone()
    wide = w.to(torch.int64)
    want = (wide if signed else wide.abs()).sum(dims)
    saved, kernels.ABS_SUMS_BLOCK = kernels.ABS_SUMS_BLOCK, block
    try:
        got = abs_sums(w, dims, signed=signed)
    finally:
        kernels.ABS_SUMS_BLOCK = saved
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(w, before)


def test_abs_sums_refuses_what_it_cannot_sum_by_rows():
    for w, dims in ((torch.ones(3, 4), (1,)), (torch.ones(3, dtype=torch.int8), (1,)),
                    (torch.ones(3, 4, dtype=torch.int8), (0, 1)), (torch.ones(3, 4, dtype=torch.int8), ()),
                    (torch.ones(3, 4, dtype=torch.int8), (-1,)), (torch.ones(3, 4, dtype=torch.int8), (2,))):
        with pytest.raises(ConfigError, match="abs_sums"):
            abs_sums(w, dims)


@needs_vnni  # the native int8 GEMM exists only in a library built for AVX512-VNNI
def test_a_large_gemm_layer_is_built_without_an_int64_copy_of_its_weight():
    """Building the native GEMM of a 4096 x 8192 int8 weight (32 MiB) must not widen the weight whole
    (256 MiB as int64, twice with its ``abs``: the peak of compile on resnet18 before).  Peak resident
    memory of a fresh process, measured around the build."""
    code = (
        "import torch\n"
        "from qcompiler.backends.bpu.native.gemm import Int8Gemm, gemm_available\n"
        "w = torch.randint(-128, 128, (4096, 8192), dtype=torch.int8)\n"
        "M, n = torch.full((4096,), 1 << 20, dtype=torch.int64), torch.full((4096,), 40, dtype=torch.int64)\n"
        "def hwm():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) << 10\n"
        "gemm_available()\n"
        "before = hwm()\n"
        "g = Int8Gemm(w, None, M, n, -128, 127, torch.int8)\n"
        "print(hwm() - before)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    grew = int(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split()[-1])
    assert grew < 128 << 20, f"building the layer raised the peak by {grew >> 20} MiB"


@needs_native
def test_histogram_abs_refuses_bad_arguments():
    hist = torch.zeros(16, dtype=torch.float64)
    for x, h, pu in ((torch.zeros(8, dtype=torch.float64), hist, 1.0), (torch.zeros(4, 4).t(), hist, 1.0),
                     (torch.zeros(8), hist.float(), 1.0), (torch.zeros(8), hist, 0.0),
                     (torch.zeros(8), torch.zeros(0, dtype=torch.float64), 1.0)):
        with pytest.raises(ConfigError, match="histogram_abs"):
            histogram_abs(x, pu, h)


# ---------------------------------------------------------------------------- build and fallback


def _fresh(monkeypatch, tmp_path, **env):
    """A fresh build cache and decision; the kernels on unless ``env`` turns them off (a run of the
    suite under QCOMPILER_NATIVE=0 must not change what these tests build)."""
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(build.ENV_DISABLE, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    build.reset()


@pytest.fixture
def restore_native():
    yield
    build.reset()


def test_without_a_compiler_everything_falls_back_with_one_warning(monkeypatch, tmp_path, restore_native):
    _fresh(monkeypatch, tmp_path, CC=str(tmp_path / "no-such-cc"))
    monkeypatch.delenv(build.ENV_DISABLE, raising=False)
    with pytest.warns(QCompilerWarning, match="native kernels are off"):
        assert build.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not build.native_enabled()  # decided once: no second warning
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))


def test_a_failing_compiler_leaves_no_file_behind(monkeypatch, tmp_path, restore_native):
    _fresh(monkeypatch, tmp_path, CC="false")
    monkeypatch.delenv(build.ENV_DISABLE, raising=False)
    with pytest.warns(QCompilerWarning, match="building the native kernels failed"):
        assert build.library() is None
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_environment_variable_turns_native_off_silently(monkeypatch, tmp_path, restore_native):
    _fresh(monkeypatch, tmp_path, **{build.ENV_DISABLE: "0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not build.native_enabled()
    with pytest.raises(ConfigError, match="native=True but the native kernels are off"):
        BpuSimulator(_tiny_program(), native=True)
    with pytest.raises(ConfigError, match="native kernels are off"):
        requant_rows(torch.zeros(1, 1), torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0, 1,
                     torch.empty(1, 1, dtype=torch.int8))


def test_disabled_restores_the_previous_state(restore_native):
    before = build.native_enabled()
    with build.disabled():
        assert not build.native_enabled()
    assert build.native_enabled() == before


def _tiny_program():
    t = Tiny(seed=1)
    x = t.input(torch.randint(-128, 128, (1, 2, 4, 4), generator=t.gen), 0.05)
    layer = weight_layer("conv2d", torch.randint(-127, 128, (3, 2, 3, 3), generator=t.gen), torch.full((3,), 0.01),
                         None, 0.05, 0.1, geometry=geometry(1, 1, 1, 1), name="conv")
    return lower_partition(t.build(t.call(layer, x, name="conv")), "bpu0")


@pytest.mark.skipif(not build.native_enabled(), reason="no working C compiler here")
def test_two_processes_building_at_once_both_load_one_library(tmp_path):
    """Racing processes compile once (the directory's lock; the others wait, then load what it built) and end
    with one complete library and its digest.  One compiler at a time also keeps the build within its limits on
    a loaded machine (it once ran three at load 11 on 2 cores and timed out after 120 s)."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"  # the real compiler, logging each compile (not --version)
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo $$ >> {log}\nexec {build._compiler()} "$@"\n')
    cc.chmod(0o755)
    code = ("import sys; from qcompiler.native import build; lib = build.library(); "
            "sys.exit(0 if lib is not None and lib.qc_abi_version() == build.ABI_VERSION else 1)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CC=str(cc), **{build.ENV_CACHE: str(tmp_path / "cache")})
    env.pop(build.ENV_DISABLE, None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT) for _ in range(3)]
    assert [p.wait(timeout=build.MAX_S + 300) for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1, "more than one process compiled"
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 2 and files[0].startswith("qc_kernels_") and files[0].endswith(".so"), files
    assert files[1] == files[0] + ".sha256"


@pytest.mark.skipif(not build.native_enabled(), reason="no working C compiler here")
def test_the_cache_key_follows_the_source(monkeypatch, tmp_path, restore_native):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.delenv(build.ENV_DISABLE, raising=False)
    first = build.library()
    assert first is not None
    kernels_c, src = build.INCLUDE / "kernels.c", tmp_path / "kernels.c"
    src.write_text(kernels_c.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(build, "SOURCES", tuple(src if s == kernels_c else s for s in build.SOURCES))
    build.reset()
    assert build.library() is not None
    assert len(list((tmp_path / "cache").glob("qc_kernels_*.so"))) == 2


@st.composite
def dw_cases(draw):
    """Depthwise geometries: kernels 1x1..5x5 and 1x9 / 9x1 (one to three groups of 4 taps per row), strides
    1-3 (the stride-1 and -2 row windows and the padded-row path), dilation 1-3, padding 0-3, inputs smaller
    than the kernel's span where the padding allows, C 1-70 (partial blocks of 16)."""
    kh, kw = draw(st.sampled_from([(1, 1), (1, 9), (9, 1)]) | st.tuples(st.integers(1, 5), st.integers(1, 5)))
    dh, dw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    h_min, w_min = max(1, dh * (kh - 1) + 1 - 2 * ph), max(1, dw * (kw - 1) + 1 - 2 * pw)
    H = draw(st.integers(h_min, max(12, h_min + 3)))
    W = draw(st.integers(w_min, max(12, w_min + 3)))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.integers(1, 70)), H=H, W=W, k=(kh, kw),
                stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))), padding=(ph, pw), dilation=(dh, dw),
                bias=draw(st.booleans()), out=draw(st.sampled_from(["qint8", "qint16"])),
                act=draw(st.sampled_from([None, "relu", "relu6"])), extreme=draw(st.booleans()),
                n=draw(st.integers(0, 40)), m_bits=draw(st.sampled_from([0, 15, 31])), vnni=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def dw_case_tensors(c):
    """A case of :func:`dw_cases` as tensors: x (N, C, H, W) int8, w, bias, M, n, the clamp range, and the
    reference -- conv2d in float64 (exact for these sums) + bias, fixed_point.requantize in int64, clamped."""
    g = torch.Generator().manual_seed(c["seed"])
    N, C, H, W = c["N"], c["C"], c["H"], c["W"]
    if c["extreme"]:  # the accumulator's extremes: +-127 weights on -128 / 127 inputs
        w = torch.where(torch.rand(C, 1, *c["k"], generator=g) < 0.5, -127, 127).to(torch.int8)
        x = torch.where(torch.rand(N, C, H, W, generator=g) < 0.5, -128, 127).to(torch.int8)
    else:
        w = torch.randint(-127, 128, (C, 1, *c["k"]), dtype=torch.int8, generator=g)
        x = torch.randint(-128, 128, (N, C, H, W), dtype=torch.int8, generator=g)
    b_max = 1 << (26 if c["m_bits"] == 31 else 20)  # 2**26 * 2**31 > 2**53: the int64 epilogue
    bias = torch.randint(-b_max, b_max, (C,), generator=g).to(torch.int32) if c["bias"] else None
    # M = 1: exact ties at every shift; 2**31: |acc * M| beyond 2**53 (the VNNI kernel's int64 epilogue)
    M = torch.randint(1, (1 << c["m_bits"]) + 1, (C,), generator=g)
    n = torch.randint(max(0, c["n"] - 3), c["n"] + 1, (C,), generator=g)
    lo, hi = fp.qrange(c["out"])
    if c["act"] == "relu":
        lo = 0
    elif c["act"] == "relu6":
        lo, hi = 0, 90
    return x, w, bias, M, n, lo, hi, _dw_reference(x, w, bias, M, n, lo, hi, c["stride"], c["padding"], c["dilation"])


def _dw_reference(x, w, bias, M, n, lo, hi, stride, padding, dilation):
    acc = torch.nn.functional.conv2d(x.double(), w.double(), None if bias is None else bias.double(), stride,
                                     padding, dilation, x.shape[1]).to(torch.int64)
    return fp.requantize(acc, M, n, "qint32", axis=1).clamp(lo, hi)


@needs_native
@SETTINGS
@given(dw_cases())
def test_depthwise_conv_equals_the_int64_reference(c):
    """The native depthwise kernel (VNNI or scalar), channels-last in and out, against the reference."""
    x, w, bias, M, n, lo, hi, want = dw_case_tensors(c)
    kernel = DepthwiseConv(w, bias, c["stride"], c["padding"], c["dilation"], M, n, lo, hi, _OUT[c["out"]],
                           vnni=c["vnni"] and vnni_enabled())
    got = kernel(x.permute(0, 2, 3, 1).contiguous())
    assert got.dtype == _OUT[c["out"]]
    assert torch.equal(got.permute(0, 3, 1, 2).to(torch.int64), want)




@needs_vnni
@settings(SETTINGS, max_examples=100)
@given(dw_cases())
def test_the_depthwise_constants_prepared_once_equal_the_ones_built_per_call(c):
    """The VNNI depthwise kernel reads its per-channel constants prepared once (``qc_gemm_prep``, the
    argument after ``out``); with it NULL it builds them itself, in every part of a split call and for
    every sample: the same bits, one call and split over 2 threads, every epilogue mode."""
    x, w, bias, M, n, lo, hi, want = dw_case_tensors(c)
    k = DepthwiseConv(w, bias, c["stride"], c["padding"], c["dilation"], M, n, lo, hi, _OUT[c["out"]], vnni=True)
    if not k.vnni:
        return  # (a +128 weight: the scalar kernel, no constants)
    xl = x.permute(0, 2, 3, 1).contiguous()
    prepared = k(xl)
    f, wptr, bptr, consts = k._call
    N, H, W, C, Ho, Wo = k._geometry(xl)
    for parts in (1, 2):
        out = torch.full_like(prepared, 77)
        args = (xl.data_ptr(), N, H, W, C, wptr, k.kh, k.kw, bptr, *k.geom, Ho, Wo, *consts, out.data_ptr(), None)
        assert (f(*args) if parts == 1 else k._call_mt(*args, parts)) == 0
        assert torch.equal(out, prepared)
    assert torch.equal(prepared.permute(0, 3, 1, 2).to(torch.int64), want)


@needs_vnni
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("out", ["qint8", "qint16"])
def test_each_vnni_depthwise_epilogue_equals_the_reference_at_its_limits(mode, out):
    """The three epilogues of qc_dwconv4_* (int64; float64; float64 rounded by 1.5 * 2**52 in one fma),
    each on a layer whose bounds select it, with accumulators at +-bound (extreme inputs and biases) and
    M / 2**n so that the largest |acc * M / 2**n| lies just below what the mode admits (2**31 - 1 for
    mode 2: a wrapped low word would clamp to the wrong end), and exact ties (M = 1)."""
    g = torch.Generator().manual_seed(mode)
    C, N, H, W = 37, 2, 9, 11
    w = torch.randint(-127, 128, (C, 1, 3, 3), generator=g).to(torch.int8)
    x = torch.randint(-128, 128, (N, C, H, W), generator=g).to(torch.int8)
    bias = torch.randint(-(1 << 12), 1 << 12, (C,), generator=g).to(torch.int32)
    bias[0], bias[5] = ((1 << 22), -(1 << 22)) if mode == 0 else (1 << 12, -(1 << 12))
    w[0], x[:, 0] = -127, -128  # channel 0 reaches +bound inside the image: 9 * 128 * 127 + max |bias|
    w[5], x[:, 5] = -127, 127  # channel 5 far below zero
    bound = DepthwiseConv.acc_bound(w, bias)
    if mode == 0:  # bound * M >= 2**53
        n = torch.full((C,), 36)
        M = torch.randint((1 << 31) - (1 << 20), 1 << 31, (C,), generator=g)
    elif mode == 1:  # bound * M < 2**53, but |acc| * M / 2**n may pass 2**31
        n = torch.full((C,), 3)
        M = torch.randint(1 << 20, 1 << 21, (C,), generator=g)
    else:  # bound * M / 2**n just below 2**31 - 1 on channel 0
        n = bound.bit_length() - 2 - torch.randint(0, 5, (C,), generator=g)  # M below 2**31
        M = (((1 << 31) - 2) << n) // bound // torch.randint(1, 4, (C,), generator=g)
        M[0] = (((1 << 31) - 2) << int(n[0])) // bound
        M[1:5], n[1:5] = 1, torch.tensor([0, 1, 2, 9])  # exact ties
    lo, hi = fp.qrange(out)
    k = DepthwiseConv(w, bias, (1, 1), (1, 1), (1, 1), M, n, lo, hi, _OUT[out], vnni=True)
    assert k.vnni and k.epilogue == mode
    got = k(x.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2).to(torch.int64)
    want = _dw_reference(x, w, bias, M, n, lo, hi, (1, 1), (1, 1), (1, 1))
    assert torch.equal(got, want)
    assert int(want.max()) == hi and int(want.min()) == lo  # the extremes were reached


@needs_vnni
@pytest.mark.parametrize("k, stride, dilation", [((3, 3), 1, 1), ((3, 3), 2, 1), ((5, 5), 1, 2), ((3, 5), 2, 1),
                                                 ((3, 3), 3, 1)])
def test_the_vnni_depthwise_conv_is_exact_over_several_row_bands(k, stride, dilation):
    """Inputs large enough that the kernel cuts the output rows into bands (DW4_BAND bytes of input each;
    the ring of widened rows restarts per band and channel block), batch 2, C not a multiple of 16."""
    g = torch.Generator().manual_seed(11)
    N, C, H, W = 2, 70, 64, 61
    assert (192 << 10) // (stride * W * C) + 1 < (H - 1) // stride  # two bands or more (DW4_BAND in kernels.c)
    w = torch.randint(-127, 128, (C, 1, *k), dtype=torch.int8, generator=g)
    bias = torch.randint(-(1 << 16), 1 << 16, (C,), generator=g).to(torch.int32)
    x = torch.randint(-128, 128, (N, C, H, W), dtype=torch.int8, generator=g)
    M, n = torch.randint(1 << 14, 1 << 15, (C,), generator=g), torch.randint(20, 24, (C,), generator=g)
    pad = (dilation * (k[0] - 1) // 2, dilation * (k[1] - 1) // 2)
    kern = DepthwiseConv(w, bias, (stride, stride), pad, (dilation, dilation), M, n, 0, 127, torch.int8, vnni=True)
    assert kern.vnni
    want = _dw_reference(x, w, bias, M, n, 0, 127, (stride, stride), pad, (dilation, dilation))
    xl = x.permute(0, 2, 3, 1).contiguous()
    assert torch.equal(kern(xl).permute(0, 3, 1, 2).to(torch.int64), want)
    assert torch.equal(kern(xl, 2).permute(0, 3, 1, 2).to(torch.int64), want)


@needs_native
def test_a_weight_of_plus_128_keeps_the_depthwise_conv_off_vnni():
    """vpdpbusd multiplies by signed bytes: a +128 weight (in range for the int64 kernel) takes the scalar one."""
    g = torch.Generator().manual_seed(2)
    C = 20
    w = torch.randint(-128, 129, (C, 1, 3, 3), generator=g, dtype=torch.int16)
    w[3, 0, 1, 1] = 128
    x = torch.randint(-128, 128, (1, C, 7, 7), generator=g).to(torch.int8)
    M, n = torch.randint(1, 1 << 15, (C,), generator=g), torch.full((C,), 20)
    k = DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), M, n, -128, 127, torch.int8, vnni=True)
    assert not k.vnni
    want = _dw_reference(x, w, None, M, n, -128, 127, (1, 1), (1, 1), (1, 1))
    assert torch.equal(k(x.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2).to(torch.int64), want)


@needs_native
def test_depthwise_conv_refuses_what_it_cannot_do_exactly():
    w = torch.ones(4, 1, 3, 3, dtype=torch.int8)
    M, n = torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
    with pytest.raises(ConfigError, match=r"\(C, 1, kh, kw\)"):
        DepthwiseConv(torch.ones(4, 2, 3, 3, dtype=torch.int8), None, (1, 1), (1, 1), (1, 1), M, n, -128, 127,
                      torch.int8)
    with pytest.raises(ConfigError, match="reaches 2\\*\\*31"):
        DepthwiseConv(w, torch.full((4,), 2 ** 31 - 10), (1, 1), (1, 1), (1, 1), M, n, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="shifts"):
        DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), M, n + 70, -128, 127, torch.int8)
    k = DepthwiseConv(w, None, (1, 1), (0, 0), (1, 1), M, n, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="channels-last"):
        k(torch.zeros(1, 5, 5, 3, dtype=torch.int8))
    with pytest.raises(ConfigError, match="smaller than the kernel"):
        k(torch.zeros(1, 2, 2, 4, dtype=torch.int8))
    with pytest.raises(ConfigError, match="contiguous"):
        k(torch.zeros(1, 4, 5, 5, dtype=torch.int8).permute(0, 2, 3, 1))


@needs_native
@pytest.mark.parametrize("act", [None, "relu6"])
def test_the_simulator_runs_depthwise_layers_natively_and_exactly(act):
    t = Tiny(seed=7)
    x = t.input(torch.randint(-128, 128, (2, 24, 9, 9), generator=t.gen), 0.05)
    layer = weight_layer("conv2d", torch.randint(-127, 128, (24, 1, 3, 3), generator=t.gen), torch.full((24,), 0.01),
                         torch.randn(24, generator=t.gen), 0.05, 0.1, geometry=geometry(2, 1, 1, 24), act=act,
                         name="conv")
    prog = lower_partition(t.build(t.call(layer, x, name="conv")), "bpu0")
    inputs = {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)}
    outs = {}
    for native in (True, False):
        sim = BpuSimulator(prog, native=native)
        kinds = {type(getattr(s[0], "whole", s[0])).__name__ for s in sim._steps}  # a conv: inside its row-split wrapper
        assert ("_NativeDepthwiseLayer" in kinds) == native, kinds
        outs[native] = {k: v.int_repr() for k, v in sim.run(inputs).items()}
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    assert outs[True].keys() == ref.keys()
    for k in ref:
        assert torch.equal(outs[True][k], ref[k]) and torch.equal(outs[False][k], ref[k])


@needs_native
@SETTINGS
@given(st.integers(0, 30), st.integers(0, 40), st.integers(0, 9), st.sampled_from([torch.int8, torch.int16]),
       st.sampled_from([torch.int8, torch.int16]), st.integers(0, 2 ** 20), st.integers(0, 62), st.booleans(),
       st.integers(0, 2 ** 31 - 1))
def test_requant_columns_equals_the_int64_reference(rows, cols, col0, src_dtype, dst_dtype, M, n, ties, seed):
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(src_dtype)
    src = torch.randint(info.min, info.max + 1, (rows, cols), dtype=src_dtype, generator=g)
    if ties and n > 0:  # exact halves: src * M = (2k + 1) * 2**(n-1)
        M = 1 << (n - 1) if n - 1 <= 40 else M
    dst = torch.full((rows, col0 + cols + 3), 77, dtype=dst_dtype)
    lo, hi = (-128, 127) if dst_dtype == torch.int8 else (-32768, 32767)
    requant_columns(src, dst, col0, M, n, lo, hi)
    want = fp.requantize(src.to(torch.int64), M, n, "qint32").clamp(lo, hi)
    assert torch.equal(dst[:, col0:col0 + cols].to(torch.int64), want)
    assert (dst[:, :col0] == 77).all() and (dst[:, col0 + cols:] == 77).all()  # nothing else written


@needs_native
def test_requant_columns_refuses_what_does_not_fit():
    src, dst = torch.zeros(4, 3, dtype=torch.int8), torch.zeros(4, 5, dtype=torch.int8)
    for args in ((src, dst, 3, 1, 0), (src, torch.zeros(5, 5, dtype=torch.int8), 0, 1, 0), (src, dst, 0, 1, 63),
                 (src, dst, 0, 1 << 60, 0), (src.t(), dst, 0, 1, 0), (src.int(), dst, 0, 1, 0)):
        with pytest.raises(ConfigError, match="requant_columns"):
            requant_columns(*args, -128, 127)


@st.composite
def quantize_cases(draw):
    return dict(shape=draw(st.sampled_from([(0,), (1,), (17,), (2, 3, 5, 7), (1, 3, 31, 33), (2, 3, 20, 13), (1, 3, 8, 8),
                                            (4, 300), (3, 16, 4, 5),
                                            (1, 1, 3, 3), (2, 5, 1, 1), (0, 3, 2, 2)])),
                exponent=draw(st.integers(-20, 4)), mantissa=draw(st.integers(1 << 23, (1 << 24) - 1)),
                dtype=draw(st.sampled_from([torch.int8, torch.int16])), ties=draw(st.booleans()),
                special=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 31 - 1)))


@needs_native
@SETTINGS
@given(quantize_cases())
def test_quantize_f32_equals_fixed_point_quantize(c):
    """Random float32 scales and values (normal, wide, exact ties m + 1/2 of both parities, the clamp's
    edges, +-inf, -0.0, subnormals): one native pass == ``fp.quantize`` bit for bit."""
    g = torch.Generator().manual_seed(c["seed"])
    scale = math.ldexp(c["mantissa"], c["exponent"] - 23)
    if c["seed"] % 5 == 0:  # the extreme float32 scales too: subnormal, the smallest normal, huge, 0.1
        scale = (2.0 ** -149, 1e-38, 2.0 ** -126, 3.4e38, 0.1)[(c["seed"] // 5) % 5]
    scale = float(torch.tensor(scale, dtype=torch.float32))
    qmax = 127 if c["dtype"] == torch.int8 else 32767
    n = math.prod(c["shape"])
    if c["ties"]:  # (m + 1/2) * s for a power-of-two s is exact in float32; the division gives the tie back
        scale = math.ldexp(1.0, c["exponent"])
        x = (torch.randint(-qmax - 3, qmax + 3, (n,), generator=g).double() + 0.5) * scale
    else:
        x = torch.randn(n, generator=g, dtype=torch.float64) * scale * qmax * 0.7
    x = x.float()
    if c["special"] and n >= 8:
        x[:8] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-45, -1e-45, (qmax + 0.5) * scale,
                              -(qmax + 1.5) * scale, 3e38])
    x = x.reshape(c["shape"])
    out = torch.empty(c["shape"], dtype=c["dtype"])
    quantize_f32(x, scale, out)
    want = fp.quantize(x, scale, "qint8" if c["dtype"] == torch.int8 else "qint16")
    assert torch.equal(out, want)
    if x.dim() == 4:  # straight into channels-last memory (the simulator's model-input quantize)
        N, C, H, W = x.shape
        nhwc = torch.full((N, H, W, C), 55, dtype=c["dtype"])
        quantize_f32(x, scale, nhwc.permute(0, 3, 1, 2))
        assert torch.equal(nhwc.permute(0, 3, 1, 2), want)


@needs_native
def test_quantize_f32_refuses_nan_and_misuse():
    x = torch.zeros(5)
    x[3] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        quantize_f32(x, 0.5, torch.empty(5, dtype=torch.int8))
    with pytest.raises(ConfigError, match="NaN"):  # the reference says the same
        fp.quantize(x, 0.5)
    with pytest.raises(ConfigError, match="float32 value"):
        quantize_f32(torch.zeros(5), 0.1, torch.empty(5, dtype=torch.int8))  # 0.1 is not a float32
    with pytest.raises(ConfigError, match="float32 value"):
        quantize_f32(torch.zeros(5), 0.0, torch.empty(5, dtype=torch.int8))
    with pytest.raises(ConfigError, match="dtype"):
        quantize_f32(torch.zeros(5), 0.5, torch.empty(5, dtype=torch.int32))
    with pytest.raises(ConfigError, match="shape"):
        quantize_f32(torch.zeros(5), 0.5, torch.empty(4, dtype=torch.int8))
    with pytest.raises(ConfigError, match="contiguous"):
        quantize_f32(torch.zeros(5, 2).t(), 0.5, torch.empty(2, 5, dtype=torch.int8))
    x4 = torch.zeros(1, 3, 2, 2)
    x4[0, 2, 1, 0] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):  # the channels-last path finds it too
        quantize_f32(x4, 0.5, torch.empty(1, 2, 2, 3, dtype=torch.int8).permute(0, 3, 1, 2))
    with pytest.raises(ConfigError, match="contiguous"):  # neither layout (a transposed H, W)
        quantize_f32(torch.zeros(1, 3, 2, 4), 0.5, torch.empty(1, 3, 4, 2, dtype=torch.int8).transpose(2, 3))


def _entry_gap_program(shape, in_dtype, out_dtype, keepdim):
    t = Tiny(seed=23)
    x = t.rand_input(shape, 0.0625, in_dtype)  # the inputs' halves: exact ties on entry
    gap = t.call(qnn.QuantizedAvgPool(0.0625, 0.03, out_dtype, keepdim=keepdim), x, name="gap")
    prog = lower_partition(t.build(gap), "bpu0")
    return prog, t


@needs_native
@settings(SETTINGS, max_examples=40)
@given(st.integers(1, 3), st.integers(1, 70), st.integers(1, 9), st.integers(1, 9),
       st.sampled_from(["qint8", "qint16"]), st.sampled_from(["qint8", "qint16"]), st.booleans(), st.booleans(),
       st.integers(0, 2 ** 31 - 1))
def test_the_simulators_quantize_and_global_pool_equal_the_reference(N, C, H, W, in_dtype, out_dtype, keepdim,
                                                                     channels_last, seed):
    """The fast ``quantize`` (native, per-tensor scale) and ``global_avg_pool`` (int32 sums, any layout)
    against ``kernels="fixed_point"``: inputs on and between the quantization grid's points (exact
    ties), channel-major and channels-last memory."""
    prog, t = _entry_gap_program((N, C, H, W), in_dtype, out_dtype, keepdim)
    g = torch.Generator().manual_seed(seed)
    x = t.inputs[0] + (torch.randint(0, 2, t.inputs[0].shape, generator=g) * 0.03125).float()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    inputs = {prog.inputs[0].name: x}
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    for native in (True, False):
        got = {k: v.int_repr() for k, v in BpuSimulator(prog, native=native).run(inputs).items()}
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (native, k)
    q = BpuSimulator(prog, native=True)
    assert "_fast_quantize" in {getattr(s[0], "__qualname__", "").split(".")[0] for s in q._steps}


@needs_native
@pytest.mark.parametrize("lo,hi,dtype", [(-(1 << 32), 1 << 32, torch.int16), (-128, 1000, torch.int8),
                                         (-40000, 0, torch.int16), (5, 4, torch.int8)])
def test_a_depthwise_clamp_outside_the_output_type_is_refused(lo, hi, dtype):
    """The VNNI kernel clamps in int32 and narrows by saturation, the scalar one narrows by a cast: a
    clamp range outside the output type would make them disagree (or cut it to int32), so it is refused."""
    w = torch.ones(16, 1, 3, 3, dtype=torch.int8)
    with pytest.raises(ConfigError, match="clamp"):
        DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), torch.tensor([1000]), torch.tensor([16]), lo, hi, dtype)
    DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), torch.tensor([1000]), torch.tensor([16]),
                  torch.iinfo(dtype).min, torch.iinfo(dtype).max, dtype)  # the type's own range is fine
