"""Reads after an in-place op go through the op's result.

``a.mul_(2.0)`` changes ``a``; in eager PyTorch every later read of ``a`` sees the new values.  In the
graph those reads still name ``a``, which only the calibration model (running the op in place) gets
right: once the graph is converted, BPU stubs hand each consumer its own dequantized tensor and the
lowered op computes a new value, so a later ``torch.atan(a)`` read the old ``a`` (and an in-place op
whose result nobody used was dropped as dead code), a wrong answer with no error.

This pass rewires every read of ``a`` that comes after the in-place node ``n`` (in graph order) to
``n`` itself: the in-place op's result *is* the changed ``a``, so the calibration model computes the
same values as before, and every later stage sees the dependence as a data edge.  In-place nodes are
those :func:`mutated_input` names: ``x.op_()`` methods, ``torch`` functions ending in ``_``, and
``inplace=True`` in torch.nn's functions and activation / dropout modules.  Aliases through views
(``a[0].mul_(2)`` also changes ``a``) are not followed.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.passes.base import CompileContext, Pass, PassResult

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


def _late_reads(node: fx.Node, value: fx.Node, order: dict) -> list[fx.Node]:
    """The users of ``value`` after ``node`` (in graph order), ``node`` itself not counted."""
    return [u for u in value.users if u is not node and order[u] > order[node]]


def inplace_reads(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        value = mutated_input(node, gm)
        for user in _late_reads(node, value, order) if value is not None else ():
            user.replace_input_with(value, node)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


def verify_inplace_reads(gm: fx.GraphModule, ctx: CompileContext) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        value = mutated_input(node, gm)
        if value is not None:
            late = [u.name for u in _late_reads(node, value, order)]
            assert not late, f"{late} read {value.name} after {node.name} changed it in place"


INPLACE_READS = Pass("inplace_reads", inplace_reads, verify_inplace_reads)
