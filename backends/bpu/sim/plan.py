"""A BPU program's native layers run back to back in C: the simulator's plan for one input shape.

:class:`~qcompiler.backends.bpu.sim.executor.BpuSimulator` runs a program op by op in Python.  For
the ops whose kernel can be one native call on buffers that never move (a layer with a
``plan_step`` method: the native GEMM convs and linears, the VNNI depthwise conv, the channels-last
max pool, the bilinear and nearest resizes, the cat, the global average pool), a plan fixes those buffers once per input shape and turns each maximal run of such
ops into one :class:`~qcompiler.backends.bpu.native.plan.NativeSteps`: one ctypes call for the run, and at 2
threads one parallel region of torch's OpenMP team.  The other ops run as before, in between.

A layout op (``plan_view``: flatten, reshape, identity ...) whose input is in a buffer and whose
value is a view of it is neither: the view stands for the value on every run, so the op costs
nothing and does not end a run of native steps (the tail pool -> flatten -> linear stays in C).

The plan is built while running the first call (``ProgramPlan.build``): each op is asked for its
step on its actual inputs, the step runs at once, and a value a step reads that another op made
(or a program input) gets a buffer of its own, refilled by a copy on each run.  So every value
is the one the op-by-op run computes, by the same kernel call on the same bytes: bit for bit the
same outputs.  Values a later call would overwrite are cloned before they leave (outputs are
fresh tensors, as without a plan).

A plan belongs to one thread (its buffers are written in place); the simulator keeps one per
thread and input shape.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Sequence

import torch

from qcompiler.backends.bpu.native.plan import NativeSteps, StepSpec

__all__ = ["ProgramPlan", "StalePlan", "Alloc", "fresh"]

Alloc = Callable[[Sequence[int], torch.dtype], torch.Tensor]  # (shape, dtype) -> a contiguous tensor


def fresh(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor (how a kernel called op by op allocates its output)."""
    return torch.empty(tuple(shape), dtype=dtype)


