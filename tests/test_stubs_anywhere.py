"""Stubs anywhere, and models that do not trace: they prepare, calibrate, convert, compile, run,
export and save, through ``compile`` and through the staged API.

The four stub cases (docs/stubs_and_tracing.md):

* a DeQuantStub ... QuantStub pair in the middle of a model brackets a float CPU region;
* nested stubbed submodules (a QuantStub on a QuantStub, a DeQuantStub on a DeQuantStub);
* a QuantStub on a value that is already quantized: a requantize, or nothing at equal scale;
* a dequantized value that feeds a BPU op, or a BPU cat: it gets a quantizer.

Every case checks: the compiled model (simulator + islands) equals the converted model bit for bit,
the staged API's converted model equals the compiled model bit for bit (same calibration), the
exported ONNX run by onnxruntime equals the compiled model (float tolerance), and save / load gives
identical outputs. Then untraceable code: a leaf with data-dependent Python, and a top-level forward
torch.fx cannot trace (as torch's ``TestHelperModules.ControlFlow``).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.ao.quantization as taq
import torch.nn as nn
from graph_match import assert_same_graph, in_partitions
from test_eager_islands import Gate  # data-dependent Python: torch.fx cannot trace it
from test_prepare import calibration_observer, fused_conv
from test_tracer import TypoInside

import qcompiler
from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec
from qcompiler.backends.bpu.program_check import check_program
from qcompiler.backends.eager import TORCH
from qcompiler.errors import ArtifactError, ConfigError, QCompilerWarning, TraceError, UnsupportedOpError
from qcompiler.ir.meta import BPU, CPU, META_PARTITION, META_REASON, placement
from qcompiler.ir.partitions import partitions
from qcompiler.nn import fused, qat
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import export_to_onnx, inference_session
from qcompiler.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_out_qconfig,
    get_default_calib_qconfig,
    prepare_calibration_fx,
    prepare_qat_fx,
)
from qcompiler.quantization.fake_quantize import set_state

MARCHES = ("bayes", "bernoulli2")
X = torch.rand(2, 3, 8, 8) * 2 - 1
CALIB = [torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)) * 2 - 1 for i in range(3)]


# ----------------------------------------------------------------------------------------- models


class FloatRegion(nn.Module):
    """quant -> conv -> dequant -> [conv, add: float, on the CPU] -> quant -> conv -> dequant."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = taq.QuantStub(), taq.DeQuantStub()
        self.quant2, self.dequant2 = taq.QuantStub(), taq.DeQuantStub()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.mid = nn.Conv2d(4, 4, 1)  # BPU-supported, but inside the float region
        self.conv2 = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        y = self.dequant(torch.relu(self.conv1(self.quant(x))))
        y = self.mid(y) + y
        return self.dequant2(self.conv2(self.quant2(y)))


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), taq.DeQuantStub()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.dequant(torch.relu(self.conv(self.quant(x))))


