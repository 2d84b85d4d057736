"""The native bilinear resize (``BilinearResize``, the simulator's fast ``resize_bilinear``) against
the simulator's float64 reference kernel: hypothesis over shapes, sizes, align_corners, int8/int16
in and out, extreme values, ties, and the three layouts that reach it (NCHW, channels-last and the
simulator's channel-major C,N,H,W), torch.equal."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qcompiler.backends.bpu.native.kernels import BilinearResize, bilinear_taps
from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.registry import FAST, REFERENCE, KernelSpec
from qcompiler.errors import ConfigError
from qcompiler.native import build

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
needs_native = pytest.mark.skipif(not build.native_enabled(), reason="native kernels are off on this machine")
_ST = {"qint8": torch.int8, "qint16": torch.int16}
# output/input size ratios per axis: powers of two (exact taps) and others (some exact, some not)
_FACTORS = [2, 2, 2, 4, 8, 0.5, 0.25, 1, 1.5, 0.75, 1.25, 3, 0.3]


def _spec(size, align, in_dtype, out_dtype, in_scale, out_scale, native=True) -> KernelSpec:
    op = BpuOp("resize_bilinear", ["x"], "y", {"size": list(size), "in_scale": in_scale, "align_corners": align,
                                                "out_dtype": out_dtype, "out_scale": out_scale, "out_axis": None})
    return KernelSpec(op, [ValueSpec("x", in_dtype, in_scale)], "prog/y", None, False, native=native)


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "nhwc":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "cnhw":  # the simulator's conv output: C,N,H,W memory under an N,C,H,W view
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    return x.contiguous()


@st.composite
def cases(draw):
    N, C = draw(st.integers(1, 3)), draw(st.integers(1, 20))
    H, W = draw(st.integers(1, 17)), draw(st.integers(1, 17))
    align = draw(st.booleans())
    if align and draw(st.booleans()):  # align_corners with a dyadic (in-1)/(out-1)
        Ho, Wo = (2 * H - 1 if H > 1 else 2), (2 * W - 1 if W > 1 else 1)
    else:
        fh, fw = draw(st.sampled_from(_FACTORS)), draw(st.sampled_from(_FACTORS))
        Ho, Wo = max(1, round(H * fh)), max(1, round(W * fw))
    in_dtype, out_dtype = draw(st.sampled_from(["qint8", "qint16"])), draw(st.sampled_from(["qint8", "qint16"]))
    # scales: a ratio with an arbitrary significand, exactly 1/2 (ties), or far out of range (clamps)
    kind = draw(st.sampled_from(["any", "half", "big", "one"]))
    in_scale = {"any": draw(st.floats(1e-4, 1.0)), "half": 0.5, "big": 300.0, "one": 0.25}[kind]
    out_scale = {"any": draw(st.floats(1e-4, 1.0)), "half": 1.0, "big": 0.01, "one": 0.25}[kind]
    return dict(N=N, C=C, H=H, W=W, size=(Ho, Wo), align=align, in_dtype=in_dtype, out_dtype=out_dtype,
                in_scale=in_scale, out_scale=out_scale, layout=draw(st.sampled_from(["nchw", "nhwc", "cnhw"])),
                extremes=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 31 - 1)))


def _input(c) -> torch.Tensor:
    g = torch.Generator().manual_seed(c["seed"])
    info = torch.iinfo(_ST[c["in_dtype"]])
    shape = (c["N"], c["C"], c["H"], c["W"])
    if c["extremes"]:  # only the type's min and max (the largest |Y| and the clamps)
        x = torch.where(torch.rand(shape, generator=g) < 0.5, info.min, info.max)
    else:
        x = torch.randint(info.min, info.max + 1, shape, generator=g)
    return _layout(x.to(_ST[c["in_dtype"]]), c["layout"])


@needs_native
@SETTINGS
@given(cases())
def test_native_bilinear_resize_equals_the_reference(c):
    args = (c["size"], c["align"], c["in_dtype"], c["out_dtype"], c["in_scale"], c["out_scale"])
    x = _input(c)
    want = REFERENCE["resize_bilinear"](_spec(*args))(x)
    got = FAST["resize_bilinear"](_spec(*args))(x)
    assert torch.equal(got, want)
    if not x.is_contiguous():  # channels-last stays channels-last (the next op's layout), as in the reference
        assert got.is_contiguous(memory_format=torch.channels_last) == want.is_contiguous(
            memory_format=torch.channels_last)
    info = torch.iinfo(_ST[c["out_dtype"]])
    plan = BilinearResize(c["size"], c["align"], c["in_scale"] / c["out_scale"], info.min, info.max, _ST[c["out_dtype"]])
    if plan.exact_for(x):  # the native path itself, not only the dispatcher's choice
        assert torch.equal(plan(x), want)


@needs_native
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "cnhw"])
@pytest.mark.parametrize("align", [False, True])
def test_factor_two_takes_the_native_path_and_matches(layout, align):
    """The unet case (64 channels, 2x, int8 extremes and ties): exact_for holds, so the kernel runs."""
    H, W = 9, 14
    size = (2 * H - 1, 2 * W - 1) if align else (2 * H, 2 * W)
    x = torch.randint(-128, 128, (2, 64, H, W), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    x[0, :, 0, :] = -128
    x[1, :, -1, :] = 127
    x = _layout(x, layout)
    for in_scale, out_scale in [(0.05, 0.03), (0.5, 1.0), (0.01, 0.02), (1.0, 1.0)]:
        plan = BilinearResize(size, align, in_scale / out_scale, -128, 127, torch.int8)
        assert plan.exact_for(x)
        want = REFERENCE["resize_bilinear"](_spec(size, align, "qint8", "qint8", in_scale, out_scale))(x)
        assert torch.equal(plan(x), want)


@pytest.mark.parametrize("n_in,n_out,align", [(5, 10, False), (5, 20, False), (10, 5, False), (16, 4, False),
                                              (7, 7, False), (4, 7, True), (5, 5, True), (3, 4, False),
                                              (1, 4, False), (6, 1, True), (6, 1, False)])
def test_taps_are_torch_weights(n_in, n_out, align):
    """bilinear_taps is exactly the weight matrix torch's float64 kernel applies (read off by
    resizing the identity: column i of the output is the weight of input i)."""
    taps = bilinear_taps(n_in, n_out, align)
    assert taps is not None
    i0, i1, a0, a1 = taps
    assert torch.equal(a0 + a1, torch.full((n_out,), 128, dtype=torch.int32))
    mine = torch.zeros(n_out, n_in, dtype=torch.float64)
    for o in range(n_out):
        mine[o, int(i0[o])] += int(a0[o]) / 128
        mine[o, int(i1[o])] += int(a1[o]) / 128
    eye = torch.eye(n_in, dtype=torch.float64).reshape(1, n_in, n_in, 1)  # channels = input index, H = input
    theirs = F.interpolate(eye, size=(n_out, 1), mode="bilinear", align_corners=align)[0, :, :, 0].t()
    assert torch.equal(mine, theirs)


def test_long_axes_are_refused_where_torch_floors_in_float32():
    """ATen floors the source index in float32: past 2**17 inputs a dyadic index can round up to
    the next integer (516095.9921875 -> 516096 for 2**20 + 1 -> 64), so the taps are refused and
    the simulator's fast kernel gives the reference's value (it gave 1 instead of 0 before)."""
    assert bilinear_taps(1 << 17, 1 << 18, False) is not None  # the largest axis still exact
    assert bilinear_taps((1 << 17) + 2, 64, False) is None
    W = (1 << 20) + 1
    x = torch.zeros(1, 2, 1, W, dtype=torch.int8)
    x[..., 516095] = 100
    spec = _spec((1, 64), False, "qint8", "qint8", 1.0, 1.0)
    for xv in (x, x.contiguous(memory_format=torch.channels_last)):
        assert torch.equal(FAST["resize_bilinear"](spec)(xv), REFERENCE["resize_bilinear"](spec)(xv))


@pytest.mark.parametrize("n_in,n_out,align", [(3, 7, False), (5, 9, False), (4, 6, True), (10, 3, False),
                                              (7, 12, True), (1, 6, False)])
def test_taps_refuse_rounded_weights(n_in, n_out, align):
    """Scales that are not dyadic (3/7, 5/9, 3/5 ...) give rounded float64 weights: no taps, and
    the simulator keeps the reference for them."""
    assert bilinear_taps(n_in, n_out, align) is None
    plan = BilinearResize((n_out, 4), align, 1.0, -128, 127, torch.int8)
    assert not plan.exact_for(torch.zeros(1, 2, n_in, 4, dtype=torch.int8))


@needs_native
def test_misuse_is_a_config_error():
    plan = BilinearResize((6, 6), False, 1.0, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="not one this kernel reproduces"):
        plan(torch.zeros(1, 2, 3, 3, dtype=torch.int32))
    with pytest.raises(ConfigError, match="not one this kernel reproduces"):
        plan(torch.zeros(1, 2, 5, 3, dtype=torch.int8))  # 5 -> 6 is not dyadic
    with pytest.raises(ConfigError, match="not one this kernel reproduces"):
        plan(torch.zeros(1, 2, 3, 6, dtype=torch.int8)[..., ::2])  # strided W
    with pytest.raises(ConfigError, match="out_dtype"):
        BilinearResize((6, 6), False, 1.0, -128, 127, torch.int32)
    with pytest.raises(ConfigError, match="ratio"):
        BilinearResize((6, 6), False, math.nan, -128, 127, torch.int8)
    tiny = BilinearResize((6, 6), False, 1e-310, -128, 127, torch.int8)  # ratio / 2**14 not exact
    assert not tiny.exact_for(torch.zeros(1, 2, 3, 3, dtype=torch.int8))


def test_without_native_the_fast_kernel_is_the_reference():
    spec = _spec((8, 8), False, "qint8", "qint8", 0.05, 0.03, native=False)
    x = torch.randint(-128, 128, (1, 3, 4, 4), dtype=torch.int8)
    assert FAST["resize_bilinear"](spec).__qualname__ == REFERENCE["resize_bilinear"](spec).__qualname__
    assert torch.equal(FAST["resize_bilinear"](spec)(x), REFERENCE["resize_bilinear"](spec)(x))
