"""PTQ sensitivity (from the calibration model), QuantAnalysis.advise, --apply config files and their round trip."""

import json

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import ConfigError
from qcompiler.quantization import (
    convert_fx,
    get_default_calib_qconfig,
    prepare_calibration_fx,
    prepare_qat_fx,
    set_state,
)
from qcompiler.tools.cli import main
from qcompiler.tools.config_file import read_hybrid_file, read_qconfig_file
from qcompiler.tools.quant_analysis import QuantAnalysis


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        y = self.relu1(self.conv1(x))
        y = self.relu2(self.conv2(y))
        return self.fc(torch.flatten(self.pool(self.conv3(y)), 1))


def setup(broken=None, seed=0):
    """A calibrated model; ``broken``: that layer's minmax observer also 'saw' an outlier 60x its range."""
    torch.manual_seed(seed)
    m = Net().eval()
    g = torch.Generator().manual_seed(seed + 1)
    data = [torch.randn(4, 3, 10, 10, generator=g) for _ in range(3)]
    qc = {"": get_default_calib_qconfig()}
    if broken:
        qc["module_name"] = [(broken, get_default_calib_qconfig(observer="minmax"))]
    cal = prepare_calibration_fx(m, qc, example_inputs=(data[0][:1],), march="bayes")
    cal.eval()
    with torch.no_grad():
        for x in data:
            cal(x)
    if broken:
        obs = cal.get_submodule(f"{broken}.activation_post_process").activation_post_process
        obs.max_val.mul_(60)
    return m, cal, data


def test_sensitivity_and_suggest_int16_from_the_calibration_model(tmp_path):
    m, cal, data = setup()
    ptq = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path / "ptq")
    ptq.auto_find_bad_case(data, metric="SQNR")
    rows = ptq.sensitivity(metric="SQNR")
    # the same ranking and values as from the fake-quant model the user would build by hand
    fq = set_state(prepare_qat_fx(cal), "validation").eval()
    qat = QuantAnalysis(m, fq, "fake_quant", out_dir=tmp_path / "qat")
    qat.set_bad_case(ptq.bad_case)
    assert [r[:2] for r in rows] == [r[:2] for r in qat.sensitivity(metric="SQNR")]
    assert [r[3] for r in rows] == pytest.approx([r[3] for r in qat.sensitivity(metric="SQNR")], abs=1e-9)
    target = ptq.bad_case_metric + 1.0  # the bad case's SQNR of this (twin) model, + 1 dB
    names, reached = ptq.suggest_int16(target)
    assert names and reached >= target
    # converted model analysed with the calibration model as its fake-quant model
    q = QuantAnalysis(m, convert_fx(cal), "quantized", out_dir=tmp_path / "q", fake_quant_model=cal)
    q.set_bad_case(ptq.bad_case)
    assert [r[0] for r in q.sensitivity(metric="SQNR")] == [r[0] for r in rows]


@pytest.mark.parametrize("broken", ["conv2", "conv1"])
def test_advise_names_the_broken_layer_first_with_a_fix_that_repairs_it(tmp_path, broken):
    m, cal, data = setup(broken)
    qa = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path)
    qa.auto_find_bad_case(data, metric="SQNR")
    rows = qa.advise(top_k=2)
    assert rows[0]["layer"] == broken and rows[0]["rank"] == 1
    kinds = {f.kind for f in rows[0]["fixes"]}
    assert kinds == {"int16", "cpu", "observer"}
    best = rows[0]["best"]
    assert best.gain > 6.0  # a 60x too coarse scale: the fixes win back most of the lost bits
    assert rows[0]["fixes"] == sorted(rows[0]["fixes"], key=lambda f: -f.gain)
    text = (tmp_path / "root_cause.txt").read_text()
    assert text.splitlines()[1].startswith(f"  1. {broken} ")
    assert "dB" in text and "best:" in text
    # a healthy model's top layer gains far less from any fix
    m2, cal2, data2 = setup()
    healthy = QuantAnalysis(m2, cal2, "fake_quant", out_dir=tmp_path / "h")
    healthy.auto_find_bad_case(data2, metric="SQNR")
    assert healthy.advise(top_k=1)[0]["best"].gain < best.gain - 3.0