class Nested(nn.Module):
    """Stubbed submodules inside a stubbed model, two levels deep."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = taq.QuantStub(), taq.DeQuantStub()
        self.conv0 = nn.Conv2d(3, 4, 1)
        self.inner = Inner()
        self.wrapped = taq.QuantWrapper(Inner())  # quant -> (quant -> conv -> dequant) -> dequant
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = self.inner(self.conv0(self.quant(x)))
        return self.dequant(self.conv2(self.wrapped(y)))


class ConvSandwich(nn.Module):
    """conv1 (3 -> 4, 3x3), then the module ``make()`` builds, as the submodule ``name``, then conv2
    (4 -> 2, 1x1); built in that order (the same weights for one seed)."""

    def __init__(self, name: str, make):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.middle = name
        setattr(self, name, make())
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.conv2(getattr(self, self.middle)(self.conv1(x)))


class StubOnQuantized(ConvSandwich):
    """A QuantStub applied to the output of a BPU conv (as torch's QuantWrapper after a layer)."""

    def __init__(self):
        super().__init__("requant", taq.QuantStub)


class DequantIntoBpu(nn.Module):
    """A DeQuantStub's value read by a BPU conv and by a BPU cat (with a CPU value beside it)."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = taq.QuantStub(), taq.DeQuantStub()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.selu = nn.SELU()  # CPU on both marches

    def forward(self, x):
        y = self.dequant(self.conv1(self.quant(x)))
        return torch.cat([self.conv2(y), y, self.selu(y)], 1)


# ------------------------------------------------------- the prepared graphs, stated as modules


class FloatRegionPrepared(nn.Module):
    """FloatRegion calibrated: the float region's conv and add fuse into one float conv, on the CPU."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant, self.quant2, self.dequant2 = QuantStub(), DeQuantStub(), QuantStub(), DeQuantStub()
        self.conv1 = fused_conv(nn.Conv2d(3, 4, 3, padding=1), ("conv2d", "relu"))
        self.mid = fused.FusedConv2d(nn.Conv2d(4, 4, 1), with_add=True, fused_from=("conv2d", "add"))
        self.conv2 = qat.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        bpu0, cpu0, bpu1 = in_partitions("bpu0", "cpu0", "bpu1")
        y = bpu0(self.dequant(bpu0(self.conv1(bpu0(self.quant(x))))))
        y = cpu0(self.mid(y, y))
        return bpu1(self.dequant2(bpu1(self.conv2(bpu1(self.quant2(y))))))


def _stubbed(conv: nn.Module) -> nn.Module:
    """An Inner calibrated: its stubs around its conv."""
    inner = nn.Module()
    inner.quant, inner.conv, inner.dequant = QuantStub(), conv, DeQuantStub()
    return inner


class NestedPrepared(nn.Module):
    """Nested calibrated: every stub stays a node; one observer after the wrapper's DeQuantStub."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv0, self.conv2 = qat.Conv2d(3, 4, 1), qat.Conv2d(4, 2, 1)
        self.inner = _stubbed(fused_conv(nn.Conv2d(4, 4, 3, padding=1), ("conv2d", "relu")))
        self.wrapped = nn.Module()
        self.wrapped.quant, self.wrapped.dequant = QuantStub(), DeQuantStub()
        self.wrapped.module = _stubbed(fused_conv(nn.Conv2d(4, 4, 3, padding=1), ("conv2d", "relu")))
        self.wrapped_dequant_activation_post_process = calibration_observer()

    def forward(self, x):
        y = self.conv0(self.quant(x))
        y = self.inner.dequant(self.inner.conv(self.inner.quant(y)))
        y = self.wrapped.module.quant(self.wrapped.quant(y))
        y = self.wrapped.dequant(self.wrapped.module.dequant(self.wrapped.module.conv(y)))
        return self.dequant(self.conv2(self.wrapped_dequant_activation_post_process(y)))


class StubOnQuantizedPrepared(nn.Module):
    """StubOnQuantized calibrated: the input observed, the QuantStub between the convs kept."""

    def __init__(self):
        super().__init__()
        self.x_activation_post_process = calibration_observer()
        self.conv1, self.conv2 = qat.Conv2d(3, 4, 3, padding=1), qat.Conv2d(4, 2, 1)
        self.requant, self.output_input_dequant = QuantStub(), DeQuantStub()

    def forward(self, x):
        y = self.requant(self.conv1(self.x_activation_post_process(x)))
        return self.output_input_dequant(self.conv2(y))


class DequantIntoBpuPrepared(nn.Module):
    """DequantIntoBpu calibrated: the dequantized value quantized again for the BPU conv and cat."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant, self.output_input_dequant = QuantStub(), DeQuantStub(), DeQuantStub()
        self.conv1, self.conv2 = qat.Conv2d(3, 4, 3, padding=1), qat.Conv2d(4, 4, 1)
        self.selu = nn.SELU()
        self.dequant_activation_post_process = calibration_observer()
        self.selu_activation_post_process = calibration_observer()
        self.cat_activation_post_process = calibration_observer()

    def forward(self, x):
        bpu0, cpu0, bpu1 = in_partitions("bpu0", "cpu0", "bpu1")
        y = bpu0(self.dequant(bpu0(self.conv1(bpu0(self.quant(x))))))
        q = bpu0(self.dequant_activation_post_process(y))
        a, b = bpu0(self.conv2(q)), bpu1(self.selu_activation_post_process(cpu0(self.selu(y))))
        out = bpu1(self.cat_activation_post_process(bpu1(torch.cat([a, q, b], 1))))
        return bpu1(self.output_input_dequant(out))


# qconfig_dict per case: the requantize case gives the stub a minmax observer (the convs keep the
# default histogram-mse), so its scale differs; the no-op case keeps one config (same scale)
INT16_STUB = {"": get_default_calib_qconfig(), "module_name": [("requant", get_default_calib_qconfig("qint16"))]}
MINMAX_STUB = {"": get_default_calib_qconfig(), "module_name": [("requant", get_default_calib_qconfig(
    observer="minmax"))]}
CASES = {
    "float_region": (FloatRegion, None),
    "nested": (Nested, None),
    "requantize": (StubOnQuantized, MINMAX_STUB),
    "requantize_int16": (StubOnQuantized, INT16_STUB),
    "same_scale": (StubOnQuantized, None),
    "dequant_into_bpu": (DequantIntoBpu, None),
}


# ---------------------------------------------------------------------------------------- helpers


def _build(case):
    cls, qconfig = CASES[case]
    torch.manual_seed(0)
    return cls().eval(), qconfig


@contextlib.contextmanager
def _quiet_torch_ao_notes():
    """Ignore the note listing torch.ao configs translated (the stubs are torch.ao's); keep the rest."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.ao QConfigs translated",
                                category=QCompilerWarning)
        yield


def _compile(model, march, qconfig=None, **kw):
    with _quiet_torch_ao_notes():
        return qcompiler.compile(model, (X,), march=march, qconfig_dict=qconfig, calib_data=CALIB,
                                 progress=False, **kw)


def _staged(model, march, qconfig=None):
    """prepare_calibration_fx -> calibrate on CALIB -> convert_fx."""
    with _quiet_torch_ao_notes():
        prepared = prepare_calibration_fx(model, qconfig, hybrid=True, example_inputs=(X,), march=march)
    prepared.eval()
    with torch.no_grad():
        for b in CALIB:
            prepared(b)
    return prepared, convert_fx(prepared)


def _onnx_run(path, x):
    return inference_session(str(path)).run(None, {"x": x.numpy()})[0]


def _output_lsb(converted):
    """The scale of the quantized value the model's output dequantizes (every model here ends on the BPU)."""
    out = next(n for n in converted.graph.nodes if n.op == "output").args[0]
    return converted.get_submodule(out.args[0].target).out_scale


def _check_onnx(path, y, lsb):
    """The exported graph computes in float32 where the BPU computes integers: a value within float error
    of a rounding tie may round the other way (one LSB; tests/test_export_onnx.py). All elements within
    one LSB of the output's scale, 99% of them within float32 tolerance."""
    d = np.abs(_onnx_run(path, X) - y.numpy())
    assert float(d.max()) <= lsb * (1 + 1e-4)
    assert float(np.mean(d <= 1e-5 + 1e-5 * np.abs(y.numpy()))) >= 0.99


def _check_compiled(cm, tmp_path):
    """Simulator == converted model bit for bit; ONNX == compiled; save/load bit-identical."""
    y = cm(X)
    assert torch.equal(y, cm.converted(X))
    cm.export_onnx(tmp_path / "m.onnx")
    _check_onnx(tmp_path / "m.onnx", y, _output_lsb(cm.converted))
    cm.save(tmp_path / "m.qc")
    assert torch.equal(qcompiler.load(tmp_path / "m.qc")(X), y)
    return y


def _converted_modules(gm):
    return [type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"]


# ------------------------------------------------------------------------ every case, both routes


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_compile_and_staged_api_agree_and_export_and_save(case, march, tmp_path):
    model, qconfig = _build(case)
    if qconfig is INT16_STUB and march == "bernoulli2":  # no int16 on that march: refused, naming it
        with pytest.raises(ConfigError, match="march 'bernoulli2' has no int16"):
            _compile(model, march, qconfig)
        return
    cm = _compile(model, march, qconfig)
    y = _check_compiled(cm, tmp_path)
    # staged API, same calibration: the same integers (the converted model used to raise a raw
    # TypeError, a QTensor given to Quantize)
    _, converted = _staged(model, march, qconfig)
    assert torch.equal(converted(X), y)
    export_to_onnx(converted, (X,), str(tmp_path / "staged.onnx"), input_names=["x"])
    _check_onnx(tmp_path / "staged.onnx", y, _output_lsb(converted))
    # and close to the float model
    with torch.no_grad():
        ref = model(X)
    assert float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum())) > 20


