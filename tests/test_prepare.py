"""prepare_calibration_fx / prepare_qat_fx: the guide's flow, qconfig priority, hand-over, errors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_untouched, snapshot
from graph_match import assert_same_graph
from test_golden_hybrid import STAGES, GuidePrepared

from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.nn import qat
from qcompiler.quantization import (
    CalibFakeQuantize,
    FakeQuantize,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.stubs import DeQuantStub

X = torch.rand(1, 3, 16, 16)


def calibrate(model, batches):
    """Run ``batches`` through a calibration model in eval mode, without autograd; returns it."""
    model.eval()
    with torch.no_grad():
        for b in batches:
            model(b)
    return model


def test_guide_flow_calibration_then_qat(hybrid_model, guide_hybrid_dict):
    snap = snapshot(hybrid_model)
    torch.manual_seed(1)
    data = [torch.rand(1, 3, 16, 16) for _ in range(5)]
    cal = prepare_calibration_fx(hybrid_model, {"": get_default_calib_qconfig()}, hybrid=True,
                                 hybrid_dict=guide_hybrid_dict, example_inputs=X, march="bayes")
    assert_same_graph(cal, GuidePrepared("calibration"))
    calibrate(cal, data)
    # a calibration model returns exactly the float outputs
    assert torch.equal(cal(X), hybrid_model(X))
    qat = prepare_qat_fx(
        cal,
        {"": get_default_qat_qconfig(), "module_name": [("conv4", get_default_qat_out_qconfig())]},
        hybrid=True,
        hybrid_dict=guide_hybrid_dict,
    )
    assert_same_graph(qat, GuidePrepared("qat"))
    assert type(qat).__name__ == "HybridModel"
    # conv4 emits a high-precision output: no output fake quant, but its weight is fake-quantized
    assert qat.conv4.activation_post_process is None
    assert isinstance(qat.conv4.weight_fake_quant, FakeQuantize)
    # every fake quant present in both starts from the calibrated scale
    for path in ("quant.activation_post_process", "conv0.activation_post_process", "conv2.activation_post_process",
                 "selu_1_activation_post_process", "conv3_activation_post_process"):
        calibrated = cal.get_submodule(path).calculate_qparams()[0]
        fq = qat.get_submodule(path)
        assert isinstance(fq, FakeQuantize)
        assert torch.equal(fq.scale, calibrated), path
        assert fq.observer_enabled[0] == 1 and fq.fake_quant_enabled[0] == 1
    # CPU modules keep no quantizer
    assert not hasattr(qat.conv3, "weight_fake_quant") and not hasattr(qat.prelu, "activation_post_process")
    # the calibration model is not changed by prepare_qat_fx
    assert isinstance(cal.conv0.activation_post_process, CalibFakeQuantize)
    # a training step: finite loss and gradients
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    loss = qat(X).pow(2).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in qat.parameters() if p.grad is not None)
    assert qat.conv0.weight.grad is not None and qat.conv0.weight.grad.abs().sum() > 0
    opt.step()
    assert_untouched(hybrid_model, snap)


def test_print_shows_quantizers_under_bpu_modules(hybrid_model, guide_hybrid_dict):
    cal = prepare_calibration_fx(hybrid_model, hybrid=True, hybrid_dict=guide_hybrid_dict, example_inputs=X)
    text = str(cal)
    conv0 = text[text.index("(conv0): Conv2d("):text.index("(identity)")]
    assert "(weight_fake_quant): CalibFakeQuantize(" in conv0 and "(activation_post_process): CalibFakeQuantize(" in conv0
    assert "(conv3): Conv2d(3, 3, kernel_size=(1, 1), stride=(1, 1))\n" in text  # CPU: no quantizer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.sigmoid(self.conv(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def dtype_of(gm, path):
    return gm.get_submodule(path).dtype


def test_qconfig_priority_global_type_name_attribute():
    m = Net()
    q16 = get_default_qat_qconfig(dtype="qint16")
    x = torch.rand(1, 4, 8, 8)
    gm = prepare_qat_fx(m, {"": get_default_qat_qconfig(), "module_type": [(Block, q16)]}, example_inputs=x)
    # functional ops inside a Block inherit the Block's qconfig; the head keeps the global one
    assert dtype_of(gm, "sigmoid_activation_post_process") == "qint16"
    assert dtype_of(gm, "a.conv.activation_post_process") == "qint16"
    assert dtype_of(gm, "head.activation_post_process") == "qint8"
    gm = prepare_qat_fx(m, {"": get_default_qat_qconfig(), "module_type": [(Block, q16)],
                            "module_name": [("b", get_default_qat_qconfig())]}, example_inputs=x)
    assert dtype_of(gm, "sigmoid_1_activation_post_process") == "qint8"  # module_name beats module_type
    assert dtype_of(gm, "sigmoid_activation_post_process") == "qint16"
    m.b.conv.qconfig = q16
    gm = prepare_qat_fx(m, {"": get_default_qat_qconfig(), "module_name": [("b", get_default_qat_qconfig())]},
                        example_inputs=x)
    assert dtype_of(gm, "b.conv.activation_post_process") == "qint16"  # module.qconfig beats module_name


def test_bpu_op_without_qconfig_is_an_error_naming_it():
    x = torch.rand(1, 4, 8, 8)
    with pytest.raises(ConfigError, match=r"model input 'x' feeds the BPU but has no activation qconfig"):
        prepare_qat_fx(Net(), {"": None}, example_inputs=x)
    with pytest.raises(ConfigError, match=r"BPU op 'a_conv' \(conv2d\) has no qconfig: set a global qconfig"):
        prepare_qat_fx(Net(), {"": get_default_qat_qconfig(), "module_type": [(Block, None)]}, example_inputs=x)


def test_bad_qconfig_dict_and_model_untouched():
    m = Net()
    snap = snapshot(m)
    with pytest.raises(ConfigError, match="module_names"):
        prepare_qat_fx(m, {"module_names": []}, example_inputs=torch.rand(1, 4, 8, 8))
    with pytest.raises(ConfigError, match="'hed' is not in the model"):
        prepare_qat_fx(m, {"": get_default_qat_qconfig(), "module_name": [("hed", None)]},
                       example_inputs=torch.rand(1, 4, 8, 8))
    with pytest.raises(ConfigError, match="example_inputs is required"):
        prepare_qat_fx(m)
    with pytest.raises(ConfigError, match="hybrid_dict forces ops to the CPU, which needs hybrid=True"):
        prepare_qat_fx(m, hybrid_dict={"module_name": ["head"]}, example_inputs=torch.rand(1, 4, 8, 8))
    assert_untouched(m, snap)


def test_qat_hand_over_compares_hybrid_dict_as_sets(hybrid_model, guide_hybrid_dict):
    cal = prepare_calibration_fx(hybrid_model, hybrid=True, hybrid_dict=guide_hybrid_dict,
                                 example_inputs=X, march="bayes")
    calibrate(cal, [X])
    # the same modules listed in another order (and one twice) are the same config
    reordered = {"module_type": guide_hybrid_dict["module_type"],
                 "module_name": list(reversed(guide_hybrid_dict["module_name"])) + ["conv3"]}
    qat = prepare_qat_fx(cal, hybrid=True, hybrid_dict=reordered)
    assert_same_graph(qat, GuidePrepared("qat"))
    # another module forced to the CPU is not: the error says which
    other = {**guide_hybrid_dict, "module_name": ["conv3"]}
    with pytest.raises(ConfigError, match=r"module_name \['conv1.conv'\] missing"):
        prepare_qat_fx(cal, hybrid=True, hybrid_dict=other)
    with pytest.raises(ConfigError, match=r"module_type \['_SeluModule'\] missing"):
        prepare_qat_fx(cal, hybrid=True, hybrid_dict={"module_name": guide_hybrid_dict["module_name"]})


def test_cpu_ops_without_hybrid_flag_warn(hybrid_model):
    with pytest.warns(QCompilerWarning, match="prelu: prelu is not supported on bayes"):
        prepare_calibration_fx(hybrid_model, example_inputs=X, march="bayes")


class Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.cat([F.relu(self.a(x)), self.b(x)], 1)


def calibration_observer():
    """The quantizer prepare_calibration_fx inserts as a graph node."""
    return STAGES["calibration"][2]()


def fused_conv(conv: nn.Conv2d, fused_from: tuple, with_add: bool = False) -> nn.Module:
    """The observed fused conv + ReLU prepare_calibration_fx makes."""
    return qat.FusedConv2d(conv, nn.ReLU(), with_add=with_add, fused_from=fused_from)


class CatPrepared(nn.Module):
    """Cat calibrated: the input observed, the cat observed, the output dequantized."""

    def __init__(self):
        super().__init__()
        self.x_activation_post_process, self.cat_activation_post_process = (calibration_observer(),
                                                                            calibration_observer())
        self.a = fused_conv(nn.Conv2d(4, 4, 1), ("conv2d", "relu"))
        self.b = qat.Conv2d(4, 4, 1)
        self.output_input_dequant = DeQuantStub()

    def forward(self, x):
        x = self.x_activation_post_process(x)
        y = self.cat_activation_post_process(torch.cat([self.a(x), self.b(x)], 1))
        return self.output_input_dequant(y)


def test_optimize_graph_shares_one_quantizer_for_cat():
    x = torch.rand(1, 4, 8, 8)
    gm = prepare_qat_fx(Cat(), example_inputs=x, optimize_graph=True)
    out = gm.get_submodule("cat_activation_post_process")
    assert gm.a.activation_post_process is out and gm.b.activation_post_process is out
    gm = prepare_qat_fx(Cat(), example_inputs=x)
    assert gm.a.activation_post_process is not gm.cat_activation_post_process


def test_optimize_graph_model_converts_and_matches_its_fake_quant_model():
    """convert_fx finds the shared cat quantizer under every name (it raised KeyError)."""
    from qcompiler.quantization import convert_fx, set_state

    torch.manual_seed(0)
    x = torch.rand(2, 4, 8, 8)
    cal = prepare_calibration_fx(Cat().eval(), example_inputs=x, optimize_graph=True)
    calibrate(cal, [x])
    qat = set_state(prepare_qat_fx(cal, optimize_graph=True), "validation").eval()
    q = convert_fx(qat)
    with torch.no_grad():
        assert torch.equal(q(x), qat(x))


def test_models_without_stubs_are_quantized_at_inputs_and_dequantized_at_outputs():
    gm = prepare_calibration_fx(Cat(), example_inputs=torch.rand(1, 4, 8, 8))
    assert_same_graph(gm, CatPrepared())
    assert isinstance(gm.x_activation_post_process, CalibFakeQuantize)


def test_a_few_qat_steps_lower_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    x = torch.randn(64, 3, 8, 8)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long()
    cal = calibrate(prepare_calibration_fx(model, example_inputs=x[:2]), [x[i:i + 16] for i in range(0, 64, 16)])
    # the logits layer emits a high-precision output, as the guide advises for a model output
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig(), "module_name": [("7", get_default_qat_out_qconfig())]})
    qat.train()
    opt = torch.optim.Adam(qat.parameters(), lr=0.01)
    losses = []
    for _ in range(40):  # the loss falls steadily but slowly here (-10% after ~33 steps)
        opt.zero_grad()
        loss = F.cross_entropy(qat(x), y)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in qat.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_nan_reaching_an_observer_names_it(hybrid_model):
    from qcompiler.errors import CalibrationError

    cal = prepare_calibration_fx(hybrid_model, hybrid=True, example_inputs=X)
    bad = X.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(CalibrationError, match=r"observer 'quant.activation_post_process' saw NaN/Inf"):
        cal(bad)
    hybrid_model.conv0.weight.data[0, 0, 0, 0] = float("inf")
    cal = prepare_calibration_fx(hybrid_model, hybrid=True, example_inputs=X)
    with pytest.raises(CalibrationError, match=r"'conv0.weight_fake_quant"):
        cal(X)


class _Block(nn.Module):
    """A ResNet basic block with a stem; ReLU modules used once each."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn0, self.relu0 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()

    def forward(self, x):
        x = self.relu0(self.bn0(self.stem(x)))
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + x)


