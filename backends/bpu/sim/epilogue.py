"""The weight layers' float epilogue: bias, int32 check, requantization (+ fused add, + relu/relu6)
of a tile of an exact accumulator, with near-tie detection where one float64 rounding is not
proven harmless (the package docstring says why it is exact)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.bounds import AMAX
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.quantization import fixed_point as fp


# 2**b >= qmax + 1: the magnitude below which requantized values are not clamped
_OUT_BITS = {"qint8": 7, "qint16": 15, "qint32": 31}

# elements of one output tile: the tile's GEMM result and epilogue temporaries (float64: 8 MiB)
# stay in the last-level cache between the passes over them, and a layer is a few tiles, so
# the per-call overhead of the ~10 torch ops per tile stays small (measured: 2**18..2**20 similar
# at batch 8, smaller tiles are slower)
TILE = 1 << 20


def act_clamp(a: dict) -> tuple[int, int]:
    """The output range of a weight layer: its integer type's, narrowed by a fused relu / relu6."""
    lo, hi = fp.qrange(a["out_dtype"])
    if a["act"] == "relu":
        lo = 0
    elif a["act"] == "relu6":
        lo, hi = 0, min(hi, int(a["act_max"]))  # (program_check refuses a larger act_max in artifacts)
    return lo, hi


class Epilogue:
    """bias, int32 check, requantize (+ fused add) (+ relu/relu6) of one tile of an exact accumulator.

    A tile is ``(channels, columns)`` (``rows=True``, conv: output channels
    ``c0:c1`` on dim 0) or ``(rows, O)`` (``rows=False``, linear: channels on
    the last dim).  The accumulator holds exact integers in float32/float64;
    the result is written (as integers) into ``out``.  The package docstring
    (``backends/bpu/sim/__init__.py``) says why the float64 evaluation is exact.
    """

    def __init__(self, op: BpuOp, name: str, rows: bool, other_spec: Optional[ValueSpec], ws: Workspace) -> None:
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
        self.lo, self.hi = act_clamp(a)
        self.M, self.n = T["M"].to(torch.int64), T["n"].to(torch.int64)
        self.f = torch.ldexp(self.M.double(), -self.n).view(shape)  # M * 2**-n, exact in float64
        self.with_add = bool(a["with_add"])
        b = _OUT_BITS[self.out_dtype]
        t2max = 0.0
        if self.with_add:
            self.Mb, self.nb = int(T["Mb"]), int(T["nb"])
            self.f2 = math.ldexp(float(self.Mb), -self.nb)  # exact
            t2max = AMAX[other_spec.dtype] * abs(self.f2)
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
