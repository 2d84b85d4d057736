"""Bad paths for the files qcompiler writes and reads, and bad calls of a compiled model (issue 37).

Each bad argument is a ConfigError (a bad file: ArtifactError) that names it and says the fix,
and leaves the user's files as they were: above all, a device node, FIFO or socket is never
replaced by a regular file (``save("/dev/null")`` as root did that). Each refusal has a good
call beside it that still works.
"""

from __future__ import annotations

import io
import os
import re
import socket
import stat
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from artifact_edit import Edit
from conftest import assert_untouched, snapshot

import qcompiler
from qcompiler.atomic_write import write_file
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.onnx import export_to_onnx
from qcompiler.tools.config_file import write_config_file

X = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
ROOT = os.geteuid() == 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


class TwoInputs(nn.Module):
    """Inputs named ``input`` (torch.fx calls it ``input_1``: it shadows the builtin) and ``y``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, input, y):
        return self.a(input) - self.b(y)


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class LogThenConv(nn.Module):
    """A CPU island (log) feeding the BPU: a negative input becomes NaN between the two."""

    def __init__(self):
        super().__init__()
        self.log = Log()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(self.log(x))


@pytest.fixture(scope="module")
def cm():
    torch.manual_seed(0)
    return qcompiler.compile(Net().eval(), X, hybrid_dict={"module_name": ["fc"]}, progress=False)


@pytest.fixture(scope="module")
def artifact(cm, tmp_path_factory):
    return cm.save(tmp_path_factory.mktemp("artifact") / "net.qc")


def listing(folder: Path) -> dict:
    """Every entry below ``folder``: its kind (st_mode's type bits) and, for regular files, bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        mode = os.lstat(p).st_mode
        out[str(p.relative_to(folder))] = (stat.S_IFMT(mode), p.read_bytes() if stat.S_ISREG(mode) else None)
    return out


# ----------------------------------------------------------------------------- 1. not a regular file

def _char_device(p: Path) -> Path:
    os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is, made in tmp_path
    return p


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


SPECIAL = {"fifo": (_fifo, "a FIFO (named pipe)")}
if ROOT:  # mknod of a device needs CAP_MKNOD
    SPECIAL["char-device"] = (_char_device, "a character device")

WRITERS = {
    "save": lambda cm, p: cm.save(p),
    "export_onnx": lambda cm, p: cm.export_onnx(p),
    "write_config_file": lambda cm, p: write_config_file(p, {"hybrid": {"module_name": ["fc"]}}),
    "write_file": lambda cm, p: write_file(p, b"data", "write_file"),
}
PREFIX = {"save": "save", "export_onnx": "export_to_onnx", "write_config_file": "--apply", "write_file": "write_file"}


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("writer", WRITERS)
def test_a_device_or_fifo_is_never_replaced_by_a_file(cm, tmp_path, kind, writer):
    """As root, save("/dev/null") replaced the device node by a regular file (os.replace went through)."""
    make, described = SPECIAL[kind]
    target = make(tmp_path / "target")
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{PREFIX[writer]}: '{target}' is {re.escape(described)}, not a "
                                          r"regular file; qcompiler replaces only regular files"):
        WRITERS[writer](cm, target)
    assert listing(tmp_path) == before  # still a FIFO / device; no temporary file left
    WRITERS[writer](cm, tmp_path / "file")  # a regular path still works
    assert (tmp_path / "file").is_file() and (tmp_path / "file").stat().st_size > 0


def test_an_entry_that_became_a_fifo_after_the_check_is_not_replaced(tmp_path, monkeypatch):
    """The kind is checked again just before os.replace (the path may change after the first check)."""
    import qcompiler.atomic_write as aw

    target = _fifo(tmp_path / "late")
    monkeypatch.setattr(aw, "check_target", lambda path, what: Path(path))  # as if it was a file when checked
    with pytest.raises(ConfigError, match=r"^late: '.*/late' is a FIFO \(named pipe\), not a regular file"):
        aw.write_file(target, b"data", "late")
    assert stat.S_ISFIFO(os.lstat(target).st_mode) and [p.name for p in tmp_path.iterdir()] == ["late"]


def test_a_socket_is_never_replaced(cm, tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(ConfigError, match="/s.sock' is a socket, not a regular file"):
            cm.save(path)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_symlink_to_a_device_is_refused_by_the_links_name(cm, tmp_path, kind):
    make, described = SPECIAL[kind]
    device = make(tmp_path / "dev")
    link = tmp_path / "link.qc"
    link.symlink_to(device)
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=rf"'{link}' is {re.escape(described)} \(a symbolic link to '{device}'\)"):
        cm.save(link)
    assert listing(tmp_path) == before


