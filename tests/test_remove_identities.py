"""passes/remove_identities.py: eval-mode dropout, stochastic_depth, DropPath and nn.Identity leave the
graph (golden code, bit-equal outputs); in training mode, or with training=True, they stay."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.errors import PassError
from qcompiler.ir import trace
from qcompiler.march import March
from qcompiler.passes.base import CompileContext, PassManager
from qcompiler.passes.pipeline import PARTITION_PIPELINE
from qcompiler.passes.remove_identities import REMOVE_IDENTITIES, remove_identities, verify_no_identities
from qcompiler.quantization import get_default_qat_qconfig, prepare_qat_fx

X = torch.rand(2, 4, 6, 6)
CTX = CompileContext(march=March.BAYES, example_inputs=(X,))


def stochastic_depth(input, p, mode, training=True):
    """Stands for torchvision.ops.stochastic_depth (not installable here): same module, name, fx.wrap."""
    if not training or p == 0.0:
        return input
    keep = torch.empty([input.shape[0]] + [1] * (input.ndim - 1)).bernoulli_(1.0 - p)
    return input * keep / (1.0 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


class DropPath(nn.Module):
    """timm's / transformers' shape: ``drop_prob``, identity unless training."""

    def __init__(self, drop_prob=0.2):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = torch.empty(x.shape[0], 1, 1, 1).bernoulli_(1.0 - self.drop_prob)
        return x * keep / (1.0 - self.drop_prob)


class SwinDropPath(DropPath):
    pass


MODULES = [nn.Dropout(0.3), nn.Dropout1d(0.3), nn.Dropout2d(0.3), nn.Dropout3d(0.3), nn.AlphaDropout(0.3),
           nn.FeatureAlphaDropout(0.3), DropPath(), SwinDropPath()]


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.conv(x)) + 1.0


def _trace(model):
    return trace(copy.deepcopy(model), leaf_module_types=[DropPath])


def _body(gm) -> list[str]:
    return [line.strip() for line in gm.code.strip().splitlines()[1:] if line.strip()]


@pytest.mark.parametrize("inner", MODULES, ids=lambda m: type(m).__name__)
def test_an_eval_module_identity_leaves_the_graph(inner):
    model = Wrap(inner).eval()
    gm = _trace(model)
    assert any(n.op == "call_module" and n.target == "inner" for n in gm.graph.nodes)
    assert remove_identities(gm, CTX).modified
    assert _body(gm) == ["conv = self.conv(x);  x = None", "add = conv + 1.0;  conv = None", "return add"]
    verify_no_identities(gm, CTX)
    assert torch.equal(gm(X), model.conv(X) + 1.0)  # (Dropout1d refuses a 4-D input even in eval mode)


@pytest.mark.parametrize("inner", MODULES, ids=lambda m: type(m).__name__)
def test_a_training_module_stays(inner):
    gm = _trace(Wrap(inner).train())
    assert not remove_identities(gm, CTX).modified
    assert any(n.op == "call_module" and n.target == "inner" for n in gm.graph.nodes)


class Functional(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, x):
        return self.call(x * 2.0, self) - 1.0


EVAL_CALLS = {
    "F.dropout(training=self.training)": lambda x, m: F.dropout(x, 0.2, training=m.training),
    "F.dropout(x, p, False)": lambda x, m: F.dropout(x, 0.2, False),
    "F.dropout1d": lambda x, m: F.dropout1d(x.flatten(2), 0.2, training=False).view_as(x),
    "F.dropout2d": lambda x, m: F.dropout2d(x, 0.2, m.training),
    "F.dropout3d": lambda x, m: F.dropout3d(x, 0.2, training=False),
    "F.alpha_dropout default": lambda x, m: F.alpha_dropout(x, 0.2),  # training defaults False
    "F.feature_alpha_dropout": lambda x, m: F.feature_alpha_dropout(x, 0.2, training=False),
    "torch.dropout": lambda x, m: torch.dropout(x, 0.2, False),
    "torch.dropout train=": lambda x, m: torch.dropout(x, 0.2, train=m.training),
    "torch.alpha_dropout": lambda x, m: torch.alpha_dropout(x, 0.2, False),
    "torch.feature_dropout": lambda x, m: torch.feature_dropout(x, 0.2, False),
    "stochastic_depth": lambda x, m: stochastic_depth(x, 0.2, "row", m.training),
    "stochastic_depth kw": lambda x, m: stochastic_depth(x, p=0.2, mode="batch", training=False),
    "F.dropout inplace": lambda x, m: F.dropout(x, 0.2, False, True),
}


@pytest.mark.parametrize("call", EVAL_CALLS.values(), ids=EVAL_CALLS.keys())
def test_an_eval_call_identity_leaves_the_graph(call):
    model = Functional(call).eval()
    gm = _trace(model)
    before = len(gm.graph.nodes)
    assert remove_identities(gm, CTX).modified
    assert len(gm.graph.nodes) <= before - 1
    assert not any("dropout" in str(n.target) or n.target is stochastic_depth for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))


TRAINING_CALLS = {
    "F.dropout default training=True": lambda x, m: F.dropout(x, 0.2),
    "F.dropout(training=True)": lambda x, m: F.dropout(x, 0.2, training=True),
    "F.dropout2d default": lambda x, m: F.dropout2d(x, 0.2),
    "F.alpha_dropout(training=True)": lambda x, m: F.alpha_dropout(x, 0.2, True),
    "torch.dropout(train=True)": lambda x, m: torch.dropout(x, 0.2, True),
    "stochastic_depth default training": lambda x, m: stochastic_depth(x, 0.2, "row"),
    "stochastic_depth(training=True)": lambda x, m: stochastic_depth(x, 0.2, "row", True),
}


@pytest.mark.parametrize("call", TRAINING_CALLS.values(), ids=TRAINING_CALLS.keys())
def test_a_call_that_drops_stays_even_in_an_eval_model(call):
    gm = _trace(Functional(call).eval())
    code = gm.code
    assert not remove_identities(gm, CTX).modified
    assert gm.code == code


def other_stochastic_depth(input, p, mode, training=True):
    return input * 0.5


other_stochastic_depth.__qualname__ = "stochastic_depth"  # the name, but not torchvision's module
torch.fx.wrap("other_stochastic_depth")


def test_nn_identity_stays_a_passthrough():
    """Kept on purpose (no island; the hybrid guide's golden graphs show it): see the pass's docstring."""
    gm = _trace(Wrap(nn.Identity()).eval())
    assert not remove_identities(gm, CTX).modified
    assert any(n.op == "call_module" and n.target == "inner" for n in gm.graph.nodes)


def test_a_same_named_function_of_another_module_stays():
    gm = _trace(Functional(lambda x, m: other_stochastic_depth(x, 0.2, "row", False)).eval())
    assert other_stochastic_depth in [n.target for n in gm.graph.nodes]
    assert not remove_identities(gm, CTX).modified


def test_the_verifier_names_an_identity_left_in_the_graph():
    gm = _trace(Wrap(nn.Dropout()).eval())
    with pytest.raises(PassError, match=r"remove_identities: node 'inner' is an eval-mode identity still in the graph"):
        verify_no_identities(gm, CTX)


def test_the_partition_pipeline_runs_it_first_and_places_no_dropout():
    assert PARTITION_PIPELINE[0] is REMOVE_IDENTITIES
    gm = PassManager(PARTITION_PIPELINE).run(_trace(Wrap(nn.Dropout()).eval()), CTX).gm
    assert not any(n.op == "call_module" and n.target == "inner" for n in gm.graph.nodes)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.conv2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.drop(torch.relu(self.conv1(x)))
        y = stochastic_depth(y, 0.3, "row", self.training)
        return self.conv2(F.dropout(y, 0.1, training=self.training)) + x


def test_qat_keeps_the_dropouts_of_a_training_model():
    torch.manual_seed(0)
    qat = prepare_qat_fx(Net().train(), {"": get_default_qat_qconfig()}, example_inputs=(X,))
    targets = [n.target for n in qat.graph.nodes]
    assert "drop" in targets and stochastic_depth in targets and F.dropout in targets


@pytest.mark.slow
def test_a_compiled_model_has_no_island_for_its_identities(tmp_path):
    torch.manual_seed(0)
    model = Net().eval()
    cm = qcompiler.compile(model, (X,), march="bayes", calib_data=[torch.rand(2, 4, 6, 6) for _ in range(3)],
                           progress=False)
    assert cm.torch_islands() == {}
    assert [p["placement"] for p in cm.partitions] == ["bpu"]
    cm.export_onnx(tmp_path / "m.onnx")


@pytest.mark.parametrize("training", [False, True])
def test_a_graph_captured_by_torch_export_loses_its_eval_dropouts_only(training):
    """torch.export records aten.dropout(x, p, train), lowered to F.dropout through the catalogue: the same rule."""
    from qcompiler.ir.capture import capture

    torch.manual_seed(0)
    model = Net().train(training)
    gm = capture(model, (X,), mode="export")
    drops = [n for n in gm.graph.nodes if n.target in (F.dropout, "drop")]
    assert len(drops) == 2
    assert remove_identities(gm, CTX).modified is not training
    left = [n for n in gm.graph.nodes if n.target in (F.dropout, "drop")]
    assert len(left) == (2 if training else 0)
    if not training:
        assert torch.equal(gm(X), model(X))
