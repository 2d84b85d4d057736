"""The package declares ranges of torch and Python, not pins, and setup keeps a torch inside them."""

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _torch_cpu():
    spec = importlib.util.spec_from_file_location("torch_cpu", ROOT / "scripts" / "torch_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_is_a_range_of_the_last_four_releases():
    (req,) = [d for d in PROJECT["dependencies"] if re.match(r"torch\s*[<>=]", d)]
    assert req.replace(" ", "") == "torch>=2.12,<2.16", req
    assert PROJECT["requires-python"] == ">=3.11,<3.14"


@pytest.mark.parametrize("version, inside", [
    ("2.12.0", True), ("2.12", True), ("2.13.0+cpu", True), ("2.15.1", True), ("2.15.0rc1", True),
    ("2.11.9", False), ("2.16.0", False), ("3.0.0", False), ("2.9.1", False),
])
def test_the_range_reader_agrees_with_the_release_numbers(version, inside):
    assert _torch_cpu().in_range(version, "torch>=2.12,<2.16") is inside


def test_the_range_reader_refuses_a_clause_it_cannot_read():
    with pytest.raises(SystemExit, match="cannot read the clause '~=2.12'"):
        _torch_cpu().in_range("2.13.0", "torch~=2.12")


def test_the_torch_running_the_tests_is_inside_the_declared_range():
    tc = _torch_cpu()
    assert tc.in_range(torch.__version__, tc.torch_requirement())
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_cpu.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_setup_names_no_torch_release_of_its_own():
    """One place says which torch: pyproject.toml. setup.sh defers to it through torch_cpu.py."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "python scripts/torch_cpu.py\n" in setup and "torch_cpu.py --check" in setup
    assert not re.search(r"torch[=<>]=?\s*2\.\d+|startswith\('2\.", setup), "a torch release is named in setup.sh"