def test_a_symlink_to_a_regular_file_writes_that_file_like_open(cm, tmp_path):
    """The documented choice (qcompiler.atomic_write): links are followed, the link stays a link."""
    real = tmp_path / "runs" / "model.qc"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "latest.qc"
    link.symlink_to(real)
    assert cm.save(link) == link
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert torch.equal(qcompiler.load(real)(X), cm(X))
    assert sorted(p.name for p in real.parent.iterdir()) == ["model.qc"]  # no temporary file left


@pytest.mark.parametrize("kind", SPECIAL)
def test_dump_into_a_device_or_fifo_is_a_config_error(cm, tmp_path, kind):
    make, described = SPECIAL[kind]
    target = make(tmp_path / "out")
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=rf"^dump: '{target}' is {re.escape(described)}, not a directory"):
        cm.dump(target)
    assert listing(tmp_path) == before


# ----------------------------------------------------------------------------- 2.-4. malformed paths

CALLS = {
    "save": lambda cm, p: cm.save(p),
    "export_onnx": lambda cm, p: cm.export_onnx(p),
    "dump": lambda cm, p: cm.dump(p),
    "load": lambda cm, p: qcompiler.load(p),
}
NUL_PREFIX = {"save": "save", "export_onnx": "export_to_onnx", "dump": "dump", "load": "load"}


@pytest.mark.parametrize("call", CALLS)
def test_a_nul_byte_in_a_path_is_a_config_error(cm, tmp_path, monkeypatch, call):
    """save("a\\0b.qc") raised ValueError: embedded null byte, from deep inside os."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{NUL_PREFIX[call]}: the path 'a\\x00b' contains a NUL byte"):
        CALLS[call](cm, "a\0b")
    with pytest.raises(ConfigError, match="contains a NUL byte"):
        CALLS[call](cm, b"a\0b")  # a bytes path, as open() takes it
    assert list(tmp_path.iterdir()) == []


def test_a_file_name_too_long_is_a_config_error_naming_it(cm, tmp_path, monkeypatch):
    """save("a"*300 + ".qc") raised a raw OSError (File name too long) without the save: prefix."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^save: cannot use 'aaa.*' \(303 characters\): its name is 303 bytes, "
                                          r"over the 255 bytes a file name may have; give a shorter path"):
        cm.save("a" * 300 + ".qc")
    with pytest.raises(ConfigError, match=r"^save: .*: the name 'ddd.*' \(300 characters\) in it is 300 bytes"):
        cm.save("d" * 300 + "/net.qc")
    # the sidecar's name (+ ".quant.json") is the one too long: nothing is written, not even the model
    with pytest.raises(ConfigError, match=r"^export_to_onnx: .*\.quant\.json' \(261 characters\): its name is 261"):
        cm.export_onnx("c" * 250)
    assert list(tmp_path.iterdir()) == []
    long_ok = "b" * 252 + ".qc"  # 255 bytes: the longest legal name; the temporary file's name stays legal
    assert cm.save(long_ok) == Path(long_ok)
    assert torch.equal(qcompiler.load(long_ok)(X), cm(X))
    assert [p.name for p in tmp_path.iterdir()] == [long_ok]


@pytest.mark.parametrize("call", ["save", "export_onnx"])
def test_a_path_ending_in_a_separator_is_refused(cm, tmp_path, monkeypatch, call):
    """save("x.qc/") wrote a file named x.qc."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep")
    prefix = NUL_PREFIX[call]
    with pytest.raises(ConfigError, match=rf"^{prefix}: 'x.qc/' ends with a path separator, so it names a "
                                          r"directory; give a file path \(without the trailing '/'\)"):
        CALLS[call](cm, "x.qc/")
    with pytest.raises(ConfigError, match="'notes.txt/' ends with a path separator"):
        CALLS[call](cm, "notes.txt/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep"
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=rf"^{prefix}: 'sub/' is a directory"):
        CALLS[call](cm, "sub/")
    CALLS[call](cm, "x.qc")
    assert (tmp_path / "x.qc").is_file()


# ----------------------------------------------------------------------------- 5. dump's directory

def test_dump_paths_are_checked_before_anything_is_written(cm, tmp_path, monkeypatch):
    """dump("notes.txt") raised FileExistsError, dump("notes.txt/d") NotADirectoryError, dump("/proc/x")
    an unprefixed FileNotFoundError, and dump("") wrote into the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep")
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=r"^dump: 'notes.txt' is an existing file, not a directory; give a "
                                          r"directory path"):
        cm.dump("notes.txt")
    with pytest.raises(ConfigError, match=r"^dump: cannot create 'notes.txt/d': 'notes.txt' is a file, not a "
                                          r"directory$"):
        cm.dump("notes.txt/d")
    with pytest.raises(ConfigError, match=r"^dump: the path is empty; give a directory path \('.' for the "
                                          r"current directory\)$"):
        cm.dump("")
    with pytest.raises(ConfigError, match="^dump: the path is empty"):
        cm.dump(b"")
    assert listing(tmp_path) == before
    with pytest.raises(OSError, match=r"^\[Errno \d+\] dump: cannot create the directory: .*: '/proc/qc_dump'$"):
        cm.dump("/proc/qc_dump")
    files = cm.dump("new/deeper")
    assert files and all(f.parent == Path("new/deeper") and f.is_file() for f in files)


