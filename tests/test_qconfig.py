"""QConfig factories, validation, qconfig_dict parsing and the resolver's priorities."""

import pickle

import pytest
import torch
import torch.nn as nn

from qcompiler.errors import ConfigError
from qcompiler.ir import trace
from qcompiler.ir.meta import ScopeEntry, scope
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qcompiler.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from qcompiler.quantization.qconfig import (
    QConfig,
    QConfigResolver,
    get_default_calib_out_qconfig,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    parse_qconfig_dict,
)


def test_calib_qconfig_factories():
    qc = get_default_calib_qconfig()
    assert qc.kind == "calibration" and qc.dtype == "qint8" and not qc.out_high_precision
    a, b = qc.activation(), qc.activation()
    assert a is not b  # fresh module per call
    assert isinstance(a, CalibFakeQuantize) and isinstance(a.activation_post_process, HistogramObserver)
    assert a.activation_post_process.method == "mse"
    w = qc.weight()
    assert isinstance(w, CalibFakeQuantize) and type(w.activation_post_process) is PerChannelMinMaxObserver
    assert w.ch_axis == 0
    x = torch.randn(3, 4)
    assert w(x) is x  # weights in calibration only record
    m = get_default_calib_qconfig("qint16", observer="minmax").activation()
    assert type(m.activation_post_process) is MinMaxObserver and m.dtype == "qint16"
    assert get_default_calib_qconfig(observer="kl").activation().activation_post_process.method == "kl"


def test_qat_qconfig_factories():
    qc = get_default_qat_qconfig(dtype="qint16", weight_dtype="qint8")
    assert qc.kind == "qat" and (qc.dtype, qc.weight_dtype) == ("qint16", "qint8")
    a = qc.activation()
    assert isinstance(a, FakeQuantize) and type(a.activation_post_process) is MovingAverageMinMaxObserver
    assert (a.dtype, a.quant_min, a.quant_max, a.ch_axis) == ("qint16", -32768, 32767, -1)
    w = qc.weight()
    assert type(w.activation_post_process) is MovingAveragePerChannelMinMaxObserver
    assert (w.dtype, w.ch_axis, w.qscheme) == ("qint8", 0, torch.per_channel_symmetric)
    w.ch_axis = 1  # a ConvTranspose weight
    assert w.activation_post_process.ch_axis == 1
    assert get_default_qat_qconfig() == get_default_qat_qconfig()  # comparable, picklable
    assert pickle.loads(pickle.dumps(qc)) == qc
    assert "MovingAverageMinMaxObserver" in repr(qc) and " at 0x" not in repr(qc)


def test_out_qconfigs():
    for qc, kind in ((get_default_qat_out_qconfig(), "qat"), (get_default_calib_out_qconfig(), "calibration")):
        assert qc.out_high_precision and qc.activation is None and qc.kind == kind
        assert qc.weight() is not None
    assert isinstance(get_default_qat_out_qconfig().weight(), FakeQuantize)
    assert get_default_qat_out_qconfig(weight_dtype="qint16").weight().dtype == "qint16"


def test_validation_errors():
    with pytest.raises(ConfigError, match="'qint8', 'qint16'"):
        get_default_qat_qconfig(dtype="int4")
    with pytest.raises(ConfigError, match="weight_dtype.*'qint8', 'qint16'"):
        get_default_qat_qconfig(weight_dtype="qint32")
    with pytest.raises(ConfigError, match="allowed: 'minmax', 'percentile', 'histogram-mse', 'kl'"):
        get_default_calib_qconfig(observer="mse")
    with pytest.raises(ConfigError, match="'calibration', 'qat'"):
        QConfig(kind="ptq")
    with pytest.raises(ConfigError, match="activation=None"):
        QConfig(activation=MinMaxObserver, out_high_precision=True)
    with pytest.raises(ConfigError, match="factory"):
        QConfig(activation=MinMaxObserver())
    with pytest.raises(AttributeError):
        get_default_qat_qconfig().dtype = "qint16"  # frozen


# ---------------------------------------------------------------------------
# qconfig_dict


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.act = nn.ReLU()

    def forward(self, x):
        return torch.sigmoid(self.act(self.conv(x)))  # functional sigmoid inside the block


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(2, 2, 1)
        self.block1 = Block()
        self.block2 = Block()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        x = self.block2(self.block1(self.conv0(x)))
        return self.fc(torch.relu(x).mean((2, 3)))


G = get_default_qat_qconfig()
T = get_default_qat_qconfig(dtype="qint16")
N = get_default_qat_out_qconfig()
A = get_default_calib_qconfig()


