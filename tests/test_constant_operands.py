"""BPU ops that convert used to refuse: add/sub/mul with a constant operand, standalone BatchNorm2d,
div of two feature maps, functional prelu with a tensor slope.

Each runs end to end: the fake-quant model (validation state) vs convert_fx (>= 99.9 % identical,
the rest within 1 LSB), the BPU simulator (every kernel set) and compile() bit-exact with the
converted model, the ONNX export (converted and prepared) in onnxruntime against the model it came
from; ops that cannot be lowered stay on CPU at placement time with a reason.
"""

from __future__ import annotations

import io
import warnings

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from simulator_configs import CONFIGS
from test_export_onnx import end_to_end_check, teacher_forced_check

import qcompiler
from qcompiler.backends.bpu.lower import lower_bpu_partitions
from qcompiler.compiled import lower
from qcompiler.errors import QCompilerWarning
from qcompiler.ir.meta import META_PLACEMENT, META_REASON
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import export_to_onnx
from qcompiler.quantization import (
    CalibFakeQuantize,
    FakeQuantize,
    convert_fx,
    prepare_calibration_fx,
    prepare_qat_fx,
    set_state,
)
from qcompiler.runtime import Runtime


class Net(nn.Module):
    """conv -> the op under test (``kind``); constants as buffers / parameters of the model."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.d = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("b", torch.randn(1, 4, 8, 8))
        self.register_buffer("b1", torch.randn(1, 4, 1, 1))
        self.w = nn.Parameter(torch.tensor([0.25, 0.1, -0.2, 0.3]))
        self.s = nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5)
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(-2, 2)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        y, k = self.c(x), self.kind
        return {
            "add_number": lambda: y + 1.0,
            "number_sub": lambda: 2.0 - y,
            "add_alpha": lambda: torch.add(y, 0.3, alpha=-2),
            "sub_buffer": lambda: y - self.b1,
            "add_buffer": lambda: y + self.b1,
            "buffer_add_fused": lambda: self.b + y,  # same shape: the fuse pass makes it conv + add
            "mul_buffer": lambda: y * self.b,
            "parameter_mul": lambda: self.s * y,
            "batch_norm": lambda: self.bn(F.relu(y)),
            "div": lambda: y / torch.sigmoid(self.d(x)),
            "prelu": lambda: F.prelu(y, self.w),
            "cat_buffer": lambda: torch.cat([y, self.b[:, :2]], 1),
            # negative cases
            # (ops on buffers alone are folded by tracing; on parameters they are graph nodes)
            "two_constants": lambda: y + (self.s + 1.0),
            "constants_only_mul": lambda: y + self.s * 2.0,
            "div_by_buffer": lambda: y / self.b1,
            "floor_div": lambda: torch.div(y, torch.sigmoid(self.d(x)), rounding_mode="floor"),
            "functional_batch_norm": lambda: F.batch_norm(y, self.bn.running_mean, self.bn.running_var),
            "computed_slope": lambda: F.prelu(y, self.w.abs()),
            "matmul_constant": lambda: torch.matmul(y, self.b[0, 0]),
            "functional_conv": lambda: F.conv2d(y, self.s.reshape(4, 1, 1, 1), groups=4),
        }[k]()


# kind -> (node name of the op, the marches whose table puts it on the BPU, converted module class name)
CASES = {
    "add_number": ("add", ("bayes", "bernoulli2"), "QuantizedConstantOperand"),
    "number_sub": ("sub", ("bayes",), "QuantizedConstantOperand"),  # sub is CPU on bernoulli2
    "add_alpha": ("add", ("bayes", "bernoulli2"), "QuantizedConstantOperand"),
    "sub_buffer": ("sub", ("bayes",), "QuantizedConstantOperand"),
    "add_buffer": ("add", ("bayes", "bernoulli2"), "QuantizedConstantOperand"),
    "buffer_add_fused": ("c", ("bayes", "bernoulli2"), "QuantizedWeightLayer"),  # + a QuantizedConstant
    "mul_buffer": ("mul", ("bayes", "bernoulli2"), "QuantizedConstantOperand"),
    "parameter_mul": ("mul", ("bayes", "bernoulli2"), "QuantizedConstantOperand"),
    "batch_norm": ("bn", ("bayes", "bernoulli2"), "QuantizedWeightLayer"),
    "div": ("truediv", ("bayes", "bernoulli2"), "QuantizedDiv"),
    "prelu": ("prelu", ("bernoulli2",), "QuantizedPReLU"),  # prelu is CPU on bayes
    "cat_buffer": ("cat", ("bayes", "bernoulli2"), "QuantizedCat"),  # + a QuantizedConstant input
}
PARAMS = [pytest.param(k, m, id=f"{k}-{m}") for k, (_, marches, _) in CASES.items() for m in marches]


def inputs(seed: int = 0, batch: int = 1):
    """Batch 1: bernoulli2 broadcasts a constant only as NCHW with NCHW or NC11 (same N)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 8, 8, generator=g)


