"""Layout rules: reshape / view / squeeze / unsqueeze, flatten, permute, transpose, sizes, split, pad, cat."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from qcompiler.backends.onnx.context import (
    REQUIRED,
    NodeContext,
    Tensor,
    is_tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _circular_pad, _norm_axis
from qcompiler.ir.shape_prop import _DTYPE_NAMES


@emits("cat")
def cat(ctx: NodeContext) -> Tensor:
    tensors = ctx.arg(0, "tensors")
    if isinstance(tensors, fx.Node):  # a node whose value is the tuple: torch.cat(x.chunk(2)[::-1])
        tensors = ctx.value(tensors)
    dim = int(ctx.arg(1, "dim", 0))
    names = [ctx.tensor(t) for t in tensors]
    if len(names) == 1:
        return ctx.identity(names[0])
    return ctx.make("Concat", names, axis=dim)


def shape_tensor(ctx: NodeContext, dims: Sequence[Any], tag: str = "shape") -> Tensor:
    """An int64 1-D tensor from python ints and int64 tensors (0-d sizes or 1-D shapes)."""
    dims = list(dims)
    if all(isinstance(d, (int, np.integer)) for d in dims):
        return ctx.const(tag, [int(d) for d in dims], I64)
    pieces: list[str] = []
    run: list[int] = []
    for d in dims:
        if isinstance(d, (int, np.integer)):
            run.append(int(d))
            continue
        if run:
            pieces.append(ctx.const(f"{tag}_part", run, I64))
            run = []
        if not is_tensor(d):
            raise ctx.unsupported(f"shape element {d!r}")
        d = d if ctx.dtype(d) == I64 else ctx.make("Cast", [d], tag="cast_dim", to=I64, dtype=I64)
        pieces.append(ctx.make("Unsqueeze", [d], tag="dim", axes=[0]) if _is_scalar(ctx, d) else d)
    if run:
        pieces.append(ctx.const(f"{tag}_part", run, I64))
    return ctx.make("Concat", pieces, tag=tag, dtype=I64, axis=0)


def _is_scalar(ctx: NodeContext, t: str) -> bool:
    return t in ctx.emitter.scalars


def _dims_args(ctx: NodeContext, start: int, name: str) -> list[Any]:
    """Variadic dims: ``x.view(a, b)`` / ``x.view((a, b))`` / ``torch.reshape(x, (a, b))``."""
    if name in ctx.call.kwargs:
        rest = [ctx.call.kwargs[name]]
    else:
        rest = list(ctx.call.args[start:])
    if len(rest) == 1:
        v = ctx.value(rest[0])
        return list(v) if isinstance(v, (list, tuple)) else [v]
    return [ctx.value(a) for a in rest]


@emits("reshape")
def reshape(ctx: NodeContext) -> Tensor:
    """view / reshape / squeeze / unsqueeze (ops.py maps all of them to "reshape")."""
    name = ctx.call.target if ctx.call.kind == "call_method" else getattr(ctx.call.target, "__name__", "")
    x = ctx.x()
    if name == "squeeze":
        return _squeeze(ctx, x)
    if name == "unsqueeze":
        dim = int(ctx.arg(1, "dim"))
        rank = ctx.rank()
        return ctx.make("Unsqueeze", [x], axes=[_norm_axis(dim, rank + 1)])
    dims = _dims_args(ctx, 1, "shape")
    if len(dims) == 1 and is_tensor(dims[0]) and not _is_scalar(ctx, dims[0]):
        shape = dims[0]  # a whole shape tensor (x.view(y.size()))
    else:
        shape = shape_tensor(ctx, dims)
    return ctx.make("Reshape", [x, shape])


def _squeeze(ctx: NodeContext, x: str) -> Tensor:
    shape = ctx.shape()
    if shape is None:
        raise ctx.unsupported("squeeze of a tensor of unknown shape")
    dim = ctx.arg(1, "dim", None)
    rank = len(shape)
    if dim is None:
        axes = [i for i, s in enumerate(shape) if s == 1]
    else:
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        axes = [a for a in (_norm_axis(int(d), rank) for d in dims) if shape[a] == 1]
    if not axes:
        return ctx.identity(x)
    return ctx.make("Squeeze", [x], axes=axes)


@emits("flatten")
def flatten(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    shape = ctx.shape()
    if shape is None:
        raise ctx.unsupported("flatten of a tensor of unknown shape")
    rank = len(shape)
    kw = ctx.kw(start_dim=0, end_dim=-1)  # nn.Flatten's defaults are (1, -1): it has them as attributes
    start, end = kw["start_dim"], kw["end_dim"]
    if rank == 0:
        return ctx.make("Reshape", [x, ctx.const("shape", [1], I64)])
    start, end = _norm_axis(int(start), rank), _norm_axis(int(end), rank)
    if start >= end:
        return ctx.identity(x)
    if start == 1 and end == rank - 1:
        return ctx.make("Flatten", [x], axis=1)
    # Flatten-11 always makes 2-D: copy the leading dims (0), merge, keep the trailing static dims
    dims = [0] * start + [-1] + [int(s) for s in shape[end + 1:]]
    return ctx.make("Reshape", [x, ctx.const("shape", dims, I64)])


@emits("permute")
def permute(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    dims = _dims_args(ctx, 1, "dims")
    return ctx.make("Transpose", [x], perm=[_norm_axis(int(d), rank) for d in dims])


@emits("transpose")
def transpose(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    rank = ctx.rank()
    d0, d1 = _norm_axis(int(ctx.arg(1, "dim0")), rank), _norm_axis(int(ctx.arg(2, "dim1")), rank)
    perm = list(range(rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    if d0 == d1:
        return ctx.identity(x)
    return ctx.make("Transpose", [x], perm=perm)


@emits("size")
def size(ctx: NodeContext):
    """``x.size()`` -> Shape (1-D int64), ``x.size(d)`` -> Shape + Gather (0-d int64): sizes stay
    dynamic, so a reshape fed by them follows a dynamic batch. ``x.dim()`` folds to the rank."""
    if ctx.call.method == "dim":
        return ctx.rank()
    x = ctx.x()
    shape = ctx.make("Shape", [x], tag="shape" if ctx.arg(1, "dim", None) is not None else None, dtype=I64)
    d = ctx.arg(1, "dim", None)
    if d is None:
        return shape
    idx = ctx.const("index", _norm_axis(int(d), ctx.rank()), I64)
    out = ctx.make("Gather", [shape, idx], axis=0, dtype=I64)
    ctx.emitter.scalars.add(out)
    return out


@emits("getattr")
def getattr_(ctx: NodeContext):
    """``x.shape`` (Shape), ``x.dtype`` / ``x.ndim`` (folded)."""
    attr = ctx.call.args[1]
    obj = ctx.call.args[0]
    if attr == "shape":
        return ctx.make("Shape", [ctx.tensor(obj)], dtype=I64)
    if attr == "ndim":
        return ctx.rank(obj)
    if attr in ("dtype", "device", "is_cuda", "requires_grad"):
        info = obj.meta.get("qc_tensor") if isinstance(obj, fx.Node) else None
        if attr == "dtype" and info is not None:
            rev = {v: k for k, v in _DTYPE_NAMES.items()}
            return rev.get(info.dtype)
        return {"device": torch.device("cpu"), "is_cuda": False, "requires_grad": False}.get(attr)
    raise ctx.unsupported(f"getattr {attr!r}")


@emits("split")
def split(ctx: NodeContext):
    """x.chunk(n, dim) / x.split(size_or_sections, dim): Split with the recorded piece sizes."""
    x = ctx.x()
    info = ctx.node.meta.get("qc_tensor")
    dim = int(ctx.arg(2, "dim", 0))
    rank = ctx.rank()
    axis = _norm_axis(dim, rank)
    if not isinstance(info, (tuple, list)) or not info:
        raise ctx.unsupported("split/chunk without recorded output shapes")
    sizes = [t.shape[axis] for t in info]
    if len(sizes) == 1:
        return (ctx.identity(x),)
    outs = ctx.make("Split", [x], outputs=len(sizes), axis=axis, split=sizes)
    return tuple(outs)


@emits("pad")
def pad(ctx: NodeContext) -> Tensor:
    """F.pad: torch lists (begin, end) pairs from the last dim backwards; Pad-11 wants all begins
    then all ends, first dim first."""
    x = ctx.x()
    rank = ctx.rank()
    kw = ctx.kw(pad=REQUIRED, mode="constant", value=None)
    pads, mode, value = [int(p) for p in kw["pad"]], kw["mode"], kw["value"]
    if any(p < 0 for p in pads):
        raise ctx.unsupported("negative padding (cropping)")
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pads) // 2):
        d = rank - 1 - i
        begins[d], ends[d] = pads[2 * i], pads[2 * i + 1]
    if mode == "circular":
        return _circular_pad(ctx, x, begins, ends)
    onnx_mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}.get(mode)
    if onnx_mode is None:
        raise ctx.unsupported(f"pad mode={mode!r} (constant, reflect, replicate or circular)")
    ins = [x, ctx.const("pads", begins + ends, I64)]
    if onnx_mode == "constant" and value:
        ins.append(ctx.const("value", float(value), ctx.dtype(x)))
    return ctx.make("Pad", ins, mode=onnx_mode)
