"""One node count everywhere: summary.txt, the JSON dump, the table, CompiledModel and the runtime.

Observer nodes (``<op>_activation_post_process`` after an add or an average) exist in the
prepared model and are folded away by convert; the partition pass's snapshot still named
them, so the dumps of ``compile`` counted one node more per observer than the runtime ran.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.ir.meta import META_PARTITION
from qcompiler.ir.partitions import is_quantizer_node, partitions
from qcompiler.quantization.prepare import prepare_calibration_fx
from qcompiler.tools.graph_dump import dump_partitioned, partition_table

SUMMARY_LINE = re.compile(r"^(\w+): (bpu|cpu), (\d+) ops?, ")


class AddAvg(nn.Module):
    """conv -> add -> avg pool -> linear: two graph-node observers (add, avg pool), one CPU op."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        y = self.conv(x)
        y = self.conv2(y) + y
        y = torch.nn.functional.selu(y)  # not a BPU op: a CPU island between two BPU partitions
        return self.fc(torch.flatten(self.pool(y + 1.0), 1))


def _x():
    return torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _counts_from_dump(out):
    """``{partition: count}`` from summary.txt, from the JSON's partition lists and from the table."""
    summary = {}
    for line in (out / "summary.txt").read_text().splitlines()[1:]:
        m = SUMMARY_LINE.match(line)
        assert m, line
        summary[m.group(1)] = int(m.group(3))
    data = json.loads((out / "model.json").read_text())
    listed = {p["name"]: len(p["nodes"]) for p in data["partitions"]}
    by_placement = {"bpu": data["summary"]["bpu_nodes"], "cpu": data["summary"]["cpu_nodes"]}
    return summary, listed, by_placement, data


@pytest.fixture(scope="module")
def compiled():
    return qcompiler.compile(AddAvg().eval(), _x(), march="bayes", calib_data=[_x()], progress=False)


def test_compile_outputs_agree_with_the_runtime(compiled, tmp_path):
    compiled.dump(tmp_path, name="model")
    summary, listed, by_placement, data = _counts_from_dump(tmp_path)
    runtime = {p["name"]: p["ops"] for p in compiled.partitions}
    assert set(runtime) == {"bpu0", "cpu0", "bpu1"}
    assert summary == listed == runtime
    for where in ("bpu", "cpu"):
        assert by_placement[where] == sum(n for name, n in runtime.items() if name.startswith(where))
    # the partition lists name live graph nodes only (the boundary Quantize ops
    # "<cpu op>_activation_post_process" are ops the runtime runs; the observers are gone)
    live = {n.name for n in compiled.converted.graph.nodes}
    assert all(set(p["nodes"]) <= live for p in data["partitions"])
    # the table shows the same ops per partition (one row per graph node)
    table = [r for r in partition_table(compiled.converted) if r["partition"] != "-"]
    assert {name: sum(r["partition"] == name for r in table) for name in runtime} == runtime
    # CompiledModel.summary() prints the same numbers in its ops column
    rows = {line.split()[0]: int(line.split()[2]) for line in compiled.summary().splitlines()[3:]}
    assert rows == runtime


def test_observer_nodes_are_not_counted_in_a_prepared_model(tmp_path):
    cal = prepare_calibration_fx(AddAvg().eval(), None, hybrid=True, example_inputs=(_x(),), march="bayes")
    observers = [n for n in cal.graph.nodes if is_quantizer_node(n)]
    assert {n.name for n in observers} >= {"add_1_activation_post_process", "pool_activation_post_process"}
    assert all(n.meta.get(META_PARTITION) for n in observers)  # they sit inside a partition ...
    dump_partitioned(cal, tmp_path, name="model")
    summary, listed, _, _ = _counts_from_dump(tmp_path)
    assert summary == listed
    for p in partitions(cal):  # ... but are not among its ops
        ops = [n for n in cal.graph.nodes if n.meta.get(META_PARTITION) == p.name and not is_quantizer_node(n)]
        assert p.nodes == [n.name for n in ops]


def test_partition_lists_follow_the_graph_not_the_pass_snapshot(compiled):
    gm = compiled.converted
    snapshot = {p.name: list(p.nodes) for p in gm.meta["qc_partitions"]}
    stale = [n for names in snapshot.values() for n in names if n not in {m.name for m in gm.graph.nodes}]
    assert stale, "the pass snapshot should still name the observers convert removed (else this test is moot)"
    assert not any(n in p.nodes for p in partitions(gm) for n in stale)
