"""Build and load qcompiler's native kernels (``kernels.c``) with the system C compiler.

The library is compiled on first use (``cc -O3 -march=native -shared``, about a second) into a
per-user cache directory, under a name keyed by a hash of the source, the compiler command and
version, and the CPU (model and feature flags): a changed source, flag or machine builds a new
file, never reuses a stale one.  The compiler writes a temporary file in the cache directory that
then replaces the target (``os.replace``, atomic), so two processes building at once both end
with a complete library.  No torch headers, no ``torch.utils.cpp_extension``.

If there is no compiler, the build fails, or ``QCOMPILER_NATIVE=0`` is set, :func:`library`
returns None after one :class:`~qcompiler.errors.QCompilerWarning` (none for the environment
variable), and every caller keeps its exact torch path.  ``QCOMPILER_NATIVE_CACHE`` overrides
the cache directory; ``CC`` the compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import secrets
import shutil
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Optional

from qcompiler.errors import QCompilerWarning

__all__ = ["library", "native_enabled", "reset", "disabled", "ENV_DISABLE", "ENV_CACHE", "ENV_AMX", "SOURCE", "FLAGS"]

ENV_DISABLE = "QCOMPILER_NATIVE"  # "0" / "off" / "false": never build or load
ENV_CACHE = "QCOMPILER_NATIVE_CACHE"
ENV_AMX = "QCOMPILER_NATIVE_AMX"  # "0" / "off": the int8 GEMM on AVX512-VNNI vectors, never on AMX tiles
SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-strict-aliasing", "-fvisibility=hidden", "-std=gnu11",
         "-fopenmp-simd", "-pthread",  # the simd pragmas only (no OpenMP runtime); pthreads for qc_hist_abs_f32_mt
         "-ffp-contract=off")  # float code is evaluated as written: no a*b+c fused into an FMA
ABI_VERSION = 1
_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {}  # "lib": ctypes.CDLL or None once decided; "why": reason it is off


def _disabled_by_env() -> bool:
    return os.environ.get(ENV_DISABLE, "").strip().lower() in ("0", "off", "false", "no")


def _cache_dir() -> Path:
    base = os.environ.get(ENV_CACHE)
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "qcompiler" / "native"


def _cpu_id() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
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


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=_TIMEOUT_S)
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else cc


def _build(cc: str) -> Path:
    """Compile into the cache (if not already there) and return the library's path."""
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                     _cpu_id().encode(), platform.machine().encode()])).hexdigest()[:24]
    cache = _cache_dir()
    target = cache / f"qc_kernels_{key}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        res = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True,
                             timeout=_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} exited with {res.returncode}: {res.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a racing process replaces it with an identical file
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def _load() -> tuple[Optional[ctypes.CDLL], str]:
    if _disabled_by_env():
        return None, f"{ENV_DISABLE}={os.environ.get(ENV_DISABLE)}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (gcc, cc or clang; or set CC)"
    try:
        path = _build(cc)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building the native kernels failed: {e}"
    try:
        lib = _open(path)
    except (OSError, AttributeError) as e:  # a damaged cached file (truncated, foreign): build it once more
        try:
            path.unlink(missing_ok=True)
            lib = _open(_build(cc))
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e2:
            return None, f"loading the native kernels failed ({e}), and so did a fresh build: {e2}"
    if lib.qc_abi_version() != ABI_VERSION:
        return None, "the cached library has a different ABI version"
    # the int8 GEMM on AMX tiles where the CPU and OS have them, unless QCOMPILER_NATIVE_AMX=0
    # (kernels.set_amx changes it later; the results are the same bits either way)
    lib.qc_gemm_amx_set.argtypes, lib.qc_gemm_amx_set.restype = [ctypes.c_int], ctypes.c_int
    lib.qc_gemm_amx_set(0 if os.environ.get(ENV_AMX, "").strip().lower() in ("0", "off", "false", "no") else 1)
    return lib, ""


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.qc_abi_version  # AttributeError if it is not our library
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library, built on first use; None when native kernels are off."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = _load()
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
