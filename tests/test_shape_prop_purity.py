"""Shape propagation leaves the model as it was (issue 33): a module that rebinds a plain attribute in
forward (torchvision's AnchorGenerator: ``self.cell_anchors = [a.to(dtype, device) ...]``) must not
keep the meta tensors it ran on, and an error caused by the model's state does not blame the inputs."""

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import ConfigError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.state import ModelState, ModuleAttributes


class Anchors(nn.Module):
    """Rebinds a list of tensors, fills a dict and makes a cache on its first call, as detectors do."""

    def __init__(self) -> None:
        super().__init__()
        self.cell_anchors = [torch.tensor([[-1.0, -1.0, 1.0, 1.0]]), torch.tensor([[-2.0, -2.0, 2.0, 2.0]])]
        self.cache = {}

    def forward(self, x):
        self.cell_anchors = [a.to(dtype=x.dtype, device=x.device) for a in self.cell_anchors]
        self.cache["last"] = x.new_zeros(1)
        if not hasattr(self, "grid"):
            self.grid = x.new_ones(1)
        return (self.cell_anchors[0].sum() + self.cell_anchors[1].sum()) * self.grid


class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.anchors = Anchors()

    def forward(self, x):
        y = self.conv(x)
        return y + self.anchors(y)


X = torch.randn(1, 3, 8, 8)
LEAF = {"non_traceable_module_name": ["anchors"]}


def test_shape_propagation_restores_rebound_refilled_and_added_attributes():
    gm = trace(Detector().eval(), leaf_module_names=["anchors"])
    anchors = gm.anchors
    before, cache = anchors.cell_anchors, anchors.cache
    items = list(before)
    propagate_shapes(gm, X)  # runs on meta tensors
    assert anchors.cell_anchors is before and all(a is b for a, b in zip(anchors.cell_anchors, items))
    assert not any(a.is_meta for a in anchors.cell_anchors)
    assert anchors.cache is cache and anchors.cache == {}
    assert not hasattr(anchors, "grid")
    assert gm.graph.find_nodes(op="call_module", target="anchors")[0].meta["qc_tensor"].shape == (1,)


def test_a_detector_like_model_compiles_and_runs_on_its_real_anchors():
    m = Detector().eval()
    cm = qcompiler.compile(m, X, march="bayes", prepare_custom_config_dict=LEAF, progress=False)
    ref = m(X)
    assert ((cm(X) - ref).abs().max() / ref.abs().max()).item() < 0.02


class DataDependentAnchors(Anchors):
    """Reads a value (no meta run: shape propagation runs it for real)."""

    def forward(self, x):
        scale = float(x.abs().max()) > -1.0
        return super().forward(x) * scale


def test_a_model_holding_meta_tensors_is_blamed_not_the_inputs():
    m = Detector().eval()
    m.anchors = DataDependentAnchors()
    m.anchors.cell_anchors = [a.to("meta") for a in m.anchors.cell_anchors]  # the user's model is broken
    gm = trace(m, leaf_module_names=["anchors"])
    with pytest.raises(ConfigError) as err:
        propagate_shapes(gm, X)
    text = str(err.value)
    assert "anchors.cell_anchors[0]" in text and "the cause is the model's state, not example_inputs" in text
    assert "Check the shapes and dtypes of example_inputs" not in text


_GLOBAL_CACHE = {}


class GlobalCacheAnchors(DataDependentAnchors):
    """Keeps its tensor outside the model (a module-level cache), already on the meta device."""

    def forward(self, x):
        return super().forward(x) + _GLOBAL_CACHE["anchor"]


def test_a_meta_tensor_held_outside_the_modules_is_blamed_on_the_model_too(monkeypatch):
    monkeypatch.setitem(_GLOBAL_CACHE, "anchor", torch.zeros(1, device="meta"))
    m = Detector().eval()
    m.anchors = GlobalCacheAnchors()
    gm = trace(m, leaf_module_names=["anchors"])
    with pytest.raises(ConfigError, match="the cause is the model's state, not example_inputs") as err:
        propagate_shapes(gm, X)
    assert "no module of the model holds one" in str(err.value)


def test_inputs_that_do_not_fit_are_still_blamed():
    gm = trace(Detector().eval(), leaf_module_names=["anchors"])
    with pytest.raises(ConfigError, match="Check the shapes and dtypes of example_inputs"):
        propagate_shapes(gm, torch.randn(1, 5, 8, 8))


def test_module_attributes_report_what_they_put_back():
    m = Detector()
    snap = ModuleAttributes(m)
    assert snap.restore() == []  # nothing moved
    m.anchors(torch.randn(1, 4, 2, 2))
    assert sorted(snap.restore()) == ["anchors.cache", "anchors.cell_anchors", "anchors.grid"]
    assert snap.restore() == []
    m.anchors.cell_anchors.append(torch.zeros(1))  # a list changed in place is refilled
    assert snap.restore() == ["anchors.cell_anchors"] and len(m.anchors.cell_anchors) == 2


def test_model_state_restores_plain_attributes_and_leaves_the_training_flag():
    m = Detector()
    state = ModelState(m)
    m.eval()
    m.anchors.cell_anchors = []
    state.restore()
    assert len(m.anchors.cell_anchors) == 2
    assert not m.training  # nn.Module's own entries (training, hooks) are not snapshot
