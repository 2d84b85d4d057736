"""The native library's cache, trusted the way ssh trusts its keys (docs/native.md): a cached library
is used only from a directory and file owned by this user and writable by no one else, whose SHA-256
matches the one recorded at the build, with this qcompiler's ABI version and every kernel it calls;
anything else is rebuilt (in a private directory when the cache directory itself is refused).  Also:
private modes whatever the umask, a relative XDG_CACHE_HOME ignored, and the compiler's time limits.

Each load runs in a child that imports only ``qcompiler.native.build`` (no torch: a child starts in
well under a second) and prints what it saw as JSON, so a crash in dlopen fails the test instead of
killing pytest.  One real gcc build of kernels.c per session; every rebuild after it runs a fake
compiler that copies that library to its ``-o`` path and logs the call, so a test can count builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qcompiler.errors import QCompilerWarning
from qcompiler.native import build

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
GCC = shutil.which("gcc")
QUANT_WANT = [-3, 0, 5, 127]  # qc_quantize_i8 of (-1.5, 0.25, 2.5, 300) / 0.5: half to even, clamped

pytestmark = [pytest.mark.skipif(GCC is None, reason="no gcc here"),
              pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                 reason="files owned by another user need root (os.chown)")]

# the child: the real build module under a stub package (qcompiler/__init__ imports torch), an optional
# umask, one library() call with its warnings, and one real kernel call (a stub library leaves zeros)
CHILD = r"""
import ctypes, json, os, sys, types, warnings
pkg = types.ModuleType("qcompiler")
pkg.__path__ = [os.path.join(sys.argv[1], "qcompiler")]
sys.modules["qcompiler"] = pkg
if len(sys.argv) > 2:
    os.umask(int(sys.argv[2], 8))
from qcompiler.native import build
if os.environ.get("QC_TEST_NO_PROC"):  # as on a system without /proc
    build._group_cpu = lambda pgid: None
    _isdir = os.path.isdir
    os.path.isdir = lambda p: p != "/proc/self/fd" and _isdir(p)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lib = build.library()
out = {"warnings": [str(w.message) for w in caught], "kinds": [w.category.__name__ for w in caught],
       "loaded": lib is not None, "pinned": len(getattr(build, "_PINNED", ()))}  # loaded via /proc/self/fd
if lib is not None:
    x, q = (ctypes.c_float * 4)(-1.5, 0.25, 2.5, 300.0), (ctypes.c_int8 * 4)()
    f = lib.qc_quantize_i8
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_void_p]
    out.update(abi=lib.qc_abi_version(), nan=f(x, 4, 0.5, -128.0, 127.0, q), q=list(q))
