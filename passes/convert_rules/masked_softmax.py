"""masked_softmax along a given dim (nash): the integer kernel ``fixed_point.int_masked_softmax``.

The scores' grid is their observer's (only finite scores: the fill never materializes); the mask is a
second input that must arrive as its 0/1 codes, int8 at scale 1.0 (the fixed quantizer
``insert_observers`` gives a bool value entering the BPU); the output grid is the output observer's.
"""

from __future__ import annotations

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_TENSOR, TensorInfo
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.registry import converts


@converts("masked_softmax")
def masked_softmax(ctx: ConvertContext) -> qnn.QuantizedMaskedSoftmax:
    """The module of the node's dim and polarity; the mask's grid checked to be the exact 0/1 one."""
    src, mask = ctx.input(0), ctx.input(1)
    if (mask.scale, mask.dtype) != (1.0, "qint8"):
        raise UnsupportedOpError(f"{ctx.where}: the mask must enter as 0/1 codes (int8, scale 1.0), got "
                                 f"scale {mask.scale!r} ({mask.dtype}); give it a bool tensor")
    dim = ctx.args["dim"]
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise UnsupportedOpError(f"{ctx.where}: masked_softmax needs dim as a constant int, got {dim!r}")
    info = ctx.operand(0).meta.get(META_TENSOR)
    if isinstance(info, TensorInfo) and len(info.shape):
        dim %= len(info.shape)
    return qnn.QuantizedMaskedSoftmax(dim, bool(ctx.args["fill_mask_is_true"]), src.scale, src.dtype,
                                      ctx.out.scale, ctx.out.dtype)
