"""Every BPU op kind: simulator (both kernel sets) == converted module == slow pure-integer reference.

Each case is a tiny converted graph built by hand from ``qcompiler.nn.quantized``
modules (float placeholders -> Quantize -> op(s) -> output), lowered with
``lower_partition``; inputs are integers times the input scale, so the
quantized inputs are exactly the chosen integers (also adversarial ones).
"""

from __future__ import annotations

import operator

import int_reference as ref
import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from simulator_configs import CONFIGS

from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.sim.epilogue import Epilogue
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.ir.meta import META_OP, META_PARTITION, META_PLACEMENT
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.layout import same_scale as _same_scale
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qtensor import QTensor
from qcompiler.runtime import Runtime

# every kernel set: fixed_point calls, the fast kernels with float GEMMs, and with int8 GEMMs


class Tiny:
    """Builds a one-partition converted graph (node meta as convert leaves it)."""

    def __init__(self, seed: int = 0) -> None:
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.inputs: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(seed)

    def _mark(self, node: fx.Node, op: str) -> fx.Node:
        node.meta.update({META_PLACEMENT: "bpu", META_PARTITION: "bpu0", META_OP: op})
        return node

    def input(self, ints: torch.Tensor, scale: float, dtype: str = "qint8", name: str = None) -> fx.Node:
        """A float input whose quantization (scale, dtype) is exactly ``ints``."""
        ph = self.graph.placeholder(name or f"x{len(self.inputs)}")
        self.inputs.append(ints.to(torch.float64).mul(scale).float())
        return self.call(qnn.Quantize(scale, dtype), ph, name=f"{ph.name}_q")

    def rand_input(self, shape, scale: float, dtype: str = "qint8", lo=None, hi=None) -> fx.Node:
        qlo, qhi = fp.qrange(dtype)
        ints = torch.randint(qlo if lo is None else lo, (qhi if hi is None else hi) + 1, shape, generator=self.gen)
        return self.input(ints, scale, dtype)

    def call(self, module: nn.Module, *args, name: str = None, op: str = None, **kwargs) -> fx.Node:
        name = name or f"op{len(self.root._modules)}"
        self.root.add_module(name, module)
        node = self.graph.call_module(name, tuple(args), kwargs)
        node.name = name
        return self._mark(node, op or module.qc_op)

    def same_scale(self, op: str, x: fx.Node, *args, method: str = None, function=None, module: nn.Module = None,
                   dtype="qint8", name: str = None, **kwargs) -> fx.Node:
        """A QuantizedSameScale node built the way convert builds it (from the float node)."""
        if method is not None:
            node = self.graph.call_method(method, (x,) + args, kwargs)
        elif function is not None:
            node = self.graph.call_function(function, (x,) + args, kwargs)
        else:
            path = f"float_{len(self.root._modules)}"
            self.root.add_module(path, module)
            node = self.graph.call_module(path, (x,) + args, kwargs)
        node.meta[META_OP] = op
        quantized = _same_scale(node, module, dtype)
        name = name or f"op{len(self.root._modules)}"
        self.root.add_module(name, quantized)
        node.op, node.target, node.name = "call_module", name, name
        return self._mark(node, op)

    def build(self, *outs: fx.Node) -> fx.GraphModule:
        self.graph.output(outs[0] if len(outs) == 1 else tuple(outs))
        return fx.GraphModule(self.root, self.graph)


def weight_layer(kind, w_ints, w_scale, bias, in_scale, out_scale, out_dtype="qint8", geometry=None, act=None,
                 other_scale=None, name="layer"):
    return qnn.QuantizedWeightLayer(kind, w_ints.to(torch.int8), torch.as_tensor(w_scale, dtype=torch.float32),
                                    bias, in_scale, out_scale, out_dtype, geometry or {}, act, other_scale, name=name)


def geometry(stride=1, padding=0, dilation=1, groups=1, output_padding=None):
    g = {"stride": fp._pair(stride), "padding": fp._pair(padding), "dilation": fp._pair(dilation), "groups": groups}
    if output_padding is not None:
        g["output_padding"] = fp._pair(output_padding)
    return g


