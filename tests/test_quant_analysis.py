"""QuantAnalysis: bad-case search, per-layer comparison, advisor, sensitivity, int16 suggestion, errors."""

import csv
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import train_mode_models as tm
from conftest import assert_untouched, snapshot

import qcompiler
import qcompiler.zoo as zoo
from qcompiler.errors import ConfigError
from qcompiler.quantization import convert_fx, prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.tools.quant_analysis import COMPARE_COLUMNS, QuantAnalysis, compute_metric

SHAPE = {"hybrid": (1, 3, 32, 32), "resnet18": (1, 3, 32, 32), "transformer_block": (1, 16, 64)}
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
    # data that does not fit the models: named, not a raw torch error
    wrong = [(torch.rand(1, 5, 16, 16),)]
    with pytest.raises(ConfigError, match=r"the baseline model \(HybridModel\) failed on the given inputs "
                                          r"\(\(1, 5, 16, 16\)\): RuntimeError"):
        qa.auto_find_bad_case(wrong)


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


# ----------------------------------------------------------------------------- analysis_model_type="compiled"

# The compiled runtime against the converted graph it was lowered from (tests/test_compile.py): BPU
# partitions are bit-exact, CPU islands run in onnxruntime in float, within 1e-5.  resnet18 at 32x32 is
# all BPU; hybrid has three CPU islands (PReLU, SELU).
RUNTIME_TOL = {"resnet18": 0.0, "hybrid": 1e-5}
COMPILED_FILES = ("compare_per_layer_out.txt", "compare_per_layer_out.csv", "abnormal_layer_advisor.txt")


@pytest.fixture(scope="module")
def compiled_pair(tmp_path_factory):
    """name -> the mis-scaled model compiled (mode="qat"), analysed as "compiled" (the CompiledModel) and as
    "quantized" (its converted graph), both with the fake-quant model; built once per name."""
    cache = {}

    def get(name):
        if name not in cache:
            model, fq = build(name)
            fq.get_submodule(MISSCALED[name]).activation_post_process.scale.mul_(1 / 20)
            data = batches(name)
            cm = qcompiler.compile(fq, data[0], mode="qat", progress=False)
            snaps = [snapshot(model), snapshot(fq), snapshot(cm.converted)]
            qas = {}
            for kind, analysed in (("compiled", cm), ("quantized", cm.converted)):
                qa = QuantAnalysis(model, analysed, kind, out_dir=tmp_path_factory.mktemp(f"{name}_{kind}"),
                                   fake_quant_model=fq)
                qa.auto_find_bad_case(data, metric="L1")
                qa.run()
                qa.compare_per_layer()
                qas[kind] = qa
            cache[name] = SimpleNamespace(name=name, model=model, fq=fq, cm=cm, data=data, snaps=snaps,
                                          c=qas["compiled"], q=qas["quantized"])
        return cache[name]

    return get


def check_untouched(p):
    for m, snap in zip((p.model, p.fq, p.cm.converted), p.snaps):
        assert_untouched(m, snap)


@pytest.mark.parametrize("name", ["hybrid", "resnet18"])
def test_compiled_bad_case_agrees_with_quantized(compiled_pair, name):
    p = compiled_pair(name)
    tol = RUNTIME_TOL[name]
    cpu_parts = [q["name"] for q in p.cm.partitions if q["placement"] == "cpu"]
    assert (len(cpu_parts) > 0) == (tol > 0), cpu_parts
    # the bad case is found on the runtime's outputs: argmax of L1(float, compiled), computed here independently
    with torch.no_grad():
        l1 = [compute_metric("L1", p.model(*b), p.cm(*b)) for b in p.data]
    best = max(range(len(l1)), key=l1.__getitem__)
    assert p.c.bad_case_index == p.q.bad_case_index == best
    assert torch.equal(p.c.bad_case[0], p.data[best][0])
    assert p.c.case_metrics == pytest.approx(l1, rel=0, abs=1e-12)
    # the runtime's metrics equal the converted graph's: exactly on an all-BPU model, within 1e-5 with islands
    assert len(p.c.case_metrics) == len(p.q.case_metrics) == len(p.data)
    for vc, vq in zip(p.c.case_metrics, p.q.case_metrics):
        assert abs(vc - vq) <= tol, (vc, vq)
    if tol == 0:
        assert p.c.case_metrics == p.q.case_metrics
    torch.testing.assert_close(p.c.analy_output, p.q.analy_output, rtol=tol, atol=tol)
    assert torch.equal(p.c.base_output, p.q.base_output)


