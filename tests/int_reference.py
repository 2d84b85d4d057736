"""A slow, pure-integer reference interpreter of BPU programs (tests only).

Independent of torch's kernels and of ``qcompiler.quantization.fixed_point``:
integers are numpy int64 arrays (or Python ints where a product could pass
2**63), convolutions are explicit loops over output positions, and every
rounding is Python's ``round`` of an exact :class:`fractions.Fraction`
(round half to even), the contract of DESIGN.md "BPU numerics".  The only
floating point is where the contract itself is floating point: ``quantize``
(a float32 division), ``dequantize`` (a float32 product), and the resize ops
(defined in float64 by the converted model).

``run_program(program, inputs)`` interprets a whole
:class:`~qcompiler.backends.bpu.program.BpuProgram`; the ``ref_*``
functions are the ops.  Keep shapes small: this is slow on purpose.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

RANGES = {"qint8": (-128, 127), "qint16": (-32768, 32767), "qint32": (-(2 ** 31), 2 ** 31 - 1)}
I32 = (-(2 ** 31), 2 ** 31 - 1)


class ReferenceOverflow(Exception):
    """The reference saw an int32 accumulator out of range (names the op)."""


# ---------------------------------------------------------------------------- scalars


def round_half_even(fr: Fraction) -> int:
    """Nearest integer, ties to even (Python's round on an exact Fraction)."""
    return round(fr)


def requant_value(acc: int, M: int, n: int) -> int:
    return round_half_even(Fraction(int(acc) * int(M), 2 ** int(n)))


def clamp(v: int, dtype: str) -> int:
    lo, hi = RANGES[dtype]
    return min(max(v, lo), hi)


def ref_requant_params(real: float, mult_bits: int = 31, max_shift: int = 31) -> tuple[int, int]:
    """Independent ``requant_params``: ``real ~= M / 2**n`` with a ``mult_bits`` multiplier."""
    if real == 0:
        return 0, 0
    sign = -1 if real < 0 else 1
    a = abs(real)
    mant, e = math.frexp(a)
    M = round(mant * 2 ** mult_bits)  # exact float, Python rounds half to even
    n = mult_bits - e
    if M == 2 ** mult_bits:
        M, n = 2 ** (mult_bits - 1), n - 1
    if n > max_shift:
        M, n = round(a * 2.0 ** max_shift), max_shift
    if M == 0:
        n = 0
    return sign * M, n


def f32(x: float) -> float:
    return float(np.float32(x))


# ---------------------------------------------------------------------------- arrays


def _vec(fn, *arrays):
    """Apply a Python-int function element-wise (broadcasting), returning int64."""
    arrays = np.broadcast_arrays(*[np.asarray(a, dtype=np.int64) for a in arrays])
    out = np.empty(arrays[0].shape, dtype=np.int64)
    for idx in np.ndindex(out.shape):
        out[idx] = fn(*[int(a[idx]) for a in arrays])
    return out


def _channel(param, ndim: int, axis: Optional[int]):
    p = np.asarray(param, dtype=np.int64)
    if p.size == 1:
        return p.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = p.size
    return p.reshape(shape)


def ref_requantize(acc, M, n, dtype: str, axis: Optional[int] = None) -> np.ndarray:
    acc = np.asarray(acc, dtype=np.int64)
    Mv, nv = _channel(M, acc.ndim, axis), _channel(n, acc.ndim, axis)
    return _vec(lambda a, m, s: clamp(requant_value(a, m, s), dtype), acc, Mv, nv)


def check_int32(acc: np.ndarray, op: str) -> np.ndarray:
    if acc.size and (int(acc.min()) < I32[0] or int(acc.max()) > I32[1]):
        raise ReferenceOverflow(f"{op}: int32 accumulator overflow")
    return acc


def ref_quantize(x: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """clamp(round_half_even(float32(x) / float32(scale)))."""
    q = np.round(np.asarray(x, dtype=np.float32) / np.float32(scale))
    lo, hi = RANGES[dtype]
    return np.clip(q, lo, hi).astype(np.int64)


def ref_dequantize(q: np.ndarray, scale, axis: Optional[int] = None) -> np.ndarray:
    q = np.asarray(q, dtype=np.int64).astype(np.float32)
    if isinstance(scale, (list, tuple)):
        s = np.asarray(scale, dtype=np.float64).astype(np.float32)
        shape = [1] * q.ndim
        shape[axis % q.ndim] = s.size
        return q * s.reshape(shape)
    return q * np.float32(scale)


# ---------------------------------------------------------------------------- weight layers


def ref_conv2d(x, w, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1) -> np.ndarray:
    """Exact int64 accumulator of conv2d by explicit loops over outputs (zero padding)."""
    x = np.asarray(x, dtype=np.int64)
    w = np.asarray(w, dtype=np.int64)
    N, _, H, W = x.shape
    O, Cg, kh, kw = w.shape
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((N, O, Ho, Wo), dtype=np.int64)
    og = O // groups
    for n in range(N):
        for o in range(O):
            g = o // og
            for oh in range(Ho):
                for ow in range(Wo):
                    s = 0
                    for c in range(Cg):
                        ci = g * Cg + c
                        for i in range(kh):
                            ih = oh * sh - ph + i * dh
                            if not 0 <= ih < H:
                                continue
                            for j in range(kw):
                                iw = ow * sw - pw + j * dw
                                if 0 <= iw < W:
                                    s += int(x[n, ci, ih, iw]) * int(w[o, c, i, j])
                    if bias is not None:
                        s += int(bias[o])
                    out[n, o, oh, ow] = s
    return out


def ref_conv_transpose2d(x, w, bias=None, stride=(1, 1), padding=(0, 0), output_padding=(0, 0),
                         dilation=(1, 1), groups=1) -> np.ndarray:
    """Exact transposed conv by scattering every input element (weight (Cin, Cout/g, kh, kw))."""
    x = np.asarray(x, dtype=np.int64)
    w = np.asarray(w, dtype=np.int64)
    N, C, H, W = x.shape
    _, og, kh, kw = w.shape
    sh, sw = stride
    ph, pw = padding
    oph, opw = output_padding
    dh, dw = dilation
    Ho = (H - 1) * sh - 2 * ph + dh * (kh - 1) + oph + 1
    Wo = (W - 1) * sw - 2 * pw + dw * (kw - 1) + opw + 1
    O = og * groups
    cg = C // groups
    out = [[[[0] * Wo for _ in range(Ho)] for _ in range(O)] for _ in range(N)]
    for n in range(N):
        for c in range(C):
            g = c // cg
            for ih in range(H):
                for iw in range(W):
                    v = int(x[n, c, ih, iw])
                    if v == 0:
                        continue
                    for oc in range(og):
                        for i in range(kh):
                            oh = ih * sh - ph + i * dh
                            if not 0 <= oh < Ho:
                                continue
                            for j in range(kw):
                                ow = iw * sw - pw + j * dw
                                if 0 <= ow < Wo:
                                    out[n][g * og + oc][oh][ow] += v * int(w[c, oc, i, j])
    res = np.asarray(out, dtype=np.int64).reshape(N, O, Ho, Wo)
    if bias is not None:
        res = res + np.asarray(bias, dtype=np.int64).reshape(1, -1, 1, 1)
    return res


def ref_linear(x, w, bias=None) -> np.ndarray:
    x = np.asarray(x, dtype=np.int64)
    w = np.asarray(w, dtype=np.int64)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = np.zeros((x2.shape[0], w.shape[0]), dtype=np.int64)
    for r in range(x2.shape[0]):
        for o in range(w.shape[0]):
            s = sum(int(a) * int(b) for a, b in zip(x2[r], w[o]))
            out[r, o] = s + (int(bias[o]) if bias is not None else 0)
    return out.reshape(*lead, w.shape[0])


def ref_matmul(a, b) -> np.ndarray:
    return np.matmul(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))  # exact integer matmul


def ref_weight_layer(op, q, other=None) -> np.ndarray:
    a, T = op.attrs, _np_tensors(op)
    if op.kind == "conv2d":
        acc = ref_conv2d(q, T["weight"], T.get("bias"), a["stride"], a["padding"], a["dilation"], a["groups"])
    elif op.kind == "conv_transpose2d":
        acc = ref_conv_transpose2d(q, T["weight"], T.get("bias"), a["stride"], a["padding"], a["output_padding"],
                                   a["dilation"], a["groups"])
    else:
        acc = ref_linear(q, T["weight"], T.get("bias"))
    check_int32(acc, op.output)
    if a["high_precision"]:
        return acc
    axis = -1 if op.kind == "linear" else 1
    Mv, nv = _channel(T["M"], acc.ndim, axis), _channel(T["n"], acc.ndim, axis)
    if a["with_add"]:
        Mb, nb = int(T["Mb"]), int(T["nb"])
        y = _vec(lambda acc_, m, s, b: round_half_even(Fraction(acc_ * m, 2 ** s) + Fraction(b * Mb, 2 ** nb)),
                 acc, Mv, nv, other)
        y = _vec(lambda v: clamp(v, a["out_dtype"]), y)
    else:
        y = ref_requantize(acc, T["M"], T["n"], a["out_dtype"], axis)
    if a["act"] == "relu":
        y = np.maximum(y, 0)
    elif a["act"] == "relu6":
        y = np.clip(y, 0, a["act_max"])
    return y


# ---------------------------------------------------------------------------- element-wise ops


def ref_addsub(qa, Ma, na, qb, Mb, nb, dtype: str, sign: int = 1) -> np.ndarray:
    return _vec(lambda a, b: clamp(round_half_even(Fraction(a * Ma, 2 ** na) + sign * Fraction(b * Mb, 2 ** nb)),
                                   dtype), qa, qb)


def ref_mul(qa, qb, M, n, dtype: str) -> np.ndarray:
    return _vec(lambda a, b: clamp(requant_value(a * b, M, n), dtype), qa, qb)


def ref_div(qa, qb, a_scale: float, b_scale: float, out_scale: float, b_dtype: str, dtype: str) -> np.ndarray:
    """a / b through a reciprocal multiplier per divisor code, recomputed here from the scales
    (``s_a / (s_b * s_out) / q`` in float64, 31-bit multipliers); b == 0 saturates by a's sign."""
    lo, hi = RANGES[b_dtype]
    base = f32(a_scale) / (f32(b_scale) * f32(out_scale))
    table = {q: ref_requant_params(base / q, 31, 61) for q in range(lo, hi + 1) if q}
    qmin, qmax = RANGES[dtype]

    def one(a, b):
        if b == 0:
            return qmax if a > 0 else (qmin if a < 0 else 0)
        return clamp(requant_value(a, *table[b]), dtype)
    return _vec(one, qa, qb)


def ref_prelu(q, Mp, np_, Mn, nn_, dtype: str, axis: Optional[int]) -> np.ndarray:
    q = np.asarray(q, dtype=np.int64)
    pos = ref_requantize(q, Mp, np_, dtype)
    neg = ref_requantize(q, Mn, nn_, dtype, axis)
    return np.where(q >= 0, pos, neg)


def ref_lut(q, table, in_dtype: str) -> np.ndarray:
    lo, _ = RANGES[in_dtype]
    return np.asarray(table, dtype=np.int64)[np.asarray(q, dtype=np.int64) - lo]


# ---------------------------------------------------------------------------- pooling / resize


def _pool_out(size, k, s, p, d, ceil):
    num = size + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil else num // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def ref_max_pool2d(q, kernel, stride, padding, dilation=(1, 1), ceil_mode=False) -> np.ndarray:
    q = np.asarray(q, dtype=np.int64)
    N, C, H, W = q.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    Ho, Wo = _pool_out(H, kh, sh, ph, dh, ceil_mode), _pool_out(W, kw, sw, pw, dw, ceil_mode)
    out = np.zeros((N, C, Ho, Wo), dtype=np.int64)
    for n in range(N):
        for c in range(C):
            for oh in range(Ho):
                for ow in range(Wo):
                    best = None
                    for i in range(kh):
                        ih = oh * sh - ph + i * dh
                        for j in range(kw):
                            iw = ow * sw - pw + j * dw
                            if 0 <= ih < H and 0 <= iw < W:
                                v = int(q[n, c, ih, iw])
                                best = v if best is None else max(best, v)
                    out[n, c, oh, ow] = best
    return out


def ref_window_sum(q, kernel, stride, padding) -> np.ndarray:
    """Zero-padded window sums (count_include_pad)."""
    q = np.asarray(q, dtype=np.int64)
    N, C, H, W = q.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    Ho, Wo = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    out = np.zeros((N, C, Ho, Wo), dtype=np.int64)
    for oh in range(Ho):
        for ow in range(Wo):
            s = np.zeros((N, C), dtype=np.int64)
            for i in range(kh):
                ih = oh * sh - ph + i
                for j in range(kw):
                    iw = ow * sw - pw + j
                    if 0 <= ih < H and 0 <= iw < W:
                        s += q[:, :, ih, iw]
            out[:, :, oh, ow] = s
    return out


def ref_global_avg_pool(q, in_scale: float, out_scale: float, dtype: str, keepdim: bool = True) -> np.ndarray:
    q = np.asarray(q, dtype=np.int64)
    hw = q.shape[-1] * q.shape[-2]
    M, n = ref_requant_params(f32(in_scale) / (hw * f32(out_scale)))
    s = q.sum(axis=(-2, -1), keepdims=True)
    y = ref_requantize(s, M, n, dtype)
    return y if keepdim else y.reshape(y.shape[:-2])


def ref_resize_nearest(q, size, ratio: float, dtype: str) -> np.ndarray:
    """PyTorch 'nearest' source index (float32 scale), then the float64 rescale rounded half to even."""
    q = np.asarray(q, dtype=np.int64)
    H, W = q.shape[-2:]
    Ho, Wo = size

    def src(o, inp, out):
        if out == inp:
            return o
        if out == 2 * inp:
            return o >> 1
        scale = np.float32(inp) / np.float32(out)
        return min(math.floor(np.float32(o) * scale), inp - 1)

    rows = [src(o, H, Ho) for o in range(Ho)]
    cols = [src(o, W, Wo) for o in range(Wo)]
    y = q[..., rows, :][..., cols].astype(np.float64)
    return np.clip(np.round(y * ratio), *RANGES[dtype]).astype(np.int64)


def ref_resize_bilinear(q, size, ratio: float, align_corners: bool, dtype: str) -> np.ndarray:
    """Bilinear in float64 (PyTorch's source-index rule), rescaled, rounded half to even."""
    q = np.asarray(q, dtype=np.float64)
    H, W = q.shape[-2:]
    Ho, Wo = size

    def taps(o, inp, out):
        if align_corners:
            scale = (inp - 1) / (out - 1) if out > 1 else 0.0
            s = scale * o
        else:
            scale = inp / out
            s = max(scale * (o + 0.5) - 0.5, 0.0)
        i0 = min(math.floor(s), inp - 1)
        i1 = i0 + 1 if i0 < inp - 1 else i0
        l1 = s - i0
        return i0, i1, 1.0 - l1, l1

    out = np.zeros(q.shape[:-2] + (Ho, Wo), dtype=np.float64)
    for oh in range(Ho):
        h0, h1, wh0, wh1 = taps(oh, H, Ho)
        for ow in range(Wo):
            w0, w1, ww0, ww1 = taps(ow, W, Wo)
            out[..., oh, ow] = (wh0 * (ww0 * q[..., h0, w0] + ww1 * q[..., h0, w1])
                                + wh1 * (ww0 * q[..., h1, w0] + ww1 * q[..., h1, w1]))
    return np.clip(np.round(out * ratio), *RANGES[dtype]).astype(np.int64)


# ---------------------------------------------------------------------------- programs


def _np_tensors(op) -> dict:
    return {k: t.numpy() if hasattr(t, "numpy") else np.asarray(t) for k, t in op.tensors.items()}


def run_op(op, args: Sequence[np.ndarray], specs: dict) -> np.ndarray:
    """One BPU op on numpy integers (floats for quantize)."""
    k, a, T = op.kind, op.attrs, _np_tensors(op)
    out_dtype = a.get("out_dtype")
    if k == "quantize":
        return ref_quantize(args[0], a["out_scale"], out_dtype)
    if k == "dequantize":
        s = specs[op.inputs[0]]
        return ref_dequantize(args[0], s.scale, s.axis)
    if k in ("conv2d", "conv_transpose2d", "linear"):
        return ref_weight_layer(op, *args)
    if k == "requantize":
        return ref_requantize(np.asarray(args[0], dtype=np.int64), int(T["M"]), int(T["n"]), out_dtype)
    if k == "matmul":
        acc = check_int32(ref_matmul(*args), op.output)
        return ref_requantize(acc, int(T["M"]), int(T["n"]), out_dtype)
    if k == "constant":
        return np.asarray(T["value"], dtype=np.int64)
    if "constant" in T and len(args) == 1:  # add / sub / mul with a constant operand
        args = [T["constant"], args[0]] if a["constant_index"] == 0 else [args[0], T["constant"]]
    if k == "div":
        return ref_div(args[0], args[1], a["a_scale"], a["b_scale"], a["out_scale"], a["b_dtype"], out_dtype)
    if k in ("add", "sub"):
        return ref_addsub(args[0], int(T["Ma"]), int(T["na"]), args[1], int(T["Mb"]), int(T["nb"]), out_dtype,
                          1 if k == "add" else -1)
    if k == "mul":
        if len(args) == 2:
            return ref_mul(args[0], args[1], int(T["M"]), int(T["n"]), out_dtype)
        return ref_requantize(int(a["sign"]) * np.asarray(args[0], dtype=np.int64), int(T["M"]), int(T["n"]),
                              out_dtype)
    if k == "cat":
        parts = [ref_requantize(x, int(M), int(n), out_dtype) for x, M, n in zip(args, T["M"], T["n"])]
        return np.concatenate(parts, axis=a["dim"])
    if k == "relu":
        return np.maximum(np.asarray(args[0], dtype=np.int64), 0)
    if k == "relu6":
        q = np.asarray(args[0], dtype=np.int64)
        if "M" in T:
            q = ref_requantize(q, int(T["M"]), int(T["n"]), out_dtype)
        return np.clip(q, 0, a["max"])
    if k in ("prelu", "leaky_relu"):
        return ref_prelu(args[0], int(T["Mp"]), int(T["np"]), T["Mn"], T["nn"], out_dtype, a.get("axis"))
    if k == "max_pool2d":
        return ref_max_pool2d(args[0], a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    if k == "avg_pool2d":
        s = ref_window_sum(args[0], a["kernel_size"], a["stride"], a["padding"])
        return ref_requantize(s, int(T["M"]), int(T["n"]), out_dtype)
    if k == "global_avg_pool":
        return ref_global_avg_pool(args[0], a["in_scale"], a["out_scale"], out_dtype, a["keepdim"])
    if k == "resize_nearest":
        return ref_resize_nearest(args[0], a["size"], a["in_scale"] / a["out_scale"], out_dtype)
    if k == "resize_bilinear":
        return ref_resize_bilinear(args[0], a["size"], a["in_scale"] / a["out_scale"], a["align_corners"], out_dtype)
    if k == "lut":
        return ref_lut(args[0], T["table"], a["in_dtype"])
    x = np.asarray(args[0])
    if k == "identity":
        return x
    if k == "reshape":
        return x.reshape(a["shape"])
    if k == "flatten":
        s, e = a["start_dim"] % x.ndim, a["end_dim"] % x.ndim
        return x.reshape(x.shape[:s] + (-1,) + x.shape[e + 1:])
    if k == "squeeze":
        return np.squeeze(x) if a["dim"] is None else (np.squeeze(x, a["dim"]) if x.shape[a["dim"]] == 1 else x)
    if k == "unsqueeze":
        return np.expand_dims(x, a["dim"] % (x.ndim + 1))
    if k == "permute":
        return np.transpose(x, a["dims"])
    if k == "transpose":
        return np.swapaxes(x, a["dim0"], a["dim1"])
    if k == "getitem":
        from qcompiler.backends.bpu.program import decode_index
        return x[decode_index(a["index"])]
    raise NotImplementedError(k)


def run_program(program, inputs: dict) -> dict:
    """Interpret ``program`` on numpy inputs (int arrays for quantized inputs, floats for f32)."""
    specs = program.value_specs()
    env = {k: np.asarray(v) for k, v in inputs.items()}
    for op in program.ops:
        env[op.output] = run_op(op, [env[i] for i in op.inputs], specs)
    return {v.name: env[v.name] for v in program.outputs}
