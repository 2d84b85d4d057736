"""A layout op whose sizes are read from a tensor at run time stays on the CPU (the BPU program holds
static sizes), with the reason; the same op with numbers stays on the BPU. Before, it was placed on
the BPU and compile failed in lowering."""

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REASON
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.place import place


class MergeHeads(nn.Module):
    """``b, h, n, e = y.shape; y.transpose(1, 2).reshape(b, n, h * e)``; with batch 2 and 2 heads the
    rewrite to numbers declines (which size is the batch is ambiguous)."""

    def __init__(self, numbers: bool):
        super().__init__()
        self.fc, self.numbers = nn.Linear(8, 8), numbers

    def forward(self, x):
        y = self.fc(x)
        b, h, n, e = y.shape
        return y.transpose(1, 2).reshape((-1, 3, 16) if self.numbers else (b, n, h * e))


X = torch.randn(2, 2, 3, 8)


def _reshape(model, march):
    gm = trace(model)
    propagate_shapes(gm, (X,))
    place(gm, CompileContext(march=March(march), example_inputs=(X,)))
    (node,) = [n for n in gm.graph.nodes if n.target == "reshape"]
    return node.meta[META_PLACEMENT], node.meta[META_REASON]


@pytest.mark.parametrize("march", ["bayes", "nash"])
def test_sizes_read_at_run_time_keep_the_reshape_on_the_cpu(march):
    placement, reason = _reshape(MergeHeads(numbers=False), march)
    assert placement == "cpu"
    assert "computed at run time" in reason and "write them as numbers" in reason


@pytest.mark.parametrize("march", ["bayes", "nash"])
def test_numbers_keep_the_reshape_on_the_bpu(march):
    assert _reshape(MergeHeads(numbers=True), march)[0] == "bpu"


def test_the_model_compiles_and_matches_the_float_model():
    model = MergeHeads(numbers=False).eval()
    cm = qcompiler.compile(model, (X,), march="bayes", calib_data=[X], progress=False)
    with torch.no_grad():
        want, got = model(X), cm(X)
    assert got.shape == want.shape
    assert float(10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())) > 25
