"""The native int8 GEMM with the fused requantization (backends/bpu/native/gemm.py) against the exact
int64 reference (hypothesis, torch.equal), its refusals and argument checks, and the simulator's
1x1 conv / linear layers on it against the fixed_point kernels."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_bpu_reference import Tiny, geometry, rand_scales, weight_layer

from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.native.gemm import ENV_VNNI, ConvGeometry, Int8Gemm, gemm_available
from qcompiler.backends.bpu.native.kernels import DepthwiseConv, amx_calls, amx_enabled, amx_mode, set_amx
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.errors import ConfigError
from qcompiler.native import build
from qcompiler.native.kernels import _fn
from qcompiler.quantization import fixed_point as fp

SETTINGS = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
needs_gemm = pytest.mark.skipif(not build.native_enabled() or not gemm_available(),
                                reason="the native int8 GEMM needs the native kernels built for AVX512-VNNI")
_OUT = {"qint8": torch.int8, "qint16": torch.int16}
# the kernel's two paths: AVX512-VNNI vectors, and AMX tiles (where the CPU and OS have them); every
# reference test runs on both, and a path this machine lacks is skipped by name
_AMX_HERE = build.native_enabled() and gemm_available() and amx_enabled()
PATHS = pytest.mark.parametrize("on_path", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _AMX_HERE, reason="AMX tiles: this CPU or OS has none"))], ids=["vnni", "amx"], indirect=True)


@pytest.fixture
def on_path(request):
    """The GEMM on the path the test is parametrized with (True: AMX tiles), then back to the default;
    the tile path's tests must have run calls on it."""
    was, calls = amx_mode(), amx_calls()
    assert set_amx(request.param, every_call=True) == request.param  # (every call: the small ones too)
    yield request.param
    set_amx(was > 0, every_call=was == 2)
    assert (amx_calls() > calls) == request.param


@st.composite
def gemm_cases(draw):
    return dict(P=draw(st.integers(1, 40)), K=draw(st.sampled_from([1, 2, 3, 4, 5, 7, 16, 33, 64, 129, 1000, 2305])),
                O=draw(st.integers(1, 150)), bias=draw(st.booleans()), extreme=draw(st.booleans()),
                out=draw(st.sampled_from(["qint8", "qint16"])), act=draw(st.sampled_from([None, "relu", "relu6"])),
                add=draw(st.sampled_from([None, torch.int8, torch.int16])), n=draw(st.integers(0, 40)),
                nb=draw(st.integers(0, 40)), ties=draw(st.booleans()), m_bits=draw(st.sampled_from([15, 31])),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def _case(c):
    g = torch.Generator().manual_seed(c["seed"])
    P, K, O = c["P"], c["K"], c["O"]
    if c["extreme"]:  # the accumulator's extremes: +-127 / -128 weights on -128 / 127 inputs
        w = torch.where(torch.rand(O, K, generator=g) < 0.5, -128, 127).to(torch.int8)
        x = torch.where(torch.rand(P, K, generator=g) < 0.5, -128, 127).to(torch.int8)
        x[0] = -128  # a row of -128 against a row of -128 weights: the largest positive sum
        w[0] = -128
    else:
        w = torch.randint(-128, 128, (O, K), dtype=torch.int8, generator=g)
        x = torch.randint(-128, 128, (P, K), dtype=torch.int8, generator=g)
    b_max = 1 << (26 if c["m_bits"] == 31 else 20)  # 2**26 * 2**31 > 2**53: the int64 epilogue
    bias = torch.randint(-b_max, b_max, (O,), generator=g).to(torch.int32) if c["bias"] else None
    if c["ties"]:  # power-of-two factors: exact ties of both parities
        M = torch.ones(O, dtype=torch.int64)
    else:  # up to 2**31: |acc * M| beyond 2**53 takes the int64 epilogue, below it the float64 one
        M = torch.randint(1, 1 << c["m_bits"], (O,), generator=g)
    n = torch.randint(max(0, c["n"] - 3), c["n"] + 1, (O,), generator=g)
    lo, hi = fp.qrange(c["out"])
    if c["act"] == "relu":
        lo = 0
    elif c["act"] == "relu6":
        lo, hi = 0, 90
    other, add = None, None
    if c["add"] is not None:
        b_hi = 127 if c["add"] == torch.int8 else 32767
        other = torch.randint(-b_hi - 1, b_hi + 1, (P, O), dtype=c["add"], generator=g)
        other[0] = -b_hi - 1
        Mb = 1 if c["ties"] else int(torch.randint(-(1 << 15), 1 << 15, (1,), generator=g))
        add = (Mb, c["nb"], c["add"])
    return x, w, bias, M, n, lo, hi, add, other


def reference(x, w, bias, M, n, lo, hi, add, other):
    """The int64 reference: exact sums, fixed_point's rounding (half to even), one rounding with a fused add."""
    acc = x.to(torch.int64) @ w.to(torch.int64).t()
    if bias is not None:
        acc = acc + bias.to(torch.int64)
    prod = acc * M.reshape(1, -1)
    if add is None:
        y = fp.rounding_shift(prod, n.reshape(1, -1))
    else:
        y = fp.round_scaled_sum(prod, n.reshape(1, -1), other.to(torch.int64) * add[0], add[1])
    return y.clamp(lo, hi)


@needs_gemm
@PATHS
@SETTINGS
@given(gemm_cases())
def test_int8_gemm_equals_the_int64_reference(on_path, c):
    x, w, bias, M, n, lo, hi, add, other = _case(c)
    if Int8Gemm.refusal(w, bias, M, n, lo, hi, _OUT[c["out"]], add) is not None:
        return  # (a fused sum beyond 2**62: refused, tested below)
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]], add)
    got = k(x, other=other)
    assert got.dtype == _OUT[c["out"]]
    assert torch.equal(got.to(torch.int64), reference(x, w, bias, M, n, lo, hi, add, other))


@needs_gemm
@PATHS
@SETTINGS
@given(gemm_cases())
def test_constants_prepared_once_equal_the_ones_built_per_call(on_path, c):
    """A layer's per-channel constants come prepared once (``qc_gemm_prep``, the last argument); with
    it NULL the kernel builds them itself, as before: the same bits, every epilogue mode and fused add."""
    x, w, bias, M, n, lo, hi, add, other = _case(c)
    if Int8Gemm.refusal(w, bias, M, n, lo, hi, _OUT[c["out"]], add) is not None:
        return
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]], add)
    outs = []
    for prepared in (True, False):
        out = torch.empty(x.shape[0], k.O, dtype=_OUT[c["out"]])
        args = list(k._args(x, x.stride(0) if x.shape[0] > 1 else k.K, None, out, other, 0, x.shape[0]))
        if not prepared:
            args[-1] = None
        assert k._f(*args) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0].to(torch.int64), reference(x, w, bias, M, n, lo, hi, add, other))


