"""The exact GEMMs of the fast kernels: the int8 x int8 -> int32 entry (``torch._int_mm``) with its
once-per-process self-test, and the input-channel chunks that keep float32 GEMMs exact."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from qcompiler.backends.bpu.sim.bounds import F32_EXACT, F64_EXACT
from qcompiler.compat.torch_private import int_mm as torch_int_mm, int_mm_exists
from qcompiler.quantization import fixed_point as fp

__all__ = ["int8_gemm_available", "int8_gemm_preferred", "int8_dot_product", "int_mm", "gemm_operand", "gemm_mode", "exact_chunks", "float_plan"]


_INT8_GEMM: Optional[bool] = None


def int8_gemm_available() -> bool:
    """True when ``torch._int_mm`` computes int8 x int8 -> int32 GEMMs exactly on this machine.

    Checked once per process on saturation-prone operands (products of
    127/-128 in every sign pattern: a kernel built on ``vpmaddubsw``, whose
    int16 pair sums saturate, fails it) over the shapes the lowering emits
    (1-sized M, K and N included), each operand in every layout the kernels
    hand over, through :func:`int_mm` (the kernels' only entry), against
    exact int64 products.  With non-saturating int32 arithmetic (VNNI, AMX) the
    result is exact whenever the true sum fits int32 (two's complement
    wrap-around cannot change an in-range result), which the fast kernels
    prove from the weights before using it.
    """
    global _INT8_GEMM
    if _INT8_GEMM is None:
        _INT8_GEMM = _int8_self_test()
    return _INT8_GEMM


# x86 CPU flags of the int8 dot-product instructions (VNNI, AMX) torch._int_mm's fast kernels use.
_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def int8_dot_product(cpuinfo: str) -> bool:
    """True when the ``flags`` line of ``cpuinfo`` (the text of /proc/cpuinfo) names VNNI or AMX."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return bool(_INT8_DOT_FLAGS & set(line.partition(":")[2].split()))
    return False


@functools.cache
def int8_gemm_preferred() -> bool:
    """The simulator's default for ``int8_gemm``: the int8 GEMM where it is exact and this CPU has
    int8 dot-product instructions; elsewhere the exact float32 GEMMs, the faster of the two there.

    Without VNNI or AMX, ``torch._int_mm`` is exact but slow: a bayes resnet18 at batch 4 ran in
    9.6 s on it against 0.47 s on the float32 GEMMs (an AVX2-only EPYC), mobilenet_v2 in 1.8 s
    against 0.44 s. Both give the same integers, so this is a speed choice only.
    """
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # no /proc (not Linux): the float32 GEMMs, exact everywhere
        return False
    return int8_dot_product(cpuinfo) and int8_gemm_available()


def gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) in a layout ``torch._int_mm`` reads correctly for every shape: row-major with
    unit column stride and a row stride of at least ``max(1, columns)``; else a row-major copy.

    Contiguity is not enough: torch calls ``w.t()`` of a ``(10, 1)`` weight contiguous with
    strides ``(1, 1)``, and ``int_mm`` then reads the wrong memory (size-1 dims make strides
    ambiguous to its transpose detection).
    """
    if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]):
        return t
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def int_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` (int8 x int8 -> int32) with every operand in a :func:`gemm_operand` layout.

    The only way the fast kernels call ``torch._int_mm``; :func:`int8_gemm_available` checks
    exactly this function.
    """
    target = gemm_operand(out)
    torch_int_mm(gemm_operand(a), gemm_operand(b), out=target)
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
    if not int_mm_exists():
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
                            got = int_mm(aa, bb, out)
                            if not torch.equal(got.to(torch.int64), want):
                                return False
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def gemm_mode() -> str:
    """float32 GEMMs are exact below 2**24 only at IEEE float32 precision (see fixed_point)."""
    return "f32" if fp._f32_gemm_is_ieee() else "f64"


def exact_chunks(l1: np.ndarray, amax: int, limit: int) -> Optional[list[tuple[int, int]]]:
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


def float_plan(l1: np.ndarray, l1_row: int, amax: int, mode: str) -> Optional[tuple]:
    """``(dtype, chunks)`` of the float GEMMs of a weight with L1 sums ``l1`` (``(O, C)``; ``l1_row``:
    the largest row sum) on inputs with ``|x| <= amax``: float32 over :func:`exact_chunks` in GEMM
    ``mode`` "f32", else float64 in one chunk while every sum stays below 2**53; None when neither
    is exact (then fixed_point runs the layer). More than :data:`MAX_F32_CHUNKS` float32 chunks lose to
    one float64 GEMM: an int16 input (``amax`` 32768) leaves a chunk a few input channels, and ViT-B/16's
    linears on nash's int16 LayerNorm outputs ran as hundreds of tiny GEMMs (4.5 s of a 4.7 s run)."""
    chunks = exact_chunks(l1, amax, F32_EXACT) if mode == "f32" else None
    f64 = amax * l1_row < F64_EXACT
    if chunks is not None and (len(chunks) <= MAX_F32_CHUNKS or not f64):
        return torch.float32, tuple(chunks)
    if f64:
        return torch.float64, ((0, l1.shape[1]),)
    return None


MAX_F32_CHUNKS = 2  # a float64 GEMM costs about two float32 ones
