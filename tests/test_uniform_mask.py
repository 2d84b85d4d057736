"""passes/rewrite.py row ``uniform_constant_mask_removed``: masked_fill / where with a constant boolean
mask that selects one operand everywhere is that operand (exact), so a folded attention mask of a model
without padding (transformers' ViT on nash: a CPU masked_fill between two BPU ops) leaves no op behind."""

import pytest
import torch
import torch.nn as nn

from qcompiler.ir import propagate_shapes, trace
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.rewrite import rewrite

X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))


class Masked(nn.Module):
    def __init__(self, mask, form):
        super().__init__()
        self.register_buffer("mask", mask)
        self.form = form

    def forward(self, x):
        y = x * 2
        if self.form == "masked_fill":
            return y.masked_fill(self.mask, float("-inf")) + 1
        if self.form == "where_x":
            return torch.where(self.mask, y, x) + 1
        return torch.where(self.mask, x, y) + 1


def _rewritten(model):
    gm = trace(model.eval())
    propagate_shapes(gm, (X,))
    ctx = CompileContext(march=March.NASH, example_inputs=(X,))
    out = rewrite(gm, ctx).gm
    return out, [n.target for n in out.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("form, mask", [
    ("masked_fill", torch.zeros(3, 4, dtype=torch.bool)),   # selects nothing: the input
    ("where_x", torch.ones(2, 3, 4, dtype=torch.bool)),     # all True: the input
    ("where_y", torch.zeros(2, 3, 4, dtype=torch.bool)),    # all False: the other
])
def test_a_uniform_constant_mask_leaves_the_operand_it_selects(form, mask):
    model = Masked(mask, form)
    gm, targets = _rewritten(model)
    assert not {"masked_fill", torch.where} & set(targets), targets
    assert torch.equal(gm(X), model(X))


@pytest.mark.parametrize("form, mask, why", [
    ("masked_fill", torch.tensor([[True, False, False, False]] * 3), "a mask that selects something"),
    ("masked_fill", torch.zeros(1, 2, 3, 4, dtype=torch.bool), "a mask that broadcasts the input up"),
    ("where_x", torch.tensor([[True, False, True, True]] * 3), "a condition that mixes"),
])
def test_the_row_declines_what_is_not_the_identity(form, mask, why):
    model = Masked(mask, form)
    gm, targets = _rewritten(model)
    assert "masked_fill" in targets or torch.where in targets, why
    assert torch.equal(gm(X), model(X))


class RuntimeMask(nn.Module):
    def forward(self, x):
        return x.masked_fill(x > 5, 0.0) + 1  # all False on this input, but computed at run time


def test_a_mask_computed_at_run_time_is_kept_even_when_it_selects_nothing_here():
    _, targets = _rewritten(RuntimeMask())
    assert "masked_fill" in targets
