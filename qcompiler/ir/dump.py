"""Review dumps of a partitioned GraphModule: table, JSON, DOT/SVG, annotated code, summary.

Everything here only reads what the passes recorded (node meta and
``gm.meta``), so a dump shows exactly the placement decisions and partitions
the compiler made, with the reason for each node.  All outputs are
deterministic (graph order, no timestamps) so two dumps of the same model can
be diffed byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import graphviz
import torch.fx as fx
from tabulate import tabulate

from qcompiler.atomic_write import check_directory, make_directory, write_files
from qcompiler.errors import ConfigError
from qcompiler.ir.meta import (
    BPU,
    CPU,
    GM_MARCH,
    META_OP,
    META_PARTITION,
    META_PLACEMENT,
    META_REASON,
    META_STUB,
    META_TENSOR,
    format_tensor_info,
    scope,
)
from qcompiler.ir.ops import describe_target
from qcompiler.ir.partitions import boundary_edges, op_counts, partitions, summary_line
from qcompiler.ir.printing import annotated_code

__all__ = [
    "DumpResult",
    "partition_table",
    "to_json",
    "to_dot",
    "summary_text",
    "dump_partitioned",
    "NO_PLACEMENT",
    "DUMP_STEM",
    "SVG_LEGEND",
    "with_legend",
    "dump_contents",
    "write_dump",
]

DUMP_STEM = "model"
"""The stem of every file a dump or ``qcompiler compile --out`` writes (``model.json``, ``model.onnx``,
``model.qc``), whatever the entry point or the model: the directory names the model, the files
inside have fixed names (docs/dumps.md)."""

NO_PLACEMENT = "-"
"""Placement/partition shown for nodes that have none (graph inputs and the output)."""

TABLE_COLUMNS = ("node", "op", "target", "placement", "reason", "partition", "shape")

# DOT styling, one entry per kind of node.
_STYLE_BPU = {"shape": "box", "style": "filled,rounded", "fillcolor": "#cfe2ff", "color": "#1f5fbf"}
_STYLE_CPU = {"shape": "box", "style": "filled,rounded", "fillcolor": "#ffe0b2", "color": "#c26a00"}
_STYLE_STUB = {"shape": "hexagon", "style": "filled", "fillcolor": "#fff3a8", "color": "#8a7a00"}
_STYLE_IO = {"shape": "ellipse", "style": "solid", "color": "black"}
_STYLE_BOUNDARY = {"color": "red", "penwidth": "2.0", "style": "bold"}
_CLUSTER_STYLE = {
    BPU: {"style": "rounded,dashed", "color": "#1f5fbf", "fontcolor": "#1f5fbf"},
    CPU: {"style": "rounded,dashed", "color": "#c26a00", "fontcolor": "#c26a00"},
}


@dataclass
class DumpResult:
    """What :func:`dump_partitioned` wrote: the files (in write order), the summary text, notes."""

    files: list[Path] = field(default_factory=list)
    summary: str = ""
    notes: list[str] = field(default_factory=list)


def _target(node: fx.Node, modules: dict) -> str:
    """``describe_target``, plus the fused pattern for fused modules: ``FusedConv2d(conv2d+batch_norm+relu)``."""
    text = describe_target(node, modules)
    if node.op == "call_module":
        fused_from = getattr(modules.get(node.target), "fused_from", None)
        if isinstance(fused_from, (tuple, list)) and fused_from:
            text = f"{text}({'+'.join(map(str, fused_from))})"
    return text


def partition_table(gm: fx.GraphModule) -> list[dict]:
    """One row per node in graph order (inputs and the output included, placement ``-``).

    Keys: node, op (fx op kind), target, placement, reason, partition, shape.
    """
    modules = dict(gm.named_modules())
    rows = []
    for node in gm.graph.nodes:
        rows.append({
            "node": node.name,
            "op": node.op,
            "target": _target(node, modules),
            "placement": node.meta.get(META_PLACEMENT) or NO_PLACEMENT,
            "reason": node.meta.get(META_REASON) or "",
            "partition": node.meta.get(META_PARTITION) or NO_PLACEMENT,
            "shape": format_tensor_info(node.meta.get(META_TENSOR)),
        })
    return rows


def _march_name(gm: fx.GraphModule) -> Optional[str]:
    march = gm.meta.get(GM_MARCH)
    if march is None:
        return None
    return str(getattr(march, "value", march))


def _model_name(gm: fx.GraphModule) -> str:
    return type(gm).__name__


def to_json(gm: fx.GraphModule) -> dict:
    """The dump as plain JSON-serialisable data, in graph/partition order (nothing re-sorted)."""
    parts = partitions(gm)
    table = partition_table(gm)
    edges = boundary_edges(gm)
    nodes = []
    for row, node in zip(table, gm.graph.nodes):
        entry = dict(row)
        entry["inputs"] = [src.name for src in node.all_input_nodes]
        entry["scope"] = [[e.path, e.type_name] for e in scope(node)]
        nodes.append(entry)
    return {
        "model": _model_name(gm),
        "march": _march_name(gm),
        "summary": {
            "line": summary_line(gm),
            "partitions": len(parts),
            "bpu_partitions": sum(p.placement == BPU for p in parts),
            "cpu_partitions": sum(p.placement == CPU for p in parts),
            "nodes": len(table),
            # the ops of the partitions (quantizer nodes left out), the count every output uses
            "bpu_nodes": op_counts(gm)[BPU],
            "cpu_nodes": op_counts(gm)[CPU],
            "boundary_edges": [[a, b] for a, b in edges],
        },
        "partitions": [p.to_dict() for p in parts],
        "nodes": nodes,
    }


def _is_stub(node: fx.Node) -> bool:
    """Inserted boundary stubs and the model's own Quant/DeQuant stubs."""
    return bool(node.meta.get(META_STUB)) or node.meta.get(META_OP) in ("quant", "dequant")


