"""Pooling and resize rules: max pooling keeps its input's grid; average pooling, the global mean and
interpolate are requantized onto the output grid."""

from __future__ import annotations

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import shape
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.layout import same_scale
from qcompiler.passes.convert_rules.registry import converts


@converts("max_pool2d")
def max_pool2d(ctx: ConvertContext) -> qnn.QuantizedSameScale:
    """The maximum of integers on one grid is on that grid; no second (index) output."""
    if ctx.node.op == "call_module" and ctx.module.return_indices:
        raise UnsupportedOpError(f"{ctx.where}: max_pool2d with return_indices=True has no fixed-point "
                                 f"lowering; use return_indices=False on the BPU, or run this module on "
                                 f"CPU (hybrid_dict)")
    return same_scale(ctx.node, ctx.module, ctx.out.dtype)


@converts("adaptive_avg_pool2d")  # and "mean" over H, W (convert_rules.reduce picks it)
def global_mean(ctx: ConvertContext) -> qnn.QuantizedAvgPool:
    """The mean over H and W (placement admits only the global forms)."""
    keepdim = bool(ctx.args["keepdim"]) if ctx.op == "mean" else True
    return qnn.QuantizedAvgPool(ctx.input().scale, ctx.out.scale, ctx.out.dtype, keepdim=keepdim)


@converts("avg_pool2d")
def avg_pool2d(ctx: ConvertContext) -> qnn.QuantizedAvgPool:
    """A windowed mean, its window from the module or the call."""
    if ctx.module is not None:
        k, s, p = ctx.module.kernel_size, ctx.module.stride, ctx.module.padding
    else:
        k, s, p = ctx.args["kernel_size"], ctx.args["stride"], ctx.args["padding"]
    return qnn.QuantizedAvgPool(ctx.input().scale, ctx.out.scale, ctx.out.dtype, kernel=k, stride=s or k, padding=p)


@converts("interpolate")
def interpolate(ctx: ConvertContext) -> qnn.QuantizedResize:
    """A resize to the node's traced output size, its mode from the module or the call."""
    if ctx.module is not None:
        mode, align = getattr(ctx.module, "mode", None), getattr(ctx.module, "align_corners", None)
    else:
        mode, align = ctx.args["mode"], ctx.args["align_corners"]
    return qnn.QuantizedResize(mode or "nearest", ctx.input().scale, ctx.out.scale, ctx.out.dtype,
                               shape(ctx.node)[2:], align)