def node_qconfigs(model, resolver):
    gm = trace(model)
    mods = dict(gm.named_modules())
    return {n.name: resolver.for_scope(scope(n), mods.get(n.target) if n.op == "call_module" else None)
            for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")}


def test_priority_global_type_name_attribute():
    model = Net()
    r = parse_qconfig_dict({"": G}, model)
    got = node_qconfigs(model, r)
    assert set(map(id, got.values())) == {id(G)}

    # module_type beats global
    r = parse_qconfig_dict({"": G, "module_type": [(nn.Conv2d, T)]}, model)
    got = node_qconfigs(model, r)
    assert got["conv0"] is T and got["block1_conv"] is T and got["fc"] is G and got["block1_act"] is G

    # module_name beats module_type; a name covers its submodules and functionals
    r = parse_qconfig_dict({"": G, "module_type": [(nn.Conv2d, T)], "module_name": [("block1", N)]}, model)
    got = node_qconfigs(model, r)
    assert got["block1_conv"] is N and got["block1_act"] is N and got["sigmoid"] is N
    assert got["block2_conv"] is T and got["sigmoid_1"] is G and got["conv0"] is T

    # innermost name wins
    r = parse_qconfig_dict({"": G, "module_name": [("block1", N), ("block1.conv", T)]}, model)
    got = node_qconfigs(model, r)
    assert got["block1_conv"] is T and got["block1_act"] is N

    # a module.qconfig attribute beats everything; the innermost attribute wins
    model.block1.qconfig = A
    model.block1.act.qconfig = None  # explicit None: not quantized
    got = node_qconfigs(model, r)
    assert got["block1_conv"] is A and got["sigmoid"] is A and got["block1_act"] is None
    assert got["block2_conv"] is G


def test_functional_inherits_enclosing_module_type():
    model = Net()
    r = parse_qconfig_dict({"module_type": [(Block, T)]}, model)
    got = node_qconfigs(model, r)
    assert got["sigmoid"] is T and got["sigmoid_1"] is T and got["block1_conv"] is T
    assert got["conv0"] is None and got["relu"] is None and got["fc"] is None


def test_root_qconfig_attribute_acts_as_global():
    model = Net()
    model.qconfig = A
    r = parse_qconfig_dict({"": G, "module_name": [("fc", N)]}, model)
    assert r.for_module_name("fc") is N
    assert r.for_module_name("conv0") is A  # root attribute overrides "" ...
    assert r.for_module_name("") is A


def test_subclass_and_dotted_type_and_scope_helpers():
    class MyConv(nn.Conv2d):
        pass

    model = Net()
    model.conv0 = MyConv(2, 2, 1)
    r = parse_qconfig_dict({"module_type": [("torch.nn.Conv2d", T), (MyConv, N)]}, model)
    assert r.for_module_name("conv0") is N  # exact class first
    assert r.for_module_name("block1.conv") is T
    assert r.scope_of("block1.conv") == (
        ScopeEntry("", Net), ScopeEntry("block1", Block), ScopeEntry("block1.conv", nn.Conv2d))
    # an inserted stub's scope (path not in the model) falls back to the global qconfig
    r = parse_qconfig_dict({"": G}, model)
    assert r.for_scope((ScopeEntry("", Net), ScopeEntry("x_activation_post_process", MinMaxObserver))) is G


def test_empty_and_none_dicts():
    model = Net()
    assert parse_qconfig_dict(None, model).for_module_name("conv0") is None
    assert isinstance(parse_qconfig_dict({}, model), QConfigResolver)


@pytest.mark.parametrize("bad, match", [
    ({"module_types": []}, r"unknown key 'module_types'; allowed: '', 'module_type', 'module_name'"),
    ({"object_type": []}, "allowed"),
    ([("", G)], "must be a dict"),
    ({"": "qat"}, r"qconfig_dict\[''\] must be a qcompiler QConfig or None"),
    ({"module_name": ("conv0", G)}, "single pair"),
    ({"module_name": {"conv0": G}}, "list of"),
    ({"module_name": [("conv0",)]}, "entry 0"),
    ({"module_name": [("conv0", get_default_qat_qconfig)]}, r"\[0\]\[1\] must be a qcompiler QConfig"),
    ({"module_name": [("block1.cnv", G)]}, "Did you mean 'block1.conv'"),
    ({"module_name": [("fc", G), ("fc", N)]}, "listed twice"),
    ({"module_type": [(nn.Conv2d, G), (nn.Conv2d, N)]}, "listed twice"),
    ({"module_type": [(int, G)]}, "not an nn.Module"),
    ({"module_type": [("torch.nn.Conv9d", G)]}, "cannot import"),
])
def test_qconfig_dict_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        parse_qconfig_dict(bad, Net())


def test_torch_ao_qconfig_is_translated_and_garbage_rejected():
    import torch.ao.quantization as taq

    r = parse_qconfig_dict({"": taq.get_default_qat_qconfig()}, Net())  # tests/test_torch_ao.py has the rest
    assert r.global_qconfig == get_default_qat_qconfig()
    assert "qconfig_dict['']" in r.translated
    model = Net()
    model.conv0.qconfig = "bad"
    r = parse_qconfig_dict({"": G}, model)
    with pytest.raises(ConfigError, match="module 'conv0'.qconfig"):
        r.for_module_name("conv0")
