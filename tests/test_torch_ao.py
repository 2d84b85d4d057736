"""Models annotated for torch.ao: qconfig attributes, QConfigMapping, torch.ao stubs and FloatFunctional."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.ao.nn.quantized as nnq
import torch.ao.quantization as taq
import torch.nn as nn

import qcompiler
from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.ir.meta import META_PLACEMENT, META_REASON
from qcompiler.quantization import (
    FakeQuantize,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_calibration_fx,
    prepare_qat_fx,
)
from qcompiler.quantization.qconfig import parse_qconfig_dict
from qcompiler.quantization.torch_ao import translate

MARCHES = ("bayes", "bernoulli2")
X = torch.rand(2, 3, 10, 10)


class Annotated(nn.Module):
    """As torch's quantization tests build them: stubs, a root qconfig, one submodule left float."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = taq.QuantStub(), taq.DeQuantStub()
        self.c1 = nn.Conv2d(3, 4, 3)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.c3 = nn.Conv2d(4, 4, 1)
        self.ff = nnq.FloatFunctional()
        self.c2.qconfig = None  # torch.ao: not quantized
        self.qconfig = taq.get_default_qconfig("x86")

    def forward(self, x):
        x = self.quant(x)
        y = torch.relu(self.c1(x))
        return self.dequant(self.c3(self.ff.add(self.c2(y), self.c3(y)[:, :, 1:-1, 1:-1])))


def _sqnr(ref, got):
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def _compile(model, march, **kw):
    calib = [torch.rand(2, 3, 10, 10, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = qcompiler.compile(model, (X,), march=march, calib_data=calib, progress=False, **kw)
    ours = [w for w in caught if issubclass(w.category, QCompilerWarning) and "torch.ao" in str(w.message)]
    return cm, ours


@pytest.mark.parametrize("march", MARCHES)
def test_an_annotated_model_compiles_with_one_warning(march):
    torch.manual_seed(0)
    model = Annotated().eval()
    cm, warned = _compile(model, march)
    assert len(warned) == 1
    text = str(warned[0].message)
    assert text.startswith(f"torch.ao QConfigs translated to the {march} scheme (symmetric, zero point 0)")
    assert ("the root model.qconfig: torch.ao QConfig(HistogramObserver): HistogramObserver -> histogram-mse; "
            "quint8 per_tensor_affine -> qint8 symmetric, zero point 0; reduce_range dropped") in text
    c2 = next(n for n in cm.converted.graph.nodes if n.name == "c2")
    assert c2.meta[META_PLACEMENT] == "cpu"
    assert c2.meta[META_REASON] == "module 'c2'.qconfig is None (not quantized): the op stays float on the CPU"
    c1 = next(n for n in cm.converted.graph.nodes if n.name == "c1")
    assert c1.meta[META_PLACEMENT] == "bpu"
    with torch.no_grad():
        assert _sqnr(model(X), cm(X)) > 25  # int8 activations and weights around a float conv


def test_the_translation_follows_the_kind():
    qc = taq.get_default_qconfig("x86")
    cal = parse_qconfig_dict({"": qc}, nn.Conv2d(1, 1, 1), kind="calibration")
    assert cal.global_qconfig == get_default_calib_qconfig(observer="histogram-mse")
    qat = parse_qconfig_dict({"": taq.get_default_qat_qconfig("x86")}, nn.Conv2d(1, 1, 1), kind="qat")
    assert qat.global_qconfig == get_default_qat_qconfig()
    minmax = taq.QConfig(activation=taq.MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
                         weight=taq.default_per_channel_weight_observer)
    t = translate(minmax, "x")
    assert (t.observer, t.dtype, t.changes) == ("minmax", "qint8", ("MinMaxObserver -> minmax",))
    wide = taq.QConfig(activation=taq.MinMaxObserver.with_args(dtype=torch.qint32, quant_min=-32768,
                                                                quant_max=32767),
                       weight=taq.default_weight_observer)
    t = translate(wide, "x")
    assert t.dtype == "qint16"
    assert "weight MinMaxObserver (qint8, per_tensor_symmetric) -> qint8 symmetric per output channel" in t.changes


def test_a_dynamic_qconfig_keeps_the_op_float_on_the_cpu():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(256, 5)).eval()
    qconfig_dict = {"": get_default_calib_qconfig(), "module_name": [("2", taq.default_dynamic_qconfig)]}
    with pytest.warns(QCompilerWarning, match=r"PlaceholderObserver \(dynamic / float\): not a BPU scheme"):
        cal = prepare_calibration_fx(model, qconfig_dict, hybrid=True, example_inputs=(X,))
    lin = next(n for n in cal.graph.nodes if n.name == "_2")
    assert lin.meta[META_PLACEMENT] == "cpu"
    assert lin.meta[META_REASON].startswith("qconfig_dict['module_name'] '2' is torch.ao QConfig(PlaceholderObserver)")


def test_a_qconfig_mapping_stands_for_the_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    mapping = (taq.QConfigMapping().set_global(taq.get_default_qconfig("x86"))
               .set_object_type(torch.add, taq.get_default_qconfig("x86"))
               .set_module_name("2", None))
    with pytest.warns(QCompilerWarning) as rec:
        cal = prepare_calibration_fx(model, mapping, hybrid=True, example_inputs=(X,))
    text = "\n".join(str(w.message) for w in rec if "torch.ao" in str(w.message))
    assert "QConfigMapping object_type 'add' (a function: use the module that calls it): no qconfig_dict form" in text
    placed = {n.name: n.meta.get(META_PLACEMENT) for n in cal.graph.nodes}
    assert placed["_0"] == "bpu" and placed["_2"] == "cpu"
    cal(X)
    q = convert_fx(cal)
    assert torch.isfinite(q(X)).all()


def test_qat_from_a_torch_ao_qat_qconfig():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).train()
    qat = prepare_qat_fx(model, {"": taq.get_default_qat_qconfig("x86")}, hybrid=True, example_inputs=(X,))
    fqs = [m for m in qat.modules() if type(m) is FakeQuantize]
    assert fqs and all(fq.dtype == "qint8" for fq in fqs)


def test_a_broken_torch_ao_factory_names_where():
    def boom():
        raise RuntimeError("no observer today")

    bad = taq.QConfig(activation=boom, weight=taq.default_weight_observer)
    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    with pytest.raises(ConfigError, match=r"qconfig_dict\[''\].activation: the torch.ao observer factory .* failed "
                                          r"\(RuntimeError: no observer today\)"):
        prepare_calibration_fx(model, {"": bad}, hybrid=True, example_inputs=(X,))


def test_the_model_keeps_its_torch_ao_attributes():
    model = Annotated().eval()
    qc = model.qconfig
    _compile(model, "bayes")
    assert model.qconfig is qc and model.c2.qconfig is None
