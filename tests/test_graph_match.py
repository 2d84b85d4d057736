"""The structural graph comparison golden tests use (tests/graph_match.py): what it tells apart."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_match import assert_same_graph, meta, traced
from qcompiler.ir.tracer import trace


class ConvAdd(nn.Module):
    """conv -> relu, plus the input scaled by a constant: modules, functions, methods, constants."""

    def __init__(self, kernel=3, scale=2.0, act=F.relu):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, kernel, padding=kernel // 2)
        self.scale, self.act = scale, act

    def forward(self, x):
        return self.act(self.conv(x)) + x.mul(self.scale)


def _fails(actual, expected, match):
    with pytest.raises(AssertionError, match=match):
        assert_same_graph(actual, expected)


def test_the_same_model_matches_and_renamed_nodes_still_match():
    gm = trace(ConvAdd())
    assert_same_graph(gm, ConvAdd())
    for i, node in enumerate(gm.graph.nodes):
        node.name = f"n{i}"
    assert_same_graph(gm, ConvAdd())


def test_a_changed_target_fails_naming_the_node():
    _fails(trace(ConvAdd(act=torch.sigmoid)), ConvAdd(), r"at node 2 \(actual 'sigmoid', expected 'relu'\) in target")
    _fails(trace(ConvAdd(kernel=1)), ConvAdd(), r"at node 1 \(actual 'conv', expected 'conv'\) in target")
    gm = trace(ConvAdd())
    next(n for n in gm.graph.nodes if n.op == "call_method").target = "div"
    _fails(gm, ConvAdd(), r"at node 3 \(actual 'mul', expected 'mul'\) in target:\n"
                          r"  target: actual 'div'\n +expected 'mul'")


def test_a_changed_constant_fails():
    _fails(trace(ConvAdd(scale=3.0)), ConvAdd(), r"at node 3 .* in args")
    _fails(trace(ConvAdd(scale=2)), ConvAdd(), r"at node 3 .* in args")  # 2 is not 2.0


def test_a_swapped_argument_fails():
    gm = trace(ConvAdd())
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    add.args = add.args[::-1]
    _fails(gm, ConvAdd(), r"at node 4 \(actual 'add', expected 'add'\) in args")


def test_an_extra_or_a_missing_node_fails_where_it_is():
    gm = trace(ConvAdd())
    conv = next(n for n in gm.graph.nodes if n.op == "call_module")
    with gm.graph.inserting_after(conv):
        extra = gm.graph.call_function(torch.relu, (conv,))
    conv.replace_all_uses_with(extra, delete_user_cb=lambda user: user is not extra)
    _fails(gm, ConvAdd(), r"at node 2 .* in target, kwargs:\n"
                          r"  target: actual torch.relu\n +expected torch.nn.functional.relu")
    gm = trace(ConvAdd())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.relu, (out.args[0],))  # unused
    _fails(gm, ConvAdd(), r"at node 5 .* in op, target:\n  op: actual 'call_function'\n +expected 'output'")
    _fails(trace(ConvAdd()), gm, r"at node 5 .* in op, target:\n  op: actual 'output'")


def test_a_shared_module_is_told_from_two_equal_ones():
    class Twice(nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.a = nn.Identity()
            self.b = self.a if shared else nn.Identity()

        def forward(self, x):
            return self.b(self.a(x))

    assert_same_graph(trace(Twice(True)), Twice(True))
    _fails(trace(Twice(True)), Twice(False), r"at node 2 .* in target")


def test_stated_meta_is_compared_on_every_node():
    class Expected(ConvAdd):
        def __init__(self, part):
            super().__init__()
            self.part = part

        def forward(self, x):
            return meta(F.relu(meta(self.conv(x), partition="bpu0")), partition=self.part) + x.mul(2.0)

    gm = trace(ConvAdd())
    _fails(gm, Expected("bpu0"), r"at node 1 .* in meta qc_partition:\n  meta qc_partition: actual None")
    for node, part in zip(gm.graph.nodes, (None, "bpu0", "bpu0")):
        node.meta["qc_partition"] = part
    assert_same_graph(gm, Expected("bpu0"))
    _fails(gm, Expected("cpu0"), r"at node 2 \(actual 'relu', expected 'relu'\) in meta qc_partition")


def test_a_function_states_a_graph_of_functions_and_methods():
    def expected(x, y):
        return torch.cat([x.relu(), y], 1).sum(dim=(2, 3), keepdim=True)

    def swapped(x, y):
        return torch.cat([y, x.relu()], 1).sum(dim=(2, 3), keepdim=True)

    def keepdim(x, y):
        return torch.cat([x.relu(), y], 1).sum(dim=(2, 3), keepdim=False)

    assert_same_graph(traced(expected), expected)
    _fails(traced(swapped), expected, r"at node 3 \(actual 'cat', expected 'cat'\) in args")
    _fails(traced(keepdim), expected, r"at node 4 \(actual 'sum_1', expected 'sum_1'\) in kwargs")
