"""Fast kernels of the nash transformer kinds: matmul, add / sub, mul, lut, softmax, layer_norm.

Each computes the integers of its reference kernel (``reference.py``, i.e. the
``fixed_point`` function the converted module calls) by a shorter route whose exactness is
proven from the operands' integer types, and hands any call outside that proof to the
reference kernel itself (so every error the reference raises is raised the same way):

* ``lut`` and one-input ``mul`` are a function of one int8/int16 code: a table over every code,
  filled once *by the reference kernel itself*, then one ``numpy.take`` with the codes read as
  unsigned (the table rotated to match).  Exact by construction.
* ``add`` / ``sub`` / two-input ``mul`` and the requantization of ``matmul`` in float64:
  ``a*Ma/2**na + b*Mb/2**nb`` (``a*b*M/2**n``) is one fixed-point number with
  ``max(na, nb)`` (``n``) fraction bits; when the operands' type bounds keep its integer
  numerator below 2**53 every product, scaling by a power of two and sum is exact in float64,
  and ``torch.round`` rounds it half to even once, as ``round_scaled_sum`` / ``requantize`` do.
  Beyond that bound the int64 formulas are used (the rounding shift as one add and one shift).
* ``matmul``: one float32 (float64) batched GEMM when ``k * max|a| * max|b| < 2**24 (2**53)``,
  exact whatever the summation order, as ``fixed_point.int_matmul`` chooses; the int32 range of
  the accumulator is proven from the same bound, else checked on the data.
* ``softmax``: the exponentials from the table, their float64 sum (exact: integers < 2**53), then
  ``floor(E*M / (S*2**n) + 1/2)`` in float64.  With ``n >= 1`` the exact quotient is either a tie
  (representable, so computed exactly) or at least ``1 / (S*2**n)`` from one, and the two
  roundings err by at most ``2**-52 * (qmax + 2)``: below that distance when
  ``(qmax + 2) * L * max(table) * 2**n < 2**52`` (checked per call, ``L`` the axis length).
  Values past ``qmax`` clamp either way (every step is monotone).
* ``layer_norm`` (int8 input, ``2 * 128 * N * 2**30 < 2**53``): the row sums and the rsqrt
  table step as in ``fixed_point.int_layer_norm`` (on the rows only), then per element
  ``z = round((N*q - S1) * R / 2**s)`` and ``round((z*M + B) / 2**(n+16))`` in float64 (each
  numerator an integer below 2**53: exact; ``|z|`` is checked on the data before the second step).
  int16 inputs take the int64 formulas with the one-shift rounding.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from qcompiler.backends.bpu.sim.bounds import F32_EXACT, F64_EXACT, I32
from qcompiler.backends.bpu.sim.reference import _with_constant
from qcompiler.backends.bpu.sim.registry import REFERENCE, KernelSpec, fast_kernel
from qcompiler.quantization import fixed_point as fp

# largest |value| of the operand types the fast kernels take, by storage dtype
_AMAX = {torch.int8: 1 << 7, torch.int16: 1 << 15}
_UNSIGNED = {torch.int8: np.uint8, torch.int16: np.uint16}
_CODES = {torch.int8: "qint8", torch.int16: "qint16"}


def _round_shift(v: torch.Tensor, n: int) -> torch.Tensor:
    """``round_half_even(v / 2**n)`` of int64 ``v`` (``0 <= n <= 61``, ``|v| < 2**62``), in place:
    ``(v + 2**(n-1) - 1 + (floor(v / 2**n) & 1)) >> n``, which is ``fixed_point.rounding_shift``."""
    if n == 0:
        return v
    odd = (v >> n) & 1
    return v.add_((1 << (n - 1)) - 1).add_(odd) >> n


# --- code tables: lut, one-input mul


class _CodeTable:
    """A function of one int8/int16 code as a table over every code, filled by ``reference`` (the
    reference kernel) on ``arange(qmin, qmax + 1)`` the first time a dtype is seen, stored rotated
    so that the code's bits read as unsigned index it.  Other inputs go to ``reference``."""

    def __init__(self, reference: Callable) -> None:
        self.reference = reference
        self.tables: dict[torch.dtype, Optional[np.ndarray]] = {}

    def _table(self, dtype: torch.dtype) -> Optional[np.ndarray]:
        if dtype not in self.tables:
            lo, hi = fp.qrange(_CODES[dtype])
            codes = torch.arange(lo, hi + 1, dtype=torch.int64).to(dtype)
            try:
                values = self.reference(codes)
            except Exception:  # the reference rejects some code: every call goes to it (and raises there)
                self.tables[dtype] = None
                return None
            # unsigned index u = code mod 2**bits: codes 0..hi then lo..-1
            self.tables[dtype] = np.ascontiguousarray(torch.roll(values, lo).numpy())
        return self.tables[dtype]

    def __call__(self, x):
        if isinstance(x, torch.Tensor) and x.dtype in _UNSIGNED and x.device.type == "cpu" and x.numel():
            table = self._table(x.dtype)
            if table is not None:
                return torch.from_numpy(np.asarray(np.take(table, x.numpy().view(_UNSIGNED[x.dtype]))))
        return self.reference(x)


