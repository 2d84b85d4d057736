"""The registry of BPU lowering rules: (converted module class, its ``qc_op``) -> rule.

A rule turns one node of a converted BPU partition into one program op
(``rule(ctx) -> BpuOp``, ``ctx`` a :class:`~qcompiler.backends.bpu.lower.LoweringContext`).
It is registered for the class of the converted module, the ops that module can compute
(its ``qc_op``), and the BPU op kinds it may emit::

    @lowers(qnn.QuantizedResize, "interpolate", emits=("resize_nearest", "resize_bilinear"))
    def resize(ctx): ...

The class is matched exactly, not along the MRO: a subclass of a converted module may
compute something else, so it needs its own rule. The declared kinds are what the coverage
test checks against the simulator's reference kernels; the driver rejects a rule that emits
a kind it did not declare. A second rule for the same class and op raises at import. Both are
bugs in the rule files: :class:`~qcompiler.errors.InternalError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from qcompiler.errors import InternalError

if TYPE_CHECKING:
    from qcompiler.backends.bpu.lower import LoweringContext
    from qcompiler.backends.bpu.program import BpuOp


@dataclass(frozen=True)
class Rule:
    """A registered lowering: the function and the BPU op kinds it may emit."""

    fn: Callable[[LoweringContext], BpuOp]
    emits: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


_RULES: dict[tuple[type, str], Rule] = {}


def lowers(cls: type, *ops: str, emits: tuple[str, ...]) -> Callable:
    """Decorator: the rule lowers modules of exactly ``cls`` whose ``qc_op`` is one of ``ops``,
    into ops of the BPU kinds ``emits``."""
    def deco(fn: Callable) -> Callable:
        rule = Rule(fn, frozenset(emits))
        for op in ops:
            old = _RULES.get((cls, op))
            if old is not None:
                raise InternalError(f"two BPU lowering rules for {cls.__name__} '{op}': {old.name} and "
                                     f"{rule.name}; keep one")
            _RULES[(cls, op)] = rule
        return fn
    return deco


def rule_for(ctx: LoweringContext) -> Rule:
    """The rule lowering ``ctx``'s module; an :class:`~qcompiler.errors.UnsupportedOpError` naming the
    node when none does."""
    m = ctx.module
    rule = _RULES.get((type(m), m.qc_op))
    if rule is None:
        raise ctx.fail(f"no BPU op kind for {type(m).__name__} '{m.qc_op}'")
    return rule


def lowered_ops() -> frozenset[str]:
    """Every op (a converted module's ``qc_op``) some rule lowers."""
    return frozenset(op for _, op in _RULES)


def emitted_kinds() -> frozenset[str]:
    """Every BPU op kind some rule may emit."""
    return frozenset(kind for rule in _RULES.values() for kind in rule.emits)


__all__ = ["Rule", "lowers", "rule_for", "lowered_ops", "emitted_kinds"]
