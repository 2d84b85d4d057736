"""Reliability catalogue: bad inputs across compile, call, save, load, export, the CLI, config files,
the native kernel cache, the distributed helpers, and side effects on the process.

Each row is ``(id, action, expected, fragment)``: ``action(env)`` makes one bad call;
``expected`` is the documented error type (for the CLI: the exit status; for the native kernel
cache: the QCompilerWarning, after which the result must still be right), and ``fragment``
must appear in the message (it names the key, input, path or node at fault). After every
row, the user's models and every file that existed before are checked to be untouched,
nothing new is written, and the process is as it was: environment, working directory,
``sys.path``, torch's thread counts, default dtype, grad mode, RNG state and default march.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import shutil
import stat
import sys
import tempfile
import textwrap
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Union

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from artifact_edit import Edit
from conftest import assert_untouched, fifo_watch, snapshot
from onnx import helper, numpy_helper
from torch.utils.data import DataLoader, TensorDataset

import qcompiler
from qcompiler import distributed
from qcompiler.backends.bpu.native.plan import NativeSteps
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.compiled import _from_artifact, load
from qcompiler.errors import ArtifactError, CalibrationError, ConfigError, QCompilerWarning
from qcompiler.native import build, kernels
from qcompiler.onnx import export_to_onnx
from qcompiler.quantization import auto_int16, sync
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.sync import sync_observers
from qcompiler.tools.case_file import load_case
from qcompiler.tools.cli import main
from qcompiler.tools.config_file import MAX_CONFIG_BYTES, read_hybrid_file, read_qconfig_file, write_config_file

X = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
X9 = torch.rand(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))  # made here: a case draws no random numbers
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
    expected: Union[type, int]  # an exception type, the CLI's exit status, or a warning (the result still right)
    fragment: Union[str, tuple]  # or several, each in the message (the CLI: in its error line)
    root_only: bool = False  # /proc takes no files even for root; other users fail earlier (not writable)
    notes: int = 0  # the CLI: indented note lines after the error line (an error's __notes__)
    result: Any = None  # a warning row's right result when it is not the compiled model's output (env.reference)


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
    return SimpleNamespace(cm=cm, artifact=artifact, qat=qat, cal=cal, reference=cm(X))


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
                          cal=copy.deepcopy(built.cal), cm=built.cm, artifact=tmp_path / "net.qc",
                          loaded=load(tmp_path / "net.qc"), reference=built.reference)
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

        VALUE = 3


        def build():
            return torch.nn.Conv2d(3, 4, 3)


        def needs(channels):
            return torch.nn.Conv2d(channels, 4, 3)
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
    "empty.bin": lambda p: p.write_bytes(b""),
    "wrong.npz": lambda p: np.savez(p, np.zeros((4, 3, 9, 9), np.float32)),
    "two.npz": lambda p: np.savez(p, np.zeros((4, 3, 8, 8), np.float32), np.zeros((4, 3, 8, 8), np.float32)),
    "ints.npz": lambda p: np.savez(p, np.zeros((4, 3, 8, 8), np.int64)),
    "none.npz": lambda p: np.savez(p),
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


def _manifest_edit(change):
    def edit(manifest):
        change(manifest)
        return manifest
    return edit


def _drop(key):
    return _manifest_edit(lambda m: m.pop(key))


def _symlink(env, name: str, target) -> Path:
    path = env.inputs / name
    path.symlink_to(target)
    return path


def _json(env, name: str, content) -> Path:
    """A config file in ``inputs/``: ``content`` as JSON, or as the file's text when it is a str."""
    path = env.inputs / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _script(env, name: str, body: str, executable: bool = True) -> Path:
    path = env.inputs / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755 if executable else 0o644)
    return path


@contextlib.contextmanager
def _environ(**values):
    """Environment variables set for the block (None: unset), then restored; the native kernel
    decision is forgotten on the way in and out (qcompiler.native.build.reset)."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    build.reset()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        build.reset()


def _native_run(env, **values):
    """The artifact loaded and run under the environment ``values``: the output, which the
    harness compares with the compiled model's (the exact torch path gives the same numbers)."""
    with _environ(**values):
        return load(env.artifact)(X)


def _native_compile(env, **values):
    """A whole compile (calibration included) under ``values``: the same model as the fixture's."""
    with _environ(**values):
        return qcompiler.compile(env.model, X, hybrid_dict=HYBRID, progress=False)(X)


def _native_off(env, value):
    """With ``QCOMPILER_NATIVE=value`` a run gives the same numbers without a warning, and asking
    the simulator for native kernels is a ConfigError."""
    with _environ(QCOMPILER_NATIVE=value), warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)
        assert torch.equal(load(env.artifact)(X), env.reference)
        assert not build.native_enabled()
        BpuSimulator(env.loaded.runtime.programs["bpu0"], native=True)


def _native_cache(env, cache):
    """A cache directory that cannot be used, with a compiler that fails (``false``): the refusal
    is warned about and nothing is built; the torch path runs."""
    return _native_run(env, QCOMPILER_NATIVE_CACHE=cache, CC="false")


def _private_dir_removed(env):
    """The private build directory (made when the cache cannot be used) is removed again."""
    tmp = env.inputs / "tmp"
    tmp.mkdir()
    saved, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        return _native_cache(env, str(env.tmp / "notes.txt"))
    finally:
        tempfile.tempdir = saved
        left = sorted(p.name for p in tmp.iterdir())
        assert not left, f"left in the temporary directory: {left}"


def _metric(outputs, targets):
    return float((outputs.argmax(1) == targets).float().mean())


def _loader(*tensors, batch_size=1):
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size)


Y = torch.arange(2)  # targets for X
X4C = torch.rand(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))  # 4 channels: the model takes 3
NAN = X.clone()
NAN[1, 0, 0, 0] = float("nan")


def _evaluate_keeps_threads(env, model, loader, threads=1):
    """evaluate fails; the caller's torch thread count (here ``threads``) is what it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        distributed.evaluate(model, loader, _metric, progress=False)
    finally:
        now = torch.get_num_threads()
        torch.set_num_threads(before)
        assert now == threads, f"evaluate left {now} torch threads; the caller had {threads}"


def _under_no_grad(env, action):
    """``action`` fails while the caller has grad mode off; it is still off afterwards."""
    with torch.no_grad():
        try:
            action(env)
        finally:
            assert not torch.is_grad_enabled(), "grad mode was turned on"


def _under_float64(env, action):
    """``action`` fails while the caller's default dtype is float64; it still is afterwards."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        action(env)
    finally:
        now = torch.get_default_dtype()
        torch.set_default_dtype(saved)
        assert now == torch.float64, now


def _under_deterministic(env, action):
    """``action`` fails while the caller asks for deterministic algorithms; it still does afterwards."""
    torch.use_deterministic_algorithms(True)
    try:
        action(env)
    finally:
        now = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(False)
        assert now, "deterministic algorithms were turned off"


def _under_inference_mode(env, action):
    with torch.inference_mode():
        try:
            action(env)
        finally:
            assert torch.is_inference_mode_enabled(), "inference mode was turned off"


def _split_call(env, x, threads=2):
    """A call of the compiled model with the batch split over ``threads`` workers."""
    saved = env.cm.threads
    env.cm.threads = threads
    try:
        return env.cm(x)
    finally:
        env.cm.threads = saved


def _threads_kept(env, value):
    """A refused ``threads`` value leaves the one set before."""
    env.loaded.threads = 3
    try:
        env.loaded.threads = value
    finally:
        assert env.loaded.threads == 3, env.loaded.threads


def _join(**values):
    return lambda env: _with_environ(distributed.join_torchrun, **values)


def _with_environ(fn, **values):
    with _environ(**values):
        return fn()


def _cli_env(values, *argv):
    return lambda env: _with_environ(lambda: main([str(a) for a in argv]), **values)


# ----------------------------------------------------------------------------- the catalogue

C, A = ConfigError, ArtifactError
def _compile(**kw):
    return lambda e: qcompiler.compile(e.model, X, progress=False, **kw)


THREADS = "threads must be None (torch.get_num_threads()) or an int from 1 to 256, got "
BUDGET = "int16_budget must be a fraction in [0, 1] of the BPU activation tensors, got "
MORE_COMPILE = [
    Case("compile/threads-zero", _compile(threads=0), C, "compile: " + THREADS + "0"),
    Case("compile/threads-bool", _compile(threads=True), C, "compile: " + THREADS + "True"),
    Case("compile/threads-str", _compile(threads="2"), C, "compile: " + THREADS + "'2'"),
    Case("compile/threads-too-many", _compile(threads=10 ** 6), C, "compile: " + THREADS + "1000000"),
    Case("compile/int16-budget-in-qat", lambda e: qcompiler.compile(e.qat, X, mode="qat", int16_budget=0.1,
                                                                    progress=False), C,
         "compile: int16_budget is a PTQ step (mode='ptq')"),
    Case("compile/int16-budget-negative", _compile(int16_budget=-0.1), C, "compile: " + BUDGET + "-0.1"),
    Case("compile/int16-budget-above-one", _compile(int16_budget=1.5), C, "compile: " + BUDGET + "1.5"),
    Case("compile/int16-budget-nan", _compile(int16_budget=float("nan")), C, "compile: " + BUDGET + "nan"),
    Case("compile/int16-budget-str", _compile(int16_budget="0.1"), C, "compile: " + BUDGET + "'0.1'"),
    Case("compile/int16-budget-int8-march", _compile(int16_budget=0.1, march="bernoulli2"), C,
         "compile(int16_budget=...): march 'bernoulli2' has no int16 activations"),
    Case("compile/march-int", _compile(march=5), C, "unknown march 5; allowed: bernoulli2, bayes"),
    Case("compile/march-empty", _compile(march=""), C, "unknown march ''; allowed: bernoulli2, bayes"),
    Case("compile/hybrid-dict-list", _compile(hybrid_dict=["fc"]), C,
         ("hybrid_dict must be a dict with keys", "got list")),
    Case("compile/hybrid-module-name-str", _compile(hybrid_dict={"module_name": "fc"}), C,
         "hybrid_dict['module_name'] must be a list, got str"),
    Case("compile/hybrid-module-name-int", _compile(hybrid_dict={"module_name": [5]}), C,
         "hybrid_dict['module_name']: expected module names (str), got 5 (int)"),
    Case("compile/qconfig-dict-list", _compile(qconfig_dict=[1]), C, ("qconfig_dict must be a dict with keys",
                                                                     "got list")),
    Case("compile/qconfig-module-name-unknown", _compile(qconfig_dict={"module_name": [("conv9", None)]}), C,
         "qconfig_dict['module_name']: module 'conv9' is not in the model Net. Did you mean 'conv'?"),
    Case("compile/qconfig-global-str", _compile(qconfig_dict={"": "int8"}), C,
         "qconfig_dict[''] must be a qcompiler QConfig or None"),
    Case("compile/custom-config-list", _compile(prepare_custom_config_dict=["leaf"]), C,
         "prepare_custom_config_dict must be a dict, got list"),
    Case("compile/leaf-module-unknown", _compile(prepare_custom_config_dict={"non_traceable_module_name": ["conv9"]}),
         C, "non_traceable_module_name: module 'conv9' is not in the model Net. Did you mean 'conv'?"),
    Case("compile/leaf-module-str", _compile(prepare_custom_config_dict={"non_traceable_module_name": "conv"}), C,
         "prepare_custom_config_dict['non_traceable_module_name'] must be a list, got str"),
    Case("compile/calib-none-batch", _compile(calib_data=[None]), C,
         "calib_data batch 0: input 0 must be a float32 tensor, got NoneType"),
    Case("compile/calib-string", _compile(calib_data="abc"), C,
         "calib_data batch 0: input 0 must be a float32 tensor, got str"),
    Case("compile/calib-complex", _compile(calib_data=[X, X.to(torch.complex64)]), C,
         "calib_data batch 1: input 0 must be a float32 tensor like the example input's, got complex64"),
    Case("compile/calib-bool", _compile(calib_data=[X > 0.5]), C,
         "calib_data batch 0: input 0 must be a float32 tensor like the example input's, got bool"),
    Case("compile/calib-inf", _compile(calib_data=[X * float("inf")]), CalibrationError,
         "observer 'x_activation_post_process' saw NaN/Inf in its input"),
    Case("compile/example-str", lambda e: qcompiler.compile(e.model, "x", progress=False), C,
         "example_inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, got str"),
    Case("compile/example-dict-key", lambda e: qcompiler.compile(e.model, {1: X}, progress=False), C,
         "example_inputs as a dict are keyword inputs: its keys must be the forward's parameter names"),
    Case("compile/example-numpy", lambda e: qcompiler.compile(e.model, X.numpy(), progress=False), C,
         "example_inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, got ndarray"),
    Case("compile/example-int-dtype", lambda e: qcompiler.compile(e.model, X.long(), progress=False), C,
         "example_inputs do not fit the model: node 'conv' (module 'conv' (Conv2d)) failed on inputs (i64[2,3,8,8])"),
    Case("compile/example-two-inputs", lambda e: qcompiler.compile(e.model, (X, X), progress=False), C,
         "example_inputs do not fit the model: forward(x) takes 1 inputs, got 2"),
    Case("compile/example-channels", lambda e: qcompiler.compile(e.model, X4C, progress=False), C,
         ("node 'conv' (module 'conv' (Conv2d)) failed on inputs (f32[2,4,8,8])", "to have 3 channels")),
    Case("compile/mode-none", _compile(mode=None), C, "compile: unknown mode None; allowed: ptq, qat"),
    Case("compile/qat-mode-calibration-model", lambda e: qcompiler.compile(e.cal, X, mode="qat", progress=False), C,
         "compile(mode='qat') takes a model from prepare_qat_fx"),
]

