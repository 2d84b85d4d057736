"""The simulator's fast nash kernels (``backends/bpu/sim/fast_nash.py``: matmul, add, sub, mul, lut,
softmax, layer_norm) against their reference kernels (the ``fixed_point`` functions): hypothesis over
shapes, axes, broadcasting, int8/int16 in and out, multipliers up to 31 bits and shifts up to 61,
extreme codes and constructed ties, torch.equal (values and dtype); and the calls outside each
fast kernel's proof raising exactly what the reference raises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim import fast_nash
from qcompiler.backends.bpu.sim.registry import FAST, REFERENCE, KernelSpec
from qcompiler.errors import ConfigError
from qcompiler.quantization import fixed_point as fp

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_ST = {"qint8": torch.int8, "qint16": torch.int16}
DTYPES = st.sampled_from(["qint8", "qint16"])
FILLS = st.sampled_from(["random", "random", "min", "max", "extremes", "small", "zero"])


def _codes(shape, dtype: str, fill: str, seed: int) -> torch.Tensor:
    lo, hi = fp.qrange(dtype)
    g = torch.Generator().manual_seed(seed)
    if fill == "min":
        t = torch.full(shape, lo, dtype=torch.int64)
    elif fill == "max":
        t = torch.full(shape, hi, dtype=torch.int64)
    elif fill == "extremes":
        t = torch.where(torch.rand(shape, generator=g) < 0.5, lo, hi) if len(shape) else torch.tensor(lo)
    elif fill == "small":
        t = torch.randint(-3, 4, shape, generator=g)
    elif fill == "zero":
        t = torch.zeros(shape, dtype=torch.int64)
    else:
        t = torch.randint(lo, hi + 1, shape, generator=g)
    return t.to(_ST[dtype])


def _spec(kind: str, inputs: list, attrs: dict, tensors: dict, in_dtypes: list) -> KernelSpec:
    op = BpuOp(kind, inputs, "y", attrs, tensors)
    return KernelSpec(op, [ValueSpec(n, d, 0.1) for n, d in zip(inputs, in_dtypes)], "prog/y", None, False)


def _same(k: KernelSpec, *xs) -> None:
    """The fast kernel's result is the reference's, or both raise the same error."""
    fast, ref = FAST[k.op.kind](k), REFERENCE[k.op.kind](k)
    try:
        want = ref(*xs)
    except Exception as e:  # noqa: BLE001  (whatever the reference raises, the fast kernel must too)
        with pytest.raises(type(e)):
            fast(*xs)
        return
    got = fast(*xs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got.to(torch.int64) - want.to(torch.int64)).abs().max()


_MN = st.tuples(st.floats(1e-6, 60.0), st.sampled_from([15, 24, 31]), st.sampled_from([31, 45, 61]))


def _requant(real: float, bits: int, max_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    return fp.requant_params(real, mult_bits=bits, max_shift=max_shift)


# --- matmul


@SETTINGS
@given(batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 9), k=st.integers(1, 300),
       p=st.integers(1, 9), da=DTYPES, db=DTYPES, out=DTYPES, fill_a=FILLS, fill_b=FILLS, mn=_MN,
       broadcast=st.booleans(), seed=st.integers(0, 1 << 20))
def test_matmul(batch, m, k, p, da, db, out, fill_a, fill_b, mn, broadcast, seed):
    M, n = _requant(mn[0] / k, mn[1], mn[2])
    spec = _spec("matmul", ["a", "b"], {"out_dtype": out, "out_scale": 0.1}, {"M": M, "n": n}, [da, db])
    b_batch = [1] * len(batch) if broadcast else batch
    _same(spec, _codes((*batch, m, k), da, fill_a, seed), _codes((*b_batch, k, p), db, fill_b, seed + 1))


def test_matmul_ties_and_errors():
    """Exact halves round to even; a shape mismatch raises the reference's ConfigError."""
    M, n = torch.tensor(1), torch.tensor(1)  # y = acc / 2: every odd accumulator is a tie
    spec = _spec("matmul", ["a", "b"], {"out_dtype": "qint8", "out_scale": 0.1}, {"M": M, "n": n},
                 ["qint8", "qint8"])
    a = torch.arange(-9, 9, dtype=torch.int8).reshape(1, 18, 1)
    b = torch.ones(1, 1, 3, dtype=torch.int8)
    _same(spec, a, b)
    y = FAST["matmul"](spec)(a, b)
    assert y[0, :, 0].tolist() == [round(v / 2) for v in range(-9, 9)]  # Python rounds half to even too
    with pytest.raises(ConfigError):
        FAST["matmul"](spec)(a, torch.ones(1, 2, 3, dtype=torch.int8))


