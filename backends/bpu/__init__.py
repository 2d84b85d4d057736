"""The BPU backend: per-march op-support tables (data) and their constraint predicates.

The tables (:mod:`.support`, :mod:`.bernoulli2`, :mod:`.bayes`, :mod:`.nash`) are the layer the placement
pass reads; the lowering, the program format and the simulator (:mod:`.lower`,
:mod:`.program`, :mod:`.simulator`) sit above the passes and are imported by their users.
"""

from qcompiler.backends.bpu import bayes, bernoulli2, nash
from qcompiler.backends.bpu.support import OpRule, OpTable
from qcompiler.march import March, MarchLike, to_march

TABLES: dict[March, OpTable] = {March.BERNOULLI2: bernoulli2.TABLE, March.BAYES: bayes.TABLE, March.NASH: nash.TABLE}


def op_table(march: MarchLike) -> OpTable:
    """The op-support table of a march."""
    return TABLES[to_march(march)]


__all__ = ["OpRule", "OpTable", "TABLES", "op_table"]
