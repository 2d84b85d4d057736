"""The accuracy-debugging guide's quick start with our module names (issue 38).

The example (``QUICK_START``) is the guide's, translated: ``horizon_plugin_pytorch`` ->
``qcompiler``, ``hb4.export`` -> ``qcompiler.export`` (imported as ``hb4``), the profiler package
-> ``qcompiler.tools``; ``device_ids=None`` where the guide passes a GPU index (this machine has
none; a GPU index without a GPU is a ConfigError, tested below). It runs on nash
(``March.NASH_M``), writes the files the guide lists, and the one-call ``prepare`` with its
setters gives what the staged API gives for the equivalent qconfig_dict.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler import zoo
from qcompiler.errors import ConfigError
from qcompiler.march import March, get_march, set_march
from qcompiler.quantization import (
    FakeQuantizeBase,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.prepare_one_call import MODEL_CHECK, prepare
from qcompiler.quantization.qconfig_template import (
    default_calibration_qconfig_setter,
    default_qat_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
    sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter,
)
from qcompiler.tools import CompiledModelProfiler, HbirModelProfiler, ModelProfiler, QuantAnalysis
from qcompiler.tools.quant_analysis import resolve_device

QUICK_START = '''
from copy import deepcopy
import torch
from torch import nn
from torch.quantization import DeQuantStub, QuantStub
from qcompiler.march import March, set_march
from qcompiler.quantization.qconfig_template import (
    default_qat_qconfig_setter
)
from qcompiler.quantization import prepare
import qcompiler as hb4
from qcompiler.tools.model_check import check_qat_model
from qcompiler.tools import QuantAnalysis, ModelProfiler


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.relu = nn.ReLU()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        x = self.conv(x)
        x = self.relu(x)
        x = torch.nn.functional.interpolate(
            x, scale_factor=1.3, mode="bilinear", align_corners=False
        )
        x = self.dequant(x)
        return x


data = torch.rand((1, 3, 32, 32))
float_net = Net()
float_net(data)

set_march(March.NASH_M)
qat_net = prepare(float_net, data, default_qat_qconfig_setter)
check_qat_model(qat_net, data, save_results=True)
qat_net(data)
qat_hbir = hb4.export(qat_net, (data,))

qa = QuantAnalysis(
    baseline_model=float_net,
    analysis_model=qat_net,
    analysis_model_type="fake_quant",
    device_ids=None,
    out_dir="./floatvsqat",
)
qa.set_bad_case(data)
qa.run()
qa.compare_per_layer()
qa.sensitivity()

qa2 = QuantAnalysis(
    baseline_model=qat_net,
    analysis_model=qat_hbir,
    analysis_model_type="export",
    device_ids=None,
    out_dir="./qatvshbir",
)
qa2.set_bad_case(data)
qa2.run()
qa2.compare_per_layer()
'''

GUIDE_FILES = ["model_check_result.txt",
               "floatvsqat/compare_per_layer_out.txt", "floatvsqat/compare_per_layer_out.csv",
               "floatvsqat/abnormal_layer_advisor.txt", "floatvsqat/sensitive_ops.txt",
               "qatvshbir/compare_per_layer_out.txt", "qatvshbir/compare_per_layer_out.csv",
               "qatvshbir/abnormal_layer_advisor.txt"]


@pytest.fixture
def march_kept():
    before = get_march()
    yield
    set_march(before)


@pytest.fixture
def quick_start(tmp_path, monkeypatch, march_kept, capsys):
    """The namespace of the quick start, run as written in a fresh working directory (and what it printed)."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    ns: dict = {"__name__": "quick_start"}
    exec(compile(QUICK_START, "quick_start.py", "exec"), ns)
    ns["printed"] = capsys.readouterr().out
    return ns, tmp_path


