"""Selection rules (nash): narrow with constant bounds keeps its input's grid, like getitem
(:mod:`.layout`): the same integers, fewer of them."""

from __future__ import annotations

from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.layout import same_scale
from qcompiler.passes.convert_rules.registry import converts


@converts("narrow")
def narrow(ctx: ConvertContext) -> qnn.QuantizedSameScale:
    """torch.narrow / Tensor.narrow on the integers (placement admits constant dim, start, length)."""
    return same_scale(ctx.node, ctx.module, ctx.out.dtype)


@converts("slice")
def slice_(ctx: ConvertContext) -> qnn.QuantizedSameScale:
    """aten.slice.Tensor (torch.export's ``x[:, a:b:c]``) on the integers (placement admits constant bounds)."""
    return same_scale(ctx.node, ctx.module, ctx.out.dtype)
