"""Normalization rules: layer_norm (decomposed: opset 11 has no LayerNormalization), batch_norm."""

from __future__ import annotations

import numpy as np
import torch

from qcompiler.backends.onnx.context import (
    REQUIRED,
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.conv import conv
from qcompiler.nn.qat import bn_affine, bn_weight
from qcompiler.quantization.fixed_point import bias_codes


@emits("layer_norm")
def layer_norm(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    kw = ctx.kw(normalized_shape=REQUIRED, weight=None, bias=None, eps=1e-5)
    shape, eps = kw["normalized_shape"], kw["eps"]
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    w = ctx.tensor(kw["weight"]) if kw["weight"] is not None else None
    b = ctx.tensor(kw["bias"]) if kw["bias"] is not None else None
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


@emits("batch_norm", "batch_norm1d")
def batch_norm(ctx: NodeContext) -> Tensor:
    """Inference BatchNormalization with the running statistics (export is eval); a BPU
    BatchNorm2d of a prepared model, quantized, is the depthwise 1x1 conv the BPU computes."""
    x = ctx.x()
    if ctx.module is not None and ctx.quant.quantize and ctx.module.__dict__.get("_qc_input_quantizer") is not None:
        return _quantized_batch_norm(ctx, x)
    # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    kw = ctx.kw(running_mean=None, running_var=None, weight=None, bias=None, training=False, momentum=0.1,
                eps=1e-5)
    if kw["running_mean"] is None or kw["running_var"] is None:
        raise ctx.unsupported("BatchNorm without running statistics")
    if kw["training"]:
        raise ctx.unsupported("batch_norm with training=True normalizes with the batch's statistics; "
                              "the export computes inference BatchNormalization (call it with training=False)")
    mean, var = ctx.tensor(kw["running_mean"]), ctx.tensor(kw["running_var"])
    scale = ctx.tensor(kw["weight"]) if kw["weight"] is not None else _filled(ctx, "scale", 1.0)
    bias = ctx.tensor(kw["bias"]) if kw["bias"] is not None else _filled(ctx, "bias", 0.0)
    return ctx.make("BatchNormalization", [x, scale, bias, mean, var], epsilon=float(kw["eps"]))


def _filled(ctx: NodeContext, tag: str, value: float) -> Tensor:
    """A per-channel constant for a BatchNorm without affine weight or bias."""
    shape = ctx.shape()
    if shape is None or len(shape) < 2:
        raise ctx.unsupported("batch_norm without weight or bias needs an input of known shape (N, C, ...)")
    return ctx.const(tag, np.full(shape[1], value, np.float32))


def _quantized_batch_norm(ctx: NodeContext, x: str) -> Tensor:
    """``qat.BatchNorm2d`` as convert lowers it: weights ``+-127`` at ``|a_c| / 127``
    (``qat.bn_weight``), the bias on the grid ``s_in * s_w``; scales in the sidecar."""
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
