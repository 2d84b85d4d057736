"""Lowering of masked_softmax (nash): one ``masked_softmax`` op reading the scores and the mask's 0/1
codes, holding softmax's exponential table and the output multiplier / shift
(``fixed_point.int_masked_softmax``)."""

from __future__ import annotations

import torch

from qcompiler.backends.bpu.lowering.common import dtype_name
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn


@lowers(qnn.QuantizedMaskedSoftmax, "masked_softmax", emits=("masked_softmax",))
def masked_softmax(ctx):
    """Inputs (scores, mask codes); the dim, polarity and input type as attrs; table, M, n as tensors."""
    m, x, mask = ctx.module, ctx.arg(0), ctx.arg(1)
    s, ms = ctx.per_tensor(x), ctx.per_tensor(mask, "mask")
    if s.dtype != dtype_name(m.in_dtype):
        raise ctx.fail(f"the exponential table is for {m.in_dtype} input but '{x.name}' is {s.dtype}")
    if (ms.scale, ms.dtype) != (1.0, "qint8"):
        raise ctx.fail(f"mask '{mask.name}' is {ms.describe()}; it must be 0/1 codes (int8, scale 1.0)")
    tensors = {"table": m.table, "M": torch.tensor(m.M, dtype=torch.int64), "n": torch.tensor(m.n, dtype=torch.int64)}
    attrs = {"dim": m.dim, "fill_mask_is_true": m.fill_mask_is_true, "in_dtype": s.dtype, **ctx.out()}
    return ctx.emit("masked_softmax", [x.name, mask.name], attrs, tensors)