def test_quick_start_runs_and_writes_the_guide_files(quick_start):
    ns, root = quick_start
    for rel in GUIDE_FILES:
        assert (root / rel).is_file() and (root / rel).stat().st_size > 0, rel
    assert get_march() is March.NASH and ns["qat_hbir"].march == "nash"
    # prepare printed its model check, and the explicit check_qat_model call printed again
    assert ns["printed"].count("check_qat_model: no anomalies found.") == 2
    # the guide's printed qconfig tables: int8 everywhere, per-channel int8 weights, no high-precision output
    check = ns["qat_net"].meta[MODEL_CHECK]
    out = {r["name"]: r for r in check.layer_qconfigs}
    assert out["quant"]["output_dtype"] == "qint8" and out["conv"]["output_dtype"] == "qint8"
    assert out["conv"]["observer"] == "MovingAverageMinMaxObserver" and out["conv"]["ch_axis"] == -1
    assert [(w["name"], w["dtype"], w["ch_axis"], w["observer"]) for w in check.weight_qconfigs] == [
        ("conv", "qint8", 0, "MovingAveragePerChannelMinMaxObserver")]
    text = (root / "model_check_result.txt").read_text()
    assert "Each layer out qconfig" in text and "Weight qconfig" in text
    # the per-layer table names the guide's layers; QAT vs exported shows the resize as the lossy one
    rows = ns["qa2"].compare_rows
    assert [r["mod_name"] for r in rows] == ["quant", "conv", "interpolate", "dequant"]
    assert rows[1]["Cosine"] == pytest.approx(1.0, abs=1e-6)  # conv: convert matches the fake quant
    assert "interpolate" in (root / "qatvshbir/abnormal_layer_advisor.txt").read_text()
    sens = ns["qa"].sensitive_ops
    assert {(r[0], r[1]) for r in sens} >= {("conv", "weight"), ("conv", "activation"), ("quant", "activation")}


def test_the_advisor_names_the_layer_a_broken_variant_breaks(quick_start):
    """The same example with the conv's output scale fixed 20x too small: the advisor names conv (clipping)."""
    ns, root = quick_start
    broken = ns["qat_net"]
    fq = broken.get_submodule("conv").activation_post_process
    fq.disable_observer()
    fq.set_qparams(fq.scale.detach() / 20)
    qa = QuantAnalysis(ns["float_net"], broken, "fake_quant", out_dir=root / "broken")
    qa.set_bad_case(ns["data"])
    qa.compare_per_layer()
    first = qa.advice[0]
    assert (first["mod_name"], first["kind"]) == ("conv", "saturation")
    healthy = (root / "floatvsqat/abnormal_layer_advisor.txt").read_text()
    assert "conv: saturation" not in healthy


def test_export_matches_compile_qat_layer_by_layer(quick_start, tmp_path):
    ns, _ = quick_start
    qat_net, data = ns["qat_net"], ns["data"]
    compiled = qcompiler.compile(qat_net, (data,), mode="qat")
    exported = ns["qat_hbir"]
    assert torch.equal(compiled(data), exported(data))
    tables = []
    for kind, model in (("compiled", compiled), ("export", exported)):
        qa = QuantAnalysis(qat_net, model, kind, out_dir=tmp_path / kind)
        qa.set_bad_case(data)
        tables.append(qa.compare_per_layer())
        assert (tmp_path / kind / "compare_per_layer_out.txt").is_file()
    assert tables[0] == tables[1] and len(tables[0]) == 4


def test_export_of_a_calibration_model_converts_at_the_calibrated_scales(march_kept):
    set_march("bayes")
    model, x = zoo.get("resnet18"), zoo.example_inputs("resnet18")
    calib = prepare(model, x, default_calibration_qconfig_setter, verbose=False)
    assert calib.meta[MODEL_CHECK] is not None
    calib.eval()
    with torch.no_grad():
        calib(*x)
    exported = qcompiler.export(calib, x)
    with torch.no_grad():
        ref = qcompiler.convert_fx(calib)(*x)
    assert torch.equal(exported(*x), ref)
    assert [n.name for n in exported.converted.graph.nodes] == [
        n.name for n in qcompiler.convert_fx(calib).graph.nodes]
    with pytest.raises(ConfigError, match="export takes a model from prepare"):
        qcompiler.export(model, x)


# ----------------------------------------------------------------------------- prepare + setters


def quantizer_summary(gm) -> list:
    """Every quantizer of a prepared model (path, class, dtype, ch_axis, observer) and each weight layer's
    output quantizer (None: high precision), with the generated code: what a qconfig decides."""
    rows = []
    for path, m in gm.named_modules():
        if isinstance(m, FakeQuantizeBase):
            obs = getattr(m, "activation_post_process", None)
            rows.append((path, type(m).__name__, str(m.dtype), m.ch_axis, type(obs).__name__))
        elif hasattr(m, "weight_fake_quant"):
            rows.append((path, "layer", getattr(m, "activation_post_process", None) is None))
    return [gm.code, rows]


def _leaves(x) -> list:
    return [t for v in x for t in _leaves(v)] if isinstance(x, (tuple, list)) else [x]


# model -> the layers whose result is a model output (the default setter's high-precision outputs)
OUTPUT_LAYERS = {"resnet18": ["fc"], "mobilenet_v2": ["classifier.1"], "unet": ["head"], "lstm_seq": ["fc"],
                 "transformer_block": [], "hybrid": []}