@fast_kernel("lut")
def _fast_lut(k: KernelSpec) -> Callable:
    return _CodeTable(REFERENCE["lut"](k))


# --- element-wise add / sub / mul


def _storage_of(t) -> Optional[torch.dtype]:
    return t.dtype if isinstance(t, torch.Tensor) and t.dtype in _AMAX and t.device.type == "cpu" else None


def _finish(v: torch.Tensor, out_dtype) -> torch.Tensor:
    """Rounded float64 (or int64) values -> the output type, clamped as ``fixed_point`` does."""
    lo, hi = fp.qrange(out_dtype)
    return v.clamp_(lo, hi).to(fp.storage_dtype(out_dtype))


@fast_kernel("add", "sub")
def _fast_add_sub(k: KernelSpec) -> Callable:
    reference = REFERENCE[k.op.kind](k)
    Ma, na, Mb, nb = (int(k.tensors[t]) for t in ("Ma", "na", "Mb", "nb"))
    if not (0 <= na <= 61 and 0 <= nb <= 61):
        return reference
    sign = 1 if k.op.kind == "add" else -1
    s = max(na, nb)
    ka, kb = float(Ma) * 2.0 ** -na, float(sign * Mb) * 2.0 ** -nb  # exact: |M| < 2**53
    exact: dict[tuple, bool] = {}
    out_dtype = k.out_dtype
    raw = _with_constant(k.op, lambda x, y: (x, y))  # the operands in the order the reference takes them

    def add(*xs):
        a, b = raw(*xs)
        da, db = _storage_of(a), _storage_of(b)
        if da is None or db is None:
            return reference(*xs)
        key = (da, db)
        if key not in exact:  # the numerator over 2**s stays below 2**53 for any operands of these types
            exact[key] = _AMAX[da] * abs(Ma) * 2 ** (s - na) + _AMAX[db] * abs(Mb) * 2 ** (s - nb) < F64_EXACT
        if not exact[key]:
            return reference(*xs)
        v = a.to(torch.float64).mul_(ka)
        if v.shape == torch.broadcast_shapes(a.shape, b.shape):
            v.add_(b.to(torch.float64), alpha=kb)
        else:  # a broadcasts up to b
            v = torch.add(v, b.to(torch.float64), alpha=kb)
        return _finish(v.round_(), out_dtype)
    return add


