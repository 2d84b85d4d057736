"""The fast cat: each input requantized (or copied) straight into its slice of the output, in
float64 or in native integer passes."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.native.kernels import (
    int32_requant,
    requant_columns,
    requant_columns32,
    requant_columns_step,
)
from qcompiler.backends.bpu.sim.bounds import STORAGE
from qcompiler.backends.bpu.sim.memory import Workspace, nhwc
from qcompiler.backends.bpu.sim.plan import Alloc, fresh
from qcompiler.backends.bpu.sim.registry import REFERENCE, KernelSpec, fast_kernel
from qcompiler.quantization import fixed_point as fp

# elements of one float64 slice of the fast cat (512 KiB)
_CAT_CHUNK = 1 << 16


def _like(ws: Workspace, key: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scratch buffer of ``x``'s shape in its memory format (channels-last or contiguous), so
    element-wise passes between them run at unit stride."""
    if nhwc(x):
        N, C, H, W = x.shape
        return ws.get(key, (N, H, W, C), dtype).permute(0, 3, 1, 2)
    return ws.get(key, x.shape, dtype)


@fast_kernel("cat")
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
        self.params = [(int(M), int(n), _narrow(int(M), int(n), STORAGE[spec.dtype], self.lo, self.hi)
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
        out = torch.empty(shape, dtype=st, memory_format=torch.channels_last if nhwc(xs[0]) else torch.contiguous_format)
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
    """``(M32, n32, dtype)``: the int32 parameters :func:`~qcompiler.backends.bpu.native.kernels.int32_requant` proved
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
    """:func:`_fast_cat` in native passes, one per input
    (:func:`~qcompiler.backends.bpu.native.kernels.requant_columns`, or its int32 twin ``requant_columns32``
    where ``_narrow`` proved it equal on every input value),
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
