"""Tests of the ``qcompiler`` command line (qcompiler.tools.cli), mostly in-process via ``main``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qcompiler.tools.cli import main

SUMMARY = "partitions: 3 bpu, 3 cpu; BPU<->CPU boundary edges: 5"
HYBRID_FLAGS = [
    "--march", "bayes",
    "--hybrid-module-name", "conv1.conv",
    "--hybrid-module-name", "conv3",
    "--hybrid-module-type", "qcompiler.zoo.hybrid._SeluModule",
]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_usage_error(code, out, err):
    assert code == 2
    assert err.startswith("error: ")
    assert "Traceback" not in err and "Traceback" not in out


def test_partition_zoo_hybrid(capsys, tmp_path):
    out_dir = tmp_path / "dump"
    code, out, err = _run(capsys, "partition", "zoo:hybrid", *HYBRID_FLAGS, "--dump-passes", "--out", str(out_dir))
    assert code == 0, err
    assert SUMMARY in out.splitlines()
    for name in ("bpu0", "cpu0", "bpu1", "cpu1", "bpu2", "cpu2"):
        assert name in out
    for f in ("model.code.txt", "model.table.txt", "model.json", "model.dot", "summary.txt"):
        assert (out_dir / f).is_file(), f
        assert str(out_dir / f) in out
    assert (out_dir / "summary.txt").read_text().splitlines()[0] == SUMMARY
    data = json.loads((out_dir / "model.json").read_text())
    assert [p["name"] for p in data["partitions"]] == ["bpu0", "cpu0", "bpu1", "cpu1", "bpu2", "cpu2"]
    conv3 = next(n for n in data["nodes"] if n["node"] == "conv3")
    assert conv3["placement"] == "cpu"
    assert sorted(p.name for p in (out_dir / "passes").iterdir())[0].startswith("00_")


def test_partition_zoo_with_input_shape(capsys, tmp_path):
    code, out, err = _run(capsys, "partition", "zoo:resnet18", "--input-shape", "1,3,64,64",
                          "--march", "bernoulli2", "--out", str(tmp_path))
    assert code == 0, err
    assert "partitions: 1 bpu, 0 cpu" in out
    data = json.loads((tmp_path / "model.json").read_text())
    assert data["march"] == "bernoulli2"
    assert data["nodes"][0]["shape"] == "f32[1,3,64,64]"


def test_partition_module_factory_file(capsys, tmp_path):
    src = tmp_path / "my_model.py"
    src.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class TwoInputs(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 4, 1)
                self.act = nn.PReLU()
                self.emb = nn.Embedding(10, 4)

            def forward(self, x, idx):
                return self.act(self.conv(x)).mean() + self.emb(idx).sum()

        def build():
            torch.manual_seed(0)
            return TwoInputs().eval()
    """))
    out_dir = tmp_path / "out"
    code, out, err = _run(capsys, "partition", f"{src}:build", "--input-shape", "1,3,8,8",
                          "--input-shape", "2,5", "--input-dtype", "float32", "--input-dtype", "int64",
                          "--hybrid-module-type", "torch.nn.Embedding", "--out", str(out_dir))
    assert code == 0, err
    assert out.splitlines()[0].startswith("partitions: ")
    data = json.loads((out_dir / "model.json").read_text())
    assert data["model"] == "TwoInputs"
    inputs = [n for n in data["nodes"] if n["op"] == "placeholder"]
    assert [n["shape"] for n in inputs] == ["f32[1,3,8,8]", "i64[2,5]"]
    emb = next(n for n in data["nodes"] if n["node"] == "emb")
    assert (emb["placement"], emb["reason"]) == ("cpu", "hybrid_dict module_type Embedding")


def test_module_factory_needs_input_shape(capsys, tmp_path):
    code, out, err = _run(capsys, "partition", "torch.nn:Identity", "--out", str(tmp_path))
    _assert_usage_error(code, out, err)
    assert "--input-shape is required" in err


def test_unknown_march(capsys, tmp_path):
    code, out, err = _run(capsys, "partition", "zoo:hybrid", "--march", "bays", "--out", str(tmp_path))
    _assert_usage_error(code, out, err)
    assert "bayes" in err and "bernoulli2" in err


def test_unknown_hybrid_module_name(capsys, tmp_path):
    code, out, err = _run(capsys, "partition", "zoo:hybrid", "--hybrid-module-name", "conv9", "--out", str(tmp_path))
    _assert_usage_error(code, out, err)
    assert "'conv9'" in err and "'conv4'" in err


def test_unknown_zoo_model(capsys, tmp_path):
    code, out, err = _run(capsys, "partition", "zoo:resnet19", "--out", str(tmp_path))
    _assert_usage_error(code, out, err)
    assert "resnet18" in err


