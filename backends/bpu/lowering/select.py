"""Lowering of the nash selections with constant indices: narrow and slice are the static getitem
``x[:, ..., start:start + length]`` / ``x[:, ..., start:end:step]`` (the kind ``getitem`` of the layout ops)."""

from __future__ import annotations

from qcompiler.backends.bpu.constraints import slice_args
from qcompiler.backends.bpu.lowering.layout import same_scale
from qcompiler.ir.meta import shape


@same_scale("narrow", emits=("getitem",))
def narrow(ctx, args, kwargs):
    """narrow(dim, start, length), given by position or keyword, as a tuple of slices."""
    names = ("dim", "start", "length")
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    if set(values) != set(names) or any(isinstance(v, bool) or not isinstance(v, int) for v in values.values()):
        raise ctx.fail(f"narrow with arguments {args!r} {kwargs!r} (constant ints dim, start, length)")
    dim, start, length = values["dim"], values["start"], values["length"]
    s = shape(ctx.arg(0))
    if (dim < 0 or start < 0) and s is None:
        raise ctx.fail("narrow with a negative dim or start of a value without a traced shape")
    if dim < 0:
        dim += len(s)
    if start < 0:
        start += s[dim]
    index = tuple([slice(None)] * dim + [slice(start, start + length)])
    return "getitem", {"index": ctx.index(index)}


@same_scale("slice", emits=("getitem",))
def slice_(ctx, args, kwargs):
    """aten.slice.Tensor(dim, start, end, step) as the index ``x[:, ..., start:end:step]``; an end past the
    dim (torch.export writes ``x[a:]`` with end 2**63 - 1) is the dim's end."""
    node = ctx.node
    bounds = slice_args(node)
    if bounds is None:
        raise ctx.fail(f"slice with arguments {args!r} {kwargs!r} (constant ints dim, step; start, end or None)")
    dim, start, end, step = bounds
    s = shape(ctx.arg(0))
    if s is None:
        raise ctx.fail("slice of a value without a traced shape")
    dim %= len(s)
    if end is not None and end >= s[dim]:
        end = None
    index = tuple([slice(None)] * dim + [slice(start, end, step)])
    return "getitem", {"index": ctx.index(index)}