class BlockPrepared(nn.Module):
    """_Block calibrated: the input observed, three fused convs (the last adds the stem's output)."""

    def __init__(self, folded: tuple):
        super().__init__()
        self.x_activation_post_process = calibration_observer()
        self.stem = fused_conv(nn.Conv2d(3, 8, 3, padding=1), ("conv2d", *folded, "relu"))
        self.conv1 = fused_conv(nn.Conv2d(8, 8, 3, padding=1), ("conv2d", *folded, "relu"))
        self.conv2 = fused_conv(nn.Conv2d(8, 8, 3, padding=1), ("conv2d", *folded, "add", "relu"), with_add=True)
        self.output_input_dequant = DeQuantStub()

    def forward(self, x):
        x = self.stem(self.x_activation_post_process(x))
        return self.output_input_dequant(self.conv2(self.conv1(x), x))


def test_model_pre_fused_by_torch_ao_gets_the_same_quantizers():
    """torch.ao's fuse_modules leaves nn.Identity where it folded a BN: prepare must place the
    observers as for the original model (after each ReLU, none between a conv and its ReLU)."""
    from torch.ao.quantization import fuse_modules

    torch.manual_seed(0)
    model = _Block().eval()
    ao = fuse_modules(model, [["stem", "bn0"], ["conv1", "bn1"], ["conv2", "bn2"]])  # a copy
    for m in (model, ao):
        gm = prepare_calibration_fx(m, example_inputs=X)
        folded = () if m is ao else ("batch_norm",)
        assert_same_graph(gm, BlockPrepared(folded))
        ops = {name: gm.get_submodule(name).fused_from for name in ("stem", "conv1", "conv2")}
        assert ops == {"stem": ("conv2d", *folded, "relu"), "conv1": ("conv2d", *folded, "relu"),
                       "conv2": ("conv2d", *folded, "add", "relu")}