@pytest.mark.parametrize("shape", ["1,x", "", "1,,3", "1,0,3", "-1,3"])
def test_malformed_input_shape(capsys, tmp_path, shape):
    code, out, err = _run(capsys, "partition", "zoo:hybrid", f"--input-shape={shape}", "--out", str(tmp_path))
    _assert_usage_error(code, out, err)
    assert "--input-shape" in err


@pytest.mark.parametrize("argv, needle", [
    (["partition", "zoo:hybrid", "--input-dtype", "float16", "--out", "OUT"], "invalid choice"),
    (["partition", "zoo:hybrid", "--input-dtype", "int64", "--out", "OUT"], "--input-dtype needs --input-shape"),
    (["partition", "zoo:hybrid", "--input-shape", "1,3,8,8", "--input-dtype", "int64", "--input-dtype", "int64",
      "--out", "OUT"], "at most one dtype per input"),
    (["partition", "zoo:hybrid"], "--out"),
    (["partition", "no_such_module_xyz:build", "--input-shape", "1,3", "--out", "OUT"], "no_such_module_xyz"),
    (["partition", "torch.nn:Linear", "--input-shape", "1,3", "--out", "OUT"], "without arguments"),
    (["partition", "torch.nn:Linaer", "--input-shape", "1,3", "--out", "OUT"], "'Linear'"),
    (["partition", "zoo:hybrid", "--input-shape", "1,3,8", "--out", "OUT"], "example_inputs do not fit"),
    ([], "command is required"),
    (["frobnicate"], "invalid choice"),
])
def test_other_usage_errors(capsys, tmp_path, argv, needle):
    argv = [str(tmp_path) if a == "OUT" else a for a in argv]
    code, out, err = _run(capsys, *argv)
    _assert_usage_error(code, out, err)
    assert needle in err


def test_help_and_version(capsys):
    assert main(["--help"]) == 0
    assert "partition" in capsys.readouterr().out
    assert main(["partition", "--help"]) == 0
    assert "--hybrid-module-name" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert "qcompiler" in capsys.readouterr().out


