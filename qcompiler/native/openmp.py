"""torch's own OpenMP runtime, for native kernels that split a call over torch's intra-op threads.

torch's CPU ops run their parallel parts on an OpenMP team (ATen's parallel backend; on the x86
Linux wheels GNU ``libgomp``).  After each op the team's worker threads keep spinning for a while,
waiting for the next parallel region.  A native kernel that hands part of its work to a thread of
its own right after a torch op (the calibration observers bin each activation just after its
conv) finds the other core held by that spinning worker, and its helper waits to be scheduled:
on 1M-value histograms between convs the native pool (``qc_run_rows``) gained nothing, while a
parallel region of torch's runtime halved the time (docs/performance.md, "Calibration on both
cores").  Starting a region of the same runtime, from the thread that ran the op and with no more
threads than torch's count, gives the work to the spinning worker at once and adds no thread to the
process (a region from another thread, or of more threads, makes the runtime start threads of its own).

:func:`parallel_entry` is the address of the runtime's ``GOMP_parallel(fn, data, num_threads,
flags)``, the GNU OpenMP entry point a compiler emits for ``#pragma omp parallel`` (LLVM's and
Intel's runtimes export it too), for the native kernels to call with a plain C function.  None
when torch's parallel backend is not OpenMP, or not exactly one OpenMP runtime is loaded (which
one torch uses would be a guess), or the platform has no ``/proc/self/maps``: the callers then
keep their other path.  Found once per process.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional

import torch

__all__ = ["parallel_entry", "RUNTIMES"]

RUNTIMES = ("libgomp", "libiomp", "libomp")  # file name prefixes of OpenMP runtimes
_MISSING = object()
_entry: object = _MISSING


def _loaded_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    paths = {line.split(None, 5)[5] for line in text.splitlines() if len(line.split(None, 5)) == 6}
    return {p for p in paths if os.path.basename(p).startswith(RUNTIMES)}


def _find() -> Optional[int]:
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    runtimes = _loaded_runtimes()
    if len(runtimes) != 1 or not hasattr(os, "RTLD_NOLOAD"):
        return None
    try:  # RTLD_NOLOAD: the runtime already in the process, never a second copy
        lib = ctypes.CDLL(runtimes.pop(), mode=os.RTLD_NOLOAD)
        return ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def parallel_entry() -> Optional[int]:
    """The address of torch's OpenMP ``GOMP_parallel``, or None (see the module docstring).  None in
    a process forked after the runtime started its team: GNU OpenMP's team does not survive a fork
    (a region there never returns), so the callers bin on one thread instead."""
    global _entry
    if _entry is _MISSING:
        _entry = _find()
    if _entry is not None and os.getpid() != _PID:
        return None
    return _entry  # type: ignore[return-value]


_PID = os.getpid()  # the process this module was imported in (a forked child has another id)
