"""Build and load qcompiler's native kernels with the system C compiler.

One library holds the C sources of two packages (:data:`SOURCES`): this one's calibration kernels
(``kernels.c``) and thread pool (``pool.c``, ``qc_pool.h``), and the BPU simulator's kernels
(``backends/bpu/native``).  It is compiled on first use (``cc -O3 -march=native -shared``, one
compiler call, seconds) into a per-user cache directory, under a name keyed by a hash of every source
and header, the compiler command and version, and the CPU (model and feature flags): a changed
source, flag or machine builds a new file, never reuses a stale one.  No torch headers, no
``torch.utils.cpp_extension``.

A cached library is code this process will run, so it is trusted the way ssh trusts its keys
(docs/native.md): the directory and the file must be owned by this user and writable by nobody
else, the file's SHA-256 must match the one the build recorded beside it (``<name>.sha256``),
checked through the same open file that is then loaded (``/proc/self/fd/N``), and the library must
have this ABI version and every kernel the Python side calls.  A file that fails is rebuilt; a
directory that fails is left alone, with a warning, and the library is built in a fresh private
directory instead.  Directories are made 0700 and files 0700 / 0600 whatever the umask.  Builds
are atomic (temporary file + ``os.replace``) and serialised by a lock on the directory, so racing
processes compile once and all load the same library.

The compiler runs in its own process group, killed when the group has used no CPU for
``QCOMPILER_NATIVE_BUILD_IDLE_S`` seconds (20: a hung compiler makes no progress, a compiler on a
loaded machine does) or after ``QCOMPILER_NATIVE_BUILD_MAX_S`` (600) in any case.

If there is no compiler, the build fails, or ``QCOMPILER_NATIVE=0`` is set, :func:`library`
returns None after one :class:`~qcompiler.errors.QCompilerWarning` (none for the environment
variable), and every caller keeps its exact torch path; :func:`library` never raises.
``QCOMPILER_NATIVE_CACHE`` (an absolute path) overrides the cache directory; ``CC`` the compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import importlib.util
import math
import os
import platform
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from qcompiler.errors import QCompilerWarning

__all__ = ["library", "native_enabled", "reset", "disabled", "ENV_DISABLE", "ENV_CACHE", "ENV_AMX", "ENV_BUILD_IDLE",
           "ENV_BUILD_MAX", "SOURCES", "HEADERS", "INCLUDE", "FLAGS", "SYMBOLS", "VNNI_SYMBOLS", "command"]

ENV_DISABLE = "QCOMPILER_NATIVE"  # "0" / "off" / "false": never build or load
ENV_CACHE = "QCOMPILER_NATIVE_CACHE"
ENV_AMX = "QCOMPILER_NATIVE_AMX"  # "0" / "off": the int8 GEMM on AVX512-VNNI vectors, never on AMX tiles
ENV_BUILD_IDLE = "QCOMPILER_NATIVE_BUILD_IDLE_S"  # kill the compiler when its group used no CPU this long
ENV_BUILD_MAX = "QCOMPILER_NATIVE_BUILD_MAX_S"  # kill the compiler after this long in any case
INCLUDE = Path(__file__).parent  # qc_pool.h, which the BPU sources include


def _bpu_kernels_dir() -> Path:
    """``backends/bpu/native``, the BPU simulator's kernels (package data, as these), found the way
    the import system finds ``qcompiler.backends`` (inside an installed package, or beside
    ``qcompiler/`` in an editable checkout, whose pyproject maps it to ``./backends``), without
    running any backend code: the spec only locates the package."""
    spec = importlib.util.find_spec("qcompiler.backends")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(locations[0]) / "bpu" / "native" if locations else INCLUDE / "missing-bpu-kernels"


_BPU = _bpu_kernels_dir()
SOURCES = tuple(sorted(INCLUDE.glob("*.c"))) + tuple(sorted(_BPU.glob("*.c")))
HEADERS = tuple(sorted(INCLUDE.glob("*.h"))) + tuple(sorted(_BPU.glob("*.h")))
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-strict-aliasing", "-fvisibility=hidden", "-std=gnu11",
         "-fopenmp-simd", "-pthread",  # the simd pragmas only (no OpenMP runtime); pthreads for qc_hist_abs_f32_mt
         "-ffp-contract=off")  # float code is evaluated as written: no a*b+c fused into an FMA
ABI_VERSION = 1
IDLE_S, MAX_S = 20.0, 600.0
_POLL_S = 0.25

_INTS = ("i8", "i16")
_PAIRS = ("i8_i8", "i8_i16", "i16_i8", "i16_i16")  # input_output dtypes
# every function of the library the Python side binds (kernels.py, gemm.py, plan.py): a library without
# one of them is not used (tests/test_native_cache.py checks this list against the source and the callers)
SYMBOLS = (
    "qc_abi_version", "qc_gemm_vnni", "qc_gemm_amx_set", "qc_gemm_amx_calls", "qc_conv_geometry_layout",
    "qc_hist_abs_f32", "qc_hist_abs_f32_mt",
    "qc_hist_abs_grow_f32", "qc_hist_observe_f32", "qc_rows_minmax_f32", "qc_plan_sizes", "qc_run_plan",
    "qc_run_plan_timed",
    *(f"qc_requant_{a}_{o}" for a in ("f32", "f64") for o in _INTS),
    *(f"qc_requant_add_{a}_{p}" for a in ("f32", "f64") for p in _PAIRS),
    *(f"qc_quantize{layout}_{o}" for layout in ("", "_nhwc") for o in _INTS),
    *(f"qc_dwconv_i8_{o}" for o in _INTS),
    *(f"qc_{c}_{p}" for c in ("cat", "cat32") for p in _PAIRS),
    *(f"qc_cat_{o}_step" for o in _INTS),
    *(f"qc_resize_nhwc_{p}{s}" for p in _PAIRS for s in ("", "_step")),
    *(f"qc_resize_planes_{p}" for p in _PAIRS),
    *(f"qc_nearest_nhwc_{p}_step" for p in _PAIRS),
    *(f"qc_maxpool_nhwc_{o}{s}" for o in _INTS for s in ("", "_step")),
    *(f"qc_gap_nhwc_{p}{s}" for p in _PAIRS for s in ("", "_step")),
)
# and those it must have where it has AVX512-VNNI kernels for this CPU (qc_gemm_vnni() == 1)
VNNI_SYMBOLS = (
    *(f"qc_gemm_{o}{s}" for o in _INTS for s in ("", "_mt", "_step")),
    *(f"qc_gemm_add_{p}{s}" for p in _PAIRS for s in ("", "_mt", "_step")),
    *(f"qc_dwconv4_i8_{o}{s}" for o in _INTS for s in ("", "_mt", "_step")),
    "qc_gemm_conv_layout", "qc_gemm_prep", "qc_gemm_prep_bytes", "qc_gemm_slide_cap", "qc_gemm_slide_weights",
    "qc_gemm_tail_weights",
)

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # never a symlink; a FIFO does not block
_lock = threading.Lock()
_state: dict = {}  # "lib": ctypes.CDLL or None once decided; "why": reason it is off
_PINNED: list[int] = []  # fds of the files loaded through /proc/self/fd/N (see _dlopen)


class _Refused(Exception):
    """A cache directory that must not be used; the message names it and says why."""


def _disabled_by_env() -> bool:
    return os.environ.get(ENV_DISABLE, "").strip().lower() in ("0", "off", "false", "no")


def _cache_dir(notes: list) -> Optional[Path]:
    """The cache directory (absolute), or None for a private one.  A relative ``QCOMPILER_NATIVE_CACHE``
    is ignored with a note (it would name another directory in every working directory), a relative
    ``XDG_CACHE_HOME`` silently (the XDG spec: a relative value is invalid)."""
    base = os.environ.get(ENV_CACHE)
    if base and os.path.isabs(base):
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    default = Path(root) / "qcompiler" / "native" if os.path.isabs(root) else None
    if base:
        notes.append(f"qcompiler: {ENV_CACHE}={base!r} is not an absolute path, so it is ignored; the native "
                     f"kernels are cached in {default or 'a private directory'} instead (set it to an absolute path)")
    elif default is None:
        notes.append(f"qcompiler: no absolute cache directory for the native kernels "
                     f"(HOME={os.environ.get('HOME')!r}); building them in a private directory (set {ENV_CACHE} "
                     f"to an absolute path)")
    return default


def _refusal(st: os.stat_result, path: Path) -> Optional[str]:
    """Why a cache directory or file may not be trusted (ssh's rule: yours, and writable by nobody else)."""
    uid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if mode & 0o002:
        return f"{path} is writable by others (mode {mode:04o})"
    if mode & 0o020:
        return f"{path} is writable by its group (mode {mode:04o})"
    return None


def _makedirs(path: Path) -> None:
    """Create the missing directories of ``path`` 0700, whatever the umask."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)  # mode & ~umask: never more than 0700
        except FileExistsError:
            continue  # a racing process made it; it is checked when opened
        os.chmod(d, 0o700)  # a umask such as 0o700 would have left it unusable


def _open_dir(path: Path) -> int:
    """An fd on the directory ``path`` (created where missing); _Refused if it may not be trusted."""
    try:
        _makedirs(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _Refused(f"{path} cannot be used ({e.strerror or e})") from None
    why = _refusal(os.fstat(fd), path)
    if why:
        os.close(fd)
        raise _Refused(why)
    return fd


def _open_checked(dir_fd: int, cache: Path, name: str) -> tuple[Optional[int], Optional[str]]:
    """An fd on the regular file ``name`` of the directory, or None and why not (None: it does not exist)."""
    path = cache / name
    try:
        fd = os.open(name, _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path} cannot be opened ({'a symbolic link' if e.errno == errno.ELOOP else e.strerror})"
    st = os.fstat(fd)
    why = _refusal(st, path) if stat.S_ISREG(st.st_mode) else f"{path} is not a regular file"
    if why:
        os.close(fd)
        return None, why
    return fd, None


def _recorded_digest(dir_fd: int, cache: Path, name: str) -> tuple[Optional[str], Optional[str]]:
    """The SHA-256 the build recorded for ``name`` (sha256sum's format), or None and why not (None: no record,
    a cache from before digests were recorded)."""
    fd, why = _open_checked(dir_fd, cache, f"{name}.sha256")
    if fd is None:
        return None, why
    try:
        words = os.read(fd, 4096).decode("ascii", "replace").split()
    finally:
        os.close(fd)
    if len(words) != 2 or words[1] != name or not re.fullmatch("[0-9a-f]{64}", words[0]):
        return None, f"{cache / name}.sha256 does not hold '<sha256>  {name}'"
    return words[0], None


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _dlopen(fd: int, path: Path) -> ctypes.CDLL:
    """Load the very file open as ``fd`` (the one just hashed): ``/proc/self/fd/N`` is the same inode, so
    no one can swap the path in between.  A copy of the fd stays open for good: glibc matches loaded
    libraries by name, and a later load through a reused fd number would get this library back."""
    if not os.path.isdir("/proc/self/fd"):
        return ctypes.CDLL(str(path))  # the directory is this user's alone (checked)
    pin = os.dup(fd)
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{pin}")
    except BaseException:
        os.close(pin)
        raise
    _PINNED.append(pin)
    return lib


def _verify(lib: ctypes.CDLL, path: Path) -> Optional[str]:
    """Why the loaded library is not the one this qcompiler needs (ABI version, kernels), or None."""
    if not hasattr(lib, "qc_abi_version"):
        return f"{path} is not qcompiler's kernel library (no qc_abi_version)"
    lib.qc_abi_version.argtypes, lib.qc_abi_version.restype = [], ctypes.c_int
    abi = lib.qc_abi_version()
    if abi != ABI_VERSION:
        return f"{path} has ABI version {abi}, this qcompiler needs {ABI_VERSION}"
    need = SYMBOLS + (VNNI_SYMBOLS if hasattr(lib, "qc_gemm_vnni") and lib.qc_gemm_vnni() == 1 else ())
    missing = sorted(n for n in need if not hasattr(lib, n))
    if missing:
        return (f"{path} lacks {len(missing)} of the {len(need)} kernels this qcompiler calls "
                f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    return None


def _cached(dir_fd: int, cache: Path, name: str) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """The cached library if every check passes, else None and why (None: nothing usable to complain about)."""
    fd, why = _open_checked(dir_fd, cache, name)
    if fd is None:
        return None, why
    try:
        recorded, why = _recorded_digest(dir_fd, cache, name)
        if recorded is None:
            return None, why
        if _sha256(fd) != recorded:
            return None, f"{cache / name} does not match the SHA-256 recorded in {name}.sha256 (damaged or replaced)"
        try:
            lib = _dlopen(fd, cache / name)
        except OSError as e:
            return None, f"{cache / name} cannot be loaded ({e})"
        why = _verify(lib, cache / name)
        return (None, why) if why else (lib, None)
    finally:
        os.close(fd)


def _group_cpu(pgid: int) -> Optional[int]:
    """Clock ticks of CPU used so far by the processes of group ``pgid`` and their reaped children
    (utime + stime + cutime + cstime from /proc/<pid>/stat), or None without /proc."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 14 and int(fields[2]) == pgid:  # fields[0] is field 3 (state) of proc(5)
            total += sum(int(x) for x in fields[11:15])
    return total


def _run(cmd: list, what: str, limits: tuple[float, float]) -> tuple[int, str, str]:
    """Run the compiler in a session of its own: (exit code, stdout, stderr).  The whole group is killed,
    and RuntimeError raised naming ``what``, once it has used no CPU for the idle limit (where /proc
    tells) or once the cap has passed."""
    idle, cap = limits
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        start = last = time.monotonic()
        used = -1
        try:
            while True:
                try:
                    proc.wait(timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                if now - start >= cap:
                    raise RuntimeError(f"{what} was still running after {cap:g} s and was killed (the cap on a "
                                       f"build; {ENV_BUILD_MAX} sets it)")
                cpu = _group_cpu(proc.pid)
                if cpu is not None and cpu > used:
                    used, last = cpu, now
                elif cpu is not None and now - last >= idle:
                    raise RuntimeError(f"{what} used no CPU for {idle:g} s and was killed as hung "
                                       f"({ENV_BUILD_IDLE} sets the limit)")
        finally:
            if proc.returncode is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def _limits(notes: list) -> tuple[float, float]:
    """(idle, cap) seconds from the environment; a bad value is named in a note and the default used."""
    got = []
    for env, default in ((ENV_BUILD_IDLE, IDLE_S), (ENV_BUILD_MAX, MAX_S)):
        raw = os.environ.get(env, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            value = math.nan
        if not (0 < value < math.inf):
            notes.append(f"qcompiler: {env}={raw!r} is not a positive number of seconds; using {default:g}")
            value = default
        got.append(value)
    return got[0], got[1]


def _cpu_id() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    fields = ("model name", "flags", "Features", "CPU part")
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in fields]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("gcc", "cc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _library_name(cc: str, limits: tuple[float, float]) -> str:
    rc, out, _ = _run([cc, "--version"], f"`{os.path.basename(cc)} --version`", limits)
    version = out.splitlines()[0] if rc == 0 and out else cc
    key = hashlib.sha256(b"\0".join([_sources_digest(), " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_id().encode(), platform.machine().encode()])).hexdigest()[:24]
    return f"qc_kernels_{key}.so"


def _sources_digest() -> bytes:
    """The SHA-256 of every source and header, each with its name (a renamed or moved file counts too)."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(f"{path.parent.name}/{path.name}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.digest()


def command(cc: str, out: Path) -> list[str]:
    """The one compiler call that builds the library from :data:`SOURCES` into ``out``."""
    return [cc, *FLAGS, f"-I{INCLUDE}", "-o", str(out), *(str(s) for s in SOURCES), "-lm"]


def _build(cc: str, dir_fd: int, cache: Path, name: str, limits: tuple[float, float]) -> ctypes.CDLL:
    """Compile into the checked directory, record the digest, install both atomically, and load the
    compiled file through the fd it was hashed from.  RuntimeError / OSError say what failed."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        what = f"`{os.path.basename(cc)}` compiling the native kernels ({len(SOURCES)} sources)"
        rc, _, err = _run(command(cc, cache / tmp), what, limits)
        if rc != 0:
            detail = f": {err.strip()[:500]}" if err.strip() else ""
            raise RuntimeError(f"{os.path.basename(cc)} exited with {rc}{detail}")
        fd = os.open(tmp, _OPEN, dir_fd=dir_fd)  # what the compiler wrote, in the checked directory
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise RuntimeError(f"{cache / tmp}, the compiler's output, is not a regular file of this user's")
            os.fchmod(fd, 0o700)  # the compiler made it 0777 & ~umask
            digest = _sha256(fd)
            rec = os.open(f"{tmp}.sha256", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dir_fd)
            try:
                os.fchmod(rec, 0o600)
                os.write(rec, f"{digest}  {name}\n".encode())
            finally:
                os.close(rec)
            # atomic: a racing process (without the lock) replaces them with an identical pair
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.replace(f"{tmp}.sha256", f"{name}.sha256", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            lib = _dlopen(fd, cache / name)
        finally:
            os.close(fd)
    finally:
        for left in (tmp, f"{tmp}.sha256"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(left, dir_fd=dir_fd)
    why = _verify(lib, cache / name)
    if why:
        raise RuntimeError(f"the fresh build {why}")
    return lib


def _lock_dir(dir_fd: int, wait_s: float) -> None:
    """Hold the directory's flock (released when ``dir_fd`` is closed) so racing processes build once; after
    ``wait_s`` (a holder that is stuck), or where flock does not work, go on without it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                return
            time.sleep(_POLL_S)
        except OSError:
            return


def _load(notes: list) -> tuple[Optional[ctypes.CDLL], str]:
    """The checked library, cached or built; else None and why.  ``notes`` collects the warnings to give."""
    if _disabled_by_env():
        return None, f"{ENV_DISABLE}={os.environ.get(ENV_DISABLE)}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (gcc, cc or clang; or set CC)"
    limits = _limits(notes)
    try:
        name = _library_name(cc, limits)
        cache, dir_fd = _cache_dir(notes), None
        if cache is not None:
            try:
                dir_fd = _open_dir(cache)
            except _Refused as e:
                notes.append(f"qcompiler: refusing the native kernel cache: {e}; building the kernels in a private "
                             f"directory instead (make it a directory of yours that only you can write: chown it, "
                             f"chmod 700 {cache}; or set {ENV_CACHE} to such a directory)")
        if dir_fd is None:
            return _load_private(cc, name, limits), ""
        try:
            lib, why = _cached(dir_fd, cache, name)
            if lib is None:
                _lock_dir(dir_fd, limits[0] + limits[1])
                lib, why = _cached(dir_fd, cache, name)  # a racing process may have built it meanwhile
            if lib is None:
                if why:
                    notes.append(f"qcompiler: not loading the cached native kernels: {why}; rebuilding them")
                lib = _build(cc, dir_fd, cache, name, limits)
            return lib, ""
        finally:
            os.close(dir_fd)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building the native kernels failed: {e}"


def _load_private(cc: str, name: str, limits: tuple[float, float]) -> ctypes.CDLL:
    """Build in a fresh 0700 directory of this user's, load, and remove the directory (nothing is reused)."""
    private = Path(tempfile.mkdtemp(prefix="qcompiler-native-"))
    try:
        dir_fd = _open_dir(private)
        try:
            return _build(cc, dir_fd, private, name, limits)
        finally:
            os.close(dir_fd)
    except _Refused as e:
        raise RuntimeError(f"the private directory {e}") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library, built on first use; None when native kernels are off.  Never raises:
    a failure of the native layer turns it off with one warning, and callers keep their exact torch path."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                notes: list = []
                try:
                    lib, why = _load(notes)
                    if lib is not None:
                        # the int8 GEMM on AMX tiles where the CPU and OS have them, unless QCOMPILER_NATIVE_AMX=0
                        # (kernels.set_amx changes it later; the results are the same bits either way)
                        lib.qc_gemm_amx_set.argtypes, lib.qc_gemm_amx_set.restype = [ctypes.c_int], ctypes.c_int
                        off = os.environ.get(ENV_AMX, "").strip().lower() in ("0", "off", "false", "no")
                        lib.qc_gemm_amx_set(0 if off else 1)
                except Exception as e:  # never the caller's problem: the torch path is exact
                    lib, why = None, f"the native layer failed unexpectedly: {type(e).__name__}: {e}"
                for note in notes:
                    warnings.warn(note, QCompilerWarning, stacklevel=2)
                if lib is None and not _disabled_by_env():
                    warnings.warn(f"qcompiler: native kernels are off ({why}); using the slower exact torch "
                                  f"kernels (set {ENV_DISABLE}=0 to silence this)", QCompilerWarning, stacklevel=2)
                _state["why"] = why
                _state["lib"] = lib
    return _state["lib"]


def native_enabled() -> bool:
    """Whether the native kernels are in use (built and loaded, not turned off by ``QCOMPILER_NATIVE=0``)."""
    return library() is not None


def reset() -> None:
    """Forget the decision (tests: re-read the environment variable on the next call)."""
    with _lock:
        _state.clear()


@contextlib.contextmanager
def disabled():
    """Native kernels off inside the block: ``QCOMPILER_NATIVE=0`` is set, then restored (tests run
    the torch paths this way).  Changes the whole process; objects built inside keep their choice."""
    saved = os.environ.get(ENV_DISABLE)
    os.environ[ENV_DISABLE] = "0"
    reset()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_DISABLE, None)
        else:
            os.environ[ENV_DISABLE] = saved
        reset()
