"""Lookup-table rules: element-wise functions evaluated through a table from the input's grid to the
output's (one table row per op in :data:`LUT_FUNCTIONS`).

``fp.build_lut`` evaluates the function in float64 on every input code and refuses a NaN, so a
function with a restricted domain is given here on the whole grid (docs/marches.md, "Table
kernels"): a value of +-inf saturates to the output type's qmax / qmin.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.ops import is_number
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.convert_rules.registry import converts

_INF = math.inf


def _log(x: torch.Tensor) -> torch.Tensor:
    """log x; -inf (saturating to qmin) for x <= 0, log's limit at 0+."""
    return torch.where(x > 0, torch.log(x.clamp(min=torch.finfo(x.dtype).tiny)), -_INF)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt x; 0 for x < 0 (the value at 0)."""
    return torch.sqrt(x.clamp(min=0))


def _rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt x; +inf (saturating to qmax) for x <= 0, the limit at 0+."""
    return torch.where(x > 0, torch.rsqrt(x.clamp(min=torch.finfo(x.dtype).tiny)), _INF)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x; +inf (saturating to qmax) at x = 0 (the grid's 0 is +0, torch's 1 / +0)."""
    return torch.where(x != 0, torch.reciprocal(x), _INF)


def _pow(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """x ** c. An integer c is defined everywhere (0 ** c < 0 is +inf: qmax); a fractional c is
    evaluated on max(x, 0), so x < 0 takes the value at 0 (0, or qmax for c < 0)."""
    base = x if float(exponent).is_integer() else x.clamp(min=0)
    return torch.pow(base, exponent)


# op -> the float function its table samples (default arguments; float64 versions for table building;
# defined on every input code, see the module docstring). pow's entry takes the exponent as well.
LUT_FUNCTIONS = {
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "silu": F.silu,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "gelu": F.gelu,
    "elu": F.elu,
    "selu": F.selu,
    # transformer tables (issue 34)
    "erf": torch.erf,
    "mish": F.mish,
    "log": _log,
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    "reciprocal": _reciprocal,
    "pow": _pow,
}


# op -> the arguments (besides the input) that change the function a table samples, read from the call
# (a module's attributes, a function's arguments) and passed on: gelu's tanh form, elu's alpha
TABLE_ARGUMENTS = {"gelu": ("approximate",), "elu": ("alpha",)}


def table_function(op: str, exponent=None, **arguments):
    """The element-wise function the table of ``op`` samples (pow: of ``x ** exponent``; ``arguments``:
    the call's :data:`TABLE_ARGUMENTS`)."""
    fn = LUT_FUNCTIONS[op]
    if op == "pow":
        return functools.partial(fn, exponent=float(exponent))
    return functools.partial(fn, **arguments) if arguments else fn


@converts(*LUT_FUNCTIONS)
def lookup(ctx: ConvertContext) -> qnn.QuantizedLookup:
    """The table of ``LUT_FUNCTIONS[op]`` over every input code (pow: of ``x ** c``, ``c`` the call's
    Python-number exponent, kept on the module)."""
    src = ctx.input()
    exponent = None
    if ctx.op == "pow":
        exponent = ctx.args["exponent"]
        if not is_number(exponent):
            raise UnsupportedOpError(f"{ctx.where}: pow's exponent is {type(exponent).__name__}, not a Python "
                                     f"number; a table samples x ** c for one constant c (keep it on the CPU)")
    arguments = {k: ctx.args[k] for k in TABLE_ARGUMENTS.get(ctx.op, ())}
    fn = table_function(ctx.op, exponent, **arguments)
    return qnn.QuantizedLookup(ctx.op, fn, src.scale, src.dtype, ctx.out.scale, ctx.out.dtype, exponent=exponent,
                               arguments=arguments)