@pytest.mark.parametrize("name", ["hybrid", "resnet18"])
def test_compiled_per_layer_identical_to_quantized(compiled_pair, name):
    p = compiled_pair(name)
    c, q = p.c, p.q
    # per-layer values are recorded on the CompiledModel's converted graph: the same numbers, the same files
    assert [r["mod_name"] for r in c.compare_rows] == [r["mod_name"] for r in q.compare_rows]
    assert len(c.layers) == len(q.layers) >= 10
    for lc, lq in zip(c.layers, q.layers):
        assert torch.equal(lc["analy"], lq["analy"]) and torch.equal(lc["base"], lq["base"]), lc["mod_name"]
    for f in COMPILED_FILES:
        assert (c.out_dir / f).read_text() == (q.out_dir / f).read_text(), f
    # ... and that graph is what the runtime runs: the last layer (the model output) matches cm's output
    out_node = next(n for n in p.cm.converted.graph.nodes if n.op == "output")
    assert c.layers[-1]["node"] == out_node.args[0].name
    torch.testing.assert_close(c.layers[-1]["analy"].float().reshape(-1),
                               p.cm(*c.bad_case).reshape(-1), rtol=RUNTIME_TOL[name], atol=RUNTIME_TOL[name])
    # the mis-scaled layer shows up in the compiled analysis like in the fake-quant one
    row = next(r for r in c.compare_rows if r["mod_name"] == MISSCALED[name])
    assert row["quant_dtype"] == "qint8" and row["qscale"] > 0 and row["max_qscale_diff"] > 8
    assert any(a["mod_name"] == MISSCALED[name] and a["kind"] == "saturation" for a in c.advice), c.advice
    assert "analysis model type: <b>compiled</b>" in c.report().read_text()
    check_untouched(p)


def test_compiled_sensitivity_matches_quantized_and_needs_fake_quant(compiled_pair, tmp_path):
    p = compiled_pair("hybrid")
    ranked = p.c.sensitivity()
    assert ranked == p.q.sensitivity()
    assert (ranked[0][0], ranked[0][1]) == (MISSCALED["hybrid"], "activation")
    assert ranked[0][3] > 2 * ranked[1][3]
    assert ((p.c.out_dir / "sensitive_ops.txt").read_text()
            == (p.q.out_dir / "sensitive_ops.txt").read_text())
    check_untouched(p)
    # a CompiledModel does not keep the prepared model: sensitivity/int16 say which argument to pass
    qa = QuantAnalysis(p.model, p.cm, "compiled", out_dir=tmp_path / "nofq")
    qa.set_bad_case(p.c.bad_case)
    msg = r"pass fake_quant_model=<the prepared model this compiled model came from>"
    with pytest.raises(ConfigError, match=msg):
        qa.sensitivity()
    with pytest.raises(ConfigError, match=msg):
        qa.suggest_int16(30.0)
    assert not (tmp_path / "nofq").exists()


# node names of layers the forward hooks on the float model cannot stand for: stubs and functions
NOT_A_FLOAT_MODULE = {
    "resnet18": {"x_activation_post_process", "flatten", "output_input_dequant"},
    "hybrid": {"prelu_input_dequant", "selu", "selu_activation_post_process", "conv1_prelu_input_dequant",
               "selu_1", "selu_1_activation_post_process", "selu_2_input_dequant", "selu_2"},
}