def _dot_op(node: fx.Node, modules: dict) -> str:
    """The op line of a DOT label: canonical op (fused pattern for fused modules), else the fx kind."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "call_module":
        fused_from = getattr(modules.get(node.target), "fused_from", None)
        if isinstance(fused_from, (tuple, list)) and fused_from:
            return "+".join(map(str, fused_from))
    return node.meta.get(META_OP) or describe_target(node, modules)


def _dot_escape(text: str) -> str:
    """Text for a DOT escString: backslashes doubled (``\\n`` line breaks are added by the caller)."""
    return text.replace("\\", "\\\\")


def to_dot(gm: fx.GraphModule) -> str:
    """DOT source: one cluster per partition, nodes coloured by placement, boundary edges red/bold.

    BPU nodes are blue boxes, CPU nodes orange boxes, Quant/DeQuant stubs and
    observers yellow hexagons, inputs/outputs plain ellipses.  Labels are
    ``name\\nop\\nshape``; the placement reason is the node's tooltip (SVG).
    """
    modules = dict(gm.named_modules())
    model = _model_name(gm)
    march = _march_name(gm)
    title = f"{model}{f' ({march})' if march else ''}: {summary_line(gm)}"
    dot = graphviz.Digraph(
        name=model,
        graph_attr={"rankdir": "TB", "label": _dot_escape(title), "labelloc": "t", "fontname": "Helvetica"},
        node_attr={"fontname": "Helvetica", "fontsize": "10"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9"},
    )

    def add_node(graph: graphviz.Digraph, node: fx.Node) -> None:
        label = "\\n".join(_dot_escape(s) for s in (
            node.name, _dot_op(node, modules), format_tensor_info(node.meta.get(META_TENSOR))
        ))
        if node.op in ("placeholder", "output"):
            style = _STYLE_IO
        elif _is_stub(node):
            style = _STYLE_STUB
        elif node.meta.get(META_PLACEMENT) == CPU:
            style = _STYLE_CPU
        elif node.meta.get(META_PLACEMENT) == BPU:
            style = _STYLE_BPU
        else:
            style = _STYLE_IO
        attrs = dict(style)
        reason = node.meta.get(META_REASON)
        if reason:
            attrs["tooltip"] = _dot_escape(f"{node.meta.get(META_PLACEMENT, '')}: {reason}")
        graph.node(node.name, label=label, **attrs)

    in_cluster: set[str] = set()
    for p in partitions(gm):
        with dot.subgraph(name=f"cluster_{p.name}") as sub:
            sub.attr(label=p.name, **_CLUSTER_STYLE.get(p.placement, {}))
            for node in gm.graph.nodes:  # the partition's ops and its observers, if any
                if node.meta.get(META_PARTITION) == p.name and node.op not in ("placeholder", "output"):
                    add_node(sub, node)
                    in_cluster.add(node.name)
    for node in gm.graph.nodes:
        if node.name not in in_cluster:
            add_node(dot, node)

    for node in gm.graph.nodes:
        mine = node.meta.get(META_PARTITION)
        for src in node.all_input_nodes:
            theirs = src.meta.get(META_PARTITION)
            if mine is not None and theirs is not None and mine != theirs:
                dot.edge(src.name, node.name, **_STYLE_BOUNDARY)
            else:
                dot.edge(src.name, node.name)
    return dot.source


def _names(names: list[str]) -> str:
    return ", ".join(names) if names else "-"


def summary_text(gm: fx.GraphModule) -> str:
    """``summary_line`` then one line per partition: name, placement, ops, inputs -> outputs."""
    lines = [summary_line(gm)]
    for p in partitions(gm):
        lines.append(
            f"{p.name}: {p.placement}, {len(p.nodes)} op{'s' if len(p.nodes) != 1 else ''}, "
            f"{_names(p.inputs)} -> {_names(p.outputs)}"
        )
    return "\n".join(lines) + "\n"


def _table_text(gm: fx.GraphModule) -> str:
    rows = partition_table(gm)
    body = tabulate([[r[c] for c in TABLE_COLUMNS] for r in rows], headers=list(TABLE_COLUMNS), tablefmt="github")
    return body + "\n"


LEGEND_HEIGHT = 26
LEGEND_WIDTH = 470
SVG_LEGEND = (
    '<g id="legend" class="legend" font-family="Helvetica,sans-Serif" font-size="11">'
    '<rect x="8" y="8" width="14" height="12" rx="3" fill="#cfe2ff" stroke="#1f5fbf"/>'
    '<text x="27" y="18">BPU op</text>'
    '<rect x="80" y="8" width="14" height="12" rx="3" fill="#ffe0b2" stroke="#c26a00"/>'
    '<text x="99" y="18">CPU op</text>'
    '<rect x="152" y="8" width="14" height="12" fill="#fff3a8" stroke="#8a7a00"/>'
    '<text x="171" y="18">quant / dequant stub</text>'
    '<line x1="292" y1="14" x2="316" y2="14" stroke="red" stroke-width="2"/>'
    '<text x="321" y="18">BPU&lt;-&gt;CPU boundary edge</text>'
    "</g>"
)
"""The key of the drawing's colours (the styles above), drawn below the graph in every SVG."""