@pytest.mark.parametrize("case", sorted(CASES))
def test_qat_route(case, tmp_path):
    """prepare_calibration_fx -> prepare_qat_fx -> a training step -> compile(mode='qat')."""
    model, qconfig = _build(case)
    calib, _ = _staged(model, "bayes", qconfig)
    qat = prepare_qat_fx(calib)
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for b in CALIB:
        opt.zero_grad()
        qat(b).pow(2).mean().backward()
        opt.step()
    set_state(qat, "validation")
    qat.eval()
    cm = qcompiler.compile(qat, (X,), mode="qat", progress=False)
    y = _check_compiled(cm, tmp_path)
    assert torch.equal(convert_fx(qat)(X), y)


# ------------------------------------------------------------------------------ goldens per case


def test_float_region_golden():
    """The ops between the DeQuantStub and the QuantStub run on the CPU although the BPU has them
    (the conv and the add fuse there into one CPU conv)."""
    model, _ = _build("float_region")
    prepared, converted = _staged(model, "bayes")
    assert_same_graph(prepared, FloatRegionPrepared())
    assert [p.name for p in partitions(prepared)] == ["bpu0", "cpu0", "bpu1"]
    mid = next(n for n in prepared.graph.nodes if n.target == "mid")
    assert mid.meta[META_REASON] == "between DeQuantStub 'dequant' and QuantStub 'quant2': a float region, on the CPU"
    assert _converted_modules(converted) == ["Quantize", "QuantizedWeightLayer", "DeQuantize", "FusedConv2d",
                                             "Quantize", "QuantizedWeightLayer", "DeQuantize"]


