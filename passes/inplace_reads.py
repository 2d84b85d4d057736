"""Reads after an in-place op go through the op's result.

``a.mul_(2.0)`` changes ``a``; in eager PyTorch every later read of ``a`` sees the new values.  In the
graph those reads still name ``a``, which only the calibration model (running the op in place) gets
right: once the graph is converted, BPU stubs hand each consumer its own dequantized tensor and the
lowered op computes a new value, so a later ``torch.atan(a)`` read the old ``a`` (and an in-place op
whose result nobody used was dropped as dead code), a wrong answer with no error.

This pass rewires every read of ``a`` that comes after the in-place node ``n`` (in graph order) to
``n`` itself: the in-place op's result *is* the changed ``a``, so the calibration model computes the
same values as before, and every later stage sees the dependence as a data edge.  In-place nodes are
those :func:`~qcompiler.ir.inplace.mutated_input` names: ``x.op_()`` methods, ``torch`` functions
ending in ``_``, and ``inplace=True`` in torch.nn's functions and activation / dropout modules.  Aliases through views
(``a[0].mul_(2)`` also changes ``a``) are not followed.
"""

from __future__ import annotations

import torch.fx as fx

from qcompiler.errors import PassError
from qcompiler.ir.inplace import mutated_input
from qcompiler.passes.base import CompileContext, Pass, PassResult


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
            if late:
                raise PassError(f"{late} read {value.name} after {node.name} changed it in place")


# lasting: a later pass that moved a read of ``a`` after ``a.mul_()`` (as rewrite's pad fold once did) would
# bring the wrong answer back, so every pass after this one is checked for it
INPLACE_READS = Pass("inplace_reads", inplace_reads, verify_inplace_reads, lasting=True)