MORE_CALL = [
    Case("call/complex", lambda e: e.cm(X.to(torch.complex64)), C,
         "input 0 ('x') must be a float32 tensor like the example input's, got complex64"),
    Case("call/bool", lambda e: e.cm(X > 0.5), C,
         "input 0 ('x') must be a float32 tensor like the example input's, got bool"),
    Case("call/none", lambda e: e.cm(None), C, "input 0 ('x') must be a float32 tensor, got NoneType"),
    Case("call/int", lambda e: e.cm(5), C, "input 0 ('x') must be a float32 tensor, got int"),
    Case("call/tuple", lambda e: e.cm((X,)), C, "input 0 ('x') must be a float32 tensor, got tuple of 1"),
    Case("call/scalar", lambda e: e.cm(torch.tensor(1.0)), C, "input 0 ('x') has shape () (0 dims)"),
    Case("call/five-dims", lambda e: e.cm(X[None]), C, "input 0 ('x') has shape (1, 2, 3, 8, 8) (5 dims)"),
    Case("call/channels", lambda e: e.cm(X4C), C,
         "input 0 ('x') has shape (2, 4, 8, 8); the example input has (2, 3, 8, 8)"),
    Case("call/threads-zero", lambda e: setattr(e.loaded, "threads", 0), C, "CompiledModel.threads: " + THREADS + "0"),
    Case("call/threads-negative", lambda e: setattr(e.loaded, "threads", -1), C,
         "CompiledModel.threads: " + THREADS + "-1"),
    Case("call/threads-float", lambda e: setattr(e.loaded, "threads", 2.0), C,
         "CompiledModel.threads: " + THREADS + "2.0"),
    Case("call/threads-str", lambda e: setattr(e.loaded, "threads", "2"), C,
         "CompiledModel.threads: " + THREADS + "'2'"),
    Case("call/threads-too-many", lambda e: setattr(e.loaded, "threads", 10 ** 6), C,
         "CompiledModel.threads: " + THREADS + "1000000"),
    Case("call/loaded-activation-dtypes", lambda e: e.loaded.activation_dtypes, C,
         "activation_dtypes needs the compiled graph"),
    Case("call/loaded-no-inputs", lambda e: e.loaded(), C, "the model takes 1 inputs (x), got 0"),
    Case("call/loaded-two-inputs", lambda e: e.loaded(X, X), C, "the model takes 1 inputs (x), got 2"),
    Case("call/loaded-int-dtype", lambda e: e.loaded(X.long()), C,
         "input 0 ('x') must be a float32 tensor like the example input's, got int64"),
    Case("call/loaded-numpy", lambda e: e.loaded(X.numpy()), C, "got ndarray (torch.from_numpy converts it)"),
    Case("call/loaded-rank", lambda e: e.loaded(X[0]), C, "input 0 ('x') has shape (3, 8, 8) (3 dims)"),
    Case("call/loaded-empty-batch", lambda e: e.loaded(X[:0]), C, "input 0 ('x') is empty (shape (0, 3, 8, 8))"),
    Case("call/loaded-list", lambda e: e.loaded([X]), C, "input 0 ('x') must be a float32 tensor, got list of 1"),
    Case("call/loaded-channels", lambda e: e.loaded(X4C), C, "input 0 ('x') has shape (2, 4, 8, 8)"),
]

MORE_SAVE = [
    Case("save/int-path", lambda e: e.cm.save(5), C, ("save: the path must be a str", "got int")),
    Case("save/list-path", lambda e: e.cm.save(["net.qc"]), C, ("save: the path must be a str", "got list")),
    Case("save/whitespace-path", lambda e: e.cm.save("   "), C, "save: the path is empty"),
    Case("save/cwd", lambda e: e.cm.save("."), C, "save: '.' is a directory"),
    Case("save/symlink-to-directory", lambda e: e.cm.save(_symlink(e, "to_sub", e.tmp / "sub")), C,
         "to_sub' is a directory"),
    Case("save/in-proc", lambda e: e.cm.save("/proc/qc_catalogue.qc"), OSError, ("save: ", "'/proc/qc_catalogue.qc'")),
    Case("save/below-proc", lambda e: e.cm.save("/proc/qc_catalogue/net.qc"), OSError,
         ("save: ", "'/proc/qc_catalogue")),
    Case("save/in-sys", lambda e: e.cm.save("/sys/qc_catalogue.qc"), OSError, ("save: ", "'/sys/qc_catalogue.qc'")),
    Case("save/loaded-directory", lambda e: e.loaded.save(e.tmp / "sub"), C, "sub' is a directory"),
    Case("save/loaded-none", lambda e: e.loaded.save(None), C, ("save: the path must be a str", "got NoneType")),
    Case("save/loaded-empty-path", lambda e: e.loaded.save(""), C, "save: the path is empty"),
]
def _load_edited(name, **edit):
    return lambda e: load(_edited(e, name, **edit))


MANIFEST = "manifest.json: "
MORE_LOAD = [
    Case("load/ort-threads-zero", lambda e: load(e.artifact, ort_threads=0), C,
         "load: ort_threads must be a positive int, got 0"),
    Case("load/ort-threads-bool", lambda e: load(e.artifact, ort_threads=True), C,
         "load: ort_threads must be a positive int, got True"),
    Case("load/ort-threads-str", lambda e: load(e.artifact, ort_threads="1"), C,
         "load: ort_threads must be a positive int, got '1'"),
    Case("load/threads-zero", lambda e: load(e.artifact, threads=0), C, "load: " + THREADS + "0"),
    Case("load/threads-str", lambda e: load(e.artifact, threads="4"), C, "load: " + THREADS + "'4'"),
    Case("load/none-path", lambda e: load(None), C, ("load: the path must be a str", "got NoneType")),
    Case("load/int-path", lambda e: load(5), C, ("load: the path must be a str", "got int")),
    Case("load/proc-file", lambda e: load("/proc/self/status"), A,
         "/proc/self/status: not a qcompiler artifact or truncated"),
    Case("load/dangling-symlink", lambda e: load(_symlink(e, "gone.qc", e.tmp / "gone")), A, "gone.qc: no such file"),
    Case("load/manifest-a-list", lambda e: load(_edited(e, "list.qc", manifest=b"[1, 2]")), A,
         "list.qc: not a qcompiler artifact (foreign manifest)"),
    Case("load/no-format", _load_edited("nofmt.qc", manifest=_drop("format")), A, "nofmt.qc: not a qcompiler artifact"),
    *[Case(f"load/no-{key}", _load_edited(f"no_{key}.qc", manifest=_drop(key)), A,
           f"no_{key}.qc: {MANIFEST}'{key}' is missing")
      for key in ("steps", "inputs", "outputs", "model", "march", "programs", "members")],
    Case("load/steps-not-a-list", _load_edited("steps.qc", manifest=_set("steps", "x")), A,
         MANIFEST + "'steps' is 'x', expected a JSON list"),
    Case("load/no-steps-for-a-program", _load_edited("nosteps.qc", manifest=_set("steps", [])), A,
         MANIFEST + "program 'bpu0' belongs to no BPU step"),
    Case("load/inputs-not-a-list", _load_edited("inputs.qc", manifest=_set("inputs", 5)), A,
         MANIFEST + "'inputs' is 5, expected a JSON list"),
    Case("load/model-not-a-str", _load_edited("model.qc", manifest=_set("model", 5)), A,
         MANIFEST + "'model' is 5, expected a JSON str"),
    Case("load/older-version", _load_edited("old.qc", manifest=_set("format_version", 0)), A,
         "old.qc: written by an older qcompiler (artifact format 0"),
    Case("load/version-float", _load_edited("float.qc", manifest=_set("format_version", 1.5)), A,
         "float.qc: corrupted (no format version)"),
    Case("load/version-bool", _load_edited("bool.qc", manifest=_set("format_version", True)), A,
         "bool.qc: corrupted (no format version)"),
    Case("load/step-kind-unknown", _load_edited("kind.qc", manifest=_manifest_edit(
        lambda m: m["steps"][0].__setitem__("kind", "gpu"))), A, MANIFEST + "steps[0]: kind 'gpu' is not a step kind"),
    Case("load/step-kind-torch", _load_edited("torch.qc", manifest=_manifest_edit(
        lambda m: m["steps"][1].__setitem__("kind", "torch"))), A,
         MANIFEST + "steps[1]: kind 'torch' is not a step kind"),
    Case("load/step-reads-nothing-made", _load_edited("reads.qc", manifest=_manifest_edit(
        lambda m: m["steps"][1].__setitem__("inputs", ["nowhere"]))), A,
         MANIFEST + "steps[1] ('cpu0') reads 'nowhere', which no earlier step or model input makes"),
    Case("load/outputs-not-a-structure", _load_edited("outs.qc", manifest=_set("outputs", "nowhere")), A,
         MANIFEST + "outputs: 'nowhere' is not an output structure"),
    Case("load/tensors-smaller-than-declared", _load_edited("small.qc", manifest=_manifest_edit(
        lambda m: m["members"].__setitem__("tensors.safetensors", 3))), A,
         "member 'tensors.safetensors' is 3 bytes, but the programs declare"),
    Case("load/island-size", _load_edited("island.qc", **{"islands/cpu0.onnx": b"garbage"}), A,
         "member 'islands/cpu0.onnx' declares 7 bytes uncompressed; the manifest says"),
    Case("load/signature-not-a-list", _load_edited("sig.qc", manifest=_set("input_signature", "x")), A,
         MANIFEST + "'input_signature' must list one entry per input (1), got 'x'"),
    Case("load/signature-entry", _load_edited("sige.qc", manifest=_set("input_signature", [[1, 2]])), A,
         MANIFEST + "input_signature[0][0]: expected a JSON object, got 1"),
    Case("load/program-without-ops", _load_edited("ops.qc", manifest=_manifest_edit(
        lambda m: m["programs"].__setitem__("bpu0", {}))), A, MANIFEST + "programs['bpu0']: 'ops' is missing"),
    Case("load/step-without-program", _load_edited("prog0.qc", manifest=_set("programs", {})), A,
         MANIFEST + "steps[0]: BPU step 'bpu0' has no program (programs: none)"),
]