@needs_gemm
@PATHS
def test_the_largest_proven_accumulator_is_exact(on_path):
    """-128 * -128 over the largest K (and bias) the bound admits: the true sum is 2**31 - 2, while
    the unsigned-activation sums before the compensation wrap around int32 and must come back exactly."""
    K = (2 ** 31 - 1) // (128 * 128) - 1
    w = torch.full((17, K), -128, dtype=torch.int8)
    w[1] = 127
    bias = torch.full((17,), 2 ** 31 - 1 - 128 * 128 * K - 1)
    x = torch.full((40, K), -128, dtype=torch.int8)  # (40 rows: the tile path takes calls of 16 or more)
    x[1] = 127
    x[37] = 127
    M, n = torch.ones(17, dtype=torch.int64), torch.full((17,), 24)
    k = Int8Gemm(w, bias, M, n, -(1 << 15), (1 << 15) - 1, torch.int16)
    assert torch.equal(k(x).to(torch.int64), reference(x, w, bias, M, n, -(1 << 15), (1 << 15) - 1, None, None))


@needs_gemm
@PATHS
def test_a_row_range_writes_only_its_rows(on_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-128, 128, (83, 37), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (19, 37), dtype=torch.int8, generator=g)
    M, n = torch.randint(1, 1 << 15, (19,), generator=g), torch.full((19,), 20)
    k = Int8Gemm(w, None, M, n, -128, 127, torch.int8)
    out = torch.full((83, 19), 55, dtype=torch.int8)
    k(x, out, m0=5, m1=54)  # (49 rows: a 32-row tile and a partial one, on the tile path)
    want = reference(x, w, None, M, n, -128, 127, None, None).to(torch.int8)
    assert torch.equal(out[5:54], want[5:54])
    assert bool((out[:5] == 55).all()) and bool((out[54:] == 55).all())
    k(x, out, m0=0, m1=5)
    k(x, out, m0=54, m1=83)
    assert torch.equal(out, want)


@st.composite
def tall_cases(draw):
    """Many rows (several of the tile path's row blocks, whose size follows K), K around the tiles' 64-byte
    chunks (a whole number of them, a partial last one, fewer than one), channel counts that leave a
    single block of 16 or a partial one, and a row range cut anywhere (fewer than the 16 rows from which a
    call takes the tiles, a partial 32-row tile, a partial 16-row half)."""
    K = draw(st.sampled_from([3, 4, 60, 64, 68, 128, 576, 1000, 1024, 4608]))
    P = draw(st.integers(1, 1400 if K <= 1024 else 200))
    return dict(P=P, K=K, O=draw(st.sampled_from([1, 15, 16, 17, 32, 40, 64, 65, 100, 130])),
                cut=draw(st.tuples(st.integers(0, P), st.integers(0, P))), add=draw(st.booleans()),
                out=draw(st.sampled_from(["qint8", "qint16"])), seed=draw(st.integers(0, 2 ** 31 - 1)))


@needs_gemm
@PATHS
@settings(SETTINGS, max_examples=40)
@given(tall_cases())
def test_tall_gemms_over_several_row_blocks_equal_the_reference(on_path, c):
    g = torch.Generator().manual_seed(c["seed"])
    P, K, O = c["P"], c["K"], c["O"]
    x = torch.randint(-128, 128, (P, K), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (O, K), dtype=torch.int8, generator=g)
    bias = torch.randint(-(1 << 16), 1 << 16, (O,), generator=g)
    M, n = torch.randint(1, 1 << 15, (O,), generator=g), torch.randint(14, 22, (O,), generator=g)
    lo, hi = fp.qrange(c["out"])
    other = add = None
    if c["add"]:
        other = torch.randint(-128, 128, (P, O), dtype=torch.int8, generator=g)
        add = (int(torch.randint(-(1 << 15), 1 << 15, (1,), generator=g)), 13, torch.int8)
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]], add)
    m0, m1 = sorted(c["cut"])
    out = torch.full((P, O), 77, dtype=_OUT[c["out"]])
    k(x, out, other=other, m0=m0, m1=m1)
    want = reference(x, w, bias, M, n, lo, hi, add, other)
    assert torch.equal(out[m0:m1].to(torch.int64), want[m0:m1])
    assert bool((out[:m0] == 77).all()) and bool((out[m1:] == 77).all())


