"""Reads after an in-place op go through the op's result.

``a.mul_(2.0)`` changes ``a``; in eager PyTorch every later read of ``a`` sees the new values.  In the
graph those reads still name ``a``, which only the calibration model (running the op in place) gets
right: once the graph is converted, BPU stubs hand each consumer its own dequantized tensor and the
lowered op computes a new value, so a later ``torch.atan(a)`` read the old ``a`` (and an in-place op
whose result nobody used was dropped as dead code), a wrong answer with no error.

This pass rewires every read of ``a`` that comes after the in-place node ``n`` (in graph order) to
``n`` itself: the in-place op's result *is* the changed ``a``, so the calibration model computes the
same values as before, and every later stage sees the dependence as a data edge.  In-place nodes are
those :func:`mutated_input` names: ``x.op_()`` methods, ``inplace=True`` functions and modules, and
``torch`` functions ending in ``_``.  Aliases through views (``a[0].mul_(2)`` also changes ``a``) are
not followed.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from qcompiler.passes.base import CompileContext, Pass, PassResult


def mutated_input(node: fx.Node, modules: dict) -> Optional[fx.Node]:
    """The value ``node`` changes in place (its first argument), or None."""
    first = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(first, fx.Node):
        return None
    if node.kwargs.get("inplace") is True:
        return first
    if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
        return first
    if node.op == "call_module" and getattr(modules.get(node.target), "inplace", False) is True:
        return first
    if node.op == "call_function" and getattr(node.target, "__name__", "").endswith("_") \
            and not getattr(node.target, "__name__", "").endswith("__"):
        return first
    return None


def inplace_reads(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modules = dict(gm.named_modules())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        value = mutated_input(node, modules)
        if value is None:
            continue
        for user in list(value.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(value, node)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


def verify_inplace_reads(gm: fx.GraphModule, ctx: CompileContext) -> None:
    modules = dict(gm.named_modules())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        value = mutated_input(node, modules)
        if value is not None:
            late = [u.name for u in value.users if u is not node and order[u] > order[node]]
            assert not late, f"{late} read {value.name} after {node.name} changed it in place"


INPLACE_READS = Pass("inplace_reads", inplace_reads, verify_inplace_reads)
