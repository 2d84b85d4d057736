"""Raw inputs from files, names and the environment become typed errors (issue 37).

Bad-case files and ``--qconfig`` / ``--hybrid`` files that are not regular files (a FIFO,
``/dev/zero``), too big or nested too deep; qconfig fields of the wrong JSON type; module type
names, which are matched against the model and never imported; ``QCOMPILER_DIST_TIMEOUT``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import fifo_watch

from qcompiler.errors import ArtifactError, ConfigError, QCompilerWarning
from qcompiler.hybrid import parse_hybrid_dict
from qcompiler.quantization import sync
from qcompiler.tools import config_file
from qcompiler.tools.case_file import case_bytes, load_case
from qcompiler.tools.cli import main
from qcompiler.tools.config_file import read_hybrid_file, read_qconfig_file

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT = 120  # seconds a child python (importing torch) may take on a busy machine


def _child(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code args...`` from the repository root; fails the test if it does not end in time."""
    try:
        return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT, env=dict(os.environ if env is None else env, PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not end within {CHILD_TIMEOUT} s (blocked?)")


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


def _raises_without_blocking(fifo: Path, call, error):
    """``call()`` raises ``error``, and does so without waiting for a writer on ``fifo``."""
    with fifo_watch(fifo) as released, pytest.raises(error) as info:
        call()
    assert not released.is_set(), "the call blocked reading the FIFO"
    return info


# ----------------------------------------------------------------------------- bad-case files


def test_load_case_refuses_a_fifo_without_blocking(tmp_path):
    """safe_open holds the GIL while it opens the path, so the check runs in a child with a timeout."""
    fifo = _fifo(tmp_path)
    code = ("import sys\nfrom qcompiler.errors import ArtifactError\nfrom qcompiler.tools.case_file import load_case\n"
            "try:\n    load_case(sys.argv[1])\nexcept ArtifactError as exc:\n    print(exc)\n")
    run = _child(code, str(fifo))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"{fifo}: not a regular file (a FIFO); give the path of a bad-case file"


@pytest.mark.parametrize("make, kind", [(lambda p: p.mkdir(), "a directory"), (None, "a character device")])
def test_load_case_refuses_other_non_regular_files(tmp_path, make, kind):
    path = Path("/dev/null") if make is None else tmp_path / "case"
    if make is not None:
        make(path)
    with pytest.raises(ArtifactError, match=f"^{path}: not a regular file \\({kind}\\)"):
        load_case(path)


def test_load_case_still_reads_a_regular_file_and_a_missing_one_is_an_artifact_error(tmp_path):
    case = (torch.arange(6.0).reshape(2, 3), {"k": [1, "s"]})
    path = tmp_path / "bad_case.safetensors"
    path.write_bytes(case_bytes(case))
    got = load_case(path)
    assert torch.equal(got[0], case[0]) and got[1] == case[1]
    with pytest.raises(ArtifactError, match="absent.safetensors: cannot read it"):
        load_case(tmp_path / "absent.safetensors")


# ----------------------------------------------------------------------------- --qconfig / --hybrid files


def _write(tmp_path: Path, data, name: str = "cfg.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("field, value", [("observer", ["percentile"]), ("observer", {"a": 1}),
                                          ("dtype", ["qint8"]), ("dtype", {"qint16": True}), ("observer", 3)])
@pytest.mark.parametrize("where", ["global", "module_name"])
def test_qconfig_field_of_the_wrong_type_names_the_key_and_the_allowed_values(tmp_path, field, value, where):
    entry = {field: value}
    data = {"global": entry} if where == "global" else {"module_name": {"fc": entry}}
    path = _write(tmp_path, data)
    key = "['global']" if where == "global" else "['module_name']['fc']"
    allowed = config_file.DTYPES if field == "dtype" else config_file.OBSERVERS
    with pytest.raises(ConfigError) as info:
        read_qconfig_file(path)
    message = str(info.value)
    assert message.startswith(f"--qconfig {path}: {key}['{field}']: ")
    assert "is not one of " + ", ".join(repr(a) for a in allowed) in message


def test_qconfig_fields_of_the_right_type_still_read(tmp_path):
    path = _write(tmp_path, {"global": {"dtype": "qint16"}, "module_name": {"fc": {"observer": "percentile"}}})
    result = read_qconfig_file(path)
    assert [name for name, _ in result["module_name"]] == ["fc"]
    assert str(result[""].activation().dtype) == "qint16"