@needs_gemm
@pytest.mark.skipif(not _AMX_HERE, reason="AMX tiles: this CPU or OS has none")
def test_the_tile_path_is_switched_process_wide_and_gives_the_vector_paths_bits():
    """``set_amx`` switches the kernel between its two paths (both exact: the same int32 lanes, the same
    epilogue; by default tiles take only calls of 2**22 multiply-adds or more), and ``QCOMPILER_NATIVE_AMX=0``
    keeps a fresh process on the vectors."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-128, 128, (333, 300), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (70, 300), dtype=torch.int8, generator=g)
    M, n = torch.randint(1, 1 << 15, (70,), generator=g), torch.full((70,), 19)
    k = Int8Gemm(w, None, M, n, -128, 127, torch.int8)
    was = amx_mode()
    try:
        assert set_amx(False) is False and not amx_enabled()
        calls = amx_calls()
        vec = k(x)
        assert amx_calls() == calls
        assert set_amx(True) is True and amx_enabled() and amx_mode() == 1
        assert torch.equal(k(x), vec) and amx_calls() == calls + 1  # (7M multiply-adds: on tiles)
        k(x[:40])  # 40 * 300 * 70 = 840k multiply-adds: below the tiles' threshold, on vectors
        assert amx_calls() == calls + 1
        small = Int8Gemm(torch.zeros(16, 9 * 64, dtype=torch.int8), None, torch.ones(16, dtype=torch.int64),
                         torch.full((16,), 8), -128, 127, torch.int8)
        conv = ((1, 8, 8, 64), (3, 3), (1, 1), (1, 1), (1, 1))  # 64 rows x 576 x 16: 590k multiply-adds
        assert small.conv_layout(*conv) == "direct"  # (the layout the call takes: on vectors)
        assert set_amx(True, every_call=True) and amx_mode() == 2
        assert torch.equal(k(x[:40]), vec[:40]) and amx_calls() == calls + 2
        assert small.conv_layout(*conv) == "slide"
    finally:
        set_amx(was > 0, every_call=was == 2)
    code = "from qcompiler.backends.bpu.native.kernels import amx_enabled; print(amx_enabled())"
    for env, want in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "QCOMPILER_NATIVE_AMX": env}).stdout.strip()
        assert out == want, (env, out)


@needs_gemm
def test_int8_gemm_refuses_what_it_cannot_do_exactly():
    w = torch.full((4, 8), 100, dtype=torch.int8)
    M, n = torch.ones(4, dtype=torch.int64), torch.full((4,), 8)
    with pytest.raises(ConfigError, match="reaches 2\\*\\*31"):
        Int8Gemm(torch.full((2, 1 << 17), -128, dtype=torch.int8), None, M[:2], n[:2], -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="reaches 2\\*\\*31"):
        Int8Gemm(w, torch.full((4,), 2 ** 31 - 10), M, n, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="below 2\\*\\*31"):
        Int8Gemm(w, None, M << 31, n, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="shifts"):
        Int8Gemm(w, None, M, n + 70, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="out_dtype"):
        Int8Gemm(w, None, M, n, -128, 127, torch.int32)
    with pytest.raises(ConfigError, match="128-bit"):
        Int8Gemm(w, None, M << 29, n, -128, 127, torch.int8, add=(1 << 30, 62, torch.int16))
    k = Int8Gemm(w, None, M, n, -128, 127, torch.int8)
    x3 = torch.zeros(3, 8, dtype=torch.int8)
    for bad_out, m1 in ((torch.empty(2, 4, dtype=torch.int8), 3), (torch.empty(3, 4, dtype=torch.int16), 3)):
        with pytest.raises(ConfigError, match="run_rows"):  # the unchecked core still guards its writes
            k.run_rows(x3, 8, None, bad_out, None, 0, m1)
    with pytest.raises(ConfigError, match="int8 \\(rows, 8\\)"):
        k(torch.zeros(3, 7, dtype=torch.int8))
    with pytest.raises(ConfigError, match="int8 \\(rows, 8\\)"):
        k(torch.zeros(3, 8, dtype=torch.int16))
    with pytest.raises(ConfigError, match="unit column stride"):
        k(torch.zeros(8, 3, dtype=torch.int8).t())
    with pytest.raises(ConfigError, match="fused add"):
        k(torch.zeros(3, 8, dtype=torch.int8), other=torch.zeros(3, 4, dtype=torch.int8))
    with pytest.raises(ConfigError, match="row range"):
        k(torch.zeros(3, 8, dtype=torch.int8), m0=2, m1=4)


def _gemm_program(kind: str, with_add: bool, act, stride: int = 1, out_dtype: str = "qint8", k: int = 1):
    t = Tiny(seed=11)
    if kind == "conv2d":
        x = t.input(torch.randint(-128, 128, (2, 40, 7, 9), generator=t.gen), 0.05)
        w = torch.randint(-127, 128, (33, 40, k, k), generator=t.gen)
        p = k // 2
        other_shape = (2, 33, (7 + 2 * p - k) // stride + 1, (9 + 2 * p - k) // stride + 1)
        geom = geometry(stride, p, 1, 1)
    else:
        x = t.input(torch.randint(-128, 128, (3, 5, 70), generator=t.gen), 0.05)
        w = torch.randint(-127, 128, (21, 70), generator=t.gen)
        other_shape, geom = (3, 5, 21), None
    args = (x,)
    if with_add:
        args += (t.input(torch.randint(-128, 128, other_shape, generator=t.gen), 0.1),)
    O = w.shape[0]
    layer = weight_layer(kind, w, torch.rand(O, generator=t.gen) * 0.02 + 0.001, torch.randn(O, generator=t.gen),
                         0.05, 0.1, out_dtype=out_dtype, geometry=geom, act=act, other_scale=0.1 if with_add else None,
                         name="layer")
    prog = lower_partition(t.build(t.call(layer, *args, name="layer")), "bpu0")
    return prog, {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)}


@needs_gemm
@pytest.mark.parametrize("kind,with_add,act,stride,out_dtype,k", [
    ("conv2d", False, None, 1, "qint8", 1), ("conv2d", True, "relu", 1, "qint8", 1),
    ("conv2d", False, "relu6", 2, "qint8", 1), ("conv2d", True, None, 2, "qint16", 1),
    ("conv2d", True, "relu", 1, "qint8", 3), ("conv2d", False, None, 2, "qint16", 3),
    ("linear", False, "relu", 1, "qint8", 1), ("linear", True, None, 1, "qint16", 1)])
def test_the_simulator_runs_convs_and_linears_on_the_gemm_exactly(kind, with_add, act, stride, out_dtype, k,
                                                                  monkeypatch):
    prog, inputs = _gemm_program(kind, with_add, act, stride, out_dtype, k)
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    for on in (True, False):
        monkeypatch.setenv(ENV_VNNI, "1" if on else "0")
        sim = BpuSimulator(prog, native=True)
        kinds = {type(getattr(s[0], "whole", s[0])).__name__ for s in sim._steps}
        assert ("_NativeGemmLayer" in kinds) == on, kinds
        got = {k: v.int_repr() for k, v in sim.run(inputs).items()}
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (on, k)


@needs_gemm
@pytest.mark.parametrize("C,k,stride,pad", [(3, 7, 2, 3), (3, 5, 1, 2), (1, 11, 3, 0), (5, 7, 2, 3)])
def test_large_kernels_over_few_channels_run_on_the_gemm_exactly(C, k, stride, pad):
    """resnet18's stem (7x7 over 3 channels, stride 2) and its kin: the im2col rows are kw * C bytes per
    kernel row (not a multiple of 64: the masked copy's tail) and the padding taps."""
    t = Tiny(seed=29)
    x = t.input(torch.randint(-128, 128, (2, C, 23, 19), generator=t.gen), 0.05)
    w = torch.randint(-127, 128, (64, C, k, k), generator=t.gen)
    layer = weight_layer("conv2d", w, torch.rand(64, generator=t.gen) * 0.02 + 0.001, torch.randn(64, generator=t.gen),
                         0.05, 0.1, geometry=geometry(stride, pad, 1, 1), act="relu", name="stem")
    prog = lower_partition(t.build(t.call(layer, x, name="stem")), "bpu0")
    inputs = {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)}
    ref = {k_: v.int_repr() for k_, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    sim = BpuSimulator(prog, native=True)
    assert "_NativeGemmLayer" in {type(getattr(s[0], "whole", s[0])).__name__ for s in sim._steps}
    got = {k_: v.int_repr() for k_, v in sim.run(inputs).items()}
    assert got.keys() == ref.keys() and all(torch.equal(got[k_], ref[k_]) for k_ in ref)


@needs_gemm
@PATHS
@settings(SETTINGS, max_examples=80)
@given(gemm_cases(), st.integers(0, 40))
def test_both_float64_epilogues_equal_the_reference(on_path, c, n0):
    """Without a fused add: the float64 epilogue clamps in int32 (``f64 == 2``) where
    ``|acc| * M / 2**n < 2**31 - 1`` on every channel, else in float64 (``f64 == 1``); the shift drawn
    over [0, 40] gives both (and saturating outputs at small shifts), checked against the int64 reference."""
    c = {**c, "add": None, "m_bits": 15, "bias": c["bias"]}
    x, w, bias, M, n, lo, hi, add, other = _case(c)
    n = torch.full_like(n, n0)
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]])
    bound = Int8Gemm.acc_bound(w, bias)
    assert k.f64 == (2 if bound * int(M.max()) < ((1 << 31) - 1) << n0 else 1)
    assert torch.equal(k(x).to(torch.int64), reference(x, w, bias, M, n, lo, hi, None, None))


