"""The README runs as written: its python blocks (in order, one session) and its CLI synopsis (= --help)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qcompiler.march import March
from qcompiler.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# runs every block in one namespace, saying which block it is in first (a failure names it)
RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for i, code in enumerate(blocks, 1):
    print(f"--- README python block {i} of {len(blocks)}", file=sys.stderr, flush=True)
    exec(compile(code, f"README.md python block {i}", "exec"), namespace)
"""


def _fenced(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


def test_readme_has_the_blocks_it_promises():
    assert len(_fenced("python")) == 6
    assert "numeric debugging tools are next" not in README
    for folder in ("examples/", "tools/"):
        assert f"`{folder}`" in README
    assert "qcompiler.quantization.weight_rounding" in README  # where optimize_weight_rounding comes from


def test_readme_sets_up_before_the_tour():
    """A new reader meets the two set-up commands before any block that needs the package installed."""
    setup = README.index("## Set up and run")
    assert setup < README.index("```python") and setup < README.index("## Example")
    assert "bash scripts/setup.sh && python -m pytest -q" in README[setup:README.index("## Example")]


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
    blocks = _fenced("python")
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-c", RUNNER, "blocks.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # what the blocks' comments promise
    assert "partitions: 3 bpu, 3 cpu; BPU<->CPU boundary edges: 5" in proc.stdout.splitlines()
    assert "int16 advice (target output SQNR 30.00 dB)" in proc.stdout
    for written in ("out/hybrid/summary.txt", "out/hybrid/model.svg" if _has_dot() else "out/hybrid/model.dot",
                    "qa/report.html", "qa/compare_per_layer_out.csv", "out/r18/summary.txt",
                    "out/r18/model.onnx", "r18.qc", "model_check_result.txt", "qatvshbir/compare_per_layer_out.csv",
                    "floatvsqat/abnormal_layer_advisor.txt", "hbir_dir/statistic.txt"):
        assert (tmp_path / written).is_file(), written


def _has_dot() -> bool:
    return shutil.which("dot") is not None


# ----------------------------------------------------------------------------- CLI synopsis


def _synopsis() -> dict[str, str]:
    """``{command: its synopsis text}`` from the README's command-line block."""
    section = README[README.index("## The command line"):]
    block = re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)
    return {m.group(1): m.group(0) for m in re.finditer(r"^qcompiler (\w+) .*?(?=\n\n|\Z)", block, re.S | re.M)}


def _subparsers() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(sub.choices)


def _readme_value(text: str, option: str) -> str:
    m = re.search(rf"{re.escape(option)}[ =]([^\]\s]+)", text)
    assert m, f"README synopsis: {option} shows no value"
    return m.group(1)


def test_readme_cli_synopsis_matches_argparse():
    synopsis, parsers = _synopsis(), _subparsers()
    assert sorted(synopsis) == sorted(parsers)
    for command, parser in parsers.items():
        text = synopsis[command]
        shown = set(re.findall(r"--[a-z][a-z0-9-]*", text))
        actions = [a for a in parser._actions if a.option_strings and "--help" not in a.option_strings]
        assert shown == {a.option_strings[-1] for a in actions}, command
        for a in actions:
            option = a.option_strings[-1]
            # repeatable options are shown with "..."
            assert (a.__class__.__name__ == "_AppendAction") == bool(
                re.search(rf"\[{re.escape(option)} [^\]]*\]\.\.\.", text)), (command, option)
            if a.nargs == 0:  # a flag: shown without a value
                assert not re.search(rf"{option} [A-Za-z]", text), (command, option)
                continue
            value = _readme_value(text, option)
            if option == "--march":
                expected = {m.value for m in March}
            elif a.choices:
                expected = set(a.choices)
            else:
                assert value == a.metavar, (command, option, value, a.metavar)
                continue
            assert set(value.split("|")) == expected, (command, option)
        required = {a.option_strings[-1] for a in actions if a.required}
        for option in required:  # shown outside brackets
            assert re.search(rf"(^|\s){re.escape(option)} ", text) and f"[{option}" not in text, (command, option)
        assert (" CONFIG.toml " if command == "build" else " MODEL ") in text


@pytest.mark.parametrize("old, new", [
    (" [--input-dtype float32|int64]...", ""),          # an option left out (as --input-dtype once was)
    (" [--target-sqnr DB]", ""),
    ("[--march bayes|bernoulli2|nash]", "[--march bayes|bernoulli2]"),  # a march missing
    ("[--dump-passes] --out DIR", "[--dump-passes] [--out DIR]"),  # a required option shown optional
    ("[--calib-limit N]\n    [--resize", "[--calib-limit N]...\n    [--resize"),  # not repeatable
    ("--weight-rounding]", "--weight-rounding] [--dump-passes]"),  # an option compile does not have
])
def test_synopsis_check_catches_a_stale_readme(monkeypatch, old, new):
    assert old in README
    monkeypatch.setattr(sys.modules[__name__], "README", README.replace(old, new, 1))
    with pytest.raises(AssertionError):
        test_readme_cli_synopsis_matches_argparse()
