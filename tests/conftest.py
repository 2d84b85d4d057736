"""Shared fixtures: the heterogeneous-QAT guide's HybridModel and its hybrid_dict."""

import pytest
import torch

from qcompiler.zoo.hybrid import HybridModel, _SeluModule


@pytest.fixture
def hybrid_model():
    torch.manual_seed(0)
    return HybridModel().eval()


@pytest.fixture
def guide_hybrid_dict():
    return {"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]}


def snapshot(model: torch.nn.Module):
    """What must be unchanged after a failed/successful call: state and module tree."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tree = [(name, type(m), m.training) for name, m in model.named_modules()]
    return state, tree


def assert_untouched(model, snap):
    state, tree = snap
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), k
    assert [(name, type(m), m.training) for name, m in model.named_modules()] == tree