def test_apply_round_trip_through_the_config_files(tmp_path):
    m, cal, data = setup("conv2")
    qa = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path)
    qa.auto_find_bad_case(data, metric="SQNR")
    best = qa.advise(top_k=1)[0]["best"]
    path = qa.apply_advice(tmp_path / "fix.json")
    cfg = json.loads(path.read_text())
    qd, hd = read_qconfig_file(path), read_hybrid_file(path)
    if best.kind == "cpu":
        assert hd["module_name"] == ["conv2"] and cfg["qconfig"]["module_name"] == {}
    else:
        assert [n for n, _ in qd["module_name"]] == ["conv2"] and hd["module_name"] == []
    cm = qcompiler.compile(m, (data[0][:1],), march="bayes", qconfig_dict=qd, hybrid_dict=hd, calib_data=data,
                           progress=False)
    if best.kind == "int16":
        assert cm.activation_dtypes["conv2"] == "qint16"
    elif best.kind == "cpu":
        assert "conv2" not in cm.activation_dtypes


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"),
    ('{"qconfig": {"modules": {}}}', "unknown key 'modules'"),
    ('{"module_name": {"conv2": {"dtype": "qint4"}}}', r"\['module_name'\]\['conv2'\]\['dtype'\]"),
    ('{"module_name": {"conv2": {"observer": "best"}}}', "'best' is not one of"),
    ('{"module_name": {"conv2": {"bits": 16}}}', "unknown field 'bits'"),
    ('[1]', "must hold a JSON object"),
])
def test_qconfig_file_errors_name_the_file_and_key(tmp_path, text, match):
    p = tmp_path / "q.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        read_qconfig_file(p)
    assert str(p) in str(e.value)


def test_hybrid_file_errors(tmp_path):
    p = tmp_path / "h.json"
    p.write_text('{"hybrid": {"module_name": "conv2"}}')
    with pytest.raises(ConfigError, match=r"h.json: \['module_name'\] must be a list of strings"):
        read_hybrid_file(p)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_hybrid_file(tmp_path / "missing.json")


