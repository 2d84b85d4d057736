"""The pooler rows of passes/rewrite.py (transformers' EfficientNet: AvgPool2d(hidden_dim, ceil_mode=True)
over the last map, then pooled.reshape(pooled.shape[:2])): alone, declining, and in the pipeline."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.ir import propagate_shapes, trace
from qcompiler.march import March
from qcompiler.passes import rewrite as rw
from qcompiler.passes.base import CompileContext

X = torch.rand(2, 3, 5, 5)


class Pooler(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.conv, self.pool, self.head = nn.Conv2d(3, 8, 1), pool, nn.Linear(8, 4)

    def forward(self, x):
        p = self.pool(self.conv(x))
        return self.head(p.reshape(p.shape[:2]))


def _run(model, x=X):
    gm = trace(copy.deepcopy(model).eval())
    propagate_shapes(gm, (x,))
    ctx = CompileContext(march=March.BAYES, example_inputs=(x,))
    return gm, rw.rewrite(gm, ctx)


@pytest.mark.parametrize("pool", [nn.AvgPool2d(8, ceil_mode=True), nn.AvgPool2d(5), nn.AvgPool2d((5, 6), 7, ceil_mode=True)],
                         ids=["larger-ceil", "exact", "rect"])
def test_a_pool_over_the_whole_map_is_the_global_pool_and_its_shape_slice_numbers(pool):
    model = Pooler(pool).eval()
    gm, result = _run(model)
    assert result.modified
    assert type(gm.get_submodule("pool")) is nn.AdaptiveAvgPool2d and gm.get_submodule("pool").output_size == 1
    assert "reshape = pool.reshape((-1, 8))" in gm.code.replace("pool_1", "pool")
    assert not any(n.target in ("shape",) or "getattr" in n.name for n in gm.graph.nodes)
    # avg_pool2d and the global mean sum the same H * W values: equal within float32 rounding
    torch.testing.assert_close(gm(X), model(X), rtol=0, atol=1e-6)
    y = torch.rand(5, 3, 5, 5)  # the batch stays free
    torch.testing.assert_close(gm(y), model(y), rtol=0, atol=1e-6)


@pytest.mark.parametrize("pool", [nn.AvgPool2d(3), nn.AvgPool2d(8, ceil_mode=True, padding=0, divisor_override=9),
                                  nn.AvgPool2d(4, 4, padding=2)],
                         ids=["smaller-window", "divisor-override", "padded"])
def test_the_pool_row_declines_where_the_window_is_not_the_map(pool):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = pool

        def forward(self, x):
            return self.pool(x)

    gm, _ = _run(Plain())
    assert type(gm.get_submodule("pool")) is nn.AvgPool2d


def test_a_shape_slice_not_from_the_batch_is_declined():
    class Reads(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[1:2] + (-1,))  # not a leading slice

    gm, _ = _run(Reads())
    assert any("getattr" in n.name for n in gm.graph.nodes)


def test_the_pooler_compiles_all_on_the_bpu_and_exports():
    model = Pooler(nn.AvgPool2d(8, ceil_mode=True)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = qcompiler.compile(model, (X,), march="bayes", progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    assert (cm(X) - model(X)).abs().max() < 0.05 * model(X).abs().max() + 1e-3
