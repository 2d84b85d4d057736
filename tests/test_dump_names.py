"""One naming scheme for every dump: ``model.*`` (qcompiler.ir.dump.DUMP_STEM) whatever the entry point.

``cm.dump`` named the files after the class (``HybridModel.json``), the CLI after the zoo name
(``hybrid.json``) and ``dump_partitioned`` ``model.json``: the same model gave three file lists.
"""

from __future__ import annotations

import torch

import qcompiler
from qcompiler import zoo
from qcompiler.tools.cli import main
from qcompiler.tools.graph_dump import dump_partitioned

X = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
GRAPH_FILES = {"model.code.txt", "model.table.txt", "model.json", "model.dot", "model.svg", "summary.txt"}


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_every_entry_point_writes_the_same_file_names(tmp_path, capsys):
    cm = qcompiler.compile(zoo.get("hybrid"), X, march="bayes", calib_data=[X], progress=False)
    cm.dump(tmp_path / "api")
    dump_partitioned(qcompiler.partition(zoo.get("hybrid"), X, march="bayes"), tmp_path / "staged")
    assert main(["partition", "zoo:hybrid", "--input-shape", "1,3,32,32", "--out", str(tmp_path / "part")]) == 0
    assert main(["compile", "zoo:hybrid", "--input-shape", "1,3,32,32", "--calib-random", "1",
                 "--out", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    steps = {f"{s.name}.program.txt" if s.kind == "bpu" else f"{s.name}.onnx" for s in cm.runtime.steps}
    assert _files(tmp_path / "staged") == _files(tmp_path / "part") == sorted(GRAPH_FILES)
    assert _files(tmp_path / "api") == sorted(GRAPH_FILES | steps)
    assert _files(tmp_path / "cli") == sorted(GRAPH_FILES | steps | {"model.onnx", "model.onnx.quant.json", "model.qc"})


def test_an_explicit_name_still_renames_the_graph_files(tmp_path):
    gm = qcompiler.partition(zoo.get("hybrid"), X, march="bayes")
    dump_partitioned(gm, tmp_path, name="hybrid")
    assert _files(tmp_path) == sorted(f.replace("model.", "hybrid.") for f in GRAPH_FILES)
