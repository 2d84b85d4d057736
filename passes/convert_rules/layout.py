"""Layout rules: ops that move integers without changing them (reshape, flatten, permute, transpose,
indexing, identities) keep their input's grid; cat rescales each input onto the output grid.

:func:`same_scale` builds the module of every op that keeps its input's grid (relu and max pool
use it too).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_OP
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.registry import converts

# same-grid ops whose module form computes from the float module it replaces (its attributes)
FLOAT_MODULE_OPS = frozenset({"max_pool2d", "flatten"})


def same_scale(node: fx.Node, module: Optional[nn.Module], dtype: str) -> qnn.QuantizedSameScale:
    """The fixed-point module of a node that keeps its input's grid, saying what it computes: the
    node's function or method, else the float module it replaces, else nothing (the identity)."""
    op = node.meta.get(META_OP)
    if op == "relu":
        return qnn.QuantizedSameScale(op, dtype=dtype)
    if node.op == "call_function":
        return qnn.QuantizedSameScale(op, function=node.target, dtype=dtype)
    if node.op == "call_method":
        return qnn.QuantizedSameScale(op, method=node.target, dtype=dtype)
    return qnn.QuantizedSameScale(op, float_module=module if op in FLOAT_MODULE_OPS else None, dtype=dtype)


@converts("reshape", "flatten", "permute", "transpose", "getitem", "identity", "dropout")
def layout(ctx: ConvertContext) -> qnn.QuantizedSameScale:
    """The same integers re-arranged (dropout in eval: the identity)."""
    return same_scale(ctx.node, ctx.module, ctx.out.dtype)


@converts("cat")
def cat(ctx: ConvertContext) -> qnn.QuantizedCat:
    """Each input requantized onto the output grid, then joined."""
    scales = [ctx.scale_of(t) for t in ctx.args["tensors"]]
    if any(s is None for s in scales):
        raise UnsupportedOpError(f"{ctx.where}: cat of a non-quantized input")
    return qnn.QuantizedCat(scales, ctx.out.scale, ctx.out.dtype)
