"""No public entry changes the caller's model, and written files look like any other file.

Every entry that takes a user's model gets it in the state most likely to be disturbed (train
mode, observers and fake quants on) and must leave it exactly as it was: parameters, buffers
(observer/fake-quant switches), grads, training flags, plain attributes, hooks. The files
``save`` and ``export_onnx`` write follow the umask (0o666 minus it), like a plain ``open``.
And the process is left as it was: compiling changes no environment variable.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import train_mode_models as tm
from conftest import assert_untouched, snapshot

import qcompiler
from qcompiler.frontend import partition
from qcompiler.onnx import SIDECAR_SUFFIX, export_to_onnx
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.tools import numeric_suite as ns
from qcompiler.tools.model_check import check_qat_model
from qcompiler.tools.quant_analysis import QuantAnalysis

X = tm.X


@pytest.fixture(scope="module")
def models():
    """(float model, QAT model, converted model) in eval mode; copy before use."""
    return tm.build()


def _calibrating(fm):
    cal = prepare_calibration_fx(fm, example_inputs=X, march="bayes")
    cal(*X)
    return cal.train()


def _analyse(fm, qat, out_dir):
    qa = QuantAnalysis(fm, qat, "fake_quant", out_dir=out_dir)
    qa.auto_find_bad_case([X], num_steps=1)
    qa.run()
    qa.compare_per_layer()
    qa.sensitivity()
    try:
        qa.suggest_int16(60.0)
    except qcompiler.ConfigError:  # int16 everywhere may still miss the target: not what is tested here
        pass


# (id, which user model: "float" (train mode) | "calibration" | "qat" (training) | "converted", call)
ENTRIES = [
    ("compile-ptq", "float", lambda m, t: qcompiler.compile(m, X, progress=False)),
    ("compile-qat", "qat", lambda m, t: qcompiler.compile(m, X, mode="qat", progress=False)),
    ("partition", "float", lambda m, t: partition(m, X)),
    ("prepare_calibration_fx", "float", lambda m, t: prepare_calibration_fx(m, example_inputs=X)),
    ("prepare_qat_fx-float", "float", lambda m, t: prepare_qat_fx(m, example_inputs=X)),
    ("prepare_qat_fx-calibration", "calibration", lambda m, t: prepare_qat_fx(m)),
    ("convert_fx-calibration", "calibration", lambda m, t: convert_fx(m)),
    ("convert_fx-qat", "qat", lambda m, t: convert_fx(m)),
    ("export_to_onnx-calibration", "calibration", lambda m, t: export_to_onnx(m, X, t / "m.onnx")),
    ("export_to_onnx-qat", "qat", lambda m, t: export_to_onnx(m, X, t / "m.onnx")),
    ("export_to_onnx-converted", "converted", lambda m, t: export_to_onnx(m, X, t / "m.onnx")),
    ("compare_model_outputs", "qat", lambda m, t: ns.compare_model_outputs(tm.BNNet().train(), m, *X)),
    ("compare_model_stub", "qat", lambda m, t: ns.compare_model_stub(tm.BNNet().train(), m, [torch.nn.Conv2d], *X)),
    ("compare_weights", "qat", lambda m, t: ns.compare_weights(tm.BNNet().state_dict(), m.state_dict())),
    ("check_qat_model", "qat", lambda m, t: check_qat_model(m, X, verbose=False)),
    ("quant_analysis", "qat", lambda m, t: _analyse(tm.BNNet().train(), m, t / "qa")),
]


@pytest.mark.parametrize("entry, kind, call", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_public_entries_leave_the_callers_model_as_it_was(models, tmp_path, entry, kind, call):
    fm, qat, q = models
    model = {"float": lambda: copy.deepcopy(fm).train(),
             "calibration": lambda: _calibrating(fm),
             "qat": lambda: set_state(copy.deepcopy(qat), "qat").train(),
             "converted": lambda: copy.deepcopy(q).train()}[kind]()
    snap = snapshot(model)
    call(model, tmp_path)
    assert_untouched(model, snap)


def test_compile_qat_keeps_the_model_training_and_gives_the_same_result(models):
    """compile(mode="qat") used to switch the caller's model to eval and its observers off."""
    _, qat, _ = models
    training = set_state(copy.deepcopy(qat), "qat").train()
    reference = qcompiler.compile(copy.deepcopy(qat), X, mode="qat", progress=False)
    snap = snapshot(training)
    compiled = qcompiler.compile(training, X, mode="qat", progress=False)
    assert_untouched(training, snap)
    assert training.training and all(int(m.observer_enabled[0]) == 1 for m in training.modules()
                                     if hasattr(m, "observer_enabled"))
    assert compiled.name == type(training).__name__
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(5)) * 2
    assert torch.equal(compiled(x), reference(x))


