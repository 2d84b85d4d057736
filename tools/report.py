"""One self-contained HTML report of a :class:`~qcompiler.tools.quant_analysis.QuantAnalysis`.

No external URL, script or stylesheet: inline CSS, the partitioned graph as
inline SVG (rendered with graphviz's ``dot``; a placement table instead when
``dot`` is missing), the per-layer error table with the worst rows coloured,
the advisor findings and the sensitivity ranking when computed.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any, Union

import torch.fx as fx

from qcompiler.atomic_write import write_file
from qcompiler.ir.dump import partition_table, to_dot
from qcompiler.tools.metrics import COMPARE_COLUMNS, compute_metric

__all__ = ["write_report", "graph_svg"]

WORST_ROWS = 5
_CSS = """
body{font-family:sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:0.5em 0}
th,td{border:1px solid #bbb;padding:2px 6px;text-align:right}
th{background:#eee} td.l{text-align:left}
tr.worst{background:#ffc9c9} tr.bad{background:#ffe8cc}
.graph svg{max-width:100%;height:auto}
.bpu{background:#cfe2ff} .cpu{background:#ffe0b2}
pre{background:#f6f6f6;padding:0.5em;white-space:pre-wrap}
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _num(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return _e(v)


def _strip_urls(svg: str) -> str:
    """graphviz puts the SVG namespace/DTD URLs in; they are identifiers, but drop them anyway."""
    svg = re.sub(r"<\?xml[^>]*\?>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg, flags=re.S)
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", svg)
    return svg.replace("<svg", '<svg role="img"', 1)


def graph_svg(gm: fx.GraphModule) -> tuple[str, bool]:
    """``(html, True)``: inline SVG of ``to_dot(gm)``; ``(table html, False)`` when ``dot`` is unavailable."""
    try:
        import graphviz

        svg = graphviz.Source(to_dot(gm)).pipe(format="svg").decode("utf-8")
        return _strip_urls(svg), True
    except Exception:  # dot missing or failing: fall back to a table
        rows = partition_table(gm)
        cols = list(rows[0].keys()) if rows else []
        out = ["<table><tr>" + "".join(f"<th>{_e(c)}</th>" for c in cols) + "</tr>"]
        for r in rows:
            cls = str(r.get("placement", ""))
            out.append(f'<tr class="{_e(cls)}">' + "".join(f'<td class="l">{_e(r[c])}</td>' for c in cols) + "</tr>")
        out.append("</table>")
        return "\n".join(out), False


def write_report(analysis, path: Union[str, Path]) -> Path:
    """Write the HTML report of ``analysis`` (runs compare_per_layer first if needed) to ``path``."""
    if not analysis.compare_rows:
        analysis.compare_per_layer()
    rows = analysis.compare_rows
    finite = [(r["Cosine"], r["index"]) for r in rows if not math.isnan(r["Cosine"])]
    worst = {i for _, i in sorted(finite)[:WORST_ROWS]}
    flagged = {a["index"] for a in analysis.advice}
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>qcompiler quant analysis</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Quantization analysis</h1>",
        f"<p>analysis model type: <b>{_e(analysis.analysis_model_type)}</b>; layers compared: {len(rows)}; "
        f"per-layer baseline: {_e(getattr(analysis, 'baseline_source', ''))}; "
        f"bad case index: {_e(analysis.bad_case_index)}</p>",
    ]
    if getattr(analysis, "base_output", None) is not None:
        parts.append("<p>model output: " + ", ".join(
            f"{m} {_num(compute_metric(m, analysis.base_output, analysis.analy_output))}"
            for m in ("COSINE", "L1", "ATOL", "SQNR")) + "</p>")
    gm = analysis.analysis_graph
    graph_html, is_svg = graph_svg(gm)
    parts.append("<h2>Partitioned graph</h2>")
    parts.append("<p>blue: BPU, orange: CPU, yellow: boundary stubs</p>" if is_svg
                 else "<p>(graphviz 'dot' not available: placement table instead of the drawing)</p>")
    parts.append(f'<div class="graph">{graph_html}</div>')
    parts.append(f"<h2>Per-layer errors</h2><p>red: the {WORST_ROWS} lowest cosines; orange: advisor findings</p>")
    parts.append("<table><tr>" + "".join(f"<th>{_e(c)}</th>" for c in COMPARE_COLUMNS) + "</tr>")
    for r in rows:
        cls = "worst" if r["index"] in worst else ("bad" if r["index"] in flagged else "")
        cells = []
        for c in COMPARE_COLUMNS:
            left = c in ("mod_name", "base_op_type", "analy_op_type", "shape", "quant_dtype")
            attr = ' class="l"' if left else ""
            cells.append(f"<td{attr}>{_num(r[c])}</td>")
        parts.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>")
    parts.append("</table>")
    parts.append("<h2>Abnormal layer advisor</h2>")
    if analysis.advice:
        parts.append("<table><tr><th>index</th><th>layer</th><th>kind</th><th>finding</th><th>suggestion</th></tr>")
        for a in analysis.advice:
            parts.append(f'<tr><td>{a["index"]}</td><td class="l">{_e(a["mod_name"])}</td><td class="l">{_e(a["kind"])}'
                         f'</td><td class="l">{_e(a["message"])}</td><td class="l">{_e(a["suggestion"])}</td></tr>')
        parts.append("</table>")
    else:
        parts.append("<p>No abnormal layer found.</p>")
    if analysis.sensitive_ops:
        metric = getattr(analysis, "sensitivity_metric", "metric")
        parts.append(f"<h2>Sensitivity ({_e(metric)}, most sensitive first)</h2>")
        parts.append(f"<table><tr><th>op_name</th><th>type</th><th>op_type</th><th>{_e(metric)}</th>"
                     "<th>quant_dtype</th><th>flops</th></tr>")
        for r in analysis.sensitive_ops:
            parts.append(f'<tr><td class="l">{_e(r[0])}</td><td class="l">{_e(r[1])}</td><td class="l">{_e(r[2])}</td>'
                         f"<td>{_num(r[3])}</td><td>{_e(r[4])}</td><td>{r[5]} ({r[6]:.2%})</td></tr>")
        parts.append("</table>")
    sugg = getattr(analysis, "int16_suggestion", None)
    if sugg:
        parts.append(f"<p>int16 suggestion: {_e(', '.join(sugg[0]))} -> output SQNR {_num(sugg[1])} dB</p>")
    parts.append("</body></html>\n")
    p = Path(path)
    write_file(p, "\n".join(parts).encode("utf-8"), "report")
    return p
