"""PT2E interop: BPUQuantizer for torchao's prepare_pt2e, and qcompiler.compile of convert_pt2e graphs."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler import zoo
from qcompiler.errors import ConfigError
from qcompiler.compiled import CompiledModel, lower

torchao = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
from qcompiler.pt2e import BPUQuantizer, get_bpu_quantization_config  # noqa: E402
from qcompiler.pt2e.qdq import import_scales, strip_qdq  # noqa: E402
from qcompiler.quantization.convert import convert_fx  # noqa: E402
from qcompiler.quantization.prepare import prepare_calibration_fx  # noqa: E402

QT = torch.ops.quantized_decomposed.quantize_per_tensor.default
DQT = torch.ops.quantized_decomposed.dequantize_per_tensor.default
DQC = torch.ops.quantized_decomposed.dequantize_per_channel.default


def _pt2e(model, example, quantizer, calib):
    prepared = torchao.prepare_pt2e(torch.export.export(model, example).module(), quantizer)
    with torch.no_grad():
        for batch in calib:
            prepared(*batch)
    return torchao.convert_pt2e(prepared)


def _sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum()))


def _same_scales_reference(converted, example, hybrid_dict=None):
    """qcompiler's own staged flow on the stripped float graph with the PT2E scales: prepare, convert, lower."""
    stripped = strip_qdq(converted)
    prepared = prepare_calibration_fx(stripped.gm, None, {"capture": "export"}, hybrid=True,
                                      hybrid_dict=hybrid_dict, example_inputs=example, march="bayes").eval()
    with torch.no_grad():
        prepared(*example)
    assert import_scales(prepared, stripped, example) > 0
    ours = convert_fx(prepared)
    return CompiledModel(lower(ours, example_inputs=example), name="ref", march="bayes", converted=ours,
                         example_inputs=example), ours


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = zoo.get("resnet18").eval()
    example = zoo.example_inputs("resnet18", image_size=32)
    calib = [(torch.randn(1, 3, 32, 32),) for _ in range(8)]
    converted = _pt2e(model, example, BPUQuantizer("bayes"), calib)
    return model, example, calib, converted


def test_resnet18_pt2e_flow_is_bit_exact_with_our_convert_and_near_our_ptq(resnet):
    model, example, calib, converted = resnet
    compiled = qcompiler.compile(converted, example, march="bayes", progress=False)
    reference, ours_converted = _same_scales_reference(converted, example)
    ptq = qcompiler.compile(model, example, march="bayes", calib_data=calib, progress=False)
    assert [p["placement"] for p in compiled.partitions] == [p["placement"] for p in ptq.partitions] == ["bpu"]
    torch.manual_seed(1)
    test = [torch.randn(1, 3, 32, 32) for _ in range(4)]
    with torch.no_grad():
        for x in test:
            got = compiled(x)
            assert torch.equal(got, reference(x))  # BPU program vs our staged convert, same scales
            assert torch.equal(got, ours_converted(x))  # the simulator vs the convert module
        ref = torch.cat([model(x) for x in test])
        pt2e_sqnr = _sqnr(ref, torch.cat([compiled(x) for x in test]))
        ptq_sqnr = _sqnr(ref, torch.cat([ptq(x) for x in test]))
    print(f"resnet18 32x32 SQNR: pt2e {pt2e_sqnr:.2f} dB, qcompiler PTQ {ptq_sqnr:.2f} dB")
    assert pt2e_sqnr >= ptq_sqnr - 0.5


def test_imported_weights_are_the_pt2e_integers(resnet):
    _, _, _, converted = resnet
    stripped = strip_qdq(converted)
    for weight, scale, axis in stripped.weights:
        shape = [1] * weight.dim()
        shape[axis] = -1
        q = torch.round(weight / scale.reshape(shape))
        assert torch.equal(q * scale.reshape(shape), weight)  # on the grid: our per-channel quantize gives q
        assert q.abs().max() <= 127


class _Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), self.b(x) * 3.0], dim=1))


def _scales_around(converted, target):
    node = next(n for n in converted.graph.nodes if n.target is target)
    ins = [a.args[1] for a in node.args[0]]
    out = next(iter(node.users)).args[1]
    return ins, out


def test_cat_inputs_and_output_share_one_scale():
    torch.manual_seed(0)
    model = _Cat().eval()
    x = (torch.randn(1, 3, 8, 8),)
    converted = _pt2e(model, x, BPUQuantizer("bayes"), [x])
    ins, out = _scales_around(converted, torch.ops.aten.cat.default)
    assert len(set(ins)) == 1 and ins[0] == out  # b's output is 3x a's range, yet one scale for all
    compiled = qcompiler.compile(converted, x, march="bayes", progress=False)
    reference, _ = _same_scales_reference(converted, x)
    y = torch.randn(1, 3, 8, 8)
    assert torch.equal(compiled(y), reference(y))


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.conv1(x))


def _qdq_of(converted):
    dtypes = [n.args[5] for n in converted.graph.nodes if n.target is QT]
    weights = sum(1 for n in converted.graph.nodes if n.target is DQC)
    return dtypes, weights