def with_legend(svg: str) -> str:
    """Graphviz's SVG with :data:`SVG_LEGEND` below the drawing: the viewBox (and the size) grow by
    :data:`LEGEND_HEIGHT` (and to at least :data:`LEGEND_WIDTH` wide)."""
    m = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"\s+viewBox="([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)"', svg)
    if m is None:
        return svg
    x0, y0, w, h = (float(v) for v in m.groups()[2:])
    width, height = max(w, LEGEND_WIDTH), h + LEGEND_HEIGHT
    head = f'<svg width="{width:.2f}pt" height="{height:.2f}pt"\n viewBox="{x0:.2f} {y0:.2f} {width:.2f} {height:.2f}"'
    end = svg.rindex("</svg>")
    legend = f'<g transform="translate({x0:.2f},{y0 + h:.2f})">{SVG_LEGEND}</g>\n'
    return svg[:m.start()] + head + svg[m.end():end] + legend + svg[end:]


def _render_svg(dot_source: str) -> bytes:
    return with_legend(graphviz.Source(dot_source).pipe(format="svg").decode("utf-8")).encode("utf-8")


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name \
            or (os.altsep and os.altsep in name):
        raise ConfigError(f"dump name must be a plain file name stem (no path separators), got {name!r}")
    return name


def dump_contents(gm: fx.GraphModule, name: str = DUMP_STEM) -> tuple[list[tuple[str, bytes]], list[str]]:
    """``([(file name, bytes)], notes)``: what :func:`dump_partitioned` writes, built in memory, so a
    caller adding files of its own (``CompiledModel.dump``) writes them all in one go or none."""
    name = _check_name(name)
    notes: list[str] = []
    dot_source = to_dot(gm)
    contents: list[tuple[str, bytes]] = [
        (f"{name}.code.txt", annotated_code(gm).encode()),
        (f"{name}.table.txt", _table_text(gm).encode()),
        (f"{name}.json", (json.dumps(to_json(gm), indent=2, ensure_ascii=False) + "\n").encode()),
        (f"{name}.dot", (dot_source if dot_source.endswith("\n") else dot_source + "\n").encode()),
    ]
    if shutil.which("dot") is None:
        notes.append(
            f"graphviz 'dot' not found: wrote only {name}.dot; install it with `apt-get install graphviz`"
        )
    else:
        try:
            contents.append((f"{name}.svg", _render_svg(dot_source)))
        except (graphviz.ExecutableNotFound, graphviz.CalledProcessError, subprocess.CalledProcessError,
                OSError) as exc:
            notes.append(f"graphviz 'dot' failed to render {name}.svg ({type(exc).__name__}: {exc}); "
                         f"wrote only {name}.dot")
    contents.append(("summary.txt", summary_text(gm).encode()))
    return contents, notes


def write_dump(out: Path, contents: list[tuple[str, bytes]]) -> list[Path]:
    """Every ``(file name, bytes)`` written into ``out`` (created if missing) by one
    :func:`qcompiler.atomic_write.write_files`: all files or none."""
    make_directory(out, "dump")
    return write_files([(out / filename, data) for filename, data in contents], "dump")


def dump_partitioned(gm: fx.GraphModule, out_dir: Union[str, Path], name: str = DUMP_STEM) -> DumpResult:
    """Write ``{name}.code.txt``, ``{name}.table.txt``, ``{name}.json``, ``{name}.dot``,
    ``{name}.svg`` (only if graphviz's ``dot`` is installed) and ``summary.txt`` into ``out_dir``.

    All contents are built in memory before anything is written, and each file
    is written via a temp file + ``os.replace``; so an error while building
    leaves ``out_dir`` untouched and no file is ever half-written. ``out_dir`` is checked
    first (:func:`qcompiler.atomic_write.check_directory`: a ConfigError for an empty path, an
    existing file or a path below one); a directory that cannot be created (``/proc``) is an
    OSError prefixed ``dump:``.
    """
    out = check_directory(out_dir, "dump")
    contents, notes = dump_contents(gm, name)
    files = write_dump(out, contents)
    return DumpResult(files=files, summary=summary_line(gm), notes=notes)
