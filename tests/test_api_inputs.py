"""Raw API cases (issue 37): auto_int16's batches, non-dense tensors, bytes paths, pickling a
CompiledModel, and QuantAnalysis.clean removing only its own files.

Each bad input is a typed error naming the input or argument and the fix, raised before any work,
leaving the caller's model and files as they were; each supported form is checked to work.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import train_mode_models as tm
from conftest import assert_untouched, snapshot

import qcompiler
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.quantization import auto_int16, prepare_calibration_fx, prepare_qat_fx
from qcompiler.tools.quant_analysis import QuantAnalysis

X = tm.X  # (2, 3, 8, 8)


class LinearHead(nn.Module):
    """A conv then a linear layer over the flattened map: only 8x8 inputs fit."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def fully_conv():
    """Runs on any spatial size: a wrong-shape batch gives no error, just a measurement on other data."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))


def _calibrated(make):
    torch.manual_seed(0)
    cal = prepare_calibration_fx(make().eval(), example_inputs=X, march="bayes").eval()
    with torch.no_grad():
        cal(*X)
    return cal


@pytest.fixture(scope="module")
def compiled():
    """BPU partitions and an onnxruntime CPU island (SELU)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SELU(), nn.Conv2d(4, 4, 1)).eval()
    return qcompiler.compile(model, X, progress=False)


# ----------------------------------------------------------------------------- 1. auto_int16's batches

@pytest.mark.parametrize("make", [LinearHead, fully_conv], ids=["linear-head", "fully-convolutional"])
def test_auto_int16_checks_its_batches_against_the_example_inputs(make):
    """The batches were not checked: torch's 'mat1 and mat2 shapes cannot be multiplied' for a linear
    head, and a fully-convolutional model measured on them without a word. Now the rule calibration
    uses (qcompiler.batches.check_inputs), against the example inputs the model was prepared with."""
    cal = _calibrated(make)
    snap = snapshot(cal)
    with pytest.raises(ConfigError, match=r"^auto_int16: batches\[1\]: input 0 has shape \(2, 3, 9, 9\); the example "
                                          r"input has \(2, 3, 8, 8\), and only the batch size may differ"):
        auto_int16(cal, [X, torch.rand(2, 3, 9, 9)], budget=0.5)
    with pytest.raises(ConfigError, match=r"^auto_int16: batches\[0\]: the model takes 1 inputs, got 2"):
        auto_int16(cal, [(X[0], X[0])], budget=0.5)
    with pytest.raises(ConfigError, match=r"^auto_int16: batches\[0\]: input 0 is empty \(shape \(0, 3, 8, 8\)\)"):
        auto_int16(cal, [X[0][:0]], budget=0.5)
    assert_untouched(cal, snap)  # refused before the search re-types any observer
    assert "qc_int16" not in cal.meta
    # what calibration accepts is accepted: another batch size, float64 (cast to float32)
    other = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    assert auto_int16(_calibrated(make), [other.double()], budget=0.5) == auto_int16(cal, [other], budget=0.5)


def test_compile_int16_budget_names_a_calibration_batch_of_the_wrong_shape():
    with pytest.raises(ConfigError, match=r"^calib_data batch 0: input 0 has shape \(2, 3, 9, 9\)"):
        qcompiler.compile(LinearHead().eval(), X, calib_data=[torch.rand(2, 3, 9, 9)], int16_budget=0.5,
                          progress=False)
    cm = qcompiler.compile(LinearHead().eval(), X, calib_data=[torch.rand(4, 3, 8, 8)], int16_budget=0.5,
                           progress=False)
    assert cm.int16 is not None and cm(X[0]).shape == (2, 2)


# ----------------------------------------------------------------------------- 2. non-dense tensors

def _layouts():
    out = [pytest.param(lambda t: t.to_sparse(), "sparse_coo", id="sparse_coo")]
    if torch.backends.mkldnn.is_available():
        out.append(pytest.param(lambda t: t.to_mkldnn(), "_mkldnn", id="mkldnn"))
    return out


