"""Normalization rules: layer_norm (decomposed: opset 11 has no LayerNormalization), batch_norm,
group_norm and instance_norm (InstanceNormalization), normalize (a p-norm), local_response_norm (LRN)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from qcompiler.backends.onnx.context import (
    ModuleTensor,
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _norm_axis
from qcompiler.backends.onnx.rules.conv import conv
from qcompiler.backends.onnx.rules.elementwise import clip
from qcompiler.ir.ops import REQUIRED
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


@emits("batch_norm", "batch_norm1d", "batch_norm3d")
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


def _per_channel(ctx: NodeContext, a, rank: int, tag: str) -> Tensor:
    """A (C,) weight or bias shaped (C, 1, ..., 1) to broadcast along dim 1 of a rank-``rank`` input."""
    if isinstance(a, ModuleTensor):
        return ctx.param(a.module, a.attr, a.path, transform=lambda v: v.reshape((-1,) + (1,) * (rank - 2)))
    return ctx.make("Reshape", [ctx.tensor(a), ctx.const(f"{tag}_shape", [-1] + [1] * (rank - 2), I64)], tag=tag)


def _affine(ctx: NodeContext, y: str, weight, bias, rank: int) -> Tensor:
    """``y * weight + bias`` per channel (either may be None)."""
    if weight is not None:
        y = ctx.make("Mul", [y, _per_channel(ctx, weight, rank, "weight")], tag="scaled" if bias is not None else None)
    if bias is not None:
        y = ctx.make("Add", [y, _per_channel(ctx, bias, rank, "bias")])
    return y


def _instance_normalization(ctx: NodeContext, x: str, channels: int, eps: float, tag=None) -> Tensor:
    """InstanceNormalization of (N, C, ...) over each (n, c) with unit scale and zero bias."""
    return ctx.make("InstanceNormalization", [x, _filled_n(ctx, "ones", channels, 1.0),
                                              _filled_n(ctx, "zeros", channels, 0.0)], tag=tag, epsilon=float(eps))


def _filled_n(ctx: NodeContext, tag: str, n: int, value: float) -> Tensor:
    return ctx.const(tag, np.full(n, value, np.float32))


@emits("group_norm", since=11)
def group_norm(ctx: NodeContext) -> Tensor:
    """Opset 11 has no GroupNormalization: (N, C, ...) is reshaped to (N, G, -1), instance-normalized,
    reshaped back, then the per-channel affine."""
    kw = ctx.kw(num_groups=REQUIRED, weight=None, bias=None, eps=1e-5)
    x, shape, g = ctx.x(), ctx.shape(), int(kw["num_groups"])
    if shape is None or len(shape) < 2:
        raise ctx.unsupported("group_norm needs an input of known shape (N, C, ...)")
    grouped = ctx.make("Reshape", [x, ctx.const("grouped_shape", [0, g, -1], I64)], tag="grouped")
    normed = _instance_normalization(ctx, grouped, g, kw["eps"], tag="normalized")
    y = ctx.make("Reshape", [normed, ctx.make("Shape", [x], tag="shape", dtype=I64)],
                 tag="ungrouped" if kw["weight"] is not None or kw["bias"] is not None else None)
    return _affine(ctx, y, kw["weight"], kw["bias"], len(shape))


@emits("instance_norm", since=11)
def instance_norm(ctx: NodeContext) -> Tensor:
    """F.instance_norm / nn.InstanceNorm1d-3d as torch evaluates them: the input's statistics
    (InstanceNormalization), or the running statistics where a module tracks them (eval) or the
    call says ``use_input_stats=False`` (BatchNormalization)."""
    kw = ctx.kw(running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1,
                eps=1e-5)
    x, shape = ctx.x(), ctx.shape()
    if shape is None:
        raise ctx.unsupported("instance_norm needs an input of known shape (run shape propagation first)")
    if ctx.module is not None:  # eval: a module that tracks running statistics normalizes with them
        kw["use_input_stats"] = not ctx.module.track_running_stats
        unbatched = next((r for cls, r in _UNBATCHED_RANK.items() if isinstance(ctx.module, cls)), None)
        if len(shape) == unbatched:  # (C, ...): a batch of one
            y = _instance_norm(ctx, ctx.make("Unsqueeze", [x], tag="batched", axes=[0]), (1, *shape), kw, "normalized")
            return ctx.make("Squeeze", [y], axes=[0])
    if len(shape) < 3:
        raise ctx.unsupported(f"instance_norm of a rank-{len(shape)} input (it takes (N, C, L, ...))")
    return _instance_norm(ctx, x, shape, kw)


def _instance_norm(ctx: NodeContext, x: str, shape, kw: dict, tag=None) -> Tensor:
    rank, c = len(shape), shape[1]
    affine = kw["weight"] is not None or kw["bias"] is not None
    if kw["use_input_stats"]:
        return _affine(ctx, _instance_normalization(ctx, x, c, kw["eps"], tag="normalized" if affine else tag),
                       kw["weight"], kw["bias"], rank)
    if kw["running_mean"] is None or kw["running_var"] is None:
        raise ctx.unsupported("instance_norm with use_input_stats=False needs running_mean and running_var")
    scale = ctx.tensor(kw["weight"]) if kw["weight"] is not None else _filled_n(ctx, "scale", c, 1.0)
    bias = ctx.tensor(kw["bias"]) if kw["bias"] is not None else _filled_n(ctx, "bias", c, 0.0)
    return ctx.make("BatchNormalization", [x, scale, bias, ctx.tensor(kw["running_mean"]),
                                           ctx.tensor(kw["running_var"])], tag=tag, epsilon=float(kw["eps"]))


# InstanceNorm module -> the rank of an unbatched input (C, L...), which torch normalizes as a batch of one
_UNBATCHED_RANK = {nn.InstanceNorm1d: 2, nn.InstanceNorm2d: 3, nn.InstanceNorm3d: 4}


# p -> ONNX reduction that computes the p-norm in one node
_NORM_REDUCE = {1.0: "ReduceL1", 2.0: "ReduceL2"}


@emits("normalize", since=11)
def normalize(ctx: NodeContext) -> Tensor:
    """F.normalize: ``x / max(||x||_p over dim, eps)``, p = 1, 2 (ReduceL1 / ReduceL2), inf, or any p > 0."""
    kw = ctx.kw(p=2.0, dim=1, eps=1e-12, out=None)
    if kw["out"] is not None:
        raise ctx.unsupported("normalize with out= (an in-place write)")
    p, x = float(kw["p"]), ctx.x()
    if not p > 0:
        raise ctx.unsupported(f"normalize with p={kw['p']!r} (p must be > 0)")
    axes = [_norm_axis(int(kw["dim"]), ctx.rank())]
    if p in _NORM_REDUCE:
        norm = ctx.make(_NORM_REDUCE[p], [x], tag="norm", axes=axes, keepdims=1)
    elif p == float("inf"):
        norm = ctx.make("ReduceMax", [ctx.make("Abs", [x], tag="abs")], tag="norm", axes=axes, keepdims=1)
    else:
        powed = ctx.make("Pow", [ctx.make("Abs", [x], tag="abs"), ctx.const("p", p)], tag="abs_pow")
        summed = ctx.make("ReduceSum", [powed], tag="sum", axes=axes, keepdims=1)
        norm = ctx.make("Pow", [summed, ctx.const("inv_p", 1.0 / p)], tag="norm")
    return ctx.make("Div", [x, clip(ctx, norm, float(kw["eps"]), None, tag="norm_eps")])


@emits("local_response_norm", since=11)
def local_response_norm(ctx: NodeContext) -> Tensor:
    """``x / (k + alpha / size * sum of x^2 over a window of size channels) ^ beta``, per position.
    An odd size is ONNX LRN (4-d: the spatial dims are flattened to one); torch centres an even
    window one channel lower than LRN does, so that is summed here as torch does."""
    kw = ctx.kw(size=REQUIRED, alpha=1e-4, beta=0.75, k=1.0)
    size, x, shape = int(kw["size"]), ctx.x(), ctx.shape()
    alpha, beta, k = float(kw["alpha"]), float(kw["beta"]), float(kw["k"])
    if shape is None or len(shape) < 3:
        raise ctx.unsupported("local_response_norm needs an input of known shape (N, C, L, ...)")
    if size % 2 == 0:
        return _even_window_lrn(ctx, x, shape[1], size, alpha, beta, k)
    if len(shape) == 4:
        return ctx.make("LRN", [x], size=size, alpha=alpha, beta=beta, bias=k)
    x4 = ctx.make("Reshape", [x, ctx.const("flat_shape", [0, 0, -1, 1], I64)], tag="to_4d")
    y = ctx.make("LRN", [x4], tag="lrn", size=size, alpha=alpha, beta=beta, bias=k)
    return ctx.make("Reshape", [y, ctx.make("Shape", [x], tag="shape", dtype=I64)])


def _even_window_lrn(ctx: NodeContext, x: str, c: int, size: int, alpha: float, beta: float, k: float) -> Tensor:
    """torch's form: x^2 as (N, 1, C, S), zero-padded by size // 2 channels before and (size - 1) // 2
    after, averaged over windows of ``size`` channels; ``x / (k + alpha * mean) ^ beta``."""
    sq = ctx.make("Reshape", [ctx.make("Mul", [x, x], tag="square"), ctx.const("window_shape", [0, 1, c, -1], I64)],
                  tag="channels_as_h")
    pads = ctx.const("window_pads", [0, 0, size // 2, 0, 0, 0, (size - 1) // 2, 0], I64)
    avg = ctx.make("AveragePool", [ctx.make("Pad", [sq, pads], tag="pad", mode="constant")], tag="window_mean",
                   kernel_shape=[size, 1])
    avg = ctx.make("Reshape", [avg, ctx.make("Shape", [x], tag="shape", dtype=I64)], tag="back")
    div = ctx.make("Pow", [ctx.make("Add", [ctx.make("Mul", [avg, ctx.const("alpha", alpha)], tag="scaled"),
                                            ctx.const("k", k)], tag="plus_k"), ctx.const("beta", beta)], tag="div")
    return ctx.make("Div", [x, div])


@emits("rms_norm", since=11)
def rms_norm(ctx: NodeContext) -> Tensor:
    """x / sqrt(mean(x^2 over the last len(normalized_shape) dims) + eps) * weight; eps None is the
    dtype's machine epsilon (as torch)."""
    kw = ctx.kw(normalized_shape=REQUIRED, weight=None, eps=None)
    shape = kw["normalized_shape"]
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    x = ctx.x()
    eps = kw["eps"] if kw["eps"] is not None else float(np.finfo(np.float32).eps)
    ms = ctx.make("ReduceMean", [ctx.make("Mul", [x, x], tag="square")], tag="mean_square", axes=list(range(-k, 0)),
                  keepdims=1)
    rms = ctx.make("Sqrt", [ctx.make("Add", [ms, ctx.const("eps", float(eps))], tag="plus_eps")], tag="rms")
    if kw["weight"] is None:
        return ctx.make("Div", [x, rms])
    return ctx.make("Mul", [ctx.make("Div", [x, rms], tag="normalized"), ctx.tensor(kw["weight"])])


