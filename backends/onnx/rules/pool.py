"""Pooling and resize rules: max / average pooling (1-D, 2-D, 3-D), adaptive average pooling (1-D, 2-D, 3-D)
and adaptive max pooling (1-D, 2-D), any output size, interpolate."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from qcompiler.backends.onnx.context import (
    NodeContext,
    Tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _ntuple
from qcompiler.ir.ops import REQUIRED
from qcompiler.quantization.fixed_point import max_pool_out_size, pads4


@emits("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices",
       "max_pool3d_with_indices")
def max_pool2d(ctx: NodeContext):
    """MaxPool; with indices (``return_indices=True`` / ``F.max_poolNd_with_indices``) also its Indices,
    which count over the whole (N, C, ...) input: torch's count within one plane is that mod the plane size."""
    n = int(ctx.op[len("max_pool")])
    kw = ctx.kw(kernel_size=REQUIRED, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False)
    with_indices = bool(kw["return_indices"]) or ctx.op.endswith("_with_indices")
    k, s, ceil = _ntuple(kw["kernel_size"], n), kw["stride"], kw["ceil_mode"]
    s = _ntuple(s if s not in (None, [], ()) else k, n)
    p, d = _ntuple(kw["padding"], n), _ntuple(kw["dilation"], n)
    trim = _ceil_trim(ctx, ceil, k, s, p, d)
    attrs = dict(kernel_shape=k, strides=s, pads=p + p, dilations=d, ceil_mode=int(bool(ceil)))
    if not with_indices:
        return _trimmed(ctx, ctx.make("MaxPool", [ctx.x()], tag="max_pool" if trim else None, **attrs), trim)
    shape = ctx.shape()
    if shape is None or len(shape) != n + 2:
        raise ctx.unsupported("indices of a pool whose input is not (N, C, spatial...)")
    y, idx = ctx.make("MaxPool", [ctx.x()], tag="max_pool", outputs=2, **attrs)
    ctx.b.dtypes[idx] = I64
    plane = ctx.const("plane", int(np.prod(shape[2:])), I64)
    idx = ctx.make("Mod", [idx, plane], tag="plane_index", dtype=I64)
    if trim:
        return _trimmed(ctx, y, trim), ctx.make("Identity", [_trimmed_indices(ctx, idx, trim)], dtype=I64)
    return ctx.make("Identity", [y]), idx


def _trimmed_indices(ctx: NodeContext, y: Tensor, trim: list[tuple[int, int]]) -> Tensor:
    return ctx.make("Slice", [y, ctx.const("i_starts", [0] * len(trim), I64),
                              ctx.const("i_ends", [e for _, e in trim], I64),
                              ctx.const("i_axes", [a for a, _ in trim], I64)], tag="indices_trim", dtype=I64)


def _ceil_trim(ctx: NodeContext, ceil: bool, k, s, p, d=None) -> list[tuple[int, int]]:
    """(axis, torch length) where a ceil-mode pool's ONNX output is one longer than torch's:
    torch drops a last window that would start in the right padding, ONNX keeps it."""
    shape = ctx.shape()
    if not ceil or shape is None or len(shape) != len(k) + 2:
        return []
    d = d if d is not None else [1] * len(k)
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
             tag: Optional[str] = None, n: int = 2) -> Tensor:
    k = _ntuple(kernel, n)
    s = _ntuple(stride if stride not in (None, [], ()) else k, n)
    if n == 2 and isinstance(padding, (list, tuple)) and len(padding) == 4:  # four sides (t, l, b, r)
        if ceil_mode:
            raise ctx.unsupported("ceil_mode with a four-sided padding")
        pads, p = list(pads4(padding)), None
    else:
        p = _ntuple(padding, n)
        pads = p + p
    trim = _ceil_trim(ctx, ceil_mode, k, s, p)
    y = ctx.make("AveragePool", [x], tag=tag or ("average_pool" if trim else None), kernel_shape=k, strides=s,
                 pads=pads, ceil_mode=int(bool(ceil_mode)), count_include_pad=int(bool(count_include_pad)))
    return _trimmed(ctx, y, trim)


@emits("avg_pool1d", "avg_pool2d", "avg_pool3d")
def avg_pool2d(ctx: NodeContext) -> Tensor:
    if ctx.op == "avg_pool1d":  # F.avg_pool1d has no divisor_override
        kw = ctx.kw(kernel_size=REQUIRED, stride=None, padding=0, ceil_mode=False, count_include_pad=True)
        kw["divisor_override"] = None
    else:
        kw = ctx.kw(kernel_size=REQUIRED, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                    divisor_override=None)
    if kw["divisor_override"] is not None:
        raise ctx.unsupported("divisor_override")
    return avg_pool(ctx, ctx.x(), kw["kernel_size"], kw["stride"], kw["padding"], kw["ceil_mode"],
                    kw["count_include_pad"], n={"avg_pool1d": 1, "avg_pool2d": 2, "avg_pool3d": 3}[ctx.op])