print(json.dumps(out))
"""

FAKE_CC = """#!/bin/sh
# a compiler that answers --version as gcc does and "builds" by copying {lib}
if [ "$1" = --version ]; then exec {gcc} --version; fi
out=""
while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
echo "$out" >> {log}
{busy}cp {lib} "$out"
"""


def _child(tmp_path, env, *, umask=None, cwd=None, timeout=120):
    """Run CHILD; returns its JSON (with "rc"), failing the test on a crash or a hang."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("CC", "XDG_CACHE_HOME", build.ENV_CACHE, build.ENV_DISABLE, "QCOMPILER_NATIVE_BUILD_IDLE_S",
                         "QCOMPILER_NATIVE_BUILD_MAX_S")}
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir(exist_ok=True)
    base.update(TMPDIR=str(tmpdir), **env)
    args = [sys.executable, "-c", CHILD, str(ROOT)] + ([f"{umask:o}"] if umask is not None else [])
    proc = subprocess.Popen(args, env=base, cwd=cwd or tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the load did not finish within {timeout} s")
    assert proc.returncode == 0, f"the load crashed: exit {proc.returncode}\n{err[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def good(tmp_path_factory):
    """One real build of kernels.c (gcc); returns the library's path (its name is the cache key's)."""
    tmp = tmp_path_factory.mktemp("good")
    got = _child(tmp, {build.ENV_CACHE: str(tmp / "cache"), "CC": GCC}, timeout=900)
    assert got["loaded"] and got["q"] == QUANT_WANT, got
    (lib,) = (tmp / "cache").glob("qc_kernels_*.so")
    return lib


@pytest.fixture
def cc(tmp_path, good):
    """The fake compiler (copies the good library); ``cc.log`` lists the outputs it wrote."""
    path = tmp_path / "fake-cc"
    path.write_text(FAKE_CC.format(lib=good, gcc=GCC, log=tmp_path / "cc.log", busy=""))
    path.chmod(0o755)
    return path


def _builds(tmp_path):
    log = tmp_path / "cc.log"
    return log.read_text().split() if log.exists() else []


def _env(cc, cache):
    return {"CC": str(cc), build.ENV_CACHE: str(cache)}


def _private_dir(path, mode=0o700):
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def _record(lib):
    """The digest file a build writes beside the library (sha256sum's format)."""
    digest = hashlib.sha256(lib.read_bytes()).hexdigest()
    Path(f"{lib}.sha256").write_text(f"{digest}  {lib.name}\n")
    os.chmod(f"{lib}.sha256", 0o600)


def _stub(path, good, *, abi=1, marker=None, only=None):
    """A library built from a tiny C source and named ``path``: qc_abi_version returns ``abi``, every
    other function the good library exports (or only those in ``only``) returns 0 and writes nothing,
    and a constructor writes ``marker`` when the library is loaded."""
    names = only if only is not None else [n for n in _exports(good) if n != "qc_abi_version"]
    src = ["#include <stdio.h>", f"int qc_abi_version(void) {{ return {abi}; }}"]
    src += [f"int {n}(void) {{ return 0; }}" for n in names]
    if marker is not None:
        src.append("__attribute__((constructor)) static void planted(void) { FILE *f = fopen(\"%s\", \"w\"); "
                   "if (f) { fputs(\"ran\", f); fclose(f); } }" % marker)
    c = path.parent / f"{path.name}.c"
    c.write_text("\n".join(src) + "\n")
    subprocess.run([GCC, "-shared", "-fPIC", "-o", str(path), str(c)], check=True)
    c.unlink()
    path.chmod(0o700)
    return path


def _exports(lib):
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted(ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-1].startswith("qc_"))


def _text_section(lib):
    """(offset, size) of the ELF64 library's .text section."""
    data = lib.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    for name, _type, _flags, _addr, off, size in sections:
        if data[names + name:data.index(b"\0", names + name)] == b".text":
            return off, size
    raise AssertionError(f"{lib} has no .text section")


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _loaded_real_kernels(got):
    assert got["loaded"], got
    assert got["abi"] == build.ABI_VERSION and got["q"] == QUANT_WANT, got


# ---------------------------------------------------------------------------------------------------------------
# the positive case: a build records its digest, and a good cache is loaded as it is


def test_a_build_records_its_digest_and_the_next_load_uses_it_as_it_is(tmp_path, cc, good):
    cache = tmp_path / "cache"
    first = _child(tmp_path, _env(cc, cache))
    _loaded_real_kernels(first)
    assert first["warnings"] == [] and len(_builds(tmp_path)) == 1
    lib = cache / good.name
    digest, name = (cache / f"{good.name}.sha256").read_text().split()
    assert name == good.name and digest == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert sorted(p.name for p in cache.iterdir()) == [good.name, f"{good.name}.sha256"]
    second = _child(tmp_path, _env(cc, cache))
    _loaded_real_kernels(second)
    assert second["warnings"] == [] and len(_builds(tmp_path)) == 1  # no second build
    assert first["pinned"] == second["pinned"] == 1  # loaded through the fd it was hashed from


# ---------------------------------------------------------------------------------------------------------------
# owner and mode: a planted library never runs


@pytest.mark.parametrize("case", ["shared 1777 dir, planted by nobody", "dir owned by nobody",
                                  "group-writable dir"])
def test_a_library_in_a_directory_others_can_write_is_never_loaded(tmp_path, cc, good, case):
    """The directory is refused with a warning naming it and why; the build goes to a fresh private
    directory (removed after the load), and the refused directory is left as it was."""
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "marker"
    _stub(shared / good.name, good, marker=marker)
    _record(shared / good.name)
    if case.startswith("shared"):
        shared.chmod(0o1777)
        for p in shared.iterdir():
            os.chown(p, NOBODY, NOBODY)
        why = "writable by others"
    elif case.startswith("dir owned"):
        shared.chmod(0o755)
        os.chown(shared, NOBODY, NOBODY)
        why = f"owned by uid {NOBODY}"
    else:
        shared.chmod(0o770)
        why = "writable by its group"
    before = sorted(p.name for p in shared.iterdir())
    got = _child(tmp_path, _env(cc, shared))
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    _loaded_real_kernels(got)
    assert len(got["warnings"]) == 1 and got["kinds"] == ["QCompilerWarning"], got
    assert str(shared) in got["warnings"][0] and why in got["warnings"][0], got
    assert sorted(p.name for p in shared.iterdir()) == before
    (built,) = _builds(tmp_path)
    assert not built.startswith(str(shared)) and built.startswith(str(tmp_path / "tmpdir"))
    assert list((tmp_path / "tmpdir").iterdir()) == []  # the private directory is gone


