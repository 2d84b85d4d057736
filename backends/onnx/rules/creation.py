"""Tensors made from another's shape: zeros_like / ones_like / full_like (and empty_like as zeros),
new_zeros / new_ones / new_full (and new_empty as zeros), randn_like / rand_like.

A ``*_like`` tensor takes the input's shape at run time (``ConstantOfShape(Shape(x))``), so a CPU island
with a dynamic batch keeps working; ``new_*`` take their size from the call. The dtype is the one shape
propagation recorded (the input's, or the ``dtype=`` argument)."""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from qcompiler.backends.onnx.context import NodeContext, Tensor
from qcompiler.backends.onnx.registry import emits, register
from qcompiler.backends.onnx.rules.common import I64
from qcompiler.backends.onnx.rules.layout import shape_tensor


def _filled(ctx: NodeContext, shape: Tensor, value) -> Tensor:
    dt = ctx.out_dtype()
    if dt is None:
        raise ctx.unsupported("the result dtype is unknown (run shape propagation first)")
    if isinstance(value, complex):
        raise ctx.unsupported("a complex fill value")
    arr = np.array([value], dtype=helper.tensor_dtype_to_np_dtype(dt))
    return ctx.make("ConstantOfShape", [shape], value=numpy_helper.from_array(arr, "value"), dtype=dt)


def like(value):
    def rule(ctx: NodeContext) -> Tensor:
        fill = ctx.kw(fill_value=None)["fill_value"] if value is None else value
        if not isinstance(fill, (bool, int, float)):
            raise ctx.unsupported("a fill value that is not a Python number")
        return _filled(ctx, ctx.make("Shape", [ctx.x()], tag="shape", dtype=I64), fill)
    return rule


register("zeros_like", like(0))
register("ones_like", like(1))
register("full_like", like(None))


def new(value):
    def rule(ctx: NodeContext) -> Tensor:
        if value is None:
            kw = ctx.kw(size=None, fill_value=None)
            fill = kw["fill_value"]
        else:
            kw, fill = ctx.kw(size=None), value
        size = kw["size"]
        if size is None:
            raise ctx.unsupported("missing size")
        dims = list(size) if isinstance(size, (list, tuple)) else [size]
        if not isinstance(fill, (bool, int, float)):
            raise ctx.unsupported("a fill value that is not a Python number")
        return _filled(ctx, shape_tensor(ctx, dims, "size"), fill)
    return rule


register("new_zeros", new(0))
register("new_ones", new(1))
register("new_full", new(None))


@emits("randn_like", "rand_like", since=11)
def random_like(ctx: NodeContext) -> Tensor:
    """RandomNormalLike / RandomUniformLike (mean 0, scale 1 / [0, 1)): the same distribution as torch's,
    other draws (a random op matches in shape, dtype and distribution, never in values)."""
    op_type = "RandomNormalLike" if ctx.op == "randn_like" else "RandomUniformLike"
    dt = ctx.out_dtype()
    x = ctx.x()
    if dt is None or dt != ctx.dtype(x):
        raise ctx.unsupported("a dtype other than the input's")
    return ctx.make(op_type, [x])