def test_overrides_module_name_beats_module_type_beats_global():
    torch.manual_seed(0)
    model, x = _Two().eval(), (torch.randn(1, 3, 8, 8),)
    default = _qdq_of(_pt2e(model, x, BPUQuantizer("bayes"), [x]))
    assert default == ([torch.int8] * 3, 2)
    q16 = get_bpu_quantization_config("qint16")
    typed = BPUQuantizer("bayes").set_module_type(nn.Conv2d, q16)
    assert _qdq_of(_pt2e(model, x, typed, [x])) == ([torch.int16] * 3, 2)
    named = BPUQuantizer("bayes").set_module_type(nn.Conv2d, q16).set_module_name("conv2", None)
    dtypes, weights = _qdq_of(_pt2e(model, x, named, [x]))
    assert weights == 1 and dtypes == [torch.int16, torch.int16]  # conv2 float: its weight and output too
    off = BPUQuantizer("bayes").set_global(None)
    assert _qdq_of(_pt2e(model, x, off, [x])) == ([], 0)


def test_int16_pt2e_graph_compiles_as_int16():
    torch.manual_seed(0)
    model, x = _Two().eval(), (torch.randn(1, 3, 8, 8),)
    quantizer = BPUQuantizer("bayes").set_global(get_bpu_quantization_config("qint16"))
    converted = _pt2e(model, x, quantizer, [x])
    compiled = qcompiler.compile(converted, x, march="bayes", progress=False)
    assert set(compiled.activation_dtypes.values()) == {"qint16"}
    reference, _ = _same_scales_reference(converted, x)
    assert torch.equal(compiled(x[0]), reference(x[0]))


def test_qat_pt2e_graph_compiles_with_its_trained_scales():
    torch.manual_seed(0)
    model, x = _Two(), (torch.randn(1, 3, 8, 8),)
    quantizer = BPUQuantizer("bayes").set_global(get_bpu_quantization_config(is_qat=True))
    prepared = torchao.prepare_qat_pt2e(torch.export.export(model, x).module(), quantizer)
    prepared(*x)  # a training step's forward: the fake quants see data
    converted = torchao.convert_pt2e(prepared)
    compiled = qcompiler.compile(converted, x, march="bayes", progress=False)
    reference, _ = _same_scales_reference(converted, x)
    y = torch.randn(1, 3, 8, 8)
    assert torch.equal(compiled(y), reference(y))
    assert _sqnr(model(y).detach(), compiled(y)) > 20


def test_int16_on_a_march_without_it_is_refused():
    with pytest.raises(ConfigError, match="bernoulli2.*int16"):
        BPUQuantizer("bernoulli2").set_global(get_bpu_quantization_config("qint16"))
    with pytest.raises(ConfigError, match="qint8' or 'qint16"):
        get_bpu_quantization_config("quint8")


def _tampered(position, value):
    torch.manual_seed(0)
    model, x = _Two().eval(), (torch.randn(1, 3, 8, 8),)
    converted = _pt2e(model, x, BPUQuantizer("bayes"), [x])
    q = next(n for n in converted.graph.nodes if n.target is QT)
    for node in [q, *q.users]:
        args = list(node.args)
        args[position] = value
        node.args = tuple(args)
    return converted, x, q.name


@pytest.mark.parametrize("position,value,words", [
    (2, 3, "zero point 3"),
    (5, torch.uint8, "torch.uint8"),
    (3, -127, r"range \[-127, 127\]"),
])
def test_qdq_outside_the_contract_names_the_node_and_the_fix(position, value, words):
    converted, x, name = _tampered(position, value)
    with pytest.raises(ConfigError, match=rf"'{name}'.*{words}.*BPUQuantizer"):
        qcompiler.compile(converted, x, march="bayes", progress=False)


def test_a_quantizer_with_no_pt2e_scale_is_a_clear_error():
    torch.manual_seed(0)
    model, x = _Two().eval(), (torch.randn(1, 3, 8, 8),)
    converted = _pt2e(model, x, BPUQuantizer("bayes").set_module_name("conv2", None), [x])
    with pytest.raises(ConfigError, match="no Q/DQ.*BPUQuantizer"):
        qcompiler.compile(converted, x, march="bayes", progress=False)


def test_pt2e_graph_refuses_qat_and_its_own_calibration_steps(resnet):
    _, example, _, converted = resnet
    with pytest.raises(ConfigError, match="brings its own scales"):
        qcompiler.compile(converted, example, march="bayes", weight_rounding=True, progress=False)


