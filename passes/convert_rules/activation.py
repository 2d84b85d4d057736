"""Piecewise-linear activation rules: relu keeps its input's grid; relu6, leaky_relu and prelu are a
slope for the negative side (and relu6 a top) requantized onto the output grid."""

from __future__ import annotations

import torch
import torch.fx as fx

from qcompiler.errors import UnsupportedOpError
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext, attr_value
from qcompiler.passes.convert_rules.layout import same_scale
from qcompiler.passes.convert_rules.registry import converts


@converts("relu")
def relu(ctx: ConvertContext) -> qnn.QuantizedSameScale:
    """max(q, 0) on the input's grid."""
    return same_scale(ctx.node, ctx.module, ctx.out.dtype)


@converts("relu6")
def relu6(ctx: ConvertContext) -> qnn.QuantizedPReLU:
    """Slope 0 below zero, clipped at 6 (rarely on the input's grid, so requantized)."""
    return qnn.QuantizedPReLU("relu6", torch.zeros(1), ctx.input().scale, ctx.out.scale, ctx.out.dtype, top=6.0)


@converts("leaky_relu")
def leaky_relu(ctx: ConvertContext) -> qnn.QuantizedPReLU:
    """One negative slope, from the module or the call (default 0.01)."""
    if ctx.module is not None:
        slope = torch.tensor([ctx.module.negative_slope])
    else:
        slope = torch.tensor([ctx.args["negative_slope"]])
    return qnn.QuantizedPReLU("leaky_relu", slope, ctx.input().scale, ctx.out.scale, ctx.out.dtype)


@converts("prelu")
def prelu(ctx: ConvertContext) -> qnn.QuantizedPReLU:
    """Learned slopes: the module's weight, or the parameter / buffer a functional prelu reads (then
    stored in the module, so the node keeps only its input)."""
    if ctx.module is not None:
        slope = ctx.module.weight
    else:
        weight = ctx.args["weight"]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            raise UnsupportedOpError(f"{ctx.where}: functional prelu whose slope is computed at run time; the "
                                     f"BPU takes a parameter or buffer as the slope, or run it on CPU")
        slope = attr_value(ctx.node.graph.owning_module, weight)
        ctx.node.args, ctx.node.kwargs = (ctx.args["input"],), {}
    return qnn.QuantizedPReLU("prelu", slope, ctx.input().scale, ctx.out.scale, ctx.out.dtype)
