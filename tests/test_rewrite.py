"""The rewrite pass (passes/rewrite.py): each row before/after as golden code, bit-equal outputs,
a no-op rerun, the note in the placement reason, and the cases each row must decline."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.errors import PassError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_REASON, META_REWRITE
from qcompiler.march import March
from qcompiler.passes import rewrite as rw
from qcompiler.passes.base import CompileContext

X = torch.rand(2, 3, 8, 8)


def _run(model, x=X, march=March.BAYES):
    gm = trace(copy.deepcopy(model).eval())  # the pipeline rewrites a copy; so does this test
    propagate_shapes(gm, (x,))
    ctx = CompileContext(march=march, example_inputs=(x,))
    return gm, ctx, rw.rewrite(gm, ctx)


def _body(gm) -> list[str]:
    return [line.strip() for line in gm.code.strip().splitlines()[1:] if line.strip()]


class PadConv(nn.Module):
    def __init__(self, pads=(2, 2, 1, 1), value=0.0, mode="constant", conv_padding=1):
        super().__init__()
        self.pads, self.value, self.mode = pads, value, mode
        self.conv = nn.Conv2d(3, 4, 3, padding=conv_padding)

    def forward(self, x):
        return self.conv(F.pad(x, self.pads, self.mode, self.value))


class PadPool(nn.Module):
    def __init__(self, pool: nn.Module, pads=(1, 1, 1, 1)):
        super().__init__()
        self.pool, self.pads = pool, pads

    def forward(self, x):
        return self.pool(F.pad(x, self.pads))


class Unsqueeze(nn.Module):
    def forward(self, x):
        return x[:, None] + x[:, :, None], x[..., None, :]


def test_zero_pad_folds_into_the_conv():
    model = PadConv()
    ref = model(X)
    gm, ctx, result = _run(model)
    assert result.modified
    assert _body(gm) == ["conv = self.conv(x);  x = None", "return conv"]
    assert gm.conv.padding == (2, 3) and model.conv.padding == (1, 1)
    # the same products, summed in another order by torch's conv kernel: float32 rounding only
    torch.testing.assert_close(gm(X), ref, atol=1e-6, rtol=1e-6)
    assert not rw.rewrite(gm, ctx).modified  # a fixed point
    rw.verify_rewritten(gm, ctx)
    conv = next(n for n in gm.graph.nodes if n.name == "conv")
    assert conv.meta[META_REWRITE] == "F.pad with zeros folded into the padding of the conv / average pool after it"


def test_zero_pad_folds_into_an_average_pool_counting_padding():
    model = PadPool(nn.AvgPool2d(3, 1))
    ref = model(X)
    gm, _, result = _run(model)
    assert result.modified and gm.pool.padding == (1, 1)
    assert _body(gm) == ["pool = self.pool(x);  x = None", "return pool"]
    assert torch.equal(gm(X), ref)


@pytest.mark.parametrize("model", [
    PadConv(pads=(1, 2, 1, 1)),  # asymmetric: a conv pads both sides alike
    PadConv(value=0.5),  # not zeros
    PadConv(mode="reflect"),
    PadConv(pads=(1, 1)),  # 2-D pad list (W only) with an asymmetric H: still symmetric, see below
    PadPool(nn.MaxPool2d(3, 1)),  # max pool pads with -inf, not zeros
    PadPool(nn.AvgPool2d(3, 1, count_include_pad=False, padding=1)),  # the zeros would not be counted
    PadPool(nn.AvgPool2d(3, 1, padding=1)),  # 2 > kernel // 2: torch refuses such a pool
], ids=["asymmetric", "nonzero", "reflect", "w-only", "max-pool", "not-counted", "over-half-kernel"])
def test_pad_rows_decline(model):
    ref = model(X)
    gm, _, result = _run(model)
    if isinstance(model, PadConv) and model.pads == (1, 1):  # W-only zero pad: symmetric, folds
        assert result.modified and gm.conv.padding == (1, 2)
        torch.testing.assert_close(gm(X), ref, atol=1e-6, rtol=1e-6)
    else:
        assert not result.modified
        assert any(n.op == "call_function" and n.target is F.pad for n in gm.graph.nodes)
        assert torch.equal(gm(X), ref)


def test_a_shared_conv_keeps_its_padding():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            return self.conv(F.pad(x, (1, 1, 1, 1)))[:, :, 1:-1, 1:-1] + self.conv(x)

    model = Shared()
    gm, _, result = _run(model)
    assert not result.modified
    assert torch.equal(gm(X), model(X))


def test_the_march_must_accept_the_new_padding(monkeypatch):
    class Refusing:
        def check(self, info):
            return False, "padding too large"

    monkeypatch.setattr(rw, "op_table", lambda march: Refusing())
    gm, _, result = _run(PadConv())
    assert not result.modified and gm.conv.padding == (1, 1)


def test_index_none_becomes_unsqueeze():
    model = Unsqueeze()
    ref = model(X)
    gm, ctx, result = _run(model)
    assert result.modified
    assert _body(gm) == ["unsqueeze = x.unsqueeze(1)", "unsqueeze_1 = x.unsqueeze(2)",
                         "add = unsqueeze + unsqueeze_1;  unsqueeze = unsqueeze_1 = None",
                         "unsqueeze_2 = x.unsqueeze(3);  x = None", "return (add, unsqueeze_2)"]
    assert all(torch.equal(a, b) for a, b in zip(gm(X), ref))
    assert not rw.rewrite(gm, ctx).modified


@pytest.mark.parametrize("index", [(slice(None), 0), (slice(1, None), None), (slice(None, None, 2), None), (0,)],
                         ids=["int", "partial-slice", "step", "no-none"])
def test_index_rows_decline(index):
    class Index(nn.Module):
        def forward(self, x):
            return x[index]

    model = Index()
    gm, _, result = _run(model)
    assert not result.modified
    assert torch.equal(gm(X), model(X))


def test_the_placement_reason_shows_the_rewrite():
    gm = qcompiler.partition(PadConv().eval(), (X,), march="bayes")
    conv = next(n for n in gm.graph.nodes if n.name == "conv")
    assert conv.meta[META_REASON] == ("conv2d supported on bayes (F.pad with zeros folded into the padding of the "
                                      "conv / average pool after it)")
    assert not any(n.op == "call_function" and n.target is F.pad for n in gm.graph.nodes)


def test_rewritten_models_compile_bit_exact_with_their_converted_model():
    torch.manual_seed(0)
    cm = qcompiler.compile(PadConv().eval(), (X,), march="bayes", progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]  # the pad no longer splits the graph
    assert [s.kind for s in qcompiler.compile(PadConv(value=0.5).eval(), (X,), march="bayes",
                                              progress=False).runtime.steps] != ["bpu"]
    assert torch.equal(cm(X), cm.converted(X))


def test_the_verifier_names_a_row_that_still_matches():
    gm = trace(PadConv().eval())
    propagate_shapes(gm, (X,))
    with pytest.raises(PassError, match=r"rewrite: row 'pad_into_layer' still matches node 'pad'"):
        rw.verify_rewritten(gm, CompileContext(march=March.BAYES, example_inputs=(X,)))


def test_each_unsqueeze_step_has_its_shape_for_the_emitter():
    """x[:, :, None, None] becomes two unsqueezes; both carry their shapes, so the CPU island is ONNX."""

    class TwoNones(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 2, 1)

        def forward(self, x):
            return self.conv(x.flatten(2))[:, :, None, None, :].sigmoid()

    gm, _, result = _run(TwoNones())
    shapes = [n.meta["qc_tensor"].shape for n in gm.graph.nodes if n.op == "call_method" and n.target == "unsqueeze"]
    assert result.modified and shapes == [(2, 2, 1, 64), (2, 2, 1, 1, 64)]
    cm = qcompiler.compile(TwoNones().eval(), (X,), march="bernoulli2", progress=False)
    assert cm.torch_islands() == {}
    torch.testing.assert_close(cm(X), cm.converted(X), atol=1e-6, rtol=1e-6)  # onnxruntime vs torch floats