@pytest.mark.slow
def test_python_m_end_to_end(tmp_path):
    out_dir = tmp_path / "dump"
    proc = subprocess.run(
        [sys.executable, "-m", "qcompiler.tools.cli", "partition", "zoo:hybrid", "--out", str(out_dir)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("partitions: ")
    assert (out_dir / "model.json").is_file()
    assert (out_dir / "summary.txt").read_text().splitlines()[0] == proc.stdout.splitlines()[0]


def test_compile_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "c"
    code = main(["compile", "zoo:hybrid", "--input-shape", "1,3,16,16", "--march", "bayes",
                 "--hybrid-module-name", "conv3", "--calib-random", "2", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "BPU<->CPU boundary edges:" in text
    assert "output SQNR vs float on random data (2 seeded batches of uniform noise, --calib-random; not real " in text
    for f in ("model.onnx", "model.onnx.quant.json", "model.qc", "model.json", "bpu0.program.txt"):
        assert (out / f).exists(), f
    import qcompiler

    m = qcompiler.load(out / "model.qc")
    assert m(torch.rand(1, 3, 16, 16)).shape == (1, 3, 16, 16)


def test_compile_command_weight_rounding(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["compile", "zoo:hybrid", "--input-shape", "1,3,16,16", "--calib-random", "2",
                 "--weight-rounding", "--out", str(out)]) == 0
    assert (out / "model.qc").exists()


def test_compile_command_calib_npz(tmp_path, capsys):
    import numpy as np

    npz = tmp_path / "calib.npz"
    np.savez(npz, np.random.default_rng(0).random((6, 3, 16, 16), dtype=np.float32))
    assert main(["compile", "zoo:hybrid", "--input-shape", "1,3,16,16", "--calib-data", str(npz),
                 "--calib-batch-size", "4", "--out", str(tmp_path / "o")]) == 0
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"nope")
    assert main(["compile", "zoo:hybrid", "--calib-data", str(bad), "--out", str(tmp_path / "o2")]) == 2
    assert "not an .npz archive, .npy array or torch.save file; write it with np.savez" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad --calib-data and --out


def _npz(path, *arrays):
    import numpy as np

    np.savez(path, *arrays)
    return path


def _calib_error_cases(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    single = tmp_path / "single.npy"
    np.save(single, rng.random((2, 3, 9, 9), dtype=np.float32))
    return {
        "empty_file": (empty, "cannot read it as an .npz file"),
        "npy_shape": (single, "input 0 has shape (2, 3, 9, 9); the example input has (1, 3, 16, 16)"),
        "no_arrays": (_npz(tmp_path / "none.npz"), "the model takes 1 inputs, got 0"),
        "zero_samples": (_npz(tmp_path / "zero.npz", np.zeros((0, 3, 16, 16), np.float32)),
                         "input 0 is empty (shape (0, 3, 16, 16))"),
        "sample_shape": (_npz(tmp_path / "shape.npz", np.zeros((4, 3, 9, 9), np.float32)),
                         "input 0 has shape (4, 3, 9, 9); the example input has (1, 3, 16, 16)"),
        "scalar": (_npz(tmp_path / "scalar.npz", np.float32(1)), "input 0 has shape () (0 dims)"),
        "int64": (_npz(tmp_path / "int.npz", np.zeros((4, 3, 16, 16), np.int64)),
                  "input 0 must be a float32 tensor like the example input's, got int64"),
        "two_arrays": (_npz(tmp_path / "two.npz", *[np.zeros((4, 3, 16, 16), np.float32)] * 2),
                       "the model takes 1 inputs, got 2"),
        "strings": (_npz(tmp_path / "str.npz", np.array(["a", "b"])), "array 'arr_0' cannot be a tensor"),
    }


@pytest.mark.parametrize("case", ["empty_file", "npy_shape", "no_arrays", "zero_samples", "sample_shape", "scalar",
                                  "int64", "two_arrays", "strings"])
def test_compile_bad_calib_data_is_a_usage_error_and_writes_nothing(capsys, tmp_path, case):
    path, needle = _calib_error_cases(tmp_path)[case]
    before = path.read_bytes()
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "compile", "zoo:hybrid", "--input-shape", "1,3,16,16", "--calib-data", str(path),
                             "--out", str(out))
    _assert_usage_error(code, stdout, err)
    assert err.startswith(f"error: --calib-data {path}")
    assert needle in err
    assert path.read_bytes() == before and not out.exists()


def test_compile_float64_calib_data_is_cast_like_float32(capsys, tmp_path):
    import numpy as np

    data = np.random.default_rng(0).random((4, 3, 16, 16))  # numpy's default dtype: float64
    runs = {}
    for dtype in ("float64", "float32"):
        npz = _npz(tmp_path / f"{dtype}.npz", data.astype(dtype))
        code, out, err = _run(capsys, "compile", "zoo:hybrid", "--input-shape", "1,3,16,16", "--calib-data", str(npz),
                              "--out", str(tmp_path / dtype))
        assert code == 0, err
        assert f"output SQNR vs float on the calibration data, 4 samples from {npz}: " in out
        runs[dtype] = (tmp_path / dtype / "model.qc").read_bytes()
    assert runs["float64"] == runs["float32"]  # float64 samples are rounded to float32, then calibrate alike


@pytest.mark.parametrize("command", ["compile", "partition", "report"])
@pytest.mark.parametrize("where", ["file", "under_file"])
def test_bad_out_is_found_before_any_work(capsys, tmp_path, monkeypatch, command, where):
    import qcompiler.tools.cli_commands as cli_commands

    def not_reached(*_):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(cli_commands, "load_model", not_reached)
    user_file = tmp_path / "notes.txt"
    user_file.write_text("keep me")
    out = user_file if where == "file" else user_file / "sub"
    code, stdout, err = _run(capsys, command, "zoo:hybrid", "--out", str(out))
    _assert_usage_error(code, stdout, err)
    assert "argument --out: " in err and repr(str(user_file)) in err
    assert ("is an existing file" if where == "file" else "is a file, not a directory") in err
    assert user_file.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [user_file]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_out_parent(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, stdout, err = _run(capsys, "partition", "zoo:hybrid", "--out", str(locked / "new"))
    finally:
        locked.chmod(0o700)
    _assert_usage_error(code, stdout, err)
    assert "is not writable" in err and not (locked / "new").exists()


def test_an_out_dir_another_process_creates_while_it_is_probed_is_accepted(tmp_path, monkeypatch):
    """Under torchrun every rank probes --out (mkdir, rmdir) at once: the rank that loses the race
    finds the directory made by the other and must accept it (it failed CI once: 'File exists')."""
    from pathlib import Path

    from qcompiler.tools.cli import out_dir

    real_mkdir = Path.mkdir

    def raced(self, *args, **kwargs):  # the other rank's mkdir lands just before ours
        real_mkdir(self)
        raise FileExistsError(17, "File exists", str(self))

    monkeypatch.setattr(Path, "mkdir", raced)
    target = tmp_path / "two" / "deeper"
    assert out_dir(str(target)) == target
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    (tmp_path / "blocker").write_text("x")  # a real failure still fails
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create"):
        out_dir(str(tmp_path / "blocker" / "sub"))