class _Buffers:
    """The memory of the native steps' outputs, reused once a value is dead: a value's buffer goes
    back to the free list when the last value in it (the output, or a view an op made of it) is
    freed, and the next output takes the smallest free buffer it fits in.  So a plan holds about
    the memory the op-by-op run has live at its peak, and later layers write to memory the
    earlier ones left warm in cache."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []  # uint8 buffers no live value uses
        self.live: dict[int, list] = {}  # storage address -> [its uint8 buffer, live values in it]
        self.total = 0  # bytes allocated

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fits:
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        else:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.total += buf.numel()
        self.live[buf.untyped_storage().data_ptr()] = [buf, 0]
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def made(self, value: Any) -> None:
        entry = self._entry(value)
        if entry is not None:
            entry[1] += 1

    def dropped(self, value: Any) -> None:
        entry = self._entry(value)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[entry[0].untyped_storage().data_ptr()]
                self.free.append(entry[0])

    def _entry(self, value: Any) -> Optional[list]:
        return self.live.get(value.untyped_storage().data_ptr()) if isinstance(value, torch.Tensor) else None


class StalePlan(Exception):
    """A value no longer has the shape or dtype its plan buffer was made for (the simulator then
    drops the plan and runs the call op by op)."""


Step = tuple[Callable, tuple, str, tuple]  # BpuSimulator's (kernel, input names, output name, names freed)


class ProgramPlan:
    """The segments of one program for one input shape: runs of native steps (:class:`NativeSteps`)
    and, between them, the other ops as Python calls."""

    def __init__(self) -> None:
        # (NativeSteps, the names of the values its steps make), or a list of [fn, ins, out, free, into] records
        self.segments: list[Any] = []
        self.native_values: dict[str, torch.Tensor] = {}  # what the native steps write, by value name
        self.input_copies: list[tuple[str, torch.Tensor]] = []  # program inputs a native step reads
        self.storages: set[int] = set()  # the plan's buffers (an output in one is cloned on the way out)
        self.native_ops = 0
        self.outputs: tuple[str, ...] = ()
        self.buffer_bytes = 0  # the native steps' output memory (reused across dead values)

    @classmethod
    def build(cls, steps: list[Step], outputs: tuple[str, ...], env: dict[str, Any],
              parts: int) -> tuple[Optional["ProgramPlan"], dict]:
        """Run ``steps`` on ``env`` (the checked inputs; filled with the values) while building the
        plan; ``outputs`` are the program's output names.  Returns (the plan, or None when no op has
        a native step, env)."""
        plan = cls()
        plan.outputs = outputs
        bufs = _Buffers()
        fixed: dict[str, torch.Tensor] = {}  # value name -> the buffer a native step reads it from
        producer: dict[str, list] = {}  # value name -> the Python record that makes it
        native: list[StepSpec] = []
        names: list[str] = []  # the values the native steps in `native` make
        python: list[list] = []

        def fix(name: str) -> torch.Tensor:
            if name in fixed:
                return fixed[name]
            v = env[name]
            buf = torch.empty_like(v, memory_format=torch.preserve_format)
            buf.copy_(v)
            if name in producer:
                producer[name][4] = buf
            else:
                plan.input_copies.append((name, buf))
            plan.storages.add(buf.untyped_storage().data_ptr())
            fixed[name] = env[name] = buf
            # a Python op's view of a plan buffer no longer holds it: each run copies it out right after the op
            bufs.dropped(v)
            return buf

        for fn, ins, out, free in steps:
            viewer = getattr(fn, "plan_view", None)
            view = viewer(*[fixed[i] for i in ins]) if viewer is not None and ins and all(
                i in fixed for i in ins) else None  # a layout op's view of a buffer: no step at all
            if view is not None:
                env[out] = fixed[out] = plan.native_values[out] = view
                bufs.made(view)  # (it keeps its buffer alive as long as it is)
                for name in free:
                    bufs.dropped(env.pop(name))
                continue
            planner = getattr(fn, "plan_step", None)
            made = None
            if planner is not None and all(isinstance(env[i], torch.Tensor) for i in ins):
                made = planner(*[env[i] for i in ins])  # would it be one kernel call on these layouts?
                if made is not None:  # the same call on buffers that stay put
                    made = planner(*[fix(i) for i in ins], alloc=bufs.alloc)
            if made is not None:
                value, spec = made
                if python:
                    plan.segments.append(python)
                    python = []
                NativeSteps([spec]).run(parts)  # this call's value, now
                native.append(spec)
                names.append(out)
                env[out] = fixed[out] = plan.native_values[out] = value
                plan.storages.add(value.untyped_storage().data_ptr())
                plan.native_ops += 1
            else:
                if native:
                    plan.segments.append((NativeSteps(native), tuple(names)))
                    native, names = [], []
                record = [fn, ins, out, free, None]
                python.append(record)
                producer[out] = record
                env[out] = fn(*[env[i] for i in ins])
            bufs.made(env[out])  # (an output is never freed: its buffer is never reused)
            for name in free:
                bufs.dropped(env.pop(name))
        plan.segments.append((NativeSteps(native), tuple(names)) if native else python)
        plan.buffer_bytes = bufs.total
        plan._finish(env)
        return (plan if plan.native_ops else None), env

    def run(self, env: dict[str, Any], parts: int, times: Optional[dict[str, float]] = None) -> dict:
        """Every op on ``env`` (the checked inputs, of the shapes the plan was built for); returns env
        with every value.  Raises :class:`StalePlan` if a value changed shape (nothing is written
        into a buffer of the wrong size).  ``times``: add each op's seconds to it, by the name of the
        value it makes (the native steps then run one by one on the calling thread)."""
        for name, buf in self.input_copies:
            v = env[name]
            if v.shape != buf.shape or v.dtype != buf.dtype:
                raise StalePlan(name)
            buf.copy_(v)
            env[name] = buf
        env.update(self.native_values)
        for seg in self.segments:
            if isinstance(seg, tuple):
                steps, names = seg
                if times is None:
                    steps.run(parts)
                else:
                    for name, t in zip(names, steps.run_timed()):
                        times[name] = times.get(name, 0.0) + t
                continue
            for fn, ins, out, free, into in seg:
                if times is None:
                    v = fn(*[env[i] for i in ins])
                else:
                    t0 = time.perf_counter()
                    v = fn(*[env[i] for i in ins])
                    times[out] = times.get(out, 0.0) + time.perf_counter() - t0
                if into is not None:
                    if not isinstance(v, torch.Tensor) or v.shape != into.shape or v.dtype != into.dtype:
                        raise StalePlan(out)
                    into.copy_(v)
                    v = into
                env[out] = v
                for name in free:
                    del env[name]
        self._finish(env)
        return env

    def _finish(self, env: dict[str, Any]) -> None:
        """Clone the outputs that live in the plan's buffers (the next call rewrites them)."""
        for name in self.outputs:
            v = env[name]
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in self.storages:
                env[name] = v.clone()