def ints_of(v):
    if isinstance(v, QTensor):
        return v.int_repr()
    return v


def check_all(gm: fx.GraphModule, tiny: Tiny, reference: bool = True):
    """converted == simulator (both kernel sets), and == the integer reference; returns the program."""
    prog = lower_partition(gm, "bpu0")
    xs = tiny.inputs
    with torch.no_grad():
        conv_out = gm(*xs)
    conv_outs = list(conv_out) if isinstance(conv_out, tuple) else [conv_out]
    for cfg in CONFIGS:
        kernels = f"{cfg['kernels']}{'' if cfg.get('int8_gemm') is None else '/int8=' + str(cfg['int8_gemm'])}"
        sim_out = Runtime.simulated(gm, {"bpu0": prog}, **cfg)(*xs)
        sim_outs = list(sim_out) if isinstance(sim_out, tuple) else [sim_out]
        for c, s in zip(conv_outs, sim_outs):
            if isinstance(c, QTensor):
                assert isinstance(s, QTensor) and s.equal(c), f"{kernels}: simulator != converted"
            else:
                assert torch.equal(s, c), f"{kernels}: simulator != converted"
    if reference:
        ref_outs = ref.run_program(prog, {ph.name: x.numpy() for ph, x in
                                          zip([n for n in gm.graph.nodes if n.op == "placeholder"], xs)})
        for spec, c in zip(prog.outputs, conv_outs):
            got = ints_of(c).numpy()
            want = ref_outs[spec.name]
            assert got.shape == want.shape
            if got.dtype.kind == "f":
                assert np.array_equal(got, want.astype(np.float32)), f"{spec.name}: reference differs"
            else:
                assert np.array_equal(got.astype(np.int64), want), \
                    f"{spec.name}: reference differs at {np.argwhere(got.astype(np.int64) != want)[:5].tolist()}"
    return prog


def rand_w(gen, shape, lo=-127, hi=127):
    return torch.randint(lo, hi + 1, shape, generator=gen)


def rand_scales(gen, n, lo=0.002, hi=0.02):
    return (torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo).float()


# ---------------------------------------------------------------------------- weight layers

CONV_CASES = [
    # Cin, Cout, k, stride, padding, dilation, groups, H, W
    (3, 4, 3, 1, 1, 1, 1, 6, 7),
    (4, 6, 3, 2, 1, 1, 1, 7, 6),
    (4, 5, 1, 1, 0, 1, 1, 5, 5),
    (4, 5, 1, 2, 0, 1, 1, 6, 5),
    (6, 6, 3, 1, 1, 1, 6, 6, 6),  # depthwise
    (6, 6, 3, 2, 1, 1, 6, 7, 7),  # depthwise, strided
    (6, 6, 3, 2, 2, 2, 6, 9, 8),  # depthwise, strided, dilated
    (6, 6, 3, 1, 1, 2, 6, 7, 7),  # depthwise, dilated
    (4, 6, 3, 1, 2, 2, 2, 6, 6),  # grouped, dilated
    (3, 4, (3, 1), (1, 2), (1, 0), 1, 1, 6, 6),
    (5, 3, 5, 1, 2, 1, 1, 5, 4),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c[:3])) + f"-s{c[3]}-g{c[6]}")
