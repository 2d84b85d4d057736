"""report.html rendered by a real browser: headless Chromium over the DevTools protocol (one launch).

Checks what a reader sees at 1400 px: every section and chart is there and has a size,
the graph shows the BPU<->CPU boundary edges, nothing runs off the right edge, the shape
column stays on one line, and the console stays clean. The full-page screenshot is kept in
``$QC_TEST_ARTIFACTS`` (default ``out/test-artifacts``) as ``report.png``, next to the page.
Skips, saying why, when no Chromium is installed (``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from headless_chromium import Chromium, find_chromium

from qcompiler import zoo
from qcompiler.ir.partitions import boundary_edges
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.tools.quant_analysis import QuantAnalysis
from qcompiler.tools.report import REPORT_SECTIONS

WIDTH = 1400
ROOT = Path(__file__).resolve().parent.parent
CHARTS = ("chart-layer-errors", "chart-sensitivity", "chart-int16")

PAGE_FACTS = """JSON.stringify((() => {
  const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.right, r.width, r.height]; };
  const q = s => [...document.querySelectorAll(s)];
  return {
    scrollWidth: document.documentElement.scrollWidth,
    innerWidth: window.innerWidth,
    sections: q("section").map(s => [s.id, s.offsetHeight]),
    charts: Object.fromEntries(q("svg[class^=chart-]").map(s => [s.getAttribute("class"), box(s)])),
    graphSvg: q("#graph svg").map(box),
    redEdges: q("#graph g.edge path[stroke=red]").length,
    tableRight: Math.max(...q("table").filter(t => t.offsetParent).map(t => box(t)[1])),
    shapeCells: q("#layer-table td.nw").map(td => [td.getBoundingClientRect().height,
                                                   parseFloat(getComputedStyle(td).lineHeight) ||
                                                   parseFloat(getComputedStyle(td).fontSize) * 1.2]),
    wordBreaks: q("#layer-table td.name").filter(td => td.scrollWidth > td.clientWidth).length,
  };
})())"""


def _artifact_dir() -> Path:
    out = Path(os.environ.get("QC_TEST_ARTIFACTS", ROOT / "out" / "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The report of the hybrid guide model (BPU and CPU partitions) with sensitivity and int16 advice."""
    out = tmp_path_factory.mktemp("report")
    model = zoo.get("hybrid")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(1, 3, 32, 32, generator=g),) for _ in range(2)]
    hybrid_dict = {"module_name": ["conv1.conv", "conv3"]}
    cal = prepare_calibration_fx(model, None, hybrid=True, hybrid_dict=hybrid_dict, example_inputs=batches[0],
                                 march="bayes")
    cal.eval()
    with torch.no_grad():
        for b in batches:
            cal(*b)
    fq = prepare_qat_fx(cal, None, hybrid=True, hybrid_dict=hybrid_dict)
    set_state(fq, "validation")
    fq.eval()
    qa = QuantAnalysis(model, convert_fx(fq), "quantized", out_dir=out, fake_quant_model=fq)
    qa.auto_find_bad_case(batches)
    qa.compare_per_layer()
    qa.sensitivity()
    from_int8 = qa.suggest_int16(target_sqnr=-1e9)[1]
    qa.suggest_int16(target_sqnr=from_int8 + 3.0)
    return qa, qa.report()


@pytest.fixture(scope="module")
def chromium():
    """The browser binary; skips (before any work) saying why when there is none."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium on PATH (chromium, chromium-browser, google-chrome; or set QC_CHROMIUM): "
                    "bash scripts/setup.sh installs it with apt-get install chromium")
    return binary


def test_report_renders_in_chromium(chromium, report):
    binary = chromium
    qa, page = report
    artifacts = _artifact_dir()
    kept = shutil.copy(page, artifacts / "report.html")
    with Chromium(binary, width=WIDTH, height=1000) as browser:
        browser.open(Path(kept).resolve().as_uri())
        facts = json.loads(browser.evaluate(PAGE_FACTS))
        shot = browser.screenshot(artifacts / "report.png")
        problems = browser.problems()
        # the probes can fail: an over-wide element shows in scrollWidth, a console error is caught
        probe = browser.evaluate("(() => { const d = document.createElement('div'); d.style.width = '2000px';"
                                 " d.style.height = '1px'; document.body.appendChild(d);"
                                 " const w = document.documentElement.scrollWidth; d.remove();"
                                 " console.error('probe error'); return w; })()")
        caught = browser.problems()
    print(f"\nreport screenshot: {shot}\nreport page: {kept}")

    assert problems == []
    assert probe > WIDTH and caught == ["console.error: probe error"]
    assert [sid for sid, _ in facts["sections"]] == list(REPORT_SECTIONS)
    assert all(height > 40 for _, height in facts["sections"]), facts["sections"]
    for chart in CHARTS:
        left, right, width, height = facts["charts"][chart]
        assert width > 0.8 * (WIDTH - 120) and height > 150 and right <= WIDTH, (chart, facts["charts"][chart])
    assert len(facts["graphSvg"]) == 1 and facts["graphSvg"][0][3] > 200
    # the hybrid model's five BPU<->CPU edges are drawn red, one path each
    assert facts["redEdges"] == len(boundary_edges(qa.analysis_graph)) == 5
    # fits 1400 px: no horizontal scrolling, no table past the right edge
    assert facts["innerWidth"] == WIDTH and facts["scrollWidth"] <= WIDTH, facts
    assert facts["tableRight"] <= WIDTH
    # every shape cell is one line high; names break only after their dots, never overflow their cell
    assert facts["shapeCells"] and all(h < 2 * line for h, line in facts["shapeCells"]), facts["shapeCells"]
    assert facts["wordBreaks"] == 0
    assert shot.stat().st_size > 50_000


GRAPH_FACTS = """JSON.stringify((() => {
  const g = document.querySelector("#graph .graph"), svg = g.querySelector("svg"), r = svg.getBoundingClientRect();
  return {left: r.left, right: r.right, height: r.height, boxHeight: g.clientHeight, scroll: g.scrollHeight,
          scrollX: g.scrollWidth - g.clientWidth, legend: [...svg.querySelectorAll("#legend text")].map(t => t.textContent)};
})())"""


def test_report_graph_fits_1280_px_unclipped_with_its_legend(chromium, report):
    """The graph sat in a 1100 px scroll box; now all of it shows, within the page width."""
    from qcompiler.ir.dump import SVG_LEGEND

    _, page = report
    html = Path(page).read_text()
    assert SVG_LEGEND in html  # golden text of the legend group, inside the inline SVG
    with Chromium(chromium, width=1280, height=900) as browser:
        browser.open(Path(page).resolve().as_uri())
        facts = json.loads(browser.evaluate(GRAPH_FACTS))
        assert browser.problems() == []
    assert 0 <= facts["left"] and facts["right"] <= 1280, facts
    assert facts["height"] > 1100 and facts["scroll"] <= facts["boxHeight"] + 1 and facts["scrollX"] <= 0, facts
    assert facts["legend"] == ["BPU op", "CPU op", "quant / dequant stub", "BPU<->CPU boundary edge"]