@needs_gemm
def test_the_float64_epilogue_modes_are_chosen_by_their_bounds():
    w = torch.full((16, 64), 127, dtype=torch.int8)  # bound 128 * 64 * 127 = 1040384 < 2**20
    x = torch.full((3, 64), -128, dtype=torch.int8)
    x[1] = 127
    for n0, mode in ((0, 1), (2, 1), (3, 2), (5, 2), (20, 2), (40, 2)):
        M, n = torch.full((16,), 1 << 14), torch.full((16,), n0)
        for lo, hi in ((-128, 127), (0, 127), (0, 90)):
            k = Int8Gemm(w, None, M, n, lo, hi, torch.int8)
            assert k.f64 == mode, (n0, k.f64)
            assert torch.equal(k(x).to(torch.int64), reference(x, w, None, M, n, lo, hi, None, None))


@needs_gemm
@PATHS
@settings(SETTINGS, max_examples=60)
@given(gemm_cases())
def test_the_int64_epilogue_without_a_fused_add_equals_the_reference(on_path, c):
    """Multipliers near 2**31 and a bias near 2**26: |acc * M| may pass 2**53, so the kernel takes its
    int64 epilogue (not the float64 one) without a fused add."""
    c = {**c, "add": None, "m_bits": 31, "bias": True, "ties": False}
    x, w, bias, M, n, lo, hi, add, other = _case(c)
    bias[0] = (1 << 26) - 1
    M[0] = (1 << 31) - 1
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]])
    assert k.f64 == 0
    assert torch.equal(k(x).to(torch.int64), reference(x, w, bias, M, n, lo, hi, None, None))


@st.composite
def conv_cases(draw):
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dh, dw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    H = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 10))
    W = draw(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 10))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.sampled_from([1, 2, 3, 5, 16, 33, 64])), H=H, W=W,
                O=draw(st.integers(1, 70)), k=(kh, kw), stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                padding=(ph, pw), dilation=(dh, dw), extreme=draw(st.booleans()), add=draw(st.booleans()),
                out=draw(st.sampled_from(["qint8", "qint16"])), seed=draw(st.integers(0, 2 ** 31 - 1)))


def conv_case_tensors(c: dict):
    """The kernel, its channels-last input and fused operand, and the int64 reference (unclamped) of
    one ``conv_cases`` draw."""
    g = torch.Generator().manual_seed(c["seed"])
    N, C, H, W, O = c["N"], c["C"], c["H"], c["W"], c["O"]
    if c.get("extreme"):
        w = torch.where(torch.rand(O, C, *c["k"], generator=g) < 0.5, -128, 127).to(torch.int8)
        x = torch.where(torch.rand(N, C, H, W, generator=g) < 0.5, -128, 127).to(torch.int8)
    else:
        w = torch.randint(-128, 128, (O, C, *c["k"]), dtype=torch.int8, generator=g)
        x = torch.randint(-128, 128, (N, C, H, W), dtype=torch.int8, generator=g)
    bias = torch.randint(-(1 << 20), 1 << 20, (O,), generator=g)
    M, n = torch.randint(1, 1 << 15, (O,), generator=g), torch.randint(15, 25, (O,), generator=g)
    acc = torch.nn.functional.conv2d(x.double(), w.double(), bias.double(), c["stride"], c["padding"],
                                     c["dilation"]).to(torch.int64)
    lo, hi = fp.qrange(c["out"])
    other = add = None
    if c["add"]:
        other = torch.randint(-128, 128, acc.shape, dtype=torch.int8, generator=g)
        add = (int(torch.randint(-(1 << 15), 1 << 15, (1,), generator=g)), 12, torch.int8)
        want = fp.round_scaled_sum(acc * M.view(1, -1, 1, 1), n.view(1, -1, 1, 1), other.to(torch.int64) * add[0], 12)
    else:
        want = fp.rounding_shift(acc * M.view(1, -1, 1, 1), n.view(1, -1, 1, 1))
    k = Int8Gemm(w.permute(0, 2, 3, 1).reshape(O, -1), bias, M, n, lo, hi, _OUT[c["out"]], add)
    return (k, x.permute(0, 2, 3, 1).contiguous(), None if other is None else other.permute(0, 2, 3, 1).contiguous(),
            want)


@needs_gemm
@PATHS
@SETTINGS
@given(conv_cases())
def test_int8_gemm_conv_equals_the_int64_reference(on_path, c):
    """The im2col inside the kernel (taps in the padding are the zero point) against conv2d in float64
    (exact for these sums) and the int64 requantization."""
    k, xl, ol, want = conv_case_tensors(c)
    got = k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol)
    lo, hi = fp.qrange(c["out"])
    assert torch.equal(got.permute(0, 3, 1, 2).to(torch.int64), want.clamp(lo, hi))


@st.composite
def wide_conv_cases(draw):
    """Convs with many output rows (several of the kernel's row blocks) and a row range that starts and
    ends anywhere: kernel rows read in place (kw * C a multiple of 4, dilation 1 along W) or staged."""
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    dh, dw = draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2]))
    ph, pw = draw(st.integers(0, kh)), draw(st.integers(0, kw))
    H = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 16))
    W = draw(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 16))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.sampled_from([4, 8, 12, 64, 2, 3, 5, 6, 1])), H=H, W=W,
                O=draw(st.integers(1, 70)), k=(kh, kw), stride=(draw(st.integers(1, 2)), draw(st.integers(1, 2))),
                padding=(ph, pw), dilation=(dh, dw), extreme=draw(st.booleans()), add=draw(st.booleans()),
                out=draw(st.sampled_from(["qint8", "qint16"])), seed=draw(st.integers(0, 2 ** 31 - 1)),
                cut=draw(st.tuples(st.floats(0, 1), st.floats(0, 1))))


@needs_gemm
@PATHS
@SETTINGS
@given(wide_conv_cases())
def test_a_conv_row_range_equals_the_reference_and_writes_only_its_rows(on_path, c):
    """Output rows m0..m1 of a conv, cut anywhere (inside an image row, across images, across the
    kernel's row blocks), in each of the kernel's layouts ("direct", "tail", "im2col"): the rows read
    in place, the rows staged at the left and right edges and the kernel rows in the vertical padding
    all equal the int64 reference; no other row is written."""
    k, xl, ol, want = conv_case_tensors(c)
    lo, hi = fp.qrange(c["out"])
    want = want.clamp(lo, hi).permute(0, 2, 3, 1).reshape(-1, c["O"])
    P = want.shape[0]
    m0, m1 = sorted(int(f * P) for f in c["cut"])
    out4 = torch.full((c["N"], *_out_hw(c), c["O"]), 77, dtype=_OUT[c["out"]])
    k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol, m0=m0, m1=m1, out=out4)
    out = out4.reshape(P, c["O"])
    assert torch.equal(out[m0:m1].to(torch.int64), want[m0:m1])
    assert bool((out[:m0] == 77).all()) and bool((out[m1:] == 77).all())