def placements(gm) -> dict:
    return {n.name: (n.meta[META_PLACEMENT], n.meta[META_REASON]) for n in gm.graph.nodes if META_PLACEMENT in n.meta}


def calibrated(kind: str, march: str):
    torch.manual_seed(0)
    x = inputs()
    with warnings.catch_warnings():  # model check: a conv + constant add is not a fusable residual add
        warnings.simplefilter("ignore", QCompilerWarning)
        cal = prepare_calibration_fx(Net(kind).eval(), example_inputs=(x,), march=march, hybrid=True)
    cal.eval()
    with torch.no_grad():
        for seed in range(3):  # x (seed 0) too: no clipping on the checked input
            cal(inputs(seed))
    return cal, x


def validated(cal):
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return qat


def assert_within_one_lsb(ref: torch.Tensor, out: torch.Tensor, lsb: float) -> None:
    same = (ref == out).double().mean().item()
    assert same >= 0.999, f"only {same:.4%} of output elements identical"
    assert float((ref.double() - out.double()).abs().max()) <= lsb * (1 + 1e-6)


@pytest.mark.parametrize("kind,march", PARAMS)
def test_lowered_end_to_end(kind, march):
    name, _, cls = CASES[kind]
    cal, x = calibrated(kind, march)
    assert placements(cal)[name][0] == "bpu", placements(cal)[name]
    qat = validated(cal)
    q = convert_fx(qat)
    module = q.get_submodule(next(n.target for n in q.graph.nodes if n.name == name))
    assert type(module).__name__ == cls
    # no float constant (get_attr) is left in a BPU partition: the modules hold the integers
    assert not [n.name for n in q.graph.nodes if n.op == "get_attr" and n.meta.get(META_PLACEMENT) == "bpu"]
    constants = [type(q.get_submodule(n.target)).__name__ for n in q.graph.nodes if "constant_fake_quant" in n.name]
    assert constants == (["QuantizedConstant"] if kind in ("buffer_add_fused", "cat_buffer") else [])
    with torch.no_grad():
        ref, out = qat(x), q(x)
        # the BPU programs in the integer simulator, every kernel set, and the runtime compile() builds
        programs = lower_bpu_partitions(q)
        for cfg in CONFIGS:
            assert torch.equal(Runtime.simulated(q, programs, **cfg)(x), out), cfg
        assert torch.equal(lower(q)(x), out)
    assert_within_one_lsb(ref, out, module.out_scale)
    # ONNX: the converted model and the prepared (fake-quant) model, each against its source
    for model in (q, qat):
        buf = io.BytesIO()
        sidecar = export_to_onnx(model, (x,), buf)
        proto = onnx.load_from_string(buf.getvalue())
        teacher_forced_check(model, proto, sidecar, (x,))
        end_to_end_check(model, proto, sidecar, (x,))


def test_constant_integers_and_scales():
    """A buffer is quantized per tensor like a weight (scale max|b|/127) and the fake-quant model
    computes with exactly those integers; a number c is sign(c) at scale |c|."""
    cal, x = calibrated("sub_buffer", "bayes")
    assert isinstance(cal.get_submodule("b1_constant_fake_quant"), CalibFakeQuantize)
    qat = validated(cal)
    fq = qat.get_submodule("b1_constant_fake_quant")  # same path: the calibrated scale is handed over
    assert isinstance(fq, FakeQuantize) and fq.ch_axis == -1
    b1 = qat.b1
    assert torch.equal(fq.scale, (b1.abs().max() / 127).reshape(1))
    q = convert_fx(qat)
    m = q.get_submodule(next(n.target for n in q.graph.nodes if n.name == "sub"))
    assert m.constant.dtype == torch.int8 and m.const_scale == float(fq.scale)
    assert torch.equal(m.constant.double() * m.const_scale, fq(b1).double())
    assert int(m.constant.abs().max()) == 127
    number = convert_fx(validated(calibrated("add_number", "bayes")[0]))
    m = next(mod for mod in number.modules() if isinstance(mod, qnn.QuantizedConstantOperand))
    assert int(m.constant) == 1 and m.const_scale == 1.0 and m.constant.dim() == 0


