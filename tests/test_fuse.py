"""Tests of the fuse pass (passes/fuse.py) and the fused modules (qcompiler/nn/fused.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.nn.quantized import FloatFunctional

import qcompiler
from qcompiler.errors import PassError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import (
    META_FUSED_FROM,
    META_OP,
    META_PLACEMENT,
    META_REASON,
    META_SCOPE,
    META_TENSOR,
    set_placement,
)
from qcompiler.ir.ops import describe_target
from qcompiler.nn import FusedConv2d, FusedLinear, FusedModule, build_fused, fold_bn
from qcompiler.passes.base import CompileContext
from qcompiler.passes.fuse import FUSE, PATTERNS, fuse

CTX = CompileContext(march=qcompiler.March.BAYES)


# ---------------------------------------------------------------- helpers


def set_bn_stats(bn: nn.Module, seed: int) -> nn.Module:
    """Give a BN non-trivial running statistics and affine parameters."""
    g = torch.Generator().manual_seed(seed)
    n = bn.num_features
    with torch.no_grad():
        if bn.track_running_stats:
            bn.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.randn(n, generator=g))
            bn.bias.copy_(torch.randn(n, generator=g))
    return bn


def init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic weights and BN statistics; eval mode."""
    torch.manual_seed(seed)
    for i, m in enumerate(model.modules()):
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            m.reset_parameters()
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            set_bn_stats(m, seed + i)
    return model.eval()


def inputs(*shapes: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g) for s in shapes)


def traced(model: nn.Module, args: tuple, **kw) -> fx.GraphModule:
    gm = trace(copy.deepcopy(model), **kw)
    propagate_shapes(gm, args)
    return gm


def run_fuse(gm: fx.GraphModule):
    result = FUSE(gm, CTX)
    result.gm.graph.lint()
    FUSE.verify(result.gm, CTX)
    return result


def calls(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The graph's calls as (node name, what it calls); fused modules show their pattern."""
    modules = dict(gm.named_modules())
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_module" and isinstance(modules[n.target], FusedModule):
            mod = modules[n.target]
            out.append((n.name, f"{type(mod).__name__}[{mod.extra_repr()}]"))
        else:
            out.append((n.name, describe_target(n, modules)))
    return out


def node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def check_close(gm: fx.GraphModule, model: nn.Module, args: tuple) -> None:
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), model(*args), rtol=1e-5, atol=1e-6)


def check_equal(gm: fx.GraphModule, model: nn.Module, args: tuple) -> None:
    with torch.no_grad():
        out, ref = gm(*args), model(*args)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------- models


class ConvBN(nn.Module):
    def __init__(self, relu: bool = False, groups: int = 1, bias: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, groups=groups, bias=bias)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True) if relu else None

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.relu(y) if self.relu is not None else y