def _out_hw(c: dict) -> tuple[int, int]:
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = c["k"], c["stride"], c["padding"], c["dilation"]
    return (c["H"] + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (c["W"] + 2 * pw - dw * (kw - 1) - 1) // sw + 1


@needs_gemm
@PATHS
@pytest.mark.parametrize("C,k,stride,dilation,layout", [
    (64, 3, 1, 1, "direct/slide"), (64, 3, 2, 1, "direct/slide"), (64, 1, 2, 1, "direct/slide"),
    (4, 1, 1, 2, "direct/slide"), (3, 7, 2, 1, "tail/slide"), (3, 3, 2, 1, "tail/slide"), (5, 1, 1, 1, "tail/slide"),
    (64, 3, 1, (1, 2), "im2col"), (3, 7, 2, (2, 1), "im2col/slide"), (3, 5, 1, 1, "im2col/slide"),
    (1, 1, 1, 1, "im2col/slide"), (2, 3, 1, 1, "im2col/slide")])
def test_each_conv_reads_its_input_in_the_layout_its_kernel_rows_allow(on_path, C, k, stride, dilation, layout):
    """In place when a kernel row is a multiple of 4 bytes without dilation along W (any stride, and
    dilation along H); with the tail plane when it is one past (a 7x7 or 3x3 stem on 3 channels; not
    with dilation, which would leave the tail's column); im2col otherwise (2 or 3 past: 5x5 or 3x3 on
    1-2 channels; a kernel row of one byte).  On AMX tiles (the name after the slash) a conv without
    dilation along W reads a padded copy in place instead ("slide") where that costs less than copying
    its rows (all these, the tiles computing 9 of every 16 rows where the output rows are 9 wide).  Then
    the layout's output against the int64 reference."""
    layout = layout.split("/")[-1] if on_path else layout.split("/")[0]
    dil = dilation if isinstance(dilation, tuple) else (dilation, dilation)
    c = dict(N=2, C=C, H=19, W=17, O=40, k=(k, k), stride=(stride, stride), padding=(k // 2, k // 2), dilation=dil,
             extreme=False, add=False, out="qint8", seed=C * 100 + k)
    kern, xl, _, want = conv_case_tensors(c)
    assert kern.conv_layout(tuple(xl.shape), c["k"], c["stride"], c["padding"], dil) == layout
    got = kern.conv(xl, c["k"], c["stride"], c["padding"], dil)
    assert torch.equal(got.permute(0, 3, 1, 2).to(torch.int64), want.clamp(-128, 127))


@st.composite
def slide_cases(draw):
    """Convs the AMX tiles read in place from the padded copy: kernel rows of any length (a multiple of 64
    bytes or padded to one with zero weights), strides (stride 1 walks the padded grid, others the output
    rows), dilation along H, padding up to the kernel, images up to 30 wide, row ranges cut anywhere
    (inside a row, across images, past the tile blocks)."""
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    dh = draw(st.sampled_from([1, 1, 2]))
    ph, pw = draw(st.integers(0, kh)), draw(st.integers(0, kw))
    H = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 30))
    W = draw(st.integers(max(1, kw - 2 * pw), 30))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.sampled_from([1, 3, 4, 16, 21, 48, 64, 96])), H=H, W=W,
                O=draw(st.integers(1, 40)), k=(kh, kw), stride=(draw(st.sampled_from([1, 1, 2, 3])),
                                                               draw(st.sampled_from([1, 1, 2, 3]))),
                padding=(ph, pw), dilation=(dh, 1),
                extreme=draw(st.booleans()), add=draw(st.booleans()), out=draw(st.sampled_from(["qint8", "qint16"])),
                seed=draw(st.integers(0, 2 ** 31 - 1)), cut=draw(st.tuples(st.floats(0, 1), st.floats(0, 1))),
                cap=draw(st.sampled_from([None, 1, 3000])))


def _slide_cap(nbytes: int = 0) -> int:
    """The padded copy's cap per call (bpu/native/gemm.c, gemm_slide_cap): set it (> 0), return it."""
    return int(_fn("qc_gemm_slide_cap", (ctypes.c_int64,), ctypes.c_int64)(nbytes))


@needs_gemm
@pytest.mark.skipif(not _AMX_HERE, reason="AMX tiles: this CPU or OS has none")
@pytest.mark.parametrize("on_path", [True], ids=["amx"], indirect=True)
@SETTINGS
@given(slide_cases())
def test_the_padded_copy_read_in_place_by_tiles_equals_the_reference(on_path, c):
    """GEMM_SLIDE (bpu/native/gemm.c): positions of the padded grid past a row's outputs and between images, and
    the tile rows past an output row's end, are computed and dropped; only rows m0..m1 are written,
    each equal to the int64 reference."""
    k, xl, ol, want = conv_case_tensors(c)
    assume(k.conv_layout(tuple(xl.shape), c["k"], c["stride"], c["padding"], c["dilation"]) == "slide")
    lo, hi = fp.qrange(c["out"])
    want = want.clamp(lo, hi).permute(0, 2, 3, 1).reshape(-1, c["O"])
    P = want.shape[0]
    m0, m1 = sorted(int(f * P) for f in c["cut"])
    assume(m1 - m0 >= 16)  # (fewer rows take the vectors)
    out4 = torch.full((c["N"], *_out_hw(c), c["O"]), 77, dtype=_OUT[c["out"]])
    saved = _slide_cap()
    try:
        if c["cap"]:  # (a cap below the images' copies: the call runs an image or a few at a time)
            _slide_cap(c["cap"])
        k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol, m0=m0, m1=m1, out=out4)
    finally:
        _slide_cap(saved)
    out = out4.reshape(P, c["O"])
    assert torch.equal(out[m0:m1].to(torch.int64), want[m0:m1])
    assert bool((out[:m0] == 77).all()) and bool((out[m1:] == 77).all())


@needs_gemm
@pytest.mark.skipif(not _AMX_HERE, reason="AMX tiles: this CPU or OS has none")
@pytest.mark.parametrize("on_path", [True], ids=["amx"], indirect=True)
def test_the_padded_copy_is_made_a_few_images_at_a_time_past_its_cap(on_path):
    """A batch whose padded copy would pass the cap runs a few whole images at a time (one tile call
    each here): the same bits, whatever the cap."""
    c = dict(N=5, C=16, H=9, W=11, O=20, k=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), extreme=False,
             add=True, out="qint8", seed=8)
    k, xl, ol, want = conv_case_tensors(c)
    want = want.clamp(-128, 127).permute(0, 2, 3, 1)
    img = 11 * 13 * 16  # one padded image's bytes
    saved = _slide_cap()
    try:
        for cap, calls in ((saved, 1), (2 * img, 3), (1, 5), (5 * img, 1)):
            _slide_cap(cap)
            before = amx_calls()
            got = k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol)
            assert torch.equal(got.to(torch.int64), want), cap
            assert amx_calls() - before == calls, (cap, amx_calls() - before)
    finally:
        _slide_cap(saved)