def test_batch_norm_is_a_depthwise_layer_with_exact_factors():
    cal, x = calibrated("batch_norm", "bayes")
    q = convert_fx(validated(cal))
    bn = q.get_submodule("bn")  # keeps its module path, like the weight layers
    assert isinstance(bn, qnn.QuantizedWeightLayer) and bn.geometry["groups"] == 4
    assert bn.q_weight.shape == (4, 1, 1, 1) and bn.q_weight.abs().flatten().tolist() == [127] * 4
    a = cal.bn.weight.double() / torch.sqrt(cal.bn.running_var.double() + cal.bn.eps)
    torch.testing.assert_close(bn.q_weight.flatten().double() * bn.w_scale.double(), a, rtol=1e-7, atol=0)
    assert bn.bias.dtype == torch.int32


@pytest.mark.parametrize("kind", ["sub_buffer", "div", "batch_norm", "parameter_mul"])
def test_compile_runs_on_the_simulator_and_saves(kind, tmp_path):
    """compile() (PTQ from the calibration observers): simulator == converted model, also after save/load."""
    torch.manual_seed(0)
    x = inputs(batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cm = qcompiler.compile(Net(kind).eval(), (x,), march="bayes", calib_data=[inputs(s, 2) for s in range(3)],
                               progress=False)
    assert [p["placement"] for p in cm.partitions] == ["bpu"]
    with torch.no_grad():
        out = cm.converted(x)
        assert torch.equal(cm(x), out)
        assert torch.equal(qcompiler.load(cm.save(tmp_path / "m.qc"))(x), out)


def test_qat_trains_through_constants_and_batch_norm():
    """QAT: the constant's fake quant passes gradients (straight through) to a parameter constant;
    a BPU BN trains as a BN."""
    for kind in ("parameter_mul", "batch_norm"):
        cal, x = calibrated(kind, "bayes")
        qat = prepare_qat_fx(cal, hybrid=True)
        qat.train()
        qat(inputs(1)).pow(2).mean().backward()
        p = qat.s if kind == "parameter_mul" else qat.bn.weight
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)


