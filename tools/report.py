"""One self-contained HTML report of a :class:`~qcompiler.tools.quant_analysis.QuantAnalysis`.

What a reader looks at first comes first: the model-output metrics, a per-layer error
chart along the graph order (SQNR in dB, points coloured by the layer's quantized dtype),
the sensitivity ranking as a bar chart, the int16 advice of ``suggest_int16`` with its
predicted gain, and the partitioned graph coloured by placement with the BPU<->CPU
boundary edges in red. The full tables follow (they fit a 1400 px window: short
numbers, no wrapping shape column; the CSV has every digit).

No external URL, script or stylesheet: inline CSS; the charts are drawn by matplotlib
(its object API, no pyplot: the Agg/SVG canvases, never a GUI backend) and the graph by
graphviz's ``dot``, both inlined as SVG (a placement table instead when ``dot`` is missing).
"""

from __future__ import annotations

import html
import io
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import matplotlib
import torch.fx as fx
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from qcompiler.atomic_write import write_file
from qcompiler.ir.dump import partition_table, to_dot, with_legend
from qcompiler.ir.meta import BPU, CPU
from qcompiler.ir.partitions import op_counts
from qcompiler.tools.metrics import compute_metric
from qcompiler.tools.root_cause import MIN_FIX_GAIN

__all__ = ["write_report", "graph_svg", "layer_sqnr", "REPORT_SECTIONS"]

WORST_ROWS = 5
SENSITIVITY_BARS = 25       # most sensitive quantizers drawn in the bar chart
SQNR_CAP = 80.0             # dB; an exact layer (infinite SQNR) is drawn at the cap
REPORT_SECTIONS = ("overview", "layer-errors", "sensitivity", "int16-advice", "root-cause", "graph", "layer-table",
                   "advisor")
"""``id`` of every section, in page order (the browser test checks them)."""

# one colour per quantized dtype of a layer output, and per placement
DTYPE_COLORS = {"qint8": "#1f5fbf", "qint16": "#2e9e44", "qint32": "#7a3fbf"}
FLOAT_COLOR = "#c26a00"
CPU_BAND = "#ffe9cc"
ADVICE_COLOR = "#d62728"