# --- add / sub


@SETTINGS
@given(kind=st.sampled_from(["add", "sub"]), shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       da=DTYPES, db=DTYPES, out=DTYPES, fill_a=FILLS, fill_b=FILLS,
       scales=st.tuples(st.floats(1e-4, 10.0), st.floats(1e-4, 10.0), st.floats(1e-4, 10.0)),
       bits=st.sampled_from([15, 31]), how=st.sampled_from(["same", "bcast_a", "bcast_b", "const0", "const1"]),
       seed=st.integers(0, 1 << 20))
def test_add_sub(kind, shape, da, db, out, fill_a, fill_b, scales, bits, how, seed):
    Ma, na, Mb, nb = fp.add_params(*scales, mult_bits=bits, max_shift=61)
    tensors = {"Ma": torch.tensor(Ma), "na": torch.tensor(na), "Mb": torch.tensor(Mb), "nb": torch.tensor(nb)}
    a, b = _codes(shape, da, fill_a, seed), _codes(shape, db, fill_b, seed + 1)
    if how == "bcast_a":
        a = a[..., :1]
    elif how == "bcast_b":
        b = b[..., :1]
    attrs = {"out_dtype": out, "out_scale": 0.1}
    if how.startswith("const"):
        i = int(how[-1])
        tensors["constant"] = (a, b)[i]
        spec = _spec(kind, ["x"], {**attrs, "constant_index": i}, tensors, [(da, db)[1 - i]])
        _same(spec, (a, b)[1 - i])
    else:
        _same(_spec(kind, ["a", "b"], attrs, tensors, [da, db]), a, b)


def test_add_ties():
    """a/2 + b/2 with odd sums: exact halves, rounded to even by both kernels."""
    t = {"Ma": torch.tensor(1), "na": torch.tensor(1), "Mb": torch.tensor(1), "nb": torch.tensor(1)}
    spec = _spec("add", ["a", "b"], {"out_dtype": "qint8", "out_scale": 0.1}, t, ["qint8", "qint8"])
    a = torch.arange(-128, 128, dtype=torch.int8)
    b = torch.ones(256, dtype=torch.int8)
    _same(spec, a, b)
    assert FAST["add"](spec)(a, b).tolist() == [max(-128, min(127, round((v + 1) / 2))) for v in range(-128, 128)]


# --- mul


@SETTINGS
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), da=DTYPES, db=DTYPES, out=DTYPES,
       fill_a=FILLS, fill_b=FILLS, mn=_MN, how=st.sampled_from(["binary", "bcast", "const0", "const1", "unary"]),
       sign=st.sampled_from([1, -1]), seed=st.integers(0, 1 << 20))
def test_mul(shape, da, db, out, fill_a, fill_b, mn, how, sign, seed):
    M, n = _requant(mn[0] / 1000, mn[1], mn[2])
    a, b = _codes(shape, da, fill_a, seed), _codes(shape, db, fill_b, seed + 1)
    attrs, tensors = {"out_dtype": out, "out_scale": 0.1}, {"M": M, "n": n}
    if how == "unary":
        _same(_spec("mul", ["x"], {**attrs, "const": 0.5, "sign": sign}, tensors, [da]), a)
    elif how.startswith("const"):
        i = int(how[-1])
        tensors["constant"] = (a, b)[i]
        _same(_spec("mul", ["x"], {**attrs, "constant_index": i}, tensors, [(da, db)[1 - i]]), (a, b)[1 - i])
    else:
        _same(_spec("mul", ["a", "b"], attrs, tensors, [da, db]), a, b[..., :1] if how == "bcast" else b)


# --- lut


@SETTINGS
@given(shape=st.lists(st.integers(1, 7), max_size=4), dtype=DTYPES, out=DTYPES, fill=FILLS,
       transpose=st.booleans(), seed=st.integers(0, 1 << 20))
def test_lut(shape, dtype, out, fill, transpose, seed):
    lo, hi = fp.qrange(dtype)
    table = _codes((hi - lo + 1,), out, "random", seed + 7)
    spec = _spec("lut", ["x"], {"fn": "gelu", "in_dtype": dtype, "out_dtype": out, "out_scale": 0.1},
                 {"table": table}, [dtype])
    x = _codes(shape, dtype, fill, seed)
    _same(spec, x.transpose(0, -1) if transpose and x.dim() > 1 else x)