@pytest.mark.parametrize("name", ["hybrid", "resnet18"])
def test_compiled_without_fake_quant_model_compares_fused_layers_like_with_like(compiled_pair, name, tmp_path):
    """Without the fake-quant model (qcompiler.compile does not return it) the baseline layers come from
    forward hooks on the unfused float model; a fused conv+bn(+add)+relu must compare with the float
    relu's output, and a function node named like a module (hybrid: F.selu is node ``selu``, module
    ``selu`` runs last) must not compare with that module's output."""
    p = compiled_pair(name)
    qa = QuantAnalysis(p.model, p.cm, "compiled", out_dir=tmp_path)
    qa.set_bad_case(p.c.bad_case)
    rows = {r["mod_name"]: r for r in qa.compare_per_layer()}
    assert qa.baseline_source == "baseline module hooks"
    twin = {r["mod_name"]: r for r in p.c.compare_rows}  # baseline from the float twin (BN folded)
    assert set(rows) == set(twin) - NOT_A_FLOAT_MODULE[name]
    for k, r in rows.items():
        for col in ("base_min", "base_max", "base_mean"):
            assert r[col] == pytest.approx(twin[k][col], abs=1e-4), (k, col)
        assert r["Cosine"] == pytest.approx(twin[k]["Cosine"], abs=1e-4), k
        assert r["L1"] == pytest.approx(twin[k]["L1"], abs=1e-5), k
        assert r["analy_max"] == twin[k]["analy_max"], k  # same analysed graph
    if name == "resnet18":
        # conv1 = conv1+bn1+relu, layer1.0.conv2 = conv2+bn2+add+relu: post-ReLU baselines, close to the analysis
        for k in ("conv1", "layer1.0.conv2"):
            assert rows[k]["base_min"] >= 0 and rows[k]["Cosine"] > 0.98, rows[k]
    # the bad case gives the same verdict per layer as the twin: no abnormal finding on a layer the twin finds fine
    flagged = {(a["mod_name"], a["kind"]) for a in qa.advice}
    assert flagged <= {(a["mod_name"], a["kind"]) for a in p.c.advice}
    assert (MISSCALED[name], "saturation") in flagged


def test_compiled_wrong_model_type_is_a_config_error_naming_the_fix(compiled_pair, tmp_path):
    p = compiled_pair("hybrid")
    out = tmp_path / "never"
    for wrong in (p.cm.converted, p.fq):
        with pytest.raises(ConfigError, match=r"needs the CompiledModel returned by qcompiler\.compile, got "
                                              r"a GraphModule \(HybridModel\); for a GraphModule use analysis_model_type='quantized'"):
            QuantAnalysis(p.model, wrong, "compiled", out_dir=out)
    with pytest.raises(ConfigError, match=r"got Linear$"):
        QuantAnalysis(p.model, nn.Linear(3, 3), "compiled", out_dir=out)
    loaded = qcompiler.load(p.cm.save(tmp_path / "m.qc"))
    x = p.data[0]
    torch.testing.assert_close(loaded(*x), p.cm(*x), rtol=0, atol=0)  # a working model, just without a graph
    with pytest.raises(ConfigError, match=r"loaded from an artifact \(qcompiler\.load\) and has no graph to compare "
                                          r"layer by layer: analyse the model returned by qcompiler\.compile"):
        QuantAnalysis(p.model, loaded, "compiled", out_dir=out)
    with pytest.raises(ConfigError, match=r"got CompiledModel; for a CompiledModel use analysis_model_type='compiled'"):
        QuantAnalysis(p.model, p.cm, "quantized", out_dir=out)
    assert not out.exists()
    check_untouched(p)


# ----------------------------------------------------------------------------- models in train mode


def _analyse(baseline, analysed, kind, out_dir, data):
    qa = QuantAnalysis(baseline, analysed, kind, out_dir=out_dir)
    qa.auto_find_bad_case(data, metric="L1")
    qa.run()
    qa.compare_per_layer()
    if kind == "fake_quant":
        qa.sensitivity()
    return qa


def test_models_in_train_mode_are_evaluated_and_left_untouched(tmp_path):
    """A float model in train mode and a QAT model training (observers on) give the analysis of the
    eval-mode, validation-state models and are left as they were (BN statistics, scales, flags)."""
    fm, qat, q = tm.build()
    g = torch.Generator().manual_seed(2)
    data = [(torch.rand(2, 3, 8, 8, generator=g) * 3,) for _ in range(3)]  # beyond the calibrated range
    f_train, qat_train = tm.training(fm, qat)
    snaps = [snapshot(f_train), snapshot(qat_train)]
    for kind, eval_model, train_model in (("fake_quant", qat, qat_train), ("quantized", q, q)):
        ref = _analyse(fm, eval_model, kind, tmp_path / f"{kind}_ref", data)
        qa = _analyse(f_train, train_model, kind, tmp_path / kind, data)
        assert qa.case_metrics == ref.case_metrics and qa.bad_case_index == ref.bad_case_index
        assert torch.equal(qa.base_output, ref.base_output) and torch.equal(qa.analy_output, ref.analy_output)
        assert [r["mod_name"] for r in qa.compare_rows] == [r["mod_name"] for r in ref.compare_rows]
        assert {"bn0", "conv", "fc"} <= {r["mod_name"] for r in qa.compare_rows}
        for a, b in zip(qa.layers, ref.layers):
            assert torch.equal(a["base"], b["base"]) and torch.equal(a["analy"], b["analy"]), a["mod_name"]
        assert qa.sensitive_ops == ref.sensitive_ops
        assert_untouched(f_train, snaps[0])
        assert_untouched(qat_train, snaps[1])
    assert f_train.bn.training and int(qat_train.conv.activation_post_process.observer_enabled[0]) == 1