@pytest.mark.parametrize("act", [None, "relu", "relu6"])
def test_conv2d(case, act):
    Cin, Cout, k, s, p, d, g, H, W = case
    t = Tiny(seed=hash((case, act)) % 1000)
    kh, kw = fp._pair(k)
    x = t.rand_input((2, Cin, H, W), 0.05)
    w = rand_w(t.gen, (Cout, Cin // g, kh, kw))
    bias = torch.randn(Cout, generator=t.gen)
    layer = weight_layer("conv2d", w, rand_scales(t.gen, Cout), bias, 0.05, 0.04, geometry=geometry(s, p, d, g),
                         act=act, name="conv")
    check_all(t.build(t.call(layer, x, name="conv")), t)


@pytest.mark.parametrize("groups", [1, 4])
def test_conv2d_fused_add_and_int16(groups):
    t = Tiny(seed=3)
    x = t.rand_input((2, 4, 5, 5), 0.01, "qint16", lo=-3000, hi=3000)
    other = t.rand_input((2, 8, 5, 5), 0.02)
    w = rand_w(t.gen, (8, 4 // groups, 3, 3))
    layer = weight_layer("conv2d", w, rand_scales(t.gen, 8), torch.randn(8, generator=t.gen), 0.01, 0.03,
                         out_dtype="qint16", geometry=geometry(1, 1, 1, groups), act="relu", other_scale=0.02)
    check_all(t.build(t.call(layer, x, other, name="conv")), t)


def test_conv2d_ties_and_tiny_factors(monkeypatch):
    """Power-of-two factors make exact ties (half to even); a large shift (n > 53 - 15 for int16
    output) takes the fast epilogue off its static path (near-tie detection + exact int64 fix-up)."""
    fixed = []
    exact = Epilogue._exact
    monkeypatch.setattr(Epilogue, "_exact",
                        lambda self, y, flag, *a: (fixed.append(int(flag.sum())), exact(self, y, flag, *a)))
    t = Tiny(seed=4)
    x = t.rand_input((1, 3, 6, 6), 1.0)
    other = t.rand_input((1, 4, 6, 6), 0.5)
    w = rand_w(t.gen, (4, 3, 3, 3))
    tie = weight_layer("conv2d", w, torch.full((4,), 0.5), None, 1.0, 1.0, geometry=geometry(1, 1),
                       other_scale=0.5, name="tie")  # acc * 0.5 + b * 0.5
    y = t.call(tie, x, other, name="tie")
    tiny = weight_layer("conv2d", rand_w(t.gen, (4, 4, 1, 1)), torch.full((4,), 1e-6), None, 1.0, 3e-3,
                        out_dtype="qint16", geometry=geometry(), name="tiny")
    prog = check_all(t.build(t.call(tiny, y, name="tiny")), t)
    assert int(prog.ops[-1].tensors["n"].max()) > 53 - 15
    assert sum(fixed) > 0  # the exact ties were recomputed in int64


def test_conv_transpose2d():
    t = Tiny(seed=5)
    x = t.rand_input((2, 4, 4, 5), 0.05)
    w = rand_w(t.gen, (4, 3, 3, 3))  # (Cin, Cout/g, kh, kw)
    layer = weight_layer("conv_transpose2d", w, rand_scales(t.gen, 3), torch.randn(3, generator=t.gen), 0.05, 0.05,
                         geometry=geometry(2, 1, 1, 1, output_padding=1), act="relu")
    check_all(t.build(t.call(layer, x, name="deconv")), t)


@pytest.mark.parametrize("with_add", [False, True])
def test_linear(with_add):
    t = Tiny(seed=6)
    x = t.rand_input((3, 2, 20), 0.05)
    other = t.rand_input((3, 2, 7), 0.1) if with_add else None
    layer = weight_layer("linear", rand_w(t.gen, (7, 20)), rand_scales(t.gen, 7), torch.randn(7, generator=t.gen),
                         0.05, 0.08, other_scale=0.1 if with_add else None)
    args = (x, other) if with_add else (x,)
    check_all(t.build(t.call(layer, *args, name="fc")), t)


def test_high_precision_output_and_dequantize():
    t = Tiny(seed=7)
    x = t.rand_input((2, 5, 4, 4), 0.05)
    conv = weight_layer("conv2d", rand_w(t.gen, (3, 5, 3, 3)), rand_scales(t.gen, 3), torch.randn(3, generator=t.gen),
                        0.05, None, geometry=geometry(1, 1))
    hp = t.call(conv, x, name="hp_conv")
    deq = t.call(qnn.DeQuantize(), hp, name="deq")
    fc = weight_layer("linear", rand_w(t.gen, (6, 4)), rand_scales(t.gen, 6), None, 0.05, None)
    hp_fc = t.call(fc, t.rand_input((2, 4), 0.05), name="hp_fc")
    prog = check_all(t.build(hp, deq, hp_fc), t)
    out = {v.name: v for v in prog.outputs}
    assert out["hp_conv"].dtype == "qint32" and out["hp_conv"].axis == 1 and out["deq"].dtype == "f32"


# ---------------------------------------------------------------------------- element-wise

@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("sub", [False, True])
def test_add_sub(dtype, sub):
    t = Tiny(seed=8)
    a = t.rand_input((2, 3, 4, 4), 0.03, dtype)
    b = t.rand_input((2, 3, 4, 4), 0.05, dtype)
    check_all(t.build(t.call(qnn.QuantizedAdd(0.03, 0.05, 0.06, dtype, sub=sub), a, b)), t)


def test_add_exact_ties():
    t = Tiny(seed=9)
    a = t.rand_input((1, 2, 8, 8), 0.5)
    b = t.rand_input((1, 2, 8, 8), 0.25)
    check_all(t.build(t.call(qnn.QuantizedAdd(0.5, 0.25, 1.0, "qint8"), a, b)), t)


def test_mul_tensor_and_constant():
    t = Tiny(seed=10)
    a = t.rand_input((2, 3, 4), 0.03)
    b = t.rand_input((2, 3, 4), 0.02)
    m = t.call(qnn.QuantizedMul(0.03, 0.02, 0.01, "qint8"), a, b, name="mul")
    c = t.call(qnn.QuantizedMul(0.01, None, 0.004, "qint8", constant=-0.25), m, -0.25, name="mulc")
    check_all(t.build(c), t)


@pytest.mark.parametrize("op,index,alpha", [("add", 1, 1.0), ("add", 0, 1.0), ("sub", 1, 1.0), ("sub", 0, 1.0),
                                              ("add", 1, -2.0), ("sub", 0, 0.5), ("mul", 1, 1.0), ("mul", 0, 1.0)])
@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_constant_operand(op, index, alpha, dtype):
    """add / sub / mul with a constant tensor held by the module (broadcast NC11), at either position."""
    t = Tiny(seed=20)
    scale = 0.03 if dtype == "qint8" else 0.0003
    x = t.rand_input((2, 3, 4, 4), scale, dtype)
    const = rand_w(t.gen, (1, 3, 1, 1)).to(torch.int8)
    m = qnn.QuantizedConstantOperand(op, scale, const, 0.02, index, 0.05, "qint8", alpha=alpha)
    prog = check_all(t.build(t.call(m, x, name="cop")), t)
    (op_,) = [o for o in prog.ops if o.output == "cop"]
    assert op_.inputs == ["x0_q"] and torch.equal(op_.tensors["constant"], const)
    assert op_.kind == m.qc_op and op_.attrs["constant_index"] == index


@pytest.mark.parametrize("c", [1.0, -0.3, 0.0])
def test_constant_operand_number_is_exact(c):
    """A number c is the integer sign(c) at scale |c|: y = round((q*s_x + c) / s_out) with ties to even."""
    t = Tiny(seed=21)
    x = t.rand_input((1, 2, 5, 5), 0.25)
    q = torch.tensor((c > 0) - (c < 0), dtype=torch.int8)
    m = qnn.QuantizedConstantOperand("add", 0.25, q, abs(c) or 1.0, 1, 0.5, "qint8")
    gm = t.build(t.call(m, x, name="addc"))
    check_all(gm, t)
    xi = fp.quantize(t.inputs[0], 0.25)
    want = torch.clamp(torch.round((xi.double() * 0.25 + c) / 0.5), -128, 127)
    assert torch.equal(gm(*t.inputs).int_repr().double(), want)


@pytest.mark.parametrize("b_dtype", ["qint8", "qint16"])
def test_div_with_zero_divisors(b_dtype):
    """a / b by a reciprocal table; every divisor code appears, 0 included (saturates by a's sign)."""
    t = Tiny(seed=22)
    lo, hi = fp.qrange(b_dtype)
    codes = torch.arange(-128, 128) if b_dtype == "qint8" else torch.randint(lo, hi + 1, (256,), generator=t.gen)
    codes[:3] = 0
    a_ints = torch.randint(-128, 128, (2, 256), generator=t.gen)
    a_ints[:, 0], a_ints[:, 1], a_ints[:, 2] = 5, -7, 0  # x/0 -> qmax, -x/0 -> qmin, 0/0 -> 0
    a = t.input(a_ints, 0.04)
    b = t.input(codes.expand(2, 256).clone(), 0.01 if b_dtype == "qint8" else 0.0001, b_dtype)
    m = qnn.QuantizedDiv(0.04, 0.01 if b_dtype == "qint8" else 0.0001, b_dtype, 0.05, "qint8")
    gm = t.build(t.call(m, a, b, name="div"))
    prog = check_all(gm, t)
    assert prog.ops[-1].kind == "div" and prog.ops[-1].tensors["M"].numel() == hi - lo + 1
    y = gm(*t.inputs).int_repr()
    assert y[:, 0].tolist() == [127, 127] and y[:, 1].tolist() == [-128, -128] and y[:, 2].tolist() == [0, 0]
    # elsewhere: the quotient rounded once, half to even, as the fake-quant model rounds it
    nz = codes != 0
    sa, sb, so = (float(torch.tensor(v)) for v in (0.04, 0.01 if b_dtype == "qint8" else 0.0001, 0.05))  # float32
    real = (a_ints.double() * sa) / (codes.double() * sb) / so
    assert torch.equal(y[:, nz].double(), torch.round(real[:, nz]).clamp(-128, 127))


def test_cat_matmul_relu_relu6():
    t = Tiny(seed=11)
    a = t.rand_input((2, 2, 3, 4), 0.03)
    b = t.rand_input((2, 3, 3, 4), 0.05)
    c = t.call(qnn.QuantizedCat([0.03, 0.05], 0.04, "qint8"), [a, b], dim=1, name="cat")
    r = t.same_scale("relu", c, function=torch.relu, name="relu")
    r6 = t.same_scale("relu6", c, function=F.relu6, name="relu6")
    mm = t.call(qnn.QuantizedMatmul(0.04, 0.04, 0.3, "qint8"), r, t.same_scale("transpose", r6, -1, -2,
                                                                               method="transpose"), name="mm")
    check_all(t.build(mm), t)


@pytest.mark.parametrize("op,slope", [("prelu", torch.tensor([0.25, -0.1, 0.3])), ("leaky_relu", torch.tensor([0.1]))])
def test_prelu_leaky(op, slope):
    t = Tiny(seed=12)
    x = t.rand_input((2, 3, 4, 4), 0.05)
    check_all(t.build(t.call(qnn.QuantizedPReLU(op, slope, 0.05, 0.05, "qint8"), x)), t)


@pytest.mark.parametrize("in_scale, out_scale", [(0.05, 0.03), (0.02, 0.05), (0.05, 0.01)],
                         ids=["finer", "coarser", "top_above_qmax"])
def test_relu6_with_its_own_output_scale(in_scale, out_scale):
    """A relu6 whose output has its own observer (e.g. after an add) requantizes, then clamps."""
    t = Tiny(seed=14)
    x = t.rand_input((2, 3, 4, 4), in_scale)
    m = qnn.QuantizedPReLU("relu6", torch.zeros(1), in_scale, out_scale, "qint8", top=6.0)
    check_all(t.build(t.call(m, x, name="relu6")), t)


@pytest.mark.parametrize("in_scale, in_dtype, out_scale, out_dtype", [
    (0.05, "qint8", 0.03, "qint8"), (0.02, "qint8", 0.05, "qint8"), (0.05, "qint8", 0.1, "qint8"),
    (0.05, "qint8", 0.0005, "qint16"), (0.0005, "qint16", 0.01, "qint8")],
    ids=["finer", "coarser", "half_ties", "to_int16", "from_int16_saturating"])
def test_requantize(in_scale, in_dtype, out_scale, out_dtype):
    """A QuantStub on a quantized value: simulator == converted == the integer reference, exact ties
    (factor 1/2: every odd q) round half to even."""
    t = Tiny(seed=15)
    x = t.rand_input((2, 3, 4, 4), in_scale, in_dtype)
    gm = t.build(t.call(qnn.Requantize(in_scale, in_dtype, out_scale, out_dtype), x, name="requant", op="quant"))
    check_all(gm, t)
    if out_scale == 2 * in_scale:
        q = torch.arange(-5, 6, dtype=torch.int8)  # q / 2: -2.5 -2 -1.5 -1 -0.5 0 0.5 1 1.5 2 2.5
        y = qnn.Requantize(in_scale, in_dtype, out_scale, out_dtype)(QTensor(q, in_scale, 0)).int_repr()
        assert y.tolist() == [-2, -2, -2, -1, 0, 0, 0, 1, 2, 2, 2]


@pytest.mark.parametrize("in_dtype", ["qint8", "qint16"])
def test_lut(in_dtype):
    t = Tiny(seed=13)
    x = t.rand_input((2, 3, 5), 0.05 if in_dtype == "qint8" else 0.0005, in_dtype)
    scale = 0.05 if in_dtype == "qint8" else 0.0005
    check_all(t.build(t.call(qnn.QuantizedLookup("sigmoid", torch.sigmoid, scale, in_dtype, 1 / 127, "qint8"), x)), t)


# ---------------------------------------------------------------------------- pools, resize, layout

def test_pools():
    t = Tiny(seed=14)
    x = t.rand_input((2, 3, 7, 7), 0.05)
    mp_mod = t.same_scale("max_pool2d", x, module=nn.MaxPool2d(3, 2, 1), name="maxpool")
    mp_fn = t.same_scale("max_pool2d", x, 2, stride=1, padding=1, dilation=2, ceil_mode=True, function=F.max_pool2d,
                         name="maxpool_fn")
    ap = t.call(qnn.QuantizedAvgPool(0.05, 0.03, "qint8", kernel=(3, 2), stride=(2, 1), padding=(1, 0)), x, name="avg")
    gap = t.call(qnn.QuantizedAvgPool(0.05, 0.02, "qint8"), x, name="gap")
    mean = t.call(qnn.QuantizedAvgPool(0.05, 0.02, "qint16", keepdim=False), x, name="mean")
    check_all(t.build(mp_mod, mp_fn, ap, gap, mean), t)


@pytest.mark.parametrize("mode,size,align", [("nearest", (8, 10), None), ("nearest", (3, 7), None),
                                             ("bilinear", (8, 10), False), ("bilinear", (7, 5), True)])
def test_resize(mode, size, align):
    t = Tiny(seed=15)
    x = t.rand_input((2, 2, 4, 5), 0.05)
    check_all(t.build(t.call(qnn.QuantizedResize(mode, 0.05, 0.03, "qint8", size, align), x)), t)


def test_layout_ops():
    t = Tiny(seed=16)
    x = t.rand_input((2, 3, 4, 5), 0.05)
    a = t.same_scale("reshape", x, 2, -1, 5, method="view", name="view")
    b = t.same_scale("permute", a, 0, 2, 1, method="permute", name="permute")
    c = t.same_scale("transpose", b, function=torch.transpose, dim0=1, dim1=2, name="transpose")
    d = t.same_scale("flatten", c, 1, function=torch.flatten, name="flatten")
    e = t.same_scale("reshape", d, 1, method="unsqueeze", name="unsqueeze")
    f = t.same_scale("reshape", e, function=torch.squeeze, name="squeeze")
    g = t.same_scale("getitem", x, (slice(None), slice(1, 3), Ellipsis, None, slice(None, None, 2)),
                     function=operator.getitem, name="getitem")
    h = t.same_scale("flatten", x, module=nn.Flatten(2), name="flatten_mod")
    i = t.same_scale("identity", h, module=nn.Identity(), name="ident")
    j = t.same_scale("dropout", i, module=nn.Dropout(0.5).eval(), name="drop")
    k = t.same_scale("identity", j, method="contiguous", name="contig")
    prog = check_all(t.build(f, g, k), t)
    kinds = [op.kind for op in prog.ops]
    for kind in ("reshape", "permute", "transpose", "flatten", "unsqueeze", "squeeze", "getitem", "identity"):
        assert kind in kinds


# ---------------------------------------------------------------------------- adversarial values

def test_float32_accumulation_would_be_wrong_but_simulator_is_exact(monkeypatch):
    """int8 extremes with Cin*k*k = 2304: the sums pass 2**24, so float32 accumulation rounds. The float
    kernel splits the reduction into float32-exact chunks (allowed here however many it takes; by default
    more than two give way to one float64 GEMM), and equals the reference either way."""
    from qcompiler.backends.bpu.sim import gemm

    monkeypatch.setattr(gemm, "MAX_F32_CHUNKS", 64)
    t = Tiny(seed=17)
    Cin, Cout = 256, 4
    xi = torch.full((1, Cin, 3, 3), 127)
    xi[0, ::7, 1, :] = -128
    w = torch.full((Cout, Cin, 3, 3), 127)
    w[:, ::5, 0, 0] = -128
    w[1] = -128
    x = t.input(xi, 1.0)
    layer = weight_layer("conv2d", w, torch.full((Cout,), 0.01), None, 1.0, 3000.0, out_dtype="qint16",
                         geometry=geometry(1, 1), name="big")
    gm = t.build(t.call(layer, x, name="big"))
    exact = ref.ref_conv2d(xi.numpy(), w.numpy(), None, (1, 1), (1, 1))
    assert np.abs(exact).max() > 2 ** 24
    # float32 accumulation (sequential, and torch's own float32 conv) is wrong here ...
    seq = np.zeros(Cout, dtype=np.float32)
    patch = xi[0, :, :, :].numpy().astype(np.float32)
    for o in range(Cout):
        for v in (patch * w[o].numpy().astype(np.float32)).reshape(-1):
            seq[o] = np.float32(seq[o] + np.float32(v))
    assert not np.array_equal(seq.astype(np.int64), exact[0, :, 1, 1])
    torch_f32 = F.conv2d(xi.float(), w.float(), padding=1).to(torch.int64).numpy()
    assert not np.array_equal(torch_f32, exact)
    # ... the simulator (both kernel sets) equals the reference exactly
    prog = check_all(gm, t)
    fast = BpuSimulator(prog, int8_gemm=False, native=False)  # (the native GEMM would take it in int32)
    assert len(fast._steps[1][0].whole._plan(128)[1]) > 1  # the float kernel split the reduction into float32-exact chunks
    monkeypatch.undo()
    check_all(gm, t)
    fast = BpuSimulator(prog, int8_gemm=False, native=False)
    assert fast._steps[1][0].whole._plan(128) == (torch.float64, ((0, Cin),))  # chunks of input channels


def test_int32_accumulator_overflow_is_reported():
    """int16 activations with a 576-long reduction: |acc| reaches 32767*127*576 > 2**31."""
    t = Tiny(seed=18)
    x = t.input(torch.full((1, 64, 4, 4), 32767), 1.0, "qint16")
    layer = weight_layer("conv2d", torch.full((2, 64, 3, 3), 127), torch.full((2,), 0.01), None, 1.0, 1000.0,
                         out_dtype="qint16", geometry=geometry(1, 1), name="overflowing_conv")
    gm = t.build(t.call(layer, x, name="overflowing_conv"))
    prog = lower_partition(gm, "bpu0")
    with pytest.raises(fp.AccumulatorOverflow, match="overflowing_conv"):
        gm(*t.inputs)  # the converted model reports it too
    for cfg in CONFIGS:
        with pytest.raises(fp.AccumulatorOverflow, match="bpu0/overflowing_conv: int32 accumulator"):
            Runtime.simulated(gm, {"bpu0": prog}, **cfg)(*t.inputs)
    with pytest.raises(ref.ReferenceOverflow):
        ref.run_program(prog, {"x0": t.inputs[0].numpy()})


def test_global_pool_sum_overflow_is_reported():
    """int16 values summed over a 256x512 map leave int32: the simulator checks the sums."""
    t = Tiny(seed=19)
    x = t.input(torch.full((1, 1, 256, 512), 32767), 1.0, "qint16")
    gm = t.build(t.call(qnn.QuantizedAvgPool(1.0, 30000.0, "qint16"), x, name="gap"))
    prog = lower_partition(gm, "bpu0")
    for cfg in CONFIGS:
        with pytest.raises(fp.AccumulatorOverflow, match="bpu0/gap: int32 accumulator"):
            Runtime.simulated(gm, {"bpu0": prog}, **cfg)(*t.inputs)
