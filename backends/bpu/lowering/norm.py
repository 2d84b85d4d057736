"""Lowering of the normalizations: layer_norm as the BPU's integer layer-norm op
(``fixed_point.int_layer_norm``), with the multipliers and bias codes convert folded gamma / beta into."""

from __future__ import annotations

import torch

from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn


@lowers(qnn.QuantizedLayerNorm, "layer_norm", emits=("layer_norm",))
def layer_norm(ctx):
    """The normalized dims count, the input grid, and the per-element (M, n, B) with the eps units."""
    m, x = ctx.module, ctx.arg(0)
    s = ctx.per_tensor(x)
    if s.dtype != m.in_dtype:
        raise ctx.fail(f"layer_norm was converted for {m.in_dtype} input but '{x.name}' is {s.dtype}")
    attrs = {"dims": m.dims, "in_dtype": s.dtype, "in_scale": float(s.scale), **ctx.out()}
    return ctx.emit("layer_norm", [x.name], attrs,
                    {"M": m.M, "n": m.n, "B": m.B, "eps": torch.tensor(m.eps_units, dtype=torch.int64)})
