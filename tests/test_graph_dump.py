"""Tests of the graph dumps (qcompiler.ir.dump, public as qcompiler.tools.graph_dump) on the hybrid guide model."""

from __future__ import annotations

import json
import re
import shutil

import graphviz
import pytest

import qcompiler
from qcompiler import zoo
from qcompiler.ir import dump as graph_dump  # the implementation, for monkeypatching its globals
from qcompiler.tools.graph_dump import dump_partitioned, partition_table, to_dot, to_json
from qcompiler.zoo.hybrid import _SeluModule

SUMMARY = "partitions: 3 bpu, 3 cpu; BPU<->CPU boundary edges: 5"
PARTITIONS = ["bpu0", "cpu0", "bpu1", "cpu1", "bpu2", "cpu2"]
HYBRID_DICT = {"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]}
BASE_FILES = ["hybrid.code.txt", "hybrid.table.txt", "hybrid.json", "hybrid.dot", "summary.txt"]


def _partitioned():
    return qcompiler.partition(
        zoo.get("hybrid"), zoo.example_inputs("hybrid", image_size=16), march="bayes", hybrid_dict=HYBRID_DICT
    )


@pytest.fixture(scope="module")
def gm():
    return _partitioned()


def _rows(gm):
    return {row["node"]: row for row in partition_table(gm)}


def test_table_rows(gm):
    rows = _rows(gm)
    assert list(rows)[0] == "input_1" and list(rows)[-1] == "output"
    assert len(rows) == len(list(gm.graph.nodes))
    for io in ("input_1", "output"):
        assert rows[io]["placement"] == "-" and rows[io]["partition"] == "-"
    assert rows["input_1"]["op"] == "placeholder"
    assert rows["input_1"]["shape"] == "f32[1,3,16,16]"

    conv3 = rows["conv3"]
    assert (conv3["op"], conv3["target"], conv3["placement"], conv3["partition"]) == (
        "call_module", "Conv2d", "cpu", "cpu1")
    assert 'hybrid_dict module_name "conv3"' in conv3["reason"]

    prelu = rows["prelu"]
    assert (prelu["placement"], prelu["reason"], prelu["partition"]) == (
        "cpu", "prelu is not supported on bayes", "cpu0")
    assert rows["conv1_conv"]["reason"] == 'hybrid_dict module_name "conv1.conv"'
    assert rows["selu_2"]["reason"] == "hybrid_dict module_type _SeluModule"
    assert rows["selu_2"]["target"] == "F.selu"
    assert (rows["conv0"]["placement"], rows["conv0"]["partition"]) == ("bpu", "bpu0")
    assert (rows["conv4"]["placement"], rows["conv4"]["partition"]) == ("bpu", "bpu2")
    assert rows["conv3_input_dequant_0"]["target"] == "DeQuantStub"
    assert set(rows["conv0"]) == {"node", "op", "target", "placement", "reason", "partition", "shape"}


def test_fused_target_names_the_pattern():
    import torch

    gm = qcompiler.partition(zoo.get("resnet18"), (torch.rand(1, 3, 32, 32),), march="bayes")
    rows = _rows(gm)
    assert rows["conv1"]["target"] == "FusedConv2d(conv2d+batch_norm+relu)"
    assert rows["layer1_0_conv2"]["target"] == "FusedConv2d(conv2d+batch_norm+add+relu)"


def test_json(gm):
    data = json.loads(json.dumps(to_json(gm)))
    assert data["model"] == "HybridModel"
    assert data["march"] == "bayes"
    assert data["summary"]["line"] == SUMMARY
    assert data["summary"]["bpu_partitions"] == 3 and data["summary"]["cpu_partitions"] == 3
    assert len(data["summary"]["boundary_edges"]) == 5
    assert ["conv3_input_dequant_0", "conv3"] in data["summary"]["boundary_edges"]
    assert [p["name"] for p in data["partitions"]] == PARTITIONS
    assert data["partitions"][3] == {
        "name": "cpu1", "placement": "cpu", "nodes": ["conv3"],
        "inputs": ["conv3_input_dequant_0"], "outputs": ["conv3"],
    }
    nodes = {n["node"]: n for n in data["nodes"]}
    assert nodes["conv3"]["inputs"] == ["conv3_input_dequant_0"]
    assert nodes["conv1_conv"]["scope"] == [["", "HybridModel"], ["conv1", "_ConvBlock"], ["conv1.conv", "Conv2d"]]
    assert [n["node"] for n in data["nodes"]] == [n.name for n in gm.graph.nodes]


def test_dot(gm):
    dot = to_dot(gm)
    assert dot.startswith("digraph")
    for name in PARTITIONS:
        assert dot.count(f"subgraph cluster_{name} ") == 1
        assert f"label={name}" in dot
    assert dot.count("subgraph cluster_") == len(PARTITIONS)
    assert dot.count("color=red") == 5  # one per boundary edge
    assert "conv3_input_dequant_0 -> conv3 [color=red" in dot
    assert 'label="conv3\\nconv2d\\nf32[1,3,16,16]"' in dot
    assert to_dot(gm) == dot


def test_dump_files_and_determinism(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ra = dump_partitioned(_partitioned(), a, name="hybrid")
    rb = dump_partitioned(_partitioned(), b, name="hybrid")
    assert ra.summary == SUMMARY
    for f in BASE_FILES:
        assert (a / f).is_file() and (a / f).stat().st_size > 0
    assert [p.name for p in ra.files] == [p.name for p in rb.files]
    assert set(ra.files) == set(a.iterdir())
    for fa, fb in zip(ra.files, rb.files):
        assert fa.read_bytes() == fb.read_bytes(), fa.name
    summary = (a / "summary.txt").read_text().splitlines()
    assert summary[0] == SUMMARY
    assert summary[1:] == [
        "bpu0: bpu, 4 ops, input_1 -> prelu_input_dequant_0",
        "cpu0: cpu, 5 ops, prelu_input_dequant_0 -> selu_1",
        "bpu1: bpu, 3 ops, selu_1 -> conv3_input_dequant_0",
        "cpu1: cpu, 1 op, conv3_input_dequant_0 -> conv3",
        "bpu2: bpu, 4 ops, conv3 -> selu_2_input_dequant_0",
        "cpu2: cpu, 2 ops, selu_2_input_dequant_0 -> dequant",
    ]
    table = (a / "hybrid.table.txt").read_text()
    assert table.splitlines()[0].split("|")[1].strip() == "node"
    assert "prelu is not supported on bayes" in table
    assert (a / "hybrid.code.txt").read_text().startswith("# HybridModel")
    assert json.loads((a / "hybrid.json").read_text())["summary"]["line"] == SUMMARY
    assert not list(a.glob(".*"))  # no temp files left


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' binary not installed")
def test_svg_when_dot_installed(gm, tmp_path):
    result = dump_partitioned(gm, tmp_path, name="hybrid")
    svg = (tmp_path / "hybrid.svg").read_bytes()
    assert svg.startswith(b"<?xml") or b"<svg" in svg
    assert tmp_path / "hybrid.svg" in result.files
    assert result.notes == []


def test_no_dot_binary_writes_only_dot(gm, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    result = dump_partitioned(gm, tmp_path, name="hybrid")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(BASE_FILES)
    assert not (tmp_path / "hybrid.svg").exists()
    assert len(result.notes) == 1
    assert "graphviz 'dot' not found" in result.notes[0]
    assert "hybrid.dot" in result.notes[0]
    assert "apt-get install graphviz" in result.notes[0]


@pytest.mark.parametrize("existing", [False, True])
def test_failure_leaves_no_partial_files(gm, tmp_path, monkeypatch, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()

    def boom(_gm):
        raise RuntimeError("boom")

    monkeypatch.setattr(graph_dump, "to_dot", boom)
    with pytest.raises(RuntimeError, match="boom"):
        dump_partitioned(gm, out, name="hybrid")
    assert not out.exists() or list(out.iterdir()) == []


def test_failed_write_leaves_no_temp_file(gm, tmp_path, monkeypatch):
    """A write that fails half-way removes its temp file and never touches the target."""
    real_replace = graph_dump.os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(graph_dump.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        dump_partitioned(gm, tmp_path, name="hybrid")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "hybrid.json" not in names
    assert not [n for n in names if n.endswith(".tmp")]


def test_bad_dump_name(gm, tmp_path):
    with pytest.raises(qcompiler.ConfigError, match="plain file name"):
        dump_partitioned(gm, tmp_path, name="a/b")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")
def test_svg_dump_has_a_legend_below_the_drawing(tmp_path):
    from qcompiler.ir.dump import LEGEND_HEIGHT, SVG_LEGEND

    gm = _partitioned()
    dump_partitioned(gm, tmp_path)
    svg = (tmp_path / "model.svg").read_text()
    assert svg.count(SVG_LEGEND) == 1  # golden text of the legend group
    bare = graphviz.Source(to_dot(gm)).pipe(format="svg").decode()
    height = lambda text: float(re.search(r'viewBox="[\d.]+ [\d.]+ [\d.]+ ([\d.]+)"', text).group(1))  # noqa: E731
    assert height(svg) == pytest.approx(height(bare) + LEGEND_HEIGHT, abs=0.01)
    assert SVG_LEGEND not in bare
