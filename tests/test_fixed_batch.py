"""A compiled graph that bakes the example's batch in (torch.export specializes every size; a folded
constant then holds the batch, as BEiT's relative-position bias does) is refused at another batch with a
ConfigError, never run into a wrong-shaped answer or a traceback from inside torch."""

import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.tools.metrics import compute_metric


class BatchBias(nn.Module):
    """conv + a parameter-only bias expanded to the input's batch (a constant once the batch is specialized)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(1, 4, 6, 6))

    def forward(self, x):
        return self.conv(x) + self.bias.expand(x.shape[0], -1, -1, -1) * 2


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = BatchBias().eval()
    x = torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cm = qcompiler.compile(model, (x,), march="bayes", calib_data=[x], progress=False,
                               prepare_custom_config_dict={"capture": "export"})
    return model, cm


def test_the_example_batch_runs(compiled):
    model, cm = compiled
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = cm(x)
        assert torch.equal(got, cm.converted(x))  # the batch split once ran it as 2 x 1 and answered batch 4
        assert compute_metric("SQNR", model(x), got) > 20.0
    # the fused add's operand is the folded (2, 4, 6, 6) bias: along the batch, so not proven per-sample
    assert "lies along the batch dim" in cm.split_refusal


def test_a_smaller_batch_is_refused_not_answered_at_the_example_batch(compiled):
    _, cm = compiled
    with pytest.raises(ConfigError, match=r"called at batch 1, an output came back at batch 2; the graph is not "
                                          r"proven per-sample .* call it at batch 2"):
        cm(torch.randn(1, 3, 6, 6))


def test_a_larger_batch_is_a_config_error_not_a_torch_traceback(compiled):
    _, cm = compiled
    with pytest.raises(ConfigError, match=r"batch 3 failed \(.*\); the graph is not proven per-sample"):
        cm(torch.randn(3, 3, 6, 6))


def test_a_per_sample_graph_runs_at_any_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).eval()
    cm = qcompiler.compile(model, (torch.randn(2, 3, 6, 6),), march="bayes", progress=False)
    for b in (1, 3):
        assert cm(torch.randn(b, 3, 6, 6)).shape == (b, 4, 6, 6)
