"""The executor: :class:`BpuSimulator` runs a program's ops in order, each with its kernel from
the tables (``FAST`` over ``REFERENCE``), op by op or through per-shape native plans
(``backends/bpu/sim/plan.py``)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from qcompiler.backends.bpu.native.plan import plans_enabled
from qcompiler.backends.bpu.onednn_conv import onednn_conv_available
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec
from qcompiler.backends.bpu.sim.gemm import int8_gemm_available, int8_gemm_preferred
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.backends.bpu.sim.plan import ProgramPlan, StalePlan
from qcompiler.backends.bpu.sim.registry import FAST, REFERENCE, KernelSpec
from qcompiler.backends.bpu.sim.row_split import RowSplitConv
from qcompiler.errors import ConfigError, UnsupportedOpError
from qcompiler.native.build import native_enabled
from qcompiler.parallel import part_budget
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qtensor import QTensor

__all__ = ["BpuSimulator", "KERNELS"]


KERNELS = ("fast", "fixed_point")

# input shapes a thread keeps a plan for (each holds every native layer's output buffer)
_PLANS_PER_THREAD = 4


class BpuSimulator:
    """Executes a BPU program on integers.

    ``run(inputs)`` takes a dict keyed by the program's input names: a
    ``QTensor`` with the input's dtype and scale for a quantized input, a
    float tensor for an ``f32`` input (a ``quantize`` op reads it).  It
    returns a dict keyed by the output names: QTensors for quantized outputs
    (per-channel for high-precision int32), float32 tensors for dequantized
    ones.  Weights are prepared once at construction.  A simulator may run in
    several threads at once: scratch buffers are per thread, and the lazily filled caches
    (prepacked weights, GEMM plans) hold values that do not depend on the thread.

    With the native kernels (``plan`` not False, ``QCOMPILER_NATIVE_PLAN`` not 0) the layers that
    have a native step run as a plan per thread and input shape (``backends/bpu/sim/plan.py``):
    built on the first call with those shapes, then one C call per run of such layers.
    """

    def __init__(self, program: BpuProgram, *, kernels: str = "fast", int8_gemm: Optional[bool] = None,
                 onednn: Optional[bool] = None, native: Optional[bool] = None, plan: Optional[bool] = None) -> None:
        if kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        program.validate()
        self.program, self.kernels = program, kernels
        if int8_gemm is None:
            int8_gemm = kernels == "fast" and int8_gemm_preferred()
        elif int8_gemm and not int8_gemm_available():
            raise ConfigError("int8_gemm=True but torch._int_mm is not exact (or missing) on this machine")
        if onednn is None:
            onednn = kernels == "fast" and onednn_conv_available()
        elif onednn and not onednn_conv_available():
            raise ConfigError("onednn=True but oneDNN's int8 convolution is not exact (or missing) on this machine")
        if native is None:
            native = kernels == "fast" and native_enabled()
        elif native and not native_enabled():
            raise ConfigError("native=True but the native kernels are off (no C compiler, a failed build, "
                              "or QCOMPILER_NATIVE=0); see qcompiler.native.build.native_enabled()")
        self.int8_gemm, self.onednn, self.native = bool(int8_gemm), bool(onednn), bool(native)
        self.specs = program.value_specs()
        self._ws = Workspace()
        self._steps: list[tuple[Callable, tuple[str, ...], str, tuple[str, ...]]] = []
        last_use: dict[str, int] = {}
        for i, op in enumerate(program.ops):
            for name in op.inputs:
                last_use[name] = i
        keep = {v.name for v in program.outputs}
        for i, op in enumerate(program.ops):
            fn = _compile(op, self.specs, f"{program.name}/{op.output}", kernels, self._ws, self.int8_gemm,
                          self.onednn, self.native)
            free = tuple(n for n in dict.fromkeys(op.inputs) if last_use.get(n) == i and n not in keep)
            self._steps.append((fn, tuple(op.inputs), op.output, free))
        self._in_checks = [(v, _input_check(v, program.name)) for v in program.inputs]
        self._out_wrap = [(v.name, _output_wrap(v)) for v in program.outputs]
        self._outputs = tuple(v.name for v in program.outputs)
        # native layers run back to back in C, per thread and input shape (backends/bpu/sim/plan.py)
        # (plan=False: op by op, as the op-by-op tests and benchmarks/native_plan.py need; None: unless
        # QCOMPILER_NATIVE_PLAN=0)
        self._planned = (self.native and (plans_enabled() if plan is None else bool(plan))
                         and any(hasattr(fn, "plan_step") for fn, *_ in self._steps))
        self._plans = threading.local()
        # a profile: set to a dict, each run adds each op's seconds to it, keyed by the value the op makes
        # (a plan's native steps then run one by one on the calling thread; benchmarks/simulator.py).  The
        # call that builds a plan records nothing, and a layout op a plan keeps as a view (no work) is absent
        self.step_times: Optional[dict[str, float]] = None

    def run(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(inputs, dict):
            raise ConfigError(f"BpuSimulator.run takes a dict of the program's inputs "
                              f"({', '.join(v.name for v in self.program.inputs)}), got {type(inputs).__name__}")
        env: dict[str, torch.Tensor] = {}
        for spec, check in self._in_checks:
            if spec.name not in inputs:
                raise ConfigError(f"program {self.program.name}: missing input '{spec.name}'")
            env[spec.name] = check(inputs[spec.name])
        with torch.no_grad():
            if self._planned:
                env = self._run_planned(env)
            else:
                self._run_ops(env)
        return {name: wrap(env[name]) for name, wrap in self._out_wrap}

    def _run_ops(self, env: dict[str, Any]) -> dict[str, Any]:
        """The program op by op on ``env``."""
        times = self.step_times
        for fn, ins, out, free in self._steps:
            if times is None:
                env[out] = fn(*[env[i] for i in ins])
            else:
                t0 = time.perf_counter()
                env[out] = fn(*[env[i] for i in ins])
                times[out] = times.get(out, 0.0) + time.perf_counter() - t0
            for name in free:
                del env[name]
        return env

    def _run_planned(self, env: dict[str, Any]) -> dict[str, Any]:
        """The call through this thread's plan for these input shapes (``backends/bpu/sim/plan.py``),
        built on the first call with them."""
        plans = getattr(self._plans, "by_shape", None)
        if plans is None:
            plans = self._plans.by_shape = {}
        key = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in env.values())
        parts = part_budget()
        plan = plans.get(key, False)
        if plan is False:
            if len(plans) >= _PLANS_PER_THREAD:  # the oldest shape's buffers go
                del plans[next(iter(plans))]
            plans[key], env = ProgramPlan.build(self._steps, self._outputs, env, parts)
            return env
        if plan is None:  # no op of this program has a native step on these shapes
            return self._run_ops(env)
        inputs = dict(env)
        try:
            return plan.run(env, parts, self.step_times)
        except StalePlan:
            del plans[key]
            return self._run_planned(inputs)

    __call__ = run


def _input_check(spec: ValueSpec, prog: str) -> Callable[[Any], torch.Tensor]:
    where = f"program {prog}: input '{spec.name}'"
    if spec.is_float:
        def check_float(v):
            if isinstance(v, torch.Tensor) and not isinstance(v, QTensor) and v.dtype == torch.bool:
                return v.float()  # a bool (masked_softmax's mask) enters as its 0/1, as torch casts it
            if isinstance(v, QTensor) or not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise ConfigError(f"{where} must be a float tensor, got {type(v).__name__}"
                                  + (f" {v.dtype}" if isinstance(v, torch.Tensor) else ""))
            return v
        return check_float

    def check_q(v):
        if not isinstance(v, QTensor):
            raise ConfigError(f"{where} must be a QTensor ({spec.dtype}), got {type(v).__name__}")
        if str(v.dtype) != spec.dtype:
            raise ConfigError(f"{where} must be {spec.dtype}, got {v.dtype}")
        if spec.per_channel:
            ok = v.qscheme().startswith("per_channel") and v.q_per_channel_axis() == spec.axis % v.dim() and \
                v.q_per_channel_scales().tolist() == spec.scale
        else:
            ok = not v.qscheme().startswith("per_channel") and v.q_scale() == spec.scale and v.q_zero_point() == 0
        if not ok:
            raise ConfigError(f"{where}: quantization parameters differ from the program's "
                              f"({spec.describe()})")
        return v.int_repr()
    return check_q


def _output_wrap(spec: ValueSpec) -> Callable[[torch.Tensor], Any]:
    if spec.is_float:
        return lambda t: t.contiguous()
    if spec.per_channel:
        scales = torch.tensor(spec.scale, dtype=torch.float64)
        zeros = torch.zeros(len(spec.scale), dtype=torch.int64)
        return lambda t: QTensor(t.contiguous(), scales, zeros, axis=spec.axis % t.dim())
    return lambda t: QTensor(t.contiguous(), spec.scale, 0)


def _compile(op: BpuOp, specs: dict[str, ValueSpec], name: str, kernels: str, ws: Workspace,
             int8_gemm: bool = False, onednn: bool = False, native: bool = False) -> Callable:
    """The kernel of one op: the ``FAST`` overlay's with ``kernels="fast"``, else the ``REFERENCE`` one."""
    build = FAST.get(op.kind) if kernels == "fast" else None
    if build is None:
        build = REFERENCE.get(op.kind)
    if build is None:
        raise UnsupportedOpError(f"{name}: the simulator has no kernel for op kind {op.kind!r}")
    def built(o: BpuOp) -> Callable:
        return build(KernelSpec(o, [specs[i] for i in o.inputs], name, ws, int8_gemm, onednn, native))

    padding = op.attrs.get("padding")
    if op.kind in _FOUR_SIDED and len(padding) == 4:
        # a folded F.pad: the symmetric kernel on the codes zero-padded by the excess (code 0 is 0.0)
        t, l, b, r = padding
        kernel = built(replace(op, attrs={**op.attrs, "padding": [min(t, b), min(l, r)]}))
        whole = lambda x, *rest: kernel(fp.pad_excess(x, padding)[0], *rest)  # noqa: E731
    else:
        whole = built(op)
    if op.kind in _ROW_SPLIT and kernels == "fast":
        return RowSplitConv(op, whole, built)  # one image's rows over idle workers (sim/row_split.py)
    return whole


_FOUR_SIDED = ("conv2d", "avg_pool2d")  # the op kinds whose padding may be [top, left, bottom, right]

_ROW_SPLIT = ("conv2d",)  # the op kinds cut into output-row bands when workers are idle
