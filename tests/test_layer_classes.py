"""Subclasses of torch layers made outside torch (transformers' EfficientNetDepthwiseConv2d(nn.Conv2d)),
and padding modules: what the tracer calls as a whole and what it traces into (qcompiler.ir.tracer)."""

import warnings

import torch
import torch.nn as nn

import qcompiler
from qcompiler.ir.tracer import trace

X = torch.randn(2, 4, 9, 9)


class DepthwiseConv(nn.Conv2d):
    """Only sets its arguments, as transformers' EfficientNetDepthwiseConv2d does."""

    def __init__(self, channels):
        super().__init__(channels, channels, 3, groups=channels)


class ScaledConv(nn.Conv2d):
    """Overrides forward: traced into like any user module."""

    def forward(self, x):
        return super().forward(x) * 2


class Net(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.pad = nn.ZeroPad2d((1, 1, 1, 1))
        self.conv = conv
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.head(self.conv(self.pad(x)).relu())


def _partition(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcompiler.partition(model.eval(), (X,), march="bayes")


def test_a_layer_subclass_keeping_its_forward_is_the_layer_itself():
    model = Net(DepthwiseConv(4)).eval()
    gm = trace(model)
    assert type(gm.get_submodule("conv")) is nn.Conv2d  # the graph's twin: fusion and convert match it
    assert type(model.conv) is DepthwiseConv  # the user's model keeps its module
    assert gm.get_submodule("conv").weight is model.conv.weight
    assert torch.equal(gm(X), model(X))


def test_its_padding_folds_into_it_and_the_model_compiles_all_on_the_bpu():
    model = Net(DepthwiseConv(4)).eval()
    gm = _partition(model)
    assert [n.meta.get("qc_placement") for n in gm.graph.nodes if n.op == "call_module"
            and "post_process" not in n.target and "dequant" not in n.target] == ["bpu", "bpu"]
    assert not any(n.op == "call_function" and n.target is torch.nn.functional.pad for n in gm.graph.nodes)
    cm = qcompiler.compile(model, (X,), march="bayes", progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    assert (cm(X) - model(X)).abs().max() < 0.05 * model(X).abs().max()


def test_a_subclass_with_its_own_forward_is_traced_into():
    model = Net(ScaledConv(4, 4, 3)).eval()
    gm = trace(model)
    assert not any(n.op == "call_module" and n.target == "conv" for n in gm.graph.nodes)  # its forward is its own
    assert any(n.op == "call_function" and n.target is torch.nn.functional.conv2d for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))