@fast_kernel("mul")
def _fast_mul(k: KernelSpec) -> Callable:
    reference = REFERENCE["mul"](k)
    if len(k.op.inputs) == 1 and "constant" not in k.tensors:  # sign * x requantized: a code table
        return _CodeTable(reference)
    M, n = k.tensors["M"], k.tensors["n"]
    if M.numel() != 1 or n.numel() != 1 or not 0 <= int(n) <= 61:
        return reference
    M, n = int(M), int(n)
    Mf = float(M) * 2.0 ** -n
    out_dtype = k.out_dtype
    raw = _with_constant(k.op, lambda x, y: (x, y))

    def mul(*xs):
        a, b = raw(*xs)
        da, db = _storage_of(a), _storage_of(b)
        if da is None or db is None:
            return reference(*xs)
        bound = _AMAX[da] * _AMAX[db] * abs(M)
        if bound < F64_EXACT:  # a*b*M an integer below 2**53: every float64 step exact
            return _finish(torch.mul(a.to(torch.float64), b.to(torch.float64)).mul_(Mf).round_(), out_dtype)
        if bound < 1 << 62:  # requantize's int64 product, without its data check (proven here)
            return _finish(_round_shift(torch.mul(a.to(torch.int64), b.to(torch.int64)).mul_(M), n), out_dtype)
        return reference(*xs)
    return mul


# --- matmul


@fast_kernel("matmul")
def _fast_matmul(k: KernelSpec) -> Callable:
    reference = REFERENCE["matmul"](k)
    M, n = k.tensors["M"], k.tensors["n"]
    if M.numel() != 1 or n.numel() != 1 or not 0 <= int(n) <= 61:
        return reference
    M, n = int(M), int(n)
    Mf = float(M) * 2.0 ** -n
    out_dtype, name = k.out_dtype, k.name

    def matmul(x, y):
        da, db = _storage_of(x), _storage_of(y)
        if da is None or db is None or x.dim() < 2 or y.dim() < 2 or x.shape[-1] != y.shape[-2]:
            return reference(x, y)
        bound = x.shape[-1] * _AMAX[da] * _AMAX[db]  # every partial sum, in any order
        if bound < F32_EXACT and fp._f32_gemm_is_ieee():
            acc = torch.matmul(x.to(torch.float32), y.to(torch.float32)).to(torch.float64)
        elif bound < F64_EXACT:
            acc = torch.matmul(x.to(torch.float64), y.to(torch.float64))
        else:
            return reference(x, y)
        if bound >= I32:  # the int32 range is not proven: check it as the reference does
            fp.check_accumulator(acc, 32, op=name)
        if bound * abs(M) < F64_EXACT:  # acc*M an integer below 2**53
            return _finish(acc.mul_(Mf).round_(), out_dtype)
        if bound * abs(M) >= 1 << 62:
            return reference(x, y)
        return _finish(_round_shift(acc.to(torch.int64).mul_(M), n), out_dtype)
    return matmul


# --- softmax


@fast_kernel("softmax")
def _fast_softmax(k: KernelSpec) -> Callable:
    reference = REFERENCE["softmax"](k)
    table, M, n = k.tensors["table"], int(k.tensors["M"]), int(k.tensors["n"])
    dim, out_dtype = int(k.attrs["dim"]), k.out_dtype
    t = table.to(torch.int64)
    if not (0 < M < (1 << fp.SOFTMAX_MULT_BITS) and 1 <= n <= fp.SOFTMAX_MAX_SHIFT) or t.dim() != 1 or \
            t.numel() == 0 or int(t.min()) < 0 or int(t.max()) > 1 << fp.SOFTMAX_EXP_BITS or int(t[0]) <= 0:
        return reference  # (it raises on the parameters it rejects; n == 0 rounds an odd divisor down)
    tmax, qmax = int(t.max()), fp.qrange(out_dtype)[1]
    padded: dict[torch.dtype, np.ndarray] = {}
    den_scale = 2.0 ** n

    def softmax(x):
        dx = _storage_of(x)
        if dx is None or x.dim() == 0 or not -x.dim() <= dim < x.dim() or x.numel() == 0:
            return reference(x)
        L = x.shape[dim]
        if L > fp.SOFTMAX_MAX_LEN or (qmax + 2) * L * tmax * 2 ** n >= 1 << 52:
            return reference(x)
        if dx not in padded:  # EXP[min(d, len - 1)] for every d = max - q of the type, as float64
            span = 2 * _AMAX[dx]
            padded[dx] = t[torch.arange(span).clamp(max=t.numel() - 1)].to(torch.float64).numpy()
        wide = x.to(torch.int32)
        d = torch.sub(wide.amax(dim, keepdim=True), wide)
        e = torch.from_numpy(np.take(padded[dx], d.numpy()))
        den = e.sum(dim, keepdim=True).mul_(den_scale)
        return _finish(e.mul_(M).div_(den).add_(0.5).floor_(), out_dtype)
    return softmax


