"""Native kernel calls built once on fixed buffers and run in one call (``qc_run_plan``, backends/bpu/native/plan.c).

Between two native layers the simulator spent a few microseconds of Python each (dispatch, an
output allocation, a ctypes call): on mobilenet_v2's 52 small layers that was a quarter of the
run at batch 1.  A :class:`NativeSteps` holds a run of native layers whose buffers do not move
(the simulator's per-shape plans, ``backends/bpu/sim/plan.py``): each :class:`StepSpec` (a kernel's
``*_step`` builder and its arguments, pointers included) is turned into a C step once, and
:meth:`NativeSteps.run` runs them all in order in one ctypes call.

With ``parts`` > 1 the whole run is one parallel region of ``parts`` threads of torch's OpenMP
runtime (:func:`~qcompiler.native.openmp.parallel_entry`): from the thread that runs torch's ops
(a batch of one, ``qcompiler.parallel.run_split``) its own team, whose workers are still spinning
from the last op; from another thread (a batch-split worker lent idle workers) that thread's team,
which the runtime starts on first use.  Each step of at least :data:`MIN_WORK`
multiply-adds is cut into chunks of output rows taken by whichever thread comes, and no thread
starts a step before every chunk of the one before has finished.  Each chunk computes its rows
exactly as the whole call does, so the bits do not depend on the cut or on who ran what.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, NamedTuple, Optional, Sequence

from qcompiler.errors import ConfigError
from qcompiler.native.build import library
from qcompiler.native.openmp import parallel_entry

__all__ = ["StepSpec", "NativeSteps", "MIN_WORK", "ENV_PLAN", "plans_enabled"]

ENV_PLAN = "QCOMPILER_NATIVE_PLAN"  # "0" / "off": the simulator calls its native layers one by one
# A step below this many multiply-adds (or window taps) runs on one thread: handing out its chunks
# and waiting for the slowest costs about as much as half of it saves (benchmarks/native_plan.py).
MIN_WORK = 1 << 17

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class StepSpec(NamedTuple):
    """One native kernel call as a plan step: ``fn`` is its ctypes ``*_step`` builder, ``args`` the
    call's arguments after the step and argument-block pointers, ``keep`` the tensors those
    pointers point into (held as long as the step)."""
    fn: Any
    args: tuple
    keep: tuple = ()


def plans_enabled() -> bool:
    """Whether the simulator may build plans (``QCOMPILER_NATIVE_PLAN`` is not 0)."""
    return os.environ.get(ENV_PLAN, "").strip().lower() not in ("0", "off", "false", "no")


_API: dict[int, tuple] = {}  # id of the library -> (step bytes, argument-block bytes, qc_run_plan, qc_run_plan_timed)


def _api() -> tuple:
    """The plan entry points of the loaded library, typed once."""
    lib = library()
    if lib is None:
        raise ConfigError("NativeSteps: the native kernels are off; check native_enabled() first")
    api = _API.get(id(lib))
    if api is None:
        lib.qc_plan_sizes.argtypes, lib.qc_plan_sizes.restype = [_P], None
        sizes = (_I64 * 2)()
        lib.qc_plan_sizes(sizes)
        run, timed = lib.qc_run_plan, lib.qc_run_plan_timed
        run.argtypes, run.restype = [_P, _I64, ctypes.c_int, _I64, _P], ctypes.c_int
        timed.argtypes, timed.restype = [_P, _I64, _P], ctypes.c_int
        api = _API[id(lib)] = (int(sizes[0]), int(sizes[1]), run, timed)
    return api


class NativeSteps:
    """The C steps of ``specs``, in order, each built once by its builder into memory this object
    owns.  The buffers the steps read and write must stay where they are: the caller keeps them
    (and ``keep`` of each spec is kept here)."""

    def __init__(self, specs: Sequence[StepSpec]) -> None:
        step_bytes, ctx_bytes, self._run, self._run_timed = _api()
        self.n = len(specs)
        self._steps = ctypes.create_string_buffer(max(1, self.n) * step_bytes)
        self._ctx = ctypes.create_string_buffer(max(1, self.n) * ctx_bytes + 64)
        ctx0 = -(-ctypes.addressof(self._ctx) // 64) * 64  # each argument block 64-byte aligned
        self._addr = ctypes.addressof(self._steps)
        self._keep = [s.keep for s in specs]
        for i, spec in enumerate(specs):
            rc = spec.fn(self._addr + i * step_bytes, ctx0 + i * ctx_bytes, *spec.args)
            if rc != 0:
                raise ConfigError(f"NativeSteps: step {i} was refused by its builder ({rc})")

    def run(self, parts: int = 1, min_work: Optional[int] = None) -> None:
        """Every step, in order; ``parts`` > 1: on torch's OpenMP team (or the native pool when
        torch's runtime is not found), cutting the steps of at least ``min_work`` (None:
        :data:`MIN_WORK`, read at the call, which benchmarks/native_plan.py varies)."""
        omp = parallel_entry() if parts > 1 else None
        rc = self._run(self._addr, self.n, int(parts), MIN_WORK if min_work is None else int(min_work), omp)
        if rc != 0:
            raise MemoryError("native plan: out of memory for a kernel's scratch")

    def run_timed(self) -> list[float]:
        """Every step, in order, on the calling thread; returns each step's seconds (a profile)."""
        ns = (_I64 * max(1, self.n))()
        if self._run_timed(self._addr, self.n, ns) != 0:
            raise MemoryError("native plan: out of memory for a kernel's scratch")
        return [ns[i] * 1e-9 for i in range(self.n)]
