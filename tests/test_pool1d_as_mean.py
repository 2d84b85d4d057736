"""passes/rewrite.py row ``global_pool1d_as_mean``: ``AdaptiveAvgPool1d(1)`` (Swin's pooler over the tokens)
as ``mean(-1, keepdim=True)`` where the march runs that mean and not the pool."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.ir import propagate_shapes, trace
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.rewrite import rewrite

X = torch.randn(2, 8, 49, generator=torch.Generator().manual_seed(0))


class Pooler(nn.Module):
    def __init__(self, functional=False, size=1):
        super().__init__()
        self.pool, self.functional, self.size = nn.AdaptiveAvgPool1d(size), functional, size

    def forward(self, x):
        y = F.adaptive_avg_pool1d(x, self.size) if self.functional else self.pool(x)
        return torch.flatten(y, 1)


def _rewritten(model, march):
    gm = trace(model.eval())
    propagate_shapes(gm, (X,))
    out = rewrite(gm, CompileContext(march=March(march), example_inputs=(X,))).gm
    return out, [n.target for n in out.graph.nodes if n.op != "placeholder" and n.op != "output"]


@pytest.mark.parametrize("functional", [False, True])
def test_the_pool_is_the_mean_on_nash(functional):
    model = Pooler(functional)
    gm, targets = _rewritten(model, "nash")
    assert torch.mean in targets and "pool" not in targets and F.adaptive_avg_pool1d not in targets
    torch.testing.assert_close(gm(X), model(X), atol=1e-6, rtol=0)  # sum order: float32 rounding


@pytest.mark.parametrize("march, model", [
    ("bayes", lambda: Pooler()),                 # bayes runs neither: nothing to gain
    ("nash", lambda: Pooler(size=7)),            # not a global pool
])
def test_the_row_declines(march, model):
    gm, targets = _rewritten(model(), march)
    assert torch.mean not in targets