# ----------------------------------------------------------------------------- 6. file objects

def test_export_to_a_file_object_needs_a_writable_binary_one(cm, tmp_path):
    """export_to_onnx(m, X, open(p, "w")) raised TypeError from f.write, open(p, "rb") io.UnsupportedOperation."""
    text, ro, closed = tmp_path / "t.onnx", tmp_path / "r.onnx", tmp_path / "c.onnx"
    ro.write_bytes(b"mine")
    with open(text, "w") as f:
        with pytest.raises(ConfigError, match=rf"^export_to_onnx: f \('{text}'\) is a text file object, but an "
                                              r"ONNX file is bytes; open it in binary mode, e.g. open\(path, 'wb'\)"):
            export_to_onnx(cm.converted, X, f)
    with open(ro, "rb") as f:
        with pytest.raises(ConfigError, match=rf"^export_to_onnx: f \('{ro}'\) is not open for writing \(opened "
                                              r"with mode 'rb'\); open it with open\(path, 'wb'\)"):
            export_to_onnx(cm.converted, X, f)
    f = open(closed, "wb")
    f.close()
    with pytest.raises(ConfigError, match=r"^export_to_onnx: f \('.*c.onnx'\) is closed"):
        export_to_onnx(cm.converted, X, f)
    with pytest.raises(ConfigError, match=r"f \(StringIO\) is a text file object"):
        export_to_onnx(cm.converted, X, io.StringIO())
    assert text.read_bytes() == b"" and ro.read_bytes() == b"mine" and closed.read_bytes() == b""
    buf = io.BytesIO()
    sidecar = export_to_onnx(cm.converted, X, buf)
    assert sidecar == export_to_onnx(cm.converted, X, tmp_path / "m.onnx")
    assert buf.getvalue() == (tmp_path / "m.onnx").read_bytes()
    with open(tmp_path / "b.onnx", "wb") as f:
        export_to_onnx(cm.converted, X, f)
    assert (tmp_path / "b.onnx").read_bytes() == buf.getvalue()


# ----------------------------------------------------------------------------- 7. empty paths

@pytest.mark.parametrize("call", CALLS)
def test_an_empty_path_is_refused_naming_the_call(cm, tmp_path, monkeypatch, call):
    """load("") said ".: no such file"; dump("") wrote into the working directory."""
    monkeypatch.chdir(tmp_path)
    kind = "directory" if call == "dump" else "file"
    with pytest.raises(ConfigError, match=rf"^{NUL_PREFIX[call]}: the path is empty; give a {kind} path"):
        CALLS[call](cm, "")
    assert list(tmp_path.iterdir()) == []


def test_load_of_a_missing_file_still_names_it(tmp_path):
    with pytest.raises(ArtifactError, match=rf"^{tmp_path}/nope.qc: no such file$"):
        qcompiler.load(tmp_path / "nope.qc")


def test_load_refuses_what_is_not_a_regular_file(artifact, tmp_path):
    """load("a"*300) raised a raw OSError (File name too long); a FIFO or directory was "no such file"."""
    fifo = _fifo(tmp_path / "pipe.qc")  # opening it to read would block
    with pytest.raises(ArtifactError, match=rf"^{fifo}: no such file: it is a FIFO \(named pipe\); give the path "
                                            r"of a file CompiledModel.save wrote$"):
        qcompiler.load(fifo)
    with pytest.raises(ArtifactError, match=rf"^{tmp_path}: no such file: it is a directory"):
        qcompiler.load(tmp_path)
    with pytest.raises(ConfigError, match=r"^load: cannot use '.*: the name 'aaa.* in it is 300 bytes, over the 255 "):
        qcompiler.load(tmp_path / ("a" * 300))
    link = tmp_path / "link.qc"
    link.symlink_to(artifact)
    assert qcompiler.load(link).march == "bayes"


# ----------------------------------------------------------------------------- 8. keyword calls

def test_a_call_takes_the_inputs_by_name(cm, artifact):
    """cm(x=X) raised TypeError: __call__() got an unexpected keyword argument 'x'."""
    assert cm.input_names == ["x"]
    reference = cm(X)
    assert torch.equal(cm(x=X), reference)
    loaded = qcompiler.load(artifact)
    assert torch.equal(loaded(x=X), reference)
    for model in (cm, loaded):
        with pytest.raises(ConfigError, match=r"^compiled model: keyword argument 'y' names no input of the model; "
                                              r"its inputs are x \(pass them by position or by these names\)$"):
            model(y=X)
        with pytest.raises(ConfigError, match=r"^compiled model: input 0 \('x'\) is given twice \(by position and "
                                              r"as x=\); pass it once$"):
            model(X, x=X)
        with pytest.raises(ConfigError, match=r"input 0 \('x'\) has shape \(3, 8, 8\)"):
            model(x=X[0])  # checked like a positional input


