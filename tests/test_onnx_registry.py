"""The ONNX rule registry: opset selection, fatal duplicates, table-driven families, coverage."""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.backends.onnx import registry
from qcompiler.backends.onnx.emitter import emit_graph
from qcompiler.backends.onnx.rules import FAMILIES, NOT_EMITTED, elementwise
from qcompiler.errors import UnsupportedOpError
from qcompiler.ir import ops


@pytest.fixture
def scratch(monkeypatch):
    """Empty registry tables for one test (the real ones are restored after)."""
    monkeypatch.setattr(registry, "_OP_RULES", {})
    monkeypatch.setattr(registry, "_MODULE_RULES", {})


def _rule(tag):
    def rule(ctx):
        return tag
    rule.__qualname__ = f"rule_{tag}"
    return rule


def test_highest_opset_not_above_the_target_wins(scratch):
    registry.register("foo", _rule("v9"), since=9)
    registry.register("foo", _rule("v11"), since=11)
    registry.register("foo", _rule("v13"), since=13)
    assert registry.op_rule("foo", 11)(None) == "v11"
    assert registry.op_rule("foo", 12)(None) == "v11"
    assert registry.op_rule("foo", 10)(None) == "v9"
    assert registry.op_rule("foo", 13)(None) == "v13"
    assert registry.op_rule("foo", 8) is None  # no rule that old
    assert registry.op_rule("bar", 11) is None
    assert registry.emitted_ops(8) == frozenset() and registry.emitted_ops(11) == {"foo"}


def test_a_duplicate_registration_is_fatal(scratch):
    registry.emits("foo", since=11)(_rule("a"))
    with pytest.raises(registry.DuplicateRuleError, match=r"two ONNX emit rules for 'foo' at opset 11: .*rule_a"):
        registry.emits("foo", since=11)(_rule("b"))
    registry.emits("foo", since=12)(_rule("b"))  # a newer opset is not a duplicate
    registry.emits_module(nn.ReLU)(_rule("m"))
    with pytest.raises(registry.DuplicateRuleError):
        registry.emits_module(nn.ReLU)(_rule("m2"))


def test_since_must_be_an_opset(scratch):
    with pytest.raises(ValueError, match="since must be an opset number"):
        registry.register("foo", _rule("a"), since="11")


def test_module_rules_win_and_follow_the_mro(scratch):
    class MyReLU(nn.ReLU):
        pass

    registry.register("relu", _rule("op"))
    registry.emits_module(nn.ReLU)(_rule("module"))
    assert registry.rule_for(MyReLU(), "relu")(None) == "module"
    assert registry.rule_for(None, "relu")(None) == "op"
    assert registry.rule_for(nn.Sigmoid(), "relu")(None) == "op"  # no module rule: the op's


def test_families_register_their_table_rows():
    for op in [*elementwise.UNARY, *elementwise.BINARY, *elementwise.COMPARE]:
        assert registry.op_rule(op) is not None, op
    assert len(FAMILIES) == len(set(FAMILIES)) >= 9


def test_every_canonical_op_is_emitted_or_says_why():
    canonical = set(ops.MODULE_OPS.values()) | set(ops.FUNCTION_OPS.values()) | set(ops.METHOD_OPS.values())
    canonical |= {"relu", "relu6", "clamp"}  # clamp spellings (ops.clamp_op / ops.emit_op)
    missing = canonical - registry.emitted_ops() - set(NOT_EMITTED)
    assert not missing, f"canonical ops with neither an ONNX rule nor a NOT_EMITTED reason: {sorted(missing)}"
    stale = set(NOT_EMITTED) & registry.emitted_ops()
    assert not stale, f"NOT_EMITTED lists ops that have a rule now: {sorted(stale)}"
    assert set(NOT_EMITTED) <= canonical


class _Gru(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 3)

    def forward(self, x):
        return self.gru(x)[0]


def test_a_not_emitted_op_says_why(monkeypatch):
    """An op without a rule fails with its NOT_EMITTED reason (GRU stands in for whichever op is
    listed there: its rule is taken out of the registry for this test)."""
    monkeypatch.setattr(registry, "_OP_RULES", {op: v for op, v in registry._OP_RULES.items() if op != "gru"})
    monkeypatch.setitem(NOT_EMITTED, "gru", "GRU is not emitted yet (a reason)")
    gm = qcompiler.partition(_Gru(), (torch.rand(5, 2, 4),), march="bayes")
    with pytest.raises(UnsupportedOpError, match=r"cannot emit node 'gru' \(GRU, op 'gru'\).*GRU is not emitted yet"):
        emit_graph(gm)
    monkeypatch.undo()
    emit_graph(gm)  # with its rule back, GRU emits


class _Clamps(nn.Module):
    def __init__(self):
        super().__init__()
        self.ht = nn.Hardtanh(-0.3, 0.7)

    def forward(self, x):
        return F.hardtanh(x, -0.5, 0.25) + F.hardtanh(x) + x.clamp_min(0.1) + self.ht(x)


def test_every_clamp_spelling_emits_its_bounds():
    """Clamps that are no ReLU have no canonical op (they place on CPU); the emitter computes them as "clamp"."""
    m = _Clamps().eval()
    x = torch.linspace(-2, 2, 40).reshape(2, 20)
    gm = qcompiler.partition(m, (x,), march="bayes")
    assert all(n.meta.get("qc_op") is None for n in gm.graph.nodes if n.op != "placeholder" and
               ops.is_clamp(n, dict(gm.named_modules())))
    model = emit_graph(gm)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert torch.equal(torch.from_numpy(got), m(x))
    assert [n.op_type for n in model.graph.node].count("Clip") == 4
