"""BPU fixed-point numerics: the one place that defines the integer math.

Used by ``convert`` (fake quant -> fixed point parameters) and by the integer
BPU simulator.  It implements DESIGN.md, "BPU numerics (the simulator's
contract)":

* Quantization is symmetric with zero point 0.  ``quantize`` rounds
  **half to even** (``torch.round``) after a float32 division, exactly like
  the fake-quant model.
* A real factor (``s_in * s_w / s_out``, ``s_a / s_out``, ...) becomes an
  integer multiplier ``M`` and a right shift ``n``: ``real ~= M / 2**n``
  (:func:`requant_params`).
* Requantization is ``y = clamp(round(acc * M / 2**n))`` computed exactly in
  int64; the rounding mode is **round half to even** (convergent rounding:
  ``2.5 -> 2``, ``3.5 -> 4``, ``-2.5 -> -2``), the same tie rule as
  ``torch.round`` in the fake-quant model, so exact ties (common when a
  factor is a power of two, e.g. a leaky slope of 0.25) agree bit for bit.
* Integer conv/linear/matmul return the exact int64 accumulator.
  Overflow is detected and reported (:class:`AccumulatorOverflow`), never
  silent.
* Non-linearities are lookup tables built in float64 and rounded half to
  even (:func:`build_lut`).

Integer tensors are carried in the narrowest torch dtype of their quantized
type (``qint8 -> torch.int8``, ``qint16 -> torch.int16``,
``qint32 -> torch.int32``); accumulators are ``torch.int64``.  Every function
widens its inputs before doing arithmetic (to int64, or to float32/float64
only where the result is provably exact), so callers may pass any integer
dtype.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F

from qcompiler.errors import ConfigError, QCompilerError

Scale = Union[float, torch.Tensor]
IntPair = Union[int, Sequence[int]]

__all__ = [
    "AccumulatorOverflow",
    "qrange",
    "storage_dtype",
    "quantize",
    "dequantize",
    "symmetric_scale",
    "requant_params",
    "requantize",
    "check_accumulator",
    "pads4",
    "padding_attr",
    "pad_excess",
    "int_conv2d",
    "int_linear",
    "int_matmul",
    "add_params",
    "int_add",
    "int_sub",
    "int_mul",
    "div_params",
    "int_div",
    "bias_codes",
    "int_cat",
    "int_avg_pool2d",
    "int_global_avg_pool",
    "int_max_pool2d",
    "build_lut",
    "apply_lut",
    "relu",
    "relu6",
    "leaky_relu",
]

# float64 holds every integer of magnitude < 2**53 exactly.
_F64_EXACT = 1 << 53
# |acc * M| must stay below this so that adding the rounding term cannot
# overflow int64 either.
_MUL_LIMIT = 1 << 62
_I64_LIMIT = 1 << 63


class AccumulatorOverflow(QCompilerError, OverflowError):
    """An integer accumulator (or ``acc * M`` product) left its legal range."""

    def __init__(self, op: str, seen: int, limit: int, what: str = "accumulator",
                 fix: str | None = None) -> None:
        self.op, self.seen, self.limit, self.what = op, int(seen), int(limit), what
        fix = fix or ("narrow the operands' integer range (e.g. int8 instead of int16 "
                      "activations) or split the reduction into smaller ones")
        super().__init__(
            f"{op}: {what} overflow: max |value| seen is {self.seen} but the limit is "
            f"{self.limit} (must be < limit); fix: {fix}"
        )


# ---------------------------------------------------------------------------
# dtypes and ranges

_RANGES = {
    "qint8": (-128, 127, torch.int8),
    "qint16": (-32768, 32767, torch.int16),
    "qint32": (-(1 << 31), (1 << 31) - 1, torch.int32),
}
_ALIASES = {
    torch.int8: "qint8", torch.qint8: "qint8", "int8": "qint8",
    torch.int16: "qint16", "int16": "qint16",
    torch.int32: "qint32", torch.qint32: "qint32", "int32": "qint32",
}


def dtype_name(dtype) -> "str | None":
    """The canonical name ("qint8" / "qint16" / "qint32") of ``dtype`` or one of its aliases
    (torch.int8, torch.qint8, "int8", ...), or None if it names none of them."""
    if isinstance(dtype, str) and dtype in _RANGES:
        return dtype
    try:
        return _ALIASES.get(dtype)
    except TypeError:  # unhashable
        return None


def _norm_dtype(dtype) -> str:
    name = dtype_name(dtype)
    if name is None:
        raise ConfigError(
            f"unknown quantized dtype {dtype!r}; use one of 'qint8', 'qint16', 'qint32'"
        )
    return name


def qrange(dtype) -> tuple[int, int]:
    """``(qmin, qmax)`` of a symmetric BPU integer type ("qint8"/"qint16"/"qint32").

    The full two's complement range is used (``[-128, 127]`` for qint8); an
    unknown dtype raises :class:`ConfigError`.
    """
    lo, hi, _ = _RANGES[_norm_dtype(dtype)]
    return lo, hi


def storage_dtype(dtype) -> torch.dtype:
    """The torch integer dtype that stores values of ``dtype`` (qint8 -> torch.int8)."""
    return _RANGES[_norm_dtype(dtype)][2]


def _clamp_to(x: torch.Tensor, dtype) -> torch.Tensor:
    lo, hi = qrange(dtype)
    return x.clamp(lo, hi).to(storage_dtype(dtype))


# ---------------------------------------------------------------------------
# helpers


def _as_int(t) -> torch.Tensor:
    """``t`` as a tensor of an integer dtype (unchanged); float/bool -> ConfigError."""
    t = torch.as_tensor(t)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ConfigError(f"expected an integer tensor, got dtype {t.dtype}")
    return t


def _as_int64(t) -> torch.Tensor:
    return _as_int(t).to(torch.int64)


def _extreme(t: torch.Tensor) -> int:
    """max |t| as an exact Python int (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return max(abs(int(t.max())), abs(int(t.min())))


def _along_axis(param: torch.Tensor, like: torch.Tensor, axis: int | None, name: str) -> torch.Tensor:
    """Shape a per-tensor (1 value) or per-channel parameter to broadcast against ``like``."""
    if param.numel() == 1:
        return param.reshape(())
    if axis is None:
        raise ConfigError(
            f"{name} has {param.numel()} values (per-channel) but no axis was given; "
            f"pass axis=<channel dimension>"
        )
    ax = axis if axis >= 0 else axis + like.dim()
    if not 0 <= ax < like.dim() or like.shape[ax] != param.numel():
        raise ConfigError(
            f"{name} has {param.numel()} values but the tensor of shape "
            f"{tuple(like.shape)} has {like.shape[ax] if 0 <= ax < like.dim() else 'no'} "
            f"channels along axis {axis}"
        )
    shape = [1] * like.dim()
    shape[ax] = param.numel()
    return param.reshape(shape)


def _scale_tensor(scale: Scale, name: str = "scale") -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32) if not torch.is_tensor(scale) else scale.float()
    if s.numel() == 0 or not bool(torch.all(torch.isfinite(s) & (s > 0))):
        raise ConfigError(f"{name} must be finite and > 0, got {scale!r}")
    return s


def _pair(v: IntPair) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    v = tuple(int(i) for i in v)
    if len(v) != 2:
        raise ConfigError(f"expected an int or a pair of ints, got {v!r}")
    return v


# ---------------------------------------------------------------------------
# quantize / dequantize / scales


def quantize(x: torch.Tensor, scale: Scale, dtype="qint8", axis: int | None = None) -> torch.Tensor:
    """Float -> integer on entering the BPU: ``clamp(round_half_even(x / scale))``.

    Symmetric, zero point 0.  The division is done in float32 and rounded with
    ``torch.round`` (**round half to even**) so that the result matches the
    fake-quant model bit for bit.  ``scale`` is a float or a tensor; a
    per-channel tensor broadcasts along ``axis``.  Returns the storage dtype
    of ``dtype`` (e.g. torch.int8).
    """
    x = torch.as_tensor(x).float()
    if bool(torch.isnan(x).any()):
        raise ConfigError("quantize: the input contains NaN; it has no integer value")
    s = _along_axis(_scale_tensor(scale), x, axis, "scale")
    return _clamp_to(torch.round(x / s), dtype)


def bias_codes(bias: torch.Tensor, grid) -> torch.Tensor:
    """A bias as int32 codes on the accumulator grid ``s_in * s_w``: ``round_half_even(bias / grid)``
    saturated to the int32 range, in the dtype of ``bias / grid`` (float64 where the converted
    and the fake-quant model must agree bit for bit; the QAT training path keeps float32)."""
    lo, hi = qrange("qint32")
    return torch.round(bias / grid).clamp(lo, hi)


