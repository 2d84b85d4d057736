"""softmax and log_softmax along a given dim (nash): the integer kernels ``fixed_point.int_softmax`` and
``fixed_point.int_log_softmax``.

The output grid is the node's output observer's, as for every value-making op: a softmax lies in
[0, 1], so a min/max observer settles on ``max(p) / qmax`` (at most ``1 / qmax``), a log_softmax on
``-min / 2**(bits-1)``; the fake-quant model and every later op read the same grid. The dim is made
non-negative here.
"""

from __future__ import annotations

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_TENSOR, TensorInfo
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.registry import converts

_MODULES = {"softmax": qnn.QuantizedSoftmax, "log_softmax": qnn.QuantizedLogSoftmax}


@converts(*_MODULES)
def softmax(ctx: ConvertContext):
    """The module of the node's dim (an int; the march table keeps other calls on the CPU)."""
    src = ctx.input()
    dim = ctx.args["dim"]
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise UnsupportedOpError(f"{ctx.where}: {ctx.op} needs dim as a constant int, got {dim!r}; "
                                 f"pass dim=... or run it on the CPU")
    info = ctx.operand(0).meta.get(META_TENSOR)
    if isinstance(info, TensorInfo) and len(info.shape):
        dim %= len(info.shape)
    return _MODULES[ctx.op](dim, src.scale, src.dtype, ctx.out.scale, ctx.out.dtype)