class _TwoConvs(nn.Module):
    """Two 1x1 convs ``c1`` and ``c2``; each test writes the forward."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)


def _refuses_high_precision_output(model, layer, match):
    """prepare_qat_fx refuses a high-precision output qconfig on ``layer`` (ConfigError matching
    ``match``) and leaves ``model`` untouched."""
    snap = snapshot(model)
    qconfig = {"": get_default_qat_qconfig(), "module_name": [(layer, get_default_qat_out_qconfig())]}
    with pytest.raises(ConfigError, match=match):
        prepare_qat_fx(model, qconfig, example_inputs=X)
    assert_untouched(model, snap)


@pytest.mark.parametrize("tail", ["relu", "add"])
def test_high_precision_output_on_a_layer_fused_with_relu_or_add_is_refused(tail):
    """The int32 output is the accumulator before a fused ReLU / add: convert would drop them."""

    class M(_TwoConvs):
        def forward(self, x):
            y = self.c1(x)
            return F.relu(self.c2(y)) if tail == "relu" else self.c2(y) + y

    _refuses_high_precision_output(M().eval(), "c2", rf"node 'c2': a high-precision \(int32\) output qconfig on "
                                                     rf"a layer fused with {tail} .*Give the high-precision "
                                                     rf"qconfig to a layer")


def test_high_precision_output_read_by_a_bpu_op_is_refused_at_prepare():
    """An int32 output cannot feed another BPU op; the error names the producer, not the consumer."""

    class M(_TwoConvs):
        def forward(self, x):
            return self.c2(self.c1(x))

    model = M().eval()
    _refuses_high_precision_output(model, "c1", r"node 'c1': a high-precision \(int32\) output qconfig, but its "
                                                r"output feeds BPU op\(s\) c2, which take int8/int16 inputs")
    # the same qconfig on the last layer (its output leaves the BPU) is fine
    qconfig = {"": get_default_qat_qconfig(), "module_name": [("c2", get_default_qat_out_qconfig())]}
    gm = prepare_qat_fx(model, qconfig, example_inputs=X)
    assert gm.get_submodule("c2").activation_post_process is None
