"""The int32 requantization of the fast cat (``int32_requant`` + ``requant_columns32``) against
the int64 reference ``fixed_point.requantize``: hypothesis over multipliers, shifts, ties,
column counts (the specialised 8/16/32/64/128 and any other), int8/int16 in and out.  The native
channels-last max pool (``max_pool_nhwc``) against ``fixed_point.int_max_pool2d`` over geometries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qcompiler.backends.bpu.native.kernels import int32_requant, max_pool_nhwc, requant_columns32
from qcompiler.backends.bpu.sim.fast_pool import _FastMaxPool
from qcompiler.errors import ConfigError
from qcompiler.native import build
from qcompiler.quantization import fixed_point as fp

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
needs_native = pytest.mark.skipif(not build.native_enabled(), reason="native kernels are off on this machine")
_RANGE = {torch.int8: (-128, 127), torch.int16: (-32768, 32767)}


@needs_native
@SETTINGS
@given(st.integers(0, 40), st.sampled_from([1, 3, 8, 16, 17, 32, 64, 100, 128]), st.integers(0, 9),
       st.sampled_from([torch.int8, torch.int16]), st.sampled_from([torch.int8, torch.int16]),
       st.floats(0.01, 300.0), st.integers(0, 40), st.sampled_from(["any", "ties", "one", "relu"]),
       st.integers(0, 2 ** 31 - 1))
def test_int32_cat_pass_equals_the_int64_reference(rows, cols, col0, src_dtype, dst_dtype, ratio, extra, kind, seed):
    lo, hi = _RANGE[dst_dtype]
    if kind == "relu":
        lo = 0
    # the lowering's (M, n): a 31-bit multiplier; "ties": ratio k + 1/2 on a 2**-1 grid; "one": a copy
    M, n = fp.requant_params(torch.tensor(ratio, dtype=torch.float64), mult_bits=31, max_shift=62)
    M, n = int(M), int(n)
    if kind == "ties":
        M, n = 2 * (extra % 7) + 1, 1
    elif kind == "one":
        M, n = 1 << (extra % 20), extra % 20
    narrow = int32_requant(M, n, src_dtype, lo, hi)
    if kind in ("ties", "one") or (src_dtype == torch.int8 and ratio < 4):
        assert narrow is not None  # the usual int8 cats and exact small multipliers: the int32 pass applies
    if narrow is None:
        return
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(src_dtype)
    src = torch.randint(info.min, info.max + 1, (rows, cols), dtype=src_dtype, generator=g)
    if rows:
        src[0, 0], src[-1, -1] = info.min, info.max
    dst = torch.full((rows, col0 + cols + 3), 77, dtype=dst_dtype)
    requant_columns32(src, dst, col0, *narrow, lo, hi)
    want = fp.requantize(src.to(torch.int64), M, n, "qint32").clamp(lo, hi)
    assert torch.equal(dst[:, col0:col0 + cols].to(torch.int64), want)
    assert (dst[:, :col0] == 77).all() and (dst[:, col0 + cols:] == 77).all()  # nothing else written


def test_int32_requant_refuses_what_int32_cannot_reproduce():
    """A ratio 2**-40 above a half: int64 rounds q = 1 up, every int32 multiplier lands on the tie
    (rounded to even, 0) or loses the margin elsewhere -- no narrowing, the int64 pass stays."""
    M, n = (1 << 40) + 1, 41
    assert int32_requant(M, n, torch.int8, -128, 127) is None
    assert int32_requant(1, 0, torch.int32, -128, 127) is None  # not an int8/int16 input
    assert int32_requant(3, 1, torch.int8, -128, 127) == (3 << 22, 23)  # narrowed to the widest int32 shift


@needs_native
def test_requant_columns32_refuses_what_does_not_fit():
    src, dst = torch.zeros(4, 3, dtype=torch.int8), torch.zeros(4, 5, dtype=torch.int8)
    for args in ((src, dst, 3, 1, 0), (src, torch.zeros(5, 5, dtype=torch.int8), 0, 1, 0), (src, dst, 0, 1, 31),
                 (src, dst, 0, 1 << 24, 0), (src.t(), dst, 0, 1, 0), (src.int(), dst, 0, 1, 0),
                 (src.short(), dst, 0, 1 << 16, 0)):
        with pytest.raises(ConfigError, match="requant_columns32"):
            requant_columns32(*args, -128, 127)


@st.composite
def pools(draw):
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))  # torch: padding <= kernel / 2
    dh, dw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    H = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 12))
    W = draw(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 12))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.sampled_from([1, 3, 8, 16, 32, 40, 64, 96, 128])), H=H, W=W, k=(kh, kw),
                s=(draw(st.integers(1, 3)), draw(st.integers(1, 3))), p=(ph, pw), d=(dh, dw), ceil=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.int8, torch.int16])), extremes=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


@needs_native
@SETTINGS
@given(pools())
def test_native_max_pool_equals_torch(c):
    g = torch.Generator().manual_seed(c["seed"])
    info = torch.iinfo(c["dtype"])
    shape = (c["N"], c["C"], c["H"], c["W"])
    if c["extremes"]:  # the type's minimum everywhere but a few maxima: a window of minima stays the minimum
        x = torch.full(shape, info.min, dtype=c["dtype"])
        x.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = info.max
    else:
        x = torch.randint(info.min, info.max + 1, shape, generator=g).to(c["dtype"])
    x = x.contiguous(memory_format=torch.channels_last)
    want = fp.int_max_pool2d(x.contiguous(), c["k"], c["s"], c["p"], c["d"], c["ceil"])
    native = _FastMaxPool(c["k"], c["s"], c["p"], c["d"], c["ceil"], None, native=True)
    got = native(x)
    assert torch.equal(got, want)
    out_hw = [fp.max_pool_out_size(n, k, s_, p, d, c["ceil"]) for n, k, s_, p, d in
              zip((c["H"], c["W"]), c["k"], c["s"], c["p"], c["d"])]
    assert torch.equal(max_pool_nhwc(x, c["k"], c["s"], c["p"], c["d"], out_hw), want)  # also where torch's qint8 pool runs
    # channels-last out, the layout the native GEMM convs read (no transposition before the next conv)
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch_path = _FastMaxPool(c["k"], c["s"], c["p"], c["d"], c["ceil"], _Ws(), native=False)(x)
    assert torch.equal(torch_path, want)


class _Ws:
    """The simulator's scratch buffers, minimal: a fresh tensor per request."""

    def get(self, key, shape, dtype):
        return torch.empty(shape, dtype=dtype)


@needs_native
def test_max_pool_nhwc_refuses_other_layouts():
    x = torch.zeros(1, 3, 4, 4, dtype=torch.int8)
    with pytest.raises(ConfigError, match="channels-last"):
        max_pool_nhwc(x, (2, 2), (2, 2), (0, 0), (1, 1), (2, 2))
    with pytest.raises(ConfigError, match="channels-last"):
        max_pool_nhwc(x.float().contiguous(memory_format=torch.channels_last), (2, 2), (2, 2), (0, 0), (1, 1), (2, 2))
    with pytest.raises(ConfigError, match="bad geometry"):
        max_pool_nhwc(x.contiguous(memory_format=torch.channels_last), (2, 2), (0, 2), (0, 0), (1, 1), (2, 2))
