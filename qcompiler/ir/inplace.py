"""Which graph nodes change a value in place, and which of them change the model's own state.

``a.mul_(2.0)`` writes into ``a``; passes that reorder or copy values must know it
(:mod:`~qcompiler.passes.inplace_reads`, eager islands, the pad fold).  A write into a parameter
or buffer (``self.mean.mul_(0.5)``) is state that outlives the call: a traced graph cannot hold it,
so tracing makes the module doing it a leaf (:mod:`~qcompiler.ir.auto_leaf`).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn

# torch.nn modules whose ``inplace=True`` writes the result into their input (exactly these classes: a
# module of another class may keep an ``inplace`` flag it does not act on, as timm's GELU does)
INPLACE_MODULES = frozenset({
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.SiLU, nn.Mish, nn.Hardtanh, nn.Hardswish,
    nn.Hardsigmoid, nn.Threshold, nn.RReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.AlphaDropout, nn.FeatureAlphaDropout,
})


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def mutated_input(node: fx.Node, gm: fx.GraphModule) -> Optional[fx.Node]:
    """The value ``node`` changes in place (its first argument), or None: a tensor method ``x.op_()``,
    a ``torch`` function ``op_`` or a ``torch.nn.functional`` one with ``inplace=True``, a module of
    :data:`INPLACE_MODULES` with ``inplace=True``.  (A user function or module with such a name or flag
    is not taken at its word.)"""
    first = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method":
        return first if _in_place_name(node.target) else None
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return first if type(mod) in INPLACE_MODULES and getattr(mod, "inplace", False) is True else None
    if node.op == "call_function":
        where = getattr(node.target, "__module__", None) or ""
        if where == "torch.nn.functional" and node.kwargs.get("inplace") is True:
            return first
        if where == "torch" and _in_place_name(getattr(node.target, "__name__", "")):
            return first
    return None


def state_writes(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """``(node, attribute)`` for each in-place node whose changed value is a parameter or buffer of
    the model (a ``get_attr``, followed back through a chain of in-place ops: ``self.m.mul_(a).add_(b)``).
    Writes through views (``self.m[0].fill_(1)``) are not followed."""
    writes = []
    for node in gm.graph.nodes:
        value = mutated_input(node, gm)
        while value is not None and value.op != "get_attr":
            value = mutated_input(value, gm)
        if value is not None:
            writes.append((node, value.target))
    return writes


__all__ = ["INPLACE_MODULES", "mutated_input", "state_writes"]
