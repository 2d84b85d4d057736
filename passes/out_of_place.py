"""In-place methods become their out-of-place twins: ``x.add_(y)`` is computed as ``x.add(y)``.

After :mod:`~qcompiler.passes.inplace_reads` every read of ``x`` that follows ``x.add_(y)`` reads the
node's result, so nothing but the node's own result depends on the write, and the twin computes that
value (bit for bit, when every tensor involved has one dtype: see
:func:`~qcompiler.ir.inplace.out_of_place_twin`).  Written as the twin, the node is an ordinary op
for every later stage: it places, fuses, quantizes, lowers to the BPU and emits to ONNX under the
twin's name (``y.relu_()``, ``x.clamp_(0, 6)`` and ``y.transpose_(0, 1)`` ran as eager-torch
islands, which save and export refuse).  The calibration model no longer writes into a tensor that
an alias (a view) shares; the converted model never did, so the two now agree.  The node keeps its
name; in-place ops without a twin (``x.gt_(0)``, ``x.fill_(1)``) stay as they are.
"""

from __future__ import annotations

import torch.fx as fx

from qcompiler.ir.inplace import out_of_place_twin
from qcompiler.passes.base import CompileContext, Pass, PassResult


def out_of_place(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    changed = False
    for node in gm.graph.nodes:
        twin = out_of_place_twin(node)
        if twin is not None:
            node.target = twin
            changed = True
    if changed:
        gm.recompile()
    return PassResult(gm, changed)


def verify_out_of_place(gm: fx.GraphModule, ctx: CompileContext) -> None:
    left = [n.name for n in gm.graph.nodes if out_of_place_twin(n) is not None]
    assert not left, f"{left} still run in place, with an out-of-place twin"


OUT_OF_PLACE = Pass("out_of_place", out_of_place, verify_out_of_place)
