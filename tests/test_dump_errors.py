"""Dump paths that cannot hold a dump are a ConfigError naming the path, before anything is written.

``qcompiler.partition(dump_dir=...)`` raised a raw NotADirectoryError below a file (after the
first pass had run), and ``CompiledModel.dump`` wrote its graph files before its step files, so a
failure in between left half a dump."""

from __future__ import annotations

import os

import pytest
import torch

import qcompiler
from qcompiler import zoo
from qcompiler.errors import ConfigError

X = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def cm():
    return qcompiler.compile(zoo.get("hybrid"), X, march="bayes", calib_data=[X], progress=False)


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("x")
    return path


def test_dump_below_a_file_is_a_config_error_naming_it(cm, a_file):
    with pytest.raises(ConfigError, match=rf"^dump: cannot create '{a_file}/d': '{a_file}' is a file, not a directory"):
        cm.dump(a_file / "d")


def test_partition_dump_dir_below_a_file_is_a_config_error(a_file):
    with pytest.raises(ConfigError, match=rf"^dump_dir: cannot create '{a_file}/d': '{a_file}' is a file"):
        qcompiler.partition(zoo.get("hybrid"), X, march="bayes", dump_dir=a_file / "d")


def test_partition_dump_dir_that_is_fine_gets_one_file_per_pass(tmp_path):
    qcompiler.partition(zoo.get("hybrid"), X, march="bayes", dump_dir=tmp_path / "passes")
    names = sorted(os.listdir(tmp_path / "passes"))
    assert names and all(n[:2].isdigit() and n.endswith(".txt") for n in names), names


def test_a_failing_step_file_leaves_no_half_dump(cm, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    step = next(s for s in cm.runtime.steps if s.kind == "bpu")
    (out / f"{step.name}.program.txt").mkdir()  # a directory where a step file goes: refused
    with pytest.raises(ConfigError, match=rf"{step.name}.program.txt' is a directory"):
        cm.dump(out)
    assert sorted(os.listdir(out)) == [f"{step.name}.program.txt"]  # no model.* written before it


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_dump_into_an_unwritable_directory_is_an_error_naming_it(cm, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(OSError, match=r"^\[Errno 13\] dump: "):
        cm.dump(ro / "sub")
