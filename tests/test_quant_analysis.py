"""QuantAnalysis: bad-case search, per-layer comparison, advisor, sensitivity, int16 suggestion, errors."""

import csv

import pytest
import torch
import torch.nn as nn

import qcompiler.zoo as zoo
from qcompiler.errors import ConfigError
from qcompiler.quantization import convert_fx, prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.tools.quant_analysis import COMPARE_COLUMNS, QuantAnalysis, compute_metric

SHAPE = {"hybrid": (1, 3, 32, 32), "resnet18": (1, 3, 32, 32)}
MISSCALED = {"hybrid": "conv2", "resnet18": "layer2.0.conv1"}


def build(name, seed=0):
    model = zoo.get(name)
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(SHAPE[name], generator=g),)
    cal = prepare_calibration_fx(model, None, example_inputs=x, hybrid=True, march="bayes")
    cal.eval()
    with torch.no_grad():
        for _ in range(3):
            cal(torch.rand((2,) + SHAPE[name][1:], generator=g))
    fq = prepare_qat_fx(cal, hybrid=True)
    set_state(fq, "validation")
    fq.eval()
    return model, fq


def batches(name, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(SHAPE[name], generator=g) * (1 + 0.3 * (i % 3)),) for i in range(n)]


@pytest.fixture(scope="module", params=["hybrid", "resnet18"])
def misscaled(request, tmp_path_factory):
    name = request.param
    model, fq = build(name)
    fq.get_submodule(MISSCALED[name]).activation_post_process.scale.mul_(1 / 20)
    qa = QuantAnalysis(model, fq, "fake_quant", out_dir=tmp_path_factory.mktemp(name))
    data = batches(name)
    qa.auto_find_bad_case(data, metric="L1")
    qa.run()
    qa.compare_per_layer()
    qa.sensitivity()
    return name, model, fq, qa, data


def test_bad_case_is_argmax_l1(misscaled):
    name, model, fq, qa, data = misscaled
    with torch.no_grad():
        l1 = [compute_metric("L1", model(*b), fq(*b)) for b in data]
    best = max(range(len(l1)), key=l1.__getitem__)
    assert qa.bad_case_index == best
    assert torch.equal(qa.bad_case[0], data[best][0])
    assert (qa.out_dir / "badcase.pt").is_file()
    loaded = qa.load_bad_case()
    assert torch.equal(loaded[0], data[best][0])


def test_compare_per_layer_files(misscaled):
    name, _, _, qa, _ = misscaled
    csv_path = qa.out_dir / "compare_per_layer_out.csv"
    with open(csv_path) as f:
        header = next(csv.reader(f))
    assert header == list(COMPARE_COLUMNS)
    txt = (qa.out_dir / "compare_per_layer_out.txt").read_text()
    assert all(c in txt for c in COMPARE_COLUMNS)
    assert MISSCALED[name] in txt


def test_misscaled_layer_ranked_first_and_flagged(misscaled):
    name, _, _, qa, _ = misscaled
    top = qa.sensitive_ops[0]
    assert (top[0], top[1]) == (MISSCALED[name], "activation")
    assert top[3] > 2 * qa.sensitive_ops[1][3]
    assert (qa.out_dir / "sensitive_ops.txt").read_text().splitlines()[2].startswith(MISSCALED[name])
    flagged = [a for a in qa.advice if a["mod_name"] == MISSCALED[name] and a["kind"] == "saturation"]
    assert flagged, qa.advice
    assert "clipping" in (qa.out_dir / "abnormal_layer_advisor.txt").read_text()


def test_suggest_int16_fixes_misscaled_layer_with_one_op(misscaled):
    name, model, fq, qa, data = misscaled
    x = data[0]  # inside the calibrated input range: only the mis-scaled layer needs int16
    with torch.no_grad():
        assert compute_metric("SQNR", model(*x), fq(*x)) < 20.0
    names, sqnr = qa.suggest_int16(20.0, data=x)
    assert names == [f"{MISSCALED[name]}.activation_post_process"]
    assert sqnr >= 20.0
    # checked again independently
    m16 = qa._int16_model(names, x)
    with torch.no_grad():
        assert compute_metric("SQNR", model(*x), m16(*x)) >= 20.0


def test_quantized_model_and_sensitivity_needs_fake_quant(tmp_path):
    model, fq = build("hybrid")
    q = convert_fx(fq)
    x = batches("hybrid", 1)[0]
    qa = QuantAnalysis(model, q, "quantized", out_dir=tmp_path)
    qa.set_bad_case(x)
    rows = qa.compare_per_layer()
    conv = next(r for r in rows if r["mod_name"] == "conv2")
    assert conv["quant_dtype"] == "qint8" and conv["qscale"] > 0 and conv["Cosine"] > 0.99
    with pytest.raises(ConfigError, match="fake_quant_model"):
        qa.sensitivity()
    qa2 = QuantAnalysis(model, q, "quantized", out_dir=tmp_path / "b", fake_quant_model=fq)
    qa2.set_bad_case(x)
    assert qa2.sensitivity()


def test_custom_metric_order(tmp_path):
    model, fq = build("hybrid")
    data = batches("hybrid")
    qa = QuantAnalysis(model, fq, out_dir=tmp_path)
    res = qa.auto_find_bad_case(data, custom_metric_func=lambda b, a: float(b.mean()),
                                custom_metric_order_seq="ascending")
    with torch.no_grad():
        means = [float(model(*b).mean()) for b in data]
    assert res["index"] == min(range(4), key=means.__getitem__)


def test_errors(tmp_path):
    model, fq = build("hybrid")
    qa = QuantAnalysis(model, fq, out_dir=tmp_path / "e")
    with pytest.raises(ConfigError, match="L1, COSINE, ATOL, SQNR"):
        qa.auto_find_bad_case(batches("hybrid"), metric="L2")
    with pytest.raises(ConfigError, match="no data"):
        qa.auto_find_bad_case([])
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())
    with pytest.raises(ConfigError, match="bad case"):
        qa.run()
    with pytest.raises(ConfigError, match="no layer in common"):
        QuantAnalysis(nn.Sequential(nn.Conv2d(3, 3, 1)), fq, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="analysis_model_type"):
        QuantAnalysis(model, fq, "onnx")


def test_clean_removes_files(tmp_path):
    model, fq = build("hybrid")
    qa = QuantAnalysis(model, fq, out_dir=tmp_path / "c")
    qa.auto_find_bad_case(batches("hybrid", 2))
    qa.compare_per_layer()
    qa.sensitivity()
    qa.report()
    assert len(list((tmp_path / "c").iterdir())) == 6
    qa.clean()
    assert not (tmp_path / "c").exists()
