"""Lowering of softmax / log_softmax (nash): one op holding the tables and the multiplier / shift
convert built (``fixed_point.int_softmax`` / ``int_log_softmax``)."""

from __future__ import annotations

import torch

from qcompiler.backends.bpu.lowering.common import dtype_name
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn


def _emit(ctx, kind: str, extra: dict):
    m, x = ctx.module, ctx.arg(0)
    s = ctx.per_tensor(x)
    if s.dtype != dtype_name(m.in_dtype):
        raise ctx.fail(f"the exponential table is for {m.in_dtype} input but '{x.name}' is {s.dtype}")
    tensors = {"table": m.table, "M": torch.tensor(m.M, dtype=torch.int64),
               "n": torch.tensor(m.n, dtype=torch.int64), **extra}
    return ctx.emit(kind, [x.name], {"dim": m.dim, "in_dtype": s.dtype, **ctx.out()}, tensors)


@lowers(qnn.QuantizedSoftmax, "softmax", emits=("softmax",))
def softmax(ctx):
    """The exponential table (indexed by ``max - q``), ``M`` and ``n``; the dim and input type as attrs."""
    return _emit(ctx, "softmax", {})


@lowers(qnn.QuantizedLogSoftmax, "log_softmax", emits=("log_softmax",))
def log_softmax(ctx):
    """As softmax, plus the two log tables."""
    return _emit(ctx, "log_softmax", {"log_k": ctx.module.log_k, "log_f": ctx.module.log_f})