@pytest.mark.parametrize("reader, option", [(read_qconfig_file, "--qconfig"), (read_hybrid_file, "--hybrid")])
@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deeply_nested_json_is_a_config_error(tmp_path, reader, option, depth):
    path = _write(tmp_path, "[" * depth + "]" * depth)
    with pytest.raises(ConfigError, match=f"^{option} {path}: nested too deep to be a config file "
                                          r"\(qconfig and hybrid files nest at most 4 levels\)$"):
        reader(path)


def test_json_nested_a_little_still_reads_and_reports_its_real_problem(tmp_path):
    path = _write(tmp_path, {"module_type": [[[["torch.nn.ReLU"]]]]})
    with pytest.raises(ConfigError, match=r"\['module_type'\] must be a list of strings, got \[\[\[\["):
        read_hybrid_file(path)


@pytest.mark.parametrize("reader, option", [(read_qconfig_file, "--qconfig"), (read_hybrid_file, "--hybrid")])
def test_a_device_is_refused_before_it_is_read(reader, option):
    with pytest.raises(ConfigError, match=f"^{option} /dev/zero: not a regular file \\(a character device\\); "):
        reader("/dev/zero")


@pytest.mark.parametrize("reader, option", [(read_qconfig_file, "--qconfig"), (read_hybrid_file, "--hybrid")])
def test_a_fifo_is_refused_without_blocking(tmp_path, reader, option):
    fifo = _fifo(tmp_path)
    info = _raises_without_blocking(fifo, lambda: reader(fifo), ConfigError)
    assert str(info.value).startswith(f"{option} {fifo}: not a regular file (a FIFO); ")


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"^--qconfig {tmp_path}: not a regular file \\(a directory\\)"):
        read_qconfig_file(tmp_path)