def test_nested_golden():
    """A QuantStub on a QuantStub, a DeQuantStub on a DeQuantStub, a BPU conv after a DeQuantStub: with
    one qconfig every quantizer sees the same values, so all of them are nothing once converted."""
    model, _ = _build("nested")
    prepared, converted = _staged(model, "bayes")
    assert_same_graph(prepared, NestedPrepared())
    assert [p.name for p in partitions(prepared)] == ["bpu0"]
    assert [(n.target, type(converted.get_submodule(n.target)).__name__) for n in converted.graph.nodes
            if n.op == "call_module"] == [
        ("quant_q1", "Quantize"), ("conv0", "QuantizedWeightLayer"), ("inner.conv", "QuantizedWeightLayer"),
        ("wrapped.module.conv", "QuantizedWeightLayer"), ("conv2", "QuantizedWeightLayer"),
        ("dequant_q1", "DeQuantize"),
    ]


def test_nested_with_other_scales_requantizes():
    """Give the inner stubs their own observer: each becomes a Requantize, on the BPU."""
    model, _ = _build("nested")
    minmax = get_default_calib_qconfig(observer="minmax")
    qconfig = {"": get_default_calib_qconfig(), "module_name": [("inner.quant", minmax), ("wrapped.quant", minmax)]}
    _, converted = _staged(model, "bayes", qconfig)
    kinds = {n.name: type(converted.get_submodule(n.target)).__name__ for n in converted.graph.nodes
             if n.op == "call_module"}
    assert kinds["inner_quant"] == kinds["wrapped_quant"] == "Requantize"
    cm = _compile(model, "bayes", qconfig)
    assert torch.equal(cm(X), converted(X))
    (program,) = cm.runtime.programs.values()
    assert [(op.kind, op.output) for op in program.ops] == [
        ("quantize", "quant"), ("conv2d", "conv0"), ("requantize", "inner_quant"), ("conv2d", "inner_conv"),
        ("requantize", "wrapped_quant"),  # to the minmax scale, then back to the default config's
        ("requantize", "wrapped_module_quant"), ("conv2d", "wrapped_module_conv"), ("conv2d", "conv2"),
        ("dequantize", "dequant")]