class ConvAct(nn.Module):
    """conv then one of the activation spellings, no BN."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.act = {"module": nn.ReLU(inplace=True), "module6": nn.ReLU6(), "hardtanh_module": nn.Hardtanh(0, 6)}.get(how)

    def forward(self, x):
        y = self.conv(x)
        if self.act is not None:
            return self.act(y)
        if self.how == "F.relu":
            return F.relu(y)
        if self.how == "F.relu_inplace":
            return F.relu(y, inplace=True)
        if self.how == "torch.relu":
            return torch.relu(y)
        if self.how == "method":
            return y.relu()
        if self.how == "clamp":
            return y.clamp(min=0)
        if self.how == "F.hardtanh":
            return F.hardtanh(y, 0.0, 6.0)
        assert self.how == "F.relu6"
        return F.relu6(y)


class ConvBNAdd(nn.Module):
    """bn(conv(x)) added to ``skip`` in one of the add spellings, conv left or right."""

    def __init__(self, how: str, conv_left: bool, relu: bool) -> None:
        super().__init__()
        self.how, self.conv_left = how, conv_left
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.ff = FloatFunctional()
        self.relu = nn.ReLU() if relu else None

    def forward(self, x, skip):
        y = self.bn(self.conv(x))
        a, b = (y, skip) if self.conv_left else (skip, y)
        if self.how == "op":
            z = a + b
        elif self.how == "torch.add":
            z = torch.add(a, b)
        elif self.how == "method":
            z = a.add(b)
        else:
            z = self.ff.add(a, b)
        return self.relu(z) if self.relu is not None else z


class Residual(nn.Module):
    """ResNet-style: relu(bn1(conv1(x)) + bn2(conv2(x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(4, 8, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        a = self.bn1(self.conv1(x))
        b = self.bn2(self.conv2(x))
        return self.relu(a + b)


class DeconvBNReLU(nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.deconv = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups)
        self.bn = nn.BatchNorm2d(6)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.deconv(x)))


class LinearBNReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return F.relu(self.bn(self.fc(x)))


# ---------------------------------------------------------------- positive patterns


@pytest.mark.parametrize(
    "model, expected",
    [
        (ConvBN(), [("conv", "FusedConv2d[conv2d+batch_norm]")]),
        (ConvBN(relu=True), [("conv", "FusedConv2d[conv2d+batch_norm+relu]")]),
        (ConvBN(relu=True, groups=4, bias=True), [("conv", "FusedConv2d[conv2d+batch_norm+relu]")]),
    ],
    ids=["conv_bn", "conv_bn_relu_inplace", "depthwise_bias_bn_relu"],
)
def test_conv_bn(model, expected):
    model = init(model)
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == expected
    check_close(gm, model, args)
    fused = gm.get_submodule("conv")
    assert isinstance(fused.op, nn.Conv2d) and fused.bias is not None
    assert fused.op.groups == model.conv.groups


@pytest.mark.parametrize(
    "how, act",
    [
        ("module", "relu"),
        ("module6", "relu6"),
        ("F.relu", "relu"),
        ("F.relu_inplace", "relu"),
        ("torch.relu", "relu"),
        ("method", "relu"),
        ("F.relu6", "relu6"),
        ("clamp", "relu"),
        ("F.hardtanh", "relu6"),
        ("hardtanh_module", "relu6"),
    ],
)
def test_conv_act_is_bit_exact(how, act):
    model = init(ConvAct(how))
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == [("conv", f"FusedConv2d[conv2d+{act}]")]
    check_equal(gm, model, args)
    assert gm.get_submodule("conv").fused_from == ("conv2d", act)


@pytest.mark.parametrize("relu", [True, False], ids=["relu", "norelu"])
@pytest.mark.parametrize("conv_left", [True, False], ids=["conv_left", "conv_right"])
@pytest.mark.parametrize("how", ["op", "torch.add", "method", "FloatFunctional"])
def test_conv_bn_add(how, conv_left, relu):
    model = init(ConvBNAdd(how, conv_left, relu))
    args = inputs((2, 4, 5, 5), (2, 4, 5, 5))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    pattern = "conv2d+batch_norm+add" + ("+relu" if relu else "")
    assert calls(gm) == [("conv", f"FusedConv2d[{pattern}]")]
    assert [a.name for a in node(gm, "conv").args] == ["x", "skip"]
    check_close(gm, model, args)


def test_residual_block_fuses_both_branches_in_order():
    model = init(Residual())
    args = inputs((1, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    # conv1 takes the add; conv2+bn2 fuses alone and stays before the add it feeds
    assert calls(gm) == [
        ("conv2", "FusedConv2d[conv2d+batch_norm]"),
        ("conv1", "FusedConv2d[conv2d+batch_norm+add+relu]"),
    ]
    assert [a.name for a in node(gm, "conv1").args] == ["x", "conv2"]
    assert node(gm, "conv1").meta[META_FUSED_FROM] == ("conv1", "bn1", "add", "relu")
    check_close(gm, model, args)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_bn_relu(groups):
    model = init(DeconvBNReLU(groups))
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == [("deconv", "FusedConvTranspose2d[conv_transpose2d+batch_norm+relu]")]
    check_close(gm, model, args)
    assert gm.get_submodule("deconv").op.groups == groups


def test_linear_bn1d_relu():
    model = init(LinearBNReLU())
    args = inputs((4, 16))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == [("fc", "FusedLinear[linear+batch_norm1d+relu]")]
    assert isinstance(gm.get_submodule("fc"), FusedLinear)
    check_close(gm, model, args)


def test_linear_bn1d_on_3d_output_is_not_folded():
    """BatchNorm1d on (N, L, C) normalizes L, not the linear's features: only nothing fuses."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x):
            return F.relu(self.bn(self.fc(x)))

    model = init(M())
    args = inputs((2, 6, 4))
    gm = traced(model, args)
    assert not run_fuse(gm).modified
    assert calls(gm) == [("fc", "Linear"), ("bn", "BatchNorm1d"), ("relu", "F.relu")]
    check_equal(gm, model, args)


def test_train_mode_bn_folds_running_stats():
    model = init(ConvBN(relu=True)).train()
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    check_close(gm, model.eval(), args)


def test_fused_node_meta():
    model = init(ConvBN(relu=True))
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    scope = node(gm, "conv").meta[META_SCOPE]
    last_tensor = node(gm, "relu").meta[META_TENSOR]
    set_placement(node(gm, "conv"), "bpu", "conv2d supported")
    set_placement(node(gm, "bn"), "bpu", "bn supported")
    set_placement(node(gm, "relu"), "bpu", "relu supported")
    run_fuse(gm)
    n = node(gm, "conv")
    assert n.meta[META_SCOPE] == scope
    assert n.meta[META_TENSOR] == last_tensor
    assert n.meta[META_FUSED_FROM] == ("conv", "bn", "relu")
    assert n.meta[META_OP] == "conv2d"
    assert (n.meta[META_PLACEMENT], n.meta[META_REASON]) == ("bpu", "conv2d supported")
    assert "bn" not in dict(gm.named_modules())  # the folded BN is gone from the GraphModule


# ---------------------------------------------------------------- negative patterns


def test_conv_output_used_twice_before_bn():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.relu = nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.relu(self.bn(y)) + y

    model = init(M())
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert not run_fuse(gm).modified
    assert calls(gm) == [("conv", "Conv2d"), ("bn", "BatchNorm2d"), ("relu", "ReLU"), ("add", "operator.add")]
    check_equal(gm, model, args)


def test_shared_conv_module_is_not_fused():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return F.relu(self.conv(F.relu(self.conv(x))))

    model = init(M())
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert not run_fuse(gm).modified
    assert calls(gm) == [("conv", "Conv2d"), ("relu", "F.relu"), ("conv_1", "Conv2d"), ("relu_1", "F.relu")]
    check_equal(gm, model, args)


def test_conv_weight_read_elsewhere_is_not_fused():
    """Folding would change what ``self.conv.weight`` reads."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x)) * self.conv.weight.mean()

    model = init(M())
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert not run_fuse(gm).modified
    check_equal(gm, model, args)


def test_conv_inside_a_leaf_called_whole_is_not_fused():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.conv(x) * 2

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blk = Block()

        def forward(self, x):
            return F.relu(self.blk.conv(self.blk(x)))

    model = init(M())
    args = inputs((1, 4, 3, 3))
    gm = traced(model, args, leaf_module_names=["blk"])
    assert not run_fuse(gm).modified
    check_equal(gm, model, args)


def test_bn_without_running_stats_is_not_folded():
    model = ConvBN(relu=True)
    model.bn = nn.BatchNorm2d(8, track_running_stats=False)
    model = init(model)
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    assert not run_fuse(gm).modified
    check_equal(gm, model, args)


@pytest.mark.parametrize(
    "conv_where, relu_where, fused",
    [("bpu", "cpu", False), ("bpu", None, False), (None, "cpu", False), ("cpu", "cpu", True), ("bpu", "bpu", True)],
)
def test_placement_must_match(conv_where, relu_where, fused):
    model = init(ConvAct("module"))
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    for name, where in (("conv", conv_where), ("act", relu_where)):
        if where is not None:
            set_placement(node(gm, name), where, "by hand")
    assert run_fuse(gm).modified == fused
    expected = [("conv", "FusedConv2d[conv2d+relu]")] if fused else [("conv", "Conv2d"), ("act", "ReLU")]
    assert calls(gm) == expected
    check_equal(gm, model, args)


def test_add_operand_depending_on_conv():
    """y = conv(x); y + relu(y): the conv has two users, nothing fuses, no cycle."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return y + F.relu(y)

    model = init(M())
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert not run_fuse(gm).modified
    assert calls(gm) == [("conv", "Conv2d"), ("relu", "F.relu"), ("add", "operator.add")]
    check_equal(gm, model, args)


def test_add_of_a_value_with_itself():
    """bn(conv(x)) added to itself: the add's other operand is the pattern's own value."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn(self.conv(x))
            return F.relu(y + y)

    model = init(M())
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == [("conv", "FusedConv2d[conv2d+batch_norm]"), ("add", "operator.add"), ("relu", "F.relu")]
    check_close(gm, model, args)


@pytest.mark.parametrize("how", ["method", "functional"])
def test_add_not_fused_over_in_place_change_of_the_conv_input(how):
    """With the add fused, the conv would run at the add's place and read ``h`` after relu_."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            h = x.clone()
            y = self.bn(self.conv(h))
            if how == "method":
                h.relu_()
            else:
                F.relu(h, inplace=True)
            return y + h

    model = init(M())
    args = inputs((2, 4, 5, 5))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    relu = ("relu_", ".relu_") if how == "method" else ("relu", "F.relu")
    assert calls(gm) == [
        ("clone", ".clone"),
        ("conv", "FusedConv2d[conv2d+batch_norm]"),
        relu,
        ("add", "operator.add"),
    ]
    check_close(gm, model, args)


# ---------------------------------------------------------------- pass properties


# ---------------------------------------------------------------- identities in a pattern


class ConvIdentities(nn.Module):
    """conv -> [identity] -> bn -> [identity] -> relu, the identities spelled as asked."""

    def __init__(self, before_bn: str = "", before_relu: str = "") -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.id1, self.id2 = nn.Identity(), nn.Identity()
        self.before_bn, self.before_relu = before_bn, before_relu

    def _skip(self, y, how: str, module: nn.Module):
        for part in how.split("+") if how else ():
            y = module(y) if part == "module" else y.contiguous()
        return y

    def forward(self, x):
        y = self._skip(self.conv(x), self.before_bn, self.id1)
        return self.relu(self._skip(self.bn(y), self.before_relu, self.id2))


@pytest.mark.parametrize(
    "before_bn, before_relu",
    [("module", ""), ("", "module"), ("module", "module"), ("contiguous", "module+contiguous")],
)
def test_identities_inside_a_pattern_are_looked_through(before_bn, before_relu):
    model = init(ConvIdentities(before_bn, before_relu))
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == [("conv", "FusedConv2d[conv2d+batch_norm+relu]")]
    assert node(gm, "conv").meta[META_FUSED_FROM] == ("conv", "bn", "relu")
    assert not hasattr(gm, "id1") and not hasattr(gm, "id2")  # no node calls them any more
    check_close(gm, model, args)


def test_torch_ao_fuse_modules_output_fuses_like_the_original():
    """torch.ao's fuse_modules folds BN into the conv and leaves nn.Identity where the BN was:
    the conv must still take its residual add and ReLU (its output is not quantized alone)."""
    from torch.ao.quantization import fuse_modules

    model = init(Residual())
    ao = fuse_modules(copy.deepcopy(model), [["conv1", "bn1"], ["conv2", "bn2"]])
    assert isinstance(ao.bn1, nn.Identity) and isinstance(ao.bn2, nn.Identity)
    args = inputs((1, 4, 6, 6))
    gm = traced(ao, args)
    assert run_fuse(gm).modified
    # conv2 alone has nothing left to fuse (its BN is folded already); conv1 takes the add and ReLU
    assert calls(gm) == [("conv2", "Conv2d"), ("bn2", "Identity"), ("conv1", "FusedConv2d[conv2d+add+relu]")]
    assert node(gm, "conv1").meta[META_FUSED_FROM] == ("conv1", "add", "relu")
    check_close(gm, model, args)


@pytest.mark.parametrize("blocker", ["hook", "two_users", "placement", "dropout"])
def test_identities_that_are_not_looked_through(blocker):
    """The rule must not fire where dropping the identity would change what runs or who sees it."""
    model = init(ConvAct("module"))

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.act = model.conv, model.act
            self.mid = nn.Dropout(0.5) if blocker == "dropout" else nn.Identity()
            if blocker == "hook":
                self.mid.register_forward_hook(lambda m, i, o: None)

        def forward(self, x):
            y = self.mid(self.conv(x))
            z = self.act(y)
            return (z, y) if blocker == "two_users" else z

    m = M().eval()
    args = inputs((2, 4, 6, 6))
    gm = traced(m, args)
    if blocker == "placement":
        set_placement(node(gm, "mid"), "cpu", "by hand")
        set_placement(node(gm, "conv"), "bpu", "by hand")
        set_placement(node(gm, "act"), "bpu", "by hand")
    assert not run_fuse(gm).modified
    assert [name for name, _ in calls(gm)] == ["conv", "mid", "act"]
    with torch.no_grad():
        for out, ref in zip(*(torch.utils._pytree.tree_leaves(f(*args)) for f in (gm, m))):
            assert torch.equal(out, ref)


def test_identity_after_a_pattern_is_kept():
    """conv -> bn -> identity (-> output): the trailing identity is not part of the pattern."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.out = nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.Identity()

        def forward(self, x):
            return self.out(self.bn(self.conv(x)))

    model = init(M())
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    assert calls(gm) == [("conv", "FusedConv2d[conv2d+batch_norm]"), ("out", "Identity")]
    check_close(gm, model, args)


def _snapshot(model: nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [(name, type(m)) for name, m in model.named_modules()],
    )


def _assert_same(model: nn.Module, snap) -> None:
    state, mods = snap
    now = model.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], state[k]) for k in state)
    assert [(name, type(m)) for name, m in model.named_modules()] == mods


def test_original_model_untouched():
    model = init(Residual())
    snap = _snapshot(model)
    args = inputs((1, 4, 6, 6))
    gm = traced(model, args)  # traces a deepcopy
    assert run_fuse(gm).modified
    _assert_same(model, snap)


def test_original_model_untouched_even_when_traced_directly():
    """The GraphModule shares leaf modules with the model; fuse must still not mutate them."""
    model = init(ConvBNAdd("op", True, True))
    snap = _snapshot(model)
    conv = model.conv
    args = inputs((2, 4, 5, 5), (2, 4, 5, 5))
    gm = trace(model)
    propagate_shapes(gm, args)
    assert run_fuse(gm).modified
    _assert_same(model, snap)
    assert model.conv is conv and isinstance(model.bn, nn.BatchNorm2d)


def test_second_run_is_a_no_op():
    model = init(Residual())
    args = inputs((1, 4, 6, 6))
    gm = traced(model, args)
    assert run_fuse(gm).modified
    code = gm.code
    assert not run_fuse(gm).modified
    assert gm.code == code


def test_deterministic():
    model = init(Residual())
    args = inputs((1, 4, 6, 6))
    a, b = traced(model, args), traced(model, args)
    fuse(a, CTX)
    fuse(b, CTX)
    assert a.code == b.code
    assert [n.meta.get(META_FUSED_FROM) for n in a.graph.nodes] == [n.meta.get(META_FUSED_FROM) for n in b.graph.nodes]


def test_verifier_requires_fused_from():
    model = init(ConvBN(relu=True))
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    run_fuse(gm)
    del node(gm, "conv").meta[META_FUSED_FROM]
    with pytest.raises(PassError, match="qc_fused_from"):
        FUSE.verify(gm, CTX)


def test_verifier_finds_unfused_pattern():
    model = init(ConvBN(relu=True))
    args = inputs((2, 4, 6, 6))
    gm = traced(model, args)
    with pytest.raises(PassError, match="left unfused at nodes conv, bn, relu"):
        FUSE.verify(gm, CTX)


def test_pattern_table_shape():
    assert {p.base for p in PATTERNS} == {"conv2d", "conv_transpose2d", "linear"}
    rows = [(p.base, p.bn, p.add, p.acts) for p in PATTERNS]
    assert ("conv2d", "batch_norm", True, ("relu",)) in rows


# ---------------------------------------------------------------- fused modules


def test_fused_module_api():
    conv = init(nn.Sequential(nn.Conv2d(2, 3, 1), set_bn_stats(nn.BatchNorm2d(3), 5)))
    fused = build_fused(conv[0], bn=conv[1], act="relu", with_add=True)
    assert isinstance(fused, FusedConv2d) and fused.qc_leaf and fused.qc_op == "conv2d"
    assert fused.fused_from == ("conv2d", "batch_norm", "add", "relu")
    assert "conv2d+batch_norm+add+relu" in repr(fused)
    assert fused.weight is fused.op.weight and fused.bias is fused.op.bias
    x, other = inputs((1, 2, 3, 3), (1, 3, 3, 3))
    with torch.no_grad():
        torch.testing.assert_close(fused(x, other), F.relu(conv(x) + other), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError):
        fused(x)


def test_fold_bn_leaves_inputs_alone_and_adds_bias():
    lin = nn.Linear(3, 4, bias=False)
    bn = set_bn_stats(nn.BatchNorm1d(4), 3)
    before = (lin.weight.clone(), {k: v.clone() for k, v in bn.state_dict().items()})
    folded = fold_bn(lin, bn)
    assert folded is not lin and folded.bias is not None and lin.bias is None
    assert torch.equal(lin.weight, before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in bn.state_dict().items())
    x = inputs((5, 3))[0]
    with torch.no_grad():
        torch.testing.assert_close(folded(x), bn.eval()(lin(x)), rtol=1e-5, atol=1e-6)


# ------------------------------------------------- fused add and activation in place


class _AtenCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops a region runs (names like "hardtanh_")."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


def _aten_calls(fn) -> tuple[torch.Tensor, list[str]]:
    with _AtenCalls() as calls:
        out = fn()
    return out, calls.names


def _fused_relu6_add() -> tuple[FusedModule, nn.Module]:
    seq = init(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), set_bn_stats(nn.BatchNorm2d(3), 7)))
    return build_fused(seq[0], bn=seq[1], act="relu6", with_add=True), seq


