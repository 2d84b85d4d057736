"""Weight-layer rules: conv, transposed conv, linear (float, observed or fused: op + add + activation
+ output quantizer; the quant state supplies the weights), and matmul."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.nn as nn

from qcompiler.backends.onnx.context import (
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _arg_or_none, _circular_pad, _ntuple
from qcompiler.backends.onnx.rules.elementwise import clip
from qcompiler.ir.ops import REQUIRED
from qcompiler.nn import fused
from qcompiler.quantization.fixed_point import pads4


@emits("matmul")
def matmul(ctx: NodeContext) -> Tensor:
    other = ctx.call.kwargs.get("other", ctx.call.kwargs.get("mat2", _arg_or_none(ctx, 1)))
    return ctx.make("MatMul", [ctx.x(), ctx.tensor(other)])


@emits("dot", since=11)
def dot(ctx: NodeContext) -> Tensor:
    """torch.dot (1-D . 1-D -> 0-d) and torch.mv (2-D . 1-D): MatMul, numpy's rules (the ``mat2`` of mm
    is ``vec`` / ``tensor`` here)."""
    other = ctx.call.kwargs.get("vec", ctx.call.kwargs.get("tensor", _arg_or_none(ctx, 1)))
    return ctx.make("MatMul", [ctx.x(), ctx.tensor(other)])


@emits("addmm", since=11)
def addmm(ctx: NodeContext) -> Tensor:
    """addmm / baddbmm / addmv: beta * input + alpha * (a @ b), input broadcast (MatMul, Mul, Add; Gemm
    would need a 2-D input of the output's shape)."""
    kw = ctx.kw(a=REQUIRED, b=REQUIRED, beta=1, alpha=1)
    for name in ("mat1", "batch1", "mat"):
        if name in ctx.call.kwargs:
            kw["a"] = ctx.call.kwargs[name]
    for name in ("mat2", "batch2", "vec"):
        if name in ctx.call.kwargs:
            kw["b"] = ctx.call.kwargs[name]
    if not all(isinstance(kw[k], (int, float)) for k in ("alpha", "beta")):
        raise ctx.unsupported("alpha / beta that are tensors (give Python numbers)")
    dt = ctx.out_dtype() or ctx.dtype(ctx.x())
    y = ctx.make("MatMul", [ctx.tensor(kw["a"]), ctx.tensor(kw["b"])], tag="matmul")
    if kw["alpha"] != 1:
        y = ctx.make("Mul", [y, ctx.const("alpha", kw["alpha"], dt)], tag="alpha")
    if kw["beta"] == 0:  # torch ignores input (even NaN) when beta is 0
        return ctx.make("Identity", [y])
    x = ctx.x()
    if kw["beta"] != 1:
        x = ctx.make("Mul", [x, ctx.const("beta", kw["beta"], dt)], tag="beta")
    return ctx.make("Add", [x, y])


@emits("addbmm", "addr", since=11)
def addbmm_addr(ctx: NodeContext) -> Tensor:
    """addbmm: beta * input + alpha * sum_b(b1[b] @ b2[b]); addr: beta * input + alpha * outer(v1, v2)."""
    if ctx.op == "addbmm":
        kw = ctx.kw(batch1=REQUIRED, batch2=REQUIRED, beta=1, alpha=1)
        prod = ctx.make("MatMul", [ctx.tensor(kw["batch1"]), ctx.tensor(kw["batch2"])], tag="bmm")
        y = ctx.make("ReduceSum", [prod], tag="sum", axes=[0], keepdims=0)
    else:
        kw = ctx.kw(vec1=REQUIRED, vec2=REQUIRED, beta=1, alpha=1)
        col = ctx.make("Unsqueeze", [ctx.tensor(kw["vec1"])], tag="col", axes=[1])
        row = ctx.make("Unsqueeze", [ctx.tensor(kw["vec2"])], tag="row", axes=[0])
        y = ctx.make("Mul", [col, row], tag="outer")
    if not all(isinstance(kw[k], (int, float)) for k in ("alpha", "beta")):
        raise ctx.unsupported("alpha / beta that are tensors (give Python numbers)")
    dt = ctx.dtype(y)
    if kw["alpha"] != 1:
        y = ctx.make("Mul", [y, ctx.const("alpha", kw["alpha"], dt)], tag="alpha")
    if kw["beta"] == 0:
        return ctx.make("Identity", [y])
    x = ctx.x()
    if kw["beta"] != 1:
        x = ctx.make("Mul", [x, ctx.const("beta", kw["beta"], dt)], tag="beta")
    return ctx.make("Add", [x, y])


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
    if n == 2 and isinstance(padding, (list, tuple)) and len(padding) == 4:
        return list(pads4(padding))  # four sides (t, l, b, r): ONNX's order (begins, then ends)
    p = _ntuple(padding, n)
    return p + p


def conv(ctx: NodeContext, x: str, w: str, b: Optional[str], weight_shape: Sequence[int], stride, padding,
         dilation, groups: int, padding_mode: str = "zeros", tag: Optional[str] = None) -> Tensor:
    kernel = list(weight_shape[2:])
    n = len(kernel)
    dil = _ntuple(dilation, n)
    pads = _pads(ctx, padding, kernel, dil)
    if padding_mode == "circular":
        x = _circular_pad(ctx, x, [0, 0] + pads[:n], [0, 0] + pads[n:])
        pads = [0] * (2 * n)
    elif padding_mode not in fused.ZERO_PADDING_MODES:
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
    if any(o >= s for o, s in zip(op_, st)):  # torch allows it up to the dilation; ConvTranspose-11 does not
        raise ctx.unsupported(f"output_padding {op_} not below the stride {st} (ONNX ConvTranspose requires it)")
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


@emits("conv1d", "conv2d", "conv3d")
def conv2d(ctx: NodeContext) -> Tensor:
    """Conv (any spatial rank); fused modules add Add / Relu / Clip and the output quantizer."""
    x = ctx.x()
    if ctx.module is None:  # F.conv2d; a module here is a (fused, observed) layer the quant state reads
        kw = ctx.kw(weight=REQUIRED, bias=None, stride=1, padding=0, dilation=1, groups=1)
        b = ctx.tensor(kw["bias"]) if kw["bias"] is not None else None
        return conv(ctx, x, ctx.tensor(kw["weight"]), b, ctx.shape(kw["weight"]), kw["stride"], kw["padding"],
                    kw["dilation"], kw["groups"])
    base, base_path, act, with_add, apq = _layer_module(ctx)
    w, b = ctx.quant.layer_params(ctx, base, base_path)
    y = conv(ctx, x, w, b, tuple(base.weight.shape), base.stride, base.padding, base.dilation, base.groups,
             getattr(base, "padding_mode", "zeros"))
    return _finish_layer(ctx, y, act, with_add, apq, ctx.path, base)


@emits("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
def conv_transpose2d(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    if ctx.module is None:  # F.conv_transpose2d
        kw = ctx.kw(weight=REQUIRED, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1)
        b = ctx.tensor(kw["bias"]) if kw["bias"] is not None else None
        return conv_transpose(ctx, x, ctx.tensor(kw["weight"]), b, ctx.shape(kw["weight"]), kw["stride"],
                              kw["padding"], kw["output_padding"], kw["dilation"], kw["groups"])
    base, base_path, act, with_add, apq = _layer_module(ctx)
    w, b = ctx.quant.layer_params(ctx, base, base_path)
    y = conv_transpose(ctx, x, w, b, tuple(base.weight.shape), base.stride, base.padding, base.output_padding,
                       base.dilation, base.groups)
    return _finish_layer(ctx, y, act, with_add, apq, ctx.path, base)


@emits("linear")
def linear(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    if ctx.module is None:  # F.linear
        kw = ctx.kw(weight=REQUIRED, bias=None)
        b = ctx.tensor(kw["bias"]) if kw["bias"] is not None else None
        return linear_op(ctx, x, ctx.tensor(kw["weight"]), b, rank)
    base, base_path, act, with_add, apq = _layer_module(ctx)
    w, b = ctx.quant.layer_params(ctx, base, base_path)
    y = linear_op(ctx, x, w, b, rank)
    return _finish_layer(ctx, y, act, with_add, apq, ctx.path, base)