def test_requantize_golden():
    model, qconfig = _build("requantize")
    prepared, converted = _staged(model, "bayes", qconfig)
    assert_same_graph(prepared, StubOnQuantizedPrepared())
    (req,) = [m for m in converted.modules() if isinstance(m, qnn.Requantize)]
    assert (req.in_scale, req.out_scale) == (converted.conv1.out_scale, converted.conv2.in_scale)
    assert req.in_scale != req.out_scale
    cm = _compile(model, "bayes", qconfig)
    (program,) = cm.runtime.programs.values()
    assert [op.kind for op in program.ops] == ["quantize", "conv2d", "requantize", "conv2d", "dequantize"]


def test_requantize_to_int16():
    model, qconfig = _build("requantize_int16")
    _, converted = _staged(model, "bayes", qconfig)
    (req,) = [m for m in converted.modules() if isinstance(m, qnn.Requantize)]
    assert (req.in_dtype, req.out_dtype) == ("qint8", "qint16")


def test_same_scale_stub_is_nothing():
    model, _ = _build("same_scale")
    prepared, converted = _staged(model, "bayes")
    assert_same_graph(prepared, StubOnQuantizedPrepared())
    assert _converted_modules(converted) == ["Quantize", "QuantizedWeightLayer", "QuantizedWeightLayer",
                                             "DeQuantize"]
    assert converted.conv2.in_scale == converted.conv1.out_scale


def test_dequant_into_bpu_golden():
    """The dequantized value reaches the BPU conv and the BPU cat through a quantizer, which is nothing
    at the same scale: both read conv1's integers; only the CPU selu reads the float."""
    model, _ = _build("dequant_into_bpu")
    prepared, converted = _staged(model, "bayes")
    assert_same_graph(prepared, DequantIntoBpuPrepared())
    assert placement(next(n for n in prepared.graph.nodes if n.target == "selu")) == CPU
    cat = next(n for n in converted.graph.nodes if n.target == "cat")
    assert [a.target for a in cat.args[0]] == ["conv2", "conv1", "selu_activation_post_process_q1"]
    cm = _compile(model, "bayes")
    assert [[(op.kind, op.output) for op in p.ops] for p in cm.runtime.programs.values()] == [
        [("quantize", "quant"), ("conv2d", "conv1"), ("dequantize", "dequant"), ("conv2d", "conv2")],
        [("quantize", "selu_activation_post_process"), ("cat", "cat"), ("dequantize", "output_input_dequant_0")],
    ]


