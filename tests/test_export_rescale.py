"""Ops that bring a feature map to another scale export bit for bit as the compiled model.

The BPU requantizes each input of a cat (and the operands of an add, the product of a mul, the
sums of an average pool...) with an integer multiplier and shift, ``round_half_even(q * M / 2**n)``.
A float export (``DequantizeLinear`` -> float op -> ``QuantizeLinear``) rounds
``float32(q * s_in) / s_out`` instead, which lands on the other side of a tie when ``q * M / 2**n``
is (within float32 error of) ``k + 1/2``: squeezenet1_0's Fire cats (issue 37) had 1-3 of 18816
elements a step off, and the convs after them spread that to 135 of the 1000 logits.

Each test compiles a small model with min/max calibration chosen so that the op's factors are
simple fractions (3/4, 5/8, 1/c, ...: many codes land on ties, off only by the scales' float32
rounding), feeds codes picked to hit those ties, and asserts that onnxruntime's outputs and every
int8 tensor of the export equal the compiled model's (``torch.equal`` / ``np.array_equal``): cat
(2-4 inputs, any dim), the Fire pattern, add / sub / mul / mul by a number, matmul, average and
global average pools, leaky_relu and lookup tables, constant operands, div. Requantize and nearest resize take their output
scale from the same range as the input in a compiled model, so those two build the module directly
at tie-making ratios and compare with it (the simulator's reference arithmetic). Every test failed
on the float export. int16 is not covered: opset 11 has no int16 quantization, so int16 values are
float in the export (``backends/onnx/quant.py``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import qcompiler
from qcompiler.backends.onnx import emit_graph
from qcompiler.ir.meta import META_TENSOR, TensorInfo
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import inference_session
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from test_export_exact import _compiled_int8, _flat, _int8_tensors, _Leaves, _run_with

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- helpers


def _compile(model: nn.Module, example: tuple, calib: list[tuple]):
    """Compile with min/max observers (scale = amax / qmax exactly), so calibration sets the scales."""
    qconfig = {"": get_default_calib_qconfig(observer="minmax")}
    return qcompiler.compile(model.eval(), example, calib_data=calib, qconfig_dict=qconfig, progress=False)


def _module(cm, cls):
    (m,) = [m for m in cm.converted.modules() if isinstance(m, cls)]
    return m


def _entry_scales(cm) -> list[float]:
    """The scale of each graph input's Quantize, in input order (1.0 for an input nothing reads)."""
    gm = cm.converted
    users = [next(iter(n.users), None) for n in gm.graph.nodes if n.op == "placeholder"]
    return [1.0 if u is None else gm.get_submodule(u.target).scale for u in users]


def _near_ties(M: int, n: int, lo: int = -128, hi: int = 127, within: float = 2.0 ** -12) -> list[int]:
    """Codes q in [lo, hi] with q * M / 2**n within ``within`` of some k + 1/2 (exact, in integers)."""
    if n == 0:
        return []
    half, mod = 1 << (n - 1), 1 << n
    return [q for q in range(lo, hi + 1) if abs((q * M) % mod - half) <= within * mod]


def _inputs(codes: list[torch.Tensor], scales: list[float]) -> tuple:
    """float32 inputs that the entry quantizers turn back into ``codes``: float32(q * s)."""
    return tuple(q.to(torch.float32) * torch.tensor(s, dtype=torch.float32) for q, s in zip(codes, scales))


def _ranged(g: torch.Generator, shape, amax: float) -> torch.Tensor:
    """Random calibration values of largest magnitude exactly ``amax`` (a min/max observer's range)."""
    x = (torch.rand(shape, generator=g) * 2 - 1) * amax
    return x.flatten().index_fill(0, torch.tensor([0]), amax).reshape(shape)


def _codes(g: torch.Generator, shape, ties: list[int], lo: int = -128, hi: int = 127) -> torch.Tensor:
    """Random codes, about half of them drawn from ``ties``."""
    q = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)
    if ties:
        pick = torch.tensor(ties)[torch.randint(0, len(ties), shape, generator=g)]
        q = torch.where(torch.rand(shape, generator=g) < 0.5, pick, q)
    return q