@pytest.mark.parametrize("name", sorted(OUTPUT_LAYERS))
def test_prepare_with_the_default_setter_equals_the_staged_api(name, march_kept):
    set_march("bayes")
    model, x = zoo.get(name), zoo.example_inputs(name)
    one_call = prepare(model, x, default_qat_qconfig_setter, verbose=False)
    qd = {"": get_default_qat_qconfig()}
    if OUTPUT_LAYERS[name]:
        qd["module_name"] = [(p, get_default_qat_out_qconfig()) for p in OUTPUT_LAYERS[name]]
    staged = prepare_qat_fx(model, qd, hybrid=True, example_inputs=x)
    assert one_call.meta[MODEL_CHECK] is not None
    assert quantizer_summary(one_call) == quantizer_summary(staged)
    assert default_qat_qconfig_setter(qcompiler.partition(model, x)).get("module_name", []) == qd.get(
        "module_name", [])
    with torch.no_grad():
        a, b = one_call.eval()(*x), staged.eval()(*x)
    a, b = _leaves(a), _leaves(b)
    assert len(a) == len(b) > 0 and all(torch.equal(u, v) for u, v in zip(a, b))


def test_calibration_setter_gives_the_staged_calibration_model(march_kept):
    set_march("bayes")
    model, x = zoo.get("resnet18"), zoo.example_inputs("resnet18")
    one_call = prepare(model, x, default_calibration_qconfig_setter, verbose=False)
    staged = prepare_calibration_fx(model, {"": get_default_calib_qconfig(), "module_name": [
        ("fc", qcompiler.quantization.get_default_calib_out_qconfig())]}, hybrid=True, example_inputs=x)
    assert one_call.meta[MODEL_CHECK] is not None
    assert quantizer_summary(one_call) == quantizer_summary(staged)
    assert not any(type(m).__name__ == "FakeQuantize" for m in one_call.modules())


def test_sensitive_op_setter_takes_the_sensitivity_table(quick_start):
    ns, _ = quick_start
    table = ns["qa"].sensitive_ops  # rows [op_name, sensitive_type, op_type, L1, dtype, flops, share]
    ranked = [r[0] for r in table if r[1] == "activation"]
    top = next(name for name in ranked if name in ("quant", "conv"))  # the first op with a module of its own
    root_scoped = ranked[:ranked.index(top)]  # graph-node quantizers of root-scope functions (the resize)
    setter = sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(table, topk=1)
    net, data = ns["float_net"], ns["data"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_call = prepare(net, data, setter, verbose=False)
    assert setter.chosen == [top] and setter.skipped == root_scoped
    assert any("root scope" in str(w.message) for w in caught) == bool(root_scoped)
    staged = prepare_qat_fx(net, {"": get_default_qat_qconfig(),
                                  "module_name": [(top, get_default_qat_qconfig("qint16"))]},
                            hybrid=True, example_inputs=data)
    assert quantizer_summary(one_call) == quantizer_summary(staged)
    assert str(one_call.get_submodule(f"{top}.activation_post_process").dtype) == "qint16"
    # a list of names, a ratio, and the budget 0 (nothing raised)
    assert sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(["conv", "quant"], ratio=0.5)(
        qcompiler.partition(net, data))["module_name"] == [("conv", get_default_qat_qconfig("qint16"))]
    assert "module_name" not in sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(["conv"], topk=0)(
        qcompiler.partition(net, data))


def test_sensitive_op_calibration_setter_gives_int16_observers(quick_start):
    ns, _ = quick_start
    setter = sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(["conv"])
    calib = prepare(ns["float_net"], ns["data"], setter, verbose=False)
    assert calib.meta[qcompiler.ir.meta.GM_KIND] == "calibration"
    apq = calib.get_submodule("conv.activation_post_process")
    assert type(apq).__name__ == "CalibFakeQuantize" and str(apq.dtype) == "qint16"
    assert str(calib.get_submodule("quant.activation_post_process").dtype) == "qint8"
    assert str(calib.get_submodule("conv").op.weight_fake_quant.dtype) == "qint8"  # 8-bit weights


def test_sensitive_op_setter_refusals(quick_start):
    ns, _ = quick_start
    net, data = ns["float_net"], ns["data"]
    graph = qcompiler.partition(net, data)
    with pytest.raises(ConfigError, match="no op left to raise to int16: interpolate_activation_post_process"):
        sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(["interpolate_activation_post_process"])(graph)
    with pytest.raises(ConfigError, match="'nope' names no module and no op"):
        sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(["nope"])(graph)
    with pytest.raises(ConfigError, match="ratio must be a fraction"):
        sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(["conv"], ratio=2)
    with pytest.raises(ConfigError, match="list of op names"):
        sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter("conv")
    with pytest.raises(ConfigError, match="has no int16"):
        sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(["conv"])(
            qcompiler.partition(net, data, march="bernoulli2"))


def test_prepare_refuses_a_dict_and_a_setter_returning_no_dict():
    net = nn.Sequential(nn.Conv2d(3, 3, 1))
    x = torch.rand(1, 3, 8, 8)
    with pytest.raises(ConfigError, match="not a qconfig_dict"):
        prepare(net, x, {"": get_default_qat_qconfig()})
    with pytest.raises(ConfigError, match="returned list"):
        prepare(net, x, lambda graph: [])
    with pytest.raises(ConfigError, match="example_inputs is required"):
        prepare(net, None)
    # a plain function is a setter; its kind is its qconfigs' kind
    calib = prepare(net, x, lambda graph: {"": get_default_calib_qconfig()}, verbose=False)
    assert calib.meta[MODEL_CHECK] is not None
    assert qcompiler.ir.meta.GM_KIND in calib.meta and calib.meta[qcompiler.ir.meta.GM_KIND] == "calibration"


def test_the_staged_module_is_also_the_one_call_prepare_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import torch, torch.nn as nn
        from qcompiler.quantization import prepare
        from qcompiler.quantization.prepare import prepare_qat_fx
        import qcompiler.quantization.prepare as staged
        assert staged is prepare and staged.prepare_qat_fx is prepare_qat_fx
        gm = prepare(nn.Sequential(nn.Conv2d(3, 3, 1)), torch.rand(1, 3, 4, 4), verbose=False)
        print(gm.meta["model_check"].has_anomalies)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


# ----------------------------------------------------------------------------- device_ids, post_process


def test_device_ids(monkeypatch, quick_start):
    ns, root = quick_start
    assert resolve_device(None) == resolve_device("cpu") == resolve_device([]) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device_ids=0 asks for GPU 0, but torch sees no GPU"):
        QuantAnalysis(ns["float_net"], ns["qat_net"], "fake_quant", device_ids=0, out_dir=root / "d")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(1) == resolve_device([1, 0]) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="torch sees 2 GPU"):
        resolve_device(5)
    with pytest.raises(ConfigError, match="runs its BPU programs in the simulator on the CPU"):
        resolve_device(0, "export")
    with pytest.raises(ConfigError, match="device_ids must be None"):
        resolve_device(True)