def test_a_high_precision_output_through_a_dequant_stub_into_a_bpu_conv(tmp_path):
    """An int32 (high-precision) output has no grid to requantize from: the quantizer after the
    DeQuantStub quantizes its float value again, inside the BPU program."""

    class HighPrecision(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = taq.QuantStub(), taq.DeQuantStub()
            self.conv1, self.conv2 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return self.conv2(self.dequant(self.conv1(self.quant(x))))

    torch.manual_seed(0)
    qconfig = {"": get_default_calib_qconfig(), "module_name": [("conv1", get_default_calib_out_qconfig())]}
    cm = _compile(HighPrecision().eval(), "bayes", qconfig)
    (program,) = cm.runtime.programs.values()
    assert [(op.kind, op.output) for op in program.ops] == [
        ("quantize", "quant"), ("conv2d", "conv1"), ("dequantize", "dequant"),
        ("quantize", "dequant_activation_post_process"), ("conv2d", "conv2"), ("dequantize", "output_input_dequant_0")]
    assert program.ops[1].attrs["high_precision"] is True
    _check_compiled(cm, tmp_path)


def test_region_with_a_stub_pair_but_no_op_between_is_a_requantize_or_nothing():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = taq.QuantWrapper(nn.Conv2d(3, 4, 1))
            self.b = taq.QuantWrapper(nn.Conv2d(4, 2, 1))

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = Pair().eval()
    cm = _compile(model, "bayes", {"": get_default_calib_qconfig(), "module_name": [
        ("b.quant", get_default_calib_qconfig(observer="minmax"))]})
    (program,) = cm.runtime.programs.values()
    assert [op.kind for op in program.ops] == ["quantize", "conv2d", "requantize", "conv2d", "dequantize"]
    assert torch.equal(cm(X), cm.converted(X))


# -------------------------------------------------------------------------------- negative tests


def test_a_requantize_op_needs_its_multiplier():
    spec = ValueSpec("x", "qint8", 0.1)
    op = BpuOp("requantize", ["x"], "y", {"in_scale": 0.1, "out_dtype": "qint8", "out_scale": 0.2, "out_axis": None},
               {"M": torch.tensor(1 << 30)})
    program = BpuProgram("bpu0", [spec], [ValueSpec("y", "qint8", 0.2)], [op])
    with pytest.raises(ArtifactError, match=r"op 0 'y' \(requantize\): tensor 'n' is missing"):
        check_program(program)
    op.attrs.pop("in_scale")
    with pytest.raises(ArtifactError, match=r"'y' \(requantize\): attr 'in_scale' is missing"):
        check_program(program)


def test_lowering_refuses_a_requantize_whose_input_grid_changed():
    model, qconfig = _build("requantize")
    _, converted = _staged(model, "bayes", qconfig)
    (req,) = [m for m in converted.modules() if isinstance(m, qnn.Requantize)]
    req.in_scale *= 2
    part = next(n.meta[META_PARTITION] for n in converted.graph.nodes if n.name == "requant")
    with pytest.raises(UnsupportedOpError, match=r"node 'requant' \(op 'quant', Requantize\) in BPU partition "
                                                 r"bpu0: input .* differs from the module's"):
        lower_partition(converted, part)


# -------------------------------------------------------------------------- untraceable code


class WithGate(ConvSandwich):
    def __init__(self):
        super().__init__("block", lambda: nn.Sequential(nn.Conv2d(4, 4, 1), Gate()))


class TopLevelControlFlow(nn.Module):
    """Like torch's TestHelperModules.ControlFlow: the top-level forward branches on a value."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, x, flag):
        y = self.conv(x)
        for _ in range(int(flag.sum())):
            y = y * 0.5
        return y


@pytest.mark.parametrize("march", MARCHES)
def test_an_untraceable_submodule_becomes_a_leaf_automatically(march, tmp_path):
    torch.manual_seed(0)
    model = WithGate().eval()
    with pytest.warns(QCompilerWarning, match=r"cannot trace module 'block.1' \(Gate\).*Done automatically: "
                                              r"'block.1' is a leaf"):
        cm = _compile(model, march)
    (name, reason), = cm.torch_islands().items()
    assert "cannot emit node 'block_1' (Gate" in reason
    gm = cm.converted
    gate = next(n for n in gm.graph.nodes if n.name == "block_1")
    assert placement(gate) == CPU
    assert gate.meta[META_REASON] == ("module 'block.1' (Gate) cannot be traced (float() argument must be a string "
                                      "or a real number, not 'Proxy'): it runs as a whole, in eager torch on the CPU")
    assert placement(next(n for n in gm.graph.nodes if n.name == "block_0")) == BPU  # its sibling traced
    for x in (X, X.abs(), -X.abs()):  # both branches of the Python
        assert torch.equal(cm(x), cm.converted(x))
    with pytest.raises(UnsupportedOpError, match=r"export_onnx: 1 CPU island\(s\) run in eager torch.*nodes block_1"):
        cm.export_onnx(tmp_path / "m.onnx")
    with pytest.raises(ArtifactError, match=r"save: 1 CPU island\(s\) run in eager torch.*nodes block_1"):
        cm.save(tmp_path / "m.qc")
    assert list(tmp_path.iterdir()) == []
    # staged API: the same integers
    with pytest.warns(QCompilerWarning, match="Done automatically: 'block.1'"):
        _, converted = _staged(model, march)
    assert torch.equal(converted(X), cm(X))


def test_an_explicit_leaf_gives_the_same_model_without_a_warning():
    torch.manual_seed(0)
    model = WithGate().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)
        cm = _compile(model, "bayes", prepare_custom_config_dict={"non_traceable_module_name": ["block.1"]})
    with pytest.warns(QCompilerWarning):
        auto = _compile(model, "bayes")
    assert torch.equal(cm(X), auto(X))


class TopLevelBranches(nn.Module):
    """The top-level forward returns from inside its first, untraceable statement: nothing to trace
    around it, so the whole model runs in torch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, x, flag):
        if flag.sum() > 0:
            return self.conv(x) * 0.5
        return self.conv(x)


