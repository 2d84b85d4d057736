"""Canonical op names (qcompiler.ir.ops): clamps are ReLU / ReLU6 only for the exact bounds."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.ir import trace
from qcompiler.ir.ops import node_op

CASES = [
    # (spelling, op); the value must equal the op's for the positive cases
    (lambda m, x: torch.clamp(x, min=0), "relu"),
    (lambda m, x: torch.clamp(x, 0), "relu"),
    (lambda m, x: torch.clamp_min(x, 0.0), "relu"),
    (lambda m, x: x.clamp(min=0.0), "relu"),
    (lambda m, x: x.clamp_min(0), "relu"),
    (lambda m, x: torch.clamp(x, 0, 6), "relu6"),
    (lambda m, x: torch.clip(x, min=0.0, max=6.0), "relu6"),
    (lambda m, x: x.clip(0, 6), "relu6"),
    (lambda m, x: F.hardtanh(x, 0.0, 6.0), "relu6"),
    (lambda m, x: F.hardtanh(x, min_val=0, max_val=6, inplace=False), "relu6"),
    (lambda m, x: m.relu6_module(x), "relu6"),
    # not a ReLU: other bounds, tensor bounds, defaults, only an upper bound
    (lambda m, x: torch.clamp(x, -1, 6), None),
    (lambda m, x: torch.clamp(x, 0, 5), None),
    (lambda m, x: torch.clamp(x, max=6), None),
    (lambda m, x: torch.clamp(x, min=m.zero), None),
    (lambda m, x: x.clamp(0.5), None),
    (lambda m, x: F.hardtanh(x), None),
    (lambda m, x: m.default_hardtanh(x), None),
]


class Spelled(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.relu6_module, self.default_hardtanh = nn.Hardtanh(0.0, 6.0), nn.Hardtanh()
        self.register_buffer("zero", torch.zeros(()))

    def forward(self, x):
        return self.fn(self, x)


@pytest.mark.parametrize("fn, op", CASES, ids=[str(i) for i in range(len(CASES))])
def test_clamp_spellings(fn, op):
    model = Spelled(fn)
    gm = trace(model)
    modules = dict(gm.named_modules())
    (node,) = [n for n in gm.graph.nodes if n.op.startswith("call_") and n.target != "zero"]
    assert node_op(node, modules) == op
    if op is not None:
        x = torch.linspace(-10, 10, 201)
        reference = F.relu(x) if op == "relu" else F.relu6(x)
        assert torch.equal(model(x), reference)


def test_relu6_module_still_wins_over_its_hardtanh_base():
    gm = trace(nn.Sequential(nn.ReLU6()))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert node_op(node, dict(gm.named_modules())) == "relu6"
