"""passes/rewrite.py row ``zero_pad_removed``: ``F.pad`` / ``torch.constant_pad_nd`` by zero sizes is a copy
of its input (transformers' Swin pads to a multiple of its window unconditionally, with zeros when the sizes
divide), and no march runs a pad: removed, its readers read the input, the outputs bit-equal. Declined where
a write in place would tell the copy from the input, where the pad is a graph output, and for real padding."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import BPU, META_REWRITE
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.rewrite import rewrite

X = torch.randn(2, 4, 4, 8, generator=torch.Generator().manual_seed(0))
NOTE = "F.pad / constant_pad_nd by zero sizes (a copy) removed: its readers read its input"


class Padded(nn.Module):
    """A linear, ``pad(y)``, a linear: the pad between two BPU ops, as in Swin's layer."""

    def __init__(self, pad):
        super().__init__()
        self.a, self.b, self.pad = nn.Linear(8, 8), nn.Linear(8, 8), pad

    def forward(self, x):
        return self.b(self.pad(self.a(x)))


def _rewritten(model, x=X):
    gm = trace(copy.deepcopy(model).eval())
    propagate_shapes(gm, (x,))
    result = rewrite(gm, CompileContext(march=March.NASH, example_inputs=(x,)))
    return result, [line.strip() for line in result.gm.code.strip().splitlines()[1:] if line.strip()]


@pytest.mark.parametrize("pad", [
    lambda y: F.pad(y, (0, 0, 0, 0, 0, 0)),             # Swin's maybe_pad with sizes that divide
    lambda y: F.pad(y, (0, 0, 0, 0), mode="replicate"),
    lambda y: F.pad(y, [0, 0, 0, 0], value=3.0),
    lambda y: torch.constant_pad_nd(y, (0, 0, 0, 0)),
])
def test_a_pad_by_zero_sizes_is_removed_golden(pad):
    model = Padded(pad)
    result, body = _rewritten(model)
    assert result.modified
    assert body == ["a = self.a(x);  x = None", "b = self.b(a);  a = None", "return b"]
    a = next(n for n in result.gm.graph.nodes if n.name == "a")
    assert a.meta[META_REWRITE] == NOTE
    for seed in range(3):
        x = torch.randn(3, 5, 2, 8, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(result.gm(x), model(x))
    assert not rewrite(result.gm, CompileContext(march=March.NASH, example_inputs=(X,))).modified  # a fixed point


class WritesPadded(nn.Module):
    def forward(self, x):
        p = F.pad(x, (0, 0))
        p.add_(1)  # on the copy: x must stay as it was
        return p * x


class WritesInput(nn.Module):
    def forward(self, x):
        y = x * 2
        p = F.pad(y, (0, 0))
        y.mul_(3)  # after the copy: p must keep the old values
        return p + y


class ReturnsPad(nn.Module):
    def forward(self, x):
        y = x * 2
        return y, F.pad(y, (0, 0))  # two outputs that must not be one tensor


@pytest.mark.parametrize("model, why", [
    (Padded(lambda y: F.pad(y, (0, 0, 0, 1))), "real padding"),
    (Padded(lambda y: F.pad(y, (1, -1))), "padding and cropping: not zero sizes"),
    (WritesPadded(), "the copy is written in place"),
    (WritesInput(), "the input is written in place after the copy"),
    (ReturnsPad(), "the pad is a graph output"),
])
def test_a_pad_that_is_not_a_plain_copy_stays(model, why):
    result, body = _rewritten(model)
    assert any("pad" in line for line in body), why
    x = X.clone()
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(result.gm(x.clone())),
                                                 torch.utils._pytree.tree_leaves(model(x.clone()))))


def test_swin_style_zero_pad_leaves_one_bpu_partition_on_nash():
    model = Padded(lambda y: F.pad(y, (0, 0, 0, 0, 0, 0))).eval()
    cm = qcompiler.compile(model, (X,), march="nash", calib_data=[(X,)], progress=False)
    assert [s.kind for s in cm.runtime.steps] == [BPU]
    assert torch.equal(cm(X), cm(X.clone()))
