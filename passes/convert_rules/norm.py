"""Normalization rules: layer_norm becomes a ``QuantizedLayerNorm`` (the integer kernel of
``fixed_point.int_layer_norm``), its affine parameters folded into per-element multipliers."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_TENSOR, TensorInfo
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext, attr_value
from qcompiler.passes.convert_rules.registry import converts


def _affine(ctx: ConvertContext, name: str) -> Optional[torch.Tensor]:
    """The layer's ``weight`` / ``bias``: a module's parameter, or the buffer / parameter a functional
    call reads (None when absent); UnsupportedOpError for a value computed at run time."""
    value: Any = ctx.args[name]
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, fx.Node) and value.op == "get_attr":
        return attr_value(ctx.node.graph.owning_module, value)
    raise UnsupportedOpError(f"{ctx.where}: layer_norm {name} is computed at run time; the BPU folds a "
                             f"constant {name} (a parameter or buffer) into its multipliers, or run it on CPU")


@converts("layer_norm")
def layer_norm(ctx: ConvertContext) -> qnn.QuantizedLayerNorm:
    """nn.LayerNorm / F.layer_norm over the last dims; a functional call's constant weight and bias
    are stored in the module, so the node keeps only its input."""
    shape = ctx.args["normalized_shape"]
    dims = 1 if isinstance(shape, int) else len(shape)
    info = ctx.operand(0).meta.get(META_TENSOR)
    if not isinstance(info, TensorInfo):
        raise UnsupportedOpError(f"{ctx.where}: layer_norm input without a static shape")
    shape = tuple(int(s) for s in info.shape[len(info.shape) - dims:])  # sizes may be traced values
    weight, bias = _affine(ctx, "weight"), _affine(ctx, "bias")
    src = ctx.input()
    module = qnn.QuantizedLayerNorm(shape, weight, bias, float(ctx.args["eps"]), src.scale, src.dtype,
                                    ctx.out.scale, ctx.out.dtype)
    if ctx.module is None:
        ctx.node.args, ctx.node.kwargs = (ctx.args["input"],), {}
    return module
