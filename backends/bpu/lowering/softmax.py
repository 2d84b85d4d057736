"""Lowering of softmax (nash): one ``softmax`` op holding the exponential table and the output
multiplier / shift convert built (``fixed_point.int_softmax``)."""

from __future__ import annotations

import torch

from qcompiler.backends.bpu.lowering.common import dtype_name
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn


@lowers(qnn.QuantizedSoftmax, "softmax", emits=("softmax",))
def softmax(ctx):
    """The table (indexed by ``max - q``), ``M`` and ``n`` as tensors; the dim and input type as attrs."""
    m, x = ctx.module, ctx.arg(0)
    s = ctx.per_tensor(x)
    if s.dtype != dtype_name(m.in_dtype):
        raise ctx.fail(f"the exponential table is for {m.in_dtype} input but '{x.name}' is {s.dtype}")
    tensors = {"table": m.table, "M": torch.tensor(m.M, dtype=torch.int64), "n": torch.tensor(m.n, dtype=torch.int64)}
    return ctx.emit("softmax", [x.name], {"dim": m.dim, "in_dtype": s.dtype, **ctx.out()}, tensors)
