"""The op registry: each canonical op by name, the spelling tables derived from the catalogue,
and the ops of each tag.

A spelling (module class, call_function target, method name) belongs to exactly one op; the
tables are built once at import and a spelling defined twice raises there.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from qcompiler.ir.ops.catalogue import CATALOGUE
from qcompiler.ir.ops.opdef import OpDef, Spelling, Tag

CLAMP = "clamp"  # its spellings canonicalize by their bounds (qcompiler.ir.ops.canonical), not by table

OPS: dict[str, OpDef] = {}
_BY_SPELLING: dict[Spelling, OpDef] = {}


def _register(op: OpDef) -> None:
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is defined twice")
    OPS[op.name] = op
    for spelling in op.spellings:
        other = _BY_SPELLING.get(spelling)
        if other is not None:
            raise ValueError(f"{spelling!r} spells both {other.name!r} and {op.name!r}")
        _BY_SPELLING[spelling] = op


for _op in CATALOGUE:
    _register(_op)


def definition(spelling: Spelling) -> Optional[OpDef]:
    """The op ``spelling`` (a module class exactly, a function, a method name) belongs to, or None."""
    try:
        return _BY_SPELLING.get(spelling)
    except TypeError:  # an unhashable call_function target
        return None


def module_definition(module: nn.Module) -> Optional[OpDef]:
    """The op whose module spelling ``module`` is an instance of (the nearest class along its MRO)."""
    for cls in type(module).__mro__:
        op = _BY_SPELLING.get(cls)
        if op is not None:
            return op
    return None


def tagged(tag: Tag) -> frozenset[str]:
    """The names of the ops with ``tag``."""
    return frozenset(name for name, op in OPS.items() if tag in op.tags)


def _table(kind: str) -> dict:
    return {s: op.name for op in CATALOGUE if op.name != CLAMP for s in getattr(op, kind)}


# spelling -> canonical op (clamps excluded: their op depends on their bounds)
MODULE_OPS: dict[type, str] = _table("modules")  # subclasses match too (checked along the MRO)
FUNCTION_OPS: dict[object, str] = _table("functions")
METHOD_OPS: dict[str, str] = _table("methods")
CLAMP_OP: OpDef = OPS[CLAMP]

PASSTHROUGH_OPS = tagged(Tag.PASSTHROUGH)
LAYOUT_OPS = tagged(Tag.LAYOUT)
META_OPS = tagged(Tag.META)