def assert_bit_exact(cm, inputs: tuple) -> dict:
    """onnxruntime on ``cm.export_onnx`` gives the compiled model's outputs and int8 tensors exactly."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.onnx"
        sidecar = cm.export_onnx(path)
        model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    outs, codes = _run_with(model, _int8_tensors(model, sidecar), [t.numpy() for t in _flat(inputs)])
    with torch.no_grad():
        refs = _flat(cm(*inputs))
    ref_codes = _compiled_int8(cm.converted, inputs)
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        o = torch.from_numpy(o)
        assert o.shape == r.shape and torch.equal(o, r), \
            f"output {i}: {int((o != r).sum())}/{o.numel()} differ (max {float((o - r).abs().max()):.3g})"
    for name, got in codes.items():
        if name in ref_codes:
            assert np.array_equal(got, ref_codes[name]), \
                f"int8 tensor '{name}': {int(np.sum(got != ref_codes[name]))}/{got.size} differ"
    return sidecar


# tie-making factors: odd / (2 * d), below 1
_FRACTIONS = [(2 * j + 1) / (2 * d) for d in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16) for j in range(d) if 2 * j + 1 < 2 * d]


# ---------------------------------------------------------------------------------------------- cat


class _Cat2(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, a, b):
        return torch.cat([a, b], self.dim)


class _Cat3(_Cat2):
    def forward(self, a, b, c):
        return torch.cat([a, b, c], self.dim)


class _Cat4(_Cat2):
    def forward(self, a, b, c, d):
        return torch.cat([a, b, c, d], self.dim)


_CATS = {2: _Cat2, 3: _Cat3, 4: _Cat4}


@st.composite
def cat_cases(draw):
    k = draw(st.integers(2, 4))
    dim = draw(st.sampled_from([1, 1, 2, 3]))
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 6))]
    shapes = []
    for _ in range(k):
        s = list(shape)
        s[dim] = draw(st.integers(1, 4))
        shapes.append(tuple(s))
    top = draw(st.integers(0, k - 1))  # the input with the largest range sets the output scale
    base = draw(st.floats(0.05, 50.0))
    ratios = [1.0 if i == top else draw(st.sampled_from(_FRACTIONS)) for i in range(k)]
    return shapes, dim, base, ratios, draw(st.integers(0, 2 ** 31 - 1))


@SETTINGS
@given(cat_cases())
def test_cat_of_unequal_scales_equals_compiled(case):
    """torch.cat of 2-4 int8 inputs at scales base * odd / (2d): each input requantized to the output
    scale by the BPU's integer multiplier and shift, on codes that hit its ties."""
    shapes, dim, base, ratios, seed = case
    g = torch.Generator().manual_seed(seed)
    amax = [base * r for r in ratios]
    calib = [tuple(_ranged(g, s, a) for s, a in zip(shapes, amax))]
    cm = _compile(_CATS[len(shapes)](dim), tuple(torch.zeros(s) for s in shapes), calib)
    cat = _module(cm, qnn.QuantizedCat)
    params = fp.cat_params(cat.in_scales, cat.out_scale, mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    ties = [_near_ties(M, n) for M, n in params]
    codes = [_codes(g, s, t) for s, t in zip(shapes, ties)]
    assert_bit_exact(cm, _inputs(codes, _entry_scales(cm)))
    hit = sum(int(torch.isin(q, torch.tensor(t, dtype=torch.int64)).sum()) for q, t in zip(codes, ties) if t)
    event(f"{len(shapes)} inputs, tie elements: {'none' if not hit else '1-9' if hit < 10 else '10+'}")


class _Fire(nn.Module):
    """squeezenet's Fire module: a squeeze conv, two expand branches (1x1, 3x3) at different ranges, a
    cat, a conv. The 3x3 branch computes 3/4 of the 1x1 one (its centre tap), so the cat requantizes it
    by about 3/4 and every code 2 mod 4 of it is a near-tie."""

    def __init__(self):
        super().__init__()
        self.squeeze = nn.Conv2d(3, 4, 1)
        self.e1, self.e3 = nn.Conv2d(4, 6, 1), nn.Conv2d(4, 6, 3, padding=1)
        self.head = nn.Conv2d(12, 5, 1)
        with torch.no_grad():
            self.e3.weight.zero_()
            self.e3.weight[:, :, 1, 1] = 0.75 * self.e1.weight[:, :, 0, 0]
            self.e3.bias.copy_(0.75 * self.e1.bias)

    def forward(self, x):
        s = torch.relu(self.squeeze(x))
        return self.head(torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1))


