"""Reduction rules (nash): sum and mean over any dims are requantized once onto the output grid;
amax / amin select an integer on the input's grid. A mean over H and W of a 4-D value stays the
global average pool (:func:`.pooling.global_mean`), the form bayes runs, unchanged."""

from __future__ import annotations

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import shape
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.pooling import global_mean
from qcompiler.passes.convert_rules.registry import converts
from qcompiler.quantization import fixed_point as fp


def _in_shape(ctx: ConvertContext) -> tuple[int, ...]:
    s = shape(ctx.operand(0))
    if s is None:
        raise UnsupportedOpError(f"{ctx.where}: {ctx.op} of a value without a traced shape")
    return s


@converts("sum", "mean", "amax", "amin")
def reduce(ctx: ConvertContext):
    """The reduction over the call's ``dim`` (int, tuple, negative, or none: every dim) and ``keepdim``."""
    a = ctx.args
    if a.get("dtype") is not None:
        raise UnsupportedOpError(f"{ctx.where}: {ctx.op} with dtype={a['dtype']} has no fixed-point lowering "
                                 f"(the BPU reduces integers); drop the dtype or run it on CPU (hybrid_dict)")
    s = _in_shape(ctx)
    dims = fp.reduce_dims(a["dim"], len(s), f"{ctx.where} ({ctx.op})")
    if ctx.op == "mean" and len(s) == 4 and dims == (2, 3):
        return global_mean(ctx)  # the global average pool (bayes's form, its own kernel)
    x = ctx.input()
    out = x if ctx.op in fp.SELECTING_MODES else ctx.out
    return qnn.QuantizedReduce(ctx.op, dims, bool(a["keepdim"]), s, x.scale, out.scale, out.dtype)
