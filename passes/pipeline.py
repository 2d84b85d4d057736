"""The compiler's phases as plain lists of passes, added together in order.

Placement runs before fusion (a deviation from the first design, see
docs/design.md): fusion then never merges nodes that the march or the user's
``hybrid_dict`` put on different sides, e.g. a ReLU forced to the CPU after a
BPU conv.  Partitions are formed after stub insertion so that each stub
belongs to the BPU partition whose boundary it marks.

Each pass declares the facts it requires (``Pass.requires``: tensor metadata,
placement, ...), which the manager checks before running it; every list here
provides them in order (tests/test_contracts.py).

What does nothing at inference goes first, so that no later pass places, partitions or
emits it: ``remove_identities`` (eval-mode dropout, ``stochastic_depth``, DropPath) runs before ``inplace_reads``, since an eval dropout with ``inplace=True``
changes nothing and so is no write whose later reads need rewiring.  ``fold_constants``
follows (an eval dropout inside a parameter-only subgraph is gone by then; the values the graph
writes in place are known and left alone) and precedes ``shape_prop``, which then gives the
folded buffers' ``get_attr`` nodes their metadata like any other node's.  ``einsum`` (as
permutes, reshapes and matmul) needs the operands' shapes, so it runs after shape propagation
and the in-place passes, and before ``rewrite`` and placement, which then see only ops the
march and ONNX opset 11 have (its nodes carry their own shapes); ``attention`` (a traced
``scaled_dot_product_attention`` as matmul, softmax and matmul) follows it for the same reasons, then
``masked_softmax`` (a softmax of a -inf ``masked_fill`` as one op, so no -inf reaches a quantizer).
"""

from __future__ import annotations

from qcompiler.passes.attention import ATTENTION_AS_MATMUL
from qcompiler.passes.einsum import EINSUM_TO_MATMUL
from qcompiler.passes.fold_constants import FOLD_CONSTANTS
from qcompiler.passes.fuse import FUSE
from qcompiler.passes.inplace_reads import INPLACE_READS
from qcompiler.passes.insert_observers import INSERT_OBSERVERS
from qcompiler.passes.insert_stubs import INSERT_STUBS
from qcompiler.passes.leaf_writes import LEAF_WRITES
from qcompiler.passes.masked_softmax import MASKED_SOFTMAX
from qcompiler.passes.out_of_place import OUT_OF_PLACE
from qcompiler.passes.partition import PARTITION
from qcompiler.passes.place import PLACE
from qcompiler.passes.remove_identities import REMOVE_IDENTITIES
from qcompiler.passes.rewrite import REWRITE
from qcompiler.passes.shape_prop import SHAPE_PROP
from qcompiler.passes.view_writes import VIEW_WRITES

ANALYZE = [REMOVE_IDENTITIES, INPLACE_READS, SHAPE_PROP, LEAF_WRITES, VIEW_WRITES, OUT_OF_PLACE, FOLD_CONSTANTS,
           EINSUM_TO_MATMUL, ATTENTION_AS_MATMUL, MASKED_SOFTMAX, REWRITE, PLACE]
OPTIMIZE = [FUSE]
SPLIT = [INSERT_STUBS, PARTITION]

# trace -> eval-mode identities removed -> reads after in-place ops rewired -> parameter-only subgraphs folded ->
# shapes -> opaque writers given copies -> views re-made after writes, writes through views written back ->
# in-place twins out of place -> einsum as matmul -> attention as matmul / softmax -> rewrites -> placement ->
# fusion -> boundary stubs -> partitions
PARTITION_PIPELINE = ANALYZE + OPTIMIZE + SPLIT
# ... and observers / fake quants on the BPU ops, before grouping
PREPARE_PIPELINE = ANALYZE + OPTIMIZE + [INSERT_STUBS, INSERT_OBSERVERS, PARTITION]
# a prepared model given new qconfigs (calibration -> QAT)
REQUANTIZE_PIPELINE = [INSERT_OBSERVERS, PARTITION]

__all__ = ["ANALYZE", "OPTIMIZE", "SPLIT", "PARTITION_PIPELINE", "PREPARE_PIPELINE", "REQUANTIZE_PIPELINE"]
