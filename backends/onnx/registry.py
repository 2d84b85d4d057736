"""The registry of ONNX emit rules: canonical op (or module class) -> {opset: rule}.

A rule turns one FX node into ONNX nodes (``rule(ctx: NodeContext) -> value``). It is
registered for the opset it first works in::

    @emits("leaky_relu", since=11)
    def leaky_relu(ctx): ...

and a target opset gets, per op, the rule with the highest ``since`` not above it. A
second registration of the same op and opset is a bug in the rule files and raises at
import. Module rules (quantizers, stubs, the fixed-point modules of a converted model) are
keyed by class and looked up along the module's MRO before the op rules: they describe
what a module *is* in the quantized graph, which the op name does not.

Families of ops that differ only in the ONNX op type are table rows registered in a loop
with :func:`register` (see ``rules/elementwise.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.nn as nn

from qcompiler.backends.onnx.context import OPSET_VERSION, NodeContext
from qcompiler.errors import InternalError

Rule = Callable[[NodeContext], Any]

_OP_RULES: dict[str, dict[int, Rule]] = {}
_MODULE_RULES: dict[type, dict[int, Rule]] = {}


class DuplicateRuleError(InternalError):
    """Two rules registered for the same op (or module class) and opset."""


def _add(table: dict, key: Any, since: int, rule: Rule) -> None:
    if not isinstance(since, int) or since < 1:
        raise ValueError(f"emit rule for {key!r}: since must be an opset number, got {since!r}")
    versions = table.setdefault(key, {})
    if since in versions:
        old = versions[since]
        raise DuplicateRuleError(
            f"two ONNX emit rules for {key!r} at opset {since}: {old.__module__}.{old.__qualname__} and "
            f"{rule.__module__}.{rule.__qualname__}; keep one, or register the new one with a higher since")
    versions[since] = rule


def register(op: str, rule: Rule, *, since: int = OPSET_VERSION) -> Rule:
    """Register ``rule`` for canonical op ``op`` from opset ``since`` on (table-driven families)."""
    _add(_OP_RULES, op, since, rule)
    return rule


def emits(*ops: str, since: int = OPSET_VERSION) -> Callable[[Rule], Rule]:
    """Decorator: the rule emits each of ``ops`` (canonical names, ``qcompiler.ir.ops``) from opset ``since``."""
    def deco(rule: Rule) -> Rule:
        for op in ops:
            register(op, rule, since=since)
        return rule
    return deco


def emits_module(*classes: type, since: int = OPSET_VERSION) -> Callable[[Rule], Rule]:
    """Decorator: the rule emits calls of modules of ``classes`` (and their subclasses)."""
    def deco(rule: Rule) -> Rule:
        for cls in classes:
            _add(_MODULE_RULES, cls, since, rule)
        return rule
    return deco


def _pick(versions: Optional[dict[int, Rule]], opset: int) -> Optional[Rule]:
    if not versions:
        return None
    usable = [v for v in versions if v <= opset]
    return versions[max(usable)] if usable else None


def op_rule(op: Optional[str], opset: int = OPSET_VERSION) -> Optional[Rule]:
    """The rule for canonical op ``op`` at ``opset``, or None."""
    return _pick(_OP_RULES.get(op), opset) if op is not None else None


def module_rule(cls: type, opset: int = OPSET_VERSION) -> Optional[Rule]:
    """The module rule for class ``cls`` at ``opset``, looked up along its MRO, or None."""
    for base in cls.__mro__:
        rule = _pick(_MODULE_RULES.get(base), opset)
        if rule is not None:
            return rule
    return None


def rule_for(module: Optional[nn.Module], op: Optional[str], opset: int = OPSET_VERSION) -> Optional[Rule]:
    """The rule for a node calling ``module`` (or None) with canonical op ``op``: a module rule
    first, else the op's rule."""
    rule = module_rule(type(module), opset) if module is not None else None
    return rule if rule is not None else op_rule(op, opset)


def emitted_ops(opset: int = OPSET_VERSION) -> frozenset[str]:
    """Every canonical op some rule emits at ``opset`` (the coverage test reads it)."""
    return frozenset(op for op, versions in _OP_RULES.items() if _pick(versions, opset) is not None)


def module_classes(opset: int = OPSET_VERSION) -> frozenset[type]:
    """Every module class with a module rule at ``opset``."""
    return frozenset(cls for cls, versions in _MODULE_RULES.items() if _pick(versions, opset) is not None)


__all__ = ["Rule", "DuplicateRuleError", "register", "emits", "emits_module", "op_rule", "module_rule", "rule_for",
           "emitted_ops", "module_classes"]
