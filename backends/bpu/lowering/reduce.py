"""Lowering of the nash reductions over any dims: sum / mean requantized once (the module's M, n),
amax / amin on the input's grid."""

from __future__ import annotations

import torch

from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp


@lowers(qnn.QuantizedReduce, "sum", "mean", "amax", "amin", emits=("reduce",))
def reduce(ctx):
    """One ``reduce`` op: the mode, the sorted dims and keepdim; the multiplier of a sum / mean."""
    m, x = ctx.module, ctx.arg(0)
    s = ctx.per_tensor(x)
    if m.qc_op in fp.SELECTING_MODES and s.scale != m.out_scale:
        raise ctx.fail(f"{m.qc_op} keeps its input's grid, but '{x.name}' has scale {s.scale!r} and the "
                       f"module {m.out_scale!r}")
    attrs = {"mode": m.qc_op, "dims": list(m.dims), "keepdim": bool(m.keepdim), **ctx.out()}
    tensors = {} if m.qc_op in fp.SELECTING_MODES else \
        {"M": torch.tensor(m.M, dtype=torch.int64), "n": torch.tensor(m.n, dtype=torch.int64)}
    return ctx.emit("reduce", [x.name], attrs, tensors)