def test_lut_wrong_dtype_goes_to_the_reference():
    """An int16 tensor for an int8 table: the reference's ConfigError, not a wrong lookup."""
    spec = _spec("lut", ["x"], {"fn": "gelu", "in_dtype": "qint8", "out_dtype": "qint8", "out_scale": 0.1},
                 {"table": torch.zeros(256, dtype=torch.int8)}, ["qint8"])
    with pytest.raises(ConfigError):
        FAST["lut"](spec)(torch.tensor([300], dtype=torch.int16))


# --- softmax


@SETTINGS
@given(shape=st.lists(st.integers(1, 8), min_size=1, max_size=4), dim=st.integers(-4, 3), dtype=DTYPES,
       out=DTYPES, fill=FILLS, in_scale=st.floats(1e-4, 2.0), out_scale=st.floats(1e-5, 0.1),
       seed=st.integers(0, 1 << 20))
def test_softmax(shape, dim, dtype, out, fill, in_scale, out_scale, seed):
    table = fp.softmax_exp_table(in_scale, dtype)
    M, n = fp.softmax_params(out_scale)
    spec = _spec("softmax", ["x"], {"dim": dim, "in_dtype": dtype, "out_dtype": out, "out_scale": out_scale},
                 {"table": table, "M": torch.tensor(M), "n": torch.tensor(n)}, [dtype])
    _same(spec, _codes(shape, dtype, fill, seed))


@SETTINGS
@given(j=st.integers(0, 8), n=st.integers(1, 12), k=st.integers(0, 60), dtype=DTYPES, out=DTYPES,
       rows=st.integers(1, 4))
def test_softmax_ties(j, n, k, dtype, out, rows):
    """Equal codes along an axis of 2**j: E = 2**16 each, S = 2**(16+j), and M = (2k+1) * 2**(j+n-1)
    puts every output exactly on k + 1/2 (rounded up by both kernels)."""
    L, M = 1 << j, (2 * k + 1) << (j + n - 1)
    if M >= 1 << fp.SOFTMAX_MULT_BITS:
        return
    table = fp.softmax_exp_table(0.05, dtype)
    spec = _spec("softmax", ["x"], {"dim": -1, "in_dtype": dtype, "out_dtype": out, "out_scale": 0.01},
                 {"table": table, "M": torch.tensor(M), "n": torch.tensor(n)}, [dtype])
    x = torch.full((rows, L), 5, dtype=_ST[dtype])
    _same(spec, x)
    assert FAST["softmax"](spec)(x).flatten().tolist() == [min(k + 1, fp.qrange(out)[1])] * (rows * L)


def test_softmax_parameters_outside_the_proof():
    """n == 0 (an odd divisor) and a bad table go to the reference: same values, same errors."""
    x = _codes((3, 5), "qint8", "random", 1)
    table = fp.softmax_exp_table(0.1)
    spec = _spec("softmax", ["x"], {"dim": 1, "in_dtype": "qint8", "out_dtype": "qint8", "out_scale": 0.1},
                 {"table": table, "M": torch.tensor(9), "n": torch.tensor(0)}, ["qint8"])
    _same(spec, x)
    bad = _spec("softmax", ["x"], {"dim": 1, "in_dtype": "qint8", "out_dtype": "qint8", "out_scale": 0.1},
                {"table": -table, "M": torch.tensor(9), "n": torch.tensor(3)}, ["qint8"])
    with pytest.raises(ConfigError):
        FAST["softmax"](bad)(x)


# --- layer_norm


@SETTINGS
@given(lead=st.lists(st.integers(1, 5), max_size=2), group=st.lists(st.integers(1, 40), min_size=1, max_size=2),
       dtype=DTYPES, out=DTYPES, fill=FILLS, in_scale=st.floats(1e-3, 1.0), out_scale=st.floats(1e-3, 1.0),
       eps=st.sampled_from([0.0, 1e-5, 1e-2, 10.0]), affine=st.sampled_from(["none", "weight", "both", "big_bias"]),
       seed=st.integers(0, 1 << 20))
def test_layer_norm(lead, group, dtype, out, fill, in_scale, out_scale, eps, affine, seed):
    g = torch.Generator().manual_seed(seed)
    shape = tuple(group)
    w = None if affine == "none" else torch.randn(shape, generator=g, dtype=torch.float64)
    b = torch.randn(shape, generator=g, dtype=torch.float64) * (1e6 if affine == "big_bias" else 1.0) \
        if affine in ("both", "big_bias") else None
    M, n, B = fp.layer_norm_params(w, b, shape, out_scale)
    N = int(torch.tensor(shape).prod())
    E = fp.layer_norm_eps_units(eps, in_scale, N)
    spec = _spec("layer_norm", ["x"], {"dims": len(shape), "in_dtype": dtype, "in_scale": in_scale,
                                       "out_dtype": out, "out_scale": out_scale},
                 {"M": M, "n": n, "B": B, "eps": torch.tensor(E)}, [dtype])
    _same(spec, _codes((*lead, *shape), dtype, fill, seed))