OPSET = "only opset 11 is supported"
MORE_EXPORT = [
    Case("export/opset-12", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx", opset_version=12), C,
         ("opset_version=12: ", OPSET)),
    Case("export/opset-str", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx", opset_version="11"), C,
         ("opset_version='11': ", OPSET)),
    Case("export/f-none", lambda e: export_to_onnx(e.cm.converted, X, None), C,
         "export_to_onnx: f must be a path or a binary file object, got NoneType"),
    Case("export/dynamic-axes-unknown-name", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx",
                                                                      dynamic_axes={"y": {0: "batch"}}), C,
         "dynamic_axes names 'y', which is neither an input (x) nor an output (output)"),
    Case("export/dynamic-axes-axis-range", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx",
                                                                    dynamic_axes={"x": {7: "batch"}}), C,
         "dynamic_axes['x']: axis 7 does not exist in 'x', whose shape is (2, 3, 8, 8)"),
    Case("export/dynamic-axes-list-range", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx",
                                                                    dynamic_axes={"x": [4]}), C,
         "dynamic_axes['x']: axis 4 does not exist in 'x'"),
    Case("export/dynamic-axes-output-range", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx",
                                                                      dynamic_axes={"output": {3: "b"}}), C,
         "dynamic_axes['output']: axis 3 does not exist in 'output', whose shape is (2, 5)"),
    Case("export/dynamic-axes-str-axis", lambda e: export_to_onnx(e.cm.converted, X, e.tmp / "m.onnx",
                                                                  dynamic_axes={"x": {"0": "batch"}}), C,
         "dynamic_axes['x'] must be a dict {axis: name} or a list of axes (ints), got {'0': 'batch'}"),
    Case("export/args-numpy", lambda e: export_to_onnx(e.cm.converted, X.numpy(), e.tmp / "m.onnx"), C,
         "args must be a tensor or a tuple of the model's inputs, got ndarray"),
    Case("export/args-batch", lambda e: export_to_onnx(e.cm.converted, X[:1], e.tmp / "m.onnx", dynamic_batch=False),
         C, "input 'x' has shape (1, 3, 8, 8), the model was traced with shape (2, 3, 8, 8)"),
    Case("export/args-empty-batch", lambda e: export_to_onnx(e.cm.converted, X[:0], e.tmp / "m.onnx"), C,
         "input 'x' has shape (0, 3, 8, 8), an empty tensor; the model was traced with shape (2, 3, 8, 8)"),
    Case("export/none-path", lambda e: e.cm.export_onnx(None), C, ("export_onnx: the path must be a str",
                                                                  "got NoneType")),
    Case("export/int-path", lambda e: e.cm.export_onnx(5), C, ("export_onnx: the path must be a str", "got int")),
    Case("export/dump-none-path", lambda e: e.cm.dump(None), C, ("dump: the path must be a str", "got NoneType")),
    Case("export/in-proc", lambda e: e.cm.export_onnx("/proc/qc_catalogue.onnx"), OSError,
         ("export_to_onnx: ", "'/proc/qc_catalogue.onnx'")),
]
GOOD = ("good.py:build", "--input-shape", "1,3,8,8")
HYB = ("zoo:hybrid", "--input-shape", "1,3,32,32")  # the zoo model, small
MORE_CLI = [
    Case("cli/unknown-command", _cli("frobnicate"), 2, "argument COMMAND: invalid choice: 'frobnicate'"),
    Case("cli/unknown-option", _cli("partition", *GOOD, "--out", "o", "--frob"), 2,
         "unrecognized arguments: --frob"),
    Case("cli/missing-out", _cli("partition", *GOOD), 2, "the following arguments are required: --out"),
    Case("cli/dtype-without-shape", _cli("partition", "good.py:build", "--input-dtype", "int64", "--out", "o"), 2,
         "--input-dtype needs --input-shape"),
    Case("cli/more-dtypes-than-shapes", _cli("partition", *GOOD, "--input-dtype", "int64", "--input-dtype",
                                             "float32", "--out", "o"), 2,
         "2 --input-dtype values for 1 --input-shape values"),
    Case("cli/unknown-dtype", _cli("partition", *GOOD, "--input-dtype", "float16", "--out", "o"), 2,
         "argument --input-dtype: invalid choice: 'float16'"),
    Case("cli/zero-in-shape", _cli("partition", "good.py:build", "--input-shape", "1,0,8,8", "--out", "o"), 2,
         "argument --input-shape: malformed input shape '1,0,8,8'"),
    Case("cli/empty-shape", _cli("partition", "good.py:build", "--input-shape", "", "--out", "o"), 2,
         "argument --input-shape: malformed input shape ''"),
    Case("cli/negative-shape", _cli("partition", "good.py:build", "--input-shape", "1,-3,8,8", "--out", "o"), 2,
         "argument --input-shape: malformed input shape '1,-3,8,8'"),
    Case("cli/factory-without-shape", _cli("partition", "good.py:build", "--out", "o"), 2,
         "--input-shape is required for 'good.py:build'"),
    Case("cli/spec-without-factory", _cli("partition", "good.py", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "model 'good.py' must be 'zoo:NAME', 'package.module:factory' or 'path/to/file.py:factory'"),
    Case("cli/spec-empty-factory", _cli("partition", "good.py:", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "model 'good.py:' must be 'zoo:NAME'"),
    Case("cli/factory-not-callable", _cli("partition", "good.py:VALUE", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "'good.py:VALUE' is not callable: got int"),
    Case("cli/factory-needs-arguments", _cli("partition", "good.py:needs", "--input-shape", "1,3,8,8", "--out", "o"),
         2, "'good.py:needs' must be callable without arguments: missing a required argument: 'channels'"),
    Case("cli/module-not-found", _cli("partition", "qc_catalogue_absent:build", "--input-shape", "1,3,8,8",
                                      "--out", "o"), 2,
         "cannot import model module 'qc_catalogue_absent': No module named 'qc_catalogue_absent'"),
    Case("cli/zoo-empty-name", _cli("partition", "zoo:", "--out", "o"), 2, "unknown zoo model ''"),
    Case("cli/march-empty", _cli("partition", *GOOD, "--march", "", "--out", "o"), 2, "unknown march ''"),
    Case("cli/out-empty", _cli("partition", *GOOD, "--out", ""), 2, "argument --out: empty path"),
    Case("cli/out-below-a-file", _cli("partition", *GOOD, "--out", "notes.txt/dump"), 2,
         "argument --out: cannot create 'notes.txt/dump': 'notes.txt' is a file, not a directory"),
    Case("cli/hybrid-module-name-unknown", _cli("partition", *GOOD, "--hybrid-module-name", "conv9", "--out", "o"), 2,
         "hybrid_dict['module_name']: module 'conv9' is not in the model Conv2d"),
    Case("cli/leaf-module-unknown", _cli("partition", *HYB, "--leaf-module", "conv9", "--out", "o"), 2,
         "non_traceable_module_name: module 'conv9' is not in the model HybridModel"),
    Case("cli/zoo-input-rank", _cli("partition", "zoo:hybrid", "--input-shape", "1,3", "--out", "o"), 2,
         "node 'conv0' (module 'conv0' (Conv2d)) failed on inputs (f32[1,3])", notes=1),
    Case("cli/factory-input-channels", _cli("partition", "good.py:build", "--input-shape", "1,5,8,8", "--out", "o"), 2,
         "expected input[1, 5, 8, 8] to have 3 channels", notes=1),
    Case("cli/compile-has-no-dump-passes", _cli("compile", *HYB, "--dump-passes", "--out", "o"), 2,
         "unrecognized arguments: --dump-passes"),
    Case("cli/calib-batch-size-zero", _cli("compile", *HYB, "--calib-data", "wrong.npz", "--calib-batch-size", "0",
                                           "--out", "o"), 2, "--calib-batch-size must be at least 1"),
    Case("cli/calib-random-zero", _cli("compile", *HYB, "--calib-random", "0", "--out", "o"), 2,
         "--calib-random must be at least 1"),
    Case("cli/calib-random-not-int", _cli("compile", *HYB, "--calib-random", "x", "--out", "o"), 2,
         "argument --calib-random: invalid int value: 'x'"),
    Case("cli/calib-data-and-random", _cli("compile", *HYB, "--calib-random", "2", "--calib-data", "wrong.npz",
                                           "--out", "o"), 2,
         "argument --calib-data: not allowed with argument --calib-random"),
    Case("cli/calib-empty-file", _cli("compile", *HYB, "--calib-data", "empty.bin", "--out", "o"), 2,
         "--calib-data empty.bin: cannot read it as an .npz file (empty file)"),
    Case("cli/calib-wrong-shape", _cli("compile", *HYB, "--calib-data", "wrong.npz", "--out", "o"), 2,
         "--calib-data wrong.npz: input 0 has shape (4, 3, 9, 9); the example input has (1, 3, 32, 32)", notes=2),
    Case("cli/calib-two-arrays", _cli("compile", *HYB, "--calib-data", "two.npz", "--out", "o"), 2,
         "--calib-data two.npz: the model takes 1 inputs, got 2", notes=2),
    Case("cli/calib-int-array", _cli("compile", *HYB, "--calib-data", "ints.npz", "--out", "o"), 2,
         "--calib-data ints.npz: input 0 must be a float32 tensor like the example input's, got int64", notes=2),
    Case("cli/calib-no-arrays", _cli("compile", *HYB, "--calib-data", "none.npz", "--out", "o"), 2,
         "--calib-data none.npz: the model takes 1 inputs, got 0", notes=2),
    Case("cli/int16-budget-negative", _cli("compile", *HYB, "--int16-budget", "-0.5", "--calib-random", "1",
                                           "--out", "o"), 2, "compile: " + BUDGET + "-0.5"),
    Case("cli/int16-budget-int8-march", _cli("compile", *HYB, "--int16-budget", "0.1", "--march", "bernoulli2",
                                             "--calib-random", "1", "--out", "o"), 2,
         "march 'bernoulli2' has no int16 activations"),
    Case("cli/int16-budget-not-a-number", _cli("compile", *HYB, "--int16-budget", "x", "--out", "o"), 2,
         "argument --int16-budget: invalid float value: 'x'"),
    Case("cli/report-calib-random-zero", _cli("report", *HYB, "--calib-random", "0", "--out", "o"), 2,
         "--calib-random must be at least 1"),
    Case("cli/report-advise-negative", _cli("report", *HYB, "--advise", "-1", "--out", "o"), 2,
         "--advise K needs K >= 1 with --apply"),
    Case("cli/report-apply-without-advice", _cli("report", *HYB, "--advise", "0", "--apply", "fix.json",
                                                 "--out", "o"), 2, "--advise K needs K >= 1 with --apply"),
    Case("cli/report-unknown-metric", _cli("report", *HYB, "--metric", "MSE", "--out", "o"), 2,
         "argument --metric: invalid choice: 'MSE'"),
    Case("cli/report-target-not-a-number", _cli("report", *HYB, "--target-sqnr", "x", "--out", "o"), 2,
         "argument --target-sqnr: invalid float value: 'x'"),
]


def _q(content, name="q.json"):
    return lambda e: read_qconfig_file(_json(e, name, content))


def _h(content, name="h.json"):
    return lambda e: read_hybrid_file(_json(e, name, content))


ENTRY = "must be an object like {\"dtype\": \"qint16\", \"observer\": \"percentile\"}"
CONFIG = [
    Case("config/qconfig-missing", lambda e: read_qconfig_file("absent.json"), C,
         "--qconfig absent.json: cannot read it (No such file or directory)"),
    Case("config/qconfig-not-utf8", lambda e: read_qconfig_file(_write(e, "latin.json",
                                                                       b'{"global": {"dtype": "q\xe9"}}')),
         C, "latin.json: not a UTF-8 text (JSON) file"),
    Case("config/qconfig-byte-order-mark", lambda e: read_qconfig_file(_write(e, "bom.json", b'\xef\xbb\xbf{}')), C,
         "bom.json: not valid JSON (Unexpected UTF-8 BOM"),
    Case("config/qconfig-truncated-json", _q('{"global": ', "cut.json"), C,
         "cut.json: not valid JSON (Expecting value at line 1 column 12)"),
    Case("config/qconfig-empty-file", _q("", "empty.json"), C, "empty.json: not valid JSON (Expecting value at line 1"),
    Case("config/qconfig-top-level-list", _q([1], "list.json"), C,
         "list.json: the file must hold a JSON object, got list"),
    Case("config/qconfig-top-level-null", _q("null", "null.json"), C,
         "null.json: the file must hold a JSON object, got NoneType"),
    Case("config/qconfig-unknown-key", _q({"globals": {}}), C,
         "q.json: unknown key 'globals'; allowed: 'global', 'module_name'"),
    Case("config/qconfig-section-not-object", _q({"qconfig": []}), C,
         "q.json: ['qconfig'] must be an object, got list"),
    Case("config/qconfig-section-unknown-key", _q({"qconfig": {"global": {}, "module_type": {}}}), C,
         "q.json: ['qconfig'] unknown key 'module_type'"),
    Case("config/qconfig-global-not-object", _q({"global": "qint8"}), C,
         "q.json: ['global'] " + ENTRY + ", got 'qint8'"),
    Case("config/qconfig-unknown-field", _q({"global": {"dtyp": "qint8"}}), C,
         "q.json: ['global']: unknown field 'dtyp'; allowed: 'dtype', 'observer'"),
    Case("config/qconfig-unknown-dtype", _q({"global": {"dtype": "int4"}}), C,
         "q.json: ['global']['dtype']: 'int4' is not one of 'qint8', 'qint16'"),
    Case("config/qconfig-dtype-number", _q({"global": {"dtype": 8}}), C, "['global']['dtype']: 8 is not one of"),
    Case("config/qconfig-dtype-nan", _q('{"global": {"dtype": NaN}}'), C, "['global']['dtype']: nan is not one of"),
    Case("config/qconfig-unknown-observer", _q({"global": {"observer": "minmaxx"}}), C,
         "q.json: ['global']['observer']: 'minmaxx' is not one of 'minmax'"),
    Case("config/qconfig-module-name-list", _q({"module_name": ["conv"]}), C,
         "q.json: ['module_name'] must be an object {module path: entry}, got list"),
    Case("config/qconfig-module-entry-str", _q({"module_name": {"conv": "qint16"}}), C,
         "q.json: ['module_name']['conv'] " + ENTRY + ", got 'qint16'"),
    Case("config/qconfig-module-entry-dtype", _q({"module_name": {"conv": {"dtype": "qint4"}}}), C,
         "['module_name']['conv']['dtype']: 'qint4' is not one of 'qint8', 'qint16'"),
    Case("config/qconfig-module-entry-field", _q({"module_name": {"conv": {"bits": 16}}}), C,
         "['module_name']['conv']: unknown field 'bits'"),
    Case("config/qconfig-option-name", lambda e: read_qconfig_file(_json(e, "fix.json", [1]), option="--apply"), C,
         "--apply {tmp}/inputs/fix.json: the file must hold a JSON object, got list"),
    Case("config/hybrid-missing", lambda e: read_hybrid_file("absent.json"), C,
         "--hybrid absent.json: cannot read it (No such file or directory)"),
    Case("config/hybrid-top-level-list", _h(["fc"]), C, "h.json: the file must hold a JSON object, got list"),
    Case("config/hybrid-unknown-key", _h({"module_names": ["fc"]}), C,
         "h.json: unknown key 'module_names'; allowed: 'module_name', 'module_type'"),
    Case("config/hybrid-section-str", _h({"hybrid": "fc"}), C, "h.json: ['hybrid'] must be an object, got str"),
    Case("config/hybrid-names-str", _h({"module_name": "fc"}), C,
         "h.json: ['module_name'] must be a list of strings, got 'fc'"),
    Case("config/hybrid-names-ints", _h({"module_name": [1]}), C,
         "h.json: ['module_name'] must be a list of strings, got [1]"),
    Case("config/hybrid-types-object", _h({"module_type": {"a": 1}}), C,
         "h.json: ['module_type'] must be a list of strings, got {'a': 1}"),
    Case("config/write-to-directory", lambda e: write_config_file(e.tmp / "sub", {}), C,
         "--apply: '{tmp}/sub' is a directory"),
    Case("config/write-below-a-file", lambda e: write_config_file(e.tmp / "notes.txt" / "fix.json", {}), C,
         "notes.txt' is a file, not a directory"),
    Case("config/cli-qconfig-missing", _cli("compile", *HYB, "--qconfig", "absent.json", "--out", "o"), 2,
         "--qconfig absent.json: cannot read it (No such file or directory)"),
    Case("config/cli-qconfig-bad-json", lambda e: main(["compile", *HYB, "--qconfig", str(_json(e, "bad.json", "{")),
                                                        "--out", "o"]), 2, "bad.json: not valid JSON"),
    Case("config/cli-hybrid-names-str", lambda e: main(["compile", *HYB, "--hybrid", str(_json(
        e, "h.json", {"module_name": "conv3"})), "--out", "o"]), 2, "['module_name'] must be a list of strings"),
    Case("config/cli-qconfig-unknown-module", lambda e: main(["compile", *HYB, "--calib-random", "1", "--qconfig", str(
        _json(e, "q.json", {"module_name": {"conv9": {"dtype": "qint16"}}})), "--out", "o"]), 2,
         "qconfig_dict['module_name']: module 'conv9' is not in the model HybridModel"),
    Case("config/cli-hybrid-unknown-module", lambda e: main(["compile", *HYB, "--calib-random", "1", "--hybrid", str(
        _json(e, "h.json", {"hybrid": {"module_name": ["conv9"]}})), "--out", "o"]), 2,
         "hybrid_dict['module_name']: module 'conv9' is not in the model HybridModel"),
    Case("config/cli-qconfig-int16-on-int8-march", lambda e: main(["compile", *HYB, "--calib-random", "1", "--march",
                                                                   "bernoulli2", "--qconfig", str(_json(
        e, "q16.json", {"global": {"dtype": "qint16"}})), "--out", "o"]), 2,
         "its qconfig asks for qint16, but march 'bernoulli2' has no int16", notes=1),
]
W = QCompilerWarning
OFF = "native kernels are off (building the native kernels failed: "
REFUSED = "refusing the native kernel cache: "


def _cc(env, name, body, executable=True):
    """A compiler script in ``inputs/``, with the cache in ``inputs/`` too (nothing is written elsewhere)."""
    cc = _script(env, name, body, executable)
    return _native_run(env, CC=cc, QCOMPILER_NATIVE_CACHE=env.inputs / "cache")


def _cc_directory(env):
    (env.inputs / "cc.d").mkdir()
    return _native_run(env, CC=env.inputs / "cc.d", QCOMPILER_NATIVE_CACHE=env.inputs / "cache")


def _native_disabled_block(env):
    """A failure inside ``build.disabled()``: the variable and the native decision come back."""
    before = build.native_enabled()
    try:
        with build.disabled():
            BpuSimulator(env.loaded.runtime.programs["bpu0"], native=True)
    finally:
        assert build.native_enabled() == before


def _cli_keeps_modules(module, *argv):
    """A CLI call whose model import fails leaves no half-imported ``module`` in sys.modules."""
    def action(env):
        try:
            return main([str(a) for a in argv])
        finally:
            assert module not in sys.modules, f"{module} is left in sys.modules"
    return action


NATIVE = [
    Case("native/off-0", lambda e: _native_off(e, "0"), C, "native=True but the native kernels are off"),
    Case("native/off-word", lambda e: _native_off(e, "off"), C, "native=True but the native kernels are off"),
    Case("native/off-false-padded", lambda e: _native_off(e, " FALSE "), C,
         "native=True but the native kernels are off"),
    Case("native/off-no", lambda e: _native_off(e, "no"), C, "native=True but the native kernels are off"),
    Case("native/plan-needs-the-library", lambda e: _with_environ(lambda: NativeSteps([]), QCOMPILER_NATIVE="0"), C,
         "NativeSteps: the native kernels are off; check native_enabled() first"),
    Case("native/kernel-needs-the-library", lambda e: _with_environ(lambda: kernels.rows_minmax(X.reshape(6, -1)),
                                                                   QCOMPILER_NATIVE="0"), C,
         "native kernel qc_rows_minmax_f32: the native kernels are off"),
    Case("native/cc-missing", lambda e: _native_run(e, CC="/nonexistent/qc-catalogue-cc",
                                                    QCOMPILER_NATIVE_CACHE=e.inputs / "cache"), W,
         (OFF, "No such file or directory: '/nonexistent/qc-catalogue-cc'")),
    Case("native/cc-false", lambda e: _native_run(e, CC="false", QCOMPILER_NATIVE_CACHE=e.inputs / "cache"), W,
         OFF + "false exited with 1"),
    Case("native/cc-fails-with-a-message", lambda e: _cc(e, "fail.sh", "echo 'kernels.c:1: error: boom' >&2\nexit 3\n"),
         W, OFF + "fail.sh exited with 3: kernels.c:1: error: boom"),
    Case("native/cc-not-executable", lambda e: _cc(e, "noexec.sh", "exit 0\n", executable=False), W,
         (OFF, "Permission denied: '{tmp}/inputs/noexec.sh'")),
    Case("native/cc-is-a-directory", _cc_directory, W, (OFF, "Permission denied: '{tmp}/inputs/cc.d'")),
    Case("native/cache-is-a-file", lambda e: _native_cache(e, str(e.tmp / "notes.txt")), W,
         REFUSED + "{tmp}/notes.txt cannot be used (Not a directory)"),
    Case("native/cache-below-a-file", lambda e: _native_cache(e, str(e.tmp / "notes.txt" / "cache")), W,
         REFUSED + "{tmp}/notes.txt/cache cannot be used (Not a directory)"),
    Case("native/cache-in-proc", lambda e: _native_cache(e, "/proc/qc-catalogue-native"), W,
         REFUSED + "/proc/qc-catalogue-native cannot be used"),
    Case("native/cache-in-sys", lambda e: _native_cache(e, "/sys/qc-catalogue-native"), W,
         REFUSED + "/sys/qc-catalogue-native cannot be used"),
    Case("native/compile-without-a-compiler", lambda e: _native_compile(e, CC="/nonexistent/qc-catalogue-cc",
                                                                        QCOMPILER_NATIVE_CACHE=e.inputs / "cache"), W,
         (OFF, "'/nonexistent/qc-catalogue-cc'")),
]

PAIRS = "evaluate: dataset items must be (input, target) pairs"
_MISSING = "not set: launch with torchrun, or set the torch.distributed environment variables"
DIST = [
    Case("dist/evaluate-loader-a-list", lambda e: distributed.evaluate(e.cm, [X], _metric, progress=False), C,
         "evaluate: loader must be a torch.utils.data.DataLoader, got list"),
    Case("dist/evaluate-loader-a-dataset", lambda e: distributed.evaluate(e.cm, TensorDataset(X, Y), _metric,
                                                                          progress=False), C,
         "evaluate: loader must be a torch.utils.data.DataLoader, got TensorDataset"),
    Case("dist/evaluate-metric-not-callable", lambda e: distributed.evaluate(e.cm, _loader(X, Y), "accuracy",
                                                                             progress=False), C,
         "evaluate: metric must be a callable metric(outputs, targets)"),
    Case("dist/evaluate-items-singletons", lambda e: distributed.evaluate(e.cm, _loader(X), _metric, progress=False), C,
         PAIRS),
    Case("dist/evaluate-items-triples", lambda e: distributed.evaluate(e.cm, _loader(X, Y, Y), _metric,
                                                                       progress=False), C, PAIRS),
    Case("dist/evaluate-outputs-str", lambda e: distributed.evaluate(lambda x: "out", _loader(X, Y), _metric,
                                                                     progress=False), C,
         "evaluate: model outputs must be tensors or tuples of tensors, got str"),
    Case("dist/evaluate-outputs-dict", lambda e: distributed.evaluate(lambda x: {"y": x}, _loader(X, Y), _metric,
                                                                      progress=False), C,
         "evaluate: model outputs must be tensors or tuples of tensors, got dict"),
    Case("dist/evaluate-bad-inputs", lambda e: distributed.evaluate(e.cm, _loader(X4C, Y), _metric, progress=False), C,
         "input 0 ('x') has shape (1, 4, 8, 8)"),
    Case("dist/evaluate-training-model-bad-items", lambda e: distributed.evaluate(e.qat, _loader(X), _metric,
                                                                                  progress=False), C, PAIRS),
    Case("dist/sync-observers-str", lambda e: sync_observers("model"), C,
         "sync_observers takes a torch.nn.Module, got str"),
    Case("dist/sync-observers-none", lambda e: sync_observers(None), C,
         "sync_observers takes a torch.nn.Module, got NoneType"),
    Case("dist/join-without-rank", _join(WORLD_SIZE="2", RANK=None, MASTER_ADDR=None, MASTER_PORT=None), C,
         "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT " + _MISSING),
    Case("dist/join-without-port", _join(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=None), C,
         "WORLD_SIZE=2 but MASTER_PORT " + _MISSING),
    Case("dist/join-without-address", _join(WORLD_SIZE="4", RANK="3", MASTER_ADDR=None, MASTER_PORT="29500"), C,
         "WORLD_SIZE=4 but MASTER_ADDR " + _MISSING),
    Case("dist/cli-compile-world-without-rank", _cli_env(
        {"WORLD_SIZE": "2", "RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None}, "compile", *HYB, "--out", "o"), 2,
         "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set"),
]

SIDE = [
    Case("side/set-march-unknown", lambda e: qcompiler.set_march("pentium"), C, "unknown march 'pentium'"),
    Case("side/set-march-int", lambda e: qcompiler.set_march(7), C, "unknown march 7"),
    Case("side/compile-nan-in-a-later-batch", _compile(calib_data=[X, NAN]), CalibrationError,
         "observer 'x_activation_post_process' saw NaN/Inf"),
    Case("side/compile-nan-with-weight-rounding", _compile(calib_data=[X, NAN], weight_rounding=True),
         CalibrationError, "observer 'x_activation_post_process' saw NaN/Inf"),
    Case("side/compile-fails-under-no-grad", lambda e: _under_no_grad(e, _compile(calib_data=[NAN])),
         CalibrationError, "observer 'x_activation_post_process' saw NaN/Inf"),
    Case("side/evaluate-reader-fails-first", lambda e: _evaluate_keeps_threads(e, e.cm, _loader(X)), C, PAIRS),
    Case("side/evaluate-reader-fails-later", lambda e: _evaluate_keeps_threads(
        e, e.cm, DataLoader([(X[0], 0), (X[1], 1), ("bad",)], batch_size=1)), C, PAIRS),
    Case("side/evaluate-model-fails", lambda e: _evaluate_keeps_threads(e, e.cm, _loader(X4C, Y)), C,
         "input 0 ('x') has shape (1, 4, 8, 8)"),
    Case("side/compile-fails-under-float64-default", lambda e: _under_float64(e, _compile(calib_data=[X, NAN])),
         CalibrationError, "observer 'x_activation_post_process' saw NaN/Inf"),
    Case("side/call-fails-under-deterministic", lambda e: _under_deterministic(e, lambda e: e.cm(X4C)), C,
         "input 0 ('x') has shape (2, 4, 8, 8)"),
    Case("side/compile-fails-under-inference-mode", lambda e: _under_inference_mode(e, _compile(calib_data=[NAN])),
         CalibrationError, "observer 'x_activation_post_process' saw NaN/Inf"),
    Case("side/split-call-fails", lambda e: _split_call(e, torch.cat([X4C, X4C])), C,
         "input 0 ('x') has shape (4, 4, 8, 8)"),
    Case("side/threads-refused-keeps-value", lambda e: _threads_kept(e, 0), C,
         "CompiledModel.threads: " + THREADS + "0"),
    Case("side/native-disabled-block-fails", lambda e: _native_disabled_block(e), C,
         "native=True but the native kernels are off"),
    Case("side/native-private-dir-removed", _private_dir_removed, W, REFUSED + "{tmp}/notes.txt cannot be used"),
    Case("side/cli-module-import-keeps-sys-path", _cli("partition", "qc_catalogue_absent.sub:build", "--input-shape",
                                                       "1,3,8,8", "--out", "o"), 2,
         "cannot import model module 'qc_catalogue_absent.sub'"),
    Case("side/cli-out-probe-leaves-nothing", _cli("partition", "raises.py:build", "--input-shape", "1,3,8,8",
                                                   "--out", "fresh/deeper"), 2,
         "model factory 'raises.py:build' failed"),
    Case("side/cli-import-fails-keeps-modules", _cli_keeps_modules("import_raises", "partition", "import_raises:build",
                                                                   "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "cannot import model module 'import_raises'"),
    Case("side/cli-file-import-fails-keeps-modules", _cli_keeps_modules(
        "missing_dep", "partition", "missing_dep.py:build", "--input-shape", "1,3,8,8", "--out", "o"), 2,
         "cannot import model file 'missing_dep.py'"),
]

# ----------------------------------------------------------------------------- issue 37: the native kernel cache
# Every row runs a compiler that fails at once (``false``) or a shell script: each check is reached before
# any real build, and the result is the exact torch path's.

NOBODY = 65534  # another user's uid and gid (os.chown needs root: those rows are root_only)
NOT_LOADING = "qcompiler: not loading the cached native kernels: "
LIBRARY = bytes(range(256)) * 64  # a planted "library": the checks of these rows all come before dlopen
NAMED_CC = """\
if [ "$1" = --version ]; then echo "qc-catalogue-cc 1.0"; exit 0; fi
out=""
while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
echo "not writing $out" >&2
exit 3
"""  # a compiler that answers --version and fails naming its output (where the rebuild goes)


def _cache_dir(env, name="cache", mode=0o700, owner=None) -> Path:
    path = env.inputs / name
    path.mkdir()
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def _library_name(cc) -> str:
    """The name the cache key gives the library ``cc`` builds (as build.library computes it)."""
    return build._library_name(shutil.which(str(cc)) or str(cc), (build.IDLE_S, build.MAX_S))


def _digest_file(lib: Path, text=None) -> Path:
    """``<lib>.sha256`` as a build records it (or holding ``text``), 0600."""
    record = Path(f"{lib}.sha256")
    record.write_text(text if text is not None else f"{hashlib.sha256(lib.read_bytes()).hexdigest()}  {lib.name}\n")
    record.chmod(0o600)
    return record


def _cached_library(env, change, cc="false"):
    """A library (and its digest) in a private cache under the name ``cc``'s build would have, changed
    by ``change(lib)``; then the artifact runs with ``cc`` as the compiler."""
    cache = _cache_dir(env)
    lib = cache / _library_name(cc)
    lib.write_bytes(LIBRARY)
    lib.chmod(0o700)
    _digest_file(lib)
    change(lib)
    return _native_run(env, CC=cc, QCOMPILER_NATIVE_CACHE=cache)


def _chown(path, uid=NOBODY):
    os.chown(path, uid, uid, follow_symlinks=False)


def _symlinked(lib: Path):
    """The library replaced by a symbolic link to a copy of it (its digest still matches the target)."""
    target = lib.with_name("elsewhere.so")
    lib.rename(target)
    lib.symlink_to(target)


def _without_digest(env):
    """No digest beside the library (a cache from before digests): rebuilt without a word, into the cache."""
    cc = _script(env, "named-cc.sh", NAMED_CC)
    return _cached_library(env, lambda lib: Path(f"{lib}.sha256").unlink(), cc=cc)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _hung_cc(env, where, **limits):
    """A compiler that sleeps (in ``--version`` too, or only when compiling): killed, its whole group,
    once the limit passes; no process of it is left."""
    pids = env.inputs / "pids"
    answer = 'if [ "$1" = --version ]; then echo "qc-catalogue-cc 1.0"; exit 0; fi\n' if where == "compile" else ""
    cc = _script(env, "hang.sh", f"echo $$ >> {pids}\n{answer}exec sleep 60\n")
    try:
        return _native_run(env, CC=cc, QCOMPILER_NATIVE_CACHE=env.inputs / "cache", **limits)
    finally:
        left = [pid for pid in map(int, pids.read_text().split()) if _alive(pid)]
        assert not left, f"the hung compiler's processes {left} are still running"


def _limit(name, value, default, label=None):
    """A bad time limit of the compiler: named in a warning, and the default used."""
    return Case(f"native/{name.split('_')[-2].lower()}-s-{label or value}",
                lambda e: _native_run(e, CC="false", QCOMPILER_NATIVE_CACHE=e.inputs / "cache", **{name: value}), W,
                f"qcompiler: {name}={value!r} is not a positive number of seconds; using {default}")


IDLE, CAP = build.ENV_BUILD_IDLE, build.ENV_BUILD_MAX
HUNG = "used no CPU for 1 s and was killed as hung (QCOMPILER_NATIVE_BUILD_IDLE_S sets the limit)"
NATIVE_CACHE = [
    Case("native/cache-writable-by-others", lambda e: _native_cache(e, str(_cache_dir(e, "shared", 0o1777))), W,
         REFUSED + "{tmp}/inputs/shared is writable by others (mode 1777); building the kernels in a private "
         "directory instead"),
    Case("native/cache-writable-by-its-group", lambda e: _native_cache(e, str(_cache_dir(e, "group", 0o770))), W,
         REFUSED + "{tmp}/inputs/group is writable by its group (mode 0770)"),
    Case("native/cache-owned-by-another-uid", lambda e: _native_cache(e, str(_cache_dir(e, "theirs", 0o755, NOBODY))),
         W, REFUSED + "{tmp}/inputs/theirs is owned by uid 65534, not by this user (uid 0)", root_only=True),
    Case("native/library-owned-by-another-user", lambda e: _cached_library(e, _chown), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so is owned by uid 65534, not by this user (uid 0); "
          "rebuilding them"), root_only=True),
    Case("native/library-writable-by-others", lambda e: _cached_library(e, lambda lib: lib.chmod(0o777)), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so is writable by others (mode 0777); rebuilding them")),
    Case("native/library-a-symbolic-link", lambda e: _cached_library(e, _symlinked), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so cannot be opened (a symbolic link)")),
    Case("native/digest-owned-by-another-user", lambda e: _cached_library(e, lambda lib: _chown(f"{lib}.sha256")), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so.sha256 is owned by uid 65534"), root_only=True),
    Case("native/digest-wrong", lambda e: _cached_library(e, lambda lib: _digest_file(lib, f"{'0' * 64}  {lib.name}")),
         W, (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so does not match the SHA-256 recorded in qc_kernels_",
             ".so.sha256 (damaged or replaced); rebuilding them")),
    Case("native/digest-malformed", lambda e: _cached_library(e, lambda lib: _digest_file(lib, "garbage\n")), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so.sha256 does not hold '<sha256>  qc_kernels_")),
    Case("native/digest-missing", _without_digest, W,
         OFF + "named-cc.sh exited with 3: not writing {tmp}/inputs/cache/.qc_kernels_"),
    Case("native/library-truncated", lambda e: _cached_library(e, lambda lib: lib.write_bytes(LIBRARY[:5000])), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so does not match the SHA-256 recorded")),
    Case("native/library-empty", lambda e: _cached_library(e, lambda lib: lib.write_bytes(b"")), W,
         (NOT_LOADING + "{tmp}/inputs/cache/qc_kernels_", ".so does not match the SHA-256 recorded")),
    Case("native/cache-relative", lambda e: _native_run(e, CC="false", QCOMPILER_NATIVE_CACHE="rel",
                                                        XDG_CACHE_HOME=e.inputs / "xdg"), W,
         "qcompiler: QCOMPILER_NATIVE_CACHE='rel' is not an absolute path, so it is ignored; the native kernels are "
         "cached in {tmp}/inputs/xdg/qcompiler/native instead (set it to an absolute path)"),
    Case("native/cache-relative-dot", lambda e: _native_run(e, CC="false", QCOMPILER_NATIVE_CACHE="./inputs/cache",
                                                            XDG_CACHE_HOME=e.inputs / "xdg"), W,
         "qcompiler: QCOMPILER_NATIVE_CACHE='./inputs/cache' is not an absolute path, so it is ignored"),
    _limit(IDLE, "abc", 20), _limit(IDLE, "0", 20), _limit(IDLE, "nan", 20), _limit(IDLE, "1e400", 20),
    _limit(CAP, "-1", 600, "negative"), _limit(CAP, "inf", 600), _limit(CAP, "10m", 600),
    Case("native/compiler-hangs-in-version", lambda e: _hung_cc(e, "version", **{IDLE: "1"}), W,
         OFF + "`hang.sh --version` " + HUNG),
    Case("native/compiler-hangs-compiling", lambda e: _hung_cc(e, "compile", **{IDLE: "1"}), W,
         OFF + f"`hang.sh` compiling the native kernels ({len(build.SOURCES)} sources) " + HUNG),
    Case("native/compiler-past-the-cap", lambda e: _hung_cc(e, "compile", **{IDLE: "100", CAP: "1"}), W,
         OFF + f"`hang.sh` compiling the native kernels ({len(build.SOURCES)} sources) was still running after 1 s "
         "and was killed (the cap on a build; QCOMPILER_NATIVE_BUILD_MAX_S sets it)"),
]


# ----------------------------------------------------------------------------- issue 37: what an island may hold

NOT_OURS = "; the island is not one qcompiler writes (compile and save the model again)"
ISLAND = "member 'islands/cpu0.onnx': island 'cpu0': "


def _island_edit(change):
    """load of the artifact with its island edited by ``change(island)``, the manifest re-declaring the
    member sizes (so the edit reaches the island's checks)."""
    def action(env):
        e = Edit(env.artifact)
        island = onnx.load_from_string(e.members["islands/cpu0.onnx"])
        change(island)
        e.members["islands/cpu0.onnx"] = island.SerializeToString()
        return load(e.write(env.inputs / "island.qc"))
    return action


def _appended(make):
    """A node ``make(x, y)`` after the island's last node: it reads what that node made, writes the output."""
    def change(island):
        last = island.graph.node[-1]
        y = last.output[0]
        last.output[0] = f"{y}/pre"
        island.graph.node.append(make(f"{y}/pre", y))
    return change


def _loop_forever(island):
    """Loop(M = 2^62, cond = true) passing its input through: valid ONNX whose run never ends."""
    island.graph.initializer.extend([numpy_helper.from_array(np.array(1 << 62, np.int64), "trip_count"),
                                     numpy_helper.from_array(np.array(True), "keep_going")])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["v_in"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", onnx.TensorProto.FLOAT, None)])
    _appended(lambda x, y: helper.make_node("Loop", ["trip_count", "keep_going", x], [y], name="forever",
                                            body=body))(island)


def _gemm_attribute(name, value):
    def change(island):
        gemm = island.graph.node[0]
        kept = [a for a in gemm.attribute if a.name != name]
        gemm.ClearField("attribute")
        gemm.attribute.extend([*kept, helper.make_attribute(name, value)])
    return change


def _local_function(island):
    island.functions.append(helper.make_function("qc.catalogue", "helper", ["a"], ["b"],
                                                 [helper.make_node("Identity", ["a"], ["b"])],
                                                 [helper.make_opsetid("", 11)]))


GEMM = "node 'cpu0/fc' (Gemm) has attribute "
ISLANDS = [
    Case("load/island-loop", _island_edit(_loop_forever), A,
         "island.qc: " + ISLAND + "node 'forever' has op type 'Loop', which qcompiler never writes" + NOT_OURS),
    Case("load/island-unknown-op", _island_edit(_appended(lambda x, y: helper.make_node("NoSuchOp", [x], [y],
                                                                                        name="extra"))), A,
         ISLAND + "node 'extra' has op type 'NoSuchOp', which qcompiler never writes" + NOT_OURS),
    Case("load/island-op-not-ours", _island_edit(_appended(lambda x, y: helper.make_node("Hardmax", [x], [y],
                                                                                         name="extra"))), A,
         ISLAND + "node 'extra' has op type 'Hardmax', which qcompiler never writes"),
    Case("load/island-unnamed-node", _island_edit(_appended(lambda x, y: helper.make_node("Hardmax", [x], [y]))), A,
         ISLAND + "node 1 (unnamed) has op type 'Hardmax'"),
    Case("load/island-unlisted-attribute", _island_edit(_gemm_attribute("alpha", 2.0)), A,
         ISLAND + GEMM + "'alpha', which qcompiler never writes on Gemm" + NOT_OURS),
    Case("load/island-attribute-type", _island_edit(_gemm_attribute("transB", 1.0)), A,
         ISLAND + GEMM + "'transB' of type FLOAT; qcompiler writes it as INT" + NOT_OURS),
    Case("load/island-attribute-graph", _island_edit(_gemm_attribute("transB", helper.make_graph([], "g", [], []))),
         A, ISLAND + GEMM + "'transB' of type GRAPH; qcompiler writes it as INT"),
    Case("load/island-custom-domain", _island_edit(lambda m: m.opset_import.append(
        helper.make_opsetid("com.microsoft", 1))), A,
         ISLAND + "imports domain 'com.microsoft' (version 1); qcompiler imports only the default ONNX domain at "
         "opset 11" + NOT_OURS),
    Case("load/island-node-of-a-custom-domain", _island_edit(lambda m: setattr(m.graph.node[0], "domain",
                                                                               "com.microsoft")), A,
         ISLAND + "node 'cpu0/fc' has op type 'Gemm' of domain 'com.microsoft'; qcompiler writes only the default "
         "ONNX domain" + NOT_OURS),
    Case("load/island-opset-13", _island_edit(lambda m: setattr(m.opset_import[0], "version", 13)), A,
         ISLAND + "imports domain '' (version 13); qcompiler imports only the default ONNX domain at opset 11"),
    Case("load/island-local-function", _island_edit(_local_function), A,
         ISLAND + "defines 1 local function ('helper'); qcompiler writes none" + NOT_OURS),
]


# ----------------------------------------------------------------------------- issue 37: files that are not files



def _on_fifo(env, name, call):
    """``call(fifo)`` on a new FIFO in ``inputs/``; a reader that blocks on it is released after
    FIFO_RELEASE_S s, so a blocking call fails the row instead of hanging the run."""
    fifo = env.inputs / name
    os.mkfifo(fifo)
    with fifo_watch(fifo) as released:
        try:
            return call(fifo)
        finally:
            assert not released.is_set(), f"the call blocked reading the FIFO {fifo}"


def _big(env, name="big.json", size=MAX_CONFIG_BYTES + 1) -> Path:
    path = env.inputs / name
    with open(path, "wb") as f:  # sparse: no disk used, and never read
        f.truncate(size)
    return path


def _keeps_out(module, action):
    """``action`` fails, and ``module`` (named in the input) is not imported by it."""
    def run(env):
        before = module in sys.modules
        try:
            return action(env)
        finally:
            assert (module in sys.modules) == before, f"{module} was imported"
    return run


DEEP = "[" * 100_000 + "]" * 100_000
TOO_DEEP = ": nested too deep to be a config file (qconfig and hybrid files nest at most 4 levels)"
CHAR_DEVICE = "/dev/zero: not a regular file (a character device); give the path of a JSON file"
TOO_BIG = f": {MAX_CONFIG_BYTES + 1} bytes, more than the {MAX_CONFIG_BYTES} a config file may have"
OBSERVERS = "is not one of 'minmax'"
NOT_A_CASE = ": not a regular file ({}); give the path of a bad-case file"
THIS = "cannot import module type 'this.X': not a class of the model's modules or their bases, nor of a loaded " \
       "module (names are never imported)"


def _cli_config(option, make, *extra):
    """The CLI compiling the zoo model with ``option`` naming the file ``make(env)``."""
    return lambda e: main(["compile", *HYB, "--calib-random", "1", option, str(make(e)), *extra, "--out", "o"])


def _cli_fifo(option):
    return lambda e: _on_fifo(e, "pipe.json", lambda fifo: main(["compile", *HYB, "--calib-random", "1", option,
                                                                 str(fifo), "--out", "o"]))


FILES = [
    Case("load/case-fifo", lambda e: _on_fifo(e, "case.safetensors", load_case), A,
         "{tmp}/inputs/case.safetensors" + NOT_A_CASE.format("a FIFO")),
    Case("load/case-directory", lambda e: load_case(e.tmp / "sub"), A, "{tmp}/sub" + NOT_A_CASE.format("a directory")),
    Case("load/case-dev-zero", lambda e: load_case("/dev/zero"), A,
         "/dev/zero" + NOT_A_CASE.format("a character device")),
    Case("load/case-missing", lambda e: load_case(e.tmp / "absent.safetensors"), A,
         "{tmp}/absent.safetensors: cannot read it (No such file or directory)"),
    Case("load/case-text-file", lambda e: load_case(e.tmp / "notes.txt"), A,
         "{tmp}/notes.txt: not a qcompiler bad-case file"),
    Case("config/qconfig-observer-list", _q({"global": {"observer": ["percentile"]}}), C,
         "q.json: ['global']['observer']: ['percentile'] " + OBSERVERS),
    Case("config/qconfig-observer-object", _q({"global": {"observer": {"a": 1}}}), C,
         "q.json: ['global']['observer']: {'a': 1} " + OBSERVERS),
    Case("config/qconfig-module-observer-list", _q({"module_name": {"fc": {"observer": ["percentile"]}}}), C,
         "q.json: ['module_name']['fc']['observer']: ['percentile'] " + OBSERVERS),
    Case("config/qconfig-dtype-object", _q({"global": {"dtype": {"qint16": True}}}), C,
         "q.json: ['global']['dtype']: {'qint16': True} is not one of 'qint8', 'qint16'"),
    Case("config/qconfig-deep", _q(DEEP, "deep.json"), C, "--qconfig {tmp}/inputs/deep.json" + TOO_DEEP),
    Case("config/hybrid-deep", _h(DEEP, "deep.json"), C, "--hybrid {tmp}/inputs/deep.json" + TOO_DEEP),
    Case("config/qconfig-dev-zero", lambda e: read_qconfig_file("/dev/zero"), C, "--qconfig " + CHAR_DEVICE),
    Case("config/hybrid-dev-zero", lambda e: read_hybrid_file("/dev/zero"), C, "--hybrid " + CHAR_DEVICE),
    Case("config/qconfig-fifo", lambda e: _on_fifo(e, "pipe.json", read_qconfig_file), C,
         "--qconfig {tmp}/inputs/pipe.json: not a regular file (a FIFO); give the path of a JSON file"),
    Case("config/hybrid-fifo", lambda e: _on_fifo(e, "pipe.json", read_hybrid_file), C,
         "--hybrid {tmp}/inputs/pipe.json: not a regular file (a FIFO)"),
    Case("config/qconfig-directory", lambda e: read_qconfig_file(e.tmp / "sub"), C,
         "--qconfig {tmp}/sub: not a regular file (a directory)"),
    Case("config/qconfig-over-the-cap", lambda e: read_qconfig_file(_big(e)), C,
         "--qconfig {tmp}/inputs/big.json" + TOO_BIG),
    Case("config/hybrid-over-the-cap", lambda e: read_hybrid_file(_big(e)), C,
         "--hybrid {tmp}/inputs/big.json" + TOO_BIG),
    Case("config/hybrid-type-this", _keeps_out("this", lambda e: qcompiler.compile(
        e.model, X, hybrid_dict=read_hybrid_file(_json(e, "h.json", {"hybrid": {"module_type": ["this.X"]}})),
        progress=False)), C, "hybrid_dict['module_type'][0]: " + THIS),
    Case("config/hybrid-type-antigravity", _keeps_out("antigravity", lambda e: qcompiler.compile(
        e.model, X, hybrid_dict={"module_type": ["antigravity.fly"]}, progress=False)), C,
         "hybrid_dict['module_type'][0]: cannot import module type 'antigravity.fly'"),
    Case("config/cli-qconfig-observer-list", _cli_config("--qconfig", lambda e: _json(
        e, "q.json", {"global": {"observer": ["percentile"]}})), 2,
         "--qconfig {tmp}/inputs/q.json: ['global']['observer']: ['percentile'] " + OBSERVERS),
    Case("config/cli-qconfig-observer-object", _cli_config("--qconfig", lambda e: _json(
        e, "q.json", {"module_name": {"conv0": {"observer": {"a": 1}}}})), 2,
         "--qconfig {tmp}/inputs/q.json: ['module_name']['conv0']['observer']: {'a': 1} " + OBSERVERS),
    Case("config/cli-qconfig-deep", _cli_config("--qconfig", lambda e: _json(e, "deep.json", DEEP)), 2,
         "--qconfig {tmp}/inputs/deep.json" + TOO_DEEP),
    Case("config/cli-hybrid-deep", _cli_config("--hybrid", lambda e: _json(e, "deep.json", DEEP)), 2,
         "--hybrid {tmp}/inputs/deep.json" + TOO_DEEP),
    Case("config/cli-qconfig-dev-zero", _cli_config("--qconfig", lambda e: "/dev/zero"), 2, "--qconfig " + CHAR_DEVICE),
    Case("config/cli-hybrid-dev-zero", _cli_config("--hybrid", lambda e: "/dev/zero"), 2, "--hybrid " + CHAR_DEVICE),
    Case("config/cli-qconfig-fifo", _cli_fifo("--qconfig"), 2,
         "--qconfig {tmp}/inputs/pipe.json: not a regular file (a FIFO); give the path of a JSON file"),
    Case("config/cli-hybrid-fifo", _cli_fifo("--hybrid"), 2, "--hybrid {tmp}/inputs/pipe.json: not a regular file"),
    Case("config/cli-qconfig-over-the-cap", _cli_config("--qconfig", _big), 2,
         "--qconfig {tmp}/inputs/big.json" + TOO_BIG),
    Case("config/cli-hybrid-over-the-cap", _cli_config("--hybrid", _big), 2,
         "--hybrid {tmp}/inputs/big.json" + TOO_BIG),
    Case("config/cli-hybrid-file-type-this", _keeps_out("this", _cli_config("--hybrid", lambda e: _json(
        e, "h.json", {"hybrid": {"module_type": ["qcompiler.zoo.hybrid._SeluModule", "this.X"]}}))), 2,
         "--hybrid {tmp}/inputs/h.json: ['module_type'][1]: " + THIS),
    Case("config/cli-hybrid-module-type-this", _keeps_out("this", _cli("partition", *HYB, "--hybrid-module-type",
                                                                       "this.X", "--out", "o")), 2,
         "--hybrid-module-type 'this.X': " + THIS),
]


# ----------------------------------------------------------------------------- issue 37: QCOMPILER_DIST_TIMEOUT


def _dist_timeout(raw):
    """timeout_from_env under QCOMPILER_DIST_TIMEOUT=raw: a warning, and the built-in default."""
    return Case(f"dist/timeout-env-{raw.strip() or 'blank'}",
                lambda e: _with_environ(sync.timeout_from_env, QCOMPILER_DIST_TIMEOUT=raw), W,
                f"QCOMPILER_DIST_TIMEOUT={raw!r} is not a positive finite number of seconds (e.g. 600); using the "
                f"default 300 s", result=sync.BUILT_IN_TIMEOUT)


TIMEOUT = "timeout must be a positive finite number of seconds, got "
DIST_TIMEOUT = [
    *[_dist_timeout(raw) for raw in ("abc", "-5", "inf", "nan", "0", " ")],
    Case("dist/sync-observers-timeout-negative", lambda e: sync_observers(e.cal, timeout=-5), C,
         "sync_observers: " + TIMEOUT + "-5"),
    Case("dist/sync-observers-timeout-inf", lambda e: sync_observers(e.cal, timeout=float("inf")), C,
         "sync_observers: " + TIMEOUT + "inf"),
    Case("dist/sync-observers-timeout-nan", lambda e: sync_observers(e.qat, timeout=float("nan")), C,
         "sync_observers: " + TIMEOUT + "nan"),
    Case("dist/sync-observers-timeout-str", lambda e: sync_observers(e.cal, timeout="10"), C,
         "sync_observers: " + TIMEOUT + "'10'"),
    Case("dist/sync-observers-timeout-bool", lambda e: sync_observers(e.cal, timeout=True), C,
         "sync_observers: " + TIMEOUT + "True"),
    Case("dist/evaluate-timeout-zero", lambda e: distributed.evaluate(e.cm, _loader(X, Y), _metric, timeout=0,
                                                                      progress=False), C, "evaluate: " + TIMEOUT + "0"),
    Case("dist/require-batches-timeout-none", lambda e: sync.require_batches(1, "evaluate", timeout=None), C,
         "evaluate: " + TIMEOUT + "None"),
]


# ----------------------------------------------------------------------------- issue 37: API inputs


class Gate(nn.Module):
    """Data-dependent Python: a leaf that runs as an eager-torch island, which save refuses."""

    def forward(self, x):
        return x * 2.0 if float(x.mean()) > 0 else x - 1.0


def _pickle_eager_island(env):
    with torch.random.fork_rng():  # the case's own model: the caller's random numbers are not drawn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Gate(), nn.Conv2d(4, 4, 1)).eval()
    cm = qcompiler.compile(model, X, progress=False, prepare_custom_config_dict={"non_traceable_module_name": ["1"]})
    assert cm.torch_islands()
    return pickle.dumps(cm)


class _Pickled:
    """A pickle of a CompiledModel whose artifact bytes are ``data`` (what __reduce__ writes, edited)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        return _from_artifact, (self.data, 1, None)


DENSE = "qcompiler runs dense (strided) tensors only: pass x.to_dense()"
SPARSE = X.to_sparse()
LAYOUTS = [("sparse", SPARSE, "torch.sparse_coo")] + (
    [("mkldnn", X.to_mkldnn(), "torch._mkldnn")] if torch.backends.mkldnn.is_available() else [])
BATCHES = "auto_int16: batches"
PATH_TYPE = "the path must be a str, bytes or os.PathLike, got "
API = [
    Case("compile/auto-int16-batch-shape", lambda e: auto_int16(e.cal, [X, X9], budget=0.5), C,
         BATCHES + "[1]: input 0 has shape (2, 3, 9, 9); the example input has (2, 3, 8, 8), and only the batch "
         "size may differ"),
    Case("compile/auto-int16-batch-count", lambda e: auto_int16(e.cal, [(X, X)], budget=0.5), C,
         BATCHES + "[0]: the model takes 1 inputs, got 2"),
    Case("compile/auto-int16-batch-dtype", lambda e: auto_int16(e.cal, [X.long()], budget=0.5), C,
         BATCHES + "[0]: input 0 must be a float32 tensor like the example input's, got int64"),
    Case("compile/auto-int16-batch-empty", lambda e: auto_int16(e.cal, [X[:0]], budget=0.5), C,
         BATCHES + "[0]: input 0 is empty (shape (0, 3, 8, 8))"),
    Case("compile/auto-int16-no-batches", lambda e: auto_int16(e.cal, [], budget=0.5), C,
         BATCHES + " is empty; pass the calibration batches"),
    Case("compile/auto-int16-one-tensor", lambda e: auto_int16(e.cal, X, budget=0.5), C,
         BATCHES + " must be an iterable of model inputs (e.g. the calibration batches), not one tensor; pass [batch]"),
    *[row for name, x, layout in LAYOUTS for row in (
        Case(f"compile/example-{name}", lambda e, x=x: qcompiler.compile(e.model, x, progress=False), C,
             f"example_inputs: input 0 is a {layout} tensor; " + DENSE),
        Case(f"compile/calib-{name}", lambda e, x=x: qcompiler.compile(e.model, X, calib_data=[X, x], progress=False),
             C, f"calib_data batch 1: input 0 is a {layout} tensor; " + DENSE),
        Case(f"call/{name}", lambda e, x=x: e.cm(x), C,
             f"compiled model: input 0 ('x') is a {layout} tensor; " + DENSE),
        Case(f"call/loaded-{name}", lambda e, x=x: e.loaded(x), C, f"input 0 ('x') is a {layout} tensor; " + DENSE),
    )],
    Case("compile/qat-example-sparse", lambda e: qcompiler.compile(e.qat, SPARSE, mode="qat", progress=False), C,
         "example_inputs: input 0 is a torch.sparse_coo tensor; " + DENSE),
    Case("save/pickle-eager-island", _pickle_eager_island, A,
         ("pickle: a CompiledModel pickles as the file CompiledModel.save writes; ",
          "run in eager torch, which an artifact cannot hold without pickling code")),
    Case("load/unpickle-no-manifest", lambda e: pickle.loads(pickle.dumps(e.loaded).replace(b"manifest.json",
                                                                                            b"manifest.jsoX")), A,
         "the pickled CompiledModel: not a qcompiler artifact (no manifest"),
    Case("load/unpickle-truncated", lambda e: pickle.loads(pickle.dumps(_Pickled(e.artifact.read_bytes()[:1000]))), A,
         "the pickled CompiledModel: not a qcompiler artifact or truncated"),
    Case("load/unpickle-empty", lambda e: pickle.loads(pickle.dumps(_Pickled(b""))), A,
         "the pickled CompiledModel: not a qcompiler artifact"),
    Case("load/float-path", lambda e: load(1.5), C, "load: " + PATH_TYPE + "float"),
    Case("save/dict-path", lambda e: e.cm.save({"path": "net.qc"}), C, "save: " + PATH_TYPE + "dict"),
    Case("save/loaded-int-path", lambda e: e.loaded.save(3), C, "save: " + PATH_TYPE + "int"),
    Case("export/object-path", lambda e: e.cm.export_onnx(object()), C, "export_onnx: " + PATH_TYPE + "object"),
    Case("export/dump-int-path", lambda e: e.cm.dump(3), C, "dump: " + PATH_TYPE + "int"),
]


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
    Case("compile/calib-shape", lambda e: qcompiler.compile(e.model, X, calib_data=[X, X9],
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
    Case("call/shape", lambda e: e.cm(X9), C, "input 0 ('x') has shape (2, 3, 9, 9)"),
    Case("call/rank", lambda e: e.cm(X[0]), C, "input 0 ('x') has shape (3, 8, 8) (3 dims)"),
    Case("call/int-dtype", lambda e: e.cm(X.long()), C, "input 0 ('x') must be a float32 tensor"),
    Case("call/numpy", lambda e: e.cm(X.numpy()), C, "torch.from_numpy converts it"),
    Case("call/list", lambda e: e.cm([X]), C, "input 0 ('x') must be a float32 tensor, got list of 1"),
    Case("call/string", lambda e: e.cm("x"), C, "input 0 ('x') must be a float32 tensor, got str"),
    Case("call/empty-batch", lambda e: e.cm(X[:0]), C, "input 0 ('x') is empty"),
    Case("call/meta", lambda e: e.cm(X.to("meta")), C, "input 0 ('x') is a meta tensor"),
    Case("call/loaded-shape", lambda e: e.loaded(X9), C, "input 0 ('x') has shape (2, 3, 9, 9)"),
    Case("call/loaded-meta", lambda e: e.loaded(X.to("meta")), C, "input 0 ('x') is a meta tensor"),
    # save
    Case("save/empty-path", lambda e: e.cm.save(""), C, "save: the path is empty"),
    Case("save/directory", lambda e: e.cm.save(e.tmp / "sub"), C, "is a directory"),
    Case("save/below-a-file", lambda e: e.cm.save(e.tmp / "notes.txt" / "net.qc"), C,
         "notes.txt' is a file, not a directory"),
    Case("save/below-a-file-deeper", lambda e: e.cm.save(e.tmp / "notes.txt" / "a" / "net.qc"), C,
         "notes.txt' is a file, not a directory"),
    Case("save/none", lambda e: e.cm.save(None), C, ("save: the path must be a str", "got NoneType")),
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
    Case("export/args-shape", lambda e: export_to_onnx(e.cm.converted, X9, e.tmp / "m.onnx"), C,
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
         "--out /proc/self/fdinfo: cannot write /proc/self/fdinfo/model.code.txt: dump: No such file or directory",
         root_only=True),
    Case("cli/out-is-a-file", _cli("partition", "good.py:build", "--input-shape", "1,3,8,8", "--out", "notes.txt"),
         2, "argument --out: 'notes.txt' is an existing file"),
    Case("cli/calib-text", _cli("compile", "zoo:hybrid", "--calib-data", "calib.txt", "--out", "o"), 2,
         "--calib-data calib.txt: not an .npz archive, .npy array or torch.save file; write it with np.savez("),
    Case("cli/calib-pickle", _cli("compile", "zoo:hybrid", "--calib-data", "calib.pkl", "--out", "o"), 2,
         "--calib-data calib.pkl: torch.load(weights_only=True) refuses it (it holds Python objects other than "
         "tensors"),
    Case("cli/calib-object-array", _cli("compile", "zoo:hybrid", "--calib-data", "objects.npz", "--out", "o"), 2,
         "--calib-data objects.npz: array 'arr_0' holds Python objects (dtype object)"),
    Case("cli/calib-npy", _cli("compile", "zoo:hybrid", "--calib-data", "single.npy", "--out", "o"), 2,
         "--calib-data single.npy: input 0 has shape (2, 3, 16, 16); the example input has (1, 3, 224, 224)",
         notes=2),
    Case("cli/calib-missing", _cli("compile", "zoo:hybrid", "--calib-data", "absent.npz", "--out", "o"), 2,
         "--calib-data absent.npz: does not exist"),
    Case("cli/calib-directory", _cli("compile", "zoo:hybrid", "--calib-data", "sub", "--out", "o"), 2,
         "--calib-data sub: is a folder; for a folder of images give --calib-images sub with its preprocessing"),
    Case("cli/no-command", _cli(), 2, "a command is required"),
    *MORE_COMPILE, *MORE_CALL, *MORE_SAVE, *MORE_LOAD, *MORE_EXPORT, *MORE_CLI, *CONFIG, *NATIVE, *DIST, *SIDE,
    *NATIVE_CACHE, *ISLANDS, *FILES, *DIST_TIMEOUT, *API,
]


def _files(root: Path) -> dict:
    """Every file and folder under ``root``: contents and permission bits."""
    out = {}
    for p in sorted(root.rglob("*")):
        if "__pycache__" in p.parts:
            continue
        if p.is_symlink():
            out[str(p.relative_to(root))] = ("symlink to", os.readlink(p))
            continue
        st = p.stat()
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None  # a FIFO a case made is not read (it blocks)
        out[str(p.relative_to(root))] = (data, st.st_mode)
    return out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _process_state() -> dict:
    """What no call may change in the process (the side-effect checks of every row)."""
    return {
        "os.environ": dict(os.environ),
        "cwd": os.getcwd(),
        "sys.path": list(sys.path),
        "umask": _umask(),
        "torch threads": torch.get_num_threads(),
        "torch interop threads": torch.get_num_interop_threads(),
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "rng state": torch.random.get_rng_state().tolist(),
        "default march": qcompiler.get_march(),
        "tempfile.tempdir": tempfile.tempdir,
    }


AREAS = {"compile", "call", "save", "load", "export", "cli", "config", "native", "dist", "side"}


def test_the_catalogue_is_large_and_covers_every_entry():
    assert len(CASES) >= 200 and len({c.id for c in CASES}) == len(CASES)
    areas = {c.id.split("/")[0] for c in CASES}
    assert areas == AREAS
    counts = {a: sum(c.id.startswith(a + "/") for c in CASES) for a in AREAS}
    assert min(counts.values()) >= 8, counts


ROOT = os.geteuid() == 0


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=pytest.mark.skipif(
    c.root_only and not ROOT, reason="root only")) for c in CASES])
def test_bad_input(case, env, capsys):
    models = (env.model, env.qat, env.cal, env.cm.converted)
    snaps = [snapshot(m) for m in models]
    files = _files(env.tmp)
    process = _process_state()
    fragments = case.fragment if isinstance(case.fragment, tuple) else (case.fragment,)
    fragments = [f.replace("{tmp}", str(env.tmp)) for f in fragments]
    if isinstance(case.expected, int):
        code = case.action(env)
        out, err = capsys.readouterr()
        assert code == case.expected, err
        assert err.startswith("error: ") and "Traceback" not in err + out
        lines = err.splitlines()
        assert all(f in lines[0] for f in fragments), err
        assert len(lines) == 1 + case.notes and all(line.startswith("  ") for line in lines[1:]), err
    elif issubclass(case.expected, Warning):  # warned, and the result is still right
        with pytest.warns(case.expected) as record:
            result = case.action(env)
        messages = [str(w.message) for w in record if issubclass(w.category, case.expected)]
        assert any(all(f in m for f in fragments) for m in messages), messages
        if case.result is None:
            assert torch.equal(result, env.reference)
        else:
            assert result == case.result, result
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
    now = _process_state()
    if isinstance(case.expected, int):  # a model factory draws its weights from torch's RNG, as in any script
        process.pop("rng state"), now.pop("rng state")
    changed = sorted(k for k in process if now[k] != process[k])
    variables = sorted(k for k in {*process["os.environ"], *now["os.environ"]}
                       if process["os.environ"].get(k) != now["os.environ"].get(k))
    assert not changed, f"the call changed the process: {changed} (environment variables: {variables})"