@pytest.mark.parametrize("convert, layout", _layouts())
def test_non_dense_inputs_are_refused_with_to_dense(compiled, convert, layout):
    """A sparse input failed deep inside torch (NotImplementedError from aten::clamp / as_strided,
    or a batch_norm error); every entry now names the input and says .to_dense()."""
    x = convert(X[0])
    fix = rf"is a torch\.{layout} tensor; qcompiler runs dense \(strided\) tensors only: pass x\.to_dense\(\)"
    model = tm.BNNet().eval()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match=rf"^example_inputs: input 0 {fix}"):
        qcompiler.compile(model, (x,), progress=False)
    with pytest.raises(ConfigError, match=rf"^calib_data batch 1: input 0 {fix}"):
        qcompiler.compile(model, X, calib_data=[X[0], x], progress=False)
    with pytest.raises(ConfigError, match=rf"^example_inputs: input 0 {fix}"):
        prepare_calibration_fx(model, example_inputs=(x,))
    assert_untouched(model, snap)
    with pytest.raises(ConfigError, match=rf"^compiled model: input 0 \('input_1'\) {fix}"):
        compiled(x)
    qat = prepare_qat_fx(_calibrated(tm.BNNet))
    with pytest.raises(ConfigError, match=rf"^example_inputs: input 0 {fix}"):
        qcompiler.compile(qat, (x,), mode="qat", progress=False)
    assert torch.equal(compiled(x.to_dense()), compiled(X[0]))  # the fix the message gives works


# ----------------------------------------------------------------------------- 3. bytes paths

class _BytesPath:
    """An os.PathLike whose path is bytes (os.fspath returns bytes), as open() accepts."""

    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("as_path", [os.fsencode, lambda p: _BytesPath(os.fsencode(p))], ids=["bytes", "PathLike"])
