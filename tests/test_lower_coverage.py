"""Every op of each march table has a BPU lowering rule, and every op kind a rule emits has a reference kernel.

A march-table op convert turns into another op's module (``lowering.CONVERTED_AS``) is covered by that op's
rule. The check itself is tested: it reports a removed rule and a removed kernel, and the driver rejects a
rule that emits a kind it did not declare (the declarations are what the kernel check reads).
"""

from __future__ import annotations

import pytest
import torch
from test_bpu_reference import Tiny

from qcompiler.backends.bpu import bayes, bernoulli2
from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.lowering import CONVERTED_AS, registry
from qcompiler.backends.bpu.support import OpTable
from qcompiler.errors import UnsupportedOpError
from qcompiler.nn import quantized as qnn

MARCH_TABLES = {"bayes": bayes.TABLE, "bernoulli2": bernoulli2.TABLE}


def reference_kinds() -> frozenset[str]:
    """The BPU op kinds the simulator has a reference kernel for."""
    from qcompiler.backends.bpu.simulator import REFERENCE  # the simulator's kernels load only for this test
    return frozenset(REFERENCE)


def coverage_gaps(table: OpTable, reference: frozenset[str]) -> list[str]:
    """What the march table runs that does not lower, and the emitted kinds no reference kernel runs."""
    lowered = registry.lowered_ops()
    gaps = []
    for op in table.rules:
        target, _why = CONVERTED_AS.get(op, (op, ""))
        if target not in lowered:
            gaps.append(f"{op}: no lowering rule" + (f" for {target}, which convert makes of it" if target != op
                                                     else ""))
    return gaps + [f"{kind}: no reference kernel" for kind in sorted(registry.emitted_kinds() - reference)]


@pytest.mark.parametrize("march", MARCH_TABLES)
def test_every_march_op_lowers_to_kinds_with_reference_kernels(march):
    assert coverage_gaps(MARCH_TABLES[march], reference_kinds()) == []


def test_converted_as_reasons_are_written():
    assert all(why for _, why in CONVERTED_AS.values())


@pytest.mark.parametrize("key,gaps", [
    ((qnn.QuantizedCat, "cat"), ["cat: no lowering rule"]),
    ((qnn.QuantizedAvgPool, "global_avg_pool"),
     ["adaptive_avg_pool2d: no lowering rule for global_avg_pool, which convert makes of it",
      "mean: no lowering rule for global_avg_pool, which convert makes of it"]),
])
def test_the_check_fails_when_a_rule_is_missing(monkeypatch, key, gaps):
    monkeypatch.delitem(registry._RULES, key)
    assert coverage_gaps(bayes.TABLE, reference_kinds()) == gaps


def test_the_check_fails_when_a_kernel_is_missing():
    assert coverage_gaps(bayes.TABLE, reference_kinds() - {"resize_bilinear"}) == [
        "resize_bilinear: no reference kernel"]


def test_a_rule_emitting_an_undeclared_kind_is_rejected(monkeypatch):
    key = (qnn.QuantizedSameScale, "relu")
    rule = registry._RULES[key]
    monkeypatch.setitem(registry._RULES, key, registry.Rule(rule.fn, frozenset({"relu6"})))
    t = Tiny()
    gm = t.build(t.same_scale("relu", t.rand_input((1, 2, 3, 3), 0.1), function=torch.relu, name="r"))
    with pytest.raises(UnsupportedOpError, match=r"node 'r' .*: .*relu emitted a 'relu', which it does not declare"):
        lower_partition(gm, "bpu0")
