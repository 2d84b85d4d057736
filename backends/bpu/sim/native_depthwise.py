"""Depthwise int8 convs in one native pass (:class:`~qcompiler.backends.bpu.native.kernels.DepthwiseConv`),
channels-last in and out, also as a plan step."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.native.gemm import row_parts
from qcompiler.backends.bpu.native.kernels import DepthwiseConv
from qcompiler.backends.bpu.sim.bounds import I32, STORAGE
from qcompiler.backends.bpu.sim.epilogue import act_clamp
from qcompiler.backends.bpu.sim.plan import Alloc, fresh
from qcompiler.backends.bpu.sim.reference import fixed_point_weight_layer
from qcompiler.backends.bpu.sim.registry import KernelSpec
from qcompiler.errors import ConfigError
from qcompiler.parallel import part_budget


class _NativeDepthwiseLayer:
    """Depthwise int8 conv2d (groups == in == out channels) in one native pass: int32 accumulation
    and the integer requantization per output position (:class:`~qcompiler.backends.bpu.native.kernels.DepthwiseConv`),
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
        if bound >= I32 or bound * int(T["M"].to(torch.int64).abs().max()) >= 1 << 62:
            return None
        lo, hi = act_clamp(a)
        try:
            kernel = DepthwiseConv(w, bias, a["stride"], a["padding"], a["dilation"], T["M"], T["n"], lo, hi,
                                   STORAGE[a["out_dtype"]])
        except ConfigError:  # a layer the kernel refuses (e.g. an empty clamp range): the reference runs it
            return None
        return _NativeDepthwiseLayer(kernel, fixed_point_weight_layer(k.op, k.name))

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
