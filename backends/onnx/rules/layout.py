"""Layout rules: reshape / view / squeeze / unsqueeze, flatten, permute, transpose, sizes, split, pad, cat,
stack, expand, repeat / tile, t / T / mT, flip, roll, pixel (un)shuffle, unbind, narrow, movedim."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from qcompiler.backends.onnx.context import (
    INT64_MAX,
    NodeContext,
    Tensor,
    is_tensor,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64, _circular_pad, _norm_axis
from qcompiler.ir.meta import META_TENSOR
from qcompiler.ir.ops import REQUIRED
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


# the fields of torch's (values, indices) return types (torch.return_types.max, topk, sort...)
_RETURN_FIELDS = {"values": 0, "indices": 1}


@emits("getattr")
def getattr_(ctx: NodeContext):
    """``x.shape`` (Shape), ``x.dtype`` / ``x.ndim`` (folded), ``x.T`` / ``x.mT`` (Transpose), the
    ``.values`` / ``.indices`` of a (values, indices) result."""
    attr = ctx.call.args[1]
    obj = ctx.call.args[0]
    if attr == "shape":
        return ctx.make("Shape", [ctx.tensor(obj)], dtype=I64)
    if attr == "ndim":
        return ctx.rank(obj)
    if attr in ("T", "mT"):
        return _attr_transpose(ctx, obj, attr)
    if attr in _RETURN_FIELDS:  # torch.max(x, 1).values, x.topk(k).indices, x.sort().values
        v = ctx.value(obj)
        if isinstance(v, (tuple, list)) and len(v) == 2:
            return v[_RETURN_FIELDS[attr]]
    if attr in ("dtype", "device", "is_cuda", "requires_grad"):
        info = obj.meta.get(META_TENSOR) if isinstance(obj, fx.Node) else None
        if attr == "dtype" and info is not None:
            rev = {v: k for k, v in _DTYPE_NAMES.items()}
            return rev.get(info.dtype)
        return {"device": torch.device("cpu"), "is_cuda": False, "requires_grad": False}.get(attr)
    raise ctx.unsupported(f"getattr {attr!r}")


@emits("split")
def split(ctx: NodeContext):
    """x.chunk(n, dim) / x.split(size_or_sections, dim): Split with the recorded piece sizes."""
    x = ctx.x()
    info = ctx.node.meta.get(META_TENSOR)
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


# ---------------------------------------------------------------------------
# stack, expand, repeat, transposes, flip, roll, pixel (un)shuffle, unbind, narrow, movedim


def _static_shape(ctx: NodeContext, what: str) -> tuple[int, ...]:
    shape = ctx.shape()
    if shape is None:
        raise ctx.unsupported(f"{what} of a tensor of unknown shape")
    return tuple(shape)


@emits("stack", since=11)
def stack(ctx: NodeContext) -> Tensor:
    """Unsqueeze each input at ``dim``, Concat."""
    tensors = ctx.arg(0, "tensors")
    if isinstance(tensors, fx.Node):  # a node whose value is the tuple: torch.stack(x.unbind(1))
        infos = tensors.meta.get(META_TENSOR)
        if not isinstance(infos, (tuple, list)) or not infos or not hasattr(infos[0], "shape"):
            raise ctx.unsupported(f"stack of '{tensors.name}', whose value is not a recorded tuple of tensors")
        names, rank = list(ctx.value(tensors)), len(infos[0].shape)
    else:
        names, rank = [ctx.tensor(t) for t in tensors], ctx.rank(tensors[0])
    axis = _norm_axis(int(ctx.arg(1, "dim", 0)), rank + 1)
    parts = [ctx.make("Unsqueeze", [t], tag=f"unsqueeze{i}", axes=[axis]) for i, t in enumerate(names)]
    return ctx.make("Concat", parts, axis=axis)


@emits("expand", since=11)
def expand(ctx: NodeContext) -> Tensor:
    """Expand-11 broadcasts both ways, so torch's ``-1`` (keep this size) is a 1."""
    x = ctx.x()
    dims = _dims_args(ctx, 1, "size")
    dims = [1 if isinstance(d, int) and d == -1 else d for d in dims]
    return ctx.make("Expand", [x, shape_tensor(ctx, dims)])


