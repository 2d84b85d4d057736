"""The registry of convert rules: canonical op -> the rule that builds its fixed-point module.

A rule turns one observed BPU node into its module of ``qcompiler.nn.quantized``
(``rule(ctx: ConvertContext) -> nn.Module``) and is registered for the ops it converts::

    @converts("avg_pool2d")
    def avg_pool2d(ctx): ...

A second rule for the same op is a bug in the rule files and raises at import. The families
(one module per op family in this package) register when the package is imported.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from qcompiler.errors import InternalError, UnsupportedOpError
from qcompiler.passes.convert_rules.context import ConvertContext

Rule = Callable[[ConvertContext], nn.Module]

_RULES: dict[str, Rule] = {}


def converts(*ops: str) -> Callable[[Rule], Rule]:
    """Decorator: the rule converts each of ``ops`` (canonical names, ``qcompiler.ir.ops``)."""
    def deco(rule: Rule) -> Rule:
        for op in ops:
            old = _RULES.get(op)
            if old is not None:
                raise InternalError(f"convert: two rules for '{op}': {old.__module__}.{old.__qualname__} and "
                                f"{rule.__module__}.{rule.__qualname__}; keep one")
            _RULES[op] = rule
        return rule
    return deco


def rule_for(ctx: ConvertContext) -> Rule:
    """The rule for ``ctx.op``; UnsupportedOpError naming the node and the op when there is none."""
    rule = _RULES.get(ctx.op)
    if rule is None:
        raise UnsupportedOpError(f"{ctx.where}: no fixed-point lowering for BPU op '{ctx.op}' yet (no convert "
                                 f"rule for it in qcompiler.passes.convert_rules)")
    return rule


def converted_ops() -> frozenset[str]:
    """Every op some rule converts (the coverage test checks the march tables against it)."""
    return frozenset(_RULES)


__all__ = ["Rule", "converts", "rule_for", "converted_ops"]
