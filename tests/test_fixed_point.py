"""BPU fixed-point math (qcompiler.quantization.fixed_point) against int64 references.

The references here are written independently in numpy int64 (loops/einsum),
so the fast kernels are checked bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qcompiler.errors import ConfigError, QCompilerError
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fixed_point import AccumulatorOverflow


def rng(seed=0):
    return np.random.default_rng(seed)


def rint(g, lo, hi, shape):
    return g.integers(lo, hi + 1, size=shape, dtype=np.int64)


# ---------------------------------------------------------------- references


def round_half_even_div(v: int, k: int) -> int:
    """v / 2**k rounded half to even, on Python ints (unbounded)."""
    if k == 0:
        return v
    q, r = divmod(v, 1 << k)  # floor division, r in [0, 2**k)
    half = 1 << (k - 1)
    return q + (1 if r > half or (r == half and q % 2 == 1) else 0)


def ref_requant(acc, M, n, lo, hi):
    """round_half_even(acc*M / 2**n), clamped; Python ints (unbounded)."""
    acc, M, n = (np.asarray(v, dtype=object) for v in (acc, M, n))
    y = np.vectorize(round_half_even_div, otypes=[object])(acc * M, n)
    return np.clip(y, lo, hi).astype(np.int64)


def ref_conv2d(x, w, b, stride, pad, dil, groups):
    x, w = np.asarray(x, np.int64), np.asarray(w, np.int64)
    N, C, H, W = x.shape
    O, Cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    Ho = (H + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((N, O, Ho, Wo), np.int64)
    og = O // groups
    for o in range(O):
        g = o // og
        for i in range(Ho):
            for j in range(Wo):
                acc = np.zeros(N, np.int64)
                for c in range(Cg):
                    for u in range(kh):
                        for v in range(kw):
                            acc += xp[:, g * Cg + c, i * stride[0] + u * dil[0],
                                      j * stride[1] + v * dil[1]] * w[o, c, u, v]
                out[:, o, i, j] = acc + (b[o] if b is not None else 0)
    return out


def ref_conv2d_einsum(x, w, pad):
    """Faster int64 reference (groups=1, stride 1, dilation 1) for big channel counts."""
    x, w = np.asarray(x, np.int64), np.asarray(w, np.int64)
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    O, C, kh, kw = w.shape
    Ho, Wo = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    out = np.zeros((x.shape[0], O, Ho, Wo), np.int64)
    for u in range(kh):
        for v in range(kw):
            out += np.einsum("nchw,oc->nohw", xp[:, :, u:u + Ho, v:v + Wo], w[:, :, u, v])
    return out


# ---------------------------------------------------------------- dtypes, quantize


def test_qrange_and_bad_dtype():
    assert fp.qrange("qint8") == (-128, 127)
    assert fp.qrange("qint16") == (-32768, 32767)
    assert fp.qrange("qint32") == (-(2 ** 31), 2 ** 31 - 1)
    assert fp.storage_dtype("qint16") == torch.int16
    for bad in ("qint4", "float32", None, 8):
        with pytest.raises(ConfigError, match="unknown quantized dtype"):
            fp.qrange(bad)
    with pytest.raises(ConfigError):
        fp.quantize(torch.ones(2), 0.1, "quint8")
    with pytest.raises(ConfigError):
        fp.requantize(torch.ones(2, dtype=torch.int64), 1, 0, "int4")


def test_quantize_half_even_clamp_and_per_channel():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 1000.0, -1000.0])
    q = fp.quantize(x, 1.0, "qint8")
    assert q.dtype == torch.int8
    assert q.tolist() == [0, 2, 2, 0, -2, -2, 127, -128]
    assert fp.quantize(x, 1.0, "qint16").tolist()[-2:] == [1000, -1000]
    # per-channel along axis 0
    x = torch.tensor([[1.0, -1.0], [1.0, -1.0]])
    q = fp.quantize(x, torch.tensor([0.5, 0.25]), "qint8", axis=0)
    assert q.tolist() == [[2, -2], [4, -4]]
    with pytest.raises(ConfigError, match="axis"):
        fp.quantize(x, torch.tensor([0.5, 0.25]), "qint8")
    with pytest.raises(ConfigError):
        fp.quantize(x, 0.0)
    with pytest.raises(ConfigError, match="NaN"):
        fp.quantize(torch.tensor([float("nan")]), 0.1)
    # matches the fake-quant formula (float32 division, torch.round)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 3
    s = torch.tensor(0.0234)
    assert torch.equal(fp.quantize(x, s).long(), torch.clamp(torch.round(x / s), -128, 127).long())


def test_dequantize_and_symmetric_scale():
    q = torch.tensor([[-128, 0, 127]], dtype=torch.int8)
    assert torch.equal(fp.dequantize(q, 0.5), torch.tensor([[-64.0, 0.0, 63.5]]))
    d = fp.dequantize(torch.tensor([[1, 2], [3, 4]]), torch.tensor([1.0, 0.5]), axis=1)
    assert d.dtype == torch.float32 and d.tolist() == [[1.0, 1.0], [3.0, 2.0]]
    assert fp.symmetric_scale(12.7).item() == pytest.approx(0.1)
    assert fp.symmetric_scale(0.0).item() == torch.finfo(torch.float32).eps
    s = fp.symmetric_scale(torch.tensor([327.67, 0.0]), "qint16")
    assert s[0].item() == pytest.approx(0.01) and s[1].item() > 0


# ---------------------------------------------------------------- requant params


@pytest.mark.parametrize("real, M, n", [
    (0.5, 2 ** 14, 15),          # 0.5 = 16384 / 2**15
    (0.75, 24576, 15),           # 0.75 = 24576 / 2**15
    (1.0, 2 ** 14, 14),          # 1.0 normalises to 0.5 * 2**1
    (3.0, 24576, 13),            # 3 = 0.75 * 2**2
    (0.3, 19661, 16),            # 0.3 = 0.6 * 2**-1 -> round(0.6 * 32768) = 19661
    (-0.3, -19661, 16),
    (0.0, 0, 0),
    (1 - 2 ** -17, 2 ** 14, 14),  # mantissa rounds up to 2**15: renormalised
    (3 * 2.0 ** -33, 1, 31),     # would need n = 46 > max_shift: rounded at n = 31
    (2.0 ** -40, 0, 0),          # underflows the max shift entirely
    (32767.0, 32767, 0),
])
def test_requant_params_hand_cases(real, M, n):
    m, s = fp.requant_params(real, mult_bits=15)
    assert (int(m), int(s)) == (M, n)
    assert m.dtype == s.dtype == torch.int64


def test_requant_params_31_bits_vector_and_errors():
    m, s = fp.requant_params(0.5, mult_bits=31)
    assert (int(m), int(s)) == (2 ** 30, 31)
    m, s = fp.requant_params(torch.tensor([0.5, 0.25, 1e-3, 0.0, 2.0]))
    assert m.tolist() == [16384, 16384, round(0.512 * 2 ** 15), 0, 16384]
    assert s.tolist() == [15, 16, 24, 0, 13]
    # precision: relative error <= 2**-mult_bits while the shift fits in max_shift=31
    for bits, low in ((15, 1e-4), (31, 0.5)):
        reals = torch.tensor(rng(1).uniform(low, 100.0, 500))
        m, s = fp.requant_params(reals, mult_bits=bits)
        assert bool((m.abs() < 2 ** bits).all()) and bool(((s >= 0) & (s <= 31)).all())
        approx = m.double() / torch.pow(2.0, s.double())
        assert float(((approx - reals).abs() / reals).max()) <= 2.0 ** -bits
    with pytest.raises(ConfigError, match="too large"):
        fp.requant_params(2.0 ** 15)
    with pytest.raises(ConfigError, match="too large"):
        fp.requant_params(torch.tensor([0.5, 1e6]))
    with pytest.raises(ConfigError, match="finite"):
        fp.requant_params(float("inf"))
    with pytest.raises(ConfigError):
        fp.requant_params(0.5, mult_bits=0)


# ---------------------------------------------------------------- requantize


def test_requantize_rounds_half_to_even():
    # M/2**n = 1/2: acc * 0.5 is an exact tie for odd acc
    acc = torch.tensor([5, 3, 1, -1, -3, -5, 4, -4])
    y = fp.requantize(acc, 1, 1, "qint8")
    #   2.5->2 1.5->2 .5->0 -.5->0 -1.5->-2 -2.5->-2 (ties to even, like torch.round)
    assert y.tolist() == [2, 2, 0, 0, -2, -2, 2, -2]
    assert y.tolist() == torch.round(acc * 0.5).long().tolist()
    # same with a realistic multiplier: 0.5 -> (16384, 15)
    M, n = fp.requant_params(0.5)
    assert fp.requantize(acc, M, n).tolist() == y.tolist()
    # n == 0: no rounding term, plain integer multiply
    assert fp.requantize(torch.tensor([3, -3]), 7, 0).tolist() == [21, -21]
    # non-tie values round to nearest
    assert fp.requantize(torch.tensor([7, -7]), 1, 2).tolist() == [2, -2]  # 1.75, -1.75


def test_requantize_clamps_per_dtype():
    acc = torch.tensor([10 ** 6, -(10 ** 6), 300, -300])
    M, n = fp.requant_params(1.0)
    assert fp.requantize(acc, M, n, "qint8").tolist() == [127, -128, 127, -128]
    assert fp.requantize(acc, M, n, "qint16").tolist() == [32767, -32768, 300, -300]
    assert fp.requantize(acc, M, n, "qint16").dtype == torch.int16
    assert fp.requantize(acc, M, n, "qint32").tolist() == [10 ** 6, -(10 ** 6), 300, -300]


def test_requantize_per_channel_axis():
    g = rng(2)
    acc = torch.from_numpy(rint(g, -20000, 20000, (2, 3, 4, 5)))
    reals = torch.tensor([0.001, 0.0042, 0.0173])
    M, n = fp.requant_params(reals)
    y = fp.requantize(acc, M, n, "qint8", axis=1)
    ref = ref_requant(acc.numpy(), M.numpy()[None, :, None, None], n.numpy()[None, :, None, None],
                      -128, 127)
    assert np.array_equal(y.numpy(), ref)
    for c in range(3):
        assert torch.equal(y[:, c], fp.requantize(acc[:, c], M[c], n[c]))
    # last axis (linear output), negative axis
    acc2 = acc.reshape(-1, 3)
    y2 = fp.requantize(acc2, M, n, "qint8", axis=-1)
    assert np.array_equal(y2.numpy(), ref_requant(acc2.numpy(), M.numpy(), n.numpy(), -128, 127))
    with pytest.raises(ConfigError, match="axis"):
        fp.requantize(acc, M, n)
    with pytest.raises(ConfigError, match="channels"):
        fp.requantize(acc, M, n, axis=2)


@pytest.mark.parametrize("bits, low, amax", [(15, 1e-5, 300), (31, 1e-2, 2 ** 16)])
def test_requantize_within_one_lsb_of_real(bits, low, amax):
    # the error of M/2**n is <= |real|*2**-bits (or 2**-32 once n hits max_shift),
    # so within these ranges the result is within 1 LSB of round(acc * real)
    g = rng(3)
    reals = np.exp(g.uniform(np.log(low), np.log(4.0), 2000))
    y_real = g.uniform(-amax, amax, 2000)
    acc = np.round(y_real / reals).astype(np.int64)
    M, n = fp.requant_params(torch.tensor(reals), mult_bits=bits)
    y = fp.requantize(torch.from_numpy(acc), M, n, "qint32", axis=0).numpy().astype(np.int64)
    exact = np.round(acc * reals)
    assert np.abs(y - exact).max() <= 1
    # and bit-exact with the int64 reference formula
    assert np.array_equal(y, ref_requant(acc, M.numpy(), n.numpy(), -(2 ** 31), 2 ** 31 - 1))


def test_requantize_overflow_detected():
    acc = torch.tensor([2 ** 40, 5])
    with pytest.raises(AccumulatorOverflow, match="conv7") as ei:
        fp.requantize(acc, 2 ** 30, 31, "qint8", op="conv7")
    assert isinstance(ei.value, OverflowError) and isinstance(ei.value, QCompilerError)
    assert str(2 ** 62) in str(ei.value)
    # per-channel: only the offending channel matters
    acc = torch.tensor([[2 ** 40, 2 ** 40]])
    fp.requantize(acc, torch.tensor([1, 2 ** 10]), torch.tensor([0, 31]), "qint32", axis=1)
    with pytest.raises(AccumulatorOverflow):
        fp.requantize(acc, torch.tensor([1, 2 ** 30]), torch.tensor([0, 31]), "qint32", axis=1)


def test_check_accumulator():
    ok = torch.tensor([2 ** 31 - 1, -(2 ** 31)])
    assert fp.check_accumulator(ok) is ok
    with pytest.raises(AccumulatorOverflow, match=r"layer1\.conv.*-2147483649"):
        fp.check_accumulator(torch.tensor([0, -(2 ** 31) - 1]), op="layer1.conv")
    with pytest.raises(AccumulatorOverflow, match="int16"):
        fp.check_accumulator(torch.tensor([40000]), bits=16, op="x")


# ---------------------------------------------------------------- conv / linear / matmul


@pytest.mark.parametrize("cfg", [
    dict(N=2, C=3, O=4, H=7, W=6, k=(3, 3), stride=(1, 1), pad=(0, 0), dil=(1, 1), groups=1),
    dict(N=1, C=4, O=6, H=9, W=8, k=(3, 2), stride=(2, 1), pad=(1, 2), dil=(1, 1), groups=2),
    dict(N=1, C=5, O=5, H=8, W=8, k=(3, 3), stride=(1, 1), pad=(1, 1), dil=(1, 1), groups=5),  # depthwise
    dict(N=1, C=6, O=3, H=10, W=9, k=(3, 3), stride=(2, 3), pad=(2, 1), dil=(2, 3), groups=3),
    dict(N=1, C=3, O=2, H=5, W=5, k=(1, 1), stride=(1, 1), pad=(0, 0), dil=(1, 1), groups=1),
])
@pytest.mark.parametrize("in_dtype", ["qint8", "qint16"])
def test_int_conv2d_matches_int64_loops(cfg, in_dtype):
    g = rng(4)
    lo, hi = fp.qrange(in_dtype)
    x = rint(g, lo, hi, (cfg["N"], cfg["C"], cfg["H"], cfg["W"]))
    w = rint(g, -128, 127, (cfg["O"], cfg["C"] // cfg["groups"], *cfg["k"]))
    b = rint(g, -(2 ** 20), 2 ** 20, (cfg["O"],))
    args = (cfg["stride"], cfg["pad"], cfg["dil"], cfg["groups"])
    ref = ref_conv2d(x, w, b, *args)
    xt = torch.from_numpy(x).to(fp.storage_dtype(in_dtype))
    wt = torch.from_numpy(w).to(torch.int8)
    out = fp.int_conv2d(xt, wt, torch.from_numpy(b).int(), *args)
    assert out.dtype == torch.int64
    assert np.array_equal(out.numpy(), ref)
    assert np.array_equal(out.numpy(), F.conv2d(torch.from_numpy(x), torch.from_numpy(w),
                                                torch.from_numpy(b), *args).numpy())


@pytest.mark.parametrize("mode", ["f32", "f64", "i64"])
def test_every_kernel_is_exact(mode, monkeypatch):
    # small int8 problems are exact under every kernel: force each one
    monkeypatch.setattr(fp, "_FORCE_MODE", mode)
    g = rng(14)
    x = rint(g, -128, 127, (2, 4, 7, 6))
    for w_shape, args in [((6, 2, 3, 2), ((2, 1), (1, 2), (1, 1), 2)),
                          ((4, 1, 3, 3), ((1, 1), (2, 2), (2, 2), 4)),
                          ((3, 4, 1, 1), ((1, 1), (0, 0), (1, 1), 1))]:
        w = rint(g, -128, 127, w_shape)
        out = fp.int_conv2d(torch.from_numpy(x), torch.from_numpy(w), None, *args)
        assert np.array_equal(out.numpy(), ref_conv2d(x, w, None, *args))
    a, b = rint(g, -128, 127, (3, 5, 9)), rint(g, -128, 127, (9, 4))
    assert np.array_equal(fp.int_matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy(), a @ b)
    bt, at = torch.from_numpy(b.T.copy()), torch.from_numpy(a[0].T.copy())
    assert np.array_equal(fp.int_matmul(bt, at).numpy(), b.T @ a[0].T)
    w = rint(g, -128, 127, (6, 9))
    assert np.array_equal(fp.int_linear(torch.from_numpy(a), torch.from_numpy(w)).numpy(),
                          np.einsum("abk,ok->abo", a, w))


def test_kernel_choice():
    # (k, max|a|, max|b|) -> the fastest provably exact kernel
    assert fp._plan(576, 128, 128, "c") == "f32"            # 3x3x64 int8: 9.4e6 < 2**24
    assert fp._plan(1152, 128, 127, "c") == "f64"           # 3x3x128 int8: 1.87e7 >= 2**24
    assert fp._plan(576, 32768, 128, "c") == "f64"          # int16 activations
    assert fp._plan(9, 2 ** 31, 2 ** 22, "c") == "i64"      # >= 2**53
    with pytest.raises(AccumulatorOverflow, match="bigop"):
        fp._plan(9, 2 ** 40, 2 ** 30, "bigop")
    # float32 GEMM in reduced precision is not exact: never used then
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert fp._plan(576, 128, 128, "c") == "f64"
    finally:
        torch.set_float32_matmul_precision(old)
    assert fp._plan(576, 128, 128, "c") == "f32"


def test_conv_shape_errors():
    x = torch.zeros(1, 4, 5, 5, dtype=torch.int8)
    with pytest.raises(ConfigError, match="groups"):
        fp.int_conv2d(x, torch.zeros(3, 2, 3, 3, dtype=torch.int8), groups=2)
    with pytest.raises(ConfigError, match="fit"):
        fp.int_conv2d(x, torch.zeros(2, 4, 7, 7, dtype=torch.int8))
    with pytest.raises(ConfigError, match="integer"):
        fp.int_conv2d(x.float(), torch.zeros(2, 4, 3, 3))


def test_int_conv2d_adversarial_exact_where_float32_is_not():
    # Cin*kh*kw = 1152; weights all 127, inputs 127 except channel 0 = -128:
    # every output = 1143*127*127 - 9*128*127 = 18_289_143, odd and > 2**24,
    # which float32 cannot even represent.
    C = 128
    x = np.full((1, C, 5, 5), 127, np.int64)
    x[:, 0] = -128
    w = np.full((2, C, 3, 3), 127, np.int64)
    ref = ref_conv2d_einsum(x, w, 0)
    assert (ref == 18_289_143).all() and ref.max() > 2 ** 24
    out = fp.int_conv2d(torch.from_numpy(x).to(torch.int8), torch.from_numpy(w).to(torch.int8))
    assert np.array_equal(out.numpy(), ref)
    f32 = F.conv2d(torch.from_numpy(x).float(), torch.from_numpy(w).float())
    assert not np.array_equal(f32.double().numpy(), ref)  # float32 rounds this wrong
    # random 127/-128 inputs with padding: still exact
    g = rng(5)
    x = np.where(g.random((1, C, 6, 6)) < 0.97, 127, -128).astype(np.int64)
    out = fp.int_conv2d(torch.from_numpy(x).to(torch.int8), torch.from_numpy(w).to(torch.int8),
                        padding=1)
    assert np.array_equal(out.numpy(), ref_conv2d_einsum(x, w, 1))


def test_int_conv2d_int64_path_for_huge_operands():
    # bound k*max|x|*max|w| >= 2**53: the float64 kernel would not be exact
    g = rng(6)
    x = rint(g, -(2 ** 31), 2 ** 31 - 1, (1, 3, 5, 5))
    w = rint(g, -(2 ** 22), 2 ** 22, (2, 3, 3, 3))
    ref = ref_conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1)
    out = fp.int_conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1)
    assert np.array_equal(out.numpy(), ref)
    assert np.abs(ref).max() > 2 ** 53
    f64 = F.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), padding=1)
    assert not np.array_equal(f64.long().numpy(), ref)  # float64 would round here
    with pytest.raises(AccumulatorOverflow, match="bigconv"):
        fp.int_conv2d(torch.full((1, 4, 3, 3), 2 ** 40), torch.full((1, 4, 3, 3), 2 ** 30), op="bigconv")


def test_int_conv2d_overflow_reported_by_check_accumulator():
    x = torch.full((1, 64, 3, 3), 32767, dtype=torch.int16)
    w = torch.full((1, 64, 3, 3), 127, dtype=torch.int8)
    acc = fp.int_conv2d(x, w)
    assert int(acc) == 576 * 32767 * 127 > 2 ** 31  # exact in int64, not wrapped
    with pytest.raises(AccumulatorOverflow, match=r"backbone\.conv3"):
        fp.check_accumulator(acc, op="backbone.conv3")


def test_int_linear_and_matmul():
    g = rng(7)
    x = rint(g, -128, 127, (3, 4, 17))
    w = rint(g, -128, 127, (5, 17))
    b = rint(g, -1000, 1000, (5,))
    out = fp.int_linear(torch.from_numpy(x).to(torch.int8), torch.from_numpy(w).to(torch.int8),
                        torch.from_numpy(b).int())
    assert np.array_equal(out.numpy(), np.einsum("abk,ok->abo", x, w) + b)
    a = rint(g, -32768, 32767, (2, 3, 6, 9))
    c = rint(g, -32768, 32767, (2, 3, 9, 4))
    out = fp.int_matmul(torch.from_numpy(a).to(torch.int16), torch.from_numpy(c).to(torch.int16))
    assert out.dtype == torch.int64
    assert np.array_equal(out.numpy(), np.einsum("bhik,bhkj->bhij", a, c))
    # adversarial: k = 1151 products of 127*127 and one of -128*127: odd and > 2**24
    k = 1152
    x = np.full((1, k), 127, np.int64)
    x[0, 0] = -128
    w = np.full((2, k), 127, np.int64)
    ref = x @ w.T
    assert ref[0, 0] % 2 == 1 and ref[0, 0] > 2 ** 24
    out = fp.int_linear(torch.from_numpy(x).to(torch.int8), torch.from_numpy(w).to(torch.int8))
    assert np.array_equal(out.numpy(), ref)
    assert not np.array_equal(F.linear(torch.from_numpy(x).float(), torch.from_numpy(w).float())
                              .double().numpy(), ref)
    out = fp.int_matmul(torch.from_numpy(x), torch.from_numpy(w.T.copy()))
    assert np.array_equal(out.numpy(), ref)
    # vector operands follow torch.matmul semantics
    v = rint(g, -128, 127, (6,))
    m = rint(g, -128, 127, (2, 6, 3))
    assert np.array_equal(fp.int_matmul(torch.from_numpy(v), torch.from_numpy(m)).numpy(), v @ m)
    assert np.array_equal(fp.int_matmul(torch.from_numpy(m.transpose(0, 2, 1).copy()),
                                        torch.from_numpy(v)).numpy(), m.transpose(0, 2, 1) @ v)
    assert int(fp.int_matmul(torch.from_numpy(v), torch.from_numpy(v))) == int(v @ v)
    # int64 path
    a = rint(g, -(2 ** 30), 2 ** 30, (3, 8))
    c = rint(g, -(2 ** 24), 2 ** 24, (8, 2))
    assert np.array_equal(fp.int_matmul(torch.from_numpy(a), torch.from_numpy(c)).numpy(), a @ c)
    assert np.array_equal(fp.int_linear(torch.from_numpy(a), torch.from_numpy(c.T.copy())).numpy(),
                          a @ c)


# ---------------------------------------------------------------- add / sub / mul / cat


def ref_addsub(qa, Ma, na, qb, Mb, nb, sign, lo, hi):
    s = max(na, nb)
    tot = qa.astype(object) * (Ma << (s - na)) + sign * qb.astype(object) * (Mb << (s - nb))
    y = np.vectorize(round_half_even_div, otypes=[object])(np.asarray(tot, dtype=object), s)
    return np.clip(y, lo, hi).astype(np.int64)


@pytest.mark.parametrize("sa, sb, so", [(0.02, 0.05, 0.06), (0.1, 0.1, 0.1), (0.003, 0.9, 0.5),
                                        (1.0, 1.0 / 3, 2.0)])
def test_int_add_sub(sa, sb, so):
    g = rng(8)
    qa = rint(g, -128, 127, (4, 50))
    qb = rint(g, -128, 127, (4, 50))
    Ma, na, Mb, nb = fp.add_params(sa, sb, so)
    ta, tb = torch.from_numpy(qa).to(torch.int8), torch.from_numpy(qb).to(torch.int8)
    y = fp.int_add(ta, Ma, na, tb, Mb, nb, "qint8")
    assert y.dtype == torch.int8
    assert np.array_equal(y.numpy(), ref_addsub(qa, Ma, na, qb, Mb, nb, 1, -128, 127))
    real = np.clip(np.round((qa * sa + qb * sb) / so), -128, 127)
    assert np.abs(y.numpy().astype(np.int64) - real).max() <= 1
    y = fp.int_sub(ta, Ma, na, tb, Mb, nb, "qint16")
    assert np.array_equal(y.numpy(), ref_addsub(qa, Ma, na, qb, Mb, nb, -1, -32768, 32767))
    real = np.round((qa * sa - qb * sb) / so)
    assert np.abs(y.numpy().astype(np.int64) - real).max() <= 1
    # broadcasting like torch.add
    y = fp.int_add(ta, Ma, na, tb[:1], Mb, nb)
    assert np.array_equal(y.numpy(), ref_addsub(qa, Ma, na, qb[:1], Mb, nb, 1, -128, 127))


def test_int_add_ties_and_overflow():
    # both factors 1/2: (1 + 2)/2 = 1.5 -> 2 ; (-1 - 2)/2 = -1.5 -> -2 (half to even)
    assert fp.int_add(torch.tensor([1, -1]), 1, 1, torch.tensor([2, -2]), 1, 1).tolist() == [2, -2]
    with pytest.raises(AccumulatorOverflow, match="res_add"):
        fp.int_add(torch.tensor([2 ** 40]), 2 ** 30, 0, torch.tensor([1]), 1, 40, op="res_add")
    # very different shifts are exact (no common-scale product is ever formed)
    assert fp.int_add(torch.tensor([2 ** 40]), 2 ** 20, 0, torch.tensor([1]), 1, 40, "qint32").tolist() == [2 ** 31 - 1]
    assert fp.int_add(torch.tensor([100]), 2 ** 30, 60, torch.tensor([3]), 1, 0).tolist() == [3]


def test_round_scaled_sum_matches_python_ints():
    g = rng(31)
    ta = rint(g, -(2 ** 55), 2 ** 55, (2000,))
    tb = rint(g, -(2 ** 45), 2 ** 45, (2000,))
    na = rint(g, 0, 61, (2000,))
    nb = rint(g, 0, 61, (2000,))
    got = fp.round_scaled_sum(*(torch.from_numpy(v) for v in (ta, na, tb, nb))).tolist()
    from fractions import Fraction

    for i in range(2000):
        v = Fraction(int(ta[i]), 2 ** int(na[i])) + Fraction(int(tb[i]), 2 ** int(nb[i]))
        assert got[i] == round(v), (i, v)  # Python's round() on Fractions is half to even
    with pytest.raises(ConfigError):
        fp.int_add(torch.tensor([1]), torch.tensor([1, 2]), 0, torch.tensor([1]), 1, 0)


def test_int_mul():
    g = rng(9)
    qa, qb = rint(g, -128, 127, (100,)), rint(g, -128, 127, (100,))
    sa, sb, so = 0.05, 0.02, 0.03
    M, n = fp.requant_params(sa * sb / so)
    y = fp.int_mul(torch.from_numpy(qa), torch.from_numpy(qb), M, n, "qint8")
    assert np.array_equal(y.numpy(), ref_requant(qa * qb, int(M), int(n), -128, 127))
    real = np.clip(np.round(qa * qb * sa * sb / so), -128, 127)
    assert np.abs(y.numpy().astype(np.int64) - real).max() <= 1


def test_int_cat():
    g = rng(10)
    a = torch.from_numpy(rint(g, -128, 127, (1, 2, 3, 3))).to(torch.int8)
    b = torch.from_numpy(rint(g, -128, 127, (1, 3, 3, 3))).to(torch.int8)
    y = fp.int_cat([a, b], [0.1, 0.037], 0.1, "qint8", dim=1)
    assert y.shape == (1, 5, 3, 3) and y.dtype == torch.int8
    assert torch.equal(y[:, :2], a)  # same scale: unchanged
    M, n = fp.requant_params(0.037 / 0.1)
    assert np.array_equal(y[:, 2:].numpy(), ref_requant(b.numpy(), int(M), int(n), -128, 127))
    with pytest.raises(ConfigError):
        fp.int_cat([a, b], [0.1], 0.1)


# ---------------------------------------------------------------- pools


def ref_window_sum(x, k, s, p):
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    Ho = (x.shape[2] + 2 * p[0] - k[0]) // s[0] + 1
    Wo = (x.shape[3] + 2 * p[1] - k[1]) // s[1] + 1
    out = np.zeros(x.shape[:2] + (Ho, Wo), np.int64)
    for i in range(Ho):
        for j in range(Wo):
            out[:, :, i, j] = xp[:, :, i * s[0]:i * s[0] + k[0], j * s[1]:j * s[1] + k[1]].sum((2, 3))
    return out


@pytest.mark.parametrize("k, s, p", [((2, 2), (2, 2), (0, 0)), ((3, 3), (1, 1), (1, 1)),
                                     ((3, 2), (2, 1), (1, 0))])
def test_int_avg_pool2d(k, s, p):
    g = rng(11)
    x = rint(g, -128, 127, (2, 3, 7, 6))
    s_in, s_out = 0.04, 0.03
    y = fp.int_avg_pool2d(torch.from_numpy(x).to(torch.int8), k, s, p, in_scale=s_in, out_scale=s_out)
    sums = ref_window_sum(x, k, s, p)
    M, n = fp.requant_params(s_in / (k[0] * k[1] * s_out))
    assert np.array_equal(y.numpy(), ref_requant(sums, int(M), int(n), -128, 127))
    real = np.clip(np.round(sums * s_in / (k[0] * k[1] * s_out)), -128, 127)
    assert np.abs(y.numpy().astype(np.int64) - real).max() <= 1


def test_int_global_avg_pool_and_max_pool():
    g = rng(12)
    x = rint(g, -32768, 32767, (2, 4, 5, 7))
    y = fp.int_global_avg_pool(torch.from_numpy(x).to(torch.int16), 0.001, 0.002, "qint16")
    assert y.shape == (2, 4, 1, 1)
    M, n = fp.requant_params(0.001 / (35 * 0.002))
    assert np.array_equal(y.numpy(), ref_requant(x.sum((2, 3), keepdims=True), int(M), int(n),
                                                 -32768, 32767))
    xm = rint(g, -128, 127, (1, 2, 6, 6))
    m = fp.int_max_pool2d(torch.from_numpy(xm).to(torch.int8), 2)
    assert m.dtype == torch.int8
    assert np.array_equal(m.numpy(), xm.reshape(1, 2, 3, 2, 3, 2).max((3, 5)))
    m = fp.int_max_pool2d(torch.from_numpy(xm), 3, 1, 1)
    xp = np.pad(xm, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-(2 ** 40))
    ref = np.array([[[[xp[0, c, i:i + 3, j:j + 3].max() for j in range(6)] for i in range(6)]
                     for c in range(2)]])
    assert np.array_equal(m.numpy(), ref)


# ---------------------------------------------------------------- LUTs, activations


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


LUT_FNS = {
    "sigmoid": (torch.sigmoid, np_sigmoid, 0.05, 1 / 127),
    "tanh": (torch.tanh, np.tanh, 0.03, 1 / 127),
    "exp": (torch.exp, np.exp, 0.02, 0.1),
    "silu": (F.silu, lambda x: x * np_sigmoid(x), 0.06, 0.06),
}


@pytest.mark.parametrize("name", sorted(LUT_FNS))
@pytest.mark.parametrize("in_dtype, out_dtype", [("qint8", "qint8"), ("qint16", "qint16")])
def test_build_lut_matches_float64_formula(name, in_dtype, out_dtype):
    tfn, nfn, s_in, s_out = LUT_FNS[name]
    if in_dtype == "qint16":
        s_in, s_out = s_in / 256, s_out / 256
    lo, hi = fp.qrange(in_dtype)
    olo, ohi = fp.qrange(out_dtype)
    t = fp.build_lut(tfn, s_in, s_out, in_dtype, out_dtype)
    assert t.shape == (hi - lo + 1,) and t.dtype == fp.storage_dtype(out_dtype)
    q = np.arange(lo, hi + 1, dtype=np.int64)
    ref = np.clip(np.round(nfn(q * np.float64(np.float32(s_in))) / np.float64(np.float32(s_out))),
                  olo, ohi)
    assert np.array_equal(t.numpy().astype(np.int64), ref.astype(np.int64))
    g = rng(13)
    x = rint(g, lo, hi, (3, 40))
    y = fp.apply_lut(torch.from_numpy(x).to(fp.storage_dtype(in_dtype)), t, in_dtype)
    assert np.array_equal(y.numpy().astype(np.int64), ref[x - lo].astype(np.int64))


def test_lut_errors():
    t = fp.build_lut(torch.sigmoid, 0.05, 1 / 127)
    with pytest.raises(ConfigError, match="table"):
        fp.apply_lut(torch.tensor([0]), t, "qint16")
    with pytest.raises(ConfigError, match="NaN"):
        fp.build_lut(torch.log, 0.05, 0.05)
    with pytest.raises(ConfigError):
        fp.build_lut(torch.sigmoid, 0.05, 0.05, "qint32")


def test_relu_relu6_leaky_relu():
    q = torch.tensor([-128, -5, -1, 0, 3, 127], dtype=torch.int8)
    assert fp.relu(q).tolist() == [0, 0, 0, 0, 3, 127]
    # 6 / 0.05 = 120
    assert fp.relu6(torch.tensor([-3, 50, 119, 120, 121, 127]), 0.05).tolist() == [0, 50, 119, 120, 120, 120]
    assert fp.relu6(q, 0.01).tolist() == [0, 0, 0, 0, 3, 127]  # round(600) capped at qmax
    M, n = fp.requant_params(0.5)
    y = fp.leaky_relu(q, M, n)
    # negatives times 0.5, ties to even: -5*0.5=-2.5 -> -2, -1*0.5 -> 0
    assert y.tolist() == [-64, -2, 0, 0, 3, 127] and y.dtype == torch.int8
    M, n = fp.requant_params(0.1)
    qq = torch.arange(-128, 128)
    y = fp.leaky_relu(qq, M, n).long()
    exp = torch.where(qq >= 0, qq, torch.from_numpy(ref_requant(qq.numpy(), int(M), int(n), -128, 127)))
    assert torch.equal(y, exp)
    assert (y - torch.where(qq >= 0, qq.double(), torch.round(qq * 0.1))).abs().max() <= 1


def test_pool_sums_overflowing_int32_are_reported():
    big = torch.full((1, 1, 256, 512), 32767, dtype=torch.int16)  # sum = 32767 * 131072 > 2**31
    with pytest.raises(AccumulatorOverflow, match="gap"):
        fp.int_global_avg_pool(big, 1.0, 30000.0, "qint16", op="gap")
    with pytest.raises(AccumulatorOverflow, match="pool"):
        fp.int_avg_pool2d(torch.full((1, 1, 256, 300), 32767, dtype=torch.int16), (256, 300), in_scale=1.0,
                          out_scale=1.0, out_dtype="qint16", op="pool")