def test_cli_report_apply_then_compile_with_the_file(capsys, tmp_path):
    fix = tmp_path / "fix.json"
    code = main(["report", "zoo:hybrid", "--march", "bayes", "--calib-random", "2", "--advise", "2",
                 "--apply", str(fix), "--out", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "root cause on the bad case" in out and "best:" in out and f"fixes written to {fix}" in out
    cfg = json.loads(fix.read_text())
    assert set(cfg) == {"qconfig", "hybrid"}
    html = (tmp_path / "rep" / "report.html").read_text()
    first = out.split("root cause on the bad case")[1].splitlines()[1].split()[1]  # "  1. <layer> (..."
    assert "Root cause: fixes for the worst layers" in html and f'<td class="l nw">{first}</td>' in html
    code = main(["compile", "zoo:hybrid", "--march", "bayes", "--calib-random", "2", "--qconfig", str(fix),
                 "--hybrid", str(fix), "--int16-budget", "0.2", "--out", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "int16: " in out and " BPU activation tensors" in out
    table = (tmp_path / "c" / "model.table.txt").read_text()
    assert cfg["hybrid"]["module_name"] or cfg["qconfig"]["module_name"]  # the advice proposes something
    for name in cfg["hybrid"]["module_name"]:
        assert f'hybrid_dict module_name "{name}"' in table
    bad = tmp_path / "bad.json"
    bad.write_text('{"qconfig": {"module_name": {"nope": {"dtype": "qint16"}}}}')
    code = main(["compile", "zoo:hybrid", "--march", "bayes", "--calib-random", "1", "--qconfig", str(bad),
                 "--out", str(tmp_path / "c2")])
    out, err = capsys.readouterr()
    assert code != 0 and "'nope'" in err and "Traceback" not in err


def test_uncalibrated_calibration_model_says_to_calibrate(tmp_path):
    m, _, data = setup()
    cal = prepare_calibration_fx(m, example_inputs=(data[0][:1],), march="bayes")
    qa = QuantAnalysis(m, convert_fx(setup()[1]), "quantized", out_dir=tmp_path, fake_quant_model=cal)
    qa.set_bad_case(data[0])
    with pytest.raises(ConfigError, match="no calibrated FakeQuantize; run calibration batches"):
        qa.sensitivity()
    with pytest.raises(ConfigError, match="advise: top_k must be a positive int"):
        qa.advise(top_k=0)
    with pytest.raises(ConfigError, match="call advise"):
        qa.apply_advice(tmp_path / "f.json")


# ----------------------------------------------------------------------------- issue 35: advice that holds


def _outlier_setup():
    """conv2 with a weight outlier (8.0 at one tap of every filter, the rest ~0.1): its per-channel int8
    weight scale crushes every other tap to zero. Returns the model and normal data."""
    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():
        m.conv2.weight[:, 0, 1, 1] = 8.0
    g = torch.Generator().manual_seed(1)
    return m, [torch.randn(4, 3, 10, 10, generator=g) for _ in range(3)]


def _output_sqnr(m, cm, data):
    from qcompiler.tools.quant_analysis import compute_metric
    with torch.no_grad():
        ref = torch.cat([m(x) for x in data])
        got = torch.cat([torch.as_tensor(cm(x)) for x in data])
    return compute_metric("SQNR", ref, got)


def test_broken_layer_is_named_and_applying_the_written_file_gains(tmp_path):
    m, data = _outlier_setup()
    cal = prepare_calibration_fx(m, example_inputs=(data[0][:1],), march="bayes")
    cal.eval()
    with torch.no_grad():
        for x in data:
            cal(x)
    qa = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path)
    qa.auto_find_bad_case(data, metric="SQNR")
    named = [r for r in qa.advise(top_k=1) if r["fixes"]]
    assert named[0]["layer"] == "conv2" and named[0]["best"].gain > 3.0
    path = qa.apply_advice(tmp_path / "fix.json")
    assert path is not None and "conv2" in path.read_text()
    before = qcompiler.compile(m, (data[0][:1],), march="bayes", calib_data=data, progress=False)
    fixed = qcompiler.compile(m, (data[0][:1],), march="bayes", qconfig_dict=read_qconfig_file(path),
                              hybrid_dict=read_hybrid_file(path), calib_data=data, progress=False)
    s0, s1 = _output_sqnr(m, before, data), _output_sqnr(m, fixed, data)
    assert s1 > s0 + 3.0, (s0, s1)  # the compiled model gains what the advice measured, roughly


class RootOps(nn.Module):
    """A cat in the root module's own forward: no module_name entry can name its output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], 1))


def test_unnameable_tensor_gets_the_true_reason_and_no_empty_fix_file(tmp_path):
    torch.manual_seed(0)
    m = RootOps().eval()
    data = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    cal = prepare_calibration_fx(m, example_inputs=(data[0][:1],), march="bayes")
    cal.eval()
    with torch.no_grad():
        for x in data:
            cal(x)
    qa = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path)
    qa.auto_find_bad_case(data, metric="SQNR")
    rows = qa.advise(top_k=1)
    text = qa.fix_advice_text()
    assert "add a QuantStub module" not in text and "(the model input)" not in text
    assert rows[0]["layer"] == "cat_activation_post_process" and not rows[0]["fixes"]
    assert "'cat' (cat) is computed in the root module's forward" in rows[0]["why_no_fix"]
    assert "no config fix: 'cat' (cat)" in text
    # unnameable layers do not use up top_k: one layer a config entry names is advised
    assert sum(1 for r in rows if r["fixes"]) == 1
    for r in rows:
        r["fixes"] = [f for f in r["fixes"] if f.gain <= 0]  # pretend nothing gains
        r["best"] = r["fixes"][0] if r["fixes"] else None
    assert qa.apply_advice(tmp_path / "none.json") is None and not (tmp_path / "none.json").exists()
    html = qa.report().read_text()
    section = html[html.index('id="root-cause"'):]
    section = section[:section.index("</section>")]
    assert "Nothing found" in section and "<table" not in section


def test_root_cause_html_without_any_fix_says_nothing_found():
    from qcompiler.tools.report import _root_cause_section
    rows = [{"rank": 1, "layer": "cat", "fixes": [], "base_sqnr": 20.0, "why_no_fix": "computed in the root"}]
    html = "\n".join(_root_cause_section(rows))
    assert "Nothing found" in html and "<table" not in html and "computed in the root" in html


def test_error_jump_blames_the_layer_that_adds_the_error_not_a_float_op_after_it():
    import torch.fx as fx
    from types import SimpleNamespace
    from qcompiler.tools.report import error_jump

    def f(x):
        a = torch.relu(x)
        return torch.div(a, 2.0)

    gm = fx.symbolic_trace(f)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    analysis = SimpleNamespace(analysis_graph=gm, layers=[{"node": n} for n in names])
    assert error_jump(analysis, [20.0, 19.5]) == 0  # div only carries relu's error: relu is blamed
    assert error_jump(analysis, [40.0, 10.0]) == 1  # div adds most of the error itself
    assert error_jump(analysis, [float("nan"), float("nan")]) is None


def test_saturation_advice_is_qualified_by_what_the_clipping_costs():
    from types import SimpleNamespace
    qs = 0.01
    limit = qs * 127
    g = torch.Generator().manual_seed(0)
    a = torch.rand(1000, generator=g, dtype=torch.float64) * limit
    slight = a.clone()
    slight[:300] = limit * 1.02  # 30% clipped, each by 2%: costs little
    gross = a.clone()
    gross[:300] = limit * 10  # 30% clipped by 10x
    for b, cheap in ((slight, True), (gross, False)):
        layer = {"base": b, "analy": b.clamp(-limit, limit)}
        row = {"index": 0, "mod_name": "softmax", "qscale": qs, "quant_dtype": "qint8", "max_qscale_diff": None,
               "Cosine": 1.0}
        advice = QuantAnalysis._advise(SimpleNamespace(layers=[layer]), [row])
        sat = [x for x in advice if x["kind"] == "saturation"]
        assert len(sat) == 1
        assert ("costs little" in sat[0]["message"]) is cheap
        assert ("int16" in sat[0]["suggestion"]) is not cheap or "int16 advice" in sat[0]["suggestion"]
        assert ("no change needed" in sat[0]["suggestion"]) is cheap


class Attention(nn.Module):
    """One attention head; ``sm`` is a module so a qconfig entry can name the softmax."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x):
        a = self.sm(torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) * 0.25)
        return self.o(torch.matmul(a, self.v(x)))


def _attention_setup(loud: float):
    """nash attention with its softmax forced to int8 (histogram-mse); ``loud``: one token per batch that
    much louder, whose rare attention peaks the MSE scale clips."""
    torch.manual_seed(0)
    m = Attention().eval()
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(4):
        x = torch.randn(4, 64, 16, generator=g)
        x[i, 3] *= loud
        data.append(x)
    qc = {"": get_default_calib_qconfig(), "module_name": [("sm", get_default_calib_qconfig(dtype="qint8"))]}
    cal = prepare_calibration_fx(m, qc, example_inputs=(data[0][:1],), march="nash")
    cal.eval()
    with torch.no_grad():
        for x in data:
            cal(x)
    return m, data, qc, cal


def test_a_functional_op_row_carries_its_output_quantizer_not_its_input_one(tmp_path):
    m, data, _, cal = _attention_setup(loud=1.0)
    qa = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path)
    qa.auto_find_bad_case(data, metric="SQNR")
    rows = {r["mod_name"]: r for r in qa.compare_per_layer()}
    for op in ("matmul", "mul", "sm", "matmul_1"):  # each is quantized by <op>_activation_post_process after it
        q = rows[f"{op}_activation_post_process"]
        assert (rows[op]["quant_dtype"], rows[op]["qscale"]) == (q["quant_dtype"], q["qscale"]), op
    assert rows["sm"]["quant_dtype"] == "qint8"  # the user's int8, not nash's int16 default for softmax
    assert rows["transpose"]["qscale"] == rows["k"]["qscale"]  # a layout op carries its input's grid
    # no finding on the softmax from a scale that is not its own (its range is used in full, nothing clipped)
    assert not [a for a in qa.advice if a["mod_name"].startswith("sm")
                and a["kind"] in ("saturation", "scale_too_large")], qa.advice


def test_a_saturating_softmax_is_named_and_applying_the_written_file_gains(tmp_path):
    m, data, qc, cal = _attention_setup(loud=6.0)
    q = cal.get_submodule("sm_activation_post_process")
    with torch.no_grad():
        peak = max(float(m.sm(torch.matmul(m.q(x), m.k(x).transpose(-1, -2)) * 0.25).max()) for x in data)
    assert float(q.calculate_qparams()[0]) * 127 < 0.9 * peak  # the MSE scale clips the loud token's peaks
    qa = QuantAnalysis(m, cal, "fake_quant", out_dir=tmp_path)
    qa.auto_find_bad_case(data, metric="SQNR")
    first = [r for r in qa.advise(top_k=2) if r["fixes"]][0]
    assert first["layer"] == "sm" and first["best"].gain > 2.0, first
    assert (first["best"].kind, first["best"].observer) in (("observer", "minmax"), ("int16", ""))
    path = qa.apply_advice(tmp_path / "fix.json")
    written = json.loads(path.read_text())
    assert "sm" in written["qconfig"]["module_name"]
    for r in qa.fix_advice:  # a fix that gains less than MIN_FIX_GAIN is not written
        if r["best"] is not None and r["best"].gain < 0.1:
            assert r["layer"] not in written["qconfig"]["module_name"] and r["layer"] not in written["hybrid"]["module_name"]
    before = qcompiler.compile(m, (data[0][:1],), march="nash", qconfig_dict=qc, calib_data=data, progress=False)
    fixed = qcompiler.compile(m, (data[0][:1],), march="nash", qconfig_dict=read_qconfig_file(path),
                              hybrid_dict=read_hybrid_file(path), calib_data=data, progress=False)
    s0, s1 = _output_sqnr(m, before, data), _output_sqnr(m, fixed, data)
    assert s1 > s0 + 2.0, (s0, s1)
