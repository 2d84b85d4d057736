"""PassManager: order, failure wrapping, verification and per-pass dumps."""

import pytest
import torch
import torch.nn as nn

from qcompiler.errors import ConfigError, PassError
from qcompiler.ir import trace
from qcompiler.march import March
from qcompiler.passes.base import CompileContext, Pass, PassManager, PassResult


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def ctx():
    return CompileContext(march=March.BAYES)


def noop(gm, ctx):
    return PassResult(gm, False)


def test_runs_in_order_and_reports_modified():
    seen = []

    def a(gm, c):
        seen.append("a")
        return PassResult(gm, False)

    def b(gm, c):
        seen.append("b")
        return PassResult(gm, True)

    pm = PassManager([Pass("a", a), Pass("b", b)])
    assert pm.run(trace(Tiny()), ctx()).modified is True
    assert seen == ["a", "b"]
    assert [(r.name, r.modified) for r in pm.records] == [("a", False), ("b", True)]


def test_internal_failure_is_wrapped_with_pass_name_and_history():
    def boom(gm, c):
        raise KeyError("x")

    with pytest.raises(PassError, match=r"pass 'boom' failed: KeyError.*passes run before it: first, second"):
        PassManager([Pass("first", noop), Pass("second", noop), Pass("boom", boom)]).run(trace(Tiny()), ctx())


def test_user_errors_keep_their_type_and_gain_a_note():
    def bad(gm, c):
        raise ConfigError("bad key")

    with pytest.raises(ConfigError) as info:
        PassManager([Pass("first", noop), Pass("bad", bad)]).run(trace(Tiny()), ctx())
    assert info.value.pass_name == "bad" and info.value.passes_before == ("first",)
    assert "passes run before it: first" in "".join(info.value.__notes__)


def test_verifier_runs_after_pass_and_can_be_disabled():
    def breaks_graph(gm, c):
        relu = [n for n in gm.graph.nodes if n.target is torch.relu][0]
        relu.args = (relu,)  # a self-loop: lint must catch it
        return PassResult(gm, True)

    with pytest.raises(PassError, match="breaks_graph"):
        PassManager([Pass("breaks_graph", breaks_graph)]).run(trace(Tiny()), ctx())

    def invariant(gm, c):
        raise AssertionError("invariant X violated")

    with pytest.raises(PassError, match="invariant X violated"):
        PassManager([Pass("p", noop, invariant)]).run(trace(Tiny()), ctx())
    PassManager([Pass("p", noop, invariant)], verify=False).run(trace(Tiny()), ctx())


def test_non_passresult_is_an_error():
    with pytest.raises(PassError, match="returned Tiny, expected PassResult"):
        PassManager([Pass("wrong", lambda gm, c: gm)]).run(trace(Tiny()), ctx())


def test_dump_after_each_pass(tmp_path):
    PassManager([Pass("one", noop), Pass("two", noop)], dump_dir=tmp_path / "d").run(trace(Tiny()), ctx())
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["00_one.txt", "01_two.txt"]
    text = (tmp_path / "d" / "00_one.txt").read_text()
    assert "conv = self.conv(x)" in text and "relu = torch.relu(conv)" in text


def test_a_lasting_invariant_is_checked_after_every_later_pass():
    """INPLACE_READS is lasting: a later pass that reads a value after its in-place change is named."""
    from qcompiler.passes.inplace_reads import INPLACE_READS

    class MulThenRead(nn.Module):
        def forward(self, x):
            a = torch.relu(x)
            a.mul_(2.0)
            return torch.atan(a)

    def read_the_old_value(gm, c):  # undoes the rewiring: atan reads relu, after mul_ changed it
        relu, mul_, atan = (n for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method")
        atan.replace_input_with(mul_, relu)
        return PassResult(gm, True)

    passes = [INPLACE_READS, Pass("harmless", noop), Pass("read_the_old_value", read_the_old_value)]
    with pytest.raises(PassError, match=r"pass 'read_the_old_value' failed: PassError: \['atan'\] read relu "
                                        r"after mul_ changed it in place.*passes run before it: inplace_reads, harmless"):
        PassManager(passes).run(trace(MulThenRead()), ctx())
    PassManager(passes[:2]).run(trace(MulThenRead()), ctx())  # holds after the harmless pass