def test_snapshot_sees_observer_switches_and_training_flags(models):
    """The helper every side-effect test relies on: it must catch exactly the changes compile made."""
    _, qat, _ = models
    for change in (lambda m: set_state(m, "validation"), lambda m: m.eval(),
                   lambda m: setattr(next(x for x in m.modules() if hasattr(x, "_has_qparams")), "_has_qparams", False),
                   lambda m: m.register_forward_hook(lambda *a: None)):
        model = set_state(copy.deepcopy(qat), "qat").train()
        snap = snapshot(model)
        change(model)
        with pytest.raises(AssertionError):
            assert_untouched(model, snap)


# ----------------------------------------------------------------------------- written files


@pytest.fixture(scope="module")
def compiled(models):
    fm, _, _ = models
    return qcompiler.compile(fm, X, progress=False)


def _write_all(cm, folder):
    cm.save(folder / "m.qc")
    cm.export_onnx(folder / "m.onnx")
    return [folder / "m.qc", folder / "m.onnx", folder / f"m.onnx{SIDECAR_SUFFIX}"]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=oct)
def test_written_files_follow_the_umask(compiled, tmp_path, umask):
    old = os.umask(umask)
    try:
        files = _write_all(compiled, tmp_path)
        plain = tmp_path / "plain.txt"
        plain.write_text("x")  # what any file gets
        dumped = compiled.dump(tmp_path / "dump")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert (plain.stat().st_mode & 0o777) == want
    assert len(dumped) > 5 and {oct(f.stat().st_mode & 0o777) for f in dumped} == {oct(want)}
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == sorted(f.name for f in dumped)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(want) for f in files}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(f.name for f in files), "plain.txt", "dump"])


def test_overwriting_keeps_umask_permissions_and_replaces_the_contents(compiled, tmp_path):
    old = os.umask(0o022)
    try:
        for name in ("m.qc", "m.onnx", f"m.onnx{SIDECAR_SUFFIX}"):
            (tmp_path / name).write_bytes(b"old")
            os.chmod(tmp_path / name, 0o644)
        files = _write_all(compiled, tmp_path)
    finally:
        os.umask(old)
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o644, f
        assert f.read_bytes() != b"old"
    assert qcompiler.load(files[0]).partitions == compiled.partitions


def test_export_and_save_create_missing_parent_directories(compiled, tmp_path):
    compiled.export_onnx(tmp_path / "a" / "b" / "m.onnx")
    compiled.save(tmp_path / "c" / "d" / "m.qc")
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["m.onnx", f"m.onnx{SIDECAR_SUFFIX}"]
    assert sorted(p.name for p in (tmp_path / "c" / "d").iterdir()) == ["m.qc"]


def test_a_failed_write_names_the_target(compiled):
    """/proc/self/fdinfo exists but takes no new files (also for root): the error names the file
    the user asked for, not a hidden temporary one."""
    why = "(No such file or directory|Permission denied)"
    with pytest.raises(OSError, match=rf"export_to_onnx: {why}: '/proc/self/fdinfo/m.onnx'$"):
        compiled.export_onnx("/proc/self/fdinfo/m.onnx")
    with pytest.raises(OSError, match=rf"save: {why}: '/proc/self/fdinfo/m.qc'$"):
        compiled.save("/proc/self/fdinfo/m.qc")


def test_a_sidecar_that_cannot_be_written_leaves_the_existing_model_file(compiled, tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"the user's file")
    (tmp_path / f"m.onnx{SIDECAR_SUFFIX}").mkdir()
    with pytest.raises(qcompiler.ConfigError, match=r"m\.onnx\.quant\.json' is a directory"):
        compiled.export_onnx(tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx").read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", f"m.onnx{SIDECAR_SUFFIX}"]


# ----------------------------------------------------------------------------- the process

_PROCESS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    sys.path.insert(0, {tests!r})
    import train_mode_models as tm
    import qcompiler

    before = dict(os.environ)
    fresh = "torch._dynamo" not in sys.modules
    cm = qcompiler.compile(tm.BNNet(), tm.X, progress=False)
    cm.save({folder!r} + "/m.qc")
    qcompiler.load({folder!r} + "/m.qc")(*tm.X)
    cm.export_onnx({folder!r} + "/m.onnx")
    changed = sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k))
    print(json.dumps({{"changed": changed, "imported": fresh and "torch._dynamo" in sys.modules}}))
""")


def test_compile_changes_no_environment_variable(tmp_path):
    """Tracing and shape propagation on meta tensors make torch import torch._dynamo (every meta op
    goes through torch's Python references), and that import set TORCHINDUCTOR_CACHE_DIR in the user's
    os.environ for the rest of the process. Run in a fresh interpreter: pytest's imported it already."""
    script = tmp_path / "run.py"
    script.write_text(_PROCESS_SCRIPT.format(tests=os.path.dirname(__file__), folder=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["changed"] == []
    assert result["imported"], "compile no longer imports torch._dynamo: the test above proves nothing now"