@pytest.mark.parametrize("case", ["owned by nobody", "writable by others", "no digest", "wrong digest",
                                  "digest owned by nobody", "a symbolic link"])
def test_a_bad_library_in_a_private_directory_is_replaced_before_it_runs(tmp_path, cc, good, case):
    cache = _private_dir(tmp_path / "cache")
    marker = tmp_path / "marker"
    lib = cache / good.name
    if case == "a symbolic link":
        _stub(tmp_path / "elsewhere.so", good, marker=marker)
        lib.symlink_to(tmp_path / "elsewhere.so")
        (cache / f"{lib.name}.sha256").write_text(
            f"{hashlib.sha256((tmp_path / 'elsewhere.so').read_bytes()).hexdigest()}  {lib.name}\n")
    else:
        _stub(lib, good, marker=marker)
        _record(lib)
    if case == "owned by nobody":
        os.chown(lib, NOBODY, NOBODY)
    elif case == "writable by others":
        lib.chmod(0o777)
    elif case == "no digest":
        Path(f"{lib}.sha256").unlink()
    elif case == "wrong digest":
        Path(f"{lib}.sha256").write_text(f"{'0' * 64}  {lib.name}\n")
    elif case == "digest owned by nobody":
        os.chown(f"{lib}.sha256", NOBODY, NOBODY)
    got = _child(tmp_path, _env(cc, cache))
    assert not marker.exists(), "the bad library was loaded: its constructor ran"
    _loaded_real_kernels(got)
    assert len(_builds(tmp_path)) == 1
    assert lib.read_bytes() == good.read_bytes() and not lib.is_symlink()
    assert os.stat(lib).st_uid == os.geteuid() and _mode(lib) == 0o700
    if case == "no digest":  # a cache from before digests were recorded: rebuilt without a word
        assert got["warnings"] == [], got
    else:
        assert len(got["warnings"]) == 1 and str(cache) in got["warnings"][0], got


def test_under_umask_000_every_directory_and_file_is_private(tmp_path, cc, good):
    xdg = tmp_path / "xdg"  # none of it exists yet: every level is created here
    got = _child(tmp_path, {"CC": str(cc), "XDG_CACHE_HOME": str(xdg)}, umask=0)
    _loaded_real_kernels(got)
    cache = xdg / "qcompiler" / "native"
    assert [_mode(p) for p in (xdg, xdg / "qcompiler", cache)] == [0o700] * 3
    assert _mode(cache / good.name) == 0o700 and _mode(cache / f"{good.name}.sha256") == 0o600
    # a cache directory that exists already keeps the mode it has (0755 is fine: nobody else can write)
    other = tmp_path / "other"
    other.mkdir(mode=0o755)
    other.chmod(0o755)
    got = _child(tmp_path, _env(cc, other), umask=0)
    _loaded_real_kernels(got)
    assert got["warnings"] == [] and _mode(other) == 0o755 and _mode(other / good.name) == 0o700


# ---------------------------------------------------------------------------------------------------------------
# relative paths


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, cc, good):
    """The XDG spec: a relative value is invalid and ignored; ~/.cache is used."""
    work, home = tmp_path / "work", tmp_path / "home"
    home.mkdir()
    rel = _private_dir(work / "rel" / "qcompiler" / "native")
    marker = tmp_path / "marker"
    _stub(rel / good.name, good, marker=marker)
    _record(rel / good.name)
    got = _child(tmp_path, {"CC": str(cc), "XDG_CACHE_HOME": "rel", "HOME": str(home)}, cwd=work)
    assert not marker.exists(), "the library under the relative XDG_CACHE_HOME was loaded"
    _loaded_real_kernels(got)
    assert got["warnings"] == [], got
    assert (home / ".cache" / "qcompiler" / "native" / good.name).read_bytes() == good.read_bytes()
    # the same directory named absolutely is used
    got = _child(tmp_path, {"CC": str(cc), "XDG_CACHE_HOME": str(work / "rel"), "HOME": str(home)}, cwd=work)
    assert got["loaded"] and marker.exists()