# the fx fallback is the subject of these tests; capture="auto" would try torch.export before it
FX = {"capture": "fx"}


def test_an_untraceable_top_level_statement_runs_in_torch_and_the_rest_on_the_bpu():
    torch.manual_seed(0)
    model = TopLevelControlFlow().eval()
    flag = torch.ones(3)
    with pytest.warns(QCompilerWarning, match=r"Done instead: lines 534-535 of its forward \(reading flag, y; "
                                               r"writing y\) run as one eager-torch island"):
        cm = qcompiler.compile(model, (X, flag), march="bayes", calib_data=[(X, flag)], progress=False,
                               prepare_custom_config_dict=FX)
    assert [s.kind for s in cm.runtime.steps] == ["bpu", TORCH]
    for f in (flag, torch.zeros(3), torch.tensor([1.0, 0.0, 0.0])):  # the Python runs on every call
        assert torch.equal(cm(X, f), cm.converted(X, f))
        assert torch.allclose(cm(X, f), model(X, f), atol=0.05)


def test_an_untraceable_top_level_forward_runs_whole_in_torch(tmp_path):
    torch.manual_seed(0)
    model = TopLevelBranches().eval()
    flag = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = qcompiler.compile(model, (X, flag), march="bayes", calib_data=[(X, flag)], progress=False,
                               prepare_custom_config_dict=FX)
    messages = [str(w.message) for w in caught if issubclass(w.category, QCompilerWarning)]
    assert len(messages) == 2
    assert messages[0].startswith("TopLevelBranches: cannot trace the top-level module (TopLevelBranches)")
    assert "Done instead: the whole model runs as one eager-torch island on the CPU" in messages[0]
    assert "'strict_tracing': True" in messages[0]
    assert messages[1].startswith("compile: no op of TopLevelBranches runs on the BPU")
    assert [s.kind for s in cm.runtime.steps] == [TORCH]
    for f in (flag, torch.zeros(3), torch.tensor([1.0, 0.0, 0.0])):  # the Python runs on every call
        assert torch.equal(cm(X, f), model(X, f))
    with pytest.raises(UnsupportedOpError, match="nodes model"):
        cm.export_onnx(tmp_path / "m.onnx")
    with pytest.raises(ArtifactError, match="nodes model"):
        cm.save(tmp_path / "m.qc")
    # staged API
    with pytest.warns(QCompilerWarning, match="whole model runs as one eager-torch island"):
        prepared = prepare_calibration_fx(model, hybrid=True, example_inputs=(X, flag),
                                          prepare_custom_config_dict=FX)
    prepared(X, flag)
    assert torch.equal(convert_fx(prepared)(X, torch.zeros(3)), model(X, torch.zeros(3)))


def test_torchs_control_flow_model_compiles():
    cq = pytest.importorskip("torch.testing._internal.common_quantization")
    model = cq.TestHelperModules.ControlFlow().eval()
    inputs = model.example_inputs()
    with pytest.warns(QCompilerWarning, match="Mapped xs can only consist of tensors"):
        cm = qcompiler.compile(model, inputs, march="bayes", progress=False, prepare_custom_config_dict=FX)
    # its first statement, torch.mm(y, y), runs on the BPU; control_flow.map's statement in torch
    assert [s.kind for s in cm.runtime.steps] == ["bpu", TORCH]
    assert torch.equal(cm(*inputs), cm.converted(*inputs))
    assert torch.allclose(cm(*inputs), model(*inputs), atol=0.005)  # one int8 mm: 0.0009 off here


def test_strict_tracing_keeps_the_trace_error():
    model = WithGate().eval()
    with pytest.raises(TraceError, match=r"cannot trace module 'block.1' \(Gate\)"):
        _compile(model, "bayes", prepare_custom_config_dict={"strict_tracing": True})
    with pytest.raises(TraceError, match="top-level module"):
        prepare_calibration_fx(TopLevelControlFlow(), hybrid=True, example_inputs=(X, torch.ones(2)),
                               prepare_custom_config_dict={"strict_tracing": True})


def test_an_error_in_the_models_code_is_not_made_a_leaf():
    with pytest.raises(TraceError, match="NameError.*an error in the model's code"):
        _compile(TypoInside(), "bayes")  # a NameError in a submodule's forward
