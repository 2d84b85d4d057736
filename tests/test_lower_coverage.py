"""Every op of each march table has a BPU lowering rule, and every op kind a rule emits has a reference kernel.

A march-table op convert turns into another op's module (``lowering.CONVERTED_AS``) is covered by that op's
rule; so is every op convert has a rule for. The check itself is tested: it reports a removed rule and a
removed kernel, and the driver rejects a rule that emits a kind it did not declare (the declarations are
what the kernel check reads). Also the registry's lookup and duplicates.
"""

from __future__ import annotations

import pytest
import torch
from test_bpu_reference import Tiny

from qcompiler.backends.bpu import TABLES
from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.lowering import CONVERTED_AS, registry
from qcompiler.backends.bpu.sim.registry import REFERENCE
from qcompiler.backends.bpu.support import OpTable
from qcompiler.errors import InternalError, UnsupportedOpError
from qcompiler.march import March
from qcompiler.nn import quantized as qnn
from qcompiler.passes.convert_rules.registry import converted_ops


# the BPU op kinds the simulator has a reference kernel for
REFERENCE_KINDS = frozenset(REFERENCE)


def coverage_gaps(table: OpTable, reference: frozenset[str]) -> list[str]:
    """What the march table runs that does not lower, and the emitted kinds no reference kernel runs."""
    lowered = registry.lowered_ops()
    gaps = []
    for op in table.rules:
        target, _why = CONVERTED_AS.get(op, (op, ""))
        if target not in lowered:
            via = f" for {target}, which convert makes of it" if target != op else ""
            gaps.append(f"{op}: no lowering rule{via}")
    return gaps + [f"{kind}: no reference kernel" for kind in sorted(registry.emitted_kinds() - reference)]


@pytest.mark.parametrize("march", list(TABLES), ids=lambda m: m.value)
def test_every_march_op_lowers_to_kinds_with_reference_kernels(march):
    assert coverage_gaps(TABLES[march], REFERENCE_KINDS) == []


def test_every_op_convert_converts_lowers():
    assert sorted(converted_ops() - registry.lowered_ops() - CONVERTED_AS.keys()) == []


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
    assert coverage_gaps(TABLES[March.BAYES], REFERENCE_KINDS) == gaps


def test_the_check_fails_when_a_kernel_is_missing():
    assert coverage_gaps(TABLES[March.BAYES], REFERENCE_KINDS - {"resize_bilinear"}) == [
        "resize_bilinear: no reference kernel"]


def _relu_graph():
    t = Tiny()
    return t.build(t.same_scale("relu", t.rand_input((1, 2, 3, 3), 0.1), function=torch.relu, name="r"))


def test_a_rule_emitting_an_undeclared_kind_is_rejected(monkeypatch):
    key = (qnn.QuantizedSameScale, "relu")
    monkeypatch.setitem(registry._RULES, key, registry.Rule(registry._RULES[key].fn, frozenset({"relu6"})))
    with pytest.raises(InternalError, match=r"node 'r' in BPU partition bpu0: .*relu emitted a 'relu', which it "
                                            r"does not declare"):
        lower_partition(_relu_graph(), "bpu0")


def test_a_missing_rule_names_the_node_and_the_module(monkeypatch):
    monkeypatch.delitem(registry._RULES, (qnn.QuantizedSameScale, "relu"))
    with pytest.raises(UnsupportedOpError, match=r"node 'r' \(op 'relu', QuantizedSameScale\) in BPU partition "
                                                 r"bpu0: no BPU op kind for QuantizedSameScale 'relu'"):
        lower_partition(_relu_graph(), "bpu0")


def test_a_second_rule_for_a_module_and_op_is_fatal(monkeypatch):
    monkeypatch.setattr(registry, "_RULES", {})
    register = registry.lowers(qnn.QuantizedCat, "cat", emits=("cat",))
    register(lambda ctx: None)
    with pytest.raises(InternalError, match=r"two BPU lowering rules for QuantizedCat 'cat': .*<lambda> and "
                                            r".*<lambda>; keep one"):
        register(lambda ctx: None)
    assert registry.lowered_ops() == {"cat"} and registry.emitted_kinds() == {"cat"}
