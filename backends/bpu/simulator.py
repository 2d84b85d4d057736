"""Integer-exact BPU simulator: runs a :class:`~qcompiler.backends.bpu.program.BpuProgram`.

Values are plain integer tensors with the static quantization recorded in
the program; QTensors appear only at the program boundary.  Every op computes
exactly what the converted model's module (``qcompiler.nn.quantized``)
computes, bit for bit.  Two kernel sets are available:

``kernels="fixed_point"``
    Each op calls the ``qcompiler.quantization.fixed_point`` functions the
    converted modules call, with the same arguments (identical by
    construction).

``kernels="fast"`` (default)
    conv2d / linear / max_pool2d / cat / nearest and bilinear resize use faster kernels
    that are *provably* exact (and are tested bit-exact against
    ``fixed_point`` and a pure-integer reference):

    * int8 convs (any groups) go to oneDNN's int8 convolution when
      :func:`~qcompiler.backends.bpu.onednn_conv.onednn_conv_available`
      verified it once (``onednn=``): float32 accumulators exact below 2**24
      (proven per chunk of input channels), requantized in float64 in
      channels-last memory with no tie check (proven statically; see
      ``backends/bpu/onednn_conv.py``); with the native kernels
      (``native=``, default :func:`~qcompiler.native.build.native_enabled`)
      that epilogue is one pass of integer arithmetic in C.  Layers whose epilogue is not
      proven exact that way, and int16 inputs, use the kernels below.
    * with the native kernels on a CPU with AVX512-VNNI, groups-1 convs and linear layers of int8
      inputs run on the native int8 GEMM with the requantization fused
      (:class:`~qcompiler.native.gemm.Int8Gemm`, ``_NativeGemmLayer``), and depthwise convs on
      its VNNI depthwise kernel, where each proves the layer exact; ``QCOMPILER_NATIVE_VNNI=0``
      keeps the kernels above.
    * int8 max pools are torch's quantized max pool on the same bytes; cat
      copies or requantizes each input into its output slice in float64
      (exact for int8/int16 inputs); nearest resize requantizes the input,
      then selects bytes.  With the native kernels: bilinear resize is one
      int32 pass when its taps are exact dyadics (``BilinearResize``: then
      the reference's float64 value is that rational exactly), cat inputs
      are requantized in int32 where proven equal on every input value,
      channels-last max pools are one native pass.
    * int8 x int8 -> int32 GEMMs (``torch._int_mm``, oneDNN) when
      :func:`int8_gemm_available` verified once that they do not saturate on
      this machine (VNNI/AMX arithmetic wraps modulo 2**32, so a sum whose
      true value fits int32 is exact whatever the order), and only for layers
      whose int32 range is proven: ``128 * max_o sum_i |w[o, i]| < 2**31``.
      Operands always reach it row-major (:func:`_gemm_operand`): with a
      1-sized dim, a "contiguous" tensor can have strides it misreads.
    * otherwise (or ``int8_gemm=False``) float32 GEMMs with the reduction
      split into input-channel chunks whose every partial sum stays below
      2**24: the bound ``max|x| * max_o sum_{i in chunk} |w[o, i]|`` (an L1
      bound per output channel, much tighter than fixed_point's
      ``k * max|x| * max|w|``), ``max|x| = 128`` for int8 activations; the
      chunks are summed in float64 (exact below 2**53).
    * convolutions are explicit im2col (never Winograd/FFT), gathered per
      tile of output positions in the integer type, so a tile's GEMM
      operands and epilogue temporaries stay in cache; 1x1 convs read the
      input directly; depthwise convs multiply-add shifted windows per
      channel block in float32 (partial sums < 2**24 by the same bound).
    * activations leave a conv in channel-major memory (``C,N,H,W`` under
      an ``N,C,H,W`` view), which the next conv reads without a copy.
    * the int32 range of the accumulator is proven from the L1 bound (plus
      ``max|bias|``) when possible, else checked on the data.
    * requantization ``round_half_even(acc * M / 2**n)`` is evaluated in
      float64 as ``(acc + bias) * (M * 2**-n)`` (the factor is exact).
      Rounding that product once cannot change the result when
      ``|t| < 2**(53-n)``; values that matter (``|t| < 2**b``, ``2**b >= qmax+1``)
      qualify when ``n <= 53 - b`` (an exact tie ``m + 1/2`` is representable,
      so it stays a tie and ``torch.round`` breaks it to even).  When that
      static condition fails, or a fused add makes a second rounding, every
      element whose float64 value lies within ``eps`` (a bound on the float
      error) of a rounding boundary is recomputed exactly in int64 with
      ``fixed_point.rounding_shift`` / ``round_scaled_sum``.
    * max pool is the running maximum of the strided windows of a
      qmin-padded copy (equal to ``F.max_pool2d``).

    * with the native kernels, ``quantize`` (per-tensor scale) is one native pass, and the global
      average pool requantizes its int32 sums in one native pass.

    Everything else (add, avg pools, LUTs, matmul, other bilinear resizes, ...) uses
    the fixed_point functions in both modes.

Accumulator overflow is never silent: every accumulating op either proves its
int32 range statically or checks it on the data, raising
:class:`~qcompiler.quantization.fixed_point.AccumulatorOverflow` naming the op
(``<program>/<value>``).

A whole converted model runs through the runtime's scheduler:
:meth:`qcompiler.runtime.Runtime.simulated` (BPU partitions here, CPU partitions in torch).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from qcompiler.backends.bpu.onednn_conv import F32_EXACT, NhwcRequant, OnednnConv, onednn_conv_available
from qcompiler.backends.bpu.plan import Alloc, ProgramPlan, StalePlan, fresh
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec, decode_index
from qcompiler.backends.bpu.row_split import RowSplitConv
from qcompiler.errors import ConfigError, UnsupportedOpError
from qcompiler.native.build import native_enabled
from qcompiler.native.gemm import Int8Gemm, gemm_available, row_parts
from qcompiler.native.kernels import (
    BilinearResize,
    DepthwiseConv,
    Requant,
    abs_sums,
    global_avg_pool_nhwc,
    global_avg_pool_nhwc_step,
    int32_requant,
    max_pool_nhwc,
    max_pool_nhwc_step,
    nearest_nhwc_step,
    nearest_taps,
    quantize_f32,
    requant_columns,
    requant_columns32,
    requant_columns_step,
)
from qcompiler.native.plan import plans_enabled
from qcompiler.nn import quantized as qnn
from qcompiler.parallel import part_budget
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qtensor import QTensor

__all__ = ["BpuSimulator", "KERNELS", "REFERENCE", "FAST", "KernelSpec",
           "int8_gemm_available"]

KERNELS = ("fast", "fixed_point")

_F32_EXACT = 1 << 24
_F64_EXACT = 1 << 53
_I32 = 1 << 31
_STORAGE = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}
# largest |value| of each integer type (for static bounds)
_AMAX = {"qint8": 128, "qint16": 1 << 15, "qint32": 1 << 31}
# input shapes a thread keeps a plan for (each holds every native layer's output buffer)
_PLANS_PER_THREAD = 4

# 2**b >= qmax + 1: the magnitude below which requantized values are not clamped
_OUT_BITS = {"qint8": 7, "qint16": 15, "qint32": 31}


# ---------------------------------------------------------------------------- workspace


class _Workspace:
    """Reusable scratch buffers (one per key and dtype), so large temporaries are not
    re-allocated (and page-faulted) on every call.  Never returned to the caller.

    The buffers are per thread, so one simulator can run in several threads at once (the
    batch split of ``qcompiler.parallel``): each thread gets its own set."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def _bufs(self) -> dict[tuple[str, torch.dtype], torch.Tensor]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        return bufs

    def get(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        bufs = self._bufs
        buf = bufs.get((key, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            bufs[(key, dtype)] = buf
        return buf[:n].view(tuple(shape))

    def clear(self) -> None:
        self._bufs.clear()


# ---------------------------------------------------------------------------- simulator


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
    have a native step run as a plan per thread and input shape (``backends/bpu/plan.py``):
    built on the first call with those shapes, then one C call per run of such layers.
    """

    def __init__(self, program: BpuProgram, *, kernels: str = "fast", int8_gemm: Optional[bool] = None,
                 onednn: Optional[bool] = None, native: Optional[bool] = None, plan: Optional[bool] = None) -> None:
        if kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        program.validate()
        self.program, self.kernels = program, kernels
        if int8_gemm is None:
            int8_gemm = kernels == "fast" and int8_gemm_available()
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
        self._ws = _Workspace()
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
        # native layers run back to back in C, per thread and input shape (backends/bpu/plan.py)
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
        """The call through this thread's plan for these input shapes (``backends/bpu/plan.py``),
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


# ---------------------------------------------------------------------------- op compilation


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel builder gets: the op, its inputs' specs, a name for errors, the scratch
    buffers and whether the exact int8 GEMM / oneDNN int8 convolution may be used."""

    op: BpuOp
    in_specs: list[ValueSpec]
    name: str
    ws: _Workspace
    int8_gemm: bool
    onednn: bool = False
    native: bool = False

    @property
    def attrs(self) -> dict:
        return self.op.attrs

    @property
    def tensors(self) -> dict:
        return self.op.tensors

    @property
    def out_dtype(self) -> Optional[str]:
        return self.op.attrs.get("out_dtype")


KernelBuilder = Callable[[KernelSpec], Callable]

# op kind -> builder of its exact kernel (``qcompiler.quantization.fixed_point`` semantics): the reference
REFERENCE: dict[str, KernelBuilder] = {}
# op kind -> builder of a faster kernel, bit-exact with the reference (tests/test_bpu_simulator.py)
FAST: dict[str, KernelBuilder] = {}


def _kernel(table: dict[str, KernelBuilder], *kinds: str) -> Callable[[KernelBuilder], KernelBuilder]:
    def deco(build: KernelBuilder) -> KernelBuilder:
        for kind in kinds:
            if kind in table:
                raise RuntimeError(f"two simulator kernels for op kind {kind!r}")
            table[kind] = build
        return build
    return deco


def _compile(op: BpuOp, specs: dict[str, ValueSpec], name: str, kernels: str, ws: _Workspace,
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
        return RowSplitConv(op, whole, built)  # one image's rows over idle workers (row_split.py)
    return whole


_FOUR_SIDED = ("conv2d", "avg_pool2d")  # the op kinds whose padding may be [top, left, bottom, right]
_ROW_SPLIT = ("conv2d",)  # the op kinds cut into output-row bands when workers are idle


@_kernel(FAST, "conv2d")
def _fast_conv(k: KernelSpec) -> Callable:
    if k.native:
        layer = _NativeDepthwiseLayer.build(k) or _NativeGemmLayer.build(k)
        if layer is not None:
            return layer
    if k.onednn:
        layer = _OnednnConvLayer.build(k)
        if layer is not None:
            return layer
    return _FastConv(k.op, k.in_specs, k.name, k.ws, k.int8_gemm)


@_kernel(FAST, "linear")
def _fast_linear(k: KernelSpec) -> Callable:
    layer = _NativeGemmLayer.build(k) if k.native else None
    if layer is not None:
        return layer
    return _FastLinear(k.op, k.in_specs, k.name, k.ws, k.int8_gemm)


@_kernel(REFERENCE, "conv2d", "conv_transpose2d", "linear")
def _weight_layer(k: KernelSpec) -> Callable:
    return _fixed_point_weight_layer(k.op, k.name)


@_kernel(REFERENCE, "quantize")
def _quantize(k: KernelSpec) -> Callable:
    scale, dtype = k.attrs["out_scale"], k.attrs["out_dtype"]
    return lambda x: fp.quantize(x, scale, dtype)


@_kernel(FAST, "quantize")
def _fast_quantize(k: KernelSpec) -> Callable:
    """With the native kernels and a per-tensor scale: one native pass over a contiguous float32
    input (:func:`~qcompiler.native.kernels.quantize_f32`, exactly ``fp.quantize``); any other input
    takes ``fp.quantize``."""
    scale, dtype = k.attrs["out_scale"], k.attrs["out_dtype"]
    st = _STORAGE.get(dtype)
    s = torch.as_tensor(scale, dtype=torch.float32)
    if not k.native or st not in (torch.int8, torch.int16) or s.numel() != 1 or not (
            math.isfinite(float(s)) and float(s) > 0):
        return _quantize(k)
    s32 = float(s.reshape(()))

    def quantize(x):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            return fp.quantize(x, scale, dtype)
        if x.dim() == 4 and x.shape[1] > 1:  # channels-last, what the native convs read
            out = torch.empty((x.shape[0], *x.shape[2:], x.shape[1]), dtype=st).permute(0, 3, 1, 2)
        else:
            out = torch.empty(x.shape, dtype=st)
        quantize_f32(x, s32, out)
        return out
    return quantize


@_kernel(REFERENCE, "dequantize")
def _dequantize_kernel(k: KernelSpec) -> Callable:
    return _dequantize(k.in_specs[0])


@_kernel(REFERENCE, "requantize")
def _requantize(k: KernelSpec) -> Callable:
    M, n, name, out_dtype = k.tensors["M"], k.tensors["n"], k.name, k.out_dtype
    return lambda x: fp.requantize(x, M, n, out_dtype, op=name)


@_kernel(REFERENCE, "matmul")
def _matmul(k: KernelSpec) -> Callable:
    M, n, name, out_dtype = k.tensors["M"], k.tensors["n"], k.name, k.out_dtype

    def matmul(x, y):
        acc = fp.check_accumulator(fp.int_matmul(x, y, op=name), 32, op=name)
        return fp.requantize(acc, M, n, out_dtype, op=name)
    return matmul


@_kernel(REFERENCE, "add", "sub")
def _add_sub(k: KernelSpec) -> Callable:
    Ma, na, Mb, nb = (int(k.tensors[t]) for t in ("Ma", "na", "Mb", "nb"))
    fn = fp.int_add if k.op.kind == "add" else fp.int_sub
    name, out_dtype = k.name, k.out_dtype
    return _with_constant(k.op, lambda x, y: fn(x, Ma, na, y, Mb, nb, out_dtype, op=name))


@_kernel(REFERENCE, "mul")
def _mul(k: KernelSpec) -> Callable:
    T, name, out_dtype = k.tensors, k.name, k.out_dtype
    M, n = T["M"], T["n"]
    if len(k.op.inputs) == 2 or "constant" in T:
        return _with_constant(k.op, lambda x, y: fp.int_mul(x, y, M, n, out_dtype, op=name))
    sign = int(k.attrs["sign"])
    return lambda x: fp.requantize(sign * x.to(torch.int64), M, n, out_dtype, op=name)


@_kernel(REFERENCE, "constant")
def _constant(k: KernelSpec) -> Callable:
    value = k.tensors["value"]
    return lambda: value


@_kernel(REFERENCE, "div")
def _div(k: KernelSpec) -> Callable:
    M, n, b_dtype, name, out_dtype = k.tensors["M"], k.tensors["n"], k.attrs["b_dtype"], k.name, k.out_dtype
    return lambda x, y: fp.int_div(x, y, M, n, b_dtype, out_dtype, op=name)


@_kernel(REFERENCE, "cat")
def _cat(k: KernelSpec) -> Callable:
    Ms, ns, dim = k.tensors["M"].tolist(), k.tensors["n"].tolist(), int(k.attrs["dim"])
    params = [(torch.tensor(M, dtype=torch.int64), torch.tensor(n, dtype=torch.int64)) for M, n in zip(Ms, ns)]
    name, out_dtype = k.name, k.out_dtype

    def cat(*xs):
        return torch.cat([fp.requantize(x, M, n, out_dtype, op=f"{name}[{i}]")
                          for i, (x, (M, n)) in enumerate(zip(xs, params))], dim=dim)
    return cat


def _nhwc(x: torch.Tensor) -> bool:
    """``x`` is a 4-d tensor laid out channels-last and not also contiguous (a 1-channel or 1x1
    tensor is both: it counts as contiguous)."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _like(ws: _Workspace, key: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scratch buffer of ``x``'s shape in its memory format (channels-last or contiguous), so
    element-wise passes between them run at unit stride."""
    if _nhwc(x):
        N, C, H, W = x.shape
        return ws.get(key, (N, H, W, C), dtype).permute(0, 3, 1, 2)
    return ws.get(key, x.shape, dtype)


@_kernel(FAST, "cat")
def _fast_cat(k: KernelSpec) -> Callable:
    """Each input requantized straight into its slice of the output (:class:`_FastCat`), or the
    reference for inputs other than int8/int16."""
    if any(s.dtype not in ("qint8", "qint16") for s in k.in_specs):
        return REFERENCE["cat"](k)
    return _FastCat(k)


class _FastCat:
    """Each input requantized straight into its slice of the output: a copy when its factor is 1
    and its dtype the output's, else ``clamp(round(q * (M * 2**-n)))`` in float64, exact for
    int8/int16 inputs (``q * M`` is an integer below 2**53 and the power of two scales it exactly;
    ``torch.round`` breaks ties to even like ``fixed_point.requantize``).  Channels-last inputs give a
    channels-last output.  With the native kernels, one integer pass per input (:func:`_native_cat`)
    where the layouts allow; as a plan step, all of them in one step."""

    def __init__(self, k: KernelSpec) -> None:
        Ms, ns = k.tensors["M"].tolist(), k.tensors["n"].tolist()
        self.dim, self.out_dtype = int(k.attrs["dim"]), k.out_dtype
        self.lo, self.hi = fp.qrange(self.out_dtype)
        self.st = fp.storage_dtype(self.out_dtype)
        self.plans = []
        for spec, M, n in zip(k.in_specs, Ms, ns):
            f = math.ldexp(float(M), -int(n))  # exact
            copy = f == 1.0 and spec.dtype == self.out_dtype
            self.plans.append(None if copy else torch.tensor([f], dtype=torch.float64))
        self.ws = k.ws
        # native: each input requantized (or copied) into its columns in one integer pass
        self.native = k.native and all(0 <= int(n) <= 62 and abs(int(M)) < 1 << 46 for M, n in zip(Ms, ns))
        # (M, n) and, where proven equal on every input value, the int32 (M32, n32) of the faster pass
        self.params = [(int(M), int(n), _narrow(int(M), int(n), _STORAGE[spec.dtype], self.lo, self.hi)
                        if self.native else None) for M, n, spec in zip(Ms, ns, k.in_specs)]

    def plan_step(self, *xs: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, one step for every input's pass), or None
        where the call is not the native passes on the inputs as they lie."""
        ops = _native_cat_operands(xs, self.dim, self.st, alloc) if self.native else None
        if ops is None or not ops[1].numel():
            return None
        srcs, out2, result = ops
        params = [(n32[0], n32[1], True) if n32 is not None and src.dtype == n32[2] else (M, n, None)
                  for src, (M, n, n32) in zip(srcs, self.params)]
        return result, requant_columns_step(srcs, out2, params, self.lo, self.hi)

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        dim, lo, hi, st, ws = self.dim, self.lo, self.hi, self.st, self.ws
        if self.native:
            y = _native_cat(xs, dim, self.params, lo, hi, st)
            if y is not None:
                return y
        d = dim % xs[0].dim()
        shape = list(xs[0].shape)
        shape[d] = sum(x.shape[d] for x in xs)
        out = torch.empty(shape, dtype=st, memory_format=torch.channels_last if _nhwc(xs[0]) else torch.contiguous_format)
        off = 0
        for x, f in zip(xs, self.plans):
            dst = out.narrow(d, off, x.shape[d])
            off += x.shape[d]
            if f is None:
                dst.copy_(x)
                continue
            # in slices along a dim other than the cat dim, so the float64 temporaries stay in cache
            e = next((i for i in range(x.dim()) if i != d and x.shape[i] > 1), None)
            step = max(1, _CAT_CHUNK * (x.shape[e] if e is not None else 1) // max(1, x.numel()))
            for i0 in range(0, x.shape[e] if e is not None else 1, step):
                xv = x if e is None else x.narrow(e, i0, min(step, x.shape[e] - i0))
                dv = dst if e is None else dst.narrow(e, i0, xv.shape[e])
                t = _like(ws, "cat", xv, torch.float64)
                torch.mul(xv, f, out=t)
                dv.copy_(t.round_().clamp_(lo, hi))
        return out


def _narrow(M: int, n: int, dtype: torch.dtype, lo: int, hi: int) -> Optional[tuple]:
    """``(M32, n32, dtype)``: the int32 parameters :func:`~qcompiler.native.kernels.int32_requant` proved
    equal to ``(M, n)`` on every value of ``dtype`` (the input's storage), or None."""
    m = int32_requant(M, n, dtype, lo, hi)
    return None if m is None else (*m, dtype)


def _native_cat_operands(xs, dim: int, st: torch.dtype, alloc: Alloc = fresh) -> Optional[tuple]:
    """(each input's rows, the output's rows (memory from ``alloc``), the result to return) of
    :func:`_native_cat` on ``xs`` as they lie (the inputs' rows are views), or None where it takes the
    torch path."""
    if not xs or any(x.dtype not in (torch.int8, torch.int16) or x.dim() != xs[0].dim() for x in xs):
        return None
    d = dim % xs[0].dim()
    first = xs[0].shape
    if any(x.shape[:d] != first[:d] or x.shape[d + 1:] != first[d + 1:] for x in xs):
        return None  # torch.cat's error, from the torch path
    total = sum(x.shape[d] for x in xs)
    if d == 1 and xs[0].dim() == 4 and all(x.is_contiguous(memory_format=torch.channels_last) for x in xs):
        N, _, H, W = first
        out = alloc((N, H, W, total), st)
        srcs = [x.permute(0, 2, 3, 1).reshape(N * H * W, x.shape[1]) for x in xs]
        result = out.permute(0, 3, 1, 2)
    elif all(x.is_contiguous() for x in xs):
        rows = math.prod(first[:d])
        shape = list(first)
        shape[d] = total
        out = alloc(shape, st)
        srcs = [x.reshape(rows, -1) for x in xs]
        result = out
    else:
        return None
    return srcs, out.view(srcs[0].shape[0], -1), result


def _native_cat(xs, dim: int, params, lo: int, hi: int, st: torch.dtype) -> Optional[torch.Tensor]:
    """:func:`_fast_cat` in native passes, one per input (:func:`~qcompiler.native.kernels.requant_columns`,
    or its int32 twin ``requant_columns32`` where ``_narrow`` proved it equal on every input value),
    when every input is channels-last 4-d and the cat is along channels (rows = positions), or every
    input is contiguous (rows = the dims before the cat dim); else None (the torch path)."""
    ops = _native_cat_operands(xs, dim, st)
    if ops is None:
        return None
    srcs, out2, result = ops
    col = 0
    for src, (M, n, narrow) in zip(srcs, params):
        if narrow is not None and src.dtype == narrow[2]:
            requant_columns32(src, out2, col, narrow[0], narrow[1], lo, hi)
        else:
            requant_columns(src, out2, col, M, n, lo, hi)
        col += src.shape[1]
    return result


# elements of one float64 slice of the fast cat (512 KiB)
_CAT_CHUNK = 1 << 16


@_kernel(FAST, "resize_nearest")
def _fast_resize_nearest(k: KernelSpec) -> Callable:
    """:class:`_FastNearestResize` for int8 outputs of int8/int16 inputs, else the reference."""
    if fp.storage_dtype(k.out_dtype) != torch.int8 or k.in_specs[0].dtype not in ("qint8", "qint16"):
        return REFERENCE["resize_nearest"](k)
    return _FastNearestResize(k)


class _FastNearestResize:
    """Nearest resize of int8 values: the reference's per-element requantization
    ``clamp(round(float64(q) * ratio))`` on the (smaller) input, then torch's nearest resize of
    the bytes (a selection: the same source element per output position as in float64).  As a plan
    step (native kernels, channels-last input): one native pass selecting torch's source elements
    (:func:`~qcompiler.native.kernels.nearest_taps`) and requantizing them with the same float64
    product, which commutes with the selection."""

    def __init__(self, k: KernelSpec) -> None:
        a = k.attrs
        self.size, self.ratio = tuple(a["size"]), a["in_scale"] / a["out_scale"]
        self.lo, self.hi = fp.qrange(k.out_dtype)
        self.st = fp.storage_dtype(k.out_dtype)
        self.reference = REFERENCE["resize_nearest"](k)
        self.native = k.native
        self._taps: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or not x.numel():
            return self.reference(x)
        st = self.st
        small = x if self.ratio == 1.0 and x.dtype == st else \
            torch.round(x.double() * self.ratio).clamp_(self.lo, self.hi).to(st)
        return F.interpolate(small.view(torch.uint8), size=self.size, mode="nearest").view(st)

    def _axis(self, n_in: int, n_out: int) -> torch.Tensor:
        key = (n_in, n_out)
        if key not in self._taps:
            self._taps[key] = nearest_taps(n_in, n_out)
        return self._taps[key]

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None off the native kernels or
        where the input is not channels-last int8/int16 (then torch's resize runs, op by op)."""
        if not (self.native and x.dim() == 4 and x.numel() and x.dtype in (torch.int8, torch.int16) and _nhwc(x)
                and math.isfinite(self.ratio) and self.ratio > 0):
            return None
        N, C, H, W = x.shape
        Ho, Wo = (int(v) for v in self.size)
        out = alloc((N, Ho, Wo, C), self.st).permute(0, 3, 1, 2)
        if not out.numel() or not _nhwc(out):  # (torch's output would be contiguous)
            return None
        ratio = None if self.ratio == 1.0 and x.dtype == self.st else self.ratio
        return out, nearest_nhwc_step(x, self._axis(H, Ho), self._axis(W, Wo), ratio, self.lo, self.hi, out)


@_kernel(FAST, "resize_bilinear")
def _fast_resize_bilinear(k: KernelSpec) -> Callable:
    """Bilinear resize in one native integer pass (:class:`~qcompiler.native.kernels.BilinearResize`)
    when the input's sizes give exact dyadic weights (factor-2 and other power-of-two ratios, equal
    sizes): then the reference's float64 value is a rational computed exactly in int32, rescaled
    by the same one float64 product.  Other inputs (and native off) take the reference."""
    a, out_dtype = k.attrs, k.out_dtype
    reference = REFERENCE["resize_bilinear"](k)
    st = fp.storage_dtype(out_dtype)
    if not k.native or st not in (torch.int8, torch.int16) or k.in_specs[0].dtype not in ("qint8", "qint16"):
        return reference
    lo, hi = fp.qrange(out_dtype)
    kernel = BilinearResize(a["size"], a["align_corners"], a["in_scale"] / a["out_scale"], lo, hi, st)
    return _FastBilinearResize(kernel, reference)


class _FastBilinearResize:
    """The native bilinear resize where :meth:`BilinearResize.exact_for` holds, else the reference."""

    def __init__(self, kernel: BilinearResize, reference: Callable) -> None:
        self.kernel, self.reference = kernel, reference

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x) if self.kernel.exact_for(x) else self.reference(x)

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None where the call is not one
        ``qc_resize_nhwc_*`` pass on ``x`` as it lies (inexact taps: the reference; other layouts)."""
        k = self.kernel
        if not k.exact_for(x) or k._layout(x) != "nhwc":
            return None
        out = alloc((x.shape[0], k.Ho, k.Wo, x.shape[1]), k.out_dtype).permute(0, 3, 1, 2)
        spec = k.step(x, out)
        return None if spec is None else (out, spec)


@_kernel(REFERENCE, "relu")
def _relu(k: KernelSpec) -> Callable:
    return fp.relu


@_kernel(REFERENCE, "relu6")
def _relu6(k: KernelSpec) -> Callable:
    top, T, name, out_dtype = int(k.attrs["max"]), k.tensors, k.name, k.out_dtype
    if "M" in T:  # its own output scale: requantize first (negatives stay <= 0 and clamp to 0)
        M, n = T["M"], T["n"]
        return lambda x: fp.requantize(x, M, n, out_dtype, op=name).clamp(0, top)
    return lambda x: x.clamp(0, top)


@_kernel(REFERENCE, "prelu", "leaky_relu")
def _prelu(k: KernelSpec) -> Callable:
    T, name, out_dtype = k.tensors, k.name, k.out_dtype
    Mp, np_, Mn, nn_ = T["Mp"], T["np"], T["Mn"], T["nn"]
    axis = k.attrs.get("axis")

    def prelu(x):
        pos = fp.requantize(x, Mp, np_, out_dtype, op=name)
        neg = fp.requantize(x, Mn, nn_, out_dtype, axis=axis, op=name)
        return torch.where(x >= 0, pos, neg)
    return prelu


def _pool_geometry(k: KernelSpec) -> tuple:
    a = k.attrs
    return a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"]


@_kernel(FAST, "max_pool2d")
def _fast_max_pool(k: KernelSpec) -> Callable:
    return _FastMaxPool(*_pool_geometry(k), k.ws, native=k.native)


@_kernel(REFERENCE, "max_pool2d")
def _max_pool(k: KernelSpec) -> Callable:
    ks, st, pad, dil, ceil = _pool_geometry(k)
    return lambda x: fp.int_max_pool2d(x, ks, st, pad, dil, ceil)


@_kernel(REFERENCE, "avg_pool2d")
def _avg_pool(k: KernelSpec) -> Callable:
    a, name, out_dtype = k.attrs, k.name, k.out_dtype
    ks, st, pad = tuple(a["kernel_size"]), tuple(a["stride"]), tuple(a["padding"])
    M, n = k.tensors["M"], k.tensors["n"]
    kk = ks[0] * ks[1]
    amax = _AMAX[k.in_specs[0].dtype]

    def avg_pool(x):
        # fixed_point.int_avg_pool2d with its multipliers precomputed (same checks, same sums)
        if fp._extreme(x) * kk >= _F64_EXACT:
            raise fp.AccumulatorOverflow(name, fp._extreme(x) * kk, _F64_EXACT, what="window sum")
        s = F.avg_pool2d(x.to(torch.int64).double(), ks, st, pad, ceil_mode=False, count_include_pad=True,
                         divisor_override=1).to(torch.int64)
        if amax * kk >= _I32:  # the int32 range of the window sums is not proven: check it
            fp.check_accumulator(s, 32, op=name)
        return fp.requantize(s, M, n, out_dtype, op=name)
    return avg_pool


@_kernel(REFERENCE, "global_avg_pool")
def _global_avg_pool(k: KernelSpec) -> Callable:
    a, name, out_dtype = k.attrs, k.name, k.out_dtype
    s_in, s_out, keep = a["in_scale"], a["out_scale"], a["keepdim"]
    amax = _AMAX[k.in_specs[0].dtype]

    def gap(x):
        if amax * x.shape[-1] * x.shape[-2] >= _I32:  # int32 range of the sums not proven: check it
            fp.check_accumulator(x.to(torch.int64).sum(dim=(-2, -1)), 32, op=name)
        y = fp.int_global_avg_pool(x, s_in, s_out, out_dtype, mult_bits=qnn.MULT_BITS,
                                   max_shift=qnn.MAX_SHIFT, op=name)
        return y if keep else y.reshape(y.shape[:-2])  # as QuantizedAvgPool (mean without keepdim)
    return gap


@_kernel(FAST, "global_avg_pool")
def _fast_global_avg_pool(k: KernelSpec) -> Callable:
    return _FastGlobalAvgPool(k)


class _FastGlobalAvgPool:
    """The reference's sums in int32 where ``amax * H * W < 2**31`` proves them in range, its
    ``(M, n)`` computed once per spatial size.  With the native kernels, a channels-last input
    (the native GEMM's output) is one native pass, sums and requantization
    (:func:`~qcompiler.native.kernels.global_avg_pool_nhwc`, also a plan step); any other layout
    is summed by torch in place and requantized by one :class:`~qcompiler.native.kernels.Requant`
    pass (the int32 sums are exact in float64; ``fp.requantize`` costs 0.15-0.3 ms in small torch
    ops), or by ``fp.requantize`` without the native kernels.  Both requantize as
    ``qc_requant_*`` does.  Else the reference."""

    def __init__(self, k: KernelSpec) -> None:
        a = k.attrs
        self.name, self.out_dtype, self.native = k.name, k.out_dtype, k.native
        self.s_in, self.s_out, self.keep = a["in_scale"], a["out_scale"], a["keepdim"]
        self.amax = _AMAX[k.in_specs[0].dtype]
        self.in_storage = _STORAGE.get(k.in_specs[0].dtype)
        self.st = _STORAGE.get(k.out_dtype)
        self.lo, self.hi = fp.qrange(k.out_dtype)
        self.ref = _global_avg_pool(k)
        self._params: dict[int, tuple[int, int]] = {}
        self._requants: dict[tuple[int, int], Optional[Requant]] = {}

    def _mn(self, hw: int) -> tuple[int, int]:
        if hw not in self._params:
            self._params[hw] = fp.global_avg_pool_params(hw, self.s_in, self.s_out, mult_bits=qnn.MULT_BITS,
                                                         max_shift=qnn.MAX_SHIFT)
        return self._params[hw]

    def _fits(self, hw: int) -> bool:
        """Whether the native requantization of these sums is exact (an int64 product, a shift <= 62)."""
        M, n = self._mn(hw)
        return (self.native and self.st in (torch.int8, torch.int16) and 0 <= n <= 62
                and self.amax * hw * abs(M) < 1 << 62)

    def _requant(self, hw: int, C: int) -> Optional[Requant]:
        if (hw, C) not in self._requants:
            M, n = self._mn(hw)
            self._requants[(hw, C)] = Requant(
                torch.full((C,), M, dtype=torch.int64), torch.full((C,), n, dtype=torch.int64), self.lo, self.hi,
                self.amax * hw) if self._fits(hw) else None
        return self._requants[(hw, C)]

    @staticmethod
    def _hw(x: torch.Tensor) -> int:
        return x.shape[-1] * x.shape[-2] if x.dim() >= 3 else 0

    def _exact_int32(self, x: torch.Tensor) -> bool:
        """Whether the int32 sums are proven (for the declared input type only) and not empty."""
        hw = self._hw(x)
        return bool(hw) and self.amax * hw < _I32 and x.dtype == self.in_storage

    def _nhwc(self, x: torch.Tensor) -> bool:
        """After :meth:`_exact_int32`: whether the call is one native pass (a nonempty channels-last
        int8/int16 input, a requantization :meth:`_fits`)."""
        return (x.dim() == 4 and x.dtype in (torch.int8, torch.int16) and x.numel() > 0
                and x.is_contiguous(memory_format=torch.channels_last) and self._fits(self._hw(x)))

    def _shaped(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(*y.shape, 1, 1) if self.keep else y  # as QuantizedAvgPool (mean without keepdim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._exact_int32(x):
            return self.ref(x)
        hw = self._hw(x)
        M, n = self._mn(hw)
        if self._nhwc(x):
            return self._shaped(global_avg_pool_nhwc(x, M, n, self.lo, self.hi,
                                                     torch.empty(x.shape[:2], dtype=self.st)))
        sums = x.sum(dim=(-2, -1), dtype=torch.int32)
        rq = self._requant(hw, sums.shape[-1]) if sums.numel() else None
        if rq is None:
            y = fp.requantize(sums, M, n, self.out_dtype, op=self.name)
        else:
            y = torch.empty(sums.shape, dtype=self.st)
            rq(sums.to(torch.float64).reshape(-1, sums.shape[-1]), y.view(-1, sums.shape[-1]))
        return self._shaped(y)

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None where the call is not the
        native pass."""
        if not (self._exact_int32(x) and self._nhwc(x)):
            return None
        M, n = self._mn(self._hw(x))
        out = alloc(x.shape[:2], self.st)
        return self._shaped(out), global_avg_pool_nhwc_step(x, M, n, self.lo, self.hi, out)


@_kernel(REFERENCE, "resize_nearest", "resize_bilinear")
def _resize(k: KernelSpec) -> Callable:
    a, out_dtype = k.attrs, k.out_dtype
    size, ratio = tuple(a["size"]), a["in_scale"] / a["out_scale"]
    lo, hi = fp.qrange(out_dtype)
    st = fp.storage_dtype(out_dtype)
    # as qcompiler.nn.quantized.QuantizedResize
    options = {"mode": "nearest"} if k.op.kind == "resize_nearest" else \
        {"mode": "bilinear", "align_corners": bool(a["align_corners"])}

    def resize(x):
        y = F.interpolate(x.double(), size=size, **options)
        return torch.round(y * ratio).clamp(lo, hi).to(st)
    return resize


@_kernel(REFERENCE, "lut")
def _lut(k: KernelSpec) -> Callable:
    table, in_dtype = k.tensors["table"], k.attrs["in_dtype"]
    return lambda x: fp.apply_lut(x, table, in_dtype)


# layout kinds: op kind -> kernel builder from the op's attrs (no arithmetic, exact on any kernel set)
_LAYOUT: dict[str, Callable[[dict], Callable]] = {
    "identity": lambda a: (lambda x: x),
    "reshape": lambda a: (lambda x, shp=tuple(a["shape"]): x.reshape(shp)),
    "flatten": lambda a: (lambda x, s=int(a["start_dim"]), e=int(a["end_dim"]): torch.flatten(x, s, e)),
    "squeeze": lambda a: ((lambda x: x.squeeze()) if a["dim"] is None else (lambda x, d=int(a["dim"]): x.squeeze(d))),
    "unsqueeze": lambda a: (lambda x, d=int(a["dim"]): x.unsqueeze(d)),
    "permute": lambda a: (lambda x, dims=tuple(a["dims"]): x.permute(dims)),
    "transpose": lambda a: (lambda x, d0=int(a["dim0"]), d1=int(a["dim1"]): x.transpose(d0, d1)),
    "getitem": lambda a: (lambda x, idx=decode_index(a["index"]): x[idx]),
}


class _LayoutKernel:
    """A layout op's kernel (``fn``, no arithmetic), and its ``plan_view``: in a plan whose buffer
    holds the input, the op's value where it is a view of that buffer (then it stays one as the
    buffer is rewritten: the op needs no step, and its readers no copy; backends/bpu/plan.py)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, x: Any) -> Any:
        return self.fn(x)

    def plan_view(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        v = self.fn(x)
        shares = isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return v if shares else None  # (a copy, e.g. a reshape of strided memory, would go stale)


for _kind, _make in _LAYOUT.items():
    _kernel(REFERENCE, _kind)(lambda k, make=_make: _LayoutKernel(make(k.attrs)))


def _with_constant(op: BpuOp, binary: Callable) -> Callable:
    """A binary kernel; with one input, the op's tensor 'constant' is the other operand
    (at position attrs['constant_index'])."""
    if "constant" not in op.tensors:
        return binary
    const = op.tensors["constant"]
    if int(op.attrs["constant_index"]) == 0:
        return lambda x: binary(const, x)
    return lambda x: binary(x, const)


def _dequantize(spec: ValueSpec) -> Callable:
    """float32(q) * float32(scale), as QTensor.dequantize."""
    if spec.per_channel:
        scales = torch.tensor(spec.scale, dtype=torch.float64).to(torch.float32)

        def deq_pc(q):
            shape = [1] * q.dim()
            shape[spec.axis % q.dim()] = -1
            return q.to(torch.float32) * scales.view(shape)
        return deq_pc
    s = torch.tensor(spec.scale, dtype=torch.float32)
    return lambda q: q.to(torch.float32) * s


def _relu6_or_relu(y: torch.Tensor, act: Optional[str], top: Optional[int]) -> torch.Tensor:
    if act == "relu":
        return fp.relu(y)
    if act == "relu6":
        return y.clamp(0, top)
    return y


def _fixed_point_weight_layer(op: BpuOp, name: str) -> Callable:
    """conv2d / conv_transpose2d / linear exactly as QuantizedWeightLayer.forward."""
    a, T = op.attrs, op.tensors
    w, bias = T["weight"], T.get("bias")
    kind = op.kind
    axis = -1 if kind == "linear" else 1
    hp, act, top = a["high_precision"], a["act"], a.get("act_max")
    out_dtype = a["out_dtype"]
    if kind == "conv2d":
        st, pad, dil, g = tuple(a["stride"]), tuple(a["padding"]), tuple(a["dilation"]), int(a["groups"])

        def accumulate(q):
            return fp.int_conv2d(q, w, bias, st, pad, dil, g, op=name)
    elif kind == "linear":
        def accumulate(q):
            return fp.int_linear(q, w, bias, op=name)
    else:
        geom = {"stride": tuple(a["stride"]), "padding": tuple(a["padding"]), "dilation": tuple(a["dilation"]),
                "groups": int(a["groups"]), "output_padding": tuple(a["output_padding"])}

        def accumulate(q):
            return qnn._int_conv_transpose2d(q, w, bias, geom, name)
    if hp:
        return lambda q: fp.check_accumulator(accumulate(q), 32, op=name).to(torch.int32)
    M, n = T["M"], T["n"]
    if a["with_add"]:
        Mb, nb = T["Mb"], T["nb"]

        def layer_add(q, other):
            acc = fp.check_accumulator(accumulate(q), 32, op=name)
            y = qnn._add_per_channel(acc, M, n, other, Mb, nb, out_dtype, axis, name)
            return _relu6_or_relu(y, act, top)
        return layer_add

    def layer(q):
        acc = fp.check_accumulator(accumulate(q), 32, op=name)
        return _relu6_or_relu(fp.requantize(acc, M, n, out_dtype, axis=axis, op=name), act, top)
    return layer


# ---------------------------------------------------------------------------- fast kernels

# elements of one output tile: the tile's GEMM result and epilogue temporaries (float64: 8 MiB)
# stay in the last-level cache between the passes over them, and a layer is a few tiles, so
# the per-call overhead of the ~10 torch ops per tile stays small (measured: 2**18..2**20 similar
# at batch 8, smaller tiles are slower)
_TILE = 1 << 20
# bytes of one integer im2col tile
_COL_BYTES = 8 << 20


_INT8_GEMM: Optional[bool] = None


def int8_gemm_available() -> bool:
    """True when ``torch._int_mm`` computes int8 x int8 -> int32 GEMMs exactly on this machine.

    Checked once per process on saturation-prone operands (products of
    127/-128 in every sign pattern: a kernel built on ``vpmaddubsw``, whose
    int16 pair sums saturate, fails it) over the shapes the lowering emits
    (1-sized M, K and N included), each operand in every layout the kernels
    hand over, through :func:`_int_mm` (the kernels' only entry), against
    exact int64 products.  With non-saturating int32 arithmetic (VNNI, AMX) the
    result is exact whenever the true sum fits int32 (two's complement
    wrap-around cannot change an in-range result), which the fast kernels
    prove from the weights before using it.
    """
    global _INT8_GEMM
    if _INT8_GEMM is None:
        _INT8_GEMM = _int8_self_test()
    return _INT8_GEMM


def _gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) in a layout ``torch._int_mm`` reads correctly for every shape: row-major with
    unit column stride and a row stride of at least ``max(1, columns)``; else a row-major copy.

    Contiguity is not enough: torch calls ``w.t()`` of a ``(10, 1)`` weight contiguous with
    strides ``(1, 1)``, and ``_int_mm`` then reads the wrong memory (size-1 dims make strides
    ambiguous to its transpose detection).
    """
    if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]):
        return t
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _int_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` (int8 x int8 -> int32) with every operand in a :func:`_gemm_operand` layout.

    The only way the fast kernels call ``torch._int_mm``; :func:`int8_gemm_available` checks
    exactly this function.
    """
    target = _gemm_operand(out)
    torch._int_mm(_gemm_operand(a), _gemm_operand(b), out=target)
    if target is not out:
        out.copy_(target)
    return out


# (M, K, N) of the self-test: the shapes the lowering emits, 1-sized dims included (a linear
# with one input or one output feature, one row, a 1x1 conv of one channel, one output position)
_SELF_TEST_SHAPES = ((1, 1, 1), (1, 7, 3), (17, 1, 10), (17, 5, 1), (1, 5, 1), (3, 1, 1), (1, 1, 9),
                     (5, 64, 17), (64, 576, 300), (130, 1152, 49), (33, 2304, 64))


def _layouts(t: torch.Tensor) -> list[torch.Tensor]:
    """The same values as ``t`` in the layouts the kernels hand over: row-major, the transpose
    of a transpose, a column slice of a wider matrix, and (for 1-sized dims) odd strides."""
    R, C = t.shape
    wide = torch.zeros(R, C + 5, dtype=t.dtype)
    wide[:, 2:C + 2] = t
    out = [t.contiguous(), t.t().contiguous().t(), wide[:, 2:C + 2]]
    if R == 1 or C == 1:  # e.g. (10, 1).t().contiguous(): shape (1, 10), strides (1, 1)
        out.append(torch.as_strided(t.contiguous().clone(), (R, C), (1, 1)))
    return out


def _int8_self_test() -> bool:
    if getattr(torch, "_int_mm", None) is None:
        return False
    g = torch.Generator().manual_seed(20240605)
    try:
        for M, K, N in _SELF_TEST_SHAPES:
            for va, vb in ((127, -128), (-128, 127), (-128, -128), (127, 127), (None, None)):
                if va is None:
                    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
                    b = torch.randint(-128, 128, (K, N), dtype=torch.int8, generator=g)
                else:
                    a = torch.full((M, K), va, dtype=torch.int8)
                    b = torch.full((K, N), vb, dtype=torch.int8)
                    a[:, 1::3] = -va if va != -128 else 127
                want = a.to(torch.int64) @ b.to(torch.int64)
                small = M * K * N <= 4096  # every layout combination; large GEMMs test the arithmetic
                outs = (torch.empty(M, N, dtype=torch.int32),) + (
                    (torch.empty(N, M, dtype=torch.int32).t(),) if small else ())
                for aa in _layouts(a) if small else (a,):
                    for bb in _layouts(b):
                        for out in outs:
                            got = _int_mm(aa, bb, out)
                            if not torch.equal(got.to(torch.int64), want):
                                return False
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _gemm_mode() -> str:
    """float32 GEMMs are exact below 2**24 only at IEEE float32 precision (see fixed_point)."""
    return "f32" if fp._f32_gemm_is_ieee() else "f64"


def _chunks(l1: np.ndarray, amax: int, limit: int) -> Optional[list[tuple[int, int]]]:
    """Contiguous input-channel ranges whose partial sums stay below ``limit``.

    ``l1[o, c]`` is ``sum |w[o, c, ...]|``; a chunk ``[c0, c1)`` is safe when
    ``amax * max_o sum_{c0 <= c < c1} l1[o, c] < limit`` (every partial sum of
    the chunk's products, in any order, is bounded by that).  None if a single
    channel is already too large.
    """
    C = l1.shape[1]
    out, c0, acc = [], 0, np.zeros(l1.shape[0], dtype=np.int64)
    for c in range(C):
        nxt = acc + l1[:, c]
        if int(nxt.max(initial=0)) * amax < limit:
            acc = nxt
            continue
        if c == c0:
            return None
        out.append((c0, c))
        c0, acc = c, l1[:, c].astype(np.int64)  # (l1 may be a narrow type: the sums are int64)
        if int(acc.max(initial=0)) * amax >= limit:
            return None
    out.append((c0, C))
    return out


class _Epilogue:
    """bias, int32 check, requantize (+ fused add) (+ relu/relu6) of one tile of an exact accumulator.

    A tile is ``(channels, columns)`` (``rows=True``, conv: output channels
    ``c0:c1`` on dim 0) or ``(rows, O)`` (``rows=False``, linear: channels on
    the last dim).  The accumulator holds exact integers in float32/float64;
    the result is written (as integers) into ``out``.  See the module
    docstring for why the float64 evaluation is exact.
    """

    def __init__(self, op: BpuOp, name: str, rows: bool, other_spec: Optional[ValueSpec], ws: _Workspace) -> None:
        a, T = op.attrs, op.tensors
        self.name, self.ws, self.rows = name, ws, rows
        O = T["weight"].shape[0]
        shape = (O, 1) if rows else (1, O)
        bias = T.get("bias")
        self.bias_i64 = None if bias is None else bias.to(torch.int64)
        self.bias = None if bias is None else bias.to(torch.float64).view(shape)
        self.bias_i32 = None if bias is None else bias.to(torch.int32).view(shape)
        self.bias_f32 = None if bias is None else bias.to(torch.float32).view(shape)  # exact below 2**24
        self.max_bias = 0 if bias is None else int(bias.to(torch.int64).abs().max())
        self.hp = bool(a["high_precision"])
        if self.hp:
            return
        self.out_dtype = a["out_dtype"]
        lo, hi = fp.qrange(self.out_dtype)
        act = a["act"]
        if act == "relu":
            lo = 0
        elif act == "relu6":
            lo, hi = 0, min(hi, int(a["act_max"]))
        self.lo, self.hi = lo, hi
        self.M, self.n = T["M"].to(torch.int64), T["n"].to(torch.int64)
        self.f = torch.ldexp(self.M.double(), -self.n).view(shape)  # M * 2**-n, exact in float64
        self.with_add = bool(a["with_add"])
        b = _OUT_BITS[self.out_dtype]
        t2max = 0.0
        if self.with_add:
            self.Mb, self.nb = int(T["Mb"]), int(T["nb"])
            self.f2 = math.ldexp(float(self.Mb), -self.nb)  # exact
            t2max = _AMAX[other_spec.dtype] * abs(self.f2)
        # one rounding of (acc+bias)*f is harmless when n <= 53 - b; otherwise (or with a fused
        # add, which rounds a second time) flag elements within eps of a rounding boundary
        self.detect = self.with_add or int(self.n.max()) > 53 - b
        self.threshold = 0.5 - math.ldexp(2.0 ** b + 2.0 + t2max, -50)

    def _param(self, p: torch.Tensor, c0: int, c1: int, ndim: int) -> torch.Tensor:
        if not self.rows:
            return p
        p = p[c0:c1]
        return p if ndim == 2 else p.view((c1 - c0,) + (1,) * (ndim - 1))

    def tile(self, acc: torch.Tensor, out: torch.Tensor, c0: int, c1: int,
             other: Optional[torch.Tensor] = None, check: bool = False, bias_in_acc: bool = False) -> None:
        """``bias_in_acc``: the caller already added the bias exactly (int32, or float32 below 2**24)."""
        ws = self.ws
        t = ws.get("epi", acc.shape, torch.float64)
        t.copy_(acc)
        if self.bias is not None and not bias_in_acc:
            t.add_(self._param(self.bias, c0, c1, t.dim()))
        if check:  # the int32 range is not proven for this input: check the data
            fp.check_accumulator(t, 32, op=self.name)
        if self.hp:
            out.copy_(t)
            return
        t.mul_(self._param(self.f, c0, c1, t.dim()))
        if not self.detect:
            t.round_().clamp_(self.lo, self.hi)
            out.copy_(t)
            return
        if self.with_add:
            o = ws.get("epi_other", acc.shape, torch.float64)
            o.copy_(other)
            t.add_(o, alpha=self.f2)  # q_b * f2 is exact; one rounding of the sum
        y = ws.get("epi2", acc.shape, torch.float64)
        torch.round(t, out=y)
        flag = t.sub_(y).abs_() >= self.threshold
        if bool(flag.any()):
            self._exact(y, flag, acc, other, c0, bias_in_acc)
        y.clamp_(self.lo, self.hi)
        out.copy_(y)

    def _exact(self, y, flag, acc, other, c0, bias_in_acc=False) -> None:
        """Recompute the flagged elements in int64 with fixed_point's rounding (half to even)."""
        idx = flag.nonzero(as_tuple=True)
        c = idx[0] + c0 if self.rows else idx[-1]
        v = acc[idx].to(torch.int64)
        if self.bias_i64 is not None and not bias_in_acc:
            v = v + self.bias_i64[c]
        prod = v * self.M[c]  # |acc| < 2**31 and |M| < 2**31: no int64 overflow
        if self.with_add:
            r = fp.round_scaled_sum(prod, self.n[c], other[idx].to(torch.int64) * self.Mb, self.nb)
        else:
            r = fp.rounding_shift(prod, self.n[c])
        y[idx] = r.to(torch.float64)


class _FastConv:
    """conv2d: exact integer/float GEMMs on im2col tiles that stay in cache, then the float64 epilogue.

    The input is staged once as integers (zero-padded, channel-major).  Each
    tile of output positions (a block of images, or of rows of one image)
    gathers its im2col columns in the integer type (rows ordered (c, i, j)
    like the weight), multiplies them by the weight -- one int8 x int8 ->
    int32 GEMM when verified exact (see :func:`int8_gemm_available`), else
    float32 GEMMs over input-channel chunks whose partial sums stay below
    2**24 (float64 when no chunking works) -- and runs the epilogue on the
    tile.  1x1 convs without padding read the input directly.  Depthwise
    convs multiply-add the shifted windows per channel block (float32).
    Grouped (non-depthwise) convs use the fixed_point kernels.
    """

    def __init__(self, op: BpuOp, in_specs: list[ValueSpec], name: str, ws: _Workspace, int8_gemm: bool) -> None:
        a, T = op.attrs, op.tensors
        self.name, self.ws = name, ws
        w = T["weight"]
        self.w_i8 = w
        O, Cg, kh, kw = w.shape
        self.O, self.Cg, self.kh, self.kw = O, Cg, kh, kw
        self.stride, self.padding = tuple(a["stride"]), tuple(a["padding"])
        self.dilation, self.groups = tuple(a["dilation"]), int(a["groups"])
        self.in_dtype = in_specs[0].dtype
        self.static_amax = _AMAX[self.in_dtype] if self.in_dtype == "qint8" else None
        self.l1 = abs_sums(w, (2, 3)).numpy()  # (O, Cg)
        self.l1_row = int(self.l1.sum(axis=1).max(initial=0))  # max_o sum |w_o|
        self.depthwise = Cg == 1 and self.groups == O
        self.grouped = self.groups > 1 and not self.depthwise
        self.taps = [(i, j) for i in range(kh) for j in range(kw)]
        # int8 x int8 -> int32 GEMM: exact when the true sums fit int32 (wrap-around arithmetic
        # then gives the exact result); proven statically from the L1 bound
        self.int8 = (int8_gemm and not self.depthwise and not self.grouped and self.in_dtype == "qint8"
                     and _AMAX["qint8"] * self.l1_row < _I32)
        self.w_mat = w.reshape(O, -1).contiguous()  # (O, Cg*kh*kw), K ordered (c, i, j)
        self._plans: dict = {}
        self._fw: dict = {}
        self.with_add = bool(a["with_add"])
        self.hp = bool(a["high_precision"])
        self.out_storage = torch.int32 if self.hp else _STORAGE[a["out_dtype"]]
        self.epi = _Epilogue(op, name, True, in_specs[1] if self.with_add else None, ws)
        self.fallback = _fixed_point_weight_layer(op, name)

    def _amax(self, x: torch.Tensor) -> int:
        if self.static_amax is not None:
            return self.static_amax
        return 1 << max(fp._extreme(x), 1).bit_length()  # a power of two above max|x|: few plans

    def _plan(self, amax: int):
        """(dtype, chunks) of the float GEMMs for inputs with |x| <= amax, or None (fixed_point)."""
        mode = _gemm_mode()
        key = (amax, mode)
        if key not in self._plans:
            plan = None
            if mode == "f32":
                if self.depthwise:
                    plan = (torch.float32, ((0, 1),)) if amax * self.l1_row < _F32_EXACT else None
                else:
                    ch = _chunks(self.l1, amax, _F32_EXACT)
                    plan = (torch.float32, tuple(ch)) if ch is not None else None
            if plan is None and amax * self.l1_row < _F64_EXACT:
                plan = (torch.float64, ((0, self.Cg),))
            self._plans[key] = plan
        return self._plans[key]

    def _float_weights(self, dtype, chunks):
        key = (dtype, chunks)
        if key not in self._fw:
            kk = self.kh * self.kw
            wf = self.w_mat.to(dtype)
            if self.depthwise:
                self._fw[key] = [wf[:, t:t + 1].contiguous() for t in range(kk)]  # per tap (C, 1)
            else:
                self._fw[key] = [(wf[:, c0 * kk:c1 * kk].contiguous(), c0 * kk, c1 * kk) for c0, c1 in chunks]
        return self._fw[key]

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.grouped or x.dim() != 4:
            return self.fallback(x) if other is None else self.fallback(x, other)
        amax = self._amax(x)
        plan = None if self.int8 else self._plan(amax)
        if plan is None and not self.int8:
            return self.fallback(x) if other is None else self.fallback(x, other)
        N = x.shape[0]
        st, pad, dil, Ho, Wo = fp._conv_geometry(
            x.shape, self.w_i8.shape, self.stride, self.padding, self.dilation, self.groups, self.name)
        check = amax * self.l1_row + self.epi.max_bias >= _I32
        out = torch.empty(self.O, N, Ho, Wo, dtype=self.out_storage)
        ot = None if other is None else other.transpose(0, 1)  # (O, N, Ho, Wo) view
        if self.depthwise:
            self._depthwise(x, plan[0], out, ot, check, st, pad, dil, Ho, Wo)
        else:
            self._gemm_conv(x, plan, out, ot, check, st, pad, dil, Ho, Wo)
        return out.permute(1, 0, 2, 3)

    def _padded(self, x: torch.Tensor, pad) -> torch.Tensor:
        """x as integers (C, N, H+2ph, W+2pw) with a zero border (a workspace view)."""
        N, C, H, W = x.shape
        ph, pw = pad
        if ph == pw == 0:
            return x.transpose(0, 1)
        xp = self.ws.get("xpad", (C, N, H + 2 * ph, W + 2 * pw), x.dtype)
        xp[:, :, :ph].zero_()
        xp[:, :, ph + H:].zero_()
        xp[:, :, ph:ph + H, :pw].zero_()
        xp[:, :, ph:ph + H, pw + W:].zero_()
        xp[:, :, ph:ph + H, pw:pw + W].copy_(x.transpose(0, 1))
        return xp

    def _gemm(self, col: torch.Tensor, plan, width: int) -> torch.Tensor:
        """(O, width) exact accumulator (int32 or float) of weight @ col."""
        ws = self.ws
        if plan is None:  # int8 GEMM
            acc = ws.get("acc", (self.O, width), torch.int32)
            _int_mm(self.w_mat, col, acc)
            return acc
        dtype, chunks = plan
        xt = ws.get("xtile", (col.shape[0], width), dtype)
        xt.copy_(col)
        wts = self._float_weights(dtype, chunks)
        acc = ws.get("acc", (self.O, width), dtype)
        if len(wts) == 1:
            torch.mm(wts[0][0], xt, out=acc)
            return acc
        acc64 = ws.get("acc64", (self.O, width), torch.float64)
        for ci, (wm, r0, r1) in enumerate(wts):
            torch.mm(wm, xt[r0:r1], out=acc)
            if ci == 0:
                acc64.copy_(acc)
            else:
                acc64.add_(acc)
        return acc64

    def _add_bias(self, acc: torch.Tensor, check: bool) -> bool:
        """Add the bias to an int32 accumulator in place when acc + bias is proven in range."""
        if acc.dtype != torch.int32 or check or self.epi.bias_i32 is None:
            return False
        acc.add_(self.epi.bias_i32)
        return True

    def _gemm_conv(self, x, plan, out, ot, check, st, pad, dil, Ho, Wo) -> None:
        N, C = x.shape[:2]
        O, kh, kw = self.O, self.kh, self.kw
        (sh, sw), (dh, dw) = st, dil
        K = C * kh * kw
        ws = self.ws
        epi = self.epi
        out2 = out.view(O, -1)
        if kh == kw == 1 and pad == (0, 0):  # pointwise: the (strided) input is the im2col matrix
            src = x[:, :, ::sh, ::sw] if (sh, sw) != (1, 1) else x
            src = src.transpose(0, 1)
            if not src.is_contiguous():
                src = ws.get("stage", src.shape, x.dtype).copy_(src)
            src = src.reshape(C, -1)
            G = src.shape[1]
            other2 = None if ot is None else ot.reshape(O, -1)
            T = max(256, _TILE // O)
            for p0 in range(0, G, T):
                p1 = min(G, p0 + T)
                acc = self._gemm(src[:, p0:p1], plan, p1 - p0)
                epi.tile(acc, out2[:, p0:p1], 0, O, None if other2 is None else other2[:, p0:p1], check,
                         self._add_bias(acc, check))
            return
        xp = self._padded(x, pad)
        HW = Ho * Wo
        T = max(Wo, min(_TILE // O, _COL_BYTES // K))  # output positions per tile
        if HW <= T:
            tiles = [(n, min(N, n + T // HW), 0, Ho) for n in range(0, N, T // HW)]
        else:
            rb = max(1, T // Wo)
            tiles = [(n, n + 1, r, min(Ho, r + rb)) for n in range(N) for r in range(0, Ho, rb)]
        for n0, n1, r0, r1 in tiles:
            nb, rb = n1 - n0, r1 - r0
            width = nb * rb * Wo
            col = ws.get("col", (C, kh * kw, nb, rb, Wo), x.dtype)
            for t, (i, j) in enumerate(self.taps):
                col[:, t].copy_(xp[:, n0:n1, r0 * sh + i * dh: (r1 - 1) * sh + i * dh + 1: sh,
                                   j * dw: j * dw + sw * (Wo - 1) + 1: sw])
            acc = self._gemm(col.view(K, width), plan, width)
            o = out[:, n0:n1, r0:r1].reshape(O, width)  # a view (rows or whole images)
            other = None if ot is None else ot[:, n0:n1, r0:r1].reshape(O, width)
            epi.tile(acc, o, 0, O, other, check, self._add_bias(acc, check))

    def _depthwise(self, x, dtype, out, ot, check, st, pad, dil, Ho, Wo) -> None:
        """Per block of channels: cast the padded block, multiply-add its taps, run the epilogue."""
        N, C, H, W = x.shape
        (sh, sw), (ph, pw), (dh, dw) = st, pad, dil
        Hp, Wp = H + 2 * ph, W + 2 * pw
        ws = self.ws
        xp = self._padded(x, pad)  # (C, N, Hp, Wp) integers
        wts = self._float_weights(dtype, ((0, 1),))
        # stride 1: shifted windows of the flattened padded block (positions between rows and
        # images are computed and dropped; not when the int32 range must be checked on the data)
        flat = (sh, sw) == (1, 1) and not check
        bias = self.epi.bias_f32
        fold = (bias is not None and dtype == torch.float32 and not check
                and self.static_amax is not None and self.static_amax * self.l1_row + self.epi.max_bias < _F32_EXACT)
        per = N * Hp * Wp
        cb = max(1, _TILE // per)
        offs = [i * dh * Wp + j * dw for i, j in self.taps]
        # strided: split the block into its sh*sw phases (unit-stride windows for every tap)
        phase_hw = [((Hp - a + sh - 1) // sh, (Wp - b + sw - 1) // sw) for a in range(sh) for b in range(sw)]
        for c0 in range(0, C, cb):
            c1 = min(C, c0 + cb)
            if flat or (sh, sw) == (1, 1):
                xb = ws.get("xtile", (c1 - c0, N, Hp, Wp), dtype)
                xb.copy_(xp[c0:c1])
            else:
                phases = {}
                for k, (a, b) in enumerate((a, b) for a in range(sh) for b in range(sw)):
                    ph_ = ws.get(f"phase{k}", (c1 - c0, N) + phase_hw[k], dtype)
                    ph_.copy_(xp[c0:c1, :, a::sh, b::sw])
                    phases[(a, b)] = ph_
            if flat:
                fb = xb.view(c1 - c0, -1)
                cols = per - offs[-1]
                acc = ws.get("acc", (c1 - c0, per), dtype)
                part = acc[:, :cols]
                for k, off in enumerate(offs):
                    if k == 0 and fold:
                        torch.addcmul(bias[c0:c1], fb[:, off:off + cols], wts[k][c0:c1], out=part)
                    elif k == 0:
                        torch.mul(fb[:, off:off + cols], wts[k][c0:c1], out=part)
                    else:
                        part.addcmul_(fb[:, off:off + cols], wts[k][c0:c1])
                acc = acc.view(c1 - c0, N, Hp, Wp)[:, :, :Ho, :Wo]
            else:
                acc = ws.get("acc", (c1 - c0, N, Ho, Wo), dtype)
                for k, (i, j) in enumerate(self.taps):
                    if (sh, sw) == (1, 1):
                        xv = xb[:, :, i * dh: i * dh + Ho, j * dw: j * dw + Wo]
                    else:  # row i*dh + sh*r lies in phase (i*dh % sh) at row i*dh // sh + r
                        a, b = i * dh % sh, j * dw % sw
                        xv = phases[(a, b)][:, :, i * dh // sh: i * dh // sh + Ho, j * dw // sw: j * dw // sw + Wo]
                    wv = wts[k][c0:c1].view(-1, 1, 1, 1)
                    if k == 0 and fold:
                        torch.addcmul(bias[c0:c1].view(-1, 1, 1, 1), xv, wv, out=acc)
                    elif k == 0:
                        torch.mul(xv, wv, out=acc)
                    else:
                        acc.addcmul_(xv, wv)
            # (the epilogue's first copy drops the extra positions of the flat form)
            self.epi.tile(acc, out[c0:c1], c0, c1, None if ot is None else ot[c0:c1], check, fold)


def _act_clamp(a: dict) -> tuple[int, int]:
    """The output range of a weight layer: its integer type's, narrowed by a fused relu / relu6."""
    lo, hi = fp.qrange(a["out_dtype"])
    if a["act"] == "relu":
        lo = 0
    elif a["act"] == "relu6":
        lo, hi = 0, min(hi, int(a["act_max"]))  # (program_check refuses a larger act_max in artifacts)
    return lo, hi


class _NativeDepthwiseLayer:
    """Depthwise int8 conv2d (groups == in == out channels) in one native pass: int32 accumulation
    and the integer requantization per output position (:class:`~qcompiler.native.kernels.DepthwiseConv`),
    channels-last in and out.  Built for qint8 inputs without a fused add or a high-precision
    output, when the int32 bound is proven (``build`` returns None otherwise)."""

    def __init__(self, kernel: DepthwiseConv, fallback: Callable) -> None:
        self.kernel, self.fallback = kernel, fallback

    @staticmethod
    def build(k: KernelSpec) -> Optional["_NativeDepthwiseLayer"]:
        a, T = k.attrs, k.tensors
        w, bias = T["weight"], T.get("bias")
        C = w.shape[0]
        if (not k.native or k.in_specs[0].dtype != "qint8" or a["high_precision"] or a["with_add"]
                or a["out_dtype"] not in ("qint8", "qint16") or int(a["groups"]) != C or w.shape[1] != 1
                or not 0 <= int(T["n"].min()) <= int(T["n"].max()) <= 62):
            return None
        bound = DepthwiseConv.acc_bound(w, bias)  # what DepthwiseConv checks, tested here to fall back quietly
        if bound >= _I32 or bound * int(T["M"].to(torch.int64).abs().max()) >= 1 << 62:
            return None
        lo, hi = _act_clamp(a)
        try:
            kernel = DepthwiseConv(w, bias, a["stride"], a["padding"], a["dilation"], T["M"], T["n"], lo, hi,
                                   _STORAGE[a["out_dtype"]])
        except ConfigError:  # a layer the kernel refuses (e.g. an empty clamp range): the reference runs it
            return None
        return _NativeDepthwiseLayer(kernel, _fixed_point_weight_layer(k.op, k.name))

    def _native(self, x: torch.Tensor) -> bool:
        return x.dim() == 4 and x.dtype == torch.int8 and x.shape[1] == self.kernel.C and min(
            self.kernel.out_size(x.shape[2], x.shape[3])) > 0

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None (the reference, a layout
        copy first, or the scalar kernel)."""
        xl = x.permute(0, 2, 3, 1)
        if not self._native(x) or not xl.is_contiguous():
            return None
        Ho, Wo = self.kernel.out_size(xl.shape[1], xl.shape[2])
        out = alloc((xl.shape[0], Ho, Wo, self.kernel.C), self.kernel.out_dtype)
        spec = self.kernel.step(xl, out)
        return None if spec is None else (out.permute(0, 3, 1, 2), spec)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._native(x):
            return self.fallback(x)
        xl = x.permute(0, 2, 3, 1).contiguous()  # NHWC memory (no copy when it is already)
        N, Ho, Wo = xl.shape[0], *self.kernel.out_size(xl.shape[1], xl.shape[2])
        # the chunk's lent workers (batch < threads) split the output rows natively
        parts = row_parts(part_budget(), N * Ho * Wo * self.kernel.C * self.kernel.kh * self.kernel.kw)
        return self.kernel(xl, parts).permute(0, 3, 1, 2)


def _window_in_padding(L: int, k: int, s: int, p: int, d: int) -> bool:
    """Along one dim of length ``L``: does an output position read only padding (every tap
    ``o*s - p + i*d`` outside ``[0, L)``)?"""
    Lo = (L + 2 * p - d * (k - 1) - 1) // s + 1
    return any(all(not 0 <= o * s - p + i * d < L for i in range(k)) for o in range(max(Lo, 0)))


class _OnednnConvLayer:
    """conv2d of int8 inputs as oneDNN's exact int8 convolution (float32 accumulator with the bias,
    channels-last) and the float64 epilogue :class:`NhwcRequant`; the output stays channels-last.

    Built only when both steps are proven exact for the layer (``build`` returns None otherwise):
    ``128 * max_o sum |w[o]| + max |bias| < 2**24`` over each chunk of input channels (several
    chunks only without groups) and ``NhwcRequant.applies``.
    """

    def __init__(self, conv: OnednnConv, epi: NhwcRequant, ws: _Workspace, fallback: Callable) -> None:
        self.conv, self.epi, self.ws, self.fallback = conv, epi, ws, fallback
        self._empty: dict[tuple[int, int], bool] = {}  # (H, W) -> _empty_window

    @staticmethod
    def build(k: KernelSpec) -> Optional["_OnednnConvLayer"]:
        a, T = k.attrs, k.tensors
        if k.in_specs[0].dtype != "qint8":
            return None
        w, bias = T["weight"], T.get("bias")
        groups = int(a["groups"])
        max_bias = 0 if bias is None else int(bias.to(torch.int64).abs().max())
        # input-channel chunks whose partial sums (+ the bias, added to the first) stay below 2**24
        l1 = abs_sums(w, (2, 3)).numpy()
        chunks = _chunks(l1, _AMAX["qint8"], F32_EXACT - max_bias)
        if chunks is None or (len(chunks) > 1 and groups != 1):
            return None
        if a["high_precision"]:
            epi = NhwcRequant(None, None, torch.int32)
        else:
            out_dtype = a["out_dtype"]
            add = (int(T["Mb"]), int(T["nb"])) if a["with_add"] else None
            other_amax = _AMAX[k.in_specs[1].dtype] if add else 0
            if not NhwcRequant.applies(T["n"], out_dtype, other_amax, add):
                return None
            lo, hi = _act_clamp(a)
            epi = NhwcRequant(T["M"], T["n"], _STORAGE[out_dtype], lo, hi, add,
                              acc_bound=_AMAX["qint8"] * int(l1.sum(axis=1).max(initial=0)) + max_bias,
                              native=k.native)
        conv = OnednnConv(w, bias, a["stride"], a["padding"], a["dilation"], groups, chunks, k.ws)
        return _OnednnConvLayer(conv, epi, k.ws, _fixed_point_weight_layer(k.op, k.name))

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 4 or x.dtype != torch.int8 or self._empty_window(x.shape[2], x.shape[3]):
            return self.fallback(x) if other is None else self.fallback(x, other)
        return self.epi(self.conv(x), other, self.ws)

    def _empty_window(self, H: int, W: int) -> bool:
        """True when some output position's window lies wholly in the zero padding (along H or W):
        oneDNN's int8 convolution gets such positions wrong (e.g. a 1x2 kernel of dilation 2
        with padding 1 on a 1-wide input), so the layer runs the exact fallback instead."""
        found = self._empty.get((H, W))
        if found is None:
            c = self.conv
            found = self._empty[(H, W)] = any(_window_in_padding(L, k, s, p, d) for L, k, s, p, d in zip(
                (H, W), c.w.shape[2:], c.stride, c.padding, c.dilation))
        return found


# torch's quantized max pool vectorizes over channels: faster than the running maximum from
# 64 channels (resnet18's 3x3 pool: 1.5 -> 0.3 ms), slower with 16-32 (unet's 2x2 pools)
_QUANTIZED_POOL_MIN_CHANNELS = 64


class _FastMaxPool:
    """Integer max pool as the running maximum of the kh*kw strided windows of a qmin-padded copy.

    Equal to ``F.max_pool2d``: torch requires padding <= kernel/2, so every
    window holds at least one real element, and a qmin pad never exceeds it.
    """

    def __init__(self, ks, st, pad, dil, ceil, ws: _Workspace, native: bool = False) -> None:
        self.k, self.s, self.p, self.d = fp._pair(ks), fp._pair(st), fp._pair(pad), fp._pair(dil)
        self.ceil, self.ws, self.native = bool(ceil), ws, native

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.is_floating_point():
            return fp.int_max_pool2d(x, self.k, self.s, self.p, self.d, self.ceil)
        N, C, H, W = x.shape
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.k, self.s, self.p, self.d
        if 2 * ph > kh or 2 * pw > kw:  # torch rejects this; let it say so
            return fp.int_max_pool2d(x, self.k, self.s, self.p, self.d, self.ceil)
        Ho, Wo = fp.max_pool_out_size(H, kh, sh, ph, dh, self.ceil), fp.max_pool_out_size(W, kw, sw, pw, dw, self.ceil)
        if self._native(x):
            # one native pass, channels-last in and out (3-6x torch's quantized pool on resnet18's and
            # unet's pools, docs/performance.md)
            return max_pool_nhwc(x, self.k, self.s, self.p, self.d, (Ho, Wo))
        if x.dtype == torch.int8 and x.numel() and C >= _QUANTIZED_POOL_MIN_CHANNELS:
            try:
                return self._qint8(x)
            except (AttributeError, NotImplementedError, RuntimeError):
                pass  # a torch without (this form of) quantized tensors: the running maximum below
        need_h, need_w = (Ho - 1) * sh + dh * (kh - 1) + 1, (Wo - 1) * sw + dw * (kw - 1) + 1
        Hp, Wp = max(need_h, H + ph), max(need_w, W + pw)
        xc = x.transpose(0, 1)  # channel-major, like the conv outputs
        if (ph, pw) == (0, 0) and (Hp, Wp) == (H, W):
            xp = xc
        else:
            lo = torch.iinfo(x.dtype).min
            xp = self.ws.get("pool_pad", (C, N, Hp, Wp), x.dtype)
            xp.fill_(lo)
            xp[:, :, ph:ph + H, pw:pw + W].copy_(xc)
        out = None
        for i in range(kh):
            for j in range(kw):
                win = xp[:, :, i * dh: i * dh + sh * (Ho - 1) + 1: sh, j * dw: j * dw + sw * (Wo - 1) + 1: sw]
                out = win.clone(memory_format=torch.contiguous_format) if out is None else \
                    torch.maximum(out, win, out=out)
        return out.permute(1, 0, 2, 3)

    def _out_hw(self, x: torch.Tensor) -> tuple[int, int]:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.k, self.s, self.p, self.d
        return (fp.max_pool_out_size(x.shape[2], kh, sh, ph, dh, self.ceil),
                fp.max_pool_out_size(x.shape[3], kw, sw, pw, dw, self.ceil))

    def _native(self, x: torch.Tensor) -> bool:
        """Whether the call is one native pass (a channels-last int8/int16 input torch would pool)."""
        (kh, kw), (ph, pw) = self.k, self.p
        return (self.native and x.dim() == 4 and x.dtype in (torch.int8, torch.int16) and 2 * ph <= kh
                and 2 * pw <= kw and x.is_contiguous(memory_format=torch.channels_last))

    def plan_step(self, x: torch.Tensor, alloc: Alloc = fresh) -> Optional[tuple]:
        """As ``_NativeGemmLayer.plan_step``: (the result, its step), or None where the call is not the
        native pass."""
        if not self._native(x):
            return None
        Ho, Wo = self._out_hw(x)
        out = alloc((x.shape[0], Ho, Wo, x.shape[1]), x.dtype).permute(0, 3, 1, 2)
        if not out.numel():
            return None
        return out, max_pool_nhwc_step(x, self.k, self.s, self.p, self.d, out)

    def _qint8(self, x: torch.Tensor) -> torch.Tensor:
        """torch's quantized max pool on the int8 values viewed as a qint8 tensor (scale 1, zero
        point 0, no copy): the same integer maxima (padding never wins, as above), in one
        vectorized channels-last pass.  torch warns that quantized tensors are deprecated."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_tensor_quantized_tensor(x, 1.0, 0)
            y = F.max_pool2d(q, self.k, self.s, self.p, self.d, ceil_mode=self.ceil)
        return y.int_repr()


class _FastLinear:
    """linear: one int8 GEMM (when verified exact) or float32 GEMMs over K chunks, tiled over rows."""

    def __init__(self, op: BpuOp, in_specs: list[ValueSpec], name: str, ws: _Workspace, int8_gemm: bool) -> None:
        T = op.tensors
        a = op.attrs
        self.name, self.ws = name, ws
        w = T["weight"]
        self.w_i8 = w
        self.O, self.K = w.shape
        self.in_dtype = in_specs[0].dtype
        self.static_amax = _AMAX[self.in_dtype] if self.in_dtype == "qint8" else None
        # (O, K) |w|: int16 for int8 weights (2 bytes a weight, not int64's 8), int64 otherwise (|-32768| of an
        # int16 weight); always a copy (to() of a weight already of the type is the weight, and abs_ would change it)
        self.l1 = w.to(torch.int16 if w.dtype == torch.int8 else torch.int64, copy=True).abs_().numpy()
        self.l1_row = int(self.l1.sum(axis=1).max(initial=0))  # (numpy sums int16 in int64)
        self.int8 = int8_gemm and self.in_dtype == "qint8" and _AMAX["qint8"] * self.l1_row < _I32
        self.wt_i8 = _gemm_operand(w.t())  # (K, O) row-major
        self._plans: dict = {}
        self._wcache: dict = {}
        self.with_add = bool(a["with_add"])
        self.out_storage = torch.int32 if a["high_precision"] else _STORAGE[a["out_dtype"]]
        self.epi = _Epilogue(op, name, False, in_specs[1] if self.with_add else None, ws)
        self.fallback = _fixed_point_weight_layer(op, name)

    def _plan(self, amax: int):
        mode = _gemm_mode()
        key = (amax, mode)
        if key not in self._plans:
            plan = None
            if mode == "f32":
                ch = _chunks(self.l1, amax, _F32_EXACT)
                plan = (torch.float32, tuple(ch)) if ch is not None else None
            if plan is None and amax * self.l1_row < _F64_EXACT:
                plan = (torch.float64, ((0, self.K),))
            self._plans[key] = plan
        return self._plans[key]

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.K:
            return self.fallback(x) if other is None else self.fallback(x, other)
        amax = self.static_amax if self.static_amax is not None else 1 << max(fp._extreme(x), 1).bit_length()
        plan = None if self.int8 else self._plan(amax)
        if plan is None and not self.int8:
            return self.fallback(x) if other is None else self.fallback(x, other)
        check = amax * self.l1_row + self.epi.max_bias >= _I32
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.K)
        B = x2.shape[0]
        o2 = None if other is None else other.reshape(-1, self.O)
        out = torch.empty(B, self.O, dtype=self.out_storage)
        R = max(1, _TILE // self.O)
        ws = self.ws
        for r0 in range(0, B, R):
            r1 = min(B, r0 + R)
            if plan is None:
                acc = ws.get("acc", (r1 - r0, self.O), torch.int32)
                _int_mm(x2[r0:r1], self.wt_i8, acc)
            else:
                dtype, chunks = plan
                if plan not in self._wcache:
                    wt = self.w_i8.to(dtype).t().contiguous()  # (K, O)
                    self._wcache[plan] = [wt[k0:k1] for k0, k1 in chunks]
                wts = self._wcache[plan]
                xf = ws.get("xtile", (r1 - r0, self.K), dtype)
                xf.copy_(x2[r0:r1])
                acc = ws.get("acc", (r1 - r0, self.O), dtype)
                if len(chunks) == 1:
                    torch.mm(xf, wts[0], out=acc)
                else:
                    res = ws.get("acc64", (r1 - r0, self.O), torch.float64)
                    for ci, (k0, k1) in enumerate(chunks):
                        torch.mm(xf[:, k0:k1], wts[ci], out=acc)
                        if ci == 0:
                            res.copy_(acc)
                        else:
                            res.add_(acc)
                    acc = res
            self.epi.tile(acc, out[r0:r1], 0, self.O, None if o2 is None else o2[r0:r1], check)
        return out.reshape(*lead, self.O)


class _NativeGemmLayer:
    """A conv2d (groups 1; a 1x1 without padding reads its input rows directly, any other gathers its
    taps in the kernel) or a linear of int8 inputs as one native int8 GEMM with the requantization,
    fused add and relu/relu6 clamp in its epilogue (:class:`~qcompiler.native.gemm.Int8Gemm`),
    channels-last in and out.  Built for int8 / int16 outputs when
    :func:`~qcompiler.native.gemm.gemm_available` and the kernel proves the layer exact
    (``Int8Gemm.refusal``); ``build`` returns None otherwise (the other kernels take it)."""

    def __init__(self, gemm: Int8Gemm, conv: Optional[dict], other_dtype: Optional[torch.dtype],
                 fallback: Callable) -> None:
        self.gemm, self.conv, self.other_dtype, self.fallback = gemm, conv, other_dtype, fallback
        # per input shape (N, C, H, W): (geometry argument, NHWC output shape, rows, multiply-adds), or
        # None where the reference must run (an input smaller than the kernel); checked once per shape
        self._plans: dict[tuple, Optional[tuple]] = {}
        # a 1x1 conv with stride 1 and no padding reads its input rows as they are; a strided one takes
        # the gather path, which picks its rows in the kernel (no strided torch copy before it)
        self.pointwise = conv is not None and conv["kernel_size"] == (1, 1) and conv["padding"] == (0, 0) and \
            conv["stride"] == (1, 1)

    @staticmethod
    def build(k: KernelSpec) -> Optional["_NativeGemmLayer"]:
        a, T = k.attrs, k.tensors
        if (not k.native or k.in_specs[0].dtype != "qint8" or a["high_precision"]
                or a["out_dtype"] not in ("qint8", "qint16") or not gemm_available()):
            return None
        w = T["weight"]
        conv = None
        if k.op.kind == "conv2d":
            if int(a["groups"]) != 1 or len(a["padding"]) != 2:
                return None
            conv = {"kernel_size": tuple(int(v) for v in w.shape[2:]), "stride": tuple(int(v) for v in a["stride"]),
                    "padding": tuple(int(v) for v in a["padding"]), "dilation": tuple(int(v) for v in a["dilation"])}
            w = w.permute(0, 2, 3, 1)  # K ordered (i, j, c): the kernel's im2col order
        add = None
        if a["with_add"]:
            other_dtype = _STORAGE.get(k.in_specs[1].dtype)
            if other_dtype not in (torch.int8, torch.int16):
                return None
            add = (int(T["Mb"]), int(T["nb"]), other_dtype)
        w2, bias = w.reshape(w.shape[0], -1), T.get("bias")
        lo, hi = _act_clamp(a)
        out = _STORAGE[a["out_dtype"]]
        if Int8Gemm.refusal(w2, bias, T["M"], T["n"], lo, hi, out, add) is not None:
            return None
        gemm = Int8Gemm(w2, bias, T["M"], T["n"], lo, hi, out, add)
        return _NativeGemmLayer(gemm, conv, None if add is None else add[2], _fixed_point_weight_layer(k.op, k.name))

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        ops = self._operands(x, other, fresh)
        if ops is None:
            return self.fallback(x) if other is None else self.fallback(x, other)
        xo, geo, oo, out, rows, work, result = ops
        # the checks Int8Gemm.__call__ makes hold here: rows of K (NHWC rows, or the NHWC input of geo),
        # a fresh out, oo (rows, O)
        self.gemm.run_rows(xo, self.gemm.K, geo, out, oo, 0, rows, parts=row_parts(part_budget(), work))
        return result

    def plan_step(self, x: torch.Tensor, other: Optional[torch.Tensor] = None, alloc: Alloc = fresh) -> Optional[tuple]:
        """The call as a plan step (``backends/bpu/plan.py``): (its result, in memory from ``alloc``, and a
        :class:`~qcompiler.native.plan.StepSpec` that fills it), or None when the call would not be
        one kernel call on its inputs as they lie (the reference, or a layout copy first)."""
        ops = self._operands(x, other, alloc, copy=False)
        if ops is None:
            return None
        xo, geo, oo, out, rows, _, result = ops
        return result, self.gemm.step(xo, self.gemm.K, geo, out, oo, 0, rows)

    def _operands(self, x: torch.Tensor, other: Optional[torch.Tensor], alloc: Alloc,
                  copy: bool = True) -> Optional[tuple]:
        """(x's rows / NHWC memory, geometry, the fused operand's rows, the output (from ``alloc``), rows,
        multiply-adds, the result to return): what one kernel call takes, or None where the reference
        runs (and, without ``copy``, where an operand is not already in the layout the kernel reads)."""
        g, cv = self.gemm, self.conv
        if (x.dtype != torch.int8 or (other is not None and other.dtype != self.other_dtype)
                or (cv is not None and (x.dim() != 4 or x.shape[1] * cv["kernel_size"][0] * cv["kernel_size"][1] != g.K))
                or (cv is None and (x.dim() < 1 or x.shape[-1] != g.K))):
            return None
        if cv is None:
            lead = x.shape[:-1]
            if other is not None and other.shape != (*lead, g.O):  # a broadcast operand: the reference takes it
                return None
            if not copy and not (x.is_contiguous() and (other is None or other.is_contiguous())):
                return None  # (a reshape would copy: a step must read the value's own memory, every call)
            xo, oo = x.reshape(-1, g.K), None if other is None else other.reshape(-1, g.O)
            xo, oo = xo.contiguous(), None if oo is None else oo.contiguous()
            P = xo.shape[0]
            out = alloc((P, g.O), g.out_dtype)
            return xo, None, oo, out, P, P * g.K * g.O, out.reshape(*lead, g.O)
        if other is not None and other.dim() != 4:  # not an NCHW operand: the reference says what it is
            return None
        if self.pointwise:
            N, _, Ho, Wo = x.shape
            geo, shape, rows = None, (N, Ho, Wo, g.O), N * Ho * Wo
            work = rows * g.K * g.O
        else:
            plan = self._plans.get(tuple(x.shape), False)
            if plan is False:
                plan = self._plans[tuple(x.shape)] = self._conv_plan(tuple(x.shape))
            if plan is None:  # an input smaller than the kernel
                return None
            geo, shape, rows, work = plan
        if other is not None and other.shape != (shape[0], g.O, *shape[1:3]):  # a broadcast operand
            return None
        # NHWC memory (no copy when it is already)
        xo, oo = x.permute(0, 2, 3, 1), None if other is None else other.permute(0, 2, 3, 1)
        if not copy and not (xo.is_contiguous() and (oo is None or oo.is_contiguous())):
            return None
        xo, oo = xo.contiguous(), None if oo is None else oo.contiguous()
        out = alloc(shape, g.out_dtype)
        return xo, geo, oo, out, rows, work, out.permute(0, 3, 1, 2)

    def _conv_plan(self, shape: tuple) -> Optional[tuple]:
        cv, g = self.conv, self.gemm
        N, C, H, W = shape
        if min(H, W) <= 0:
            return None
        try:
            geo, (N, Ho, Wo) = g.conv_geometry((N, H, W, C), cv["kernel_size"], cv["stride"], cv["padding"],
                                               cv["dilation"])
        except ConfigError:  # an input smaller than the kernel: the reference says why
            return None
        return geo, (N, Ho, Wo, g.O), N * Ho * Wo, N * Ho * Wo * g.K * g.O

