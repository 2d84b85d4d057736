"""passes/rewrite.py rows ``select_as_index`` and ``split_as_narrow``: a select (transformers' class-token
read-out, as torch.export writes ``hidden[:, 0]``) and a split read piece by piece (GPT-2's
``q, k, v = x.split(d, 2)``) said as the constant index / narrow that nash runs; the same values."""

import operator

import pytest
import torch
import torch.nn as nn

from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.place import place
from qcompiler.passes.rewrite import rewrite

X = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(0))


class Then(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc, self.fn = nn.Linear(12, 12), fn

    def forward(self, x):
        return self.fn(self.fc(x))


def _rewritten(fn, march="nash"):
    model = Then(fn).eval()
    gm = trace(model)
    propagate_shapes(gm, (X,))
    ctx = CompileContext(march=March(march), example_inputs=(X,))
    gm = rewrite(gm, ctx).gm
    place(gm, ctx)
    calls = [(n.target, n.meta.get(META_PLACEMENT)) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    with torch.no_grad():
        assert torch.equal(gm(X), model(X))  # exact: the same values moved
    return calls


@pytest.mark.parametrize("fn", [lambda y: torch.select(y, 1, 0), lambda y: y.select(-1, 3), lambda y: y.select(2, -1)])
def test_select_is_a_constant_index_on_the_bpu(fn):
    calls = _rewritten(fn)
    assert (operator.getitem, "bpu") in calls and torch.select not in [t for t, _ in calls]


@pytest.mark.parametrize("fn, pieces", [
    (lambda y: (lambda q, k, v: q * k + v)(*[y.split(4, -1)[i] for i in range(3)]), 3),
    (lambda y: torch.cat([torch.split(y, [5, 7], 2)[1], torch.split(y, [5, 7], 2)[0]], -1), 2),
    (lambda y: y.chunk(5, 1)[1] * 2, 1),                      # chunk of 6 rows in 5: pieces of 2, only one read
    (lambda y: torch.tensor_split(y, (1, 4), dim=1)[2] + 1, 1),
])
def test_split_read_piece_by_piece_is_one_narrow_per_piece(fn, pieces):
    calls = _rewritten(fn)
    narrows = [p for t, p in calls if t is torch.narrow]
    assert len(narrows) == pieces and set(narrows) == {"bpu"}, calls


@pytest.mark.parametrize("fn, why", [
    (lambda y: torch.stack(y.split(4, -1)).sum(0), "the pieces are read as a list"),
    (lambda y: y.split(1, 0)[1], "along the batch (narrow refuses dim 0)"),
])
def test_split_declines(fn, why):
    calls = _rewritten(fn)
    assert torch.narrow not in [t for t, _ in calls], why


def test_bayes_keeps_its_placement():
    calls = _rewritten(lambda y: y.select(1, 0), "bayes")
    assert "select" in [t for t, _ in calls] and operator.getitem not in [t for t, _ in calls]