def _adaptive_sizes(ctx: NodeContext, n: int) -> tuple[list[int], list[int], bool]:
    """(input spatial sizes, output sizes, unbatched) of an adaptive pool (``None`` in output_size
    keeps the size; an unbatched input is (C, spatial...))."""
    kw = ctx.kw(output_size=REQUIRED, return_indices=False)
    if kw["return_indices"]:
        raise ctx.unsupported("return_indices=True")
    out = kw["output_size"]
    out = list(out) if isinstance(out, (list, tuple)) else [out] * n
    shape = ctx.shape()
    if shape is None or len(shape) not in (n + 1, n + 2) or len(out) != n:
        raise ctx.unsupported(f"an adaptive {n}-D pool needs an input ([N,] C, {n} spatial dims) of known shape")
    spatial = list(shape[-n:])
    return spatial, [s if o is None else int(o) for s, o in zip(spatial, out)], len(shape) == n + 1


def _adaptive(ctx: NodeContext, n: int, global_op: str, pool, reduce_op: str) -> Tensor:
    """Global pool for 1x1, a pool whose kernel = stride where the windows tile the input, else
    the separable windows; an unbatched input gets a batch of one around it."""
    spatial, out, unbatched = _adaptive_sizes(ctx, n)
    x = ctx.x()
    if unbatched:
        x = ctx.make("Unsqueeze", [x], tag="batch", axes=[0])
    if all(o == 1 for o in out):
        y = ctx.make(global_op, [x], tag="pool" if unbatched else None)
    elif all(s % o == 0 for s, o in zip(spatial, out)):
        y = pool(x, [s // o for s, o in zip(spatial, out)], "pool" if unbatched else None)
    else:
        y = _adaptive_separable(ctx, x, spatial, out, reduce_op)
    return ctx.make("Squeeze", [y], axes=[0]) if unbatched else y


def adaptive_windows(size: int, out: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling windows along one dim: ``[floor(i*size/out), ceil((i+1)*size/out))``."""
    return [((i * size) // out, -(-((i + 1) * size) // out)) for i in range(out)]


def _adaptive_separable(ctx: NodeContext, x: str, spatial: list[int], out: list[int], reduce_op: str) -> Tensor:
    """An adaptive pool whose windows do not tile the input: one dim at a time, a Slice + Reduce per
    output index, Concat. (A mean / max over a window box is the mean / max over one dim of the
    mean / max over the other, so ``oh + ow`` reductions make the ``oh * ow`` cells.)"""
    y = x
    for i, (size, o) in enumerate(zip(spatial, out)):
        axis = i + 2
        if size == o:
            continue
        wins = adaptive_windows(size, o)
        if o == 1:
            y = ctx.make(reduce_op, [y], tag=f"reduce_axis{axis}", axes=[axis], keepdims=1)
            continue
        ax = ctx.const(f"axis{axis}", [axis], I64)
        cells = [ctx.make(reduce_op, [ctx.make("Slice", [y, ctx.const(f"start{axis}_{j}", [s], I64),
                                                         ctx.const(f"end{axis}_{j}", [e], I64), ax],
                                               tag=f"window{axis}_{j}")],
                          tag=f"reduce{axis}_{j}", axes=[axis], keepdims=1)
                 for j, (s, e) in enumerate(wins)]
        y = ctx.make("Concat", cells, tag=f"cells_axis{axis}", axis=axis)
    return ctx.identity(y)


@emits("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d")
def adaptive_avg_pool2d(ctx: NodeContext) -> Tensor:
    """GlobalAveragePool to 1 (r3d_18's AdaptiveAvgPool3d(1)), an AveragePool where the sizes divide,
    else one Slice + ReduceMean per window along each dim."""
    n = int(ctx.op[len("adaptive_avg_pool")])
    return _adaptive(ctx, n, "GlobalAveragePool", lambda x, k, tag: avg_pool(ctx, x, k, k, 0, tag=tag, n=n),
                     "ReduceMean")


@emits("adaptive_max_pool1d", "adaptive_max_pool2d")
def adaptive_max_pool2d(ctx: NodeContext) -> Tensor:
    n = 1 if ctx.op == "adaptive_max_pool1d" else 2
    return _adaptive(ctx, n, "GlobalMaxPool",
                     lambda x, k, tag: ctx.make("MaxPool", [x], tag=tag, kernel_shape=k, strides=k), "ReduceMax")


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
    negative source coordinates to 0 as onnxruntime does) or align_corners; bicubic: cubic with
    torch's coefficient -0.75."""
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
    elif mode == "bicubic":  # torch's cubic convolution uses a = -0.75 and replicates the border
        attrs = dict(mode="cubic", cubic_coeff_a=-0.75,
                     coordinate_transformation_mode="align_corners" if align_corners else "half_pixel")
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
