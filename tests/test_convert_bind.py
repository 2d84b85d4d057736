"""Convert reads arguments with ``ops.bind``: the same model written with ``dim`` / ``keepdim`` by
position or by keyword converts to the same integers, also when torch's ``normalized_arguments``
fails (torch <= 2.12 finds the schema match of ``torch.cat`` / ``torch.mean`` ambiguous)."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.nn import quantized as qnn
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.quantization.convert import convert_fx


class Head(nn.Module):
    """Two convs joined by ``join`` (a cat), then ``act`` (a leaky_relu), ``pool`` (an avg_pool2d) and
    ``reduce`` (a global mean)."""

    def __init__(self, join, act, pool, reduce):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.join, self.act, self.pool, self.reduce = join, act, pool, reduce

    def forward(self, x):
        return self.reduce(self.pool(self.act(self.join(self.a(x), self.b(x)))))


FORMS = {
    "positional": (lambda a, b: torch.cat([a, b], 1), lambda y: F.leaky_relu(y, 0.2),
                   lambda y: F.avg_pool2d(y, 2, 2), lambda y: torch.mean(y, (2, 3), True)),
    "keyword": (lambda a, b: torch.cat([a, b], dim=1), lambda y: F.leaky_relu(y, negative_slope=0.2),
                lambda y: F.avg_pool2d(y, kernel_size=2, stride=2), lambda y: torch.mean(y, dim=(2, 3), keepdim=True)),
    "method": (lambda a, b: torch.cat((a, b), 1), lambda y: F.leaky_relu(y, 0.2),
               lambda y: F.avg_pool2d(y, 2), lambda y: y.mean((2, 3), keepdim=True)),
}


def _converted(form: str) -> tuple[fx.GraphModule, torch.Tensor]:
    """The converted model of ``Head`` written in ``form`` (same weights and calibration), and an input."""
    torch.manual_seed(0)
    model = Head(*FORMS[form]).eval()
    x = torch.randn(2, 3, 8, 8)
    cal = prepare_calibration_fx(model, None, example_inputs=(x,), hybrid=True, march="bayes")
    cal.eval()
    with torch.no_grad():
        for b in range(3):
            cal(x + 0.1 * b)
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return convert_fx(qat), x


def _outputs(form: str) -> torch.Tensor:
    q, x = _converted(form)
    kinds = {type(m) for m in q.modules()}
    assert {qnn.QuantizedCat, qnn.QuantizedPReLU, qnn.QuantizedAvgPool} <= kinds, f"{form}: all on the BPU"
    with torch.no_grad():
        return q(x)


def _ambiguous(*args, **kwargs):
    raise RuntimeError("Tried to normalize arguments to torch.cat but the schema match was ambiguous!")


@pytest.mark.parametrize("form", ["keyword", "method"])
def test_positional_and_keyword_dim_convert_alike(form):
    assert torch.equal(_outputs(form), _outputs("positional"))


def test_convert_does_not_lean_on_torch_schema_matching(monkeypatch):
    expected = _outputs("positional")
    monkeypatch.setattr(fx.Node, "normalized_arguments", _ambiguous)
    assert torch.equal(_outputs("positional"), expected)