def test_missing_torchao_names_the_install_command():
    code = ("import sys; sys.modules['torchao'] = None\n"
            "import qcompiler.pt2e as p\n"
            "from qcompiler.errors import ConfigError\n"
            "try:\n    p.BPUQuantizer\nexcept ConfigError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "ERR" in out.stdout and "pip install qcompiler[pt2e]" in out.stdout, out.stderr[-2000:]


def test_a_module_left_float_runs_on_the_cpu_with_hybrid_dict():
    torch.manual_seed(0)
    model, x = _Two().eval(), (torch.randn(1, 3, 8, 8),)
    converted = _pt2e(model, x, BPUQuantizer("bayes").set_module_name("conv2", None), [x])
    hybrid = {"module_name": ["conv2"]}
    compiled = qcompiler.compile(converted, x, march="bayes", hybrid_dict=hybrid, progress=False)
    assert [p["placement"] for p in compiled.partitions] == ["bpu", "cpu"]
    reference, _ = _same_scales_reference(converted, x, hybrid)
    y = torch.randn(1, 3, 8, 8)
    assert torch.equal(compiled(y), reference(y))
    assert _sqnr(model(y).detach(), compiled(y)) > 15  # one calibration image: a sanity bound, not accuracy


def test_pt2e_graph_refuses_a_capture_other_than_export(resnet):
    _, example, _, converted = resnet
    with pytest.raises(ConfigError, match="capture.*export"):
        qcompiler.compile(converted, example, march="bayes", prepare_custom_config_dict={"capture": "fx"},
                          progress=False)


def test_the_default_activation_observer_is_our_ptq_calibration():
    """BPUQuantizer's histogram observer runs qcompiler's histogram-mse search, so PT2E picks the scale
    compile() picks (torchao's HistogramObserver landed 0.65 dB below our PTQ on resnet18 at 64x64)."""
    from qcompiler.pt2e.quantizer import QcHistogramObserver, _activation_spec
    from qcompiler.quantization.observer import make_observer

    spec = _activation_spec(get_bpu_quantization_config())
    assert spec.observer_or_fake_quant_ctr is QcHistogramObserver
    obs = QcHistogramObserver.with_args(dtype=torch.int8, quant_min=-128, quant_max=127,
                                        qscheme=torch.per_tensor_symmetric)()
    ours = make_observer("histogram-mse", "qint8")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 64, generator=g) * torch.rand(1, generator=g) * 5
        obs(x)
        ours(x)
    scale, zero_point = obs.calculate_qparams()
    assert torch.equal(scale, ours.calculate_qparams()[0].reshape(-1)[:1].float())
    assert zero_point.tolist() == [0]


class _NoBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(torch.flatten(y, 1))


def _original_with_pt2e_scales(model, converted, example, scale_factor=None):
    """Our staged flow on the ORIGINAL float model, each quantizer fixed to the scale PT2E gave it.

    The PT2E scales are read through the stripped graph (import_scales); its quantizers are qcompiler's own on
    the same structure, so they pair with the original model's by position. ``scale_factor`` (negative test)
    multiplies the first activation scale.
    """
    from qcompiler.pt2e.qdq import FakeQuantizeBase, ImportedScaleObserver, _quantizers
    stripped = strip_qdq(converted)
    cfg = dict(hybrid=True, example_inputs=example, march="bayes")
    src = prepare_calibration_fx(stripped.gm, None, {"capture": "export"}, **cfg).eval()
    dst = prepare_calibration_fx(model, None, {"capture": "export"}, **cfg).eval()
    assert import_scales(src, stripped, example) > 0
    pairs = list(zip(_quantizers(src), _quantizers(dst)))
    assert len(pairs) == len(_quantizers(dst)) > 0 and all(isinstance(q, FakeQuantizeBase) for _, (_, q) in pairs)
    first = True
    for (_, s), (_, q) in pairs:
        scale = s.activation_post_process.calculate_qparams()[0].float()
        if q.ch_axis < 0 and first and scale_factor is not None:
            scale, first = scale * scale_factor, False
        fixed = ImportedScaleObserver(scale, s.activation_post_process.dtype, q.ch_axis)
        fixed.qc_name = q.qc_name
        q.activation_post_process = fixed
    ours = convert_fx(dst)
    return CompiledModel(lower(ours, example_inputs=example), name="orig", march="bayes", converted=ours,
                         example_inputs=example)


@pytest.fixture(scope="module")
def nobn():
    torch.manual_seed(0)
    model = _NoBN().eval()
    example = (torch.randn(1, 3, 8, 8),)
    calib = [(torch.randn(1, 3, 8, 8),) for _ in range(4)]
    return model, example, _pt2e(model, example, BPUQuantizer("bayes"), calib)


def test_original_model_with_the_pt2e_scales_is_bit_exact(nobn):
    model, example, converted = nobn
    compiled = qcompiler.compile(converted, example, march="bayes", progress=False)
    ours = _original_with_pt2e_scales(model, converted, example)
    torch.manual_seed(2)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 3, 8, 8)
            assert torch.equal(compiled(x), ours(x))


def test_original_model_with_other_scales_is_not_bit_exact(nobn):
    model, example, converted = nobn
    compiled = qcompiler.compile(converted, example, march="bayes", progress=False)
    ours = _original_with_pt2e_scales(model, converted, example, scale_factor=2.0)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert not torch.equal(compiled(x), ours(x))