# --- layer_norm


_LN_SHIFT = fp.LN_RSQRT_FRAC - fp.LN_NORM_FRAC  # z = round(d * R / 2**(p + this))


@fast_kernel("layer_norm")
def _fast_layer_norm(k: KernelSpec) -> Callable:
    reference = REFERENCE["layer_norm"](k)
    T, dims, out_dtype = k.tensors, int(k.attrs["dims"]), k.out_dtype
    M, n, B = (fp._as_int64(T[t]) for t in ("M", "n", "B"))
    eps = int(T["eps"])
    N = int(M.numel())
    shape = tuple(M.shape)
    if not (M.shape == n.shape == B.shape and len(shape) == dims and 1 <= N <= fp.LN_MAX_GROUP) or \
            not 0 <= eps <= fp.LN_MAX_EPS_UNITS or bool((n < 0).any()) or bool((n > fp.LN_MAX_SHIFT).any()) or \
            fp._extreme(M) >= 1 << fp.LN_MULT_BITS or fp._extreme(B) > fp.LN_BIAS_LIMIT:
        return reference
    rsqrt = fp.layer_norm_rsqrt_table()
    Mi, Bi, ni = M.reshape(-1), B.reshape(-1), n.reshape(-1)
    Mmax, Bmax = fp._extreme(M), fp._extreme(B)
    scale = torch.pow(2.0, -(ni + fp.LN_NORM_FRAC).to(torch.float64))
    Ms, Bs = Mi.to(torch.float64) * scale, Bi.to(torch.float64) * scale  # exact: power-of-two scalings
    TB = fp.LN_RSQRT_BITS

    def rows(S1: torch.Tensor, S2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, s) per row, int64, as int_layer_norm computes them from the row sums."""
        W = (N * S2 - S1 * S1 + eps).clamp(min=1)
        p = fp.layer_norm_exponent(W)
        t = (W << (TB - 2 * p).clamp(min=0)) >> (2 * p - TB).clamp(min=0)
        return rsqrt[t - (1 << TB)], p + _LN_SHIFT

    def layer_norm(x):
        dx = _storage_of(x)
        if dx is None or x.dim() < dims or tuple(x.shape[x.dim() - dims:]) != shape:
            return reference(x)
        q = x.reshape(-1, N)
        if dx == torch.int8 and 2 * _AMAX[dx] * N * (1 << fp.LN_RSQRT_FRAC) < F64_EXACT:
            xf = q.to(torch.float64)  # row sums exact: N * 2**14 < 2**53
            S1 = xf.sum(-1, keepdim=True)
            S2 = torch.mul(xf, xf).sum(-1, keepdim=True)
            R, s = rows(S1.to(torch.int64), S2.to(torch.int64))
            K = R.to(torch.float64) * torch.pow(2.0, -s.to(torch.float64))  # R / 2**s, exact
            # (N*q - S1) * K: q*N*R and S1*R are integers below 2**53, so both terms and their
            # difference (d*R / 2**s, representable) are exact
            z = torch.addcmul(-(S1 * K), xf, K * N).round_()
            if fp._extreme(z) * Mmax + Bmax < F64_EXACT:  # z*M + B an integer below 2**53
                return _finish(torch.addcmul(Bs, z, Ms).round_(), out_dtype).reshape(x.shape)
            zi = z.to(torch.int64)
        else:
            qi = q.to(torch.int64)
            S1 = qi.sum(-1, keepdim=True)
            S2 = torch.mul(qi, qi).sum(-1, keepdim=True)
            R, s = rows(S1, S2)
            zi = fp.rounding_shift(torch.mul(qi, N).sub_(S1).mul_(R), s)
        acc = zi.mul_(Mi).add_(Bi)
        return _finish(fp.rounding_shift(acc, ni + fp.LN_NORM_FRAC), out_dtype).reshape(x.shape)
    return layer_norm
