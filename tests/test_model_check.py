"""check_qat_model: unfused patterns, call counts, qconfig tables, anomalies, prepare's warning."""

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.errors import QCompilerWarning
from qcompiler.quantization import FakeQuantize
from qcompiler.quantization.observer import MinMaxObserver
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.tools.model_check import RESULT_FILE, check_qat_model
from qcompiler.zoo.hybrid import _SeluModule

X = torch.rand(1, 3, 8, 8)
HD = {"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]}


class ConvUsedTwiceBeforeBN(nn.Module):
    """conv -> (bn, and also added later): fuse refuses conv+bn, so it stays separate."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.unused = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        z = self.bn(y)
        z = self.relu(z)
        z = self.relu(self.conv2(z))  # the same ReLU a second time (fused into conv2 here)
        return z * y


class SharedRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.relu = nn.ReLU()
        self.never = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x) + self.relu(x))


def _qat(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat_fx(model, example_inputs=X, **kw)


def test_conv_used_twice_before_bn_is_reported_unfused(capsys):
    gm = _qat(ConvUsedTwiceBeforeBN().eval())
    r = check_qat_model(gm, X)
    hits = [u for u in r.unfused if u["nodes"][0] == "conv"]
    assert hits and hits[0]["nodes"][:2] == ["conv", "bn"]
    assert "used 2 times" in hits[0]["reason"]
    assert "unfused" in capsys.readouterr().out
    # a float model is traced and checked the same way
    assert any(u["nodes"][:2] == ["conv", "bn"] for u in check_qat_model(ConvUsedTwiceBeforeBN(), X).unfused)


def test_shared_and_never_called_modules():
    r = check_qat_model(SharedRelu(), X, verbose=False)
    assert r.call_counts["relu"] == 2 and r.shared == {"relu": 2}
    assert "never" in r.never_called
    assert r.call_counts["conv"] == 1
    # a ReLU reused without a quantizer is not an anomaly
    assert not [a for a in r.abnormal if a.kind == "shared_module"]


def test_hybrid_layer_and_weight_qconfigs(hybrid_model):
    gm = _qat(hybrid_model, hybrid=True, hybrid_dict=HD)
    r = check_qat_model(gm, X, verbose=False)
    assert r.shared == {"identity": 2} and not r.abnormal and not r.unfused
    row = next(x for x in r.layer_qconfigs if x["name"] == "conv0")
    assert (row["input_dtype"], row["output_dtype"], row["ch_axis"], row["observer"]) == (
        "qint8", "qint8", -1, "MovingAverageMinMaxObserver")
    w = next(x for x in r.weight_qconfigs if x["name"] == "conv0")
    assert (w["dtype"], w["qscheme"], w["ch_axis"], w["observer"]) == (
        "qint8", "per_channel_symmetric", 0, "MovingAveragePerChannelMinMaxObserver")
    quant = next(x for x in r.layer_qconfigs if x["name"] == "quant")
    assert quant["input_dtype"] == "torch.float32" and quant["output_dtype"] == "qint8"


def test_abnormal_configs_are_flagged_and_saved(hybrid_model, tmp_path, capsys):
    gm = _qat(hybrid_model, hybrid=True, hybrid_dict=HD)
    gm.conv0.weight_fake_quant = FakeQuantize(MinMaxObserver())  # per-tensor weight
    gm.conv2.activation_post_process.disable_fake_quant()
    r = check_qat_model(gm, X, save_results=True, out_dir=str(tmp_path))
    kinds = {(a.where, a.kind) for a in r.abnormal}
    assert ("conv0", "per_tensor_weight") in kinds
    assert ("conv2.activation_post_process", "fake_quant_disabled") in kinds
    out = capsys.readouterr().out
    assert "per_tensor_weight" in out and "fake_quant_disabled" in out
    text = (tmp_path / RESULT_FILE).read_text()
    assert text == r.text()
    for needle in ("Each layer out qconfig", "Weight qconfig", "per_tensor_weight", "fake_quant_disabled",
                   "identity", "MovingAveragePerChannelMinMaxObserver"):
        assert needle in text
    assert not list(tmp_path.glob(".tmp_*"))


def test_check_does_not_change_the_model(hybrid_model):
    gm = _qat(hybrid_model, hybrid=True, hybrid_dict=HD)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    check_qat_model(gm, X, verbose=False)
    after = gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_calibration_model_is_not_flagged_for_disabled_fake_quant(hybrid_model):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cal = prepare_calibration_fx(hybrid_model, hybrid=True, hybrid_dict=HD, example_inputs=X)
    assert not [x for x in w if "model check" in str(x.message)]
    assert not check_qat_model(cal, X, verbose=False).abnormal


def test_prepare_warns_for_unfused_model_not_for_resnet18():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        prepare_qat_fx(ConvUsedTwiceBeforeBN().eval(), hybrid=True, example_inputs=X)
    msgs = [str(x.message) for x in w if issubclass(x.category, QCompilerWarning)]
    assert any("model check" in m and "unfused" in m and "conv" in m for m in msgs), msgs

    from qcompiler.zoo import get
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        prepare_qat_fx(get("resnet18"), hybrid=True, example_inputs=torch.rand(1, 3, 32, 32))
    assert not [x for x in w if issubclass(x.category, QCompilerWarning) and "model check" in str(x.message)]


class TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_int16_boundary_is_in_the_report_but_prepare_does_not_warn(capsys):
    """An int16 qconfig on one layer makes an int8/int16 boundary: listed, but asked for (no warning, and
    nothing printed by prepare: every nash compile of a LayerNorm printed the table before)."""
    qconfig = {"": get_default_calib_qconfig(), "module_name": [("a", get_default_calib_qconfig(dtype="qint16"))]}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cal = prepare_calibration_fx(TwoConvs().eval(), qconfig, example_inputs=X, march="bayes")
    assert not [x for x in w if issubclass(x.category, QCompilerWarning) and "model check" in str(x.message)]
    assert capsys.readouterr().out == ""
    result = check_qat_model(cal, X, verbose=False)
    assert "mixed_dtype" in capsys.readouterr().out  # called by the user, it prints what it found
    assert check_qat_model(cal, X, printed=False).abnormal == result.abnormal
    assert capsys.readouterr().out == ""
    assert [(a.where, a.kind, a.message) for a in result.abnormal] == [
        ("a", "mixed_dtype", "qint8 input, qint16 output: an int8/int16 boundary"),
        ("b", "mixed_dtype", "qint16 input, qint8 output: an int8/int16 boundary")]


class ThreeConvs(nn.Module):
    """Three 1x1 convs ``a``, ``b`` and ``c``; each subclass writes the forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)


