"""Bad inputs to the CLI, the config files and the distributed helpers (issue 37, probe cases 12-21).

Each bad input is a typed qcompiler error (for the CLI: one ``error:`` line on stderr, exit
status 2, no traceback, nothing written) naming the option, key, variable or argument and the
fix; next to each, the good input still works.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from qcompiler import collectives, distributed
from qcompiler.errors import ConfigError
from qcompiler.calib_data import read_arrays
from qcompiler.tools import cli, cli_commands
from qcompiler.tools.cli import main
from qcompiler.tools.config_file import read_hybrid_file, read_qconfig_file, write_config_file

HYB = ("zoo:hybrid", "--input-shape", "1,3,16,16")


def _files(root) -> dict:
    """Every file and folder under ``root`` with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _usage_error(capsys, *argv) -> str:
    """Run the CLI; assert one ``error:`` line and status 2; return the line."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err + out
    return err.strip()


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the CLI starts loading the model: the arguments must be refused first."""
    def load_model(*args, **kwargs):
        raise AssertionError("the CLI loaded the model before checking its arguments")
    monkeypatch.setattr(cli_commands, "load_model", load_model)


@pytest.fixture
def environ(monkeypatch):
    """Set (str) or unset (None) torch.distributed variables for the test."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)

    def set_env(**values):
        for k, v in values.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
    return set_env


# ----------------------------------------------------------------------------- 12: damaged --calib-data


def _damaged(tmp_path, kind: str):
    good = tmp_path / "good.npz"
    np.savez(good, np.random.default_rng(0).random((4, 3, 16, 16), dtype=np.float32))
    data = bytearray(good.read_bytes())
    if kind == "garbage":
        data = bytearray(b"PK\x03\x04garbage")
    elif kind == "truncated":
        data = data[:len(data) // 2]
    elif kind == "crc":
        data[100] ^= 0xFF  # inside the array's bytes: the member's CRC-32 fails on reading
    else:  # a compressed member whose deflate stream is broken (zlib.error)
        np.savez_compressed(good, np.random.default_rng(0).random((50, 3, 16, 16), dtype=np.float32))
        data = bytearray(good.read_bytes())
        for i in (90, 95, 100):
            data[i] ^= 0xFF
    path = tmp_path / f"{kind}.npz"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("kind", ["garbage", "truncated", "crc", "deflate"])
def test_damaged_calib_zip_is_one_error_line(capsys, tmp_path, kind):
    path = _damaged(tmp_path, kind)
    before = _files(tmp_path)
    line = _usage_error(capsys, "compile", *HYB, "--calib-data", path, "--out", tmp_path / "o")
    assert line.startswith(f"error: --calib-data {path}: ")
    assert "cannot read it as an .npz file" in line or "is damaged" in line
    assert "np.savez" in line  # the fix
    assert _files(tmp_path) == before


def test_intact_calib_zip_still_reads(tmp_path):
    path = tmp_path / "good.npz"
    np.savez(path, np.ones((4, 3, 16, 16), np.float32))
    (x,) = read_arrays(path)
    assert x.shape == (4, 3, 16, 16) and bool((x == 1).all())


# ----------------------------------------------------------------------------- 13: torchrun variables


@pytest.mark.parametrize("values, fragment", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': it must be a whole number at least 1 (the number of processes)"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='': it must be a whole number at least 1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': it must be a whole number at least 1"),
    ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2': it must be a whole number at least 1"),
    ({"WORLD_SIZE": "2", "RANK": "one"}, "RANK='one': it must be a whole number from 0 to 1"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK='2': it must be a whole number from 0 to 1 (this process's rank of "
                                       "WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1': it must be a whole number from 0 to 1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x': it must be a whole number from 0 to 1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "3"}, "LOCAL_RANK='3': it must be a whole number from 0 to 1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "http"}, "MASTER_PORT='http': it must be a whole number from 1"),
])
def test_join_torchrun_names_a_bad_variable(environ, values, fragment):
    environ(**{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **values})
    with pytest.raises(ConfigError) as info:
        distributed.join_torchrun()
    assert fragment in str(info.value)
    assert "launch with torchrun" in str(info.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("world", [None, "1", " 1 "])
def test_join_torchrun_single_process_is_still_nothing_to_do(environ, world):
    environ(WORLD_SIZE=world, RANK="0")
    assert distributed.join_torchrun() is False


def test_cli_world_size_not_a_number_is_one_error_line(capsys, tmp_path, environ, no_work):
    environ(WORLD_SIZE="two")
    line = _usage_error(capsys, "compile", *HYB, "--out", tmp_path / "o")
    assert line.startswith("error: WORLD_SIZE='two': it must be a whole number")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- 14: --apply checked first


@pytest.mark.parametrize("target, fragment", [
    ("sub", "--apply: 'sub' is a directory; give a file path"),
    ("notes.txt/f.json", "--apply: cannot write 'notes.txt/f.json': 'notes.txt' is a file, not a directory"),
    ("", "--apply: the path is empty; give a file path"),
])
def test_report_apply_target_is_checked_before_any_work(capsys, tmp_path, monkeypatch, no_work, target, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.txt").write_text("keep me\n")
    before = _files(tmp_path)
    line = _usage_error(capsys, "report", *HYB, "--apply", target, "--out", "o")
    assert fragment in line
    assert _files(tmp_path) == before  # no o/, notes.txt untouched


def test_apply_target_that_can_be_written_passes_and_leaves_nothing(tmp_path):
    assert cli.check_apply_target(str(tmp_path / "new" / "fix.json")) == tmp_path / "new" / "fix.json"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 15: a directory as model file


def test_model_spec_naming_a_directory_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    line = _usage_error(capsys, "partition", "sub/:build", "--input-shape", "1,3,8,8", "--out", "o")
    assert "model file 'sub' is a directory" in line
    assert "'path/to/file.py:factory'" in line
    assert "does not exist" not in line


def test_model_spec_naming_a_package_directory_suggests_the_module_spec(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    line = _usage_error(capsys, "partition", "pkg/:build", "--input-shape", "1,3,8,8", "--out", "o")
    assert "model file 'pkg' is a directory" in line and "write 'pkg:FACTORY'" in line


def test_model_spec_naming_a_missing_file_still_says_it_does_not_exist(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _usage_error(capsys, "partition", "absent/m.py:build", "--input-shape", "1,3,8,8", "--out", "o")
    assert "model file 'absent/m.py' does not exist" in line


def test_model_spec_naming_a_file_still_loads(tmp_path):
    (tmp_path / "m_cli_dir_case.py").write_text("import torch\ndef build():\n    return torch.nn.ReLU()\n")
    assert isinstance(cli_commands.load_factory_model(f"{tmp_path}/m_cli_dir_case.py:build"), torch.nn.ReLU)


# ----------------------------------------------------------------------------- 16: --calib-batch-size


@pytest.mark.parametrize("flags", [("--calib-random", "1"), ("--calib-data", "absent.npz"), ()])
@pytest.mark.parametrize("size", ["-1", "0"])
def test_calib_batch_size_below_one_is_refused_whatever_the_data(capsys, tmp_path, no_work, flags, size):
    line = _usage_error(capsys, "compile", *HYB, *flags, "--calib-batch-size", size, "--out", tmp_path / "o")
    assert line == f"error: --calib-batch-size must be at least 1, got {size}"
    assert not (tmp_path / "o").exists()


def test_calib_batch_size_one_is_accepted(tmp_path):
    args = cli.build_parser().parse_args(["compile", *HYB, "--calib-random", "2", "--calib-batch-size", "1",
                                          "--out", str(tmp_path / "o")])
    batches = cli_commands.calibration_batches(args, (torch.zeros(1, 3, 16, 16),)).batches
    assert len(batches) == 2 and batches[0][0].shape == (1, 3, 16, 16)


# ----------------------------------------------------------------------------- 17: config file paths and values


@pytest.mark.parametrize("reader, option", [(read_qconfig_file, "--qconfig"), (read_hybrid_file, "--hybrid")])
@pytest.mark.parametrize("path, fragment", [
    (None, "the path must be a str or os.PathLike, got NoneType"),
    (5, "the path must be a str or os.PathLike, got int"),
    (b"c.json", "the path must be a str or os.PathLike, got bytes"),
    ("", "the path is empty; give the path of a JSON file"),
])
def test_reading_a_config_from_no_path_is_a_config_error(reader, option, path, fragment):
    with pytest.raises(ConfigError) as info:
        reader(path)
    assert str(info.value).startswith(f"{option}: {fragment}")


@pytest.mark.parametrize("path, config, fragment", [
    (None, {}, "--apply: the path must be a str or os.PathLike, got NoneType"),
    ("", {}, "--apply: the path is empty; give a file path"),
    ("c.json", {"a": object()}, "--apply c.json: ['a'] is of type object, which JSON cannot hold"),
    ("c.json", {"qconfig": {"module_name": {"fc": {"gain": float("nan")}}}},
     "--apply c.json: ['qconfig']['module_name']['fc']['gain'] is nan, which JSON cannot hold; give a finite number"),
    ("c.json", {"hybrid": {"module_name": [float("inf")]}}, "['hybrid']['module_name'][0] is inf"),
    ("c.json", {1: []}, "--apply c.json: key 1 in the config is of type int; JSON object keys are strings"),
    ("c.json", [1], "--apply c.json: the config must be a dict"),
])
def test_write_config_file_refuses_bad_input_and_writes_nothing(tmp_path, monkeypatch, path, config, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        write_config_file(path, config)
    assert fragment in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_write_config_file_refuses_a_config_that_contains_itself(tmp_path):
    config: dict = {"qconfig": {}}
    config["qconfig"]["self"] = config
    with pytest.raises(ConfigError, match="contains itself"):
        write_config_file(tmp_path / "c.json", config)
    assert list(tmp_path.iterdir()) == []


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_written_config_is_strict_json_and_reads_back(tmp_path):
    """What ``apply_advice`` writes (tools/root_cause.fixes_json) reads as both sections."""
    config = {"qconfig": {"module_name": {"conv3": {"dtype": "qint16"}, "fc": {"observer": "percentile"}}},
              "hybrid": {"module_name": ["conv1.conv"]}}
    path = write_config_file(tmp_path / "fix.json", config)
    assert _strict_json(path.read_text()) == config
    q = read_qconfig_file(path)
    assert [name for name, _ in q["module_name"]] == ["conv3", "fc"]
    assert read_hybrid_file(path) == {"module_name": ["conv1.conv"], "module_type": []}


# ----------------------------------------------------------------------------- 18: unknown sections and keys


def _json(tmp_path, data, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("reader, option", [(read_qconfig_file, "--qconfig"), (read_hybrid_file, "--hybrid")])
@pytest.mark.parametrize("data, key", [
    ({"qconfig": {"global": {"dtype": "qint16"}}, "hybird": {"module_name": ["fc"]}}, "hybird"),
    ({"qconfig": {}, "hybrid": {}, "notes": "by hand"}, "notes"),
    ({"hybrid": {"module_name": ["fc"]}, "global": {"dtype": "qint16"}}, "global"),
])
def test_unknown_key_next_to_a_section_is_an_error(tmp_path, reader, option, data, key):
    path = _json(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        reader(path)
    message = str(info.value)
    assert message.startswith(f"{option} {path}: unknown key {key!r}; allowed: 'qconfig', 'hybrid'")
    if key == "hybird":
        assert message.endswith("did you mean 'hybrid'?")


def test_a_typo_d_section_alone_is_an_error_not_an_empty_config(tmp_path):
    path = _json(tmp_path, {"hybird": {"module_name": ["fc"]}})
    with pytest.raises(ConfigError) as info:
        read_hybrid_file(path)
    assert "unknown key 'hybird'; allowed: 'module_name', 'module_type' (or a 'hybrid' section)" in str(info.value)


def test_unknown_key_in_a_flat_file_suggests_the_close_one(tmp_path):
    path = _json(tmp_path, {"module_names": ["fc"]})
    with pytest.raises(ConfigError, match=r"unknown key 'module_names'.*did you mean 'module_name'\?"):
        read_hybrid_file(path)


def test_cli_hybrid_file_with_a_typo_d_section_is_one_error_line(capsys, tmp_path, monkeypatch):
    path = _json(tmp_path, {"qconfig": {}, "hybird": {"module_name": ["conv3"]}})
    line = _usage_error(capsys, "compile", *HYB, "--calib-random", "1", "--hybrid", path, "--out", tmp_path / "o")
    assert f"--hybrid {path}: unknown key 'hybird'" in line
    assert not (tmp_path / "o").exists()


def test_good_config_files_still_read(tmp_path):
    one_section = _json(tmp_path, {"qconfig": {"global": {"dtype": "qint16"}}}, "q.json")
    assert read_hybrid_file(one_section) == {"module_name": [], "module_type": []}  # the file has no hybrid part
    assert read_qconfig_file(one_section)[""] is not None
    flat = _json(tmp_path, {"module_name": ["fc"], "module_type": ["torch.nn.PReLU"]}, "h.json")
    assert read_hybrid_file(flat) == {"module_name": ["fc"], "module_type": ["torch.nn.PReLU"]}
    flat_q = _json(tmp_path, {"global": {"observer": "percentile"}, "module_name": {"fc": {"dtype": "qint16"}}})
    assert [n for n, _ in read_qconfig_file(flat_q)["module_name"]] == ["fc"]


# ----------------------------------------------------------------------------- 19: shard


@pytest.mark.parametrize("rank, world, fragment", [
    (0, 0, "shard: world must be a positive int (the number of ranks), got 0"),
    (0, -1, "shard: world must be a positive int (the number of ranks), got -1"),
    (0, 2.0, "shard: world must be a positive int (the number of ranks), got 2.0"),
    (0, True, "shard: world must be a positive int (the number of ranks), got True"),
    ("0", 1, "shard: rank must be an int from 0 to 0 (world=1), got '0'"),
    (-1, 2, "shard: rank must be an int from 0 to 1 (world=2), got -1"),
    (2, 2, "shard: rank must be an int from 0 to 1 (world=2), got 2"),
    (False, 2, "shard: rank must be an int from 0 to 1 (world=2), got False"),
])
def test_shard_refuses_a_bad_rank_or_world(rank, world, fragment):
    with pytest.raises(ConfigError) as info:
        distributed.shard([1, 2, 3], rank=rank, world=world)
    assert str(info.value) == fragment


def test_shard_refuses_items_that_are_not_iterable():
    with pytest.raises(ConfigError, match="shard: items must be iterable .*, got int"):
        distributed.shard(5, rank=0, world=1)


def test_shards_of_every_rank_split_the_items_exactly():
    items = list(range(7))
    shares = [distributed.shard(items, rank=r, world=3) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert distributed.shard(iter(items), rank=np.int64(1), world=np.int64(3)) == [1, 4]
    assert distributed.shard(items) == items  # no process group: everything


# ----------------------------------------------------------------------------- 20: evaluate


X = torch.rand(5, 3, generator=torch.Generator().manual_seed(0))
Y = torch.arange(5)
LINEAR = torch.nn.Linear(3, 2)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(zip(X, Y))


def _metric(outputs, targets):
    return outputs.shape, targets.tolist()


@pytest.mark.parametrize("model, loader, fragment", [
    (LINEAR, DataLoader(TensorDataset(X[:0], Y[:0]), batch_size=2),
     "evaluate: loader.dataset is empty; the metric needs at least one (input, target) sample"),
    (LINEAR, DataLoader(iter([X]), batch_size=None),
     "evaluate: loader.dataset must be a map-style dataset with len() and dataset[i]"),
    (LINEAR, DataLoader(_Stream(), batch_size=2), "got _Stream; evaluate splits it over the ranks by index"),
    (LINEAR, DataLoader(TensorDataset(X, Y), batch_size=None),
     "evaluate: the DataLoader has batch_size=None (automatic batching off)"),
    (5, DataLoader(TensorDataset(X, Y), batch_size=2),
     "evaluate: model must be callable (a float, fake-quant, converted or compiled model), got int"),
])
def test_evaluate_refuses_what_it_cannot_run(model, loader, fragment):
    with pytest.raises(ConfigError) as info:
        distributed.evaluate(model, loader, _metric, progress=False)
    assert fragment in str(info.value)


@pytest.mark.parametrize("dataset", [TensorDataset(X, Y), list(zip(X, Y))])
def test_evaluate_still_runs_a_map_style_dataset(dataset):
    shape, targets = distributed.evaluate(LINEAR, DataLoader(dataset, batch_size=2), _metric, progress=False)
    assert shape == (5, 2) and targets == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------- 21: all_reduce op


@pytest.mark.parametrize("op", ["avg", "SUM", None, ["sum"]])
def test_all_reduce_refuses_an_unknown_op_without_a_group(op):
    assert not collectives.active()
    with pytest.raises(ConfigError) as info:
        collectives.all_reduce(torch.ones(2), op, "x")
    assert str(info.value) == f"all_reduce for x: unknown op {op!r}; allowed: 'max', 'min', 'sum'"


@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_all_reduce_known_ops_still_return_the_tensor_without_a_group(op):
    t = torch.tensor([1.0, 2.0])
    assert collectives.all_reduce(t, op, "x") is t
