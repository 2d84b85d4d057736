"""Lowering of pooling: average pooling (a requantization by 1 / (kh * kw)), global average pooling,
and max pooling on the input's grid."""

from __future__ import annotations

from qcompiler.backends.bpu.lowering.layout import same_scale
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp


@lowers(qnn.QuantizedAvgPool, "avg_pool2d", emits=("avg_pool2d",))
def avg_pool2d(ctx):
    """The window sum requantized once, with the multiplier int_avg_pool2d computes on every call."""
    m, x = ctx.module, ctx.arg(0)
    ctx.per_tensor(x)
    kh, kw = fp._pair(m.kernel)
    stride = fp._pair(m.stride if m.stride is not None else m.kernel)
    M, n = fp.requant_params(fp._f64(m.in_scale, "in_scale") / (kh * kw * fp._f64(m.out_scale, "out_scale")),
                             mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    attrs = {"kernel_size": [kh, kw], "stride": list(stride), "padding": fp.padding_attr(m.padding), **ctx.out()}
    return ctx.emit("avg_pool2d", [x.name], attrs, {"M": M.reshape(()), "n": n.reshape(())})


@lowers(qnn.QuantizedAvgPool, "global_avg_pool", emits=("global_avg_pool",))
def global_avg_pool(ctx):
    """The mean over H and W (adaptive_avg_pool2d to 1x1, mean over the spatial dims)."""
    m, x = ctx.module, ctx.arg(0)
    ctx.per_tensor(x)
    return ctx.emit("global_avg_pool", [x.name], {"in_scale": m.in_scale, "keepdim": bool(m.keepdim), **ctx.out()})


@same_scale("max_pool2d", emits=("max_pool2d",))
def max_pool2d(ctx, args, kwargs):
    """nn.MaxPool2d (its attributes) or F.max_pool2d (the call's arguments); the stride defaults to the kernel."""
    v = ctx.args
    if v["return_indices"]:
        raise ctx.fail("max_pool2d with return_indices")
    k = fp._pair(v["kernel_size"])
    s = fp._pair(v["stride"]) if v["stride"] not in (None, [], ()) else k
    return "max_pool2d", {"kernel_size": list(k), "stride": list(s), "padding": list(fp._pair(v["padding"])),
                          "dilation": list(fp._pair(v["dilation"])), "ceil_mode": bool(v["ceil_mode"])}
