"""Canonical op names (qcompiler.ir.ops): clamps are ReLU / ReLU6 only for the exact bounds."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.ir import trace
from qcompiler.ir.ops import node_op
from qcompiler.ir.shape_prop import propagate_shapes

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


# In-place twins: (op, value of x, of y) -> the twin's canonical op, once shape propagation has recorded
# one dtype for every tensor involved
INPLACE = [
    (lambda x, y: x.add_(y), torch.float32, "add"),
    (lambda x, y: x.mul_(2.0), torch.float32, "mul"),
    (lambda x, y: x.relu_(), torch.float32, "relu"),
    (lambda x, y: x.atan_(), torch.float32, "atan"),
    (lambda x, y: x.clamp_(0, 6), torch.float32, "relu6"),
    (lambda x, y: x.clamp_min_(0), torch.float32, "relu"),
    (lambda x, y: x.clamp_(-1, 1), torch.float32, None),  # a clamp, but no ReLU's bounds
    (lambda x, y: x.gt_(y), torch.float32, None),  # in place, 0 / 1 in x's dtype: the twin gives bool
    (lambda x, y: x.logical_not_(), torch.float32, None),
    (lambda x, y: x.add_(y), torch.float16, None),  # x.add(y) would give float32, x.add_(y) float16
    (lambda x, y: x.fill_(1.0), torch.float32, None),  # no twin
]


class TwoInputs(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


@pytest.mark.parametrize("fn, dtype, op", INPLACE, ids=[str(i) for i in range(len(INPLACE))])
def test_an_in_place_method_is_its_twins_op_when_every_tensor_has_one_dtype(fn, dtype, op):
    gm = trace(TwoInputs(fn))
    modules = dict(gm.named_modules())
    (node,) = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert node_op(node, modules) is None  # no shapes propagated: nothing says the dtypes agree
    x, y = torch.randn(4, 5).to(dtype), torch.randn(4, 5)
    propagate_shapes(gm, (x, y))
    assert node_op(node, modules) == op
    if op is not None:  # the twin computes the same value in the same dtype
        args = [y if isinstance(a, fx.Node) else a for a in node.args[1:]]
        twin = getattr(torch.Tensor, node.target[:-1])(x, *args, **node.kwargs)
        assert twin.dtype == x.dtype and torch.equal(fn(x.clone(), y), twin)