def test_path_arguments_take_bytes_like_open(compiled, tmp_path, monkeypatch, as_path):
    """load(b"...") raised pathlib's TypeError, save(b"...") refused bytes, and export_onnx(b"...")
    wrote to str(b'...'): a file under a new directory "b'" in the working directory."""
    monkeypatch.chdir(tmp_path)
    assert compiled.save(as_path(str(tmp_path / "m.qc"))) == tmp_path / "m.qc"
    loaded = qcompiler.load(as_path(str(tmp_path / "m.qc")))
    assert torch.equal(loaded(X[0]), compiled(X[0]))
    compiled.export_onnx(as_path(str(tmp_path / "m.onnx")))
    files = compiled.dump(as_path(str(tmp_path / "dump")))
    assert files and all(f.parent == tmp_path / "dump" for f in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump", "m.onnx", "m.onnx.quant.json", "m.qc"]


def test_a_path_argument_of_another_type_is_a_config_error(compiled, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call, what in [(qcompiler.load, "load"), (compiled.save, "save"), (compiled.export_onnx, "export_onnx"),
                       (compiled.dump, "dump")]:
        with pytest.raises(ConfigError, match=rf"^{what}: the path must be a str, bytes or os\.PathLike, got int$"):
            call(3)
    assert list(tmp_path.iterdir()) == []  # export_onnx(3) wrote a file named '3'


# ----------------------------------------------------------------------------- 4. pickling

def _globals(data: bytes) -> set[str]:
    """The module-level names a pickle refers to (what unpickling imports and calls)."""
    names, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            names.add(".".join(strings[-2:]))
        elif op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
    return names


def test_a_compiled_model_pickles_through_its_artifact_bit_exact(compiled):
    """pickle.dumps raised "cannot pickle '_thread._local'". It pickles as the bytes save writes (no code:
    the one name in the pickle is the function that loads them), so a worker process gets the model
    load would give, with the same outputs bit for bit."""
    compiled.threads = 2
    try:
        data = pickle.dumps(compiled)
    finally:
        compiled.threads = None
    assert _globals(data) == {"qcompiler.compiled._from_artifact"}
    again = pickle.loads(data)
    assert (again.name, again.march, again.threads, again.partitions) == (compiled.name, compiled.march, 2,
                                                                           compiled.partitions)
    for seed in range(3):
        x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2
        assert torch.equal(again(x), compiled(x))
    assert pickle.dumps(again) == data  # stable: the artifact format is deterministic
    assert again.converted is None  # like load: the runtime only
    broken = data.replace(b"manifest.json", b"manifest.jsoX")  # the bytes are checked like any file's
    with pytest.raises(ArtifactError, match=r"^the pickled CompiledModel: not a qcompiler artifact \(no manifest"):
        pickle.loads(broken)


_WORKER = textwrap.dedent("""
    import pickle, sys, torch
    model, x = pickle.load(sys.stdin.buffer)
    sys.stdout.write(repr(model(x).flatten().tolist()))
""")


def test_an_unpickled_model_runs_in_another_process(compiled):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    done = subprocess.run([sys.executable, "-c", _WORKER], input=pickle.dumps((compiled, x)), capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert torch.equal(torch.tensor(json.loads(done.stdout)), compiled(x).flatten())


def test_pickling_a_model_save_refuses_raises_saves_error():
    class Gate(nn.Module):  # data-dependent Python: an eager-torch island, which save refuses
        def forward(self, x):
            return x * 2.0 if float(x.mean()) > 0 else x - 1.0

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Gate(), nn.Conv2d(4, 4, 1)).eval()
    cm = qcompiler.compile(model, X, progress=False, prepare_custom_config_dict={"non_traceable_module_name": ["1"]})
    assert cm.torch_islands()
    with pytest.raises(ArtifactError) as saved:
        cm.save("unused.qc")
    with pytest.raises(ArtifactError) as pickled:
        pickle.dumps(cm)
    assert str(pickled.value) == f"pickle: a CompiledModel pickles as the file CompiledModel.save writes; {saved.value}"
    assert "run in eager torch, which an artifact cannot hold without pickling code" in str(saved.value)
    assert not os.path.exists("unused.qc")


# ----------------------------------------------------------------------------- 5. QuantAnalysis.clean

def _analysis(out_dir):
    fm, qat, _ = tm.build()
    qa = QuantAnalysis(fm, qat, "fake_quant", out_dir=out_dir)
    qa.set_bad_case(X)
    qa.save_bad_case()
    qa.compare_per_layer()
    return qa


def test_clean_removes_only_the_files_this_analysis_wrote(tmp_path, monkeypatch):
    """clean() removed every path of its list that existed: a file another analysis (or the user) had
    written there since under the same name went too, and with a relative out_dir, after a chdir, the
    same names in the new working directory."""
    first, second = _analysis(tmp_path / "qa"), _analysis(tmp_path / "qa")  # the second replaces every file
    own = tmp_path / "qa" / "notes.txt"
    own.write_text("the user's")
    names = sorted(p.name for p in (tmp_path / "qa").iterdir())
    assert first.clean() == []
    assert sorted(p.name for p in (tmp_path / "qa").iterdir()) == names
    assert sorted(p.name for p in second.clean()) == sorted(n for n in names if n != "notes.txt")
    assert [p.name for p in (tmp_path / "qa").iterdir()] == ["notes.txt"]  # and the folder stays

    # a file rewritten in place (same inode) after the analysis wrote it is not its file either
    third = _analysis(tmp_path / "qa3")
    (tmp_path / "qa3" / "badcase.pt").write_bytes(b"the user's bad case")
    assert "badcase.pt" not in {p.name for p in third.clean()}
    assert [p.name for p in (tmp_path / "qa3").iterdir()] == ["badcase.pt"]

    # relative out_dir: the files are where they were written, whatever the working directory is now
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "qa").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    fourth = _analysis("qa")
    monkeypatch.chdir(tmp_path / "b")
    (tmp_path / "b" / "qa" / "badcase.pt").write_bytes(b"another project's")
    removed = fourth.clean()
    assert len(removed) == 4 and not (tmp_path / "a" / "qa").exists()
    assert (tmp_path / "b" / "qa" / "badcase.pt").read_bytes() == b"another project's"