def test_a_file_over_the_cap_is_refused_unread(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as f:  # sparse: no disk used, and never read
        f.truncate(config_file.MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match=f"^--qconfig {path}: {config_file.MAX_CONFIG_BYTES + 1} bytes, more than "
                                          f"the {config_file.MAX_CONFIG_BYTES} a config file may have"):
        read_qconfig_file(path)


def test_a_file_at_the_cap_is_read(tmp_path):
    text = json.dumps({"module_name": ["fc"]})
    path = _write(tmp_path, text + " " * (config_file.MAX_CONFIG_BYTES - len(text)))
    assert path.stat().st_size == config_file.MAX_CONFIG_BYTES
    assert read_hybrid_file(path) == {"module_name": ["fc"], "module_type": []}


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("option", ["--qconfig", "--hybrid"])
@pytest.mark.parametrize("content", ["deep", "observer-list", "/dev/zero"])
def test_cli_prints_one_error_line_with_status_2(capsys, tmp_path, option, content):
    if content == "/dev/zero":
        path = Path("/dev/zero")
    elif content == "deep":
        path = _write(tmp_path, "[" * 100_000 + "]" * 100_000)
    else:
        path = _write(tmp_path, {"global": {"observer": ["percentile"]}} if option == "--qconfig"
                      else {"module_type": [["torch.nn.ReLU"]]})
    code, out, err = _cli(capsys, "compile", "zoo:hybrid", option, str(path), "--calib-random", "1",
                          "--out", str(tmp_path / "out"))
    assert code == 2, err
    assert err.startswith(f"error: {option} {path}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------- module type names


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.act = nn.PReLU()

    def forward(self, x):
        return self.act(self.block(x))


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """An importable module that leaves a marker file when it is imported; its name."""
    marker = tmp_path / "imported"
    (tmp_path / "qc_import_probe.py").write_text(
        "import pathlib, torch.nn as nn\n"
        f"pathlib.Path({str(marker)!r}).write_text('yes')\n"
        "class Probe(nn.Module):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("qc_import_probe", None)
    yield marker
    sys.modules.pop("qc_import_probe", None)


def test_a_module_type_name_never_imports(probe):
    with pytest.raises(ConfigError) as info:
        parse_hybrid_dict({"module_type": ["qc_import_probe.Probe"]}, Net())
    assert not probe.exists(), "resolving the name imported the module"
    message = str(info.value)
    assert message.startswith("hybrid_dict['module_type'][0]: cannot import module type 'qc_import_probe.Probe': ")
    for name in ("test_config_inputs.Net", "test_config_inputs.Block", "torch.nn.modules.conv.Conv2d",
                 "torch.nn.modules.activation.PReLU"):
        assert name in message


def test_a_module_type_name_without_a_model_never_imports(probe):
    with pytest.raises(ConfigError, match="cannot import module type 'qc_import_probe.Probe'"):
        parse_hybrid_dict({"module_type": ["qc_import_probe.Probe"]}, None)
    assert not probe.exists()


def test_a_loaded_module_type_that_is_not_in_the_model_warns_as_a_class_does(probe):
    import qc_import_probe  # noqa: F401  (now loaded: the name resolves, without another import)
    probe.unlink()
    with pytest.warns(QCompilerWarning, match="no module of type Probe"):
        got = parse_hybrid_dict({"module_type": ["qc_import_probe.Probe"]}, Net())
    assert got.module_types == (sys.modules["qc_import_probe"].Probe,) and not probe.exists()


@pytest.mark.parametrize("name", ["this.X", "os.system", "sys", "antigravity.fly", "torch.nn.Conv9d",
                                  "torch.nn.functional.relu", "test_config_inputs.Net.forward"])
def test_names_that_are_not_module_classes_are_config_errors(capsys, name):
    loaded = set(sys.modules)
    with pytest.raises(ConfigError, match=r"^hybrid_dict\['module_type'\]\[0\]: (cannot import module type|expected)"):
        parse_hybrid_dict({"module_type": [name]}, Net())
    assert set(sys.modules) == loaded
    assert capsys.readouterr().out == ""  # `this` prints the Zen of Python when imported


@pytest.mark.parametrize("name, cls", [
    ("torch.nn.Conv2d", nn.Conv2d),  # a public alias, reached through loaded modules
    ("torch.nn.modules.conv.Conv2d", nn.Conv2d),  # the class's own module
    ("torch.nn.modules.conv._ConvNd", nn.modules.conv._ConvNd),  # a base class of one in the model
    ("test_config_inputs.Block", Block),  # the model's own class, by __module__.__qualname__
])
def test_names_of_the_models_classes_and_their_bases_resolve(name, cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each matches a module of the model: no warning
        got = parse_hybrid_dict({"module_type": [name]}, Net())
    assert got.module_types == (cls,)


def test_a_local_class_resolves_by_its_qualified_name():
    class Local(nn.Module):
        def forward(self, x):
            return x

    model = nn.Sequential(Local())
    assert parse_hybrid_dict({"module_type": [f"{__name__}.{Local.__qualname__}"]}, model).module_types == (Local,)


def test_cli_hybrid_module_type_is_matched_not_imported(capsys, tmp_path, probe):
    code, out, err = _cli(capsys, "partition", "zoo:hybrid", "--hybrid-module-type", "this.X",
                          "--hybrid-module-type", "qc_import_probe.Probe", "--out", str(tmp_path / "out"))
    assert code == 2 and out == "" and not probe.exists()
    assert err.startswith("error: --hybrid-module-type 'this.X': cannot import module type 'this.X': ")
    assert "qcompiler.zoo.hybrid._SeluModule" in err and err.count("\n") == 1


def test_cli_hybrid_file_module_type_is_matched_not_imported(capsys, tmp_path, probe):
    path = _write(tmp_path, {"hybrid": {"module_type": ["qcompiler.zoo.hybrid._SeluModule", "this.X"]}})
    code, out, err = _cli(capsys, "compile", "zoo:hybrid", "--hybrid", str(path), "--calib-random", "1",
                          "--out", str(tmp_path / "out"))
    assert code == 2 and out == "" and "Beautiful is better than ugly" not in out + err
    assert err.startswith(f"error: --hybrid {path}: ['module_type'][1]: cannot import module type 'this.X': ")


def _module_type_reasons(out_dir: Path, name: str) -> set:
    nodes = json.loads((out_dir / f"{name}.json").read_text())["nodes"]
    return {(n["node"], n["placement"], n["reason"]) for n in nodes if "module_type" in str(n.get("reason"))}


def test_cli_module_types_of_the_model_still_work(capsys, tmp_path):
    code, out, err = _cli(capsys, "partition", "zoo:hybrid", "--march", "bayes", "--hybrid-module-type",
                          "torch.nn.PReLU", "--out", str(tmp_path / "p"))
    assert code == 0, err
    assert {reason for _, _, reason in _module_type_reasons(tmp_path / "p", "model")} == {
        "hybrid_dict module_type PReLU"}
    path = _write(tmp_path, {"hybrid": {"module_type": ["qcompiler.zoo.hybrid._SeluModule"]}})
    code, out, err = _cli(capsys, "compile", "zoo:hybrid", "--hybrid", str(path), "--calib-random", "1",
                          "--out", str(tmp_path / "c"))
    assert code == 0, err
    assert _module_type_reasons(tmp_path / "c", "model") == {("selu_2", "cpu", "hybrid_dict module_type _SeluModule")}


# ----------------------------------------------------------------------------- QCOMPILER_DIST_TIMEOUT


@pytest.mark.parametrize("raw, seconds", [(None, 300.0), ("12.5", 12.5), (" 7 ", 7.0), ("1e3", 1000.0)])
def test_dist_timeout_from_the_environment(raw, seconds):
    env = {} if raw is None else {sync.TIMEOUT_ENV: raw}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sync.timeout_from_env(env) == seconds


@pytest.mark.parametrize("raw", ["abc", "-5", "0", "inf", "nan", "-inf", "", "1e400"])
def test_a_bad_dist_timeout_warns_and_the_default_is_used(raw):
    with pytest.warns(QCompilerWarning) as record:
        seconds = sync.timeout_from_env({sync.TIMEOUT_ENV: raw})
    assert seconds == sync.BUILT_IN_TIMEOUT and math.isfinite(seconds)
    assert [str(w.message) for w in record] == [
        f"QCOMPILER_DIST_TIMEOUT={raw!r} is not a positive finite number of seconds (e.g. 600); "
        f"using the default {sync.BUILT_IN_TIMEOUT:g} s"]


@pytest.mark.parametrize("raw", ["abc", "-5", "inf", "nan"])
def test_import_qcompiler_never_fails_on_the_dist_timeout(raw):
    code = ("import qcompiler, qcompiler.distributed as d\n"
            "from qcompiler.quantization import sync\n"
            "print(sync.DEFAULT_TIMEOUT, d.DEFAULT_TIMEOUT)\n")
    run = _child(code, env=dict(os.environ, QCOMPILER_DIST_TIMEOUT=raw))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["300.0", "300.0"]
    assert f"QCOMPILER_DIST_TIMEOUT={raw!r} is not a positive finite number of seconds" in run.stderr


def test_a_good_dist_timeout_is_used_at_import():
    run = _child("from qcompiler.quantization import sync; print(sync.DEFAULT_TIMEOUT)",
                 env=dict(os.environ, QCOMPILER_DIST_TIMEOUT="42"))
    assert (run.returncode, run.stdout.strip(), run.stderr) == (0, "42.0", "")


@pytest.mark.parametrize("timeout", [-5, 0, math.inf, math.nan, "10"])
def test_a_bad_timeout_argument_is_a_config_error(timeout):
    with pytest.raises(ConfigError, match=r"^sync_observers: timeout must be a positive finite number of seconds, "
                                          f"got {timeout!r}"):
        sync.sync_observers(nn.Linear(2, 2), timeout=timeout)
    with pytest.raises(ConfigError, match=r"^evaluate: timeout must be a positive finite number of seconds"):
        sync.require_batches(1, "evaluate", timeout=timeout)
    sync.require_batches(1, "evaluate", timeout=5)  # a good one, without a process group: nothing to wait for


@pytest.mark.slow
def test_a_bad_dist_timeout_does_not_fail_a_healthy_two_rank_run(tmp_path):
    """Two gloo ranks calibrate and convert (one sync point) with QCOMPILER_DIST_TIMEOUT=-5: before,
    the sync failed at once with a CollectiveError blaming rank 1; now each rank warns and syncs."""
    from test_distributed import launch  # tests/ is on sys.path under pytest

    runs = launch("stall", 2, tmp_path, timeout=300, QCOMPILER_DIST_TIMEOUT="-5", STALL_SECONDS="0")
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert [torch.load(tmp_path / f"rank{r}.pt")["error"] for r in range(2)] == ["no error", "no error"]
    for r in runs:
        assert "QCOMPILER_DIST_TIMEOUT='-5' is not a positive finite number of seconds" in r.stderr
