"""Convert-rule coverage: every op a march runs on the BPU has a convert rule (or a written reason),
and the check fails when a rule goes missing; the registry's lookup and duplicates."""

from __future__ import annotations

import pytest
import torch.fx as fx

from qcompiler.backends.bpu import TABLES
from qcompiler.errors import InternalError, UnsupportedOpError
from qcompiler.march import March
from qcompiler.passes.convert_rules import registry
from qcompiler.passes.convert_rules.context import ConvertContext
from qcompiler.passes.insert_observers import SCALE_PRESERVING_OPS

# BPU ops that need no convert rule, and why: the convert pass handles them itself.
NO_RULE: dict[str, str] = {
    "quant": "a quantizer: the pass makes it a Quantize, a Requantize or nothing, from its own grid and "
             "its input's",
    "dequant": "a DeQuantStub: the pass makes it a DeQuantize, or nothing after another DeQuantStub",
    "size": "metadata: the size of a QTensor is its shape, so the node stays as it is",
}


def bpu_ops(march: March) -> frozenset[str]:
    """What can run on the BPU of ``march``: its table's ops, and the ops that keep their input's
    grid (identities, indexing, ...), which follow their producer onto the BPU; quantizers too."""
    return frozenset(TABLES[march].rules) | SCALE_PRESERVING_OPS | {"quant"}


def missing_rules(march: March) -> set[str]:
    """The BPU ops of ``march`` with no convert rule and no reason in :data:`NO_RULE`."""
    return set(bpu_ops(march) - registry.converted_ops() - NO_RULE.keys())


@pytest.mark.parametrize("march", list(TABLES), ids=lambda m: m.value)
def test_every_bpu_op_of_the_march_has_a_convert_rule(march):
    assert not missing_rules(march), f"{march.value}: BPU ops with no convert rule: {sorted(missing_rules(march))}"


def test_the_reasons_name_ops_without_a_rule():
    assert not NO_RULE.keys() & registry.converted_ops()


@pytest.mark.parametrize("march", list(TABLES), ids=lambda m: m.value)
def test_the_check_fails_when_a_rule_is_removed(march, monkeypatch):
    monkeypatch.delitem(registry._RULES, "avg_pool2d")  # restored after the test
    assert missing_rules(march) == {"avg_pool2d"}


def _context(op: str) -> ConvertContext:
    node = fx.Graph().placeholder("pool")
    return ConvertContext(node, op, None, {}, {}, out=None)


def test_a_missing_rule_names_the_node_and_the_op():
    with pytest.raises(UnsupportedOpError, match=r"node 'pool': no fixed-point lowering for BPU op 'nope' yet"):
        registry.rule_for(_context("nope"))
    assert registry.rule_for(_context("avg_pool2d")).__name__ == "avg_pool2d"


def test_a_second_rule_for_an_op_is_fatal(monkeypatch):
    monkeypatch.setattr(registry, "_RULES", {})

    def first(ctx):
        return None

    def second(ctx):
        return None

    registry.converts("foo")(first)
    with pytest.raises(InternalError, match=r"two rules for 'foo': .*first and .*second"):
        registry.converts("foo")(second)
    assert registry.converted_ops() == {"foo"}
