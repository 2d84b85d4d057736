"""The reference kernels: each op exactly as its converted module computes it, through the
``qcompiler.quantization.fixed_point`` functions that module calls (``kernels="fixed_point"``,
and what a fast kernel falls back to)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.bounds import AMAX, F64_EXACT, I32
from qcompiler.backends.bpu.sim.registry import KernelSpec, reference_kernel
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp


@reference_kernel("conv2d", "conv_transpose2d", "linear")
def _weight_layer(k: KernelSpec) -> Callable:
    return fixed_point_weight_layer(k.op, k.name)


@reference_kernel("quantize")
def _quantize(k: KernelSpec) -> Callable:
    scale, dtype = k.attrs["out_scale"], k.attrs["out_dtype"]
    return lambda x: fp.quantize(x, scale, dtype)


@reference_kernel("dequantize")
def _dequantize_kernel(k: KernelSpec) -> Callable:
    return _dequantize(k.in_specs[0])


@reference_kernel("requantize")
def _requantize(k: KernelSpec) -> Callable:
    M, n, name, out_dtype = k.tensors["M"], k.tensors["n"], k.name, k.out_dtype
    return lambda x: fp.requantize(x, M, n, out_dtype, op=name)


@reference_kernel("matmul")
def _matmul(k: KernelSpec) -> Callable:
    M, n, name, out_dtype = k.tensors["M"], k.tensors["n"], k.name, k.out_dtype

    def matmul(x, y):
        acc = fp.check_accumulator(fp.int_matmul(x, y, op=name), 32, op=name)
        return fp.requantize(acc, M, n, out_dtype, op=name)
    return matmul


@reference_kernel("add", "sub")
def _add_sub(k: KernelSpec) -> Callable:
    Ma, na, Mb, nb = (int(k.tensors[t]) for t in ("Ma", "na", "Mb", "nb"))
    fn = fp.int_add if k.op.kind == "add" else fp.int_sub
    name, out_dtype = k.name, k.out_dtype
    return _with_constant(k.op, lambda x, y: fn(x, Ma, na, y, Mb, nb, out_dtype, op=name))


@reference_kernel("mul")
def _mul(k: KernelSpec) -> Callable:
    T, name, out_dtype = k.tensors, k.name, k.out_dtype
    M, n = T["M"], T["n"]
    if len(k.op.inputs) == 2 or "constant" in T:
        return _with_constant(k.op, lambda x, y: fp.int_mul(x, y, M, n, out_dtype, op=name))
    sign = int(k.attrs["sign"])
    return lambda x: fp.requantize(sign * x.to(torch.int64), M, n, out_dtype, op=name)


@reference_kernel("constant")
def _constant(k: KernelSpec) -> Callable:
    value = k.tensors["value"]
    return lambda: value


@reference_kernel("div")
def _div(k: KernelSpec) -> Callable:
    M, n, b_dtype, name, out_dtype = k.tensors["M"], k.tensors["n"], k.attrs["b_dtype"], k.name, k.out_dtype
    return lambda x, y: fp.int_div(x, y, M, n, b_dtype, out_dtype, op=name)


@reference_kernel("cat")
def _cat(k: KernelSpec) -> Callable:
    Ms, ns, dim = k.tensors["M"].tolist(), k.tensors["n"].tolist(), int(k.attrs["dim"])
    params = [(torch.tensor(M, dtype=torch.int64), torch.tensor(n, dtype=torch.int64)) for M, n in zip(Ms, ns)]
    name, out_dtype = k.name, k.out_dtype

    def cat(*xs):
        return torch.cat([fp.requantize(x, M, n, out_dtype, op=f"{name}[{i}]")
                          for i, (x, (M, n)) in enumerate(zip(xs, params))], dim=dim)
    return cat


@reference_kernel("relu")
def _relu(k: KernelSpec) -> Callable:
    return fp.relu


@reference_kernel("relu6")
def _relu6(k: KernelSpec) -> Callable:
    top, T, name, out_dtype = int(k.attrs["max"]), k.tensors, k.name, k.out_dtype
    if "M" in T:  # its own output scale: requantize first (negatives stay <= 0 and clamp to 0)
        M, n = T["M"], T["n"]
        return lambda x: fp.requantize(x, M, n, out_dtype, op=name).clamp(0, top)
    return lambda x: x.clamp(0, top)


@reference_kernel("prelu", "leaky_relu")
def _prelu(k: KernelSpec) -> Callable:
    T, name, out_dtype = k.tensors, k.name, k.out_dtype
    Mp, np_, Mn, nn_ = T["Mp"], T["np"], T["Mn"], T["nn"]
    axis = k.attrs.get("axis")

    def prelu(x):
        pos = fp.requantize(x, Mp, np_, out_dtype, op=name)
        neg = fp.requantize(x, Mn, nn_, out_dtype, axis=axis, op=name)
        return torch.where(x >= 0, pos, neg)
    return prelu


def pool_geometry(k: KernelSpec) -> tuple:
    a = k.attrs
    return a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"]


@reference_kernel("max_pool2d")
def _max_pool(k: KernelSpec) -> Callable:
    ks, st, pad, dil, ceil = pool_geometry(k)
    return lambda x: fp.int_max_pool2d(x, ks, st, pad, dil, ceil)


@reference_kernel("avg_pool2d")
def _avg_pool(k: KernelSpec) -> Callable:
    a, name, out_dtype = k.attrs, k.name, k.out_dtype
    ks, st, pad = tuple(a["kernel_size"]), tuple(a["stride"]), tuple(a["padding"])
    M, n = k.tensors["M"], k.tensors["n"]
    kk = ks[0] * ks[1]
    amax = AMAX[k.in_specs[0].dtype]

    def avg_pool(x):
        # fixed_point.int_avg_pool2d with its multipliers precomputed (same checks, same sums)
        if fp._extreme(x) * kk >= F64_EXACT:
            raise fp.AccumulatorOverflow(name, fp._extreme(x) * kk, F64_EXACT, what="window sum")
        s = F.avg_pool2d(x.to(torch.int64).double(), ks, st, pad, ceil_mode=False, count_include_pad=True,
                         divisor_override=1).to(torch.int64)
        if amax * kk >= I32:  # the int32 range of the window sums is not proven: check it
            fp.check_accumulator(s, 32, op=name)
        return fp.requantize(s, M, n, out_dtype, op=name)
    return avg_pool


@reference_kernel("global_avg_pool")
def _global_avg_pool(k: KernelSpec) -> Callable:
    a, name, out_dtype = k.attrs, k.name, k.out_dtype
    s_in, s_out, keep = a["in_scale"], a["out_scale"], a["keepdim"]
    amax = AMAX[k.in_specs[0].dtype]

    def gap(x):
        if amax * x.shape[-1] * x.shape[-2] >= I32:  # int32 range of the sums not proven: check it
            fp.check_accumulator(x.to(torch.int64).sum(dim=(-2, -1)), 32, op=name)
        y = fp.int_global_avg_pool(x, s_in, s_out, out_dtype, mult_bits=qnn.MULT_BITS,
                                   max_shift=qnn.MAX_SHIFT, op=name)
        return y if keep else y.reshape(y.shape[:-2])  # as QuantizedAvgPool (mean without keepdim)
    return gap


@reference_kernel("resize_nearest", "resize_bilinear")
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


@reference_kernel("lut")
def _lut(k: KernelSpec) -> Callable:
    table, in_dtype = k.tensors["table"], k.attrs["in_dtype"]
    return lambda x: fp.apply_lut(x, table, in_dtype)


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


def fixed_point_weight_layer(op: BpuOp, name: str) -> Callable:
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


# --- layer_norm (nash)


@reference_kernel("layer_norm")
def _layer_norm(k: KernelSpec) -> Callable:
    T, dims, name, out_dtype = k.tensors, int(k.attrs["dims"]), k.name, k.out_dtype
    M, n, B, eps = T["M"], T["n"], T["B"], int(T["eps"])
    return lambda x: fp.int_layer_norm(x, dims, eps, M, n, B, out_dtype, op=name)


# --- softmax (nash)
@reference_kernel("softmax")
def _softmax(k: KernelSpec) -> Callable:
    table, M, n = k.tensors["table"], int(k.tensors["M"]), int(k.tensors["n"])
    dim, name, out_dtype = int(k.attrs["dim"]), k.name, k.out_dtype
    return lambda x: fp.int_softmax(x, dim, table, M, n, out_dtype, op=name)


@reference_kernel("log_softmax")
def _log_softmax(k: KernelSpec) -> Callable:
    T = k.tensors
    table, M, n, log_k, log_f = T["table"], int(T["M"]), int(T["n"]), T["log_k"], T["log_f"]
    dim, name, out_dtype = int(k.attrs["dim"]), k.name, k.out_dtype
    return lambda x: fp.int_log_softmax(x, dim, table, M, n, log_k, log_f, out_dtype, op=name)


# --- nash: reductions over any dims


@reference_kernel("reduce")
def _reduce(k: KernelSpec) -> Callable:
    """fixed_point.int_reduce, as QuantizedReduce calls it (M, n for sum / mean)."""
    a, name, out_dtype = k.attrs, k.name, k.out_dtype
    mode, dims, keep = a["mode"], tuple(a["dims"]), a["keepdim"]
    M, n = (int(k.tensors["M"]), int(k.tensors["n"])) if mode in ("sum", "mean") else (1, 0)
    return lambda x: fp.int_reduce(x, mode, dims, keep, M, n, out_dtype, op=name)


# --- masked_softmax (nash)
@reference_kernel("masked_softmax")
def _masked_softmax(k: KernelSpec) -> Callable:
    table, M, n = k.tensors["table"], int(k.tensors["M"]), int(k.tensors["n"])
    dim, fill, name, out_dtype = int(k.attrs["dim"]), bool(k.attrs["fill_mask_is_true"]), k.name, k.out_dtype
    return lambda x, mask: fp.int_masked_softmax(x, mask, dim, fill, table, M, n, out_dtype, op=name)