def test_a_relative_native_cache_is_refused_with_a_warning(tmp_path, cc, good):
    work, home = tmp_path / "work", tmp_path / "home"
    home.mkdir()
    rel = _private_dir(work / "rel")
    marker = tmp_path / "marker"
    _stub(rel / good.name, good, marker=marker)
    _record(rel / good.name)
    got = _child(tmp_path, {"CC": str(cc), build.ENV_CACHE: "rel", "HOME": str(home)}, cwd=work)
    assert not marker.exists(), f"the library under the relative {build.ENV_CACHE} was loaded"
    _loaded_real_kernels(got)
    assert len(got["warnings"]) == 1 and f"{build.ENV_CACHE}='rel'" in got["warnings"][0], got
    assert "not an absolute path" in got["warnings"][0]
    assert (home / ".cache" / "qcompiler" / "native" / good.name).exists()


# ---------------------------------------------------------------------------------------------------------------
# damaged libraries: the digest is checked before dlopen


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_library_is_rebuilt_without_a_crash(tmp_path, cc, good, keep):
    """Half of it (as after a killed copy) or nothing (a full disk)."""
    cache = _private_dir(tmp_path / "cache")
    lib = cache / good.name
    shutil.copy(good, lib)
    _record(lib)
    data = lib.read_bytes()
    lib.write_bytes(data[:int(len(data) * keep)])
    got = _child(tmp_path, _env(cc, cache))  # once SIGBUS in dlopen (exit 135)
    _loaded_real_kernels(got)
    assert len(_builds(tmp_path)) == 1 and lib.read_bytes() == good.read_bytes()
    assert len(got["warnings"]) == 1 and str(lib) in got["warnings"][0] and "SHA-256" in got["warnings"][0], got


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_library_with_flipped_code_bytes_is_rebuilt(tmp_path, cc, good, seed):
    cache = _private_dir(tmp_path / "cache")
    lib = cache / good.name
    shutil.copy(good, lib)
    _record(lib)
    off, size = _text_section(lib)
    data = bytearray(lib.read_bytes())
    rng = random.Random(seed)
    for i in rng.sample(range(off, off + size), 4):
        data[i] ^= 0xFF
    lib.write_bytes(bytes(data))
    got = _child(tmp_path, _env(cc, cache))
    _loaded_real_kernels(got)
    assert len(_builds(tmp_path)) == 1 and lib.read_bytes() == good.read_bytes()
    assert "SHA-256" in got["warnings"][0], got


# ---------------------------------------------------------------------------------------------------------------
# ABI version and symbols


def test_a_cached_library_with_another_abi_version_is_rebuilt(tmp_path, cc, good):
    cache = _private_dir(tmp_path / "cache")
    lib = _stub(cache / good.name, good, abi=2)
    _record(lib)  # recorded as if built here: only the ABI version is wrong
    got = _child(tmp_path, _env(cc, cache))
    _loaded_real_kernels(got)
    assert len(_builds(tmp_path)) == 1 and lib.read_bytes() == good.read_bytes()
    assert len(got["warnings"]) == 1 and "ABI version 2" in got["warnings"][0] and str(lib) in got["warnings"][0]
    # once: a fresh build with the wrong version turns the kernels off, it does not loop
    wrong = _stub(tmp_path / "abi2.so", good, abi=2)
    cc.write_text(cc.read_text().replace(str(good), str(wrong)))
    got = _child(tmp_path, _env(cc, _private_dir(tmp_path / "cache2")))
    assert not got["loaded"] and len(_builds(tmp_path)) == 2, got
    assert len(got["warnings"]) == 1 and "native kernels are off" in got["warnings"][0], got
    assert "ABI version 2" in got["warnings"][0]


def test_a_cached_library_missing_kernels_is_rebuilt(tmp_path, cc, good):
    cache = _private_dir(tmp_path / "cache")
    lib = _stub(cache / good.name, good, only=["qc_gemm_amx_set", "qc_gemm_vnni", "qc_quantize_i8"])
    _record(lib)
    got = _child(tmp_path, _env(cc, cache))
    _loaded_real_kernels(got)  # the stub's qc_quantize_i8 leaves zeros
    assert len(_builds(tmp_path)) == 1 and lib.read_bytes() == good.read_bytes()
    n = len(build.SYMBOLS)
    assert len(got["warnings"]) == 1 and f"lacks {n - 4} of the {n} kernels" in got["warnings"][0], got


