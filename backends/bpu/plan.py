"""A BPU program's native layers run back to back in C: the simulator's plan for one input shape.

:class:`~qcompiler.backends.bpu.simulator.BpuSimulator` runs a program op by op in Python.  For
the ops whose kernel can be one native call on buffers that never move (a layer with a
``plan_step`` method: the native GEMM convs and linears, the VNNI depthwise conv, the channels-last
max pool), a plan fixes those buffers once per input shape and turns each maximal run of such
ops into one :class:`~qcompiler.native.plan.NativeSteps`: one ctypes call for the run, and at 2
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

from typing import Any, Callable, Optional

import torch

from qcompiler.native.plan import NativeSteps, StepSpec

__all__ = ["ProgramPlan", "StalePlan"]


class StalePlan(Exception):
    """A value no longer has the shape or dtype its plan buffer was made for (the simulator then
    drops the plan and runs the call op by op)."""


Step = tuple[Callable, tuple, str, tuple]  # BpuSimulator's (kernel, input names, output name, names freed)


class ProgramPlan:
    """The segments of one program for one input shape: runs of native steps (:class:`NativeSteps`)
    and, between them, the other ops as Python calls."""

    def __init__(self) -> None:
        self.segments: list[Any] = []  # NativeSteps, or a list of [fn, ins, out, free, into] records
        self.native_values: dict[str, torch.Tensor] = {}  # what the native steps write, by value name
        self.input_copies: list[tuple[str, torch.Tensor]] = []  # program inputs a native step reads
        self.storages: set[int] = set()  # the plan's buffers (an output in one is cloned on the way out)
        self.native_ops = 0
        self.outputs: tuple[str, ...] = ()

    @classmethod
    def build(cls, steps: list[Step], outputs: tuple[str, ...], env: dict[str, Any],
              parts: int) -> tuple[Optional["ProgramPlan"], dict]:
        """Run ``steps`` on ``env`` (the checked inputs; filled with the values) while building the
        plan; ``outputs`` are the program's output names.  Returns (the plan, or None when no op has
        a native step, env)."""
        plan = cls()
        plan.outputs = outputs
        fixed: dict[str, torch.Tensor] = {}  # value name -> the buffer a native step reads it from
        producer: dict[str, list] = {}  # value name -> the Python record that makes it
        native: list[StepSpec] = []
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
            return buf

        for fn, ins, out, free in steps:
            viewer = getattr(fn, "plan_view", None)
            view = viewer(*[fixed[i] for i in ins]) if viewer is not None and ins and all(
                i in fixed for i in ins) else None  # a layout op's view of a buffer: no step at all
            if view is not None:
                env[out] = fixed[out] = plan.native_values[out] = view
                for name in free:
                    del env[name]
                continue
            planner = getattr(fn, "plan_step", None)
            made = None
            if planner is not None and all(isinstance(env[i], torch.Tensor) for i in ins):
                made = planner(*[env[i] for i in ins])  # would it be one kernel call on these layouts?
                if made is not None and not all(i in fixed for i in ins):
                    made = planner(*[fix(i) for i in ins])  # the same call on buffers that stay put
            if made is not None:
                value, spec = made
                if python:
                    plan.segments.append(python)
                    python = []
                NativeSteps([spec]).run(parts)  # this call's value, now
                native.append(spec)
                env[out] = fixed[out] = plan.native_values[out] = value
                plan.storages.add(value.untyped_storage().data_ptr())
                plan.native_ops += 1
            else:
                if native:
                    plan.segments.append(NativeSteps(native))
                    native = []
                record = [fn, ins, out, free, None]
                python.append(record)
                producer[out] = record
                env[out] = fn(*[env[i] for i in ins])
            for name in free:
                del env[name]
        plan.segments.append(NativeSteps(native) if native else python)
        plan._finish(env)
        return (plan if plan.native_ops else None), env

    def run(self, env: dict[str, Any], parts: int) -> dict:
        """Every op on ``env`` (the checked inputs, of the shapes the plan was built for); returns env
        with every value.  Raises :class:`StalePlan` if a value changed shape (nothing is written
        into a buffer of the wrong size)."""
        for name, buf in self.input_copies:
            v = env[name]
            if v.shape != buf.shape or v.dtype != buf.dtype:
                raise StalePlan(name)
            buf.copy_(v)
            env[name] = buf
        env.update(self.native_values)
        for seg in self.segments:
            if isinstance(seg, NativeSteps):
                seg.run(parts)
                continue
            for fn, ins, out, free, into in seg:
                v = fn(*[env[i] for i in ins])
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