def test_layer_norm_wide_group_int8():
    """A ViT-sized group (768) of int8 codes: the float64 route, bit-exact; a wrong shape raises."""
    shape = (768,)
    g = torch.Generator().manual_seed(3)
    M, n, B = fp.layer_norm_params(torch.randn(shape, generator=g), torch.randn(shape, generator=g), shape, 0.03)
    spec = _spec("layer_norm", ["x"], {"dims": 1, "in_dtype": "qint8", "in_scale": 0.03, "out_dtype": "qint8",
                                       "out_scale": 0.03},
                 {"M": M, "n": n, "B": B, "eps": torch.tensor(fp.layer_norm_eps_units(1e-6, 0.03, 768))},
                 ["qint8"])
    for fill in ("random", "extremes", "min", "small"):
        _same(spec, _codes((2, 50, 768), "qint8", fill, 5))
    with pytest.raises(ConfigError):
        FAST["layer_norm"](spec)(torch.zeros(2, 767, dtype=torch.int8))


def test_round_shift_is_fixed_point_rounding_shift():
    """The one-shift rounding against fixed_point.rounding_shift, ties and negatives included."""
    v = torch.cat([torch.arange(-70, 70), torch.tensor([(1 << 61) + 3, -(1 << 61) - 5, 1 << 40, -(1 << 40)])])
    for n in (0, 1, 2, 3, 7, 40):
        assert torch.equal(fast_nash._round_shift(v.clone(), n), fp.rounding_shift(v, n))


def test_in_proof_calls_never_reach_the_reference(monkeypatch):
    """ViT-shaped calls run the fast routes: the reference kernel is only called to fill a code
    table (once, on every code), never on the data."""
    calls, original = [], dict(REFERENCE)

    def spy(kind):
        def builder(k):
            ref = original[kind](k)

            def called(*xs):
                calls.append((kind, tuple(x.numel() for x in xs)))
                return ref(*xs)
            return called
        return builder
    for kind in ("matmul", "add", "mul", "lut", "softmax", "layer_norm"):
        monkeypatch.setitem(REFERENCE, kind, spy(kind))
    q = _codes((2, 3, 20, 16), "qint8", "random", 0)
    mn = {"M": torch.tensor(1942418473), "n": torch.tensor(42)}
    add = {"Ma": torch.tensor(1075990927), "na": torch.tensor(30), "Mb": torch.tensor(1310750973),
           "nb": torch.tensor(34)}
    table = fp.softmax_exp_table(0.05)
    Ms, ns = fp.softmax_params(0.0001)
    M, n, B = fp.layer_norm_params(None, torch.ones(16), (16,), 0.05)
    cases = [
        (_spec("matmul", ["a", "b"], {"out_dtype": "qint8", "out_scale": 0.1}, mn, ["qint8"] * 2),
         (q, q.transpose(-1, -2))),
        (_spec("add", ["a", "b"], {"out_dtype": "qint8", "out_scale": 0.1}, add, ["qint8"] * 2), (q, q.flip(0))),
        (_spec("mul", ["a", "b"], {"out_dtype": "qint16", "out_scale": 0.1}, mn, ["qint8"] * 2), (q, q.flip(0))),
        (_spec("softmax", ["x"], {"dim": -1, "in_dtype": "qint8", "out_dtype": "qint8", "out_scale": 1e-4},
               {"table": table, "M": torch.tensor(Ms), "n": torch.tensor(ns)}, ["qint8"]), (q,)),
        (_spec("layer_norm", ["x"], {"dims": 1, "in_dtype": "qint8", "in_scale": 0.03, "out_dtype": "qint8",
                                     "out_scale": 0.05}, {"M": M, "n": n, "B": B, "eps": torch.tensor(7)},
               ["qint8"]), (q,)),
    ]
    for spec, xs in cases:
        got = FAST[spec.op.kind](spec)(*xs)
        assert calls == [], spec.op.kind
        assert torch.equal(got, original[spec.op.kind](spec)(*xs)), spec.op.kind
    lut = _spec("lut", ["x"], {"fn": "gelu", "in_dtype": "qint8", "out_dtype": "qint8", "out_scale": 0.1},
                {"table": _codes((256,), "qint8", "random", 1)}, ["qint8"])
    fast = FAST["lut"](lut)
    fast(q), fast(q.flip(1))
    assert calls == [("lut", (256,))]
