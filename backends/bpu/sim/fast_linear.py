"""The fast linear: the native GEMM layer, else one exact int8 GEMM or float GEMMs over K chunks,
tiled over rows (:class:`_FastLinear`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.bounds import AMAX, I32, STORAGE
from qcompiler.backends.bpu.sim.epilogue import TILE, Epilogue
from qcompiler.backends.bpu.sim.gemm import float_plan, gemm_mode, gemm_operand, int_mm
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.backends.bpu.sim.native_gemm import _NativeGemmLayer
from qcompiler.backends.bpu.sim.reference import fixed_point_weight_layer
from qcompiler.backends.bpu.sim.registry import KernelSpec, fast_kernel
from qcompiler.quantization import fixed_point as fp


@fast_kernel("linear")
def _fast_linear(k: KernelSpec) -> Callable:
    layer = _NativeGemmLayer.build(k) if k.native else None
    if layer is not None:
        return layer
    return _FastLinear(k.op, k.in_specs, k.name, k.ws, k.int8_gemm)


class _FastLinear:
    """linear: one int8 GEMM (when verified exact) or float32 GEMMs over K chunks, tiled over rows."""

    def __init__(self, op: BpuOp, in_specs: list[ValueSpec], name: str, ws: Workspace, int8_gemm: bool) -> None:
        T = op.tensors
        a = op.attrs
        self.name, self.ws = name, ws
        w = T["weight"]
        self.w_i8 = w
        self.O, self.K = w.shape
        self.in_dtype = in_specs[0].dtype
        self.static_amax = AMAX[self.in_dtype] if self.in_dtype == "qint8" else None
        # (O, K) |w|: int16 for int8 weights (2 bytes a weight, not int64's 8), int64 otherwise (|-32768| of an
        # int16 weight); always a copy (to() of a weight already of the type is the weight, and abs_ would change it)
        self.l1 = w.to(torch.int16 if w.dtype == torch.int8 else torch.int64, copy=True).abs_().numpy()
        self.l1_row = int(self.l1.sum(axis=1).max(initial=0))  # (numpy sums int16 in int64)
        # int8 x int8 GEMM only: int16 weights (weight_dtype="qint16") take the float GEMMs
        self.int8 = (int8_gemm and self.in_dtype == "qint8" and w.dtype == torch.int8
                     and AMAX["qint8"] * self.l1_row < I32)
        # int16 x int8 as two exact int8 GEMMs (see _split16): each half's sums stay below 128 * l1_row
        self.split16 = (int8_gemm and self.in_dtype == "qint16" and w.dtype == torch.int8
                        and AMAX["qint8"] * self.l1_row < I32)
        # 128 * sum_k w[o, k]: the offset the low bytes' shift to int8 leaves in every output
        self.offset = (w.to(torch.int64).sum(dim=1) * 128).to(torch.float64) if self.split16 else None
        self.wt_i8 = gemm_operand(w.t())  # (K, O) row-major
        self._plans: dict = {}
        self._wcache: dict = {}
        self.with_add = bool(a["with_add"])
        self.out_storage = torch.int32 if a["high_precision"] else STORAGE[a["out_dtype"]]
        self.epi = Epilogue(op, name, False, in_specs[1] if self.with_add else None, ws)
        self.fallback = fixed_point_weight_layer(op, name)

    def _plan(self, amax: int):
        """(dtype, chunks) of the float GEMMs for inputs with |x| <= amax, or None (fixed_point)."""
        key = (amax, gemm_mode())
        if key not in self._plans:
            self._plans[key] = float_plan(self.l1, self.l1_row, amax, key[1])
        return self._plans[key]

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.K:
            return self.fallback(x) if other is None else self.fallback(x, other)
        amax = self.static_amax if self.static_amax is not None else 1 << max(fp._extreme(x), 1).bit_length()
        plan = None if self.int8 or self.split16 else self._plan(amax)
        if plan is None and not (self.int8 or self.split16):
            return self.fallback(x) if other is None else self.fallback(x, other)
        check = amax * self.l1_row + self.epi.max_bias >= I32
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.K)
        B = x2.shape[0]
        o2 = None if other is None else other.reshape(-1, self.O)
        out = torch.empty(B, self.O, dtype=self.out_storage)
        R = max(1, TILE // self.O)
        ws = self.ws
        for r0 in range(0, B, R):
            r1 = min(B, r0 + R)
            if self.split16:
                acc = self._split16(x2[r0:r1])
            elif plan is None:
                acc = ws.get("acc", (r1 - r0, self.O), torch.int32)
                int_mm(x2[r0:r1], self.wt_i8, acc)
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

    def _split16(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.t()`` of int16 rows ``x`` as float64, exactly, from two int8 GEMMs: with ``h = x >> 8`` and
        ``l = (x & 255) - 128`` (both in [-128, 127]), ``x = 256 h + l + 128``, so
        ``x @ w.t() = 256 (h @ w.t()) + l @ w.t() + 128 sum_k w``. Each GEMM's sums stay below ``128 * l1_row``
        (< 2**31: int32 exact), and the float64 total (< 2**53) is exact. A float64 GEMM of the same size is
        several times slower than the two int8 ones on a CPU with int8 dot products."""
        ws, R = self.ws, x.shape[0]
        h = ws.get("x_hi", (R, self.K), torch.int8)
        lo = ws.get("x_lo", (R, self.K), torch.int16)
        h.copy_(x >> 8)
        torch.bitwise_and(x, 255, out=lo)
        lo.sub_(128)
        a = int_mm(h, self.wt_i8, ws.get("acc_hi", (R, self.O), torch.int32))
        h.copy_(lo)
        b = int_mm(h, self.wt_i8, ws.get("acc_lo", (R, self.O), torch.int32))
        acc = ws.get("acc64", (R, self.O), torch.float64)
        acc.copy_(a).mul_(256).add_(b).add_(self.offset)
        return acc
