"""Reliability catalogue: bad inputs across compile, call, save, load, export and the CLI.

Each row is ``(id, action, expected, fragment)``: ``action(env)`` makes one bad call;
``expected`` is the documented error type (for the CLI: the exit status), and ``fragment``
must appear in the message (it names the key, input, path or node at fault). After every
row, the user's models and every file that existed before are checked to be untouched,
and nothing new is written.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Union

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_untouched, snapshot

import qcompiler
from qcompiler.compiled import load
from qcompiler.errors import ArtifactError, CalibrationError, ConfigError
from qcompiler.onnx import export_to_onnx
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.tools.cli import main

X = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
HYBRID = {"module_name": ["fc"]}  # a CPU island in every artifact


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.relu(self.bn(self.conv(x))).mean((2, 3)))


class Case(NamedTuple):
    id: str
    action: Callable[[Any], Any]
    expected: Union[type, int]  # an exception type, or the CLI's exit status
    fragment: Union[str, tuple]  # or several, each in the message
    root_only: bool = False  # /proc takes no files even for root; other users fail earlier (not writable)


# ----------------------------------------------------------------------------- shared objects


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.manual_seed(0)
    model = Net().eval()
    cm = qcompiler.compile(model, X, hybrid_dict=HYBRID, progress=False)
    root = tmp_path_factory.mktemp("catalogue")
    artifact = cm.save(root / "net.qc").read_bytes()
    cal = prepare_calibration_fx(Net().eval(), example_inputs=(X,), hybrid=True, hybrid_dict=HYBRID)
    cal(X)
    qat = set_state(prepare_qat_fx(cal, hybrid=True, hybrid_dict=HYBRID), "qat").train()  # training
    return SimpleNamespace(cm=cm, artifact=artifact, qat=qat)


@pytest.fixture
def env(built, tmp_path, monkeypatch):
    """Fresh user models (a float model in eval mode, a QAT model training) and a folder with
    the user's files: an artifact, a file, an empty subfolder, model sources and data for the CLI,
    and ``inputs/`` for the broken files a case makes."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    (tmp_path / "net.qc").write_bytes(built.artifact)
    (tmp_path / "notes.txt").write_text("keep me\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "inputs").mkdir()
    for name, source in SOURCES.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    for name, write in DATA.items():
        write(tmp_path / name)
    yield SimpleNamespace(tmp=tmp_path, inputs=tmp_path / "inputs", model=Net().eval(), qat=copy.deepcopy(built.qat),
                          cm=built.cm, artifact=tmp_path / "net.qc", loaded=load(tmp_path / "net.qc"))
    for name in SOURCES:  # the CLI imports them under their stems
        sys.modules.pop(Path(name).stem, None)


SOURCES = {
    "syntax.py": """\
        import torch
        def build(:
            return torch.nn.ReLU()
        """,
    "raises.py": """\
        import torch


        def helper():
            return torch.nn.Conv2d(3, -4, 3)


        def build():
            return helper()
        """,
    "import_raises.py": """\
        import torch
        raise RuntimeError("needs a GPU")
        """,
    "missing_dep.py": """\
        import torch
        import qc_catalogue_not_installed
        """,
    "not_module.py": """\
        def build():
            return 42
        """,
    "good.py": """\
        import torch


        def build():
            return torch.nn.Conv2d(3, 4, 3)
        """,
}


def _zip(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


DATA = {
    "calib.txt": lambda p: p.write_text("1.0, 2.0, 3.0\n"),
    "calib.pkl": lambda p: p.write_bytes(pickle.dumps([1.0, 2.0])),
    "objects.npz": lambda p: np.savez(p, np.array([{"a": 1}], dtype=object)),
    "single.npy": lambda p: np.save(p, np.zeros((2, 3, 16, 16), np.float32)),
    "foreign.zip": lambda p: p.write_bytes(_zip({"hello.txt": "hi"})),
}


# ----------------------------------------------------------------------------- artifact edits


def _members(env) -> dict:
    with zipfile.ZipFile(env.artifact) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _edited(env, name: str, **edit) -> Path:
    """A copy of the artifact with members replaced (bytes or a manifest-editing function) or
    dropped (None); returns its path."""
    members = _members(env)
    for member, change in edit.items():
        member = {"manifest": "manifest.json"}.get(member, member)
        if change is None:
            del members[member]
        elif callable(change):
            members[member] = json.dumps(change(json.loads(members[member])))
        else:
            members[member] = change
    path = env.inputs / name
    path.write_bytes(_zip(members))
    return path


def _set(key, value):
    def edit(manifest):
        manifest[key] = value
        return manifest
    return edit


def _drop_island(env) -> Path:
    members = _members(env)
    island = next(n for n in members if n.startswith("islands/"))
    members.pop(island)
    path = env.inputs / "no_island.qc"
    path.write_bytes(_zip(members))
    return path


def _bad_crc(env) -> Path:
    """A stored (uncompressed) manifest with one byte changed after the CRC was computed."""
    data = _zip({"manifest.json": '{"format": "qcompiler-artifact"}'})
    path = env.inputs / "crc.qc"
    path.write_bytes(data.replace(b"qcompiler-artifact", b"qcompiler-artifacT", 1))
    return path


def _write(env, name: str, data: bytes) -> Path:
    path = env.inputs / name
    path.write_bytes(data)
    return path


def _sidecar_is_a_directory(env):
    (env.inputs / "side.onnx.quant.json").mkdir()
    return env.cm.export_onnx(env.inputs / "side.onnx")


def _cli(*argv):
    return lambda env: main([str(a) for a in argv])


def _meta_model(env):
    return copy.deepcopy(env.model).to("meta")


def _meta_qat(env):
    return copy.deepcopy(env.qat).to("meta")


# ----------------------------------------------------------------------------- the catalogue

C, A = ConfigError, ArtifactError
CASES = [
    # compile: arguments
    Case("compile/model-not-a-module", lambda e: qcompiler.compile("net", X, progress=False), C,
         "model must be a torch.nn.Module, got str"),
    Case("compile/unknown-mode", lambda e: qcompiler.compile(e.model, X, mode="int4", progress=False), C,
         "unknown mode 'int4'"),
    Case("compile/weight-rounding-in-qat", lambda e: qcompiler.compile(e.qat, X, mode="qat", weight_rounding=True,
                                                                       progress=False), C, "weight_rounding=True"),
    Case("compile/qat-mode-float-model", lambda e: qcompiler.compile(e.model, X, mode="qat", progress=False), C,
         "takes a model from prepare_qat_fx"),
    Case("compile/unknown-march", lambda e: qcompiler.compile(e.model, X, march="pentium", progress=False), C,
         "unknown march 'pentium'"),
    Case("compile/no-example-inputs", lambda e: qcompiler.compile(e.model, None, progress=False), C,
         "example_inputs is required"),
    Case("compile/hybrid-dict-unknown-key", lambda e: qcompiler.compile(e.model, X, hybrid_dict={"modul_name": []},
                                                                        progress=False), C, "modul_name"),
    Case("compile/hybrid-dict-unknown-module", lambda e: qcompiler.compile(e.model, X, hybrid_dict={
        "module_name": ["conv9"]}, progress=False), C, "conv9"),
    Case("compile/qconfig-dict-unknown-key", lambda e: qcompiler.compile(e.model, X, qconfig_dict={"globl": None},
                                                                         progress=False), C, "'globl'"),
    Case("compile/custom-config-unknown-key", lambda e: qcompiler.compile(
        e.model, X, prepare_custom_config_dict={"leaf": []}, progress=False), C, "unknown key 'leaf'"),
    Case("compile/preserved-attribute-missing", lambda e: qcompiler.compile(
        e.model, X, prepare_custom_config_dict={"preserved_attributes": ["version"]}, progress=False), C,
         "model has no attribute 'version'"),
    # compile: calibration data
    Case("compile/calib-one-tensor", lambda e: qcompiler.compile(e.model, X, calib_data=X, progress=False), C,
         "got one tensor; pass [batch]"),
    Case("compile/calib-not-iterable", lambda e: qcompiler.compile(e.model, X, calib_data=5, progress=False), C,
         "calib_data must be an iterable of batches"),
    Case("compile/calib-empty", lambda e: qcompiler.compile(e.model, X, calib_data=[], progress=False), C,
         "calib_data is empty"),
    Case("compile/calib-shape", lambda e: qcompiler.compile(e.model, X, calib_data=[X, torch.rand(2, 3, 9, 9)],
                                                            progress=False), C,
         "calib_data batch 1: input 0 has shape (2, 3, 9, 9)"),
    Case("compile/calib-rank", lambda e: qcompiler.compile(e.model, X, calib_data=[X[0]], progress=False), C,
         "calib_data batch 0: input 0 has shape (3, 8, 8) (3 dims)"),
    Case("compile/calib-int-dtype", lambda e: qcompiler.compile(e.model, X, calib_data=[X.long()], progress=False),
         C, "calib_data batch 0: input 0 must be a float32 tensor"),
    Case("compile/calib-numpy", lambda e: qcompiler.compile(e.model, X, calib_data=[X.numpy()], progress=False), C,
         "torch.from_numpy converts it"),
    Case("compile/calib-two-inputs", lambda e: qcompiler.compile(e.model, X, calib_data=[(X, X)], progress=False),
         C, "calib_data batch 0: the model takes 1 inputs, got 2"),
    Case("compile/calib-batch-0", lambda e: qcompiler.compile(e.model, X, calib_data=[X[:0]], progress=False), C,
         "calib_data batch 0: input 0 is empty"),
    Case("compile/calib-nan", lambda e: qcompiler.compile(e.model, X, calib_data=[X * float("nan")],
                                                          progress=False), CalibrationError, "NaN"),
    # compile: inputs or models without data (new)
    Case("compile/example-batch-0", lambda e: qcompiler.compile(e.model, X[:0], progress=False), C,
         "example_inputs (the calibration batch without calib_data): input 0 has batch size 0"),
    Case("compile/example-and-calib-batch-0", lambda e: qcompiler.compile(e.model, X[:0], calib_data=[X[:0]],
                                                                          progress=False), C,
         "calib_data batch 0: input 0 has batch size 0"),
    Case("compile/meta-example-input", lambda e: qcompiler.compile(e.model, X.to("meta"), progress=False), C,
         "example_inputs: input 0 is a meta tensor"),
    Case("compile/meta-calib-batch", lambda e: qcompiler.compile(e.model, X, calib_data=[X, X.to("meta")],
                                                                 progress=False), C,
         "calib_data batch 1: input 0 is a meta tensor"),
    Case("compile/meta-model", lambda e: qcompiler.compile(_meta_model(e), X, progress=False), C,
         "the model's 'conv.weight' is on the meta device"),
    Case("compile/meta-qat-model", lambda e: qcompiler.compile(_meta_qat(e), X, mode="qat", progress=False), C,
         "is on the meta device"),
    # calls of a compiled model
    Case("call/no-inputs", lambda e: e.cm(), C, "compiled model: the model takes 1 inputs (x), got 0"),
    Case("call/two-inputs", lambda e: e.cm(X, X), C, "the model takes 1 inputs (x), got 2"),
    Case("call/shape", lambda e: e.cm(torch.rand(2, 3, 9, 9)), C, "input 0 ('x') has shape (2, 3, 9, 9)"),
    Case("call/rank", lambda e: e.cm(X[0]), C, "input 0 ('x') has shape (3, 8, 8) (3 dims)"),
    Case("call/int-dtype", lambda e: e.cm(X.long()), C, "input 0 ('x') must be a float32 tensor"),
    Case("call/numpy", lambda e: e.cm(X.numpy()), C, "torch.from_numpy converts it"),
    Case("call/list", lambda e: e.cm([X]), C, "input 0 ('x') must be a float32 tensor, got list of 1"),
    Case("call/string", lambda e: e.cm("x"), C, "input 0 ('x') must be a float32 tensor, got str"),
    Case("call/empty-batch", lambda e: e.cm(X[:0]), C, "input 0 ('x') is empty"),
    Case("call/meta", lambda e: e.cm(X.to("meta")), C, "input 0 ('x') is a meta tensor"),
    Case("call/loaded-shape", lambda e: e.loaded(torch.rand(2, 3, 9, 9)), C, "input 0 ('x') has shape (2, 3, 9, 9)"),
    Case("call/loaded-meta", lambda e: e.loaded(X.to("meta")), C, "input 0 ('x') is a meta tensor"),
    # save
    Case("save/empty-path", lambda e: e.cm.save(""), C, "save: the path is empty"),
    Case("save/directory", lambda e: e.cm.save(e.tmp / "sub"), C, "is a directory"),
    Case("save/below-a-file", lambda e: e.cm.save(e.tmp / "notes.txt" / "net.qc"), C,
         "notes.txt' is a file, not a directory"),
    Case("save/below-a-file-deeper", lambda e: e.cm.save(e.tmp / "notes.txt" / "a" / "net.qc"), C,
         "notes.txt' is a file, not a directory"),
    Case("save/none", lambda e: e.cm.save(None), C, "save: the path must be a str or os.PathLike, got NoneType"),
    Case("save/bytes-path", lambda e: e.cm.save(b"net.qc"), C, "save: the path must be a str or os.PathLike"),
    Case("save/loaded-below-a-file", lambda e: e.loaded.save(e.tmp / "notes.txt" / "x.qc"), C, "is a file"),
    # load (what gives an ArtifactError today; deeper checks live with the artifact tests)
    Case("load/missing", lambda e: load(e.tmp / "nope.qc"), A, "nope.qc: no such file"),
    Case("load/directory", lambda e: load(e.tmp / "sub"), A, "sub: no such file"),
    Case("load/empty", lambda e: load(_write(e, "empty.qc", b"")), A, "empty.qc: not a qcompiler artifact"),
    Case("load/text", lambda e: load(e.tmp / "notes.txt"), A, "notes.txt: not a qcompiler artifact"),
    Case("load/truncated", lambda e: load(_write(e, "half.qc", e.artifact.read_bytes()[:1000])), A,
         "half.qc: not a qcompiler artifact or truncated"),
    Case("load/truncated-end", lambda e: load(_write(e, "cut.qc", e.artifact.read_bytes()[:-30])), A,
         "cut.qc: not a qcompiler artifact or truncated"),
    Case("load/foreign-zip", lambda e: load(e.tmp / "foreign.zip"), A, "no manifest.json"),
    Case("load/bad-crc", lambda e: load(_bad_crc(e)), A, "member 'manifest.json' is corrupted (Bad CRC-32"),
    Case("load/manifest-not-json", lambda e: load(_edited(e, "json.qc", manifest=b"{")), A,
         "json.qc: corrupted (JSONDecodeError"),
    Case("load/foreign-manifest", lambda e: load(_edited(e, "foreign.qc", manifest=_set("format", "onnx"))), A,
         "foreign manifest"),
    Case("load/newer-version", lambda e: load(_edited(e, "new.qc", manifest=_set("format_version", 99))), A,
         "written by a newer qcompiler (artifact format 99"),
    Case("load/no-version", lambda e: load(_edited(e, "nov.qc", manifest=_set("format_version", "1"))), A,
         "corrupted (no format version)"),
    Case("load/missing-island", lambda e: load(_drop_island(e)), A, "corrupted (missing islands/"),
    Case("load/bad-program", lambda e: load(_edited(e, "prog.qc", **{"tensors.safetensors": b"\x08" + b"\0" * 7
                                                                     + b"{}      "})), A,
         "member 'tensors.safetensors' declares 16 bytes uncompressed; the manifest says"),
    # export
    Case("export/empty-path", lambda e: e.cm.export_onnx(""), C, "export_to_onnx: the path is empty"),
    Case("export/directory", lambda e: e.cm.export_onnx(e.tmp / "sub"), C, "sub' is a directory"),
    Case("export/below-a-file", lambda e: e.cm.export_onnx(e.tmp / "notes.txt" / "net.onnx"), C,
         "notes.txt' is a file, not a directory"),
    Case("export/sidecar-is-a-directory", _sidecar_is_a_directory, C, "side.onnx.quant.json' is a directory"),
    Case("export/f-not-a-path", lambda e: export_to_onnx(e.cm.converted, X, 5), C,
         "f must be a path or a binary file object, got int"),
    Case("export/opset", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx", opset_version=13), C,
         "opset_version=13: only opset 11"),
    Case("export/plain-module", lambda e: export_to_onnx(e.model, X, e.tmp / "m.onnx"), C, "got a plain Net"),
    Case("export/not-a-module", lambda e: export_to_onnx("net", X, e.tmp / "m.onnx"), C,
         "model must be a torch.nn.Module, got str"),
    Case("export/args-shape", lambda e: export_to_onnx(e.cm.converted, torch.rand(2, 3, 9, 9), e.tmp / "m.onnx"), C,
         "input 'x' has shape (2, 3, 9, 9), the model was traced with shape (2, 3, 8, 8)"),
    Case("export/args-dtype", lambda e: export_to_onnx(e.cm.converted, X.double(), e.tmp / "m.onnx"), C,
         "input 'x' has dtype f64, the model was traced with f32"),
    Case("export/args-count", lambda e: export_to_onnx(e.cm.converted, (X, X), e.tmp / "m.onnx"), C,
         "takes 1 input tensor(s) (x), got 2"),
    Case("export/args-type", lambda e: export_to_onnx(e.cm.converted, "x", e.tmp / "m.onnx"), C,
         "args must be a tensor or a tuple"),
    Case("export/dynamic-axes-type", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx", dynamic_axes=5),
         C, "dynamic_axes must be a dict"),
    Case("export/dynamic-axes-axis", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx",
                                                              dynamic_axes={"x": ["batch"]}), C,
         "dynamic_axes['x'] must be a dict"),
    Case("export/loaded-model", lambda e: e.loaded.export_onnx(e.tmp / "m.onnx"), C,
         "export_onnx needs the compiled graph"),
    Case("export/loaded-dump", lambda e: e.loaded.dump(e.tmp / "dump"), C, "dump needs the compiled graph"),
    # the command line: exit 2 for the user's mistakes, 1 for I/O failures; one line on stderr
    Case("cli/model-syntax-error", _cli("partition", "syntax.py:build", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "cannot import model file 'syntax.py': {tmp}/syntax.py:2: SyntaxError: invalid syntax"),
    Case("cli/factory-raises", _cli("partition", "raises.py:build", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "model factory 'raises.py:build' failed: {tmp}/raises.py:5: RuntimeError: Trying to create tensor with "
         "negative dimension -4"),
    Case("cli/module-factory-raises", _cli("partition", "raises:build", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "model factory 'raises:build' failed: {tmp}/raises.py:5: RuntimeError"),
    Case("cli/model-import-raises", _cli("partition", "import_raises.py:build", "--input-shape", "1,3,8,8",
                                         "--out", "o"), 2, "import_raises.py:2: RuntimeError: needs a GPU"),
    Case("cli/model-module-import-raises", _cli("partition", "import_raises:build", "--input-shape", "1,3,8,8",
                                                "--out", "o"), 2,
         "cannot import model module 'import_raises': {tmp}/import_raises.py:2: RuntimeError: needs a GPU"),
    Case("cli/model-missing-dependency", _cli("partition", "missing_dep.py:build", "--input-shape", "1,3,8,8",
                                              "--out", "o"), 2,
         "missing_dep.py:2: ModuleNotFoundError: No module named 'qc_catalogue_not_installed'"),
    Case("cli/model-file-missing", _cli("partition", "absent.py:build", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "model file 'absent.py' does not exist"),
    Case("cli/factory-not-a-module", _cli("partition", "not_module.py:build", "--input-shape", "1,3,8,8",
                                          "--out", "o"), 2, "must return a torch.nn.Module, got int"),
    Case("cli/factory-missing", _cli("partition", "good.py:biuld", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "has no attribute 'biuld'. Did you mean 'build'?"),
    Case("cli/unknown-zoo-model", _cli("partition", "zoo:nope", "--out", "o"), 2, "nope"),
    Case("cli/unknown-march", _cli("partition", "good.py:build", "--input-shape", "1,3,8,8", "--march", "pentium",
                                   "--out", "o"), 2, "unknown march 'pentium'"),
    Case("cli/bad-shape", _cli("partition", "good.py:build", "--input-shape", "1,x", "--out", "o"), 2,
         "malformed input shape '1,x'"),
    Case("cli/out-in-proc", _cli("partition", "good.py:build", "--input-shape", "1,3,8,8", "--out", "/proc/qc"), 2,
         ("argument --out: cannot ", "'/proc/qc'")),
    Case("cli/out-below-proc", _cli("compile", "good.py:build", "--input-shape", "1,3,8,8", "--out",
                                    "/proc/qc/deeper"), 2, ("argument --out: cannot ", "'/proc/qc/deeper'")),
    Case("cli/out-in-proc-as-root", _cli("partition", "good.py:build", "--input-shape", "1,3,8,8", "--out",
                                         "/proc/qc"), 2,
         "argument --out: cannot create '/proc/qc': No such file or directory", root_only=True),
    Case("cli/out-write-fails", _cli("partition", "good.py:build", "--input-shape", "1,3,8,8", "--out",
                                     "/proc/self/fdinfo"), 1,
         "--out /proc/self/fdinfo: cannot write /proc/self/fdinfo/Conv2d.code.txt: dump: No such file or directory",
         root_only=True),
    Case("cli/out-is-a-file", _cli("partition", "good.py:build", "--input-shape", "1,3,8,8", "--out", "notes.txt"),
         2, "argument --out: 'notes.txt' is an existing file"),
    Case("cli/calib-text", _cli("compile", "zoo:hybrid", "--calib-data", "calib.txt", "--out", "o"), 2,
         "--calib-data calib.txt: not an .npz archive (an .npz is a zip file of .npy arrays)"),
    Case("cli/calib-pickle", _cli("compile", "zoo:hybrid", "--calib-data", "calib.pkl", "--out", "o"), 2,
         "--calib-data calib.pkl: not an .npz archive"),
    Case("cli/calib-object-array", _cli("compile", "zoo:hybrid", "--calib-data", "objects.npz", "--out", "o"), 2,
         "--calib-data objects.npz: array 'arr_0' holds Python objects (dtype object)"),
    Case("cli/calib-npy", _cli("compile", "zoo:hybrid", "--calib-data", "single.npy", "--out", "o"), 2,
         "holds a single .npy array, not an .npz archive"),
    Case("cli/calib-missing", _cli("compile", "zoo:hybrid", "--calib-data", "absent.npz", "--out", "o"), 2,
         "--calib-data absent.npz: cannot read it (No such file or directory)"),
    Case("cli/calib-directory", _cli("compile", "zoo:hybrid", "--calib-data", "sub", "--out", "o"), 2,
         "--calib-data sub: cannot read it (Is a directory)"),
    Case("cli/no-command", _cli(), 2, "a command is required"),
]


def _files(root: Path) -> dict:
    """Every file and folder under ``root``: contents and permission bits."""
    out = {}
    for p in sorted(root.rglob("*")):
        if "__pycache__" in p.parts:
            continue
        st = p.stat()
        out[str(p.relative_to(root))] = (None if p.is_dir() else p.read_bytes(), st.st_mode)
    return out


def test_the_catalogue_is_large_and_covers_every_entry():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    areas = {c.id.split("/")[0] for c in CASES}
    assert areas == {"compile", "call", "save", "load", "export", "cli"}


ROOT = os.geteuid() == 0


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=pytest.mark.skipif(
    c.root_only and not ROOT, reason="root only")) for c in CASES])
def test_bad_input(case, env, capsys):
    models = (env.model, env.qat, env.cm.converted)
    snaps = [snapshot(m) for m in models]
    files = _files(env.tmp)
    fragments = case.fragment if isinstance(case.fragment, tuple) else (case.fragment,)
    fragments = [f.format(tmp=env.tmp) for f in fragments]
    if isinstance(case.expected, int):
        code = case.action(env)
        out, err = capsys.readouterr()
        assert code == case.expected, err
        assert err.startswith("error: ") and "Traceback" not in err + out
        assert all(f in err for f in fragments), err
        assert len(err.splitlines()) == 1, err
    else:
        with pytest.raises(case.expected) as info:
            case.action(env)
        assert all(f in str(info.value) for f in fragments), str(info.value)
    for m, snap in zip(models, snaps):
        assert_untouched(m, snap)
    after = _files(env.tmp)
    assert {k: after[k] for k in files} == files  # the user's files: same bytes, same modes
    made = [k for k in after.keys() - files.keys() if not k.startswith("inputs/")]  # a case's own broken files
    assert not made, f"a failed call wrote {made}"
