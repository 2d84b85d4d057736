"""Lowering of the nash selections with constant indices: narrow is the static getitem
``x[:, ..., start:start + length]`` (the kind ``getitem`` of the layout ops)."""

from __future__ import annotations

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
