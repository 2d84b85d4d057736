"""What ``qcompiler --help`` tells a newcomer, one march-spelling rule everywhere, and the factory hint."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch

import qcompiler
from qcompiler import zoo
from qcompiler.errors import ConfigError
from qcompiler.march import March, get_march, resolve_march, set_march
from qcompiler.quantization.prepare import prepare_calibration_fx
from qcompiler.tools.cli import main

COMMANDS = ("partition", "compile", "report")


def _help(capsys, command: str) -> str:
    assert main([command, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare on one line


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_default_march_and_the_zoo_models(capsys, command):
    text = _help(capsys, command)
    assert f"(default: {get_march().value})" in text and get_march() is March.BAYES
    assert "current default" not in text
    assert "bernoulli2, bayes, nash, in any letter case" in text
    m = re.search(r"zoo:NAME \(NAME one of ([\w, ]+)\)", text)
    assert m and m.group(1).split(", ") == zoo.names()


def test_report_help_has_target_sqnr(capsys):
    text = _help(capsys, "report")
    assert "--target-sqnr DB" in text and "predicted gain" in text


# ----------------------------------------------------------------------------- march spelling: any case


@pytest.mark.parametrize("spelling", ["Bayes", "BAYES", " bayes "])
def test_march_any_case_on_the_command_line(capsys, tmp_path, spelling):
    assert main(["partition", "zoo:hybrid", "--input-shape", "1,3,16,16", "--march", spelling,
                 "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "model.json").read_text())["march"] == "bayes"


def test_march_any_case_in_the_python_api():
    assert March("Bayes") is March.BAYES and March("BERNOULLI2") is March.BERNOULLI2
    assert resolve_march("BaYeS") is March.BAYES
    try:
        set_march("Bernoulli2")
        assert get_march() is March.BERNOULLI2
    finally:
        set_march("bayes")
    x = (torch.rand(1, 3, 16, 16),)
    gm = qcompiler.partition(zoo.get("hybrid"), x, march="BAYES")
    assert gm.meta["qc_march"] is March.BAYES
    cal = prepare_calibration_fx(zoo.get("hybrid"), None, hybrid=True, example_inputs=x, march="Bernoulli2")
    assert cal.meta["qc_march"] is March.BERNOULLI2


@pytest.mark.parametrize("call", [
    lambda: March("bays"),
    lambda: set_march("Bays"),
    lambda: qcompiler.partition(zoo.get("hybrid"), (torch.rand(1, 3, 16, 16),), march="bayes2"),
])
def test_unknown_march_is_a_config_error_listing_the_marches(call):
    with pytest.raises(ConfigError, match=r"unknown march .*; allowed: bernoulli2, bayes"):
        call()
    assert get_march() is March.BAYES  # a failed set_march leaves the default alone


# ----------------------------------------------------------------------------- a factory that is not there


def test_missing_factory_lists_the_callables_the_file_defines(capsys, tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(textwrap.dedent("""
        import torch.nn as nn
        from torch.nn import Linear  # imported, not defined here: not listed

        def build():
            return nn.Conv2d(3, 4, 1)

        def build_small():
            return nn.Conv2d(3, 2, 1)

        class Net(nn.Module):
            pass

        SIZE = 3
        _private = build
    """))
    code = main(["partition", f"{path}:biuld", "--input-shape", "1,3,8,8", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "has no attribute 'biuld'. Did you mean 'build'" in err
    assert err.rstrip().endswith("Callables defined in it: Net, build, build_small")


def test_missing_factory_in_a_file_without_callables(capsys, tmp_path):
    path = tmp_path / "empty_models.py"
    path.write_text("SIZE = 3\n")
    assert main(["partition", f"{path}:build", "--input-shape", "1,3", "--out", str(tmp_path / "o")]) == 2
    assert "It defines no callable: add a function that returns the nn.Module" in capsys.readouterr().err


def test_missing_factory_in_a_package_lists_a_capped_number(capsys, tmp_path):
    assert main(["partition", "torch.nn:Linaer", "--input-shape", "1,3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'Linear'" in err
    listed = err.split("Callables defined in it: ")[1]
    assert listed.count(",") == 20 and re.search(r"\.\.\. \(\+\d+\)$", listed.strip())
