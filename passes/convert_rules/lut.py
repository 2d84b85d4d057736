"""Lookup-table rules: element-wise functions evaluated through a table from the input's grid to the
output's (one table row per op in :data:`LUT_FUNCTIONS`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.registry import converts

# op -> the float function its table samples (default arguments; float64 versions for table building)
LUT_FUNCTIONS = {
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "silu": F.silu,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "gelu": F.gelu,
    "elu": F.elu,
    "selu": F.selu,
}


@converts(*LUT_FUNCTIONS)
def lookup(ctx: ConvertContext) -> qnn.QuantizedLookup:
    """The table of ``LUT_FUNCTIONS[op]`` over every input code."""
    src = ctx.input()
    return qnn.QuantizedLookup(ctx.op, LUT_FUNCTIONS[ctx.op], src.scale, src.dtype, ctx.out.scale, ctx.out.dtype)
