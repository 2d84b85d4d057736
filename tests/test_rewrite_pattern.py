"""The pattern language (qcompiler/ir/pattern.py) and the worklist that drives the rewrite rows
(passes/rewrite.py): bindings by name, the argument reader, linear work on a chain of rewrites, and
the same graphs as the driver it replaced, which restarted from the top after every rewrite."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_rewrite import (X, ChangedBetween, FlattenBySize, PadConv, PadPool, SamePadded, SizeArithmetic,
                          SqueezeExcite, TwoUsers, Unsqueeze)

from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_REWRITE, META_TENSOR
from qcompiler.ir.pattern import AnyOf, Const, Op, Rewriter, Var, arguments, one_of
from qcompiler.march import March
from qcompiler.passes import rewrite as rw
from qcompiler.passes.base import CompileContext


def _traced(model, x=X):
    gm = trace(copy.deepcopy(model).eval())
    propagate_shapes(gm, (x,))
    return gm, dict(gm.named_modules())


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


class Pads(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 1)), F.pad(x, (0, 1, 0, 1), "reflect"), x.view(2, -1), x.view((2, -1)), x.size()[1]


# ------------------------------------------------------------------ patterns and bindings


def test_an_op_pattern_binds_its_arguments_by_name_defaults_filled_in():
    gm, modules = _traced(Pads())
    zero_pad = Op("pad", {"input": Var("x"), "pad": Const(lambda p: len(p) == 2, "pads"),
                          "mode": Const(one_of("constant")), "value": Const(one_of(None))}, name="pad")
    pad, x = _node(gm, "pad"), _node(gm, "x")
    assert zero_pad.match(pad, modules) == {"x": x, "pads": (1, 1), "pad": pad}
    assert zero_pad.match(_node(gm, "pad_1"), modules) is None  # reflect; and four sides
    assert zero_pad.match(_node(gm, "view"), modules) is None  # another op
    assert Op("pad", {"pad": Const(one_of((1, 1)))}).match(pad, modules) == {}  # nothing named, nothing bound


def test_a_constant_pattern_refuses_a_node_and_var_takes_both():
    gm, modules = _traced(Pads())
    pad = _node(gm, "pad")
    assert Op("pad", {"input": Const(lambda v: True)}).match(pad, modules) is None
    assert Op("pad", {"input": Var("v"), "pad": Var("p")}).match(pad, modules) == {"v": _node(gm, "x"), "p": (1, 1)}
    assert Op("pad", {"input": Var("v", where=lambda v: v.meta[META_TENSOR].shape == (1,))}).match(pad, modules) is None


def test_a_name_bound_twice_must_bind_one_value():
    gm, modules = _traced(Pads())
    pad = _node(gm, "pad")
    assert Op("pad", {"input": Var("a"), "pad": Var("a")}).match(pad, modules) is None
    assert Op("pad", {"input": Var("a")}, name="a").match(pad, modules) is None


def test_sub_patterns_match_the_producers_and_the_first_of_several_wins():
    gm, modules = _traced(Pads())
    size_dim = Op("getitem", {"input": Op("size", {"input": Var("t"), "dim": Const(one_of(None))}),
                              "index": Const(lambda d: isinstance(d, int), "d")})
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert size_dim.match(getitem, modules) == {"t": _node(gm, "x"), "d": 1}
    either = AnyOf((Op("pad", {"input": Var("t")}), size_dim))
    assert either.ops == {"pad", "getitem"}
    assert either.match(getitem, modules) == {"t": _node(gm, "x"), "d": 1}
    assert either.match(_node(gm, "pad"), modules) == {"t": _node(gm, "x")}  # the first alternative's bindings only


def test_a_module_pattern_matches_the_called_module():
    gm, modules = _traced(nn.Sequential(nn.Conv2d(3, 3, 3, padding="same"), nn.Conv2d(3, 3, 1)))
    same = Op("conv2d", name="node", module=Var("conv", lambda m: m.padding == "same"))
    first, second = (n for n in gm.graph.nodes if n.op == "call_module")
    assert same.match(first, modules) == {"conv": gm.get_submodule("0"), "node": first}
    assert same.match(second, modules) is None


def test_the_argument_reader_reads_every_spelling_by_name():
    gm, modules = _traced(Pads())
    assert dict(arguments(_node(gm, "pad"), modules)) == {"input": _node(gm, "x"), "pad": (1, 1),
                                                          "mode": "constant", "value": None}
    assert arguments(_node(gm, "view"), modules)["size"] == (2, -1)  # x.view(2, -1)
    assert arguments(_node(gm, "view_1"), modules)["size"] == (2, -1)  # x.view((2, -1))
    view = _node(gm, "view")
    view.kwargs = {"bogus": 3}  # no such call: it binds to nothing, and a pattern declines it
    assert arguments(view, modules) is None
    assert Op("reshape", {"size": Var()}).match(view, modules) is None
    assert arguments(_node(gm, "x"), modules) is None  # a placeholder calls nothing


# ------------------------------------------------------------------ the worklist


def test_the_worklist_visits_each_node_once_then_the_touched_ones():
    gm, _ = _traced(Pads())
    rewriter = Rewriter(gm)
    first = [rewriter.next() for _ in range(3)]
    assert first == list(gm.graph.nodes)[:3]
    pad = _node(gm, "pad")
    rewriter.touched(pad)  # visited: queued again after the rest, with its input (its user still waits)
    rest = []
    while (n := rewriter.next()) is not None:
        rest.append(n)
    assert rest == list(gm.graph.nodes)[3:] + [pad, _node(gm, "x")]


def test_the_worklist_skips_erased_nodes():
    class Dead(nn.Module):
        def forward(self, x):
            torch.relu(x)  # read by nothing
            return x + 1

    gm, _ = _traced(Dead())
    rewriter = Rewriter(gm)
    relu = _node(gm, "relu")
    rewriter.erase(relu)
    seen = []
    while (n := rewriter.next()) is not None:
        seen.append(n.name)
    assert seen == ["x", "add", "output"]


# ------------------------------------------------------------------ the pass: linear work, the old graphs


class PadConvChain(nn.Module):
    """``n`` blocks of a zero F.pad before a conv: each fold is one rewrite."""

    def __init__(self, n: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, 3) for _ in range(n))

    def forward(self, x):
        for conv in self.convs:
            x = conv(F.pad(x, (1, 1, 1, 1)))
        return x


def _rewrite_restarting(gm, ctx):
    """The driver the worklist replaced: rewrite the first match from the top of the graph, then start again."""
    rewriter = Rewriter(gm)
    while any(row.apply(n, gm, ctx, rewriter) for n in gm.graph.nodes for row in rw.rows_for(n, rewriter.modules)):
        pass
    gm.graph.lint()
    gm.recompile()


def _attempts(monkeypatch, driver, model, x=X) -> int:
    """How many times ``driver`` tries a row on a node of ``model``'s graph."""
    count = [0]
    apply = rw.Rewrite.apply

    def counted(self, *args):
        count[0] += 1
        return apply(self, *args)

    gm, _ = _traced(model, x)
    with monkeypatch.context() as m:
        m.setattr(rw.Rewrite, "apply", counted)
        driver(gm, CompileContext(march=March.BAYES, example_inputs=(x,)))
    assert not any(n.target is F.pad for n in gm.graph.nodes)  # every block folded
    return count[0]


