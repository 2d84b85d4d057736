"""In-place methods become their out-of-place twins: ``x.add_(y)`` is computed as ``x.add(y)``.

After :mod:`~qcompiler.passes.inplace_reads` every read of ``x`` that follows ``x.add_(y)`` reads the
node's result, so nothing but the node's own result depends on the write, and the twin computes that
value (bit for bit, when every tensor involved has one dtype: see
:func:`~qcompiler.ir.inplace.out_of_place_twins`).  Written as the twin, the node is an ordinary op
for every later stage: it places, fuses, quantizes, lowers to the BPU and emits to ONNX under the
twin's name (``y.relu_()``, ``x.clamp_(0, 6)`` and ``y.transpose_(0, 1)`` ran as eager-torch
islands, which save and export refuse).  The node keeps its name.

``x.copy_(src)`` and ``x.fill_(v)`` overwrite all of ``x``: their twin is ``setitem(x, ..., src)``, ``x[...] = src``
out of place (passes/view_writes writes a write into a view back into its base the same way, so a tensor built
by writes into slices of a ``torch.zeros`` becomes a chain of pure ops that passes/fold_constants can fold).

In-place ops without a twin (``x.gt_(0)``, ``x.index_put_(...)``) stay as they are, and so does one whose
written value has an alias read after it (``v = y.view(-1); y.mul_(2)``, then ``v`` read): the write
must reach ``v``, which only the in-place op does.  Shape propagation records which values share a
storage (``META_STORAGE``); where it recorded nothing, the op stays in place.  Such an op is marked
(``META_ALIASED_WRITE``): once the graph is partitioned, a value that reaches it from another partition
comes through a stub of its own, which the alias does not share, and convert_fx warns.
"""

from __future__ import annotations

import torch.fx as fx

from qcompiler.errors import PassError
from qcompiler.ir.inplace import aliased_writes, as_twin, out_of_place_twins
from qcompiler.ir.meta import META_ALIASED_WRITE
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.shape_prop import TENSOR_META


def out_of_place(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    aliased = aliased_writes(gm)  # decided on the whole graph first: rewriting breaks in-place chains
    twins = out_of_place_twins(gm, aliased)
    for node, aliases in aliased.items():  # stays in place; convert_fx warns where an alias may miss it
        node.meta[META_ALIASED_WRITE] = tuple(a.name for a in aliases) if aliases is not None else ()
    for node, twin in twins.items():
        as_twin(node, twin)
    if twins:
        gm.recompile()
    return PassResult(gm, bool(twins))


def verify_out_of_place(gm: fx.GraphModule, ctx: CompileContext) -> None:
    left = [n.name for n in out_of_place_twins(gm)]
    if left:
        raise PassError(f"{left} still run in place, with an out-of-place twin")


OUT_OF_PLACE = Pass("out_of_place", out_of_place, verify_out_of_place, requires=(TENSOR_META,))