@needs_gemm
@pytest.mark.skipif(not _AMX_HERE, reason="AMX tiles: this CPU or OS has none")
@pytest.mark.parametrize("on_path", [True], ids=["amx"], indirect=True)
def test_the_slide_layout_is_taken_where_few_positions_are_dropped(on_path):
    """resnet18's 56x56 3x3 convs (7% of the padded positions dropped, 64 channels) and its stride-2 ones
    (walked by output rows, 28 of every 32 tile rows kept) slide; its 7x7 ones keep the panel (40% of the
    padded grid dropped at 512 channels, or 9 of every 16 tile rows walking output rows)."""
    def layout(H, C, O, stride=1):
        k = Int8Gemm(torch.zeros(O, 9 * C, dtype=torch.int8), None, torch.ones(O, dtype=torch.int64),
                     torch.full((O,), 8), -128, 127, torch.int8)
        return k.conv_layout((8, H, H, C), (3, 3), (stride, stride), (1, 1), (1, 1))
    assert layout(56, 64, 64) == "slide"
    assert layout(7, 512, 512) == "direct"
    assert layout(56, 64, 128, stride=2) == "slide"
    c = dict(N=2, C=64, H=56, W=56, O=64, k=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), extreme=False,
             add=True, out="qint8", seed=4)
    k, xl, ol, want = conv_case_tensors(c)
    assert k.conv_layout(tuple(xl.shape), (3, 3), (1, 1), (1, 1), (1, 1)) == "slide"
    got = k.conv(xl, (3, 3), (1, 1), (1, 1), (1, 1), ol)
    assert torch.equal(got.permute(0, 3, 1, 2).to(torch.int64), want.clamp(-128, 127))


@needs_gemm
@pytest.mark.parametrize("on_path", [False], ids=["vnni"], indirect=True)  # (tiles slide these)
def test_a_tail_conv_gets_its_weights_repacked_once_and_equals_the_per_call_repack(on_path):
    """The tail layout's weights come repacked once per kernel shape (``geo.tail_w``, kept by the layer);
    with ``geo.tail_w`` NULL the kernel repacks them itself: the same bits, whole and over row ranges that
    cut images anywhere (each range copies only the input rows it reads)."""
    c = dict(N=3, C=3, H=23, W=21, O=70, k=(7, 7), stride=(2, 2), padding=(3, 3), dilation=(1, 1), extreme=False,
             add=False, out="qint8", seed=5)
    k, xl, _, want = conv_case_tensors(c)
    geo, (N, Ho, Wo) = k.conv_geometry(tuple(xl.shape), c["k"], c["stride"], c["padding"], c["dilation"])
    assert k.conv_layout_of(geo, N * Ho * Wo) == "tail" and geo.tail_w is not None
    assert k.conv_geometry(tuple(xl.shape), c["k"], c["stride"], c["padding"], c["dilation"])[0].tail_w == geo.tail_w
    want = want.clamp(-128, 127).permute(0, 2, 3, 1).reshape(-1, c["O"])
    P = N * Ho * Wo
    for own in (True, False):
        g = ConvGeometry.from_buffer_copy(geo)
        if not own:
            g.tail_w = None
        out = torch.empty(P, c["O"], dtype=torch.int8)
        cuts = [0, 5, Ho * Wo - 3, Ho * Wo + 7, 2 * Ho * Wo + Wo, P]
        for m0, m1 in zip(cuts, cuts[1:]):
            k.run_rows(xl, k.K, g, out, None, m0, m1)
        assert torch.equal(out.to(torch.int64), want), own
    zeros = torch.zeros(k.wpack.numel(), dtype=torch.int8)  # geo.tail_w is what the kernel reads: zero weights there
    g = ConvGeometry.from_buffer_copy(geo)
    g.tail_w = zeros.data_ptr()
    out = torch.empty(P, c["O"], dtype=torch.int8)
    k.run_rows(xl, k.K, g, out, None, 0, P)
    assert not torch.equal(out.to(torch.int64), want)


@needs_gemm
@pytest.mark.parametrize("on_path", [False], ids=["vnni"], indirect=True)  # (tiles slide these)
def test_threads_building_a_tail_layers_geometry_at_once_share_one_repack(on_path):
    """The batch split builds a layer's first plan on several threads at once: every geometry they get
    points at the one repack the layer keeps (a second thread's repack is not stored over the first's,
    which would free the weights a geometry already points at)."""
    import threading
    c = dict(N=2, C=3, H=30, W=30, O=1000, k=(7, 7), stride=(2, 2), padding=(3, 3), dilation=(1, 1), extreme=False,
             add=False, out="qint8", seed=11)
    k, xl, _, want = conv_case_tensors(c)
    barrier, geos = threading.Barrier(4), []

    def build(n):
        barrier.wait()
        geos.append(k.conv_geometry((n, *xl.shape[1:]), c["k"], c["stride"], c["padding"], c["dilation"])[0])
    threads = [threading.Thread(target=build, args=(1 + i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({g.tail_w for g in geos}) == 1
    assert geos[0].tail_w == k._tail_w[(7, 7, 3, 1, 1)].data_ptr()
    geo, (N, Ho, Wo) = k.conv_geometry(tuple(xl.shape), c["k"], c["stride"], c["padding"], c["dilation"])
    out = torch.empty(N * Ho * Wo, c["O"], dtype=torch.int8)
    k.run_rows(xl, k.K, geo, out, None, 0, out.shape[0])
    assert torch.equal(out.to(torch.int64), want.clamp(-128, 127).permute(0, 2, 3, 1).reshape(-1, c["O"]))


@pytest.mark.skipif(not build.native_enabled(), reason="no native kernels here")
def test_the_geometry_struct_mirrors_the_c_one():
    """gemm.py's ConvGeometry has the size of conv_geometry.h's qc_conv_geometry and, field by field, its
    offsets: the kernel reads by name what conv_geometry writes by name."""
    layout = (ctypes.c_int64 * 32)()
    _fn("qc_conv_geometry_layout", (ctypes.c_void_p,), None)(layout)
    size, n, *offsets = layout[:2 + len(ConvGeometry._fields_)]
    assert size == ctypes.sizeof(ConvGeometry) and n == len(ConvGeometry._fields_)
    assert offsets == [getattr(ConvGeometry, f).offset for f, _ in ConvGeometry._fields_]


@needs_gemm
@PATHS
@pytest.mark.parametrize("K", [4, 64, 576, 37])
def test_rows_with_a_stride_past_k_are_read_in_place(on_path, K):
    """A GEMM over a column slice of a wider matrix (row stride > K): rows read in place when K is a
    multiple of 4 (else staged), only their K columns."""
    g = torch.Generator().manual_seed(K)
    wide = torch.randint(-128, 128, (150, K + 13), dtype=torch.int8, generator=g)
    x = wide[:, 5:5 + K]
    w = torch.randint(-128, 128, (40, K), dtype=torch.int8, generator=g)
    M, n = torch.randint(1, 1 << 15, (40,), generator=g), torch.full((40,), 20)
    k = Int8Gemm(w, None, M, n, -128, 127, torch.int8)
    assert torch.equal(k(x).to(torch.int64), reference(x.contiguous(), w, None, M, n, -128, 127, None, None))


@needs_gemm
def test_the_strides_of_1_sized_dims_do_not_matter():
    """torch gives 1-sized dims arbitrary strides ((1, 1) rows from a reshape of a view): accepted, read right."""
    w = torch.tensor([[3], [-5]], dtype=torch.int8)
    k = Int8Gemm(w, None, torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), -128, 127, torch.int8)
    x = torch.as_strided(torch.tensor([7, -2, 9], dtype=torch.int8), (3, 1), (1, 5))
    assert torch.equal(k(x), torch.tensor([[21, -35], [-6, 10], [27, -45]], dtype=torch.int8))


@needs_gemm
def test_a_multiplier_past_31_bits_keeps_the_depthwise_conv_off_vnni():
    """The VNNI depthwise epilogue multiplies with vpmuldq, which reads only M's low 32 bits: a layer
    with |M| >= 2**31 (in bounds for the int64 kernel) must take the other kernel (it gave 228 of
    576 outputs wrong before)."""
    g = torch.Generator().manual_seed(0)
    C = 16
    w = torch.randint(-20, 21, (C, 1, 3, 3), generator=g)
    x = torch.randint(-128, 128, (1, 6, 6, C), generator=g).to(torch.int8)
    M, n = torch.full((C,), (1 << 42) + 123457, dtype=torch.int64), torch.full((C,), 54, dtype=torch.int64)
    acc = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2).double(), w.double(), None, 1, 1, 1, C).to(torch.int64)
    want = fp.requantize(acc, M, n, "qint8", axis=1)
    dw = DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), M, n, -128, 127, torch.int8, vnni=True)
    assert not dw.vnni
    assert torch.equal(dw(x.contiguous()).permute(0, 3, 1, 2), want)
    small = DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), M >> 12, n - 12, -128, 127, torch.int8, vnni=True)
    assert small.vnni  # (the VNNI kernel still takes multipliers below 2**31)


