"""Groups-1 convs and linears of int8 inputs as one native int8 GEMM with the requantization fused
(:class:`~qcompiler.backends.bpu.native.gemm.Int8Gemm`), channels-last in and out, also as a plan step."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.native.gemm import Int8Gemm, gemm_available, row_parts
from qcompiler.backends.bpu.sim.bounds import STORAGE
from qcompiler.backends.bpu.sim.epilogue import act_clamp
from qcompiler.backends.bpu.sim.plan import Alloc, fresh
from qcompiler.backends.bpu.sim.reference import fixed_point_weight_layer
from qcompiler.backends.bpu.sim.registry import KernelSpec
from qcompiler.errors import ConfigError
from qcompiler.parallel import part_budget


class _NativeGemmLayer:
    """A conv2d (groups 1; a 1x1 without padding reads its input rows directly, any other gathers its
    taps in the kernel) or a linear of int8 inputs as one native int8 GEMM with the requantization,
    fused add and relu/relu6 clamp in its epilogue (:class:`~qcompiler.backends.bpu.native.gemm.Int8Gemm`),
    channels-last in and out.  Built for int8 / int16 outputs when
    :func:`~qcompiler.backends.bpu.native.gemm.gemm_available` and the kernel proves the layer exact
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
            other_dtype = STORAGE.get(k.in_specs[1].dtype)
            if other_dtype not in (torch.int8, torch.int16):
                return None
            add = (int(T["Mb"]), int(T["nb"]), other_dtype)
        w2, bias = w.reshape(w.shape[0], -1), T.get("bias")
        lo, hi = act_clamp(a)
        out = STORAGE[a["out_dtype"]]
        if Int8Gemm.refusal(w2, bias, T["M"], T["n"], lo, hi, out, add) is not None:
            return None
        gemm = Int8Gemm(w2, bias, T["M"], T["n"], lo, hi, out, add)
        return _NativeGemmLayer(gemm, conv, None if add is None else add[2], fixed_point_weight_layer(k.op, k.name))

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
        """The call as a plan step (``backends/bpu/sim/plan.py``): (its result, in memory from ``alloc``, and a
        :class:`~qcompiler.backends.bpu.native.plan.StepSpec` that fills it), or None when the call would not be
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