class ConvAdds(ThreeConvs):
    """conv + x with an alpha keyword, and conv + a broadcast (N, C, 1, 1) operand: neither fuses."""

    def forward(self, x):
        y = torch.add(self.a(x), x, alpha=2.0)
        z = self.b(y) + x.mean((2, 3), keepdim=True)
        return self.c(z) + y  # a plain residual add: fused, not reported


def test_unfused_adds_say_why():
    r = check_qat_model(_qat(ConvAdds().eval()), X)
    reasons = {u["nodes"][0]: u["reason"] for u in r.unfused}
    assert reasons == {
        "a": "'add' is called with alpha=2.0: only a plain two-operand add fuses",
        "b": "'add_1' broadcasts (1, 3, 8, 8) with (1, 3, 1, 1): only an add of two same-shape tensors fuses",
    }


class ActThenAdd(ThreeConvs):
    """conv+relu whose output is then added, and conv+add whose sum goes to a relu6: both already
    fused as far as the fuse table allows, so nothing is unfused (no pattern takes a part *before*
    what it already holds, and conv+add+relu6 is not a row)."""

    def forward(self, x):
        y = F.relu(self.a(x)) + x
        return F.relu6(self.b(y) + self.c(x))


def test_parts_before_a_fused_part_are_not_reported_unfused():
    r = check_qat_model(_qat(ActThenAdd().eval()), X)
    assert r.unfused == []


class ConstantAdds(nn.Module):
    """Convs followed by adds of a constant (``+ 1.0``, ``2.0 + ``, after a fused conv+bn, ``x + x``)
    and a mul: no residual add, nothing to report. One conv + feature-map add that cannot fuse (the
    conv's output is also multiplied): reported."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e, self.f = (nn.Conv2d(3, 3, 1) for _ in range(6))
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.a(x) + 1.0
        y = 2.0 + self.b(y)
        y = F.relu(self.bn(self.c(y)) + 0.5)
        z = self.d(y)
        z = self.f(z + z) * 2.0
        u = self.e(z)
        return (u + y) * u


def test_adds_of_constants_are_not_unfused_residual_adds():
    r = check_qat_model(_qat(ConstantAdds().eval()), X, verbose=False)
    assert [(u["nodes"], u["reason"]) for u in r.unfused] == [
        (["e", "add_4"], "the output of 'e' is used 2 times (add_4, mul_1)")]
    # the float model: conv+bn is not fused yet, but no add of a constant is part of a pattern
    r = check_qat_model(ConstantAdds().eval(), X, verbose=False)
    assert {u["nodes"][0]: u["nodes"] for u in r.unfused} == {"c": ["c", "bn"], "e": ["e", "add_4"]}


class BufferAdd(nn.Module):
    """conv + a broadcast buffer: a constant operand (lowered as such), no residual add."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("offset", torch.randn(1, 3, 1, 1))

    def forward(self, x):
        return self.conv(x) + self.offset


def test_add_of_a_buffer_is_not_an_unfused_residual_add():
    for model in (BufferAdd().eval(), _qat(BufferAdd().eval())):
        assert check_qat_model(model, X, verbose=False).unfused == []


class DefaultedArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x, mask=None, *, relu=True):
        y = self.bn(self.conv(x))
        if mask is not None:
            y = y * mask
        return F.relu(y) if relu else y


def test_float_model_traced_with_the_defaults_example_inputs_leave_out():
    r = check_qat_model(DefaultedArgs().eval(), X, verbose=False)
    assert r.call_counts == {"conv": 1, "bn": 1}
    assert [u["nodes"] for u in r.unfused] == [["conv", "bn", "relu"]]
    # a mask given is an input: the graph multiplies by it before the ReLU
    r = check_qat_model(DefaultedArgs().eval(), (X, torch.rand(1, 3, 8, 8)), verbose=False)
    assert [u["nodes"] for u in r.unfused] == [["conv", "bn"]]


def test_a_nash_compile_with_default_int16_layer_norm_prints_nothing(capsys):
    """nash makes layer_norm / softmax outputs int16 by default: the int8/int16 boundaries that follow
    are the compiler's own choice, so compile neither prints nor warns about them."""
    import qcompiler

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.fc2 = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(torch.softmax(self.ln(self.fc(x)), -1))

    x = torch.randn(2, 4, 16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cm = qcompiler.compile(Block().eval(), x, march="nash", progress=False)
    assert "qint16" in set(cm.activation_dtypes.values())
    assert capsys.readouterr().out == ""
    assert not [x for x in w if "model check" in str(x.message)]