@needs_gemm
@pytest.mark.parametrize("kind, other_shape", [("linear", (20,)), ("conv2d", (1, 20, 1, 1))])
def test_a_broadcast_fused_operand_takes_the_reference_path(kind, other_shape):
    """A fused add whose operand broadcasts (a hand-built or loaded program; the fuse pass never makes
    one) raised a ConfigError in the GEMM's linear / 1x1 paths; it now falls back, equal to fixed_point."""
    t = Tiny(seed=1)
    O, C = 20, 16
    if kind == "conv2d":
        x, w, geo = t.rand_input((1, C, 6, 6), 0.05), torch.randint(-128, 128, (O, C, 1, 1), generator=t.gen), geometry(1, 0, 1, 1)
    else:
        x, w, geo = t.rand_input((3, 4, C), 0.05), torch.randint(-128, 128, (O, C), generator=t.gen), None
    o = t.rand_input(other_shape, 0.04)
    layer = weight_layer(kind, w, rand_scales(t.gen, O), torch.randn(O, generator=t.gen), 0.05, 0.1, geometry=geo,
                         other_scale=0.04, name="L")
    prog = lower_partition(t.build(t.call(layer, x, o, name="L")), "bpu0")
    inputs = {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)}
    sim = BpuSimulator(prog, native=True)
    assert "_NativeGemmLayer" in {type(getattr(s[0], "whole", s[0])).__name__ for s in sim._steps}
    want = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    got = {k: v.int_repr() for k, v in sim.run(inputs).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@st.composite
def packed_cases(draw):
    """Small K (where the epilogue dominates), multipliers like the converted models' (2**30 to 2**31, or
    powers of two for exact ties) and per-channel shifts from the smallest the packed float64 epilogue
    admits (results near 2**31, saturating the packs) up."""
    return dict(P=draw(st.integers(1, 40)), K=draw(st.integers(3, 40) | st.sampled_from([64, 147])),
                O=draw(st.integers(1, 150)), out=draw(st.sampled_from(["qint8", "qint16"])),
                act=draw(st.sampled_from([None, "relu", "relu6"])), bias=draw(st.booleans()),
                extreme=draw(st.booleans()), ties=draw(st.booleans()), extra=draw(st.integers(0, 12)),
                rows=draw(st.tuples(st.integers(0, 40), st.integers(0, 40))), seed=draw(st.integers(0, 2 ** 31 - 1)))


@needs_gemm
@SETTINGS
@given(packed_cases())
def test_the_packed_float64_epilogue_equals_the_reference(c):
    """The epilogue for ``f64 == 2`` without a fused add (accumulators offset by 2**31, one fma rounding
    at 1.5 * 2**52, whole-vector packs, the clamp after the saturating packs): int8 / int16 out, relu /
    relu6, O not a multiple of 16, and a row range (the rows outside and the columns past O untouched)."""
    g = torch.Generator().manual_seed(c["seed"])
    P, K, O = c["P"], c["K"], c["O"]
    if c["extreme"]:
        w = torch.where(torch.rand(O, K, generator=g) < 0.5, -128, 127).to(torch.int8)
        x = torch.where(torch.rand(P, K, generator=g) < 0.5, -128, 127).to(torch.int8)
        x[0], w[0] = -128, -128  # the largest positive sum
    else:
        w = torch.randint(-128, 128, (O, K), dtype=torch.int8, generator=g)
        x = torch.randint(-128, 128, (P, K), dtype=torch.int8, generator=g)
    bias = torch.randint(-(1 << 20), 1 << 20, (O,), generator=g).to(torch.int32) if c["bias"] else None
    if c["ties"]:
        M = 2 ** torch.randint(0, 31, (O,), generator=g)
    else:
        M = torch.randint(1 << 30, 1 << 31, (O,), generator=g)
    bound = Int8Gemm.acc_bound(w, bias)
    n_min = torch.tensor([next(s for s in range(63) if bound * m < ((1 << 31) - 1) << s) for m in M.tolist()])
    n = n_min + torch.randint(0, c["extra"] + 1, (O,), generator=g)
    lo, hi = fp.qrange(c["out"])
    lo, hi = {None: (lo, hi), "relu": (0, hi), "relu6": (0, 90)}[c["act"]]
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]])
    assert k.f64 == 2
    m0, m1 = sorted(min(r, P) for r in c["rows"])
    out = torch.full((P + 1, O), 77, dtype=_OUT[c["out"]])  # one row more: a store past the last row shows
    k(x, out[:P], m0=m0, m1=m1)
    want = reference(x, w, bias, M, n, lo, hi, None, None)
    assert torch.equal(out[m0:m1].to(torch.int64), want[m0:m1])
    assert bool((out[:m0] == 77).all()) and bool((out[m1:] == 77).all())