def dequantize(q: torch.Tensor, scale: Scale, axis: int | None = None) -> torch.Tensor:
    """Integer -> float32: ``q * scale`` (leaving the BPU).

    The product is formed in float64 and rounded once to float32, which equals
    the float32 product for int8/int16 values and stays correctly rounded
    for int32 accumulators (high-precision output).
    """
    q = _as_int64(q)
    s = _along_axis(_scale_tensor(scale).double(), q, axis, "scale")
    return (q.double() * s).float()


def symmetric_scale(amax, dtype="qint8") -> torch.Tensor:
    """Symmetric scale ``amax / qmax`` (float32), floored at float32 eps.

    The floor keeps an all-zero tensor from producing a zero scale (which
    would divide by zero in :func:`quantize` and break requant factors).
    Works per tensor or per channel (``amax`` a vector).
    """
    _, qmax = qrange(dtype)
    a = torch.as_tensor(amax, dtype=torch.float32).abs()
    return torch.clamp(a / qmax, min=torch.finfo(torch.float32).eps)


# ---------------------------------------------------------------------------
# requantization


def requant_params(real_multiplier, *, mult_bits: int = 15, max_shift: int = 31
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer multiplier and shift ``(M, n)`` with ``real ~= M / 2**n``.

    ``|M| < 2**mult_bits`` (15 bits for int8 outputs; up to 31) and
    ``0 <= n <= max_shift``.  Precision is maximised: ``|real|`` is normalised
    into ``[0.5, 1)`` like ``frexp`` (``real = mant * 2**e``), then
    ``M = round_half_even(mant * 2**mult_bits)`` and ``n = mult_bits - e``.
    If ``M`` rounds up to ``2**mult_bits`` it is renormalised to
    ``2**(mult_bits-1)`` with ``n - 1``.  ``real == 0`` gives ``(0, 0)``.
    A factor too large to represent (``n`` would be negative, i.e.
    ``|real| >~ 2**mult_bits``) raises :class:`ConfigError`; a factor too small
    for ``max_shift`` is rounded at ``n = max_shift`` (``M`` may become 0, then
    ``n = 0``).  Negative factors give a negative ``M``.  Vectorised: a tensor
    of per-channel factors gives per-channel ``M`` and ``n`` (int64 tensors of
    the same shape).
    """
    if not (isinstance(mult_bits, int) and 1 <= mult_bits <= 52):
        raise ConfigError(f"mult_bits must be an int in [1, 52], got {mult_bits!r}")
    if not (isinstance(max_shift, int) and 0 <= max_shift <= 62):
        raise ConfigError(f"max_shift must be an int in [0, 62], got {max_shift!r}")
    r = (real_multiplier.detach().to(torch.float64) if torch.is_tensor(real_multiplier)
         else torch.as_tensor(real_multiplier, dtype=torch.float64))
    if not bool(torch.isfinite(r).all()):
        raise ConfigError(f"requant_params: real multiplier must be finite, got {real_multiplier!r}")
    sign = torch.sign(r)
    a = r.abs()
    mant, e = torch.frexp(a)  # a = mant * 2**e, mant in [0.5, 1) (0 for a == 0)
    M = torch.round(mant * float(1 << mult_bits))  # exact in float64 (mult_bits <= 52)
    n = mult_bits - e.to(torch.int64)
    full = M == float(1 << mult_bits)
    M = torch.where(full, torch.full_like(M, float(1 << (mult_bits - 1))), M)
    n = torch.where(full, n - 1, n)
    bad = (n < 0) & (M != 0)
    if bool(bad.any()):
        raise ConfigError(
            f"requant_params: real multiplier {float(r[bad].flatten()[0])!r} is too large for "
            f"a {mult_bits}-bit multiplier (needs |real| < {2 ** mult_bits - 0.5}); "
            f"raise mult_bits or the output scale"
        )
    small = n > max_shift
    M = torch.where(small, torch.round(a * float(2 ** max_shift)), M)
    n = torch.where(small, torch.full_like(n, max_shift), n)
    zero = M == 0
    n = torch.where(zero, torch.zeros_like(n), n)
    return (M * sign).to(torch.int64), n.to(torch.int64)


def _check_product(acc: torch.Tensor, M: torch.Tensor, op: str) -> None:
    """Raise unless ``|acc * M| < 2**62`` for every element (no int64 overflow)."""
    if _extreme(acc) * _extreme(M) < _MUL_LIMIT:
        return
    # the cheap bound failed (per-channel M): check element by element, without overflowing
    a, m = torch.broadcast_tensors(acc.abs(), M.abs())
    over = a > torch.div(_MUL_LIMIT - 1, m.clamp(min=1), rounding_mode="floor")
    if bool(over.any()):
        seen = max(int(x) * int(y) for x, y in zip(a[over][:1000].tolist(), m[over][:1000].tolist()))
        raise AccumulatorOverflow(op, seen, _MUL_LIMIT, what="acc * M product",
                                  fix="use a smaller mult_bits or keep the accumulator in int32")


def rounding_shift(v: torch.Tensor, n) -> torch.Tensor:
    """``v / 2**n`` rounded half to even, exact on int64 (``n >= 0``; ``n == 0`` is exact)."""
    n = torch.as_tensor(n, dtype=torch.int64)
    q = v >> n  # floor
    r = v - (q << n)  # remainder in [0, 2**n)
    half = (torch.ones_like(n) << n) >> 1
    up = (r > half) | ((r == half) & (half > 0) & ((q & 1) == 1))
    return q + up.to(q.dtype)


_round_shift = rounding_shift


def requantize(acc: torch.Tensor, M, n, out_dtype="qint8", axis: int | None = None,
               *, op: str = "requantize") -> torch.Tensor:
    """Accumulator -> output integers: ``clamp((acc * M + 2**(n-1)) >> n)``.

    Computed exactly in int64; the rounding mode is **round half to even**
    (``2.5 -> 2``, ``3.5 -> 4``, ``-2.5 -> -2``), like ``torch.round``.
    For ``n == 0`` there is no rounding.  Per-channel
    ``M``/``n`` broadcast along ``axis``.  Raises :class:`AccumulatorOverflow`
    (naming ``op``) if ``|acc * M|`` would reach ``2**62``.
    """
    acc = _as_int64(acc)
    M = _along_axis(_as_int64(M), acc, axis, "M")
    n = _along_axis(_as_int64(n), acc, axis, "n")
    if bool((n < 0).any()) or bool((n > 62).any()):
        raise ConfigError(f"{op}: shift n must be in [0, 62], got {n.flatten().tolist()[:8]}")
    _check_product(acc, M, op)
    return _clamp_to(_round_shift(acc * M, n), out_dtype)


def check_accumulator(acc: torch.Tensor, bits: int = 32, op: str = "accumulator") -> torch.Tensor:
    """Raise :class:`AccumulatorOverflow` if ``acc`` leaves the signed ``bits`` range.

    The BPU accumulates in int32 (``bits=32``); the exact int64 results of
    :func:`int_conv2d` & co. are checked here so overflow is reported, never
    wrapped silently.  Returns ``acc`` unchanged.
    """
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if acc.numel():
        mn, mx = int(acc.min()), int(acc.max())
        if mn < lo or mx > hi:
            worst = mn if -mn > mx else mx
            raise AccumulatorOverflow(
                op, abs(worst), 1 << (bits - 1),
                what=f"int{bits} accumulator (extreme value {worst}, range [{lo}, {hi}])")
    return acc


# ---------------------------------------------------------------------------
# exact integer conv / linear / matmul
#
# Every one of them is a sum of k integer products.  A floating-point GEMM
# whose operands are integers is *exact* when every product and every partial
# sum is an integer below the format's 2**p (p = 24 for float32, 53 for
# float64): each multiply-add is then exact, whatever the summation order,
# blocking or FMA use.  All partial sums are bounded by k * max|a| * max|b|,
# so the kernel is picked per call from that bound:
#
#   "f32"   bound < 2**24 (int8 x int8 up to k = 1032, e.g. 3x3x64 convs):
#           one float32 GEMM -- only when float32 matmul runs at IEEE
#           precision (see _f32_gemm_is_ieee).
#   "f64"   bound < 2**53 (everything else with int8/int16 operands): one
#           float64 GEMM, about 2x slower than float32.
#   "i64"   bound < 2**63: int64 GEMM (exact integer arithmetic).
#   else    AccumulatorOverflow.
#
# Convolution is lowered to GEMM by an explicit im2col built from strided
# slices (never a Winograd/FFT algorithm, which would not be exact), so the
# same rule covers it.  (Splitting an operand into two float32-exact digits
# was measured no faster than float64 on CPU, so it is not done.)

_F32_EXACT = 1 << 24
# test hook: force a kernel ("f32", "f64", "i64")
_FORCE_MODE: str | None = None


def _f32_gemm_is_ieee() -> bool:
    """True when torch's float32 matmul keeps full IEEE float32 precision.

    ``torch.set_float32_matmul_precision("medium"/"high")`` or a oneDNN
    bf16/tf32 math mode would make the float32 path inexact; we then use
    float64 instead.
    """
    if torch.get_float32_matmul_precision() != "highest":
        return False
    for holder in (torch.backends, getattr(torch.backends, "mkldnn", None),
                   getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)):
        if str(getattr(holder, "fp32_precision", "none")) not in ("none", "ieee"):
            return False
    return True


def _plan(k: int, amax: int, bmax: int, op: str) -> str:
    """Choose the fastest provably exact kernel for a reduction of length ``k``."""
    if _FORCE_MODE is not None:
        return _FORCE_MODE
    bound = k * amax * bmax
    if bound < _F32_EXACT and _f32_gemm_is_ieee():
        return "f32"
    if bound < _F64_EXACT:
        return "f64"
    if bound < _I64_LIMIT:
        return "i64"
    raise AccumulatorOverflow(op, bound, _I64_LIMIT, what="int64 accumulator bound (k*max|a|*max|b|)")


def _exact_bilinear(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: torch.Tensor,
                    b: torch.Tensor, k: int, op: str) -> torch.Tensor:
    """Exact int64 result of the bilinear integer reduction ``fn(a, b)`` of length ``k``."""
    mode = _plan(k, _extreme(a), _extreme(b), op)
    if mode == "f32":
        return fn(a.float(), b.float()).to(torch.int64)
    if mode == "f64":
        return fn(a.double(), b.double()).to(torch.int64)
    if mode == "i64":
        return fn(a.to(torch.int64), b.to(torch.int64))
    raise ConfigError(f"unknown kernel mode {mode!r}")  # pragma: no cover


# A padding is an int, a pair (h, w) (the same on both sides of each dim, as torch's convs and
# pools take it) or four sides (top, left, bottom, right) -- ONNX's ``pads`` order -- which a
# zero F.pad folded into a conv / average pool gives (passes/rewrite.py). Four sides are kept only
# when they differ (:func:`padding_attr`), so symmetric layers keep their pair everywhere.


def pads4(padding) -> tuple[int, int, int, int]:
    """``(top, left, bottom, right)`` of an int, a pair ``(h, w)`` or four sides ``(t, l, b, r)``."""
    if isinstance(padding, int):
        return padding, padding, padding, padding
    p = tuple(int(i) for i in padding)
    if len(p) == 2:
        return p[0], p[1], p[0], p[1]
    if len(p) != 4:
        raise ConfigError(f"expected a padding int, pair (h, w) or four sides (t, l, b, r), got {p!r}")
    return p


def padding_attr(padding) -> list[int]:
    """The padding as stored in geometry / program attrs: ``[h, w]`` if symmetric, else ``[t, l, b, r]``."""
    t, l, b, r = pads4(padding)
    return [t, l] if (t, l) == (b, r) else [t, l, b, r]


def pad_excess(x: torch.Tensor, padding) -> tuple[torch.Tensor, tuple[int, int]]:
    """``(x zero-padded by the asymmetric excess, the symmetric (h, w) rest)``: a symmetric kernel
    run on them computes the four-sided zero padding exactly (code 0 is the value 0)."""
    t, l, b, r = pads4(padding)
    ph, pw = min(t, b), min(l, r)
    extra = (l - pw, r - pw, t - ph, b - ph)
    return (F.pad(x, extra) if any(extra) else x), (ph, pw)


def _conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, op):
    sh, sw = _pair(stride)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)
    N, C, H, W = x_shape
    O, Cg, kh, kw = w_shape
    if min(sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ConfigError(f"{op}: stride/dilation must be >= 1 and padding >= 0")
    if groups < 1 or C != Cg * groups or O % groups:
        raise ConfigError(f"{op}: input has {C} channels and weight {tuple(w_shape)} with "
                          f"groups={groups}; need C == weight.shape[1]*groups and O % groups == 0")
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if Ho < 1 or Wo < 1:
        raise ConfigError(f"{op}: kernel {kh}x{kw} does not fit the padded {H}x{W} input")
    return (sh, sw), (ph, pw), (dh, dw), Ho, Wo


def _taps(x: torch.Tensor, kh: int, kw: int, st, pad, dil, Ho: int, Wo: int) -> list[torch.Tensor]:
    """The kh*kw strided views of the zero-padded input, one per kernel tap (row-major)."""
    (sh, sw), (ph, pw), (dh, dw) = st, pad, dil
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    return [xp[:, :, i * dh: i * dh + sh * (Ho - 1) + 1: sh, j * dw: j * dw + sw * (Wo - 1) + 1: sw]
            for i in range(kh) for j in range(kw)]


def _im2col(x: torch.Tensor, kh: int, kw: int, st, pad, dil, Ho: int, Wo: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, kh*kw, Ho*Wo) from strided slices (any dtype)."""
    B, C = x.shape[:2]
    if kh == kw == 1 and st == (1, 1) and pad == (0, 0):
        return x.reshape(B, C, 1, Ho * Wo)
    return torch.stack(_taps(x, kh, kw, st, pad, dil, Ho, Wo), dim=2).reshape(B, C, kh * kw, Ho * Wo)


def _conv_fn(stride, padding, dilation, groups, Ho, Wo):
    """conv2d as im2col + (batched) GEMM, for any dtype."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        O, Cg, kh, kw = w.shape
        N = x.shape[0]
        G, K = groups, Cg * kh * kw
        if Cg == 1 and O == G:  # depthwise: multiply-add the kh*kw shifted slices
            out = None
            for t, sl in enumerate(_taps(x, kh, kw, stride, padding, dilation, Ho, Wo)):
                term = sl * w[:, 0].reshape(O, K)[:, t].reshape(1, O, 1, 1)
                out = term if out is None else out.add_(term)
            return out
        col = _im2col(x, kh, kw, stride, padding, dilation, Ho, Wo).reshape(N, G, K, Ho * Wo)
        out = torch.matmul(w.reshape(G, O // G, K), col)  # (N, G, O/G, Ho*Wo)
        return out.reshape(N, O, Ho, Wo)

    return fn


def int_conv2d(q_in: torch.Tensor, q_weight: torch.Tensor, bias: torch.Tensor | None = None,
               stride: IntPair = 1, padding: IntPair = 0, dilation: IntPair = 1,
               groups: int = 1, *, op: str = "conv2d") -> torch.Tensor:
    """Exact integer conv2d: the int64 accumulator ``sum(q_in * q_w) + bias``.

    No rounding happens here.  The convolution is an im2col + GEMM run in the
    fastest provably exact arithmetic (float32, float64 or int64) chosen from
    the bound ``k * max|q_in| * max|q_w|`` on every partial sum,
    ``k = Cin/groups * kh * kw`` (see the comment above).  Zero padding
    only: a pair, or four sides ``(t, l, b, r)``.  The bias is added in int64.  Checking the int32 range is the
    caller's choice (:func:`check_accumulator`).
    """
    x, w = _as_int(q_in), _as_int(q_weight)
    if x.dim() != 4 or w.dim() != 4:
        raise ConfigError(f"{op}: expected 4-D input and weight, got {tuple(x.shape)} and {tuple(w.shape)}")
    x, padding = pad_excess(x, padding)  # four sides: the excess as explicit zeros
    st, pad, dil, Ho, Wo = _conv_geometry(x.shape, w.shape, stride, padding, dilation, groups, op)
    k = w.shape[1] * w.shape[2] * w.shape[3]
    out = _exact_bilinear(_conv_fn(st, pad, dil, groups, Ho, Wo), x, w, k, op)
    if bias is not None:
        out = out + _as_int64(bias).reshape(1, -1, 1, 1)
    return out


def int_linear(q_in: torch.Tensor, q_weight: torch.Tensor, bias: torch.Tensor | None = None,
               *, op: str = "linear") -> torch.Tensor:
    """Exact integer linear: int64 accumulator ``q_in @ q_weight.T + bias``.

    Same kernel choice as :func:`int_conv2d` with ``k = in_features``.
    """
    x, w = _as_int(q_in), _as_int(q_weight)
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ConfigError(f"{op}: input {tuple(x.shape)} does not match weight {tuple(w.shape)}")
    out = _exact_bilinear(lambda p, q: torch.matmul(p, q.t()), x.reshape(-1, w.shape[1]), w,
                          w.shape[1], op)
    out = out.reshape(*x.shape[:-1], w.shape[0])
    return out + _as_int64(bias) if bias is not None else out


def int_matmul(qa: torch.Tensor, qb: torch.Tensor, *, op: str = "matmul") -> torch.Tensor:
    """Exact integer matmul of two feature maps (``torch.matmul`` semantics), int64 result.

    Same kernel choice as :func:`int_conv2d` with ``k = qa.shape[-1]``.
    """
    a, b = _as_int(qa), _as_int(qb)
    if a.dim() < 1 or b.dim() < 1 or a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        raise ConfigError(f"{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    return _exact_bilinear(torch.matmul, a, b, a.shape[-1], op)


# ---------------------------------------------------------------------------
# element-wise binary ops, concat


def _scalar_param(v, name: str) -> int:
    t = _as_int64(v)
    if t.numel() != 1:
        raise ConfigError(f"{name} must be a single (per-tensor) value, got {t.numel()} values")
    return int(t.reshape(()))


def _f64(scale: Scale, name: str) -> float:
    s = _scale_tensor(scale, name)
    if s.numel() != 1:
        raise ConfigError(f"{name} must be a per-tensor scale, got {s.numel()} values")
    return float(s.reshape(()).double())


def add_params(scale_a: Scale, scale_b: Scale, scale_out: Scale, mult_bits: int = 15,
               max_shift: int = 31) -> tuple[int, int, int, int]:
    """``(Ma, na, Mb, nb)`` for :func:`int_add`/:func:`int_sub` from the factors
    ``scale_a / scale_out`` and ``scale_b / scale_out`` (ratios taken in float64)."""
    sa, sb, so = _f64(scale_a, "scale_a"), _f64(scale_b, "scale_b"), _f64(scale_out, "scale_out")
    Ma, na = requant_params(sa / so, mult_bits=mult_bits, max_shift=max_shift)
    Mb, nb = requant_params(sb / so, mult_bits=mult_bits, max_shift=max_shift)
    return int(Ma), int(na), int(Mb), int(nb)


def round_scaled_sum(ta: torch.Tensor, na, tb: torch.Tensor, nb) -> torch.Tensor:
    """``round_half_even(ta / 2**na + tb / 2**nb)`` exactly, in int64, for any shifts in [0, 61].

    Each term is split into its floor and its remainder; the remainders are
    brought to the common denominator ``2**max(na, nb)`` (always < 2**61, so
    no product or sum can overflow), added with the carry, and the total is
    rounded once. ``na``/``nb`` may be tensors broadcasting against the terms.
    """
    na = torch.as_tensor(na, dtype=torch.int64)
    nb = torch.as_tensor(nb, dtype=torch.int64)
    s = torch.maximum(na, nb)
    qa, qb = ta >> na, tb >> nb
    ra = (ta - (qa << na)) << (s - na)  # remainders over 2**s, each in [0, 2**s)
    rb = (tb - (qb << nb)) << (s - nb)
    r = ra + rb  # < 2**(s+1) <= 2**62
    one = torch.ones_like(s)
    carry = r >> s
    q = qa + qb + carry
    r = r - (carry << s)
    half = (one << s) >> 1
    up = (r > half) | ((r == half) & (half > 0) & ((q & 1) == 1))
    return q + up.to(q.dtype)


def _int_addsub(qa, Ma, na, qb, Mb, nb, out_dtype, sign: int, op: str) -> torch.Tensor:
    a, b = _as_int64(qa), _as_int64(qb)
    Ma, na = _scalar_param(Ma, "Ma"), _scalar_param(na, "na")
    Mb, nb = _scalar_param(Mb, "Mb"), _scalar_param(nb, "nb")
    if min(na, nb) < 0 or max(na, nb) > 61:
        raise ConfigError(f"{op}: shifts must be in [0, 61], got na={na}, nb={nb}")
    bound = max(_extreme(a) * abs(Ma), _extreme(b) * abs(Mb))
    if bound >= _MUL_LIMIT:
        raise AccumulatorOverflow(op, bound, _MUL_LIMIT, what="operand * multiplier")
    return _clamp_to(round_scaled_sum(a * Ma, na, sign * (b * Mb), nb), out_dtype)


def int_add(qa, Ma, na, qb, Mb, nb, out_dtype="qint8", *, op: str = "add") -> torch.Tensor:
    """Integer add of two feature maps with their own multipliers.

    ``clamp(round_half_even(qa*Ma/2**na + qb*Mb/2**nb))`` computed exactly
    (:func:`round_scaled_sum`): a single rounding for the whole op.  Get the parameters from
    :func:`add_params`.  Operands broadcast like ``torch.add``.
    """
    return _int_addsub(qa, Ma, na, qb, Mb, nb, out_dtype, 1, op)


def int_sub(qa, Ma, na, qb, Mb, nb, out_dtype="qint8", *, op: str = "sub") -> torch.Tensor:
    """Integer ``a - b``; same scheme and rounding (half to even) as :func:`int_add`."""
    return _int_addsub(qa, Ma, na, qb, Mb, nb, out_dtype, -1, op)


def int_mul(qa, qb, M, n, out_dtype="qint8", *, op: str = "mul") -> torch.Tensor:
    """Integer element-wise product: ``requantize(qa * qb, M, n)``.

    ``(M, n)`` come from ``requant_params(s_a * s_b / s_out)``; the product is
    exact in int64 and rounded once, half to even.
    """
    return requantize(_as_int64(qa) * _as_int64(qb), M, n, out_dtype, op=op)


def div_params(scale_a: Scale, scale_b: Scale, scale_out: Scale, b_dtype="qint8", *, mult_bits: int = 15,
               max_shift: int = 31) -> tuple[torch.Tensor, torch.Tensor]:
    """Reciprocal table of :func:`int_div`: ``(M, n)``, one entry per code ``q`` of the divisor
    (index ``q - qmin``), with ``M[q] / 2**n[q] ~= s_a / (s_b * s_out * q)``.

    ``s_a / (s_b * s_out)`` is formed in float64, then divided by each code (float64); the
    entry of code 0 is ``(0, 0)`` (unused: :func:`int_div` saturates there).  256 entries for
    a qint8 divisor, 65536 for qint16.  A factor too large for the multiplier raises
    :class:`ConfigError` (as :func:`requant_params`).
    """
    if _norm_dtype(b_dtype) == "qint32":
        raise ConfigError("div_params: a qint32 divisor would need a 2**32-entry table; use qint8/qint16")
    lo, hi = qrange(b_dtype)
    base = _f64(scale_a, "scale_a") / (_f64(scale_b, "scale_b") * _f64(scale_out, "scale_out"))
    codes = torch.arange(lo, hi + 1, dtype=torch.float64)
    real = torch.where(codes == 0, 0.0, base / torch.where(codes == 0, 1.0, codes))
    return requant_params(real, mult_bits=mult_bits, max_shift=max_shift)


def int_div(qa, qb, M, n, b_dtype="qint8", out_dtype="qint8", *, op: str = "div") -> torch.Tensor:
    """Integer element-wise ``a / b`` of two feature maps through a reciprocal table.

    ``y = clamp(round_half_even(qa * M[qb] / 2**n[qb]))`` exactly in int64, with ``(M, n)``
    from :func:`div_params` (indexed by ``qb - qmin``): one rounding, like the fake-quant
    model's ``round(a / b / s_out)``.  A divisor code 0 saturates: ``qmax`` for ``qa > 0``,
    ``qmin`` for ``qa < 0`` (the fake-quant model's ``+-inf`` clamped) and 0 for ``qa == 0``
    (where the float model gives NaN).  Operands broadcast like ``torch.div``.
    """
    a, b = _as_int64(qa), _as_int64(qb)
    M, n = _as_int64(M), _as_int64(n)
    lo, hi = qrange(b_dtype)
    if M.dim() != 1 or M.shape != n.shape or M.numel() != hi - lo + 1:
        raise ConfigError(f"{op}: the reciprocal table has {M.numel()} entries, expected {hi - lo + 1} for a "
                          f"{_norm_dtype(b_dtype)} divisor")
    if b.numel() and (int(b.min()) < lo or int(b.max()) > hi):
        raise ConfigError(f"{op}: divisor values outside the {_norm_dtype(b_dtype)} range")
    a, b = torch.broadcast_tensors(a, b)
    Mq, nq = M[b - lo], n[b - lo]
    _check_product(a, Mq, op)
    y = rounding_shift(a * Mq, nq)
    _, qmax = qrange(out_dtype)
    y = torch.where(b == 0, torch.sign(a) * (qmax + 1), y)  # clamps to qmax / qmin below
    return _clamp_to(y, out_dtype)


def int_cat(qs: Sequence[torch.Tensor], in_scales: Sequence[Scale], out_scale: Scale,
            out_dtype="qint8", dim: int = 0, *, mult_bits: int = 15, max_shift: int = 31,
            op: str = "cat") -> torch.Tensor:
    """Concatenate after requantizing each input to the output scale.

    Input ``i`` uses ``requant_params(s_i / s_out)`` (half-to-even rounding); an
    input already at the output scale passes through unchanged (M/2**n == 1
    is exact).
    """
    if len(qs) != len(in_scales) or not qs:
        raise ConfigError(f"{op}: need one scale per input, got {len(qs)} inputs and "
                          f"{len(in_scales)} scales")
    params = cat_params(in_scales, out_scale, mult_bits=mult_bits, max_shift=max_shift)
    parts = [requantize(q, M, n, out_dtype, op=f"{op}[{i}]") for i, (q, (M, n)) in enumerate(zip(qs, params))]
    return torch.cat(parts, dim=dim)


def cat_params(in_scales: Sequence[Scale], out_scale: Scale, *, mult_bits: int = 15,
               max_shift: int = 31) -> list[tuple[int, int]]:
    """``(M, n)`` of each :func:`int_cat` input: ``requant_params(s_i / s_out)``, the ratio in float64
    (the ONNX export requantizes with these too)."""
    so = _f64(out_scale, "out_scale")
    out = []
    for i, s in enumerate(in_scales):
        M, n = requant_params(_f64(s, f"in_scales[{i}]") / so, mult_bits=mult_bits, max_shift=max_shift)
        out.append((int(M), int(n)))
    return out


# ---------------------------------------------------------------------------
# pooling


def int_avg_pool2d(q: torch.Tensor, kernel_size: IntPair, stride: IntPair | None = None,
                   padding: IntPair = 0, *, in_scale: Scale, out_scale: Scale,
                   out_dtype="qint8", mult_bits: int = 15, max_shift: int = 31,
                   op: str = "avg_pool2d") -> torch.Tensor:
    """Average pool: exact integer window sum, then requantize by ``s_in / (kh*kw*s_out)``.

    ``count_include_pad=True`` semantics (the divisor is always ``kh*kw``; the padding may be
    four-sided); ``ceil_mode`` is not supported.  Rounding: half to even (:func:`requantize`).
    """
    kh, kw = _pair(kernel_size)
    x, padding = pad_excess(_as_int64(q), padding)  # four sides: the excess as explicit (counted) zeros
    # float64 window sums of at most kh*kw ints < 2**31 each are exact
    if _extreme(x) * kh * kw >= _F64_EXACT:
        raise AccumulatorOverflow(op, _extreme(x) * kh * kw, _F64_EXACT, what="window sum")
    s = F.avg_pool2d(x.double(), (kh, kw), stride if stride is not None else (kh, kw), padding,
                     ceil_mode=False, count_include_pad=True, divisor_override=1).to(torch.int64)
    check_accumulator(s, 32, op=op)
    M, n = avg_pool_params((kh, kw), in_scale, out_scale, mult_bits=mult_bits, max_shift=max_shift)
    return requantize(s, M, n, out_dtype, op=op)


def avg_pool_params(kernel_size: IntPair, in_scale: Scale, out_scale: Scale, *, mult_bits: int = 15,
                    max_shift: int = 31) -> tuple[int, int]:
    """``(M, n)`` of :func:`int_avg_pool2d`: the factor ``s_in / (kh * kw * s_out)`` in float64."""
    kh, kw = _pair(kernel_size)
    M, n = requant_params(_f64(in_scale, "in_scale") / (kh * kw * _f64(out_scale, "out_scale")),
                          mult_bits=mult_bits, max_shift=max_shift)
    return int(M), int(n)


def int_global_avg_pool(q: torch.Tensor, in_scale: Scale, out_scale: Scale, out_dtype="qint8",
                        *, mult_bits: int = 15, max_shift: int = 31,
                        op: str = "global_avg_pool") -> torch.Tensor:
    """Global average pool over the last two dims (keepdim, like adaptive_avg_pool2d(1)).

    Exact int64 sum over ``H*W``, then requantize by ``s_in / (H*W*s_out)``
    (half to even).
    """
    x = _as_int64(q)
    hw = x.shape[-2] * x.shape[-1]
    if hw == 0:
        raise ConfigError(f"{op}: empty spatial size {tuple(x.shape)}")
    s = x.sum(dim=(-2, -1), keepdim=True)
    check_accumulator(s, 32, op=op)  # the BPU sums in an int32 accumulator
    M, n = global_avg_pool_params(hw, in_scale, out_scale, mult_bits=mult_bits, max_shift=max_shift)
    return requantize(s, M, n, out_dtype, op=op)


def global_avg_pool_params(hw: int, in_scale: Scale, out_scale: Scale, *, mult_bits: int = 15,
                           max_shift: int = 31) -> tuple[int, int]:
    """``(M, n)`` of :func:`int_global_avg_pool` over ``hw`` positions: the factor
    ``s_in / (hw * s_out)`` in float64."""
    return requant_params(_f64(in_scale, "in_scale") / (hw * _f64(out_scale, "out_scale")),
                          mult_bits=mult_bits, max_shift=max_shift)


def max_pool_out_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """Output length of torch's max_pool2d along one axis.

    With ``ceil_mode`` torch drops a last window that would start in the right
    padding; ONNX's MaxPool does not, so the exporter trims to this length.
    """
    num = size + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil else num // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def int_max_pool2d(q: torch.Tensor, kernel_size: IntPair, stride: IntPair | None = None,
                   padding: IntPair = 0, dilation: IntPair = 1, ceil_mode: bool = False) -> torch.Tensor:
    """Max pool on integers: exact, no rescaling (input and output share the scale)."""
    return F.max_pool2d(q, kernel_size, stride if stride is not None else kernel_size, padding,
                        dilation, ceil_mode)


# ---------------------------------------------------------------------------
# lookup tables and activations


def build_lut(fn: Callable[[torch.Tensor], torch.Tensor], in_scale: Scale, out_scale: Scale,
              in_dtype="qint8", out_dtype="qint8") -> torch.Tensor:
    """Lookup table of an element-wise function, built at convert time.

    ``T[q - qmin] = clamp(round_half_even(fn(q * s_in) / s_out))`` for every
    ``q`` of ``in_dtype``; ``fn`` is evaluated in float64 on a float64 tensor
    (e.g. ``torch.sigmoid``).  256 entries for qint8 input, 65536 for qint16.
    Returned in the storage dtype of ``out_dtype``.
    """
    lo, hi = qrange(in_dtype)
    if _norm_dtype(in_dtype) == "qint32":
        raise ConfigError("build_lut: a qint32 input would need a 2**32-entry table; use qint8/qint16")
    si, so = _f64(in_scale, "in_scale"), _f64(out_scale, "out_scale")
    x = torch.arange(lo, hi + 1, dtype=torch.float64) * si
    y = torch.as_tensor(fn(x)).to(torch.float64)
    if y.shape != x.shape:
        raise ConfigError(f"build_lut: fn must be element-wise, got shape {tuple(y.shape)} "
                          f"for input shape {tuple(x.shape)}")
    if bool(torch.isnan(y).any()):
        raise ConfigError("build_lut: fn returned NaN on the input range")
    return _clamp_to(torch.round(y / so), out_dtype)


def apply_lut(q: torch.Tensor, table: torch.Tensor, in_dtype="qint8") -> torch.Tensor:
    """Apply a :func:`build_lut` table: ``table[q - qmin]`` (exact, no arithmetic)."""
    lo, hi = qrange(in_dtype)
    if table.dim() != 1 or table.numel() != hi - lo + 1:
        raise ConfigError(f"apply_lut: table has shape {tuple(table.shape)}, expected "
                          f"({hi - lo + 1},) for {_norm_dtype(in_dtype)} input")
    x = _as_int64(q)
    if x.numel() and (int(x.min()) < lo or int(x.max()) > hi):
        raise ConfigError(f"apply_lut: input values outside the {_norm_dtype(in_dtype)} range")
    return table[x - lo]


def relu(q: torch.Tensor) -> torch.Tensor:
    """ReLU on integers: ``max(q, 0)`` (exact; zero point is 0, scale unchanged)."""
    return q.clamp(min=0)


def relu6(q: torch.Tensor, scale: Scale, dtype="qint8") -> torch.Tensor:
    """ReLU6 on integers: ``clamp(q, 0, round_half_even(6 / scale))`` (float32 division,
    the same rounding as :func:`quantize`), the upper bound capped at qmax."""
    _, qmax = qrange(dtype)
    s = _scale_tensor(scale)
    if s.numel() != 1:
        raise ConfigError("relu6: expects a per-tensor scale")
    top = min(int(torch.round(torch.tensor(6.0, dtype=torch.float32) / s.reshape(()))), qmax)
    return q.clamp(0, top)


def leaky_relu(q: torch.Tensor, M_slope, n_slope, out_dtype="qint8") -> torch.Tensor:
    """Leaky ReLU on integers, input and output at the same scale.

    ``y = q`` where ``q >= 0`` else ``requantize(q, M_slope, n_slope)``, with
    ``(M_slope, n_slope) = requant_params(negative_slope)``.  The negative
    branch rounds half to even (e.g. ``-5 * 0.5 = -2.5 -> -2``, ``-3 * 0.5 -> -2``),
    like the fake-quant model.
    """
    x = _as_int64(q)
    neg = requantize(x, M_slope, n_slope, "qint32", op="leaky_relu").to(torch.int64)
    return _clamp_to(torch.where(x >= 0, x, neg), out_dtype)


# ---------------------------------------------------------------------------
# layer norm (nash): one integer definition for the module, the simulator and the ONNX export
#
# Over each group of the last ``dims`` dims (N = product of their sizes <= 2**16 elements, int8 or
# int16 codes q, |q| <= 2**15), with x = q * s_in:
#
#   S1 = sum(q), S2 = sum(q*q)                 exact int64: |S1| <= 2**31, S2 <= 2**46
#   V  = N*S2 - S1*S1                          = N**2 * var(q) = sum(d*d) / N, in [0, 2**62]
#   W  = max(V + E, 1), E = round(eps / s_in**2 * N**2) clamped to [0, 2**62)   (W < 2**63)
#   d  = N*q - S1                              = N * (q - mean), |d| <= N * 65535 < 2**32
#   p  = #{j in 1..31 : W >= 4**j}             (W in [4**p, 4**(p+1)): a comparison ladder)
#   t  = floor(W * 2**T / 4**p)                in [2**T, 2**(T+2)), T = LN_RSQRT_BITS
#   R  = RSQRT[t - 2**T]                       = round(2**F / sqrt((t + 1/2) / 2**T)), F = LN_RSQRT_FRAC
#   z  = round(d * R / 2**(p + F - Z))         the normalized value (q - mean) / sqrt(var + eps) times
#                                              2**Z (Z = LN_NORM_FRAC); |d * R| < 2**62, |z| < 2**25
#   y  = clamp(round((z * M[c] + B[c]) / 2**(n[c] + Z)))
#
# with (M[c], n[c]) = requant_params(gamma[c] / s_out, 24 bits, shift <= 28) and
# B[c] = round(beta[c] / s_out * 2**(n[c] + Z)) clamped to +-2**61 (a clamped bias saturates the
# output anyway: 2**61 / 2**44 > 4 * 32767), so |z * M + B| < 2**62. Every rounding is half to even
# (odd-symmetric, so a negative value rounds as its magnitude). No shift of d is needed: V is formed
# from S1 and S2 instead of sum(d*d) (which would reach N * 2**64). The only approximation besides
# the output rounding is the rsqrt table's bucket (relative error < 2**-(T+2)) and the rounding of z.

LN_RSQRT_BITS = 10  # T: the table holds 3 * 2**T entries, one per top-(T+2)-bit pattern of W / 4**p
LN_RSQRT_FRAC = 30  # F: table entries are rsqrt in [1/2, 1] with 30 fraction bits
LN_NORM_FRAC = 16  # Z: fraction bits of the normalized value z
LN_MULT_BITS = 24  # gamma / s_out multipliers
LN_MAX_SHIFT = 28  # n[c] <= 28, so n[c] + Z <= 44
LN_MAX_GROUP = 1 << 16  # N: the overflow bounds above hold up to this group size
LN_MAX_EPS_UNITS = (1 << 62) - 1
LN_BIAS_LIMIT = 1 << 61


def layer_norm_rsqrt_table() -> torch.Tensor:
    """The rsqrt table of :func:`int_layer_norm` (int64, ``3 * 2**LN_RSQRT_BITS`` entries): entry
    ``i`` is ``round_half_even(2**F / sqrt((i + 2**T + 1/2) / 2**T))``, the bucket's midpoint."""
    T, F_ = LN_RSQRT_BITS, LN_RSQRT_FRAC
    t = torch.arange(1 << T, 1 << (T + 2), dtype=torch.float64)
    return torch.round(float(1 << F_) / torch.sqrt((t + 0.5) / float(1 << T))).to(torch.int64)


def layer_norm_eps_units(eps: float, in_scale: Scale, group: int) -> int:
    """``E = round_half_even(eps / s_in**2 * N**2)`` (float64), clamped to ``[0, 2**62)``: eps in the
    units of ``V = N**2 * var(q)``."""
    s = _f64(in_scale, "in_scale")
    e = float(torch.round(torch.tensor(float(eps), dtype=torch.float64) / (s * s) * float(group) ** 2))
    if not e >= 0.0:  # negative eps (or NaN)
        raise ConfigError(f"layer_norm: eps must be >= 0, got {eps!r}")
    return LN_MAX_EPS_UNITS if e >= 2.0 ** 62 else int(e)


def layer_norm_params(weight: torch.Tensor | None, bias: torch.Tensor | None, shape: Sequence[int],
                      out_scale: Scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element ``(M, n, B)`` (int64, of the normalized ``shape``) of :func:`int_layer_norm`:
    ``M / 2**n ~= gamma / s_out`` (``LN_MULT_BITS``, ``n <= LN_MAX_SHIFT``) and
    ``B = round_half_even(beta / s_out * 2**(n + LN_NORM_FRAC))`` clamped to ``+-2**61``. No weight
    means gamma = 1, no bias beta = 0. A gamma too large for the output scale raises ConfigError."""
    shape = tuple(int(s) for s in shape)
    so = _f64(out_scale, "out_scale")
    g = torch.ones(shape, dtype=torch.float64) if weight is None else weight.detach().to(torch.float64)
    b = torch.zeros(shape, dtype=torch.float64) if bias is None else bias.detach().to(torch.float64)
    if tuple(g.shape) != shape or tuple(b.shape) != shape:
        raise ConfigError(f"layer_norm: weight {tuple(g.shape)} and bias {tuple(b.shape)} must have the "
                          f"normalized shape {shape}")
    if not bool(torch.isfinite(g).all() & torch.isfinite(b).all()):
        raise ConfigError("layer_norm: weight and bias must be finite")
    M, n = requant_params(g / so, mult_bits=LN_MULT_BITS, max_shift=LN_MAX_SHIFT)
    B = torch.round(b / so * torch.pow(2.0, (n + LN_NORM_FRAC).to(torch.float64)))
    B = B.clamp(-float(LN_BIAS_LIMIT), float(LN_BIAS_LIMIT)).to(torch.int64)
    return M, n, B


def layer_norm_exponent(W: torch.Tensor) -> torch.Tensor:
    """``p`` with ``4**p <= W < 4**(p+1)`` for int64 ``W >= 1``: the count of ``j`` in 1..31 with
    ``W >= 4**j`` (the comparison ladder the ONNX export writes)."""
    powers = torch.tensor([1 << (2 * j) for j in range(1, 32)], dtype=torch.int64)
    return (W.unsqueeze(-1) >= powers).sum(-1).to(torch.int64)


def int_layer_norm(q: torch.Tensor, dims: int, eps_units: int, M: torch.Tensor, n: torch.Tensor,
                   B: torch.Tensor, out_dtype="qint8", *, op: str = "layer_norm") -> torch.Tensor:
    """Integer layer norm over the last ``dims`` dims (the kernel of the comment above), with
    ``eps_units`` from :func:`layer_norm_eps_units` and ``(M, n, B)`` from :func:`layer_norm_params`
    (of the normalized shape). Inputs must be int8/int16 codes and the group at most 2**16 elements
    (the bounds that make every step exact in int64); else ConfigError."""
    x = _as_int64(q)
    M, n, B = _as_int64(M), _as_int64(n), _as_int64(B)
    if not 1 <= dims <= x.dim() or tuple(x.shape[x.dim() - dims:]) != tuple(M.shape) or \
            M.shape != n.shape or M.shape != B.shape:
        raise ConfigError(f"{op}: the parameters have shape {tuple(M.shape)} but the input {tuple(x.shape)} is "
                          f"normalized over its last {dims} dims")
    N = 1
    for s in M.shape:
        N *= int(s)
    if not 1 <= N <= LN_MAX_GROUP:
        raise ConfigError(f"{op}: the normalized group has {N} elements; the integer kernel takes 1..{LN_MAX_GROUP}")
    if _extreme(x) > 1 << 15:
        raise ConfigError(f"{op}: input codes outside the int16 range; the kernel takes int8/int16 input")
    if not 0 <= int(eps_units) <= LN_MAX_EPS_UNITS:
        raise ConfigError(f"{op}: eps_units {eps_units} outside [0, 2**62)")
    if bool((n < 0).any()) or bool((n > LN_MAX_SHIFT).any()) or _extreme(M) >= 1 << LN_MULT_BITS or \
            _extreme(B) > LN_BIAS_LIMIT:
        raise ConfigError(f"{op}: multipliers, shifts or bias codes outside their ranges")
    axes = tuple(range(x.dim() - dims, x.dim()))
    S1 = x.sum(dim=axes, keepdim=True)
    S2 = (x * x).sum(dim=axes, keepdim=True)
    W = (N * S2 - S1 * S1 + int(eps_units)).clamp(min=1)
    p = layer_norm_exponent(W)
    T = LN_RSQRT_BITS
    up = (T - 2 * p).clamp(min=0)
    down = (2 * p - T).clamp(min=0)
    t = (W << up) >> down
    R = layer_norm_rsqrt_table()[t - (1 << T)]
    d = N * x - S1
    z = rounding_shift(d * R, p + (LN_RSQRT_FRAC - LN_NORM_FRAC))
    acc = z * M + B
    return _clamp_to(rounding_shift(acc, n + LN_NORM_FRAC), out_dtype)


# ---------------------------------------------------------------------------
# softmax (nash): a max-subtracted exponential table, an int64 sum, one integer division
#
# ``q`` symmetric int8/int16 at ``s_in``; along ``dim``:
#   d = max(q) - q  (>= 0)          E = EXP[min(d, len(EXP) - 1)]   (E[0] = 2**SOFTMAX_EXP_BITS)
#   S = sum(E)  (int64)             y = clamp((E * M + (S << n) // 2) // (S << n))
# with ``M / 2**n ~= 1 / s_out`` (SOFTMAX_MULT_BITS-bit M): ``y = round_half_up(E / (S * s_out))``,
# the one rounding of the exact rational ``E * M / (S * 2**n)`` (a tie needs an even divisor; it rounds
# up).  Bounds: E <= 2**16 and an axis of at most SOFTMAX_MAX_LEN = 2**16 elements give S <= 2**32;
# n <= SOFTMAX_MAX_SHIFT = 30 gives S << n <= 2**62 and E * M < 2**40, so every int64 step is exact.

SOFTMAX_EXP_BITS = 16  # fraction bits of the exponential table: exp(0) = 1.0 is 2**16
SOFTMAX_MAX_LEN = 1 << 16  # the longest softmax axis: S = sum(E) <= 2**32
SOFTMAX_MULT_BITS = 24  # |M / 2**n - 1 / s_out| <= 2**-24 relative: < 2**-9 LSB on a 16-bit output
SOFTMAX_MAX_SHIFT = 30  # S << n <= 2**62


def softmax_exp_table(in_scale: Scale, in_dtype="qint8") -> torch.Tensor:
    """The exponential table of :func:`int_softmax`: ``EXP[d] = round_half_even(exp(-d * s_in) * 2**16)``
    for ``d = max - q`` over the input type's code span (256 entries for qint8, 65536 for qint16),
    evaluated in float64, cut after its first 0 (every later entry is 0 too: ``exp`` decreases), int32."""
    if _norm_dtype(in_dtype) not in ("qint8", "qint16"):
        raise ConfigError(f"softmax_exp_table: input must be qint8 or qint16, got {_norm_dtype(in_dtype)}")
    lo, hi = qrange(in_dtype)
    si = _f64(in_scale, "in_scale")
    if not si > 0:
        raise ConfigError(f"softmax_exp_table: in_scale must be > 0, got {si}")
    d = torch.arange(0, hi - lo + 1, dtype=torch.float64)
    e = torch.round(torch.exp(-d * si) * float(1 << SOFTMAX_EXP_BITS))
    zeros = torch.nonzero(e == 0)
    if zeros.numel():
        e = e[: int(zeros[0, 0]) + 1]
    return e.to(torch.int32)


def softmax_params(out_scale: Scale) -> tuple[int, int]:
    """``(M, n)`` with ``M / 2**n ~= 1 / s_out`` (:data:`SOFTMAX_MULT_BITS`-bit ``M``, ``n <= 30``)."""
    so = _f64(out_scale, "out_scale")
    if not so > 0:
        raise ConfigError(f"softmax_params: out_scale must be > 0, got {so}")
    M, n = requant_params(1.0 / so, mult_bits=SOFTMAX_MULT_BITS, max_shift=SOFTMAX_MAX_SHIFT)
    return int(M), int(n)


def _softmax_operands(x: torch.Tensor, dim: int, table: torch.Tensor, M, n, op: str
                      ) -> tuple[int, int, torch.Tensor]:
    """``(M, n, table as int64)`` after the checks the softmax kernels' int64 steps rely on: ``dim`` in
    range, ``(M, n)`` and the table as :func:`softmax_params` / :func:`softmax_exp_table` build them, the
    axis no longer than :data:`SOFTMAX_MAX_LEN`; ConfigError naming ``op`` otherwise."""
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ConfigError(f"{op}: dim {dim} is out of range for a {x.dim()}-d input")
    M, n = int(M), int(n)
    if not (0 < M < (1 << SOFTMAX_MULT_BITS) and 0 <= n <= SOFTMAX_MAX_SHIFT):
        raise ConfigError(f"{op}: multiplier {M} / shift {n} outside (0, 2**{SOFTMAX_MULT_BITS}) / "
                          f"[0, {SOFTMAX_MAX_SHIFT}]; build them with softmax_params")
    t = _as_int64(table)
    if t.dim() != 1 or t.numel() == 0 or int(t.max()) > (1 << SOFTMAX_EXP_BITS) or int(t.min()) < 0:
        raise ConfigError(f"{op}: exponential table must be 1-d with entries in [0, 2**{SOFTMAX_EXP_BITS}]; "
                          f"build it with softmax_exp_table")
    if x.dim() and x.shape[dim] > SOFTMAX_MAX_LEN:
        raise ConfigError(f"{op}: softmax axis of {x.shape[dim]} elements > {SOFTMAX_MAX_LEN} (the int64 "
                          f"sum bound); split the axis or run the softmax on the CPU")
    return M, n, t


def int_softmax(q: torch.Tensor, dim: int, table: torch.Tensor, M: int, n: int, out_dtype="qint8", *,
                op: str = "softmax") -> torch.Tensor:
    """softmax of the integers ``q`` along ``dim`` on the output grid (the definition above this function),
    exact in int64. ConfigError (naming ``op``) for an axis longer than :data:`SOFTMAX_MAX_LEN` or
    parameters outside the bounds the int64 steps rely on."""
    x = _as_int64(q)
    M, n, t = _softmax_operands(x, dim, table, M, n, op)
    if x.numel() == 0:
        return _clamp_to(x, out_dtype)
    d = (x.amax(dim, keepdim=True) - x).clamp(max=t.numel() - 1)
    e = t[d]
    den = e.sum(dim, keepdim=True) << n
    y = torch.div(e * M + (den >> 1), den, rounding_mode="floor")
    return _clamp_to(y, out_dtype)


# log_softmax (nash): the same exponential table and sum, then ln(S) from two tables.
#
# With d = max(q) - q, E, S as in int_softmax (S in [2**16, 2**32]), ``M / 2**n ~= s_in / s_out``:
#   c = #{j in 17..32 : S >= 2**j}            (k = 16 + c = floor(log2 S))
#   r = (S + 2**(k-16)) >> (k-15)  - 2**15    (S / 2**k ~= 1 + r / 2**15, r in [0, 2**15])
#   w = LOG_K[c] + LOG_F[r] + d * M           (>= 0; LOG_K[c] = c ln2, LOG_F[r] = ln(1 + r/2**15), both
#                                              in units of s_out / 2**n, rounded half to even)
#   y = clamp(-((w + 2**(n-1)) >> n))         (the nearest code to (t * s_in - ln(S / 2**16)) / s_out,
#                                              a tie rounding away from zero)
# ln(S / 2**16) is off by at most 2**-16 (the 15-bit mantissa) plus the table roundings.

LOG_SOFTMAX_MANTISSA_BITS = 15
_LOG_TABLE_LIMIT = 1 << 60
_LN2 = float(torch.log(torch.tensor(2.0, dtype=torch.float64)))


def log_softmax_params(in_scale: Scale, out_scale: Scale) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """``(M, n, LOG_K, LOG_F)`` of :func:`int_log_softmax`: ``M / 2**n ~= s_in / s_out`` (24-bit ``M``,
    ``n <= 30``) and the two int64 log tables (17 and ``2**15 + 1`` entries) in units of ``s_out / 2**n``."""
    si, so = _f64(in_scale, "in_scale"), _f64(out_scale, "out_scale")
    if not (si > 0 and so > 0):
        raise ConfigError(f"log_softmax_params: scales must be > 0, got in {si}, out {so}")
    M, n = (int(v) for v in requant_params(si / so, mult_bits=SOFTMAX_MULT_BITS, max_shift=SOFTMAX_MAX_SHIFT))
    if M == 0:
        raise ConfigError(f"log_softmax_params: s_in / s_out = {si / so:g} is too small for a 24-bit "
                          f"multiplier with a shift <= {SOFTMAX_MAX_SHIFT}; use a finer output scale")
    unit = float(1 << n) / so
    B = LOG_SOFTMAX_MANTISSA_BITS
    log_k = torch.round(torch.arange(17, dtype=torch.float64) * _LN2 * unit).to(torch.int64)
    log_f = torch.round(torch.log1p(torch.arange((1 << B) + 1, dtype=torch.float64) / (1 << B)) * unit
                        ).to(torch.int64)
    if max(int(log_k[-1]), int(log_f[-1])) >= _LOG_TABLE_LIMIT:  # w < 2**61 + 2**40: no int64 overflow
        raise ConfigError(f"log_softmax_params: out_scale {so:g} is too fine for int64 log tables at "
                          f"shift {n}; use a coarser output scale")
    return M, n, log_k, log_f


def int_log_softmax(q: torch.Tensor, dim: int, table: torch.Tensor, M: int, n: int, log_k: torch.Tensor,
                    log_f: torch.Tensor, out_dtype="qint8", *, op: str = "log_softmax") -> torch.Tensor:
    """log_softmax of the integers ``q`` along ``dim`` on the output grid (the definition above
    :func:`log_softmax_params`), exact in int64; ConfigError (naming ``op``) outside its bounds."""
    x = _as_int64(q)
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ConfigError(f"{op}: dim {dim} is out of range for a {x.dim()}-d input")
    M, n = int(M), int(n)
    B = LOG_SOFTMAX_MANTISSA_BITS
    if not (0 < M < (1 << SOFTMAX_MULT_BITS) and 0 <= n <= SOFTMAX_MAX_SHIFT):
        raise ConfigError(f"{op}: multiplier {M} / shift {n} outside its bounds; build them with "
                          f"log_softmax_params")
    t, lk, lf = _as_int64(table), _as_int64(log_k), _as_int64(log_f)
    if t.dim() != 1 or t.numel() == 0 or int(t[0]) != 1 << SOFTMAX_EXP_BITS or int(t.min()) < 0 \
            or lk.shape != (17,) or lf.shape != ((1 << B) + 1,):
        raise ConfigError(f"{op}: tables of the wrong form; build them with softmax_exp_table and "
                          f"log_softmax_params")
    if x.dim() and x.shape[dim] > SOFTMAX_MAX_LEN:
        raise ConfigError(f"{op}: axis of {x.shape[dim]} elements > {SOFTMAX_MAX_LEN} (the int64 sum "
                          f"bound); split the axis or run it on the CPU")
    if x.numel() == 0:
        return _clamp_to(x, out_dtype)
    d = x.amax(dim, keepdim=True) - x
    S = t[d.clamp(max=t.numel() - 1)].sum(dim, keepdim=True)
    c = (S.unsqueeze(-1) >= (torch.ones(16, dtype=torch.int64) << torch.arange(17, 33))).sum(-1)
    shift = c + (SOFTMAX_EXP_BITS - B)
    r = ((S + (torch.ones_like(shift) << (shift - 1))) >> shift) - (1 << B)
    w = lk[c] + lf[r] + d * M
    y = -((w + ((1 << n) >> 1)) >> n)
    return _clamp_to(y, out_dtype)


# ---------------------------------------------------------------------------
# reductions over any dims (nash): sum / mean requantized once, max / min on the input's grid

REDUCE_MODES = ("sum", "mean", "amax", "amin")
SELECTING_MODES = ("amax", "amin")  # the result is one of the inputs: exact, on the input's grid


def reduce_dims(dims, rank: int, op: str = "reduce") -> tuple[int, ...]:
    """``dims`` (an int, a sequence, or None / () for every dim) as sorted non-negative dims of a
    ``rank``-D tensor; ConfigError for a dim out of range or given twice."""
    if dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0):
        return tuple(range(rank))
    seq = dims if isinstance(dims, (tuple, list)) else (dims,)
    out = []
    for d in seq:
        if isinstance(d, bool) or not isinstance(d, int) or not -rank <= d < max(rank, 1):
            raise ConfigError(f"{op}: dim {d!r} is out of range for a {rank}-D tensor")
        out.append(d % max(rank, 1))
    if len(set(out)) != len(out):
        raise ConfigError(f"{op}: dim {tuple(seq)} names a dim twice")
    return tuple(sorted(out))


def reduce_params(mode: str, count: int, in_scale: Scale, out_scale: Scale, *, mult_bits: int = 15,
                  max_shift: int = 31) -> tuple[int, int]:
    """``(M, n)`` of :func:`int_reduce`: ``s_in / s_out`` for a sum, ``s_in / (count * s_out)`` for a mean
    (the ``1 / count`` folded into the one multiplier), in float64. A selecting mode has none: (1, 0)."""
    if mode in SELECTING_MODES:
        return 1, 0
    if mode not in REDUCE_MODES:
        raise ConfigError(f"reduce: mode {mode!r} is not one of {REDUCE_MODES}")
    if count <= 0:
        raise ConfigError(f"reduce: {mode} over {count} elements")
    real = _f64(in_scale, "in_scale") / (_f64(out_scale, "out_scale") * (count if mode == "mean" else 1))
    M, n = requant_params(real, mult_bits=mult_bits, max_shift=max_shift)
    return int(M), int(n)


def int_reduce(q: torch.Tensor, mode: str, dims, keepdim: bool, M: int = 1, n: int = 0, out_dtype="qint8",
               *, op: str = "reduce") -> torch.Tensor:
    """A reduction of integers over ``dims`` (:func:`reduce_dims`).

    ``sum`` / ``mean``: the exact sum in int64 (checked against the BPU's int32 accumulator), then
    :func:`requantize` by ``(M, n)`` of :func:`reduce_params` (half to even): a mean is a sum whose
    multiplier holds ``1 / count``. ``amax`` / ``amin``: the largest / smallest integer, exact, on
    the input's grid (``M``, ``n`` unused), in the input's storage type.
    """
    x = _as_int(q)
    d = reduce_dims(dims, x.dim(), op)
    if mode in SELECTING_MODES:
        if x.numel() == 0:
            raise ConfigError(f"{op}: {mode} of an empty tensor {tuple(x.shape)}")
        return (x.amax(dim=d, keepdim=keepdim) if mode == "amax" else x.amin(dim=d, keepdim=keepdim)).to(q.dtype)
    if mode not in REDUCE_MODES:
        raise ConfigError(f"{op}: mode {mode!r} is not one of {REDUCE_MODES}")
    s = x.to(torch.int64).sum(dim=d, keepdim=keepdim)
    check_accumulator(s, 32, op=op)  # the BPU sums in an int32 accumulator
    return requantize(s, M, n, out_dtype, op=op)


# masked softmax (nash): int_softmax over the kept positions of each row
#
# ``keep`` (from the mask's 0/1 codes and the polarity: kept where the code differs from the fill code)
# broadcasts to ``q``; along ``dim``:
#   mx = max(q over kept)           d = clamp(mx - q, 0, len(EXP) - 1)
#   E = EXP[d] where kept, else 0   S = sum(E)      y = clamp((E * M + (S << n) // 2) // max(S << n, 1))
# so a masked position outputs 0 and adds nothing to S, and a row with no kept position (S = 0) is 0
# everywhere (torch: NaN). Same tables, parameters and int64 bounds as int_softmax.


def int_masked_softmax(q: torch.Tensor, mask: torch.Tensor, dim: int, fill_mask_is_true: bool, table: torch.Tensor,
                       M: int, n: int, out_dtype="qint8", *, op: str = "masked_softmax") -> torch.Tensor:
    """softmax of the integers ``q`` along ``dim`` over the positions ``mask`` keeps (the definition above),
    exact in int64. ``mask``: 0/1 codes (or bools) broadcasting to ``q``; a position is filled (left out)
    where its code is 1 if ``fill_mask_is_true`` else where it is 0. ConfigError (naming ``op``) as
    :func:`int_softmax`, and for a mask that does not broadcast to ``q``."""
    x = _as_int64(q)
    mask = torch.as_tensor(mask)
    m = _as_int64(mask.to(torch.int8) if mask.dtype == torch.bool else mask)
    try:
        m = m.expand(x.shape)
    except RuntimeError:
        raise ConfigError(f"{op}: mask of shape {list(m.shape)} does not broadcast to the input's "
                          f"{list(x.shape)}") from None
    keep = (m == 0) if fill_mask_is_true else (m != 0)
    M, n, t = _softmax_operands(x, dim, table, M, n, op)
    if x.numel() == 0:
        return _clamp_to(x, out_dtype)
    floor = torch.tensor(-(1 << 40), dtype=torch.int64)  # below every code: the max of an all-masked row
    mx = torch.where(keep, x, floor).amax(dim, keepdim=True)
    d = (mx - x).clamp(0, t.numel() - 1)
    e = torch.where(keep, t[d], torch.zeros((), dtype=torch.int64))
    den = e.sum(dim, keepdim=True) << n
    y = torch.div(e * M + (den >> 1), den.clamp(min=1), rounding_mode="floor")
    return _clamp_to(y, out_dtype)
