"""Lowering of the element-wise functions the BPU evaluates through a lookup table (the table convert
built, indexed by the input integer)."""

from __future__ import annotations

from qcompiler.backends.bpu.lowering.common import dtype_name
from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn

# the functions convert tabulates (passes/convert_rules/lut.py; test_lower_coverage checks that every op
# convert converts lowers): the lowering is the same for each
TABULATED = ("sigmoid", "tanh", "exp", "silu", "hardsigmoid", "hardswish", "gelu", "elu", "selu",
             "erf", "mish", "log", "sqrt", "rsqrt", "reciprocal", "pow")


@lowers(qnn.QuantizedLookup, *TABULATED, emits=("lut",))
def lut(ctx):
    """The table, with the function's name and the input type it is indexed by."""
    m, x = ctx.module, ctx.arg(0)
    s = ctx.per_tensor(x)
    if s.dtype != dtype_name(m.in_dtype):
        raise ctx.fail(f"table is for {m.in_dtype} input but '{x.name}' is {s.dtype}")
    return ctx.emit("lut", [x.name], {"fn": m.qc_op, "in_dtype": s.dtype, **ctx.out()}, {"table": m.table})