def test_keywords_of_a_multi_input_model_use_the_forwards_names():
    torch.manual_seed(0)
    a, b = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8)
    model = TwoInputs().eval()
    cm = qcompiler.compile(model, (a, b), progress=False)
    assert cm.input_names == ["input_1", "y"]  # torch.fx renames the builtin's name
    reference = cm(a, b)
    assert torch.equal(cm(input=a, y=b), reference)
    assert torch.equal(cm(y=b, input_1=a), reference)
    assert torch.equal(cm(a, y=b), reference)
    with pytest.raises(ConfigError, match=r"^compiled model: input 1 \('y'\) missing; the model takes 2 inputs "
                                          r"\(input_1, y\)$"):
        cm(input=a)
    with pytest.raises(ConfigError, match=r"input 0 \('input_1'\) is given twice \(by another keyword and as "
                                          r"input_1=\)"):
        cm(input=a, input_1=a)


# ----------------------------------------------------------------------------- 9. ort_threads

@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, "2", None])
def test_compile_checks_ort_threads(bad):
    """compile(ort_threads=0) and ort_threads=True were accepted."""
    torch.manual_seed(0)
    model = Net().eval()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match=rf"^compile: ort_threads must be a positive int, got {re.escape(repr(bad))}; "
                                          r"pass e\.g\. ort_threads=1$"):
        qcompiler.compile(model, X, hybrid_dict={"module_name": ["fc"]}, ort_threads=bad, progress=False)
    assert_untouched(model, snap)


def test_compile_with_a_good_ort_threads_runs(cm, artifact):
    torch.manual_seed(0)
    two = qcompiler.compile(Net().eval(), X, hybrid_dict={"module_name": ["fc"]}, ort_threads=2, progress=False)
    assert two.runtime.ort_threads == 2 and torch.equal(two(X), cm(X))
    with pytest.raises(ConfigError, match=r"^load: ort_threads must be a positive int, got True"):
        qcompiler.load(artifact, ort_threads=True)


# ----------------------------------------------------------------------------- 10. NaN inputs

def test_a_nan_input_is_named(cm, artifact):
    """cm(NaN) said "quantize: the input contains NaN" without naming the input."""
    bad = X.clone()
    bad[1, 2, 3, 4] = float("nan")
    for model in (cm, qcompiler.load(artifact)):
        with pytest.raises(ConfigError, match=r"^compiled model: input 0 \('x'\) contains NaN, which BPU step "
                                              r"'bpu0' cannot quantize \(NaN has no integer value\); replace the "
                                              r"NaNs first, e\.g\. with torch\.nan_to_num$"):
            model(bad)
        assert torch.equal(model(torch.nan_to_num(bad)), model(torch.nan_to_num(bad)))
    assert torch.isnan(bad).sum() == 1  # the caller's tensor is unchanged


def test_nan_made_by_a_cpu_island_names_the_value_and_its_step():
    torch.manual_seed(0)
    x = torch.rand(2, 3, 8, 8) + 0.5
    cm = qcompiler.compile(LogThenConv().eval(), x, hybrid_dict={"module_name": ["log"]}, progress=False)
    assert torch.isfinite(cm(x)).all()
    with pytest.raises(ConfigError, match=r"^compiled model: the value '\w+' \(an output of step 'cpu0'\) contains "
                                          r"NaN, which BPU step 'bpu\d' cannot quantize"):
        cm(-x)


# ----------------------------------------------------------------------------- 11. the manifest's march

def test_an_unknown_march_in_the_manifest_is_refused(artifact, tmp_path):
    """A manifest with "march": "pentium" loaded without complaint."""
    edit = Edit(artifact)
    assert edit.manifest["march"] == "bayes"
    for march in ("pentium", "Bayes", ""):
        edit.manifest["march"] = march
        path = edit.write(tmp_path / "edited.qc")
        with pytest.raises(ArtifactError, match=rf"^{path}: manifest.json: march '{march}' is not a march this "
                                                r"qcompiler knows \(bernoulli2, bayes, nash\); the file is corrupted or "
                                                r"from another qcompiler: compile and save the model again$"):
            qcompiler.load(path)
    edit.manifest["march"] = "bernoulli2"
    assert qcompiler.load(edit.write(tmp_path / "b2.qc")).march == "bernoulli2"
    assert qcompiler.load(artifact).march == "bayes"