@emits("native_layer_norm", since=11)
def native_layer_norm(ctx: NodeContext):
    """torch.native_layer_norm(x, shape, weight, bias, eps) -> (y, mean, rstd), mean and rstd kept over
    the normalized dims (size 1 there), as torch returns them."""
    kw = ctx.kw(normalized_shape=REQUIRED, weight=None, bias=None, eps=REQUIRED)
    shape = kw["normalized_shape"]
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    x = ctx.x()
    axes = list(range(-k, 0))
    mean = ctx.make("ReduceMean", [x], tag="mean", axes=axes, keepdims=1)
    d = ctx.make("Sub", [x, mean], tag="centered")
    var = ctx.make("ReduceMean", [ctx.make("Mul", [d, d], tag="squared")], tag="var", axes=axes, keepdims=1)
    rstd = ctx.make("Reciprocal", [ctx.make("Sqrt", [ctx.make("Add", [var, ctx.const("eps", float(kw["eps"]))],
                                                                 tag="var_eps")], tag="std")], tag="rstd")
    y = ctx.make("Mul", [d, rstd], tag="normalized")
    if kw["weight"] is not None:
        y = ctx.make("Mul", [y, ctx.tensor(kw["weight"])], tag="scaled")
    if kw["bias"] is not None:
        y = ctx.make("Add", [y, ctx.tensor(kw["bias"])], tag="shifted")
    return ctx.make("Identity", [y]), mean, rstd