def test_a_chain_of_rewrites_tries_rows_a_number_of_times_linear_in_the_graph(monkeypatch):
    attempts = {n: _attempts(monkeypatch, rw.rewrite, PadConvChain(n)) for n in (16, 32, 64)}
    assert attempts[64] - attempts[32] == 2 * (attempts[32] - attempts[16])  # the same work per block
    assert attempts[64] <= 3 * 64  # each pad and conv once; the conv before a folded pad again (its users changed)
    # the driver the worklist replaced: every rewrite restarted from the top, quadratic in the blocks
    assert _attempts(monkeypatch, _rewrite_restarting, PadConvChain(32)) > 32 * 32 // 2


class Mixed(nn.Module):
    """Every row, some enabling another: a "same" conv after a zero pad, pads over pads, sizes, Nones."""

    def __init__(self):
        super().__init__()
        self.same, self.conv = nn.Conv2d(3, 3, 3, padding="same"), nn.Conv2d(3, 3, 3)
        self.pool = nn.AvgPool2d(3, 1)

    def forward(self, x):
        y = self.same(F.pad(x, (1, 1, 1, 1)))[:, :, 1:-1, 1:-1]
        y = self.pool(F.pad(F.pad(self.conv(F.pad(y, (0, 1, 0, 1))), (1, 0, 1, 0)), (0, 1, 0, 1)))
        b, c, _, _ = y.size()
        return y.view(b, -1)[:, None], y[..., None, :]


MODELS = {
    "pad-conv": (PadConv(), X), "tf-same": (PadConv(pads=(0, 1, 0, 1), conv_padding=0), X),
    "pad-pool": (PadPool(nn.AvgPool2d(3, 1)), X), "max-pool": (PadPool(nn.MaxPool2d(3, 1)), X),
    "two-users": (TwoUsers(), X), "changed-between": (ChangedBetween(), X), "unsqueeze": (Unsqueeze(), X),
    "same-padded": (SamePadded(), torch.rand(1, 3, 32, 32)), "flatten": (FlattenBySize(), torch.rand(2, 3, 6, 6)),
    "squeeze-excite": (SqueezeExcite(), torch.rand(2, 3, 6, 6)),
    "size-arithmetic": (SizeArithmetic(False), torch.rand(2, 4, 5, 6)),
    "batch-arithmetic": (SizeArithmetic(True), torch.rand(2, 4, 5, 6)),
    "chain": (PadConvChain(5), X), "mixed": (Mixed(), X),
}


def _graph(gm) -> tuple:
    """What a rewrite decides: the code, every module, each node's note and shape."""
    return (gm.code, [(name, repr(m), getattr(m, "padding", None)) for name, m in gm.named_modules()],
            [(n.name, n.meta.get(META_REWRITE), n.meta.get(META_TENSOR)) for n in gm.graph.nodes])


@pytest.mark.parametrize("name", MODELS)
def test_the_worklist_gives_the_graph_the_restarting_driver_gave(name):
    model, x = MODELS[name]
    graphs = []
    for driver in (rw.rewrite, rw.rewrite, _rewrite_restarting):  # twice: the same graph in, the same graph out
        gm, _ = _traced(model, x)
        ctx = CompileContext(march=March.BAYES, example_inputs=(x,))
        driver(gm, ctx)
        rw.verify_rewritten(gm, ctx)
        graphs.append(_graph(gm))
    assert graphs[0] == graphs[1] == graphs[2]
