"""One op count everywhere (qcompiler.ir.partitions.op_counts): ``qcompiler compile``, ``partition``,
the report's overview and the dump's JSON print the same ops per placement for the same model.

The report counted compared layers ("layers on BPU / CPU"), compile the partitions' ops and
partition "#nodes": three numbers for one model."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from qcompiler.tools.cli import main

SHAPE = ["--input-shape", "1,3,32,32"]
OPS_LINE = re.compile(r"^ops per placement: bpu (\d+), cpu (\d+)$", re.M)
REPORT_CARD = re.compile(r"<b>(\d+) / (\d+)</b><span>ops on BPU / CPU</span>")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("counts")
    printed = {}
    for cmd, extra in (("partition", []), ("compile", ["--calib-random", "1"]), ("report", ["--calib-random", "1"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main([cmd, "zoo:hybrid", *SHAPE, *extra, "--out", str(out / cmd)]) == 0
        printed[cmd] = buf.getvalue()
    return out, printed


def test_compile_partition_report_and_json_count_the_same_ops(runs):
    out, printed = runs
    counts = {cmd: tuple(map(int, OPS_LINE.search(printed[cmd]).groups())) for cmd in ("partition", "compile")}
    card = REPORT_CARD.search((out / "report" / "report.html").read_text())
    assert card, "the report's overview has no 'ops on BPU / CPU' card"
    counts["report"] = tuple(map(int, card.groups()))
    summary = json.loads((out / "compile" / "model.json").read_text())["summary"]
    counts["json"] = (summary["bpu_nodes"], summary["cpu_nodes"])
    assert len(set(counts.values())) == 1, counts
    bpu, cpu = counts["compile"]
    assert bpu > 0 and cpu > 0  # the hybrid model has ops on both: a count of one placement cannot pass alone


def test_partition_prints_ops_not_nodes(runs):
    _, printed = runs
    header = next(line for line in printed["partition"].splitlines() if line.startswith("partition "))
    assert header.split() == ["partition", "placement", "ops", "inputs", "outputs"]
    assert "#nodes" not in printed["partition"]


def test_summary_txt_says_ops(runs):
    out, _ = runs
    lines = (out / "partition" / "summary.txt").read_text().splitlines()[1:]
    assert lines and all(re.match(r"^\w+: (bpu|cpu), \d+ ops?, ", line) for line in lines), lines
