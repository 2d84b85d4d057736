"""The HTML report of a QuantAnalysis and the `qcompiler report` command."""

import re

import torch

import qcompiler.zoo as zoo
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.tools import report as report_mod
from qcompiler.tools.cli import main
from qcompiler.tools.quant_analysis import QuantAnalysis


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
    assert "<svg" not in html and "placement table" in html and "conv2" in html
    assert "http://" not in html and "https://" not in html


def test_cli_report_end_to_end(tmp_path, capsys):
    out = tmp_path / "rep"
    rc = main(["report", "zoo:hybrid", "--input-shape", "1,3,32,32", "--calib-random", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    for f in ("compare_per_layer_out.txt", "compare_per_layer_out.csv", "abnormal_layer_advisor.txt",
              "sensitive_ops.txt", "badcase.pt", "report.html"):
        assert (out / f).is_file(), f
    assert "layers compared" in capsys.readouterr().out


def test_cli_report_errors(tmp_path, capsys):
    assert main(["report", "zoo:nope", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["report", "zoo:hybrid", "--calib-random", "0", "--out", str(tmp_path)]) == 2