@st.composite
def stem_cases(draw):
    """Convs over few channels with kernels up to 7x7 (resnet18's and mobilenet_v2's stems and their
    kin): kernel rows of kw * C bytes up to 32 take the one-copy-per-kernel-row staging, longer ones and
    dilated ones the per-tap copies; padding taps; C past 64 (the padding's memset)."""
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    dh, dw = draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2]))
    ph, pw = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    H = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 14))
    W = draw(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 14))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.integers(1, 8) | st.sampled_from([33, 80])), H=H, W=W,
                O=draw(st.integers(1, 70)), k=(kh, kw), stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                padding=(ph, pw), dilation=(dh, dw), extreme=draw(st.booleans()), add=draw(st.booleans()),
                out=draw(st.sampled_from(["qint8", "qint16"])), seed=draw(st.integers(0, 2 ** 31 - 1)))


@needs_gemm
@settings(SETTINGS, max_examples=200)
@given(stem_cases())
def test_int8_gemm_stem_convs_equal_the_int64_reference(c):
    """The im2col staging of short kernel rows (one unmasked copy per kernel row, overshooting into bytes
    written again later) with the packed float64 epilogues, without and with a fused add; against conv2d
    in float64 and the int64 requantization."""
    k, xl, ol, want = conv_case_tensors(c)
    assert k.f64 == (3 if c["add"] else 2)
    got = k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol)
    lo, hi = fp.qrange(c["out"])
    assert torch.equal(got.permute(0, 3, 1, 2).to(torch.int64), want.clamp(lo, hi))


@st.composite
def fused_cases(draw):
    """Fused adds whose exact sum over the common denominator 2**s stays below 2**53: small K, int8 / int16
    operands and outputs, multipliers like the converted models' (or powers of two: exact ties), negative
    Mb, nb below and above n; the multipliers are halved until the sum's bound just fits (sums near 2**53,
    results near 2**31 at small s)."""
    return dict(P=draw(st.integers(1, 40)), K=draw(st.integers(3, 40) | st.sampled_from([64, 147])),
                O=draw(st.integers(1, 150)), out=draw(st.sampled_from(["qint8", "qint16"])),
                other=draw(st.sampled_from([torch.int8, torch.int16])), act=draw(st.sampled_from([None, "relu", "relu6"])),
                bias=draw(st.booleans()), extreme=draw(st.booleans()), ties=draw(st.booleans()),
                n0=draw(st.integers(22, 45)), dnb=draw(st.integers(-14, 3)), neg=draw(st.booleans()),
                rows=draw(st.tuples(st.integers(0, 40), st.integers(0, 40))), seed=draw(st.integers(0, 2 ** 31 - 1)))


@needs_gemm
@SETTINGS
@given(fused_cases())
def test_the_packed_fused_add_epilogue_equals_the_reference(c):
    """``f64 == 3``: the fused operand converted like the accumulator, ``b * Mb * 2**-nb`` by one exact fma,
    the sum by a second (exact below 2**53), rounded half to even by adding 1.5 * 2**52; against
    ``fixed_point.round_scaled_sum``, rows outside the range and columns past O untouched."""
    g = torch.Generator().manual_seed(c["seed"])
    P, K, O = c["P"], c["K"], c["O"]
    if c["extreme"]:
        w = torch.where(torch.rand(O, K, generator=g) < 0.5, -128, 127).to(torch.int8)
        x = torch.where(torch.rand(P, K, generator=g) < 0.5, -128, 127).to(torch.int8)
        x[0], w[0] = -128, -128
    else:
        w = torch.randint(-128, 128, (O, K), dtype=torch.int8, generator=g)
        x = torch.randint(-128, 128, (P, K), dtype=torch.int8, generator=g)
    bias = torch.randint(-(1 << 20), 1 << 20, (O,), generator=g).to(torch.int32) if c["bias"] else None
    b_hi = 127 if c["other"] == torch.int8 else 32767
    other = torch.randint(-b_hi - 1, b_hi + 1, (P, O), dtype=c["other"], generator=g)
    other[0] = -b_hi - 1
    n = c["n0"] + torch.randint(0, 4, (O,), generator=g)
    nb = max(0, c["n0"] + c["dnb"])
    if c["ties"]:
        M, Mb = 2 ** torch.randint(0, 31, (O,), generator=g), 1 << int(torch.randint(0, 31, (1,), generator=g))
    else:
        M, Mb = torch.randint(1 << 30, 1 << 31, (O,), generator=g), int(torch.randint(1, 1 << 31, (1,), generator=g))
    Mb = -Mb if c["neg"] else Mb
    lo, hi = fp.qrange(c["out"])
    lo, hi = {None: (lo, hi), "relu": (0, hi), "relu6": (0, 90)}[c["act"]]
    while True:  # halve the multipliers until the packed epilogue's bounds hold (and the int64 ones: no refusal)
        if Int8Gemm.refusal(w, bias, M, n, lo, hi, _OUT[c["out"]], (Mb, nb, c["other"])) is None:
            k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]], (Mb, nb, c["other"]))
            if k.f64 == 3:
                break
        M, Mb = torch.clamp(M // 2, min=1), Mb // 2 or 1
    m0, m1 = sorted(min(r, P) for r in c["rows"])
    out = torch.full((P + 1, O), 77, dtype=_OUT[c["out"]])
    k(x, out[:P], other=other, m0=m0, m1=m1)
    want = reference(x, w, bias, M, n, lo, hi, (Mb, nb, c["other"]), other)
    assert torch.equal(out[m0:m1].to(torch.int64), want[m0:m1])
    assert bool((out[:m0] == 77).all()) and bool((out[m1:] == 77).all())


@needs_gemm
def test_the_fused_add_epilogue_modes_are_chosen_by_their_bounds():
    """f64 == 3 exactly when every channel's fused sum over 2**s is below 2**53 and below (2**31 - 1) * 2**s;
    the int64 epilogue (f64 == 0) otherwise; both equal the reference."""
    w = torch.full((16, 64), 127, dtype=torch.int8)  # bound 128 * 64 * 127 = 1040384 < 2**20
    x = torch.full((3, 64), -128, dtype=torch.int8)
    x[1] = 127
    other = torch.tensor([[-128], [127], [5]], dtype=torch.int8).expand(3, 16).contiguous()
    big = (1 << 31) - 1
    # (M, n, nb, mode): |acc * M| + |b * Mb| * 2**9 near 2**51; the accumulator's term shifted by 3 past 2**53;
    # the operand's term shifted by 20 past 2**53; a small sum at s = 10; a sum past (2**31 - 1) * 2**10
    for m, n0, nb, mode in ((big, 40, 31, 3), (big, 37, 40, 0), (big, 40, 20, 0), ((1 << 20) - 1, 10, 10, 3),
                            (big, 10, 10, 0)):
        M, n = torch.full((16,), m), torch.full((16,), n0)
        add = (-(1 << 30), nb, torch.int8)
        k = Int8Gemm(w, None, M, n, -128, 127, torch.int8, add)
        assert k.f64 == mode, (m, n0, nb, k.f64)
        assert torch.equal(k(x, other=other).to(torch.int64), reference(x, w, None, M, n, -128, 127, add, other))