def test_fire_module_export_equals_compiled():
    """The issue's pattern end to end: conv branches -> relu -> cat at two scales -> conv; every int8
    tensor and the output exact on 10 inputs (a float rescale of the cat got some of them wrong)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    cm = _compile(_Fire(), (x,), [(torch.randn(2, 3, 12, 12),) for _ in range(3)])
    cat = _module(cm, qnn.QuantizedCat)
    (M0, n0), (M1, n1) = fp.cat_params(cat.in_scales, cat.out_scale, mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    assert M0 == 1 << n0 and abs(M1 / 2 ** n1 - 0.75) < 1e-6  # e1 sets the output scale, e3 is requantized
    for _ in range(10):
        assert_bit_exact(cm, (torch.randn(2, 3, 12, 12) * 2,))


# ---------------------------------------------------------------------------------------------- add / sub / mul


class _Binary(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, a, b):
        if self.op == "add":
            return a + b
        if self.op == "sub":
            return a - b
        if self.op == "mul":
            return a * b
        return a * -0.375  # mul by a number: requantize(sign * q)


@st.composite
def binary_cases(draw):
    op = draw(st.sampled_from(["add", "sub", "mul", "mul_number"]))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    b_shape = shape if draw(st.booleans()) else (1, shape[1], 1, 1)  # a broadcast operand
    base = draw(st.floats(0.05, 50.0))
    # add / sub: ranges i : j, so the factors are i / (i + j) and j / (i + j); mul: the output range is
    # amax_a times the code c of b, so the factor is 1 / c
    i, j = draw(st.sampled_from([(1, 1), (1, 3), (3, 5), (1, 7), (3, 1), (5, 3), (3, 13)]))
    c = draw(st.sampled_from([2, 4, 6, 8, 10, 12, 16]))
    return op, shape, b_shape, base * i, base * j, c, draw(st.integers(0, 2 ** 31 - 1))


@SETTINGS
@given(binary_cases())
def test_add_sub_mul_of_unequal_scales_equal_compiled(case):
    """Two int8 feature maps at calibrated scales whose factors make ties: add / sub (one rounding of
    qa * Ma / 2**na +- qb * Mb / 2**nb), mul (requantize(qa * qb)), and a mul by a number."""
    op, shape, b_shape, amax_a, amax_b, c, seed = case
    g = torch.Generator().manual_seed(seed)
    a, b = _ranged(g, shape, amax_a), _ranged(g, b_shape, amax_b)
    if op == "sub":  # element 0 of a - b at amax_a + amax_b
        b = -b
    elif op == "mul":  # the product's range at element 0: amax_a times b's code c; b's own range elsewhere
        a = torch.zeros(shape).flatten().index_fill(0, torch.tensor([0]), amax_a).reshape(shape)
        b = torch.zeros(b_shape).flatten().index_fill(0, torch.tensor([0]), c * amax_b / 127)
        b = b.index_fill(0, torch.tensor([b.numel() - 1]), amax_b).reshape(b_shape)
    cm = _compile(_Binary(op), (torch.zeros(shape), torch.zeros(b_shape)), [(a, b)])
    cls = qnn.QuantizedAdd if op in ("add", "sub") else qnn.QuantizedMul
    assert sum(isinstance(m, cls) for m in cm.converted.modules()) == 1
    r = int((127 * c) ** 0.5) if op == "mul" else 127  # mul: most products / c within the int8 range
    codes = [torch.randint(-r, r + 1, s, generator=g) for s in (shape, b_shape)]
    assert_bit_exact(cm, _inputs(codes, _entry_scales(cm)))
    event(op)


# ---------------------------------------------------------------------------------------------- pools


class _Pool(nn.Module):
    def __init__(self, kernel, stride, padding):
        super().__init__()
        self.kernel, self.stride, self.padding = kernel, stride, padding

    def forward(self, x):
        if self.kernel is None:
            return torch.nn.functional.adaptive_avg_pool2d(x, 1)
        return torch.nn.functional.avg_pool2d(x, self.kernel, self.stride, self.padding)


@st.composite
def pool_cases(draw):
    kernel = None  # a global pool, one time in four
    if draw(st.integers(0, 3)):
        kernel = (draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([2, 4])))
    stride = None if kernel is None else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = 0 if kernel is None else (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
    lo = (1, 1) if kernel is None else kernel
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(lo[0], 8)), draw(st.integers(lo[1], 8)))
    return kernel, stride, padding, shape, draw(st.floats(0.05, 50.0)), draw(st.integers(0, 2 ** 31 - 1))


@SETTINGS
@given(pool_cases())
def test_average_pools_equal_compiled(case):
    """avg_pool2d (even windows, strides, paddings) and a global average pool: calibrated on a constant
    input, the output scale is the input's and the factor 1 / (window size), so every window sum that is
    an odd multiple of half the window size is a tie."""
    kernel, stride, padding, shape, amax, seed = case
    g = torch.Generator().manual_seed(seed)
    cm = _compile(_Pool(kernel, stride, padding), (torch.zeros(shape),), [(torch.full(shape, amax),)])
    pool = _module(cm, qnn.QuantizedAvgPool)
    assert (pool.kernel is None) == (kernel is None)
    codes = torch.randint(-128, 128, shape, generator=g)
    assert_bit_exact(cm, _inputs([codes], _entry_scales(cm)))
    event("global" if kernel is None else f"kernel {kernel[0] * kernel[1]}")


# ---------------------------------------------------------------------------------------------- requantize / matmul


class _Requant(nn.Module):
    def __init__(self, in_scale: float, out_scale: float):
        super().__init__()
        self.q, self.rq, self.dq = qnn.Quantize(in_scale), qnn.Requantize(in_scale, "qint8", out_scale, "qint8"), \
            qnn.DeQuantize()

    def forward(self, x):
        return self.dq(self.rq(self.q(x)))


@SETTINGS
@given(st.floats(1e-3, 10.0), st.sampled_from(_FRACTIONS + [1 / f for f in _FRACTIONS]), st.integers(0, 2 ** 31 - 1))
def test_requantize_equals_the_simulator(out_scale, ratio, seed):
    """A Requantize (a QuantStub on an int8 value) at s_in / s_out = odd / (2d) or its inverse, on every
    code and random ones, against the module (the simulator's ``fixed_point.requantize``): a compiled
    model's stub gets its scale from a second observer of the same values, which cannot be steered
    onto ties."""
    in_scale = float(torch.tensor(out_scale * ratio, dtype=torch.float32))
    root = _Requant(in_scale, out_scale)
    gm = fx.GraphModule(root, _Leaves().trace(root))
    g = torch.Generator().manual_seed(seed)
    codes = torch.cat([torch.arange(-128, 128), torch.randint(-128, 128, (64,), generator=g)])  # every code
    x = _inputs([codes.reshape(1, 4, 5, 16)], [in_scale])[0]
    propagate_shapes(gm, (x,))
    model = emit_graph(gm, quantize=True)
    onnx.checker.check_model(model, full_check=True)
    got = torch.from_numpy(inference_session(model).run(None, {model.graph.input[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = gm(x)
    assert torch.equal(got, want), f"{int((got != want).sum())}/{got.numel()} differ"
    # the entry's QuantizeLinear only: the requantization is on integers, not a float Q/DQ
    assert [n.op_type for n in model.graph.node].count("QuantizeLinear") == 1


class _Matmul(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)


@SETTINGS
@given(st.integers(1, 2), st.integers(1, 5), st.integers(2, 12), st.integers(2, 5), st.floats(0.05, 50.0),
       st.sampled_from([2, 4, 6, 8, 12, 16]), st.integers(0, 2 ** 31 - 1))
def test_matmul_of_feature_maps_equals_compiled(batch, m, k, n, amax, c, seed):
    """a @ b of two int8 feature maps: MatMulInteger, then requantize(acc) by s_a * s_b / s_out = 1 / c
    (calibrated so that the product's range is amax_a times b's code c), so every sum that is an odd
    multiple of c / 2 is a tie."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(batch, m, k).index_put_((torch.tensor(0), torch.tensor(0), torch.tensor(0)), torch.tensor(amax))
    b = torch.zeros(k, n)
    b[0, 0], b[1, 1] = c * amax / 127, amax  # b's range where a is 0; the product's range c * s_a * s_b
    cm = _compile(_Matmul(), (a, b), [(a, b)])
    assert sum(isinstance(mod, qnn.QuantizedMatmul) for mod in cm.converted.modules()) == 1
    r = max(1, int((127 * c / k) ** 0.5))  # codes in [-r, r]: most sums / c within the int8 range
    codes = [torch.randint(-r, r + 1, s, generator=g) for s in ((batch, m, k), (k, n))]
    assert_bit_exact(cm, _inputs(codes, _entry_scales(cm)))


# ---------------------------------------------------------------------------------------------- prelu / lookup / resize


class _Act(nn.Module):
    def __init__(self, op: str, slope: float):
        super().__init__()
        self.op, self.slope = op, slope

    def forward(self, x):
        if self.op == "leaky_relu":
            return torch.nn.functional.leaky_relu(x, self.slope)
        return torch.sigmoid(x) if self.op == "sigmoid" else torch.tanh(x)


@SETTINGS
@given(st.sampled_from(["leaky_relu", "sigmoid", "tanh"]), st.sampled_from(_FRACTIONS), st.floats(0.05, 50.0))
def test_leaky_relu_and_lookups_equal_compiled(op, slope, amax):
    """leaky_relu with slopes odd / (2d) (the negative codes times M / 2**n ~ slope hit ties) and lookup
    tables (sigmoid, tanh: the float64 table, not onnxruntime's float32 function), on every code.
    (PReLU itself does not run on bayes.)"""
    x = torch.linspace(-amax, amax, 256).reshape(1, 1, 16, 16)
    cm = _compile(_Act(op, slope), (x,), [(x,)])
    assert sum(isinstance(m, (qnn.QuantizedPReLU, qnn.QuantizedLookup)) for m in cm.converted.modules()) == 1
    codes = torch.arange(-128, 128).reshape(1, 1, 16, 16)
    assert_bit_exact(cm, _inputs([codes], _entry_scales(cm)))


@SETTINGS
@given(st.floats(1e-3, 10.0), st.sampled_from(_FRACTIONS + [1 / f for f in _FRACTIONS]), st.integers(1, 3),
       st.integers(0, 2 ** 31 - 1))
def test_nearest_resize_equals_the_simulator(out_scale, ratio, factor, seed):
    """Nearest resize to another scale, ``round(float64(q) * s_in / s_out)`` at tie-making ratios, against
    the module (the simulator's reference); as for the requantize, a compiled model's output scale
    comes from the same range, so the module is built directly."""
    in_scale = float(torch.tensor(out_scale * ratio, dtype=torch.float32))
    root = _Resize(in_scale, out_scale, (16 * factor, 16))
    gm = fx.GraphModule(root, _Leaves().trace(root))
    codes = torch.randint(-128, 128, (2, 2, 16, 16), generator=torch.Generator().manual_seed(seed))
    codes[0, 0] = torch.arange(-128, 128).reshape(16, 16)
    x = _inputs([codes], [in_scale])[0]
    propagate_shapes(gm, (x,))
    gm.graph.find_nodes(op="call_module", target="q")[0].meta[META_TENSOR] = TensorInfo(tuple(x.shape), "i8")
    model = emit_graph(gm, quantize=True)
    onnx.checker.check_model(model, full_check=True)
    got = torch.from_numpy(inference_session(model).run(None, {model.graph.input[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = gm(x)
    assert got.shape == want.shape and torch.equal(got, want), f"{int((got != want).sum())}/{got.numel()} differ"


class _Resize(nn.Module):
    def __init__(self, in_scale: float, out_scale: float, size):
        super().__init__()
        self.q, self.dq = qnn.Quantize(in_scale), qnn.DeQuantize()
        self.resize = qnn.QuantizedResize("nearest", in_scale, out_scale, "qint8", size, None)

    def forward(self, x):
        return self.dq(self.resize(self.q(x)))


# ---------------------------------------------------------------------------------------------- constant operands


class _WithConstant(nn.Module):
    def __init__(self, op: str, constant: torch.Tensor):
        super().__init__()
        self.op = op
        self.register_buffer("c", constant)

    def forward(self, x):
        if self.op == "add":
            return x + self.c
        if self.op == "sub":
            return x - self.c
        if self.op == "rsub":
            return self.c - x
        return x * self.c


@SETTINGS
@given(binary_cases(), st.sampled_from(["add", "sub", "rsub", "mul"]))
def test_constant_operands_equal_compiled(case, op):
    """add / sub / mul of an int8 feature map and a buffer (a QuantizedConstantOperand), calibrated as
    the two-feature-map case: the constant's range i : j of the input's (add, sub), or its code c where
    the input has its range (mul)."""
    _, shape, c_shape, amax_x, amax_c, c, seed = case
    g = torch.Generator().manual_seed(seed)
    x = _ranged(g, shape, amax_x)
    const = _ranged(g, c_shape, amax_c)
    if op == "sub":
        const = -const
    elif op == "rsub":
        x = -x
    elif op == "mul":
        x = torch.zeros(shape).flatten().index_fill(0, torch.tensor([0]), amax_x).reshape(shape)
        const = torch.zeros(c_shape).flatten().index_fill(0, torch.tensor([0]), c * amax_c / 127)
        const = const.index_fill(0, torch.tensor([const.numel() - 1]), amax_c).reshape(c_shape)
    cm = _compile(_WithConstant(op, const), (torch.zeros(shape),), [(x,)])
    assert sum(isinstance(m, qnn.QuantizedConstantOperand) for m in cm.converted.modules()) == 1
    r = int((127 * c) ** 0.5) if op == "mul" else 127
    assert_bit_exact(cm, _inputs([torch.randint(-r, r + 1, shape, generator=g)], _entry_scales(cm)))
    event(op)


# ---------------------------------------------------------------------------------------------- div


class _Div(nn.Module):
    def forward(self, a, b):
        return a / b


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 6), st.floats(0.05, 50.0), st.floats(0.05, 50.0), st.integers(0, 2 ** 31 - 1))
def test_div_of_feature_maps_equals_compiled(c, w, amax_a, amax_b, seed):
    """a / b of two int8 feature maps, calibrated with b at its range everywhere: the output range is
    amax_a / amax_b, so the factor for divisor code qb is about 127 / qb and even divisors make ties.
    Codes: |qa| <= |qb| (the result in range), divisors even, odd and 0 (saturating)."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, c, 4, w)
    a = _ranged(g, shape, amax_a)
    cm = _compile(_Div(), (a, a), [(a, torch.full(shape, amax_b))])
    assert sum(isinstance(m, qnn.QuantizedDiv) for m in cm.converted.modules()) == 1
    qb = torch.randint(-16, 17, shape, generator=g) * torch.randint(1, 3, shape, generator=g)
    qa = (torch.rand(shape, generator=g) * 2 - 1).mul(qb.abs() + 1).round().to(torch.int64).clamp(-128, 127)
    assert_bit_exact(cm, _inputs([qa, qb], _entry_scales(cm)))