@emits("expand_as", since=11)
def expand_as(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    other = ctx.tensor(ctx.arg(1, "other"))
    return ctx.make("Expand", [x, ctx.make("Shape", [other], tag="shape", dtype=I64)])


@emits("repeat", "tile", since=11)
def repeat(ctx: NodeContext) -> Tensor:
    """``x.repeat`` / ``torch.tile``: Tile; more repeats than dims first add leading dims of size 1
    (as torch); ``tile`` with fewer repeats than dims repeats the leading dims once."""
    x = ctx.x()
    rank = ctx.rank()
    reps = _dims_args(ctx, 1, "dims" if ctx.op == "tile" else "repeats")
    if not all(isinstance(r, (int, np.integer)) for r in reps):
        raise ctx.unsupported("repeat counts that are tensors")
    if ctx.op == "tile" and len(reps) < rank:
        reps = [1] * (rank - len(reps)) + list(reps)
    if len(reps) < rank:
        raise ctx.unsupported(f"{len(reps)} repeat counts for a {rank}-D tensor (torch needs at least {rank})")
    if len(reps) > rank:
        x = ctx.make("Unsqueeze", [x], tag="lead", axes=list(range(len(reps) - rank)))
    return ctx.make("Tile", [x, ctx.const("repeats", [int(r) for r in reps], I64)])


@emits("t", since=11)
def t(ctx: NodeContext) -> Tensor:
    """``x.t()`` / ``torch.t``: the transpose of a 2-D tensor, a 0-D or 1-D one unchanged."""
    x = ctx.x()
    rank = ctx.rank()
    if rank > 2:
        raise ctx.unsupported(f"t() of a {rank}-D tensor (torch takes at most 2-D)")
    return ctx.make("Transpose", [x], perm=[1, 0]) if rank == 2 else ctx.identity(x)


def _attr_transpose(ctx: NodeContext, obj: Any, attr: str) -> Tensor:
    """``x.T`` (all dims reversed) and ``x.mT`` (the last two swapped)."""
    x = ctx.tensor(obj)
    rank = ctx.rank(obj)
    if attr == "T":
        perm = list(reversed(range(rank)))
    else:
        if rank < 2:
            raise ctx.unsupported(f"x.mT of a {rank}-D tensor (torch needs at least 2-D)")
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    if perm == list(range(rank)):
        return ctx.identity(x)
    return ctx.make("Transpose", [x], perm=perm)


@emits("flip", since=11)
def flip(ctx: NodeContext) -> Tensor:
    """Slice with step -1 along each flipped dim."""
    x = ctx.x()
    rank = ctx.rank()
    axes = sorted({_norm_axis(int(d), rank) for d in _dims_args(ctx, 1, "dims")})
    if not axes:
        return ctx.identity(x)
    k = len(axes)
    return ctx.make("Slice", [x, ctx.const("starts", [-1] * k, I64), ctx.const("ends", [-INT64_MAX - 1] * k, I64),
                              ctx.const("axes", axes, I64), ctx.const("steps", [-1] * k, I64)])


def _roll_axis(ctx: NodeContext, x: str, axis: int, shift: int, tag: str) -> str:
    """``cat(x[-k:], x[:-k])`` along ``axis`` with ``k = shift mod size``, the size read at run time
    (a compiled model takes other batch sizes); ``k = 0`` gives ``cat(x, [])``, ``x`` itself."""
    size = ctx.make("Gather", [ctx.make("Shape", [x], tag=f"{tag}_shape", dtype=I64),
                               ctx.const(f"{tag}_axis", [axis], I64)], tag=f"{tag}_size", dtype=I64, axis=0)
    k = ctx.make("Mod", [ctx.const(f"{tag}_shift", [shift], I64), size], tag=f"{tag}_k", dtype=I64)
    neg_k = ctx.make("Neg", [k], tag=f"{tag}_neg_k", dtype=I64)
    ax = ctx.const(f"{tag}_axes", [axis], I64)
    tail = ctx.make("Slice", [x, neg_k, ctx.const(f"{tag}_end", [INT64_MAX], I64), ax], tag=f"{tag}_tail")
    head = ctx.make("Slice", [x, ctx.const(f"{tag}_zero", [0], I64), neg_k, ax], tag=f"{tag}_head")
    return ctx.make("Concat", [tail, head], tag=tag, axis=axis)


@emits("roll", since=11)
def roll(ctx: NodeContext) -> Tensor:
    """Per rolled dim: the last ``shift`` elements, then the rest (Slice + Concat); no dims
    rolls the flattened tensor."""
    x = ctx.x()
    rank = ctx.rank()
    if 0 in ctx.shape():
        raise ctx.unsupported("roll of an empty tensor")
    kw = ctx.kw(shifts=REQUIRED, dims=None)
    shifts = kw["shifts"] if isinstance(kw["shifts"], (list, tuple)) else [kw["shifts"]]
    dims = kw["dims"]
    if not all(isinstance(s, int) for s in shifts):
        raise ctx.unsupported("shifts that are tensors")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        if len(shifts) != 1:
            raise ctx.unsupported("several shifts without dims")
        flat = ctx.make("Reshape", [x, ctx.const("flat", [-1], I64)], tag="flatten")
        y = _roll_axis(ctx, flat, 0, shifts[0], "roll0")
        return ctx.make("Reshape", [y, ctx.make("Shape", [x], tag="shape", dtype=I64)])
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if len(dims) != len(shifts):
        raise ctx.unsupported(f"{len(shifts)} shifts for {len(dims)} dims")
    y = x
    for i, (s, d) in enumerate(zip(shifts, dims)):
        y = _roll_axis(ctx, y, _norm_axis(int(d), rank), int(s), f"roll{i}")
    return y


@emits("pixel_shuffle", since=11)
def pixel_shuffle(ctx: NodeContext) -> Tensor:
    """DepthToSpace in CRD mode is torch's channel order."""
    x = ctx.x()
    r = int(ctx.kw(upscale_factor=REQUIRED)["upscale_factor"])
    if ctx.rank() != 4:
        raise ctx.unsupported(f"pixel_shuffle of a {ctx.rank()}-D tensor (4-D N, C, H, W is emitted)")
    return ctx.make("DepthToSpace", [x], blocksize=r, mode="CRD")


@emits("pixel_unshuffle", since=11)
def pixel_unshuffle(ctx: NodeContext) -> Tensor:
    """(N, C, H*r, W*r) -> (N, C, H, r, W, r) -> (N, C, r, r, H, W) -> (N, C*r*r, H, W): torch's
    channel order (SpaceToDepth orders the block before the channel)."""
    x = ctx.x()
    r = int(ctx.kw(downscale_factor=REQUIRED)["downscale_factor"])
    shape = _static_shape(ctx, "pixel_unshuffle")
    if 0 in shape:
        raise ctx.unsupported("pixel_unshuffle of an empty tensor")
    if len(shape) != 4:
        raise ctx.unsupported(f"pixel_unshuffle of a {len(shape)}-D tensor (4-D N, C, H, W is emitted)")
    _, c, h, w = shape
    six = ctx.make("Reshape", [x, ctx.const("blocks", [0, c, h // r, r, w // r, r], I64)], tag="blocks")
    moved = ctx.make("Transpose", [six], tag="move", perm=[0, 1, 3, 5, 2, 4])
    return ctx.make("Reshape", [moved, ctx.const("shape", [0, c * r * r, h // r, w // r], I64)])


@emits("unbind", since=11)
def unbind(ctx: NodeContext):
    """A tuple of the slices along ``dim``: Split into pieces of 1, each squeezed."""
    x = ctx.x()
    shape = _static_shape(ctx, "unbind")
    axis = _norm_axis(int(ctx.kw(dim=0)["dim"]), len(shape))
    n = shape[axis]
    if n == 0:
        return ()
    pieces = [x] if n == 1 else ctx.make("Split", [x], tag="split", outputs=n, axis=axis, split=[1] * n)
    return tuple(ctx.make("Squeeze", [p], tag=f"squeeze{i}", axes=[axis]) for i, p in enumerate(pieces))


@emits("narrow", since=11)
def narrow(ctx: NodeContext) -> Tensor:
    x = ctx.x()
    shape = _static_shape(ctx, "narrow")
    kw = ctx.kw(dim=REQUIRED, start=REQUIRED, length=REQUIRED)
    if not all(isinstance(kw[k], int) for k in ("dim", "start", "length")):
        raise ctx.unsupported("narrow with tensor arguments (python ints are emitted)")
    axis = _norm_axis(kw["dim"], len(shape))
    start, end = kw["start"], kw["start"] + kw["length"]
    if start < 0 <= end:  # counted from the end (kept so: the size may differ at run time)
        end = INT64_MAX
    return ctx.make("Slice", [x, ctx.const("starts", [start], I64), ctx.const("ends", [end], I64),
                              ctx.const("axes", [axis], I64)])


@emits("movedim", since=11)
def movedim(ctx: NodeContext) -> Tensor:
    """Transpose: each source dim to its destination, the other dims in order in the free places."""
    x = ctx.x()
    rank = ctx.rank()
    kw = ctx.kw(source=REQUIRED, destination=REQUIRED)
    src = kw["source"] if isinstance(kw["source"], (list, tuple)) else [kw["source"]]
    dst = kw["destination"] if isinstance(kw["destination"], (list, tuple)) else [kw["destination"]]
    src, dst = [_norm_axis(int(s), rank) for s in src], [_norm_axis(int(d), rank) for d in dst]
    if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ctx.unsupported(f"source {src} and destination {dst} must be distinct dims of the same count")
    perm: list[int] = [-1] * rank
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(i for i in range(rank) if i not in src)
    perm = [p if p >= 0 else next(rest) for p in perm]
    if perm == list(range(rank)):
        return ctx.identity(x)
    return ctx.make("Transpose", [x], perm=perm)