@pytest.mark.parametrize("act", ["relu", "relu6"])
@pytest.mark.parametrize("with_add", [False, True])
def test_fused_add_and_activation_run_in_place_without_grad(act, with_add):
    """Without autograd the add and the activation write the conv's fresh output (no new
    activation per step) and give the same bits as the out-of-place ops."""
    seq = init(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), set_bn_stats(nn.BatchNorm2d(3), 7)))
    fused = build_fused(seq[0], bn=seq[1], act=act, with_add=with_add)
    x, other = inputs((2, 2, 5, 5), (2, 3, 5, 5))
    extra = (other,) if with_add else ()
    with torch.no_grad():
        y = fused.op(x)
        want = F.relu(y + other) if act == "relu" and with_add else (
            F.relu(y) if act == "relu" else F.relu6(y + other if with_add else y))
        got, names = _aten_calls(lambda: fused(x, *extra))
    assert torch.equal(got, want)
    act_op = "relu" if act == "relu" else "hardtanh"
    assert f"{act_op}_" in names and act_op not in names, names
    assert ("add_" in names and "add" not in names) if with_add else not any(n.startswith("add") for n in names)


def test_fused_ops_stay_out_of_place_under_autograd():
    """QAT training: autograd records the conv's output, so nothing is written in place and the
    gradients are those of the unfused layers."""
    fused, _ = _fused_relu6_add()
    x, other = inputs((2, 2, 5, 5), (2, 3, 5, 5))
    x.requires_grad_(True)
    got, names = _aten_calls(lambda: fused(x, other))
    assert "hardtanh" in names and "hardtanh_" not in names and "add_" not in names, names
    got.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.relu6(fused.op(x2) + other).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_fused_ops_stay_out_of_place_when_the_conv_output_was_shown_to_a_hook():
    """A forward hook on the base layer may keep the tensor it saw: it must not change after."""
    fused, _ = _fused_relu6_add()
    kept = []
    fused.op.register_forward_hook(lambda mod, args, out: kept.append(out))
    x, other = inputs((2, 2, 5, 5), (2, 3, 5, 5))
    with torch.no_grad():
        before = fused.op(x).clone()
        kept.clear()
        got = fused(x, other)
    assert torch.equal(kept[0], before)
    assert torch.equal(got, F.relu6(before + other))