def test_train_mode_restored_when_a_run_fails(tmp_path):
    fm, qat, q = tm.build()
    f_train, qat_train = tm.training(fm, qat)
    snaps = [snapshot(f_train), snapshot(qat_train)]
    # the fake-quant model fails in run() (the float twin, a copy, ran first); the float model fails under
    # the hooks that record it when there is no fake-quant model
    for qa in (QuantAnalysis(f_train, qat_train, out_dir=tmp_path / "a"),
               QuantAnalysis(f_train, q, "quantized", out_dir=tmp_path / "b")):
        qa.set_bad_case(torch.rand(2, 5, 8, 8))
        with pytest.raises(RuntimeError, match="running_mean should contain 5 elements"):
            qa.run()
        assert_untouched(f_train, snaps[0])
        assert_untouched(qat_train, snaps[1])


def test_sensitivity_of_an_attention_block_measures_every_quantizer(tmp_path):
    """A softmax on the CPU feeds a BPU matmul: its quantizer on alone gave float64 values against the
    float32 ones of the quantizers left off, and the matmul failed (``qcompiler report zoo:transformer_block``)."""
    model, fq = build("transformer_block")
    qa = QuantAnalysis(model, fq, "fake_quant", out_dir=tmp_path)
    qa.set_bad_case(batches("transformer_block", n=1)[0])
    rows = qa.sensitivity()
    names = {r[0] for r in rows}
    assert "softmax_activation_post_process" in names  # the quantizer that failed alone
    assert all(math.isfinite(r[3]) for r in rows)


class _InPlaceAfterConv(nn.Module):
    """A conv whose output the model then changes in place (``y += 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.conv(x)
        y += 1.0
        return self.conv2(y)


def test_a_recorded_layer_output_is_not_changed_by_a_later_in_place_op(tmp_path):
    """The float baseline's layer outputs are recorded by hooks; the model's ``y += 1`` right after the conv
    must not change what was recorded for the conv (a detached view was kept: every value was off by 1)."""
    torch.manual_seed(0)
    m = _InPlaceAfterConv().eval()
    x = torch.randn(2, 3, 8, 8)
    cal = prepare_calibration_fx(m, example_inputs=(x,), hybrid=True)
    with torch.no_grad():
        for _ in range(4):
            cal(torch.randn(2, 3, 8, 8))
    qa = QuantAnalysis(m, convert_fx(cal), "quantized", out_dir=str(tmp_path))
    qa.set_bad_case(x)
    layers = {row["node"]: row for row in qa.run()}
    with torch.no_grad():
        want = m.conv(x).double()
    assert torch.equal(layers["conv"]["base"].reshape(want.shape).double(), want)


class _ScalesItsInput(nn.Module):
    """Scales its input in place after a conv read it."""

    def __init__(self) -> None:
        super().__init__()
        self.c0, self.c1 = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 1)

    def forward(self, x):
        p = self.c0(x)
        x.mul_(0.5)
        return p + self.c1(x)


def test_a_model_that_changes_its_input_in_place_is_analysed_on_the_bad_case_as_given(tmp_path):
    """The analysis runs several models on one stored bad case: each run gets its own copy (the first run
    halved the stored input for the others: the base output was 2.11 off the model's)."""
    torch.manual_seed(0)
    m = _ScalesItsInput().eval()
    x = torch.randn(2, 3, 8, 8)
    cal = prepare_calibration_fx(m, example_inputs=(x.clone(),), hybrid=True)
    with torch.no_grad():
        for _ in range(4):
            cal(torch.randn(2, 3, 8, 8))
    qa = QuantAnalysis(m, convert_fx(cal), "quantized", out_dir=str(tmp_path))
    qa.set_bad_case(x.clone())
    qa.run()
    with torch.no_grad():
        want = m(x.clone())
    assert torch.equal(qa.base_output, want)