def test_post_process_applies_to_both_outputs_and_must_be_callable(quick_start):
    ns, root = quick_start
    seen = []

    def post(out):
        seen.append(tuple(out.shape))
        return out.mean(dim=(2, 3))

    qa = QuantAnalysis(ns["qat_net"], ns["qat_hbir"], "export", post_process=post, out_dir=root / "pp")
    qa.set_bad_case(ns["data"])
    qa.run()
    assert tuple(qa.base_output.shape) == tuple(qa.analy_output.shape) == (1, 3)
    assert seen == [(1, 3, 41, 41), (1, 3, 41, 41)]
    with pytest.raises(ConfigError, match="post_process must be a callable.*device_ids="):
        QuantAnalysis(ns["qat_net"], ns["qat_hbir"], "export", 0)


# ----------------------------------------------------------------------------- profiler of the exported model


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_compiled_model_profiler_gives_model_profiler_table_of_the_exported_graph(quick_start):
    ns, root = quick_start
    exported, data = ns["qat_hbir"], ns["data"]
    assert HbirModelProfiler is CompiledModelProfiler
    expected = exported(data)
    with CompiledModelProfiler(exported, str(root / "hbir_dir")) as p:
        out = exported(data)
    assert torch.equal(out, expected)
    assert not hasattr(exported.runtime, "_graph")  # the runtime is back
    table = p.get_info_manager().table()
    assert (root / "hbir_dir" / "statistic.txt").read_text() == table
    with ModelProfiler(exported.converted, str(root / "graph_dir")) as ref:
        with torch.no_grad():
            exported.converted(data.clone())
    assert _rows(table) == _rows(ref.get_info_manager().table())
    mods = [r.mod_name for r in p.get_info_manager().records if r.attr == "output"]
    assert "conv" in mods and "interpolate" in mods
    assert {r.dtype for r in p.get_info_manager().records if r.mod_name == "conv" and r.attr == "output"} == {"qint8"}
    with pytest.raises(ConfigError, match="for a torch model use ModelProfiler"):
        CompiledModelProfiler(ns["qat_net"], str(root / "x"))
    exported.save(root / "m.qc")
    with pytest.raises(ConfigError, match="loaded from an artifact"):
        CompiledModelProfiler(qcompiler.load(root / "m.qc"), str(root / "y"))