class _ZeroInitOffset(nn.Module):
    """A learnable offset that starts at zero (a bias / layer-scale / position-embedding style)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.p = nn.Parameter(torch.zeros(1, 4, 1, 1))

    def forward(self, x):
        return self.c(x) + self.p


def test_qat_learns_a_constant_that_starts_at_zero():
    """The constant's QAT range follows its current value: a lagging average clipped the
    parameter at ~0, where the straight-through gradient is zero, so it never learned."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = _ZeroInitOffset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        qat = prepare_qat_fx(model, example_inputs=(x,), march="bayes")
    qat.train()
    opt = torch.optim.SGD([qat.p], lr=0.05)
    torch.manual_seed(1)
    for _ in range(200):  # the target wants p = 1 everywhere
        xb = torch.randn(4, 3, 8, 8)
        with torch.no_grad():
            target = model.c(xb) + 1.0
        loss = (qat(xb) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.allclose(qat.p.detach(), torch.ones(1, 4, 1, 1), atol=0.05), qat.p.flatten().tolist()


def test_div_by_a_zero_code_saturates_like_the_fake_quant_model():
    """A divisor quantized to 0: the fake-quant model gets +-inf, clamped by its output fake quant;
    the BPU saturates to the same qmax / qmin. 0 / 0 is 0 on the BPU (NaN in the float model)."""
    class Div(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.d = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
            with torch.no_grad():
                self.d.weight.zero_()
                self.d.weight[:, 0] = 10.0  # sigmoid(10 x) < 0.5 / 127 (code 0) where x < -0.55

        def forward(self, x):
            return self.c(x) / torch.sigmoid(self.d(x))

    x = inputs(batch=2)
    cal = prepare_calibration_fx(Div().eval(), example_inputs=(x,), march="bayes")
    with torch.no_grad():
        cal.eval()(x)
        qat = validated(cal)
        q = convert_fx(qat)
        seen = {}
        q.get_submodule("c").register_forward_hook(lambda m, i, o: seen.update(num=o.int_repr()))
        sigmoid = next(n.target for n in q.graph.nodes if n.name == "sigmoid")
        q.get_submodule(sigmoid).register_forward_hook(lambda m, i, o: seen.update(den=o.int_repr()))
        ref, out = qat(x), q(x)
    div = q.get_submodule(next(n.target for n in q.graph.nodes if n.name == "truediv"))
    num, zero = seen["num"], seen["den"] == 0
    for sign in (num > 0, num < 0, num == 0):
        assert bool((zero & sign).any())  # every case occurs
    top, bottom = 127 * div.out_scale, -128 * div.out_scale
    want = torch.where(num > 0, top, torch.where(num < 0, bottom, 0.0)).float()
    assert torch.equal(out[zero], want[zero])
    nan = zero & (num == 0)
    assert bool(ref[nan].isnan().all()) and torch.equal(ref[~nan], out[~nan])


@pytest.mark.parametrize("kind,march,name,reason", [
    ("div_by_buffer", "bayes", "truediv", "div: 1 feature-map operand(s); needs 2 on bayes"),
    ("floor_div", "bernoulli2", "div",
     "div: div with rounding_mode='floor' (the BPU divides exactly, then requantizes) on bernoulli2"),
    ("functional_batch_norm", "bayes", "batch_norm",
     "batch_norm: functional batch_norm (the BPU lowers an nn.BatchNorm2d module with running statistics) on bayes"),
    ("matmul_constant", "bayes", "matmul", "matmul: 1 feature-map operand(s); needs 2 on bayes"),
    ("functional_conv", "bayes", "conv2d", "conv2d: functional conv2d (the BPU lowers nn.Conv2d / "
     "nn.ConvTranspose2d / nn.Linear modules, whose weights prepare quantizes) on bayes"),
])
def test_ops_without_a_lowering_stay_on_cpu_with_a_reason(kind, march, name, reason):
    """Placement keeps them off the BPU (before: BPU, then a failure in convert); the model converts
    and the converted model matches the fake-quant model."""
    cal, x = calibrated(kind, march)
    assert placements(cal)[name] == ("cpu", reason)
    qat = validated(cal)
    q = convert_fx(qat)
    with torch.no_grad():
        ref, out = qat(x), q(x)
        torch.testing.assert_close(lower(q)(x), out, rtol=1e-5, atol=1e-5)  # CPU ops in onnxruntime: float32
    same = (ref == out).double().mean().item()
    assert same >= 0.999 and torch.allclose(ref, out, rtol=0, atol=1e-2)


@pytest.mark.parametrize("kind,march,name", [
    ("two_constants", "bayes", "add"), ("constants_only_mul", "bernoulli2", "mul"),
    ("constants_only_mul", "bayes", "mul"), ("computed_slope", "bernoulli2", "abs"),
    ("functional_conv", "bayes", "reshape"),
])
def test_operands_computed_from_constants_only_are_folded_before_placement(kind, march, name):
    """``self.s + 1.0``, ``self.s * 2.0``, ``self.w.abs()``, ``self.s.reshape(...)``: parameters and
    numbers only, so passes/fold_constants.py makes each one buffer (they stayed on the CPU with a
    reason before); the model converts and matches the fake-quant model."""
    cal, x = calibrated(kind, march)
    assert name not in placements(cal)
    assert any(n.op == "get_attr" and n.target.startswith("qc_folded_") for n in cal.graph.nodes)
    if kind == "computed_slope":  # its slope is now a constant: the BPU's prelu
        assert placements(cal)["prelu"][0] == "bpu"
    qat = validated(cal)
    q = convert_fx(qat)
    with torch.no_grad():
        ref, out = qat(x), q(x)
        torch.testing.assert_close(lower(q)(x), out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ref, out, rtol=0, atol=1e-2)


def test_batch_norm_without_running_statistics_stays_on_cpu():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(4, track_running_stats=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cal = prepare_calibration_fx(model.eval(), example_inputs=(inputs(),), march="bernoulli2", hybrid=True)
    assert placements(cal)["_2"] == ("cpu", "batch_norm: BatchNorm2d without running statistics "
                                            "(track_running_stats=False) is not a fixed affine on bernoulli2")
