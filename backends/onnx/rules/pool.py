"""Pooling and resize rules: max / average / adaptive average pooling, interpolate."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from qcompiler.backends.onnx.context import (
    REQUIRED,
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _ntuple
from qcompiler.quantization.fixed_point import max_pool_out_size


@emits("max_pool2d")
def max_pool2d(ctx: NodeContext) -> Tensor:
    kw = ctx.kw(kernel_size=REQUIRED, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False)
    if kw["return_indices"]:
        raise ctx.unsupported("return_indices=True")
    k, s, ceil = _ntuple(kw["kernel_size"], 2), kw["stride"], kw["ceil_mode"]
    s = _ntuple(s if s not in (None, [], ()) else k, 2)
    p, d = _ntuple(kw["padding"], 2), _ntuple(kw["dilation"], 2)
    trim = _ceil_trim(ctx, ceil, k, s, p, d)
    y = ctx.make("MaxPool", [ctx.x()], kernel_shape=k, strides=s, pads=p + p, dilations=d,
                 ceil_mode=int(bool(ceil)), tag="max_pool" if trim else None)
    return _trimmed(ctx, y, trim)


def _ceil_trim(ctx: NodeContext, ceil: bool, k, s, p, d=(1, 1)) -> list[tuple[int, int]]:
    """(axis, torch length) where a ceil-mode pool's ONNX output is one longer than torch's:
    torch drops a last window that would start in the right padding, ONNX keeps it."""
    shape = ctx.shape()
    if not ceil or shape is None or len(shape) != 4:
        return []
    trim = []
    for axis, size in enumerate(shape[2:]):
        want = max_pool_out_size(size, k[axis], s[axis], p[axis], d[axis], True)
        onnx_len = -(-(size + 2 * p[axis] - d[axis] * (k[axis] - 1) - 1) // s[axis]) + 1
        if onnx_len != want:
            trim.append((axis + 2, want))
    return trim


def _trimmed(ctx: NodeContext, y: Tensor, trim: list[tuple[int, int]]) -> Tensor:
    if not trim:
        return y
    return ctx.make("Slice", [y, ctx.const("starts", [0] * len(trim), I64),
                              ctx.const("ends", [e for _, e in trim], I64),
                              ctx.const("axes", [a for a, _ in trim], I64)])


def avg_pool(ctx: NodeContext, x: str, kernel, stride, padding, ceil_mode=False, count_include_pad=True,
             tag: Optional[str] = None) -> Tensor:
    k = _ntuple(kernel, 2)
    s = _ntuple(stride if stride not in (None, [], ()) else k, 2)
    p = _ntuple(padding, 2)
    trim = _ceil_trim(ctx, ceil_mode, k, s, p)
    y = ctx.make("AveragePool", [x], tag=tag or ("average_pool" if trim else None), kernel_shape=k, strides=s,
                 pads=p + p, ceil_mode=int(bool(ceil_mode)), count_include_pad=int(bool(count_include_pad)))
    return _trimmed(ctx, y, trim)


@emits("avg_pool2d")
def avg_pool2d(ctx: NodeContext) -> Tensor:
    kw = ctx.kw(kernel_size=REQUIRED, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None)
    if kw["divisor_override"] is not None:
        raise ctx.unsupported("divisor_override")
    return avg_pool(ctx, ctx.x(), kw["kernel_size"], kw["stride"], kw["padding"], kw["ceil_mode"],
                    kw["count_include_pad"])


@emits("adaptive_avg_pool2d")
def adaptive_avg_pool2d(ctx: NodeContext) -> Tensor:
    out = ctx.kw(output_size=REQUIRED)["output_size"]
    out = list(out) if isinstance(out, (list, tuple)) else [out, out]
    shape = ctx.shape()
    if shape is None or len(shape) != 4:
        raise ctx.unsupported("adaptive_avg_pool2d needs a 4-D input of known shape")
    h, w = shape[2], shape[3]
    oh, ow = (h if out[0] is None else out[0]), (w if out[1] is None else out[1])
    x = ctx.x()
    if (oh, ow) == (1, 1):
        return ctx.make("GlobalAveragePool", [x])
    if h % oh == 0 and w % ow == 0:
        return avg_pool(ctx, x, (h // oh, w // ow), (h // oh, w // ow), 0)
    raise ctx.unsupported(f"adaptive output {oh}x{ow} does not divide the input {h}x{w}")


@emits("interpolate")
def interpolate(ctx: NodeContext) -> Tensor:
    kw = ctx.kw(size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None,
                antialias=False)  # nn.Upsample has all but antialias as attributes
    return resize(ctx, ctx.x(), kw["mode"], kw["align_corners"], size=kw["size"], scale_factor=kw["scale_factor"],
                  recompute=kw["recompute_scale_factor"], antialias=kw["antialias"])


def resize(ctx: NodeContext, x: str, mode: str, align_corners, *, size=None, scale_factor=None, recompute=None,
           antialias=False, tag: Optional[str] = None) -> Tensor:
    """Resize-11. nearest: asymmetric + floor (torch's ``floor(dst * in/out)``); nearest-exact:
    half_pixel + round_prefer_ceil; (bi/tri)linear: half_pixel (align_corners=False, torch clamps
    negative source coordinates to 0 as onnxruntime does) or align_corners."""
    if antialias:
        raise ctx.unsupported("antialias=True")
    in_shape = ctx.shape()
    if in_shape is None:
        raise ctx.unsupported("the input shape is unknown")
    n = len(in_shape) - 2
    if mode == "nearest":
        attrs = dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    elif mode == "nearest-exact":
        attrs = dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil")
    elif mode in ("linear", "bilinear", "trilinear"):
        attrs = dict(mode="linear", coordinate_transformation_mode="align_corners" if align_corners else "half_pixel")
    else:
        raise ctx.unsupported(f"interpolate mode={mode!r}")
    roi = ctx.const("roi", np.zeros(0, np.float32))
    if size is None and scale_factor is not None and not recompute:
        sf = [float(v) for v in _floats(scale_factor, n)]
        scales = ctx.const("scales", [1.0, 1.0] + sf)
        return ctx.make("Resize", [x, roi, scales], tag=tag, **attrs)
    out = ctx.out_shape()
    if size is not None:
        spatial = _ntuple(size, n)
    elif out is not None:
        spatial = list(out[2:])
    else:
        spatial = [int(math.floor(in_shape[2 + i] * s)) for i, s in enumerate(_floats(scale_factor, n))]
    scales = ctx.const("scales", np.zeros(0, np.float32))
    # sizes = [N, C] of the input (kept dynamic) + the spatial sizes
    nc = ctx.make("Slice", [ctx.make("Shape", [x], tag="shape", dtype=I64), ctx.const("nc_start", [0], I64),
                            ctx.const("nc_end", [2], I64)], tag="batch_channels", dtype=I64)
    sizes = ctx.make("Concat", [nc, ctx.const("spatial", spatial, I64)], tag="sizes", dtype=I64, axis=0)
    return ctx.make("Resize", [x, roi, scales, sizes], tag=tag, **attrs)


def _floats(v, n):
    return list(v) if isinstance(v, (list, tuple)) else [v] * n
