"""``qcompiler --help`` and argument errors come before any heavy import (issue 35: they took ~5 s of
CPU importing torch). Checked by what a fresh interpreter has imported, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from qcompiler import zoo
from qcompiler.ir import capture
from qcompiler.tools import cli

HEAVY = ("torch", "numpy", "onnx", "onnxruntime", "tabulate", "PIL", "qcompiler.compiled", "qcompiler.tools.cli_commands")


def _imported_after(argv: list[str]) -> tuple[int, list[str], str]:
    """Run ``main(argv)`` in a fresh interpreter: its exit status, the heavy modules loaded, stderr."""
    code = textwrap.dedent(f"""
        import json, sys
        from qcompiler.tools.cli import main
        status = main({argv!r})
        sys.stdout.flush()
        print(json.dumps([status, [m for m in {HEAVY!r} if m in sys.modules]]), file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    *err, last = proc.stderr.strip().splitlines()
    status, heavy = json.loads(last)
    return status, heavy, "\n".join(err)


@pytest.mark.parametrize("argv", [["--help"], ["compile", "--help"], ["report", "--help"], ["partition", "--help"],
                                  ["--version"]])
def test_help_imports_nothing_heavy(argv):
    status, heavy, _ = _imported_after(argv)
    assert status == 0 and heavy == []


@pytest.mark.parametrize("argv, message", [
    (["compile", "zoo:hybrid", "--input-shape", "1,3,22O,224", "--out", "o"], "malformed input shape '1,3,22O,224'"),
    (["report", "zoo:hybrid", "--calib-random", "0", "--out", "o"], "--calib-random must be at least 1"),
    (["compile", "zoo:hybrid", "--resize", "256", "--out", "o"], "--resize is image preprocessing"),
    (["report", "zoo:hybrid", "--advise", "-1", "--out", "o"], "--advise K needs K >= 1"),
    (["compile", "zoo:hybrid", "--calib-dta", "x.npz", "--out", "o"], "unrecognized arguments"),
    (["compile", "zoo:hybrid", "--calib-data", "absent.npz", "--out", "o"], "--calib-data absent.npz: does not exist"),
    (["compile"], "the following arguments are required"),
])
def test_argument_errors_import_nothing_heavy(argv, message):
    status, heavy, err = _imported_after(argv)
    assert status == 2 and message in err and heavy == []


def test_a_command_does_import_the_compiler(tmp_path):
    """The check above can fail: a real command loads torch and the commands module."""
    status, heavy, err = _imported_after(["partition", "zoo:hybrid", "--input-shape", "1,3,16,16",
                                          "--out", str(tmp_path)])
    assert status == 0, err
    assert "torch" in heavy and "qcompiler.tools.cli_commands" in heavy


def test_the_help_constants_match_the_compiler():
    """The names the light parser spells itself are the zoo's and capture's."""
    assert list(cli.ZOO_NAMES) == zoo.names()
    assert cli.CAPTURES == capture.CAPTURES and cli.DEFAULT_CAPTURE == capture.DEFAULT_CAPTURE


def test_the_lazy_package_still_exposes_the_api():
    code = ("import qcompiler, sys; assert 'torch' not in sys.modules; "
            "from qcompiler import compile, partition, March, distributed; import qcompiler.compiled as c; "
            "assert compile is c.compile and qcompiler.load is c.load and qcompiler.ir.trace; "
            "assert set(qcompiler.__all__) <= set(dir(qcompiler)); "
            "from qcompiler.tools import QuantAnalysis, numeric_suite; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_one_call_prepare_module_is_callable_however_reached():
    """``qcompiler.quantization.prepare`` is callable (the guide's one-call prepare) without ``import
    qcompiler``'s eager imports: the module makes itself callable, and imports prepare_one_call when called."""
    code = ("import sys; from qcompiler.quantization import prepare; "
            "assert callable(prepare) and hasattr(prepare, 'prepare_qat_fx'); "
            "assert 'qcompiler.quantization.prepare_one_call' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_python_m_help_imports_no_torch():
    """``python -X importtime -m qcompiler.tools.cli compile --help``: torch is not among the imports."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "qcompiler.tools.cli", "compile", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--calib-images" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "qcompiler.march" in imported and "torch" not in imported and "numpy" not in imported