def test_fused_add_out_of_place_where_in_place_would_change_the_result():
    """``y.add_(other)`` keeps y's shape and dtype: a broadcasting or wider operand adds out of place."""
    fused, _ = _fused_relu6_add()
    x = inputs((1, 2, 5, 5))[0]
    with torch.no_grad():
        y = fused.op(x)
        wide = inputs((3, 3, 5, 5))[0]  # broadcasts y from batch 1 to 3
        assert torch.equal(fused(x, wide), F.relu6(y + wide))
        as_f64 = inputs((1, 3, 5, 5))[0].double()
        got = fused(x, as_f64)
        assert got.dtype == torch.float64 and torch.equal(got, F.relu6(y + as_f64))


def test_fused_activation_subclass_is_called_not_replaced():
    """Only nn.ReLU / nn.ReLU6 themselves are applied in place; a subclass runs its own forward."""

    class LeakyAsReLU(nn.ReLU):
        def forward(self, x):
            return F.leaky_relu(x, 0.5)

    fused, _ = _fused_relu6_add()
    fused.act = LeakyAsReLU()
    x, other = inputs((2, 2, 5, 5), (2, 3, 5, 5))
    with torch.no_grad():
        assert torch.equal(fused(x, other), F.leaky_relu(fused.op(x) + other, 0.5))


def test_fused_add_under_vmap_stays_out_of_place():
    """Review: vmap over ``other`` hides its batch dim from the shape check; ``y.add_`` then failed."""
    fused, _ = _fused_relu6_add()
    x, others = inputs((1, 2, 5, 5), (3, 1, 3, 5, 5))
    with torch.no_grad():
        got = torch.func.vmap(lambda o: fused(x, o))(others)
        want = torch.stack([F.relu6(fused.op(x) + o) for o in others])
    assert torch.equal(got, want)


def test_fused_activation_with_a_hook_of_its_own_is_called():
    """Review: a hook on ``act`` stopped firing when the activation ran as ``F.hardtanh_``."""
    fused, _ = _fused_relu6_add()
    seen = []
    fused.act.register_forward_hook(lambda mod, args, out: seen.append(out.clone()))
    x, other = inputs((2, 2, 5, 5), (2, 3, 5, 5))
    with torch.no_grad():
        got = fused(x, other)
    assert len(seen) == 1 and torch.equal(seen[0], got)
