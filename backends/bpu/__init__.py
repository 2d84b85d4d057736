"""The BPU backend: per-march op-support tables (data) and their constraint predicates."""

from qcompiler.backends.bpu.op_table import OpRule, OpTable
from qcompiler.march import March, MarchLike, to_march


def op_table(march: MarchLike) -> OpTable:
    """The op-support table of a march."""
    from qcompiler.backends.bpu import bayes, bernoulli2

    return {March.BERNOULLI2: bernoulli2.TABLE, March.BAYES: bayes.TABLE}[to_march(march)]


__all__ = ["OpRule", "OpTable", "op_table"]
