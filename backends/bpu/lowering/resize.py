"""Lowering of interpolate to a fixed output size: nearest or bilinear."""

from __future__ import annotations

from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn

# interpolate's mode -> the BPU op kind
RESIZE_KINDS = {"nearest": "resize_nearest", "bilinear": "resize_bilinear"}


@lowers(qnn.QuantizedResize, "interpolate", emits=tuple(RESIZE_KINDS.values()))
def resize(ctx):
    """The resize of the module's mode to its (static) output size; bilinear keeps align_corners."""
    m, x = ctx.module, ctx.arg(0)
    ctx.per_tensor(x)
    kind = RESIZE_KINDS.get(m.mode)
    if kind is None:
        raise ctx.fail(f"resize mode {m.mode!r} (nearest and bilinear are supported)")
    attrs = {"size": [int(s) for s in m.size], "in_scale": m.in_scale, **ctx.out()}
    if kind == "resize_bilinear":
        attrs["align_corners"] = bool(m.align_corners)
    return ctx.emit(kind, [x.name], attrs)
