"""``qcompiler.nn.functional.masked_softmax`` in float (opset 11): Where + Softmax.

``Where(fill, -inf, x)``, Softmax along the dim (another dim moved last and back: Softmax-11 normalizes
every dim from ``axis`` on), then ``Where(row all filled, 0, y)``: the function's definition (a row with
every position filled is 0, not torch's NaN). The mask is read as bool (0/1 codes: nonzero is True).
The converted nash module has its own integer rule (``rules/quantized.py``).
"""

from __future__ import annotations

from onnx import TensorProto

from qcompiler.backends.onnx.context import NodeContext, Tensor
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import _norm_axis
from qcompiler.ir.ops import REQUIRED


@emits("masked_softmax")
def masked_softmax(ctx: NodeContext) -> Tensor:
    kw = ctx.kw(mask=REQUIRED, dim=REQUIRED, fill_mask_is_true=True)
    x = ctx.x()
    rank = ctx.rank()
    axis = _norm_axis(int(kw["dim"]), rank)
    fill = ctx.tensor(kw["mask"], TensorProto.BOOL)
    if not kw["fill_mask_is_true"]:
        fill = ctx.make("Not", [fill], tag="fill", dtype=TensorProto.BOOL)
    dt = ctx.dtype(x)
    filled = ctx.make("Where", [fill, ctx.const("neg_inf", float("-inf"), dt), x], tag="filled", dtype=dt)
    perm = list(range(rank))
    perm[axis], perm[rank - 1] = perm[rank - 1], perm[axis]
    if axis != rank - 1:
        filled = ctx.make("Transpose", [filled], tag="to_last", perm=perm)
    y = ctx.make("Softmax", [filled], tag="softmax", axis=rank - 1)
    if axis != rank - 1:
        y = ctx.make("Transpose", [y], tag="back", perm=perm)
    full = ctx.make("Expand", [ctx.make("Cast", [fill], tag="fill_float", to=TensorProto.FLOAT,
                                        dtype=TensorProto.FLOAT),
                               ctx.make("Shape", [x], tag="shape", dtype=TensorProto.INT64)], tag="fill_full")
    dead = ctx.make("Greater", [ctx.make("ReduceMin", [full], tag="all_filled", axes=[axis], keepdims=1),
                                ctx.const("half", 0.5)], tag="dead", dtype=TensorProto.BOOL)
    return ctx.make("Where", [dead, ctx.const("zero", 0.0, dt), y], dtype=dt)