def test_a_fresh_build_missing_kernels_turns_native_off_in_process_without_raising(tmp_path, cc, good, monkeypatch):
    """The native layer never raises to its callers (a load of a .qc would call it an ArtifactError)."""
    partial = _stub(tmp_path / "partial.so", good, only=["qc_gemm_amx_set", "qc_gemm_vnni"])
    cc.write_text(cc.read_text().replace(str(good), str(partial)))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(build.ENV_DISABLE, raising=False)
    build.reset()
    try:
        with pytest.warns(QCompilerWarning, match="native kernels are off") as caught:
            assert build.library() is None
        n = len(build.SYMBOLS)
        assert len(caught) == 1 and f"lacks {n - 3} of the {n} kernels" in str(caught[0].message)
        assert not build.native_enabled()  # decided: no second build, no second warning
        assert len(_builds(tmp_path)) == 1
    finally:
        monkeypatch.undo()
        build.reset()


def test_loading_a_qc_with_a_cache_missing_kernels_is_never_an_artifact_error(tmp_path, cc, good, monkeypatch):
    """``qcompiler.load`` once blamed the .qc for a cached library without some kernels (ArtifactError): now
    that library is rebuilt, and where even a fresh build lacks them, the model runs on the torch path."""
    import torch
    import torch.nn as nn

    from qcompiler.compiled import compile as qc_compile
    from qcompiler.compiled import load

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(1, 3, 6, 6)
    with build.disabled():
        cm = qc_compile(m, (x,), march="bayes", progress=False)
        want = cm(x)
    saved = cm.save(tmp_path / "m.qc")
    cache = _private_dir(tmp_path / "cache")
    _record(_stub(cache / good.name, good, only=["qc_gemm_amx_set", "qc_gemm_vnni", "qc_quantize_i8"]))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(build.ENV_CACHE, str(cache))
    monkeypatch.delenv(build.ENV_DISABLE, raising=False)
    build.reset()
    try:
        with pytest.warns(QCompilerWarning, match="lacks"):
            got = load(saved)(x)
        assert torch.equal(got, want) and build.native_enabled() and len(_builds(tmp_path)) == 1
        # a fresh build without them: the torch path, one warning, still no ArtifactError
        partial = _stub(tmp_path / "partial.so", good, only=["qc_gemm_amx_set", "qc_gemm_vnni"])
        cc.write_text(cc.read_text().replace(str(good), str(partial)))
        monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache2"))
        build.reset()
        with pytest.warns(QCompilerWarning, match="native kernels are off"):
            got = load(saved)(x)
        assert torch.equal(got, want) and not build.native_enabled()
    finally:
        monkeypatch.undo()
        build.reset()


def test_the_symbol_list_matches_the_source_and_the_python_side(good):
    """build.SYMBOLS: exported by this machine's build; build.VNNI_SYMBOLS: by a build for a CPU with
    AVX512-VNNI; every ``qc_*`` name the Python side binds is one of them."""
    exported = set(_exports(good))
    assert set(build.SYMBOLS) <= exported, sorted(set(build.SYMBOLS) - exported)
    assert set(build.SYMBOLS) | set(build.VNNI_SYMBOLS) >= exported, sorted(exported - set(build.SYMBOLS))
    names = set(build.SYMBOLS) | set(build.VNNI_SYMBOLS)
    used = []
    for py in ("qcompiler/native/kernels.py", "backends/bpu/native/kernels.py", "backends/bpu/native/gemm.py",
               "backends/bpu/native/plan.py"):
        text = (ROOT / py).read_text()
        used += re.findall(r'f?"(qc_[^"]*)"', text) + re.findall(r"\blib\.(qc_\w+)", text)
    assert len(used) > 30
    for name in used:
        pattern = re.sub(r"\\\{[^}]*\\\}", r"\\w+", re.escape(name))
        assert any(re.fullmatch(pattern, n) for n in names), f"{name} is bound in Python but not in build.SYMBOLS"


def test_the_vnni_symbol_list_matches_a_build_for_a_vnni_cpu(tmp_path):
    so = tmp_path / "spr.so"
    cc, *args = [a for a in build.command(GCC, so) if a not in ("-O3", "-march=native")]
    res = subprocess.run([cc, "-O0", "-march=sapphirerapids", *args],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"gcc cannot build for sapphirerapids here: {res.stderr[-300:]}")
    assert set(_exports(so)) == set(build.SYMBOLS) | set(build.VNNI_SYMBOLS)