_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2430;background:#f4f6f9}
main{max-width:1360px;margin:0 auto;padding:20px 24px}
h1{font-size:24px;margin:4px 0 2px} h2{font-size:18px;margin:0 0 8px}
.sub{color:#5b6573;margin:0 0 14px;font-size:13px}
section{background:#fff;border:1px solid #dde2ea;border-radius:8px;padding:14px 18px;margin:0 0 16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#f4f6f9;border-radius:6px;padding:8px 14px;min-width:130px}
.card b{display:block;font-size:20px} .card span{font-size:12px;color:#5b6573}
.chart svg{width:100%;height:auto;display:block}
.graph{border:1px solid #eef0f4;border-radius:6px}
.graph svg{max-width:100%;height:auto;display:block;margin:0 auto}
.legend span{display:inline-block;padding:1px 8px;margin-right:6px;border-radius:4px;font-size:12px}
table{border-collapse:collapse;font-size:12px;margin:6px 0;max-width:100%}
th,td{border-bottom:1px solid #e3e7ee;padding:3px 7px;text-align:right;vertical-align:top}
th{background:#eef1f6;position:sticky;top:0}
td.l,th.l{text-align:left} td.nw{white-space:nowrap} td.name{max-width:320px}
tr.worst{background:#ffd9d9} tr.bad{background:#fff0d9}
.bpu{background:#cfe2ff} .cpu{background:#ffe0b2} .stub{background:#fff3a8}
.note{color:#5b6573;font-size:13px} .big{font-size:15px}
details summary{cursor:pointer;color:#1f5fbf;margin:4px 0}
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _table_head(*columns: str, left: frozenset = frozenset()) -> str:
    """``<table>`` and its header row; the columns named in ``left`` are left-aligned (class "l")."""
    cells = "".join(f'<th class="l">{_e(c)}</th>' if c in left else f"<th>{_e(c)}</th>" for c in columns)
    return f"<table><tr>{cells}</tr>"


def _num(v: Any, digits: int = 6) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.{digits}g}"
    return _e(v)


def _name(text: Any) -> str:
    """A dotted name that may break after its dots (never inside a word)."""
    return "<wbr>".join(_e(part) + "." for part in str(text).split("."))[:-1] if text else ""


def _short_type(text: Any) -> str:
    """``qcompiler.nn.quantized.QuantizedWeightLayer`` -> ``QuantizedWeightLayer``."""
    return str(text).rsplit(".", 1)[-1] if text else ""


def _tail(text: Any, n: int = 32) -> str:
    """``text`` cut to its last ``n`` characters, with an ellipsis when cut."""
    text = str(text)
    return text if len(text) <= n else "\u2026" + text[-(n - 1):]


def _quantizer_label(quantizer: str, op: str) -> str:
    """``layer1.conv1 (w)`` for a weight quantizer, ``(a)`` for an activation one."""
    return f"{op} ({'w' if quantizer.endswith('weight_fake_quant') else 'a'})"


def _dtype_short(dtype: Any) -> str:
    """``torch.qint8`` / ``qint8`` -> ``qint8``; a float dtype -> ``float``."""
    text = str(dtype).replace("torch.", "")
    return text if text in DTYPE_COLORS else "float"


def _strip_urls(svg: str) -> str:
    """Inline SVG without XML prolog, DOCTYPE, comments, metadata and namespace URLs (none is needed in HTML)."""
    svg = re.sub(r"<\?xml[^>]*\?>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg, flags=re.S)
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    return svg.replace("<svg", '<svg role="img"', 1)


def _figure_svg(fig: Figure, name: str) -> str:
    """The figure as inline SVG; ``name`` salts its element ids so several charts share a page."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    return _strip_urls(buf.getvalue()).replace("<svg", f'<svg class="chart-{name}"', 1)


def graph_svg(gm: fx.GraphModule) -> tuple[str, bool]:
    """``(html, True)``: inline SVG of ``to_dot(gm)``; ``(table html, False)`` when ``dot`` is unavailable."""
    try:
        import graphviz

        svg = with_legend(graphviz.Source(to_dot(gm)).pipe(format="svg").decode("utf-8"))
        return _strip_urls(svg), True
    except Exception:  # dot missing or failing: fall back to a table
        rows = partition_table(gm)
        cols = list(rows[0].keys()) if rows else []
        out = [_table_head(*cols, left=frozenset(cols))]
        for r in rows:
            cls = str(r.get("placement", ""))
            out.append(f'<tr class="{_e(cls)}">' + "".join(f'<td class="l">{_e(r[c])}</td>' for c in cols) + "</tr>")
        out.append("</table>")
        return "\n".join(out), False


# ----------------------------------------------------------------------------- charts


def layer_sqnr(analysis) -> list[float]:
    """SQNR (dB) of every compared layer (``analysis.layers`` order = graph order)."""
    return [compute_metric("SQNR", layer["base"], layer["analy"]) for layer in analysis.layers]


def _advised_ops(analysis) -> set[str]:
    """Ops with a quantizer the int16 advice moves (when it meets its target)."""
    adv = getattr(analysis, "int16_advice", None) or {}
    return {op for _, op, _ in adv.get("steps", ())} if adv.get("met") else set()


def _advised_quantizers(analysis) -> set[str]:
    adv = getattr(analysis, "int16_advice", None) or {}
    return set(adv.get("quantizers", ())) if adv.get("met") else set()


def _layer_error_chart(analysis, sqnr: Sequence[float]) -> str:
    """SQNR per layer along the graph order, one colour per dtype; cosine below it."""
    rows = analysis.compare_rows
    n = len(rows)
    x = list(range(n))
    shown = [min(v, SQNR_CAP) if not math.isnan(v) else float("nan") for v in sqnr]
    fig = Figure(figsize=(13.2, 5.6), dpi=100)
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.3], "hspace": 0.08})
    cpu = [layer.get("placement") == "cpu" for layer in analysis.layers]
    for i in x:  # each run of CPU layers on one light orange band, as in the graph
        if cpu[i] and (i == 0 or not cpu[i - 1]):
            end = next((j for j in range(i, n) if not cpu[j]), n)
            for a in (ax, ax2):
                a.axvspan(i - 0.5, end - 0.5, color=CPU_BAND, zorder=0, linewidth=0)
    ax.plot(x, shown, color="#9aa4b2", linewidth=1, zorder=1)
    for dtype in sorted({_dtype_short(r["quant_dtype"]) for r in rows}):
        idx = [i for i in x if _dtype_short(rows[i]["quant_dtype"]) == dtype]
        label = dtype if dtype != "float" else "float (CPU/unquantized)"
        ax.scatter(idx, [shown[i] for i in idx], s=22, zorder=2, label=label,
                   color=DTYPE_COLORS.get(dtype, FLOAT_COLOR))
    capped = [i for i in x if sqnr[i] > SQNR_CAP]
    if capped:
        ax.scatter(capped, [SQNR_CAP] * len(capped), marker="^", s=40, color="#5b6573", zorder=3,
                   label=f"exact / above {SQNR_CAP:g} dB")
    advised = _advised_ops(analysis)
    marked = [i for i in x if rows[i]["mod_name"] in advised or analysis.layers[i]["node"] in advised]
    if marked:
        ax.scatter(marked, [shown[i] for i in marked], s=140, facecolors="none", edgecolors=ADVICE_COLOR,
                   linewidths=1.8, zorder=4, label="int16 advice")
    ax.set_ylabel("SQNR vs float (dB)")
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(cpu):
        handles.append(Patch(color=CPU_BAND, label="CPU layer"))
        labels.append("CPU layer")
    ax.legend(handles, labels, loc="upper right", fontsize=8, ncol=5, framealpha=0.9)
    ax.set_title("Per-layer output SQNR along the graph order (higher is better)", fontsize=11, loc="left")
    cos = [r["Cosine"] for r in rows]
    ax2.plot(x, cos, color="#1f5fbf", marker=".", linewidth=1)
    ax2.set_ylabel("cosine")
    ax2.ticklabel_format(axis="y", useOffset=False)
    ax2.grid(True, axis="y", alpha=0.3)
    step = max(1, math.ceil(n / 60))
    ax2.set_xticks(x[::step])
    ax2.set_xticklabels([_tail(rows[i]["mod_name"]) for i in x[::step]], rotation=90, fontsize=7)
    ax2.set_xlim(-0.5, n - 0.5)
    return _figure_svg(fig, "layer-errors")


def _sensitivity_chart(analysis) -> str:
    """Horizontal bars of the most sensitive quantizers; the ones the int16 advice moves in red."""
    metric = getattr(analysis, "sensitivity_metric", "metric")
    quantizers = getattr(analysis, "_sensitive_quantizers", None) or [""] * len(analysis.sensitive_ops)
    ranked = [(r, q) for r, q in zip(analysis.sensitive_ops, quantizers) if math.isfinite(r[3])]
    top = ranked[:SENSITIVITY_BARS]
    advised = _advised_quantizers(analysis)
    labels = [f"{r[0]} ({r[1]})" for r, _ in top]
    values = [r[3] for r, _ in top]
    colors = [ADVICE_COLOR if q in advised else DTYPE_COLORS.get(_dtype_short(r[4]), FLOAT_COLOR) for r, q in top]
    fig = Figure(figsize=(13.2, 0.5 + 0.26 * max(len(top), 4)), dpi=100)
    ax = fig.subplots()
    ax.barh(range(len(top)), values, color=colors)
    ax.set_yticks(range(len(top)))
    ax.set_yticklabels([_tail(lab, 60) for lab in labels], fontsize=8)
    ax.invert_yaxis()
    better = "lower" if metric in ("L1", "ATOL") else "higher"
    ax.set_xlabel(f"output {metric} with only this quantizer on ({better} is better)")
    ax.grid(True, axis="x", alpha=0.3)
    if metric in ("COSINE", "SQNR") and values:  # zoom in on the differences
        lo, hi = min(values), max(values)
        pad = (hi - lo) * 0.1 or abs(hi) * 0.01 or 1.0
        ax.set_xlim(lo - pad, hi + pad)
    named = [("moved to int16 by the advice", ADVICE_COLOR)] + [(d, c) for d, c in DTYPE_COLORS.items()]
    handles = [Line2D([], [], color=c, linewidth=6, label=lab) for lab, c in named if c in colors]
    ax.legend(handles=handles, fontsize=8, loc="lower right", frameon=False)
    ax.set_title(f"Sensitivity: the {len(top)} quantizers that hurt the output most alone", fontsize=11, loc="left")
    return _figure_svg(fig, "sensitivity")


def _int16_chart(adv: dict) -> str:
    """Output SQNR after each quantizer the advice moves to int16, against the target."""
    steps = adv["steps"]
    fig = Figure(figsize=(13.2, 2.9), dpi=100)
    ax = fig.subplots()
    xs = list(range(len(steps) + 1))
    ys = [adv["baseline_sqnr"]] + [v for _, _, v in steps]
    ax.plot(xs, ys, marker="o", color=DTYPE_COLORS["qint16"])
    ax.axhline(adv["target_sqnr"], color=ADVICE_COLOR, linestyle="--", linewidth=1,
               label=f"target {adv['target_sqnr']:.2f} dB")
    ax.set_xticks(xs)
    ax.set_xticklabels(["all int8"] + [_tail(_quantizer_label(q, op)) for q, op, _ in steps], rotation=35,
                       ha="right", fontsize=8)
    ax.set_ylabel("output SQNR (dB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    ax.set_title("Output SQNR as the advice moves quantizers to int16, most sensitive first", fontsize=11, loc="left")
    return _figure_svg(fig, "int16")


# ----------------------------------------------------------------------------- sections


def _section(sid: str, title: str, body: Sequence[str]) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>\n' + "\n".join(body) + "\n</section>"


def _overview(analysis, sqnr: Sequence[float]) -> list[str]:
    cards = []
    if getattr(analysis, "base_output", None) is not None:
        for metric, fmt in (("SQNR", "{:.2f} dB"), ("COSINE", "{:.5f}"), ("L1", "{:.4g}"), ("ATOL", "{:.4g}")):
            v = compute_metric(metric, analysis.base_output, analysis.analy_output)
            cards.append((fmt.format(v), f"model output {metric.lower()}"))
    jump = error_jump(analysis, sqnr)
    if jump is not None:
        cards.append((f"{sqnr[jump]:.1f} dB", f"error jumps at: {analysis.compare_rows[jump]['mod_name']}"))
    cards.append((str(len(analysis.compare_rows)), "layers compared"))
    counts = op_counts(analysis.analysis_graph)  # the count compile and partition print
    cards.append((f"{counts[BPU]} / {counts[CPU]}", "ops on BPU / CPU"))
    out = ['<div class="cards">']
    out += [f'<div class="card"><b>{_e(v)}</b><span>{_e(label)}</span></div>' for v, label in cards]
    out.append("</div>")
    out.append(f'<p class="note">analysis model type: <b>{_e(analysis.analysis_model_type)}</b>; per-layer baseline: '
               f"{_e(getattr(analysis, 'baseline_source', ''))}; bad case: batch {_e(analysis.bad_case_index)}</p>")
    return out


def error_jump(analysis, sqnr: Sequence[float]) -> Optional[int]:
    """The layer (index into ``compare_rows``) that adds the most error of its own: its relative error
    power 10^(-SQNR/10) minus the largest of its compared inputs' (the model input adds none). The layer
    with the lowest SQNR is often a float op downstream that only carries the error of the BPU op before
    it; this names where the error jumps. None when no layer has a finite SQNR."""
    layers = getattr(analysis, "layers", None) or []
    index = {layer["node"]: i for i, layer in enumerate(layers)}
    graph = getattr(getattr(analysis, "analysis_graph", None), "graph", None)
    nodes = {n.name: n for n in graph.nodes} if graph is not None else {}

    def noise(i: int) -> float:
        return 10.0 ** (-sqnr[i] / 10.0) if not math.isnan(sqnr[i]) else math.nan

    def input_noise(name: str, seen: set) -> float:
        """The largest error power among the nearest compared producers of node ``name``."""
        node, worst = nodes.get(name), 0.0
        if node is None:
            return worst
        for a in node.all_input_nodes:
            if a.name in seen:
                continue
            seen.add(a.name)
            v = noise(index[a.name]) if a.name in index else input_noise(a.name, seen)
            if not math.isnan(v):
                worst = max(worst, v)
        return worst

    best, best_add = None, -math.inf
    for i, layer in enumerate(layers[:len(sqnr)]):
        own = noise(i)
        if math.isnan(own):
            continue
        added = own - input_noise(layer["node"], set())
        if added > best_add:
            best, best_add = i, added
    return best


# the analysis attribute each advice section shows, and the note that says how to compute it
_ADVICE_NOT_YET = {
    "int16_advice": "No int16 advice yet: run <code>qa.suggest_int16(target_sqnr=30)</code> before "
                    "<code>qa.report()</code>, or <code>qcompiler report --target-sqnr 30</code>.",
    "fix_advice": "No root-cause advice yet: run <code>qa.advise()</code> before <code>qa.report()</code> "
                  "(<code>qcompiler report</code> does).",
}


def _advice_section(analysis, attr: str, render: Callable[[Any], list[str]]) -> list[str]:
    """``render`` of the advice ``analysis.<attr>``, or the note saying how to compute it."""
    advice = getattr(analysis, attr, None)
    return render(advice) if advice else [f'<p class="note">{_ADVICE_NOT_YET[attr]}</p>']


def _int16_section(adv: dict) -> list[str]:
    out = []
    if not adv["steps"]:
        out.append(f'<p class="big">All int8 reaches <b>{adv["baseline_sqnr"]:.2f} dB</b> output SQNR, already at '
                   f'or above the target {adv["target_sqnr"]:.2f} dB: nothing needs int16.</p>')
        return out
    verdict = "meets" if adv["met"] else "still misses"
    out.append(f'<p class="big">Move <b>{len(adv["quantizers"])}</b> quantizer(s) to int16: output SQNR '
               f'<b>{adv["baseline_sqnr"]:.2f} dB &rarr; {adv["reached_sqnr"]:.2f} dB</b> '
               f'(predicted gain <b>{adv["gain"]:+.2f} dB</b>; {verdict} the target {adv["target_sqnr"]:.2f} dB).</p>')
    out.append(f'<div class="chart">{_int16_chart(adv)}</div>')
    out.append(_table_head("step", "quantizer", "op", "output SQNR (dB)", "gain (dB)",
                           left=frozenset({"quantizer", "op"})))
    prev = adv["baseline_sqnr"]
    for i, (q, op, v) in enumerate(adv["steps"], 1):
        out.append(f'<tr><td>{i}</td><td class="l nw">{_e(q)}</td><td class="l nw">{_e(op)}</td>'
                   f"<td>{v:.2f}</td><td>{v - prev:+.2f}</td></tr>")
        prev = v
    out.append("</table>")
    return out


def _root_cause_section(rows: list) -> list[str]:
    out = [f'<p class="note">Each fix applied alone, output SQNR measured on the bad case (all int8: '
           f'{rows[0]["base_sqnr"]:.2f} dB); best first. <code>qa.apply_advice(FILE)</code> / '
           f"<code>qcompiler report --apply FILE</code> writes the best ones that gain at least {MIN_FIX_GAIN} dB for "
           "<code>qcompiler compile --qconfig FILE --hybrid FILE</code>.</p>"]
    for r in rows:
        if not r["fixes"]:
            out.append(f'<p class="note">{_e(r["layer"])}: no config fix: {_e(r.get("why_no_fix") or "")}</p>')
    if not any(r["fixes"] for r in rows):
        out.append('<p class="big">Nothing found: no layer a config entry can name was measured, so there is '
                   "no fix to apply.</p>")
        return out
    if not any(f.gain >= MIN_FIX_GAIN for r in rows for f in r["fixes"]):
        out.append('<p class="big">Nothing found that gains: no measured fix raises the output SQNR on the bad '
                   "case; <code>--apply</code> writes no file.</p>")
    out.append(_table_head("rank", "layer", "fix", "output SQNR (dB)", "gain (dB)", left=frozenset({"layer", "fix"})))
    for r in rows:
        for i, f in enumerate(r["fixes"]):
            what = f"{f.kind} ({f.observer})" if f.observer else f.kind
            out.append(f'<tr class="{"worst" if i == 0 and f.gain >= MIN_FIX_GAIN else ""}"><td>{r["rank"] if i == 0 else ""}</td>'
                       f'<td class="l nw">{_e(r["layer"]) if i == 0 else ""}</td><td class="l">{_e(what)}</td>'
                       f"<td>{f.sqnr:.2f}</td><td>{f.gain:+.2f}</td></tr>")
    out.append("</table>")
    return out


def _layer_table(analysis, sqnr: Sequence[float]) -> list[str]:
    rows = analysis.compare_rows
    finite = [(r["Cosine"], r["index"]) for r in rows if not math.isnan(r["Cosine"])]
    worst = {i for _, i in sorted(finite)[:WORST_ROWS]}
    flagged = {a["index"] for a in analysis.advice}
    head = ["#", "layer", "op", "shape", "dtype", "qscale", "SQNR dB", "cosine", "L1", "atol", "atol/qscale",
            "float min..max", "quant min..max"]
    out = [f'<p class="note">red: the {WORST_ROWS} lowest cosines; orange: advisor findings. Every digit is in '
           "compare_per_layer_out.csv.</p>",
           "<table><tr>" + "".join(f'<th class="{"l" if h in ("layer", "op", "shape", "dtype") else ""}">{h}</th>'
                                   for h in head) + "</tr>"]
    for r, v in zip(rows, sqnr):
        cls = "worst" if r["index"] in worst else ("bad" if r["index"] in flagged else "")
        op = _short_type(r["analy_op_type"])
        title = f' title="{_e(r["analy_op_type"])}; float: {_e(r["base_op_type"])}"'
        cells = [
            f"<td>{r['index']}</td>", f'<td class="l name" title="{_e(r["mod_name"])}">{_name(r["mod_name"])}</td>',
            f'<td class="l"{title}>{_e(op)}</td>', f'<td class="l nw">{_e(r["shape"])}</td>',
            f'<td class="l">{_e(_dtype_short(r["quant_dtype"]))}</td>', f"<td>{_num(r['qscale'], 4)}</td>",
            f"<td>{'exact' if math.isinf(v) and v > 0 else _num(v, 4)}</td>", f"<td>{_num(r['Cosine'], 5)}</td>",
            f"<td>{_num(r['L1'], 4)}</td>", f"<td>{_num(r['Atol'], 4)}</td>",
            f"<td>{_num(r['max_qscale_diff'], 3)}</td>",
            f'<td class="nw">{_num(r["base_min"], 3)} .. {_num(r["base_max"], 3)}</td>',
            f'<td class="nw">{_num(r["analy_min"], 3)} .. {_num(r["analy_max"], 3)}</td>',
        ]
        out.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>")
    out.append("</table>")
    return out


def _advisor_table(analysis) -> list[str]:
    if not analysis.advice:
        return ["<p>No abnormal layer found.</p>"]
    out = [_table_head("#", "layer", "kind", "finding", "suggestion",
                       left=frozenset({"layer", "kind", "finding", "suggestion"}))]
    for a in analysis.advice:
        out.append(f'<tr><td>{a["index"]}</td><td class="l name">{_name(a["mod_name"])}</td><td class="l nw">'
                   f'{_e(a["kind"])}</td><td class="l">{_e(a["message"])}</td>'
                   f'<td class="l">{_e(a["suggestion"])}</td></tr>')
    out.append("</table>")
    return out


def _sensitivity_section(analysis) -> list[str]:
    if not analysis.sensitive_ops:
        return ['<p class="note">Not computed: run <code>qa.sensitivity()</code> (needs the fake-quant model) '
                "before <code>qa.report()</code>.</p>"]
    metric = getattr(analysis, "sensitivity_metric", "metric")
    out = [f'<div class="chart">{_sensitivity_chart(analysis)}</div>',
           f"<details><summary>all {len(analysis.sensitive_ops)} quantizers</summary>",
           _table_head("op", "kind", "type", metric, "dtype", "flops", left=frozenset({"op", "kind", "type", "dtype"}))]
    for r in analysis.sensitive_ops:
        out.append(f'<tr><td class="l name">{_e(r[0])}</td><td class="l">{_e(r[1])}</td><td class="l">{_e(r[2])}</td>'
                   f'<td>{_num(r[3], 5)}</td><td class="l">{_e(_dtype_short(r[4]))}</td><td class="nw">{r[5]} '
                   f"({r[6]:.2%})</td></tr>")
    out.append("</table></details>")
    return out


def _graph_section(gm: fx.GraphModule) -> list[str]:
    graph_html, is_svg = graph_svg(gm)
    legend = ('<p class="legend"><span class="bpu">BPU op</span><span class="cpu">CPU op</span>'
              '<span class="stub">quant / dequant stub</span><span style="color:#d00;font-weight:bold">'
              "red edge: BPU&lt;-&gt;CPU boundary</span><span>dashed boxes: partitions</span></p>")
    if not is_svg:
        legend = "<p>(graphviz 'dot' not available: placement table instead of the drawing)</p>"
    return [legend, f'<div class="graph">{graph_html}</div>']


def write_report(analysis, path: Union[str, Path], title: Optional[str] = None) -> Path:
    """Write the HTML report of ``analysis`` (runs compare_per_layer first if needed) to ``path``."""
    if not analysis.compare_rows:
        analysis.compare_per_layer()
    sqnr = layer_sqnr(analysis)
    title = title or f"Quantization analysis: {type(analysis.baseline_model).__name__}"
    sections = [
        _section("overview", "Overview", _overview(analysis, sqnr)),
        _section("layer-errors", "Per-layer error", [f'<div class="chart">{_layer_error_chart(analysis, sqnr)}</div>']),
        _section("sensitivity", "Sensitivity", _sensitivity_section(analysis)),
        _section("int16-advice", "int16 advice", _advice_section(analysis, "int16_advice", _int16_section)),
        _section("root-cause", "Root cause: fixes for the worst layers",
                 _advice_section(analysis, "fix_advice", _root_cause_section)),
        _section("graph", "Partitioned graph", _graph_section(analysis.analysis_graph)),
        _section("layer-table", "Per-layer errors (table)", _layer_table(analysis, sqnr)),
        _section("advisor", "Abnormal layer advisor", _advisor_table(analysis)),
    ]
    page = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width'><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>\n<h1>{_e(title)}</h1>"
            '<p class="sub">float model vs quantized model, layer by layer, on the worst input found</p>\n'
            + "\n".join(sections) + "\n</main></body></html>\n")
    p = Path(path)
    write_file(p, page.encode("utf-8"), "report")
    return p
