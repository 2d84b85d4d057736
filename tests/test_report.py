"""The HTML report of a QuantAnalysis and the `qcompiler report` command."""

import re

import torch

import qcompiler.zoo as zoo
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.tools import report as report_mod
from qcompiler.tools.cli import main
from qcompiler.tools.quant_analysis import QuantAnalysis, compute_metric


def _analysis(tmp_path):
    model = zoo.get("hybrid")
    x = (torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)
    cal = prepare_calibration_fx(model, None, example_inputs=x, hybrid=True, march="bayes")
    cal.eval()
    with torch.no_grad():
        cal(*x)
    fq = prepare_qat_fx(cal, hybrid=True)
    set_state(fq, "validation")
    fq.eval()
    qa = QuantAnalysis(model, fq, out_dir=tmp_path)
    qa.set_bad_case(x)
    qa.compare_per_layer()
    qa.sensitivity()
    return qa


def _section(html, sid):
    """The HTML of ``<section id=sid>``."""
    m = re.search(rf'<section id="{sid}">(.*?)</section>', html, re.S)
    assert m, f"no section {sid}"
    return m.group(1)


def test_report_is_self_contained(tmp_path):
    qa = _analysis(tmp_path)
    path = qa.report()
    html = path.read_text()
    assert path.name == "report.html"
    assert "<svg" in html
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html and "<link" not in html
    for row in qa.compare_rows:
        assert row["mod_name"] in html
    assert re.search(r'<tr class="worst">', html)


def test_report_falls_back_to_table_without_dot(tmp_path, monkeypatch):
    qa = _analysis(tmp_path)
    import graphviz

    def broken(self, *a, **k):
        raise graphviz.ExecutableNotFound(["dot"])

    monkeypatch.setattr(graphviz.Source, "pipe", broken)
    html = report_mod.write_report(qa, tmp_path / "r.html").read_text()
    graph = _section(html, "graph")
    assert "<svg" not in graph and "placement table" in graph and "conv2" in graph
    assert "http://" not in html and "https://" not in html
    assert html.count("<svg") == 2  # the charts do not need dot


def test_report_charts_follow_the_analysis(tmp_path):
    qa = _analysis(tmp_path)
    html = qa.report().read_text()
    assert re.findall(r'<section id="([\w-]+)">', html) == list(report_mod.REPORT_SECTIONS)
    # per-layer chart: one tick label per layer, in graph order (matplotlib writes SVG text as text)
    chart = _section(html, "layer-errors")
    assert chart.count("<svg") == 1 and 'class="chart-layer-errors"' in chart
    ticks = re.findall(r"<text[^>]*>([^<]*)</text>", chart)
    names = [report_mod._tail(r["mod_name"]) for r in qa.compare_rows]
    assert [t for t in ticks if t in names] == names
    # ... and the table's SQNR column is the metric of each layer's recorded outputs
    sqnr = report_mod.layer_sqnr(qa)
    assert len(sqnr) == len(qa.compare_rows)
    assert abs(sqnr[1] - compute_metric("SQNR", qa.layers[1]["base"], qa.layers[1]["analy"])) < 1e-12
    table = _section(html, "layer-table")
    assert f"<td>{sqnr[1]:.4g}</td>" in table
    # sensitivity chart: a bar label per quantizer, most sensitive first
    chart = _section(html, "sensitivity")
    labels = [t for t in re.findall(r"<text[^>]*>([^<]*)</text>", chart) if re.fullmatch(r"\S+ \(\w+\)", t)]
    assert labels == [f"{r[0]} ({r[1]})" for r in qa.sensitive_ops][:len(labels)] and len(labels) >= 5
    # no int16 advice asked for: the section says how to get it, no chart
    advice = _section(html, "int16-advice")
    assert "suggest_int16" in advice and "<svg" not in advice


def test_report_shows_int16_advice_with_its_gain(tmp_path):
    qa = _analysis(tmp_path)
    _, baseline = qa.suggest_int16(target_sqnr=-1e9)  # all int8 already meets it: nothing to move
    assert qa.int16_advice["steps"] == [] and qa.int16_advice["baseline_sqnr"] == baseline
    assert "nothing needs int16" in _section(report_mod.write_report(qa, tmp_path / "a.html").read_text(),
                                             "int16-advice")
    names, reached = qa.suggest_int16(target_sqnr=baseline + 2.0)
    adv = qa.int16_advice
    assert names == adv["quantizers"] and len(names) == len(adv["steps"]) >= 1
    assert reached == adv["reached_sqnr"] >= baseline + 2.0 and adv["met"]
    assert abs(adv["gain"] - (reached - baseline)) < 1e-9
    html = qa.report().read_text()
    section = _section(html, "int16-advice")
    assert f"{baseline:.2f} dB &rarr; {reached:.2f} dB" in section
    assert f"predicted gain <b>{reached - baseline:+.2f} dB</b>" in section
    assert 'class="chart-int16"' in section and all(q in section for q in names)
    text = qa.int16_advice_text()
    assert f"predicted gain {reached - baseline:+.2f} dB" in text and text.count("\n") == 1 + len(names)


def test_cli_report_end_to_end(tmp_path, capsys):
    out = tmp_path / "rep"
    rc = main(["report", "zoo:hybrid", "--input-shape", "1,3,32,32", "--calib-random", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    for f in ("compare_per_layer_out.txt", "compare_per_layer_out.csv", "abnormal_layer_advisor.txt",
              "sensitive_ops.txt", "badcase.pt", "report.html"):
        assert (out / f).is_file(), f
    stdout = capsys.readouterr().out
    assert "layers compared" in stdout and "int16 advice: none (give --target-sqnr DB to get it)" in stdout


def test_cli_report_target_sqnr(tmp_path, capsys):
    out = tmp_path / "rep"
    argv = ["report", "zoo:hybrid", "--input-shape", "1,3,32,32", "--calib-random", "1", "--out", str(out)]
    assert main(argv + ["--target-sqnr", "49"]) == 0, capsys.readouterr().err
    stdout = capsys.readouterr().out
    m = re.search(r"int16 advice \(target output SQNR 49.00 dB\): all int8 ([\d.]+) dB; moving (\d+) quantizer\(s\) "
                  r"to int16 gives ([\d.]+) dB \(predicted gain \+([\d.]+) dB, meets the target\)", stdout)
    assert m, stdout
    base, n, reached, gain = float(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert reached >= 49 > base and abs(reached - base - gain) < 0.011 and n >= 1
    assert len(re.findall(r"^  \d+\. \S+ \(\S+\): [\d.]+ dB$", stdout, re.M)) == n
    assert f"predicted gain <b>+{gain:.2f} dB</b>" in (out / "report.html").read_text()
    # out of reach: the report is still written, with every step, and the CLI says so
    assert main(argv + ["--target-sqnr", "300"]) == 0
    captured = capsys.readouterr()
    assert "still misses the target" in captured.out and "below the target 300" in captured.err
    assert "still misses the target" in (out / "report.html").read_text()


def test_cli_report_errors(tmp_path, capsys):
    assert main(["report", "zoo:nope", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["report", "zoo:hybrid", "--calib-random", "0", "--out", str(tmp_path)]) == 2