# ---------------------------------------------------------------------------------------------------------------
# the compiler's time limits


def _slow_cc(tmp_path, good, busy_s=None, hang=None):
    """A fake compiler that burns CPU for ``busy_s`` before copying, or hangs (``hang``: "version" in
    ``--version`` too, "compile" only when compiling) with its pid in ``pids``."""
    path = tmp_path / "slow-cc"
    pids = tmp_path / "pids"
    if hang is not None:
        text = "#!/bin/sh\necho $$ >> %s\n" % pids
        if hang == "compile":
            text += 'if [ "$1" = --version ]; then exec %s --version; fi\n' % GCC
        text += "exec sleep 600\n"
    else:
        busy = (f"{sys.executable} -c 'import time\nt = time.time() + {busy_s}\nwhile time.time() < t: pass'\n")
        text = FAKE_CC.format(lib=good, gcc=GCC, log=tmp_path / "cc.log", busy=busy)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("hang", ["version", "compile"])
def test_a_hung_compiler_is_killed_after_the_idle_limit_and_a_busy_one_is_not(tmp_path, good, hang):
    limits = {build.ENV_BUILD_IDLE: "2"}
    busy = _slow_cc(tmp_path, good, busy_s=4)  # 4 s of CPU, twice the idle limit: not a hang
    got = _child(tmp_path, {**_env(busy, tmp_path / "c1"), **limits})
    _loaded_real_kernels(got)
    assert got["warnings"] == [] and len(_builds(tmp_path)) == 1
    hung = _slow_cc(tmp_path, good, hang=hang)
    start = time.monotonic()
    got = _child(tmp_path, {**_env(hung, tmp_path / "c2"), **limits}, timeout=60)  # once 120 s
    took = time.monotonic() - start
    assert not got["loaded"] and took < 2 + 10, (took, got)
    (warning,) = got["warnings"]
    assert "native kernels are off" in warning and "used no CPU for 2 s" in warning, warning
    assert build.ENV_BUILD_IDLE in warning
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert pids and not any(_alive(p) for p in pids)
    assert not (tmp_path / "c2").exists() or list((tmp_path / "c2").iterdir()) == []  # no temporary file left


def test_the_absolute_cap_kills_a_compiler_that_runs_too_long(tmp_path, good):
    busy = _slow_cc(tmp_path, good, busy_s=60)
    start = time.monotonic()
    got = _child(tmp_path, {**_env(busy, tmp_path / "cache"), build.ENV_BUILD_MAX: "2"}, timeout=50)
    assert not got["loaded"] and time.monotonic() - start < 2 + 10, got
    (warning,) = got["warnings"]
    assert "still running after 2 s" in warning and build.ENV_BUILD_MAX in warning, warning


def test_without_proc_the_library_is_loaded_by_its_path_and_only_the_cap_kills(tmp_path, cc, good):
    """Where /proc is missing: dlopen by path (the directory is checked to be the user's alone), the digest
    still checked; no CPU accounting, so a hung compiler lives until the cap."""
    no_proc = {"QC_TEST_NO_PROC": "1"}
    cache = tmp_path / "cache"
    got = _child(tmp_path, {**_env(cc, cache), **no_proc})
    _loaded_real_kernels(got)
    assert got["warnings"] == [] and len(_builds(tmp_path)) == 1 and got["pinned"] == 0
    lib = cache / good.name
    lib.write_bytes(lib.read_bytes()[:1000])
    got = _child(tmp_path, {**_env(cc, cache), **no_proc})
    _loaded_real_kernels(got)
    assert len(_builds(tmp_path)) == 2 and "SHA-256" in got["warnings"][0], got
    hung = _slow_cc(tmp_path, good, hang="compile")
    start = time.monotonic()
    got = _child(tmp_path, {**_env(hung, tmp_path / "c2"), build.ENV_BUILD_IDLE: "0.5", build.ENV_BUILD_MAX: "3",
                            **no_proc}, timeout=60)
    assert not got["loaded"] and 3 <= time.monotonic() - start < 3 + 10, got
    assert "still running after 3 s" in got["warnings"][0], got


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_time_limit_is_named_and_the_default_used(tmp_path, cc, value):
    got = _child(tmp_path, {**_env(cc, tmp_path / "cache"), build.ENV_BUILD_IDLE: value})
    _loaded_real_kernels(got)
    (warning,) = got["warnings"]
    assert f"{build.ENV_BUILD_IDLE}={value!r}" in warning and "positive number of seconds" in warning, warning
