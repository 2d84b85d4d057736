"""Emit rules: one function per canonical op, FX call -> ONNX opset-11 nodes.

Each rule takes a :class:`~qcompiler.backends.onnx.emitter.NodeContext` and
returns the node's value: a tensor name, a python value (sizes folded at export
time), or a tuple of them (LSTM, split). ``op_table.OP_RULES`` maps op names to
these functions. Rules read arguments through ``ctx.arg(index, name, default)``
so the module, functional and method spellings of an op share one rule.

Opset-11 gaps and how the rules bridge them:

* no LayerNormalization / GELU / SiLU / HardSwish: decomposed
  (ReduceMean-Sub-Pow-ReduceMean-Add-Sqrt-Div-Mul-Add; ``0.5*x*(1+erf(x/sqrt2))``;
  ``x*sigmoid(x)``; ``x*hardsigmoid(x)``);
* Softmax-11 coerces the input to 2-D at ``axis`` (it normalizes over *all* the
  dims from ``axis`` on): a softmax over a dim other than the last is emitted
  between two Transposes that swap that dim with the last;
* Clip-11 takes min/max as inputs (ReLU6 = Clip(x, 0, 6));
* Flatten-11 always makes 2-D: other flattens are Reshapes;
* LSTM gate order is iofc (PyTorch: ifgo), one layer per node, time-major: the
  weights are reordered, layers chained, batch_first transposed.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
from onnx import TensorProto

from qcompiler.backends.onnx.emitter import FLOAT_TYPES, INT64_MAX, NodeContext, Tensor, is_tensor, to_numpy
from qcompiler.nn import fused
from qcompiler.quantization.fixed_point import max_pool_out_size

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64

# torch's SELU constants (ONNX's defaults are the same numbers rounded to float32)
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _ntuple(v: Any, n: int) -> list[int]:
    if isinstance(v, (list, tuple)):
        if len(v) == 1 and n > 1:
            return [int(v[0])] * n
        return [int(e) for e in v]
    return [int(v)] * n


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# ---------------------------------------------------------------------------
# element-wise


def unary(onnx_op: str, **attrs):
    def rule(ctx: NodeContext) -> Tensor:
        return ctx.make(onnx_op, [ctx.x()], **attrs)
    rule.__name__ = onnx_op.lower()
    return rule


def identity(ctx: NodeContext):
    v = ctx.value(ctx.arg(0, "input"))
    if is_tensor(v):
        return ctx.identity(v)
    return v  # identity of a container / python value: nothing to compute


def to_float(ctx: NodeContext) -> Tensor:
    return ctx.make("Cast", [ctx.x()], to=F32, dtype=F32)


def relu(ctx: NodeContext) -> Tensor:
    return ctx.make("Relu", [ctx.x()])


def clip(ctx: NodeContext, x: str, lo: Optional[float], hi: Optional[float], tag: Optional[str] = None) -> Tensor:
    dt = ctx.dtype(x)
    lo_t = ctx.const("min", lo, dt) if lo is not None else ""
    hi_t = ctx.const("max", hi, dt) if hi is not None else ""
    ins = [x, lo_t, hi_t]
    while ins and ins[-1] == "":
        ins.pop()
    return ctx.make("Clip", ins, tag=tag)


def clamp(ctx: NodeContext) -> Tensor:
    lo, hi = ctx.arg(1, "min", None), ctx.arg(2, "max", None)
    if any(isinstance(v, fx.Node) for v in (lo, hi)):
        raise ctx.unsupported("clamp with tensor bounds")
    return clip(ctx, ctx.x(), lo, hi)


def relu6(ctx: NodeContext) -> Tensor:
    return clip(ctx, ctx.x(), 0.0, 6.0)


def leaky_relu(ctx: NodeContext) -> Tensor:
    slope = ctx.module.negative_slope if ctx.module is not None else ctx.arg(1, "negative_slope", 0.01)
    return ctx.make("LeakyRelu", [ctx.x()], alpha=float(slope))


def prelu_slope_shape(slope: np.ndarray, rank: int) -> np.ndarray:
    """PyTorch applies the slope along dim 1; ONNX PRelu broadcasts numpy-style
    (trailing dims): a per-channel slope becomes (C, 1, ..., 1)."""
    slope = slope.reshape(-1)
    if slope.size == 1 or rank < 2:
        return slope
    return slope.reshape((slope.size,) + (1,) * (rank - 2))


def prelu(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    if ctx.module is not None:
        slope = ctx.param(ctx.module, "weight", ctx.path, transform=lambda a: prelu_slope_shape(a, rank))
    else:
        w = ctx.arg(1, "weight")
        shape = ctx.shape(w)
        slope = ctx.tensor(w)
        if shape is not None and len(shape) == 1 and shape[0] > 1 and rank > 2:
            slope = ctx.make("Reshape", [slope, ctx.const("slope_shape", [shape[0]] + [1] * (rank - 2), I64)],
                             tag="slope")
    return ctx.make("PRelu", [x, slope])


def selu(ctx: NodeContext) -> Tensor:
    return ctx.make("Selu", [ctx.x()], alpha=SELU_ALPHA, gamma=SELU_SCALE)


def elu(ctx: NodeContext) -> Tensor:
    alpha = ctx.module.alpha if ctx.module is not None else ctx.arg(1, "alpha", 1.0)
    return ctx.make("Elu", [ctx.x()], alpha=float(alpha))


def gelu(ctx: NodeContext) -> Tensor:
    approx = ctx.module.approximate if ctx.module is not None else ctx.arg(None, "approximate", "none")
    x = ctx.x()
    if approx == "tanh":  # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
        x3 = ctx.make("Pow", [x, ctx.const("three", 3.0)], tag="cube")
        inner = ctx.make("Add", [x, ctx.make("Mul", [x3, ctx.const("k", 0.044715)], tag="kx3")], tag="inner")
        t = ctx.make("Tanh", [ctx.make("Mul", [inner, ctx.const("c", math.sqrt(2.0 / math.pi))], tag="scaled")],
                     tag="tanh")
    elif approx == "none":  # 0.5 * x * (1 + erf(x / sqrt(2)))
        t = ctx.make("Erf", [ctx.make("Mul", [x, ctx.const("rsqrt2", 1.0 / math.sqrt(2.0))], tag="scaled")],
                     tag="erf")
    else:
        raise ctx.unsupported(f"gelu approximate={approx!r}")
    one_plus = ctx.make("Add", [t, ctx.const("one", 1.0)], tag="one_plus")
    half_x = ctx.make("Mul", [x, ctx.const("half", 0.5)], tag="half_x")
    return ctx.make("Mul", [half_x, one_plus])


def silu(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    return ctx.make("Mul", [x, ctx.make("Sigmoid", [x], tag="sigmoid")])


def hardsigmoid(ctx: NodeContext) -> Tensor:
    return ctx.make("HardSigmoid", [ctx.x()], alpha=1.0 / 6.0, beta=0.5)


def hardswish(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    return ctx.make("Mul", [x, ctx.make("HardSigmoid", [x], tag="hardsigmoid", alpha=1.0 / 6.0, beta=0.5)])


def _softmax_dim(ctx: NodeContext, rank: int) -> int:
    if ctx.module is not None:
        dim = ctx.module.dim
    else:
        dim = ctx.arg(1, "dim", None)
    if dim is None:  # torch's legacy implicit dim
        dim = 0 if rank in (0, 1, 3) else 1
    return _norm_axis(int(dim), rank)


def softmax(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    dtype = ctx.arg(None, "dtype", None) if ctx.module is None else None
    if dtype is not None:
        x = ctx.make("Cast", [x], tag="cast", to=_onnx_dtype(ctx, dtype), dtype=_onnx_dtype(ctx, dtype))
    axis = _softmax_dim(ctx, rank)
    if axis == rank - 1:
        return ctx.make("Softmax", [x], axis=rank - 1)
    # Softmax-11 normalizes over all dims from `axis` on: move the dim last and back
    perm = list(range(rank))
    perm[axis], perm[rank - 1] = perm[rank - 1], perm[axis]
    t = ctx.make("Transpose", [x], tag="to_last", perm=perm)
    s = ctx.make("Softmax", [t], tag="softmax", axis=rank - 1)
    return ctx.make("Transpose", [s], perm=perm)


def _onnx_dtype(ctx: NodeContext, dtype: Any) -> int:
    from qcompiler.backends.onnx.emitter import TORCH_TO_ONNX

    if dtype in TORCH_TO_ONNX:
        return TORCH_TO_ONNX[dtype]
    raise ctx.unsupported(f"dtype {dtype!r}")


def layer_norm(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    if ctx.module is not None:
        m = ctx.module
        k = len(m.normalized_shape)
        eps = m.eps
        w = ctx.param(m, "weight", ctx.path) if getattr(m, "weight", None) is not None else None
        b = ctx.param(m, "bias", ctx.path) if getattr(m, "bias", None) is not None else None
    else:
        shape = ctx.arg(1, "normalized_shape")
        k = len(shape) if isinstance(shape, (list, tuple)) else 1
        eps = ctx.arg(4, "eps", 1e-5)
        wa, ba = ctx.arg(2, "weight", None), ctx.arg(3, "bias", None)
        w = ctx.tensor(wa) if wa is not None else None
        b = ctx.tensor(ba) if ba is not None else None
    axes = list(range(-k, 0))
    mean = ctx.make("ReduceMean", [x], tag="mean", axes=axes, keepdims=1)
    d = ctx.make("Sub", [x, mean], tag="centered")
    sq = ctx.make("Pow", [d, ctx.const("two", 2.0)], tag="squared")
    var = ctx.make("ReduceMean", [sq], tag="var", axes=axes, keepdims=1)
    std = ctx.make("Sqrt", [ctx.make("Add", [var, ctx.const("eps", float(eps))], tag="var_eps")], tag="std")
    if w is None and b is None:
        return ctx.make("Div", [d, std])
    y = ctx.make("Div", [d, std], tag="normalized")
    if w is not None and b is not None:
        return ctx.make("Add", [ctx.make("Mul", [y, w], tag="scaled"), b])
    if w is not None:
        return ctx.make("Mul", [y, w])
    return ctx.make("Add", [y, b])


def batch_norm(ctx: NodeContext) -> Tensor:
    """Inference BatchNormalization with the running statistics (export is eval); a BPU
    BatchNorm2d of a prepared model, quantized, is the depthwise 1x1 conv the BPU computes."""
    x = ctx.x()
    if ctx.module is not None and ctx.quant.quantize and ctx.module.__dict__.get("_qc_input_quantizer") is not None:
        return _quantized_batch_norm(ctx, x)
    if ctx.module is not None:
        m = ctx.module
        if m.running_mean is None:
            raise ctx.unsupported("BatchNorm without running statistics")
        c = m.num_features
        scale = ctx.param(m, "weight", ctx.path) if m.weight is not None else ctx.const("scale", np.ones(c, np.float32))
        bias = ctx.param(m, "bias", ctx.path) if m.bias is not None else ctx.const("bias", np.zeros(c, np.float32))
        mean, var = ctx.param(m, "running_mean", ctx.path), ctx.param(m, "running_var", ctx.path)
        eps = m.eps
    else:
        mean, var = ctx.tensor(ctx.arg(1, "running_mean")), ctx.tensor(ctx.arg(2, "running_var"))
        wa, ba = ctx.arg(3, "weight", None), ctx.arg(4, "bias", None)
        c = ctx.shape()[1]
        scale = ctx.tensor(wa) if wa is not None else ctx.const("scale", np.ones(c, np.float32))
        bias = ctx.tensor(ba) if ba is not None else ctx.const("bias", np.zeros(c, np.float32))
        eps = ctx.arg(7, "eps", 1e-5)
    return ctx.make("BatchNormalization", [x, scale, bias, mean, var], epsilon=float(eps))


def _quantized_batch_norm(ctx: NodeContext, x: str) -> Tensor:
    """``qat.BatchNorm2d`` as convert lowers it: weights ``+-127`` at ``|a_c| / 127``
    (``qat.bn_weight``), the bias on the grid ``s_in * s_w``; scales in the sidecar."""
    from qcompiler.nn.qat import bn_affine, bn_weight
    from qcompiler.quantization.fixed_point import bias_codes

    m, path = ctx.module, ctx.path
    qin = ctx.quant.qparams(m.__dict__["_qc_input_quantizer"], f"{path} input quantizer")
    if qin is None:  # an input quantizer without a scale (a bare boundary marker): float BN
        params = [ctx.param(m, a, path) for a in ("weight", "bias", "running_mean", "running_var")]
        return ctx.make("BatchNormalization", [x, *params], epsilon=float(m.eps))
    a, b = bn_affine(m)
    q, s_w = bn_weight(a)
    c = q.numel()
    grid = torch.tensor(qin[0], dtype=torch.float64) * s_w.double()
    b_int = bias_codes(b, grid)
    w = ctx.quant._store_weight(ctx, path, q.reshape(c, 1, 1, 1), s_w, 0, 1, "qint8")
    bias = ctx.quant._store_bias(ctx, path, b_int, grid)
    return conv(ctx, x, w, bias, (c, 1, 1, 1), 1, 0, 1, c)


def quantized_constant(ctx: NodeContext, name: str, q: torch.Tensor, scale: float) -> Tensor:
    """A constant's dequantized integers ``q * scale`` (one scale) as a float initializer; the
    scale goes to the sidecar's weights when quantizing (weights and biases use
    ``QuantState._store_weight`` / ``_store_bias``)."""
    from qcompiler.quantization.fixed_point import dtype_name

    t = ctx.initializer(name, to_numpy((q.double() * float(scale)).float()))
    if ctx.quant.quantize:
        ctx.quant.weights[t] = {"scales": [float(scale)], "axis": None, "dtype": dtype_name(q.dtype)}
    return t


# ---------------------------------------------------------------------------
# binary arithmetic


def _operands(ctx: NodeContext, names=("input", "other")) -> tuple[Any, Any]:
    a = ctx.value(ctx.arg(0, names[0]))
    b = ctx.value(ctx.arg(1, names[1]))
    return a, b


def _result_dtype(ctx: NodeContext, a: Any, b: Any, op: str) -> int:
    dt = ctx.out_dtype()
    if dt is not None:
        return dt
    types = [ctx.dtype(v) for v in (a, b) if is_tensor(v)]
    if any(t in FLOAT_TYPES for t in types) or any(isinstance(v, float) for v in (a, b)):
        return next((t for t in types if t in FLOAT_TYPES), F32)
    return types[0] if types else I64


def binary(onnx_op: str, py_op):
    def rule(ctx: NodeContext):
        a, b = _operands(ctx)
        alpha = ctx.arg(None, "alpha", None)
        rounding = ctx.arg(None, "rounding_mode", None) if onnx_op == "Div" else None
        if not is_tensor(a) and not is_tensor(b):  # python arithmetic (folded sizes)
            if alpha is not None:
                b = b * alpha
            r = py_op(a, b)
            if rounding == "floor":
                r = math.floor(r)
            elif rounding == "trunc":
                r = math.trunc(r)
            return r
        dt = _result_dtype(ctx, a, b, onnx_op)
        if onnx_op == "Div" and rounding is None and dt not in FLOAT_TYPES:
            dt = F32  # true division of integers is float in torch
        ta = _as_tensor(ctx, a, dt, "a")
        tb = _as_tensor(ctx, b, dt, "b")
        if alpha is not None and alpha != 1:
            tb = ctx.make("Mul", [tb, ctx.const("alpha", alpha, dt)], tag="alpha")
        if rounding is None:
            return ctx.make(onnx_op, [ta, tb])
        if dt not in FLOAT_TYPES:
            if rounding == "trunc":
                return ctx.make("Div", [ta, tb])  # ONNX integer Div truncates
            raise ctx.unsupported("integer division with rounding_mode='floor'")
        q = ctx.make("Div", [ta, tb], tag="div")
        if rounding == "floor":
            return ctx.make("Floor", [q])
        raise ctx.unsupported(f"rounding_mode={rounding!r} on floats")
    rule.__name__ = onnx_op.lower()
    return rule


def _as_tensor(ctx: NodeContext, v: Any, dt: int, tag: str) -> Tensor:
    if is_tensor(v):
        if ctx.dtype(v) != dt:
            return ctx.make("Cast", [v], tag=f"cast_{tag}", to=dt, dtype=dt)
        return v
    if isinstance(v, (bool, int, float)):
        return ctx.const(f"const_{tag}", v, dt)
    raise ctx.unsupported(f"operand of type {type(v).__name__}")


add = binary("Add", operator.add)
sub = binary("Sub", operator.sub)
mul = binary("Mul", operator.mul)
div = binary("Div", operator.truediv)


def compare(onnx_op: str, negate: bool = False):
    """Greater / Less / Equal (bool); >=, <=, != as the negation of <, >, == (opset 11 has no
    GreaterOrEqual / LessOrEqual)."""
    def rule(ctx: NodeContext) -> Tensor:
        a, b = _operands(ctx)
        types = [ctx.dtype(v) for v in (a, b) if is_tensor(v)]
        dt = next((t for t in types if t in FLOAT_TYPES), types[0] if types else F32)
        ta, tb = _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b")
        if not negate:
            return ctx.make(onnx_op, [ta, tb], dtype=TensorProto.BOOL)
        c = ctx.make(onnx_op, [ta, tb], tag=onnx_op.lower(), dtype=TensorProto.BOOL)
        return ctx.make("Not", [c], dtype=TensorProto.BOOL)
    rule.__name__ = onnx_op.lower()
    return rule


def matmul(ctx: NodeContext) -> Tensor:
    other = ctx.call.kwargs.get("other", ctx.call.kwargs.get("mat2", _arg_or_none(ctx, 1)))
    return ctx.make("MatMul", [ctx.x(), ctx.tensor(other)])


def _arg_or_none(ctx: NodeContext, i: int) -> Any:
    return ctx.call.args[i] if i < len(ctx.call.args) else None


def where(ctx: NodeContext) -> Tensor:
    cond = ctx.tensor(ctx.arg(0, "condition"), TensorProto.BOOL)
    a, b = ctx.value(ctx.arg(1, "input")), ctx.value(ctx.arg(2, "other"))
    dt = ctx.out_dtype() or F32
    return ctx.make("Where", [cond, _as_tensor(ctx, a, dt, "a"), _as_tensor(ctx, b, dt, "b")])


def cat(ctx: NodeContext) -> Tensor:
    tensors = ctx.arg(0, "tensors")
    if isinstance(tensors, fx.Node):  # a node whose value is the tuple: torch.cat(x.chunk(2)[::-1])
        tensors = ctx.value(tensors)
    dim = int(ctx.arg(1, "dim", 0))
    names = [ctx.tensor(t) for t in tensors]
    if len(names) == 1:
        return ctx.identity(names[0])
    return ctx.make("Concat", names, axis=dim)


# ---------------------------------------------------------------------------
# weight layers (float, observed, fused; the quant state supplies the weights)


def weight_layer_parts(module: nn.Module):
    """(base layer, activation op name or None, with_add, output quantizer) of a weight layer."""
    apq = getattr(module, "activation_post_process", None)
    if isinstance(module, fused.FusedModule):
        act = None if module.act is None else ("relu6" if isinstance(module.act, nn.ReLU6) else "relu")
        return module.op, act, module.with_add, apq
    return module, None, False, apq


def _pads(ctx: NodeContext, padding: Any, kernel: Sequence[int], dilation: Sequence[int]) -> list[int]:
    n = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return [0] * (2 * n)
        if padding == "same":
            total = [d * (k - 1) for k, d in zip(kernel, dilation)]
            return [t // 2 for t in total] + [t - t // 2 for t in total]
        raise ctx.unsupported(f"padding={padding!r}")
    p = _ntuple(padding, n)
    return p + p


def _circular_pad(ctx: NodeContext, x: str, begins: Sequence[int], ends: Sequence[int]) -> Tensor:
    """Wrap-around padding (Pad-11 has no circular mode): per axis, the last ``begins[d]`` and the
    first ``ends[d]`` elements concatenated around the input."""
    for d, (before, after) in enumerate(zip(begins, ends)):
        if not before and not after:
            continue
        axis = ctx.const(f"circ_axis{d}", [d], I64)
        parts = []
        if before:
            parts.append(ctx.make("Slice", [x, ctx.const(f"circ_b{d}", [-before], I64),
                                            ctx.const(f"circ_end{d}", [2**62], I64), axis], tag=f"circ_before{d}"))
        parts.append(x)
        if after:
            parts.append(ctx.make("Slice", [x, ctx.const(f"circ_zero{d}", [0], I64),
                                            ctx.const(f"circ_a{d}", [after], I64), axis], tag=f"circ_after{d}"))
        x = ctx.make("Concat", parts, tag=f"circ_pad{d}", axis=d)
    return x


def conv(ctx: NodeContext, x: str, w: str, b: Optional[str], weight_shape: Sequence[int], stride, padding,
         dilation, groups: int, padding_mode: str = "zeros", tag: Optional[str] = None) -> Tensor:
    kernel = list(weight_shape[2:])
    n = len(kernel)
    dil = _ntuple(dilation, n)
    pads = _pads(ctx, padding, kernel, dil)
    if padding_mode == "circular":
        x = _circular_pad(ctx, x, [0, 0] + pads[:n], [0, 0] + pads[n:])
        pads = [0] * (2 * n)
    elif padding_mode != "zeros":
        mode = {"reflect": "reflect", "replicate": "edge"}.get(padding_mode)
        if mode is None:
            raise ctx.unsupported(f"padding_mode={padding_mode!r} (zeros, reflect, replicate or circular)")
        full = [0, 0] + pads[:n] + [0, 0] + pads[n:]
        x = ctx.make("Pad", [x, ctx.const("pads", full, I64)], tag="pad", mode=mode)
        pads = [0] * (2 * n)
    ins = [x, w] + ([b] if b else [])
    return ctx.make("Conv", ins, tag=tag, kernel_shape=kernel, strides=_ntuple(stride, n), pads=pads,
                    dilations=dil, group=int(groups))


def conv_transpose(ctx: NodeContext, x: str, w: str, b: Optional[str], weight_shape: Sequence[int], stride,
                   padding, output_padding, dilation, groups: int, tag: Optional[str] = None) -> Tensor:
    kernel = list(weight_shape[2:])
    n = len(kernel)
    st, dil = _ntuple(stride, n), _ntuple(dilation, n)
    p = _ntuple(padding, n)
    op_ = _ntuple(output_padding, n)
    in_shape, out_shape = ctx.shape(), ctx.out_shape()
    if in_shape is not None and out_shape is not None and len(out_shape) == n + 2:
        # derive output_padding from the recorded output size (covers forward(x, output_size))
        base = [(in_shape[2 + i] - 1) * st[i] - 2 * p[i] + dil[i] * (kernel[i] - 1) + 1 for i in range(n)]
        op_ = [out_shape[2 + i] - base[i] for i in range(n)]
    ins = [x, w] + ([b] if b else [])
    return ctx.make("ConvTranspose", ins, tag=tag, kernel_shape=kernel, strides=st, pads=p + p, dilations=dil,
                    group=int(groups), output_padding=op_)


def linear_op(ctx: NodeContext, x: str, w: str, b: Optional[str], rank: int, tag: Optional[str] = None) -> Tensor:
    """Gemm for a 2-D input, else MatMul with the transposed weight (+ Add bias)."""
    if rank == 2:
        return ctx.make("Gemm", [x, w] + ([b] if b else []), tag=tag, transB=1)
    wt = ctx.make("Transpose", [w], tag="weight_t", perm=[1, 0])
    y = ctx.make("MatMul", [x, wt], tag=tag)
    return y if b is None else ctx.make("Add", [y, b], tag="bias")


def _finish_layer(ctx: NodeContext, y: str, act: Optional[str], with_add: bool, apq, path: str,
                  base: nn.Module) -> Tensor:
    if with_add:
        other = ctx.arg(1, "other")
        y = ctx.make("Add", [y, ctx.tensor(other)], tag="add")
    if act == "relu":
        y = ctx.make("Relu", [y], tag="relu")
    elif act == "relu6":
        y = clip(ctx, y, 0.0, 6.0, tag="relu6")
    if apq is None and getattr(base, "weight_fake_quant", None) is not None:
        ctx.quant.high_precision_output(ctx, y)  # a quantized layer without output quantizer
        return y
    return ctx.quant.activation_point(ctx, y, apq, f"{path}.activation_post_process")


def _layer_module(ctx: NodeContext):
    module = ctx.module
    base, act, with_add, apq = weight_layer_parts(module)
    base_path = f"{ctx.path}.op" if base is not module else ctx.path
    return base, base_path, act, with_add, apq


def conv2d(ctx: NodeContext) -> Tensor:
    """Conv (any spatial rank); fused modules add Add / Relu / Clip and the output quantizer."""
    x = ctx.x()
    if ctx.module is None:  # F.conv2d(input, weight, bias, stride, padding, dilation, groups)
        wa = ctx.arg(1, "weight")
        ba = ctx.arg(2, "bias", None)
        return conv(ctx, x, ctx.tensor(wa), ctx.tensor(ba) if ba is not None else None, ctx.shape(wa),
                    ctx.arg(3, "stride", 1), ctx.arg(4, "padding", 0), ctx.arg(5, "dilation", 1),
                    ctx.arg(6, "groups", 1))
    base, base_path, act, with_add, apq = _layer_module(ctx)
    w, b = ctx.quant.layer_params(ctx, base, base_path)
    y = conv(ctx, x, w, b, tuple(base.weight.shape), base.stride, base.padding, base.dilation, base.groups,
             getattr(base, "padding_mode", "zeros"))
    return _finish_layer(ctx, y, act, with_add, apq, ctx.path, base)


def conv_transpose2d(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    if ctx.module is None:  # F.conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation)
        wa = ctx.arg(1, "weight")
        ba = ctx.arg(2, "bias", None)
        return conv_transpose(ctx, x, ctx.tensor(wa), ctx.tensor(ba) if ba is not None else None, ctx.shape(wa),
                              ctx.arg(3, "stride", 1), ctx.arg(4, "padding", 0), ctx.arg(5, "output_padding", 0),
                              ctx.arg(7, "dilation", 1), ctx.arg(6, "groups", 1))
    base, base_path, act, with_add, apq = _layer_module(ctx)
    w, b = ctx.quant.layer_params(ctx, base, base_path)
    y = conv_transpose(ctx, x, w, b, tuple(base.weight.shape), base.stride, base.padding, base.output_padding,
                       base.dilation, base.groups)
    return _finish_layer(ctx, y, act, with_add, apq, ctx.path, base)


def linear(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    if ctx.module is None:  # F.linear(input, weight, bias)
        ba = ctx.arg(2, "bias", None)
        return linear_op(ctx, x, ctx.tensor(ctx.arg(1, "weight")), ctx.tensor(ba) if ba is not None else None, rank)
    base, base_path, act, with_add, apq = _layer_module(ctx)
    w, b = ctx.quant.layer_params(ctx, base, base_path)
    y = linear_op(ctx, x, w, b, rank)
    return _finish_layer(ctx, y, act, with_add, apq, ctx.path, base)


# ---------------------------------------------------------------------------
# pooling and resize


def max_pool2d(ctx: NodeContext) -> Tensor:
    if ctx.module is not None:
        m = ctx.module
        k, s, p, d, ceil, ri = m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices
    else:
        k = ctx.arg(1, "kernel_size")
        s = ctx.arg(2, "stride", None)
        p, d = ctx.arg(3, "padding", 0), ctx.arg(4, "dilation", 1)
        ceil, ri = ctx.arg(5, "ceil_mode", False), ctx.arg(6, "return_indices", False)
    if ri:
        raise ctx.unsupported("return_indices=True")
    k = _ntuple(k, 2)
    s = _ntuple(s if s not in (None, [], ()) else k, 2)
    p, d = _ntuple(p, 2), _ntuple(d, 2)
    trim = _ceil_trim(ctx, ceil, k, s, p, d)
    y = ctx.make("MaxPool", [ctx.x()], kernel_shape=k, strides=s, pads=p + p, dilations=d,
                 ceil_mode=int(bool(ceil)), tag="max_pool" if trim else None)
    return _trimmed(ctx, y, trim)


def _ceil_trim(ctx: NodeContext, ceil: bool, k, s, p, d=(1, 1)) -> list[tuple[int, int]]:
    """(axis, torch length) where a ceil-mode pool's ONNX output is one longer than torch's:
    torch drops a last window that would start in the right padding, ONNX keeps it."""
    shape = ctx.shape()
    if not ceil or shape is None or len(shape) != 4:
        return []
    trim = []
    for axis, size in enumerate(shape[2:]):
        want = max_pool_out_size(size, k[axis], s[axis], p[axis], d[axis], True)
        onnx_len = -(-(size + 2 * p[axis] - d[axis] * (k[axis] - 1) - 1) // s[axis]) + 1
        if onnx_len != want:
            trim.append((axis + 2, want))
    return trim


def _trimmed(ctx: NodeContext, y: Tensor, trim: list[tuple[int, int]]) -> Tensor:
    if not trim:
        return y
    return ctx.make("Slice", [y, ctx.const("starts", [0] * len(trim), I64),
                              ctx.const("ends", [e for _, e in trim], I64),
                              ctx.const("axes", [a for a, _ in trim], I64)])


def avg_pool(ctx: NodeContext, x: str, kernel, stride, padding, ceil_mode=False, count_include_pad=True,
             tag: Optional[str] = None) -> Tensor:
    k = _ntuple(kernel, 2)
    s = _ntuple(stride if stride not in (None, [], ()) else k, 2)
    p = _ntuple(padding, 2)
    trim = _ceil_trim(ctx, ceil_mode, k, s, p)
    y = ctx.make("AveragePool", [x], tag=tag or ("average_pool" if trim else None), kernel_shape=k, strides=s,
                 pads=p + p, ceil_mode=int(bool(ceil_mode)), count_include_pad=int(bool(count_include_pad)))
    return _trimmed(ctx, y, trim)


def avg_pool2d(ctx: NodeContext) -> Tensor:
    if ctx.module is not None:
        m = ctx.module
        k, s, p, ceil, cip, div = m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad, \
            m.divisor_override
    else:
        k, s, p = ctx.arg(1, "kernel_size"), ctx.arg(2, "stride", None), ctx.arg(3, "padding", 0)
        ceil, cip = ctx.arg(4, "ceil_mode", False), ctx.arg(5, "count_include_pad", True)
        div = ctx.arg(6, "divisor_override", None)
    if div is not None:
        raise ctx.unsupported("divisor_override")
    return avg_pool(ctx, ctx.x(), k, s, p, ceil, cip)


def adaptive_avg_pool2d(ctx: NodeContext) -> Tensor:
    out = ctx.module.output_size if ctx.module is not None else ctx.arg(1, "output_size")
    out = list(out) if isinstance(out, (list, tuple)) else [out, out]
    shape = ctx.shape()
    if shape is None or len(shape) != 4:
        raise ctx.unsupported("adaptive_avg_pool2d needs a 4-D input of known shape")
    h, w = shape[2], shape[3]
    oh, ow = (h if out[0] is None else out[0]), (w if out[1] is None else out[1])
    x = ctx.x()
    if (oh, ow) == (1, 1):
        return ctx.make("GlobalAveragePool", [x])
    if h % oh == 0 and w % ow == 0:
        return avg_pool(ctx, x, (h // oh, w // ow), (h // oh, w // ow), 0)
    raise ctx.unsupported(f"adaptive output {oh}x{ow} does not divide the input {h}x{w}")


def mean(ctx: NodeContext):
    x = ctx.x()
    rank = ctx.rank()
    dim = ctx.arg(1, "dim", None)
    keepdim = bool(ctx.arg(2, "keepdim", False))
    axes = list(range(rank)) if dim is None else [_norm_axis(int(d), rank) for d in (
        dim if isinstance(dim, (list, tuple)) else [dim])]
    if rank == 4 and sorted(axes) == [2, 3]:  # mean over H, W: a global average pool
        if keepdim:
            return ctx.make("GlobalAveragePool", [x])
        g = ctx.make("GlobalAveragePool", [x], tag="global_avg_pool")
        return ctx.make("Squeeze", [g], axes=[2, 3])
    return ctx.make("ReduceMean", [x], axes=axes, keepdims=int(keepdim))


def interpolate(ctx: NodeContext) -> Tensor:
    if ctx.module is not None:
        m = ctx.module
        size, sf, mode, align, recompute = m.size, m.scale_factor, m.mode, m.align_corners, \
            getattr(m, "recompute_scale_factor", None)
        antialias = False
    else:
        size, sf = ctx.arg(1, "size", None), ctx.arg(2, "scale_factor", None)
        mode, align = ctx.arg(3, "mode", "nearest"), ctx.arg(4, "align_corners", None)
        recompute, antialias = ctx.arg(5, "recompute_scale_factor", None), ctx.arg(6, "antialias", False)
    return resize(ctx, ctx.x(), mode, align, size=size, scale_factor=sf, recompute=recompute,
                  antialias=antialias)


def resize(ctx: NodeContext, x: str, mode: str, align_corners, *, size=None, scale_factor=None, recompute=None,
           antialias=False, tag: Optional[str] = None) -> Tensor:
    """Resize-11. nearest: asymmetric + floor (torch's ``floor(dst * in/out)``); nearest-exact:
    half_pixel + round_prefer_ceil; (bi/tri)linear: half_pixel (align_corners=False, torch clamps
    negative source coordinates to 0 as onnxruntime does) or align_corners."""
    if antialias:
        raise ctx.unsupported("antialias=True")
    in_shape = ctx.shape()
    if in_shape is None:
        raise ctx.unsupported("the input shape is unknown")
    n = len(in_shape) - 2
    if mode == "nearest":
        attrs = dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    elif mode == "nearest-exact":
        attrs = dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil")
    elif mode in ("linear", "bilinear", "trilinear"):
        attrs = dict(mode="linear", coordinate_transformation_mode="align_corners" if align_corners else "half_pixel")
    else:
        raise ctx.unsupported(f"interpolate mode={mode!r}")
    roi = ctx.const("roi", np.zeros(0, np.float32))
    if size is None and scale_factor is not None and not recompute:
        sf = [float(v) for v in _floats(scale_factor, n)]
        scales = ctx.const("scales", [1.0, 1.0] + sf)
        return ctx.make("Resize", [x, roi, scales], tag=tag, **attrs)
    out = ctx.out_shape()
    if size is not None:
        spatial = _ntuple(size, n)
    elif out is not None:
        spatial = list(out[2:])
    else:
        spatial = [int(math.floor(in_shape[2 + i] * s)) for i, s in enumerate(_floats(scale_factor, n))]
    scales = ctx.const("scales", np.zeros(0, np.float32))
    # sizes = [N, C] of the input (kept dynamic) + the spatial sizes
    nc = ctx.make("Slice", [ctx.make("Shape", [x], tag="shape", dtype=I64), ctx.const("nc_start", [0], I64),
                            ctx.const("nc_end", [2], I64)], tag="batch_channels", dtype=I64)
    sizes = ctx.make("Concat", [nc, ctx.const("spatial", spatial, I64)], tag="sizes", dtype=I64, axis=0)
    return ctx.make("Resize", [x, roi, scales, sizes], tag=tag, **attrs)


def _floats(v, n):
    return list(v) if isinstance(v, (list, tuple)) else [v] * n


# ---------------------------------------------------------------------------
# layout


def shape_tensor(ctx: NodeContext, dims: Sequence[Any], tag: str = "shape") -> Tensor:
    """An int64 1-D tensor from python ints and int64 tensors (0-d sizes or 1-D shapes)."""
    dims = list(dims)
    if all(isinstance(d, (int, np.integer)) for d in dims):
        return ctx.const(tag, [int(d) for d in dims], I64)
    pieces: list[str] = []
    run: list[int] = []
    for d in dims:
        if isinstance(d, (int, np.integer)):
            run.append(int(d))
            continue
        if run:
            pieces.append(ctx.const(f"{tag}_part", run, I64))
            run = []
        if not is_tensor(d):
            raise ctx.unsupported(f"shape element {d!r}")
        d = d if ctx.dtype(d) == I64 else ctx.make("Cast", [d], tag="cast_dim", to=I64, dtype=I64)
        pieces.append(ctx.make("Unsqueeze", [d], tag="dim", axes=[0]) if _is_scalar(ctx, d) else d)
    if run:
        pieces.append(ctx.const(f"{tag}_part", run, I64))
    return ctx.make("Concat", pieces, tag=tag, dtype=I64, axis=0)


def _is_scalar(ctx: NodeContext, t: str) -> bool:
    return t in ctx.emitter.scalars


def _dims_args(ctx: NodeContext, start: int, name: str) -> list[Any]:
    """Variadic dims: ``x.view(a, b)`` / ``x.view((a, b))`` / ``torch.reshape(x, (a, b))``."""
    if name in ctx.call.kwargs:
        rest = [ctx.call.kwargs[name]]
    else:
        rest = list(ctx.call.args[start:])
    if len(rest) == 1:
        v = ctx.value(rest[0])
        return list(v) if isinstance(v, (list, tuple)) else [v]
    return [ctx.value(a) for a in rest]


def reshape(ctx: NodeContext) -> Tensor:
    """view / reshape / squeeze / unsqueeze (ops.py maps all of them to "reshape")."""
    name = ctx.call.target if ctx.call.kind == "call_method" else getattr(ctx.call.target, "__name__", "")
    x = ctx.x()
    if name == "squeeze":
        return _squeeze(ctx, x)
    if name == "unsqueeze":
        dim = int(ctx.arg(1, "dim"))
        rank = ctx.rank()
        return ctx.make("Unsqueeze", [x], axes=[_norm_axis(dim, rank + 1)])
    dims = _dims_args(ctx, 1, "shape")
    if len(dims) == 1 and is_tensor(dims[0]) and not _is_scalar(ctx, dims[0]):
        shape = dims[0]  # a whole shape tensor (x.view(y.size()))
    else:
        shape = shape_tensor(ctx, dims)
    return ctx.make("Reshape", [x, shape])


def _squeeze(ctx: NodeContext, x: str) -> Tensor:
    shape = ctx.shape()
    if shape is None:
        raise ctx.unsupported("squeeze of a tensor of unknown shape")
    dim = ctx.arg(1, "dim", None)
    rank = len(shape)
    if dim is None:
        axes = [i for i, s in enumerate(shape) if s == 1]
    else:
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        axes = [a for a in (_norm_axis(int(d), rank) for d in dims) if shape[a] == 1]
    if not axes:
        return ctx.identity(x)
    return ctx.make("Squeeze", [x], axes=axes)


def flatten(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    shape = ctx.shape()
    if shape is None:
        raise ctx.unsupported("flatten of a tensor of unknown shape")
    rank = len(shape)
    if ctx.module is not None:
        start, end = ctx.module.start_dim, ctx.module.end_dim
    else:
        start, end = ctx.arg(1, "start_dim", 0), ctx.arg(2, "end_dim", -1)
    if rank == 0:
        return ctx.make("Reshape", [x, ctx.const("shape", [1], I64)])
    start, end = _norm_axis(int(start), rank), _norm_axis(int(end), rank)
    if start >= end:
        return ctx.identity(x)
    if start == 1 and end == rank - 1:
        return ctx.make("Flatten", [x], axis=1)
    # Flatten-11 always makes 2-D: copy the leading dims (0), merge, keep the trailing static dims
    dims = [0] * start + [-1] + [int(s) for s in shape[end + 1:]]
    return ctx.make("Reshape", [x, ctx.const("shape", dims, I64)])


def permute(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    dims = _dims_args(ctx, 1, "dims")
    return ctx.make("Transpose", [x], perm=[_norm_axis(int(d), rank) for d in dims])


def transpose(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    d0, d1 = _norm_axis(int(ctx.arg(1, "dim0")), rank), _norm_axis(int(ctx.arg(2, "dim1")), rank)
    perm = list(range(rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    if d0 == d1:
        return ctx.identity(x)
    return ctx.make("Transpose", [x], perm=perm)


def size(ctx: NodeContext):
    """``x.size()`` -> Shape (1-D int64), ``x.size(d)`` -> Shape + Gather (0-d int64): sizes stay
    dynamic, so a reshape fed by them follows a dynamic batch. ``x.dim()`` folds to the rank."""
    if ctx.call.method == "dim":
        return ctx.rank()
    x = ctx.x()
    shape = ctx.make("Shape", [x], tag="shape" if ctx.arg(1, "dim", None) is not None else None, dtype=I64)
    d = ctx.arg(1, "dim", None)
    if d is None:
        return shape
    idx = ctx.const("index", _norm_axis(int(d), ctx.rank()), I64)
    out = ctx.make("Gather", [shape, idx], axis=0, dtype=I64)
    ctx.emitter.scalars.add(out)
    return out


def getattr_(ctx: NodeContext):
    """``x.shape`` (Shape), ``x.dtype`` / ``x.ndim`` (folded)."""
    attr = ctx.call.args[1]
    obj = ctx.call.args[0]
    if attr == "shape":
        return ctx.make("Shape", [ctx.tensor(obj)], dtype=I64)
    if attr == "ndim":
        return ctx.rank(obj)
    if attr in ("dtype", "device", "is_cuda", "requires_grad"):
        info = obj.meta.get("qc_tensor") if isinstance(obj, fx.Node) else None
        if attr == "dtype" and info is not None:
            from qcompiler.ir.shape_prop import _DTYPE_NAMES
            rev = {v: k for k, v in _DTYPE_NAMES.items()}
            return rev.get(info.dtype)
        return {"device": torch.device("cpu"), "is_cuda": False, "requires_grad": False}.get(attr)
    raise ctx.unsupported(f"getattr {attr!r}")


def getitem(ctx: NodeContext):
    obj = ctx.value(ctx.arg(0, None))
    idx = ctx.call.args[1]
    if isinstance(obj, (tuple, list)):
        return obj[ctx.value(idx)]
    if not is_tensor(obj):
        return obj[ctx.value(idx)]
    return _index_tensor(ctx, obj, idx)


def _index_tensor(ctx: NodeContext, x: str, idx: Any) -> Tensor:
    if x in ctx.emitter.scalars:
        raise ctx.unsupported("indexing a 0-d tensor")
    items = list(idx) if isinstance(idx, tuple) else [idx]
    shape = ctx.shape(ctx.arg(0, None))
    if shape is None:
        if ctx.dtype(x) == I64 and len(items) == 1 and isinstance(items[0], int):  # a size() shape vector
            out = ctx.make("Gather", [x, ctx.const("index", items[0], I64)], axis=0, dtype=I64)
            ctx.emitter.scalars.add(out)
            return out
        raise ctx.unsupported("indexing a tensor of unknown shape")
    rank = len(shape)
    specified = sum(1 for it in items if it is not None and it is not Ellipsis)
    starts, ends, axes, steps, squeeze, unsqueeze = [], [], [], [], [], []
    gather = None
    d = out_dim = 0
    for it in items:
        if it is Ellipsis:
            skip = rank - specified
            d += skip
            out_dim += skip
        elif it is None:
            unsqueeze.append(out_dim)
            out_dim += 1
        elif isinstance(it, bool):
            raise ctx.unsupported("boolean indexing")
        elif isinstance(it, int):
            starts.append(it)
            ends.append(it + 1 if it != -1 else INT64_MAX)
            axes.append(d)
            steps.append(1)
            squeeze.append(d)
            d += 1
        elif isinstance(it, slice):
            vals = [ctx.value(v) for v in (it.start, it.stop, it.step)]
            if any(v is not None and not isinstance(v, int) for v in vals):
                raise ctx.unsupported("slice bounds that are tensors")
            start, stop, step = vals
            step = 1 if step is None else step
            if step <= 0:
                raise ctx.unsupported("slices with a step <= 0")
            start = 0 if start is None else start
            stop = INT64_MAX if stop is None else stop
            if (start, stop, step) != (0, INT64_MAX, 1):
                starts.append(start)
                ends.append(stop)
                axes.append(d)
                steps.append(step)
            d += 1
            out_dim += 1
        elif isinstance(it, fx.Node) and gather is None:
            gather = (d, ctx.tensor(it, I64))
            d += 1
            out_dim += 1
        else:
            raise ctx.unsupported(f"index {it!r}")
    y = x
    last = not squeeze and not unsqueeze and gather is None
    if starts:
        y = ctx.make("Slice", [y, ctx.const("starts", starts, I64), ctx.const("ends", ends, I64),
                               ctx.const("axes", axes, I64), ctx.const("steps", steps, I64)],
                     tag=None if last else "slice")
    if squeeze:
        last = not unsqueeze and gather is None
        y = ctx.make("Squeeze", [y], tag=None if last else "squeeze", axes=squeeze)
    if gather is not None:
        axis, index = gather
        axis -= sum(1 for s in squeeze if s < axis)
        y = ctx.make("Gather", [y, index], tag=None if not unsqueeze else "gather", axis=axis)
    if unsqueeze:
        y = ctx.make("Unsqueeze", [y], axes=unsqueeze)
    if y == x:
        y = ctx.identity(x)
    return y


def split(ctx: NodeContext):
    """x.chunk(n, dim) / x.split(size_or_sections, dim): Split with the recorded piece sizes."""
    x = ctx.x()
    info = ctx.node.meta.get("qc_tensor")
    dim = int(ctx.arg(2, "dim", 0))
    rank = ctx.rank()
    axis = _norm_axis(dim, rank)
    if not isinstance(info, (tuple, list)) or not info:
        raise ctx.unsupported("split/chunk without recorded output shapes")
    sizes = [t.shape[axis] for t in info]
    if len(sizes) == 1:
        return (ctx.identity(x),)
    outs = ctx.make("Split", [x], outputs=len(sizes), axis=axis, split=sizes)
    return tuple(outs)


def pad(ctx: NodeContext) -> Tensor:
    """F.pad: torch lists (begin, end) pairs from the last dim backwards; Pad-11 wants all begins
    then all ends, first dim first."""
    x = ctx.x()
    rank = ctx.rank()
    pads = [int(p) for p in ctx.arg(1, "pad")]
    mode = ctx.arg(2, "mode", "constant")
    value = ctx.arg(3, "value", None)
    if any(p < 0 for p in pads):
        raise ctx.unsupported("negative padding (cropping)")
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pads) // 2):
        d = rank - 1 - i
        begins[d], ends[d] = pads[2 * i], pads[2 * i + 1]
    if mode == "circular":
        return _circular_pad(ctx, x, begins, ends)
    onnx_mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}.get(mode)
    if onnx_mode is None:
        raise ctx.unsupported(f"pad mode={mode!r} (constant, reflect, replicate or circular)")
    ins = [x, ctx.const("pads", begins + ends, I64)]
    if onnx_mode == "constant" and value:
        ins.append(ctx.const("value", float(value), ctx.dtype(x)))
    return ctx.make("Pad", ins, mode=onnx_mode)


def embedding(ctx: NodeContext) -> Tensor:
    idx = ctx.x()
    if ctx.module is not None:
        if ctx.module.max_norm is not None:
            raise ctx.unsupported("Embedding with max_norm (renormalizes the weight in forward)")
        w = ctx.param(ctx.module, "weight", ctx.path)
    else:
        w = ctx.tensor(ctx.arg(1, "weight"))
    return ctx.make("Gather", [w, idx], axis=0, dtype=ctx.dtype(w))


# ---------------------------------------------------------------------------
# LSTM

_IFGO_TO_IOFC = (0, 3, 1, 2)  # torch chunks (i, f, g, o) -> ONNX (i, o, f, c)


def _reorder_gates(a: np.ndarray, hidden: int) -> np.ndarray:
    chunks = [a[k * hidden:(k + 1) * hidden] for k in range(4)]
    return np.concatenate([chunks[k] for k in _IFGO_TO_IOFC], axis=0)


def lstm(ctx: NodeContext):
    """nn.LSTM -> one ONNX LSTM per layer (gates reordered to iofc, biases [Wb, Rb]),
    time-major (batch_first is transposed), initial (h, c) sliced per layer; returns
    ``(output, (h_n, c_n))`` like torch."""
    m = ctx.module
    if not isinstance(m, nn.LSTM):
        raise ctx.unsupported("only nn.LSTM modules")
    if getattr(m, "proj_size", 0):
        raise ctx.unsupported("LSTM with proj_size")
    shape = ctx.shape()
    if shape is None or len(shape) != 3:
        raise ctx.unsupported("LSTM needs a batched 3-D input")
    x = ctx.x()
    hx = ctx.value(ctx.arg(1, "hx", None))
    H, L = m.hidden_size, m.num_layers
    nd = 2 if m.bidirectional else 1
    path = ctx.path
    if m.batch_first:
        x = ctx.make("Transpose", [x], tag="time_major", perm=[1, 0, 2])
    hs, cs = [], []
    for layer in range(L):
        sfx = [f"_l{layer}", f"_l{layer}_reverse"][:nd]
        W = np.stack([_reorder_gates(to_numpy(getattr(m, f"weight_ih{s}")), H) for s in sfx])
        R = np.stack([_reorder_gates(to_numpy(getattr(m, f"weight_hh{s}")), H) for s in sfx])
        if m.bias:
            B = np.stack([np.concatenate([_reorder_gates(to_numpy(getattr(m, f"bias_ih{s}")), H),
                                          _reorder_gates(to_numpy(getattr(m, f"bias_hh{s}")), H)]) for s in sfx])
        else:
            B = np.zeros((nd, 8 * H), np.float32)
        w = ctx.initializer(f"{path}.W_l{layer}", W)
        r = ctx.initializer(f"{path}.R_l{layer}", R)
        b = ctx.initializer(f"{path}.B_l{layer}", B)
        h0 = c0 = ""
        if hx is not None:
            h_all, c_all = hx
            if L == 1:
                h0, c0 = h_all, c_all
            else:
                starts = ctx.const("layer_start", [layer * nd], I64)
                ends = ctx.const("layer_end", [(layer + 1) * nd], I64)
                ax = ctx.const("axis0", [0], I64)
                h0 = ctx.make("Slice", [h_all, starts, ends, ax], tag=f"h0_l{layer}")
                c0 = ctx.make("Slice", [c_all, starts, ends, ax], tag=f"c0_l{layer}")
        ins = [x, w, r, b, "", h0, c0]
        while ins[-1] == "":
            ins.pop()
        y, yh, yc = ctx.make("LSTM", ins, outputs=3, tag=None if layer == 0 else f"lstm_l{layer}",
                             hidden_size=H, direction="bidirectional" if nd == 2 else "forward")
        # Y: [seq, num_directions, batch, hidden] -> [seq, batch, num_directions * hidden]
        if nd == 1:
            x = ctx.make("Squeeze", [y], tag=f"y_l{layer}", axes=[1])
        else:
            t = ctx.make("Transpose", [y], tag=f"y_t_l{layer}", perm=[0, 2, 1, 3])
            x = ctx.make("Reshape", [t, ctx.const("merge_dirs", [0, 0, -1], I64)], tag=f"y_l{layer}")
        hs.append(yh)
        cs.append(yc)
    out = ctx.make("Transpose", [x], tag="batch_major", perm=[1, 0, 2]) if m.batch_first else x
    h_n = hs[0] if L == 1 else ctx.make("Concat", hs, tag="h_n", axis=0)
    c_n = cs[0] if L == 1 else ctx.make("Concat", cs, tag="c_n", axis=0)
    return (out, (h_n, c_n))


# ---------------------------------------------------------------------------
# converted (fixed-point) modules added here; quant.py has the others


def converted_constant_operand(ctx: NodeContext) -> Tensor:
    """QuantizedConstantOperand: the float op on the dequantized feature map and the constant
    (an initializer ``q * s``, listed in the sidecar like a weight), quantized once at the
    output scale (the BPU's one requantization)."""
    m, path = ctx.module, ctx.path
    c = quantized_constant(ctx, f"{path}.constant", m.constant, m.const_scale)
    ins = [ctx.x(), c] if m.const_index == 1 else [c, ctx.x()]
    if m.qc_op != "mul" and abs(m.alpha) != 1.0:  # alpha scales operand 1; its sign is in add/sub
        ins[1] = ctx.make("Mul", [ins[1], ctx.const("alpha", abs(m.alpha))], tag="alpha")
    y = ctx.make({"add": "Add", "sub": "Sub", "mul": "Mul"}[m.qc_op], ins)
    return ctx.quant.quantize_point(ctx, y, m.out_scale, m.out_dtype, path)


def converted_constant(ctx: NodeContext) -> Tensor:
    """QuantizedConstant: its dequantized integers as an initializer (scale in the sidecar)."""
    m = ctx.module
    return quantized_constant(ctx, f"{ctx.path}.value", m.value, m.out_scale)


def converted_div(ctx: NodeContext) -> Tensor:
    """QuantizedDiv: Div of the dequantized operands, quantized at the output scale. (A zero
    divisor gives +-inf, which QuantizeLinear saturates like the BPU; 0/0 is NaN here, 0 there.)"""
    m = ctx.module
    y = ctx.make("Div", [ctx.tensor(ctx.arg(0, "input")), ctx.tensor(ctx.arg(1, "other"))])
    return ctx.quant.quantize_point(ctx, y, m.out_scale, m.out_dtype, ctx.path)


# ---------------------------------------------------------------------------
# stubs and quantizers (float view; quant.py has the module rules)


def quant_stub(ctx: NodeContext):
    """A QuantStub: its ``activation_post_process`` quantizes (Identity in a float export)."""
    apq = getattr(ctx.module, "activation_post_process", None) if ctx.module is not None else None
    path = f"{ctx.path}.activation_post_process" if ctx.path else ctx.node.name
    return ctx.quant.activation_point(ctx, ctx.x(), apq, path, always_node=True)


def dequant_stub(ctx: NodeContext):
    return identity(ctx)
