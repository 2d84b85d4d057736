"""The place pass alone: per-march op support with reasons, hybrid_dict, followers."""

import pytest
import torch
import torch.ao.quantization as taq
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.errors import PassError, QCompilerWarning
from qcompiler.hybrid import parse_hybrid_dict
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REASON
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.place import place, verify_placed


def placed(model, x, march, hybrid=None, leaves=()):
    gm = trace(model, leaf_module_names=leaves)
    propagate_shapes(gm, x)
    ctx = CompileContext(march=March(march), example_inputs=(x,), hybrid_dict=parse_hybrid_dict(hybrid, model))
    result = place(gm, ctx)
    assert result.modified
    return {n.name: (n.meta[META_PLACEMENT], n.meta[META_REASON]) for n in gm.graph.nodes if META_PLACEMENT in n.meta}


class Seq(nn.Module):
    def __init__(self, *mods):
        super().__init__()
        self.body = nn.Sequential(*mods)

    def forward(self, x):
        return self.body(x)


X = torch.rand(1, 8, 16, 16)


def test_prelu_is_cpu_on_bayes_and_bpu_on_bernoulli2():
    m = Seq(nn.Conv2d(8, 8, 1), nn.PReLU())
    assert placed(m, X, "bayes")["body_1"] == ("cpu", "prelu is not supported on bayes")
    assert placed(m, X, "bernoulli2")["body_1"] == ("bpu", "prelu supported on bernoulli2")


def test_9x9_conv_is_cpu_on_bernoulli2_naming_the_kernel_limit():
    m = Seq(nn.Conv2d(8, 8, 9, padding=4))
    assert placed(m, X, "bernoulli2")["body_0"] == ("cpu", "conv2d: kernel 9x9 > 7 on bernoulli2")
    assert placed(m, X, "bayes")["body_0"] == ("bpu", "conv2d supported on bayes")


@pytest.mark.parametrize(
    "module, x, march, reason",
    [
        (nn.Conv2d(8, 4096, 1), X, "bernoulli2", "conv2d: out channels 4096 > 2048 on bernoulli2"),
        (nn.Conv2d(8, 8, 3, dilation=3, padding=3), X, "bernoulli2", "conv2d: dilation 3 is not a power of 2 on bernoulli2"),
        (nn.Conv2d(8, 8, 3, dilation=32, padding=32), X, "bayes", "conv2d: dilation 32 > 16 on bayes"),
        (nn.ConvTranspose2d(8, 8, 3, stride=3), X, "bernoulli2", "conv_transpose2d: stride 3 not in {2, 4} on bernoulli2"),
        (nn.ConvTranspose2d(8, 8, 3, stride=1), X, "bayes", "conv_transpose2d: stride 1x1 (a transposed conv must upsample) on bayes"),
        (nn.Upsample(scale_factor=3, mode="nearest"), X, "bayes", "interpolate: nearest resize factor 3 is not a power of 2 on bayes"),
        (nn.AvgPool2d(9, stride=1), X, "bernoulli2", "avg_pool2d: pool kernel 9x9 > 7 on bernoulli2"),
        (nn.AdaptiveAvgPool2d(2), X, "bayes", "adaptive_avg_pool2d: adaptive_avg_pool2d to 2x2 is not a global pool on bayes"),
        (nn.Sigmoid(), torch.rand(1, 64, 16, 16), "bernoulli2", "sigmoid: c*h*w = 16384 > 8192 for a lookup-table op on bernoulli2"),
        (nn.Linear(64, 8), torch.rand(1, 16, 64), "bernoulli2", "linear: bernoulli2 runs 4-D (NCHW) tensors only; tensor (1,16,64) is 3-D on bernoulli2"),
        (nn.ReLU(), torch.rand(200, 8, 4, 4), "bernoulli2", "relu: batch 200 > 128 on bernoulli2"),
        (nn.LayerNorm(16), X, "bayes", "layer_norm is not supported on bayes"),
        (nn.Softmax(dim=1), X, "bayes", "softmax is not supported on bayes"),
        (nn.AvgPool2d(3, 2, 1, count_include_pad=False), X, "bayes",
         "avg_pool2d: avg_pool2d with count_include_pad=False and padding (the BPU divides every window by kh*kw) on bayes"),
        (nn.AvgPool2d(2, divisor_override=3), X, "bernoulli2",
         "avg_pool2d: avg_pool2d with divisor_override=3 (the BPU divides by kh*kw) on bernoulli2"),
        # 16 -> ceil(13/2)+1 = 8 windows; the last covers rows 14..16 of 16: a partial window
        (nn.AvgPool2d(3, 2, ceil_mode=True), X, "bayes",
         "avg_pool2d: avg_pool2d with ceil_mode=True and a partial last window (the BPU divides by kh*kw) on bayes"),
        (nn.MaxPool2d(2, return_indices=True), X, "bayes",
         "max_pool2d: max_pool2d with return_indices=True (the indices are not a quantized value) on bayes"),
    ],
)
def test_constraint_failures_give_the_reason(module, x, march, reason):
    assert placed(Seq(module), x, march)["body_0"] == ("cpu", reason)


@pytest.mark.parametrize(
    "module, x, march",
    [
        (nn.Upsample(scale_factor=2, mode="nearest"), X, "bernoulli2"),
        (nn.Upsample(scale_factor=3, mode="bilinear"), X, "bayes"),
        (nn.Sigmoid(), torch.rand(1, 8, 16, 16), "bernoulli2"),
        (nn.Linear(64, 8), torch.rand(1, 16, 64), "bayes"),
        (nn.ConvTranspose2d(8, 8, 4, stride=2), X, "bernoulli2"),
        (nn.MaxPool2d(3, 2, 1), X, "bernoulli2"),
        (nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True), X, "bayes"),
        (nn.AvgPool2d(3, 2, 1), X, "bayes"),  # count_include_pad=True: every window divided by 9
        (nn.AvgPool2d(2, count_include_pad=False), X, "bernoulli2"),  # no padding: nothing to exclude
        (nn.AvgPool2d(2, 2, ceil_mode=True), X, "bayes"),  # 16 = 8 whole windows: ceil_mode changes nothing
    ],
)
def test_supported_configurations_stay_on_bpu(module, x, march):
    assert placed(Seq(module), x, march)["body_0"][0] == "bpu"


class Binary(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x, x.mean(dim=1, keepdim=True))


def test_sub_is_cpu_on_bernoulli2_only():
    m = Binary(torch.sub)
    assert placed(m, X, "bernoulli2")["sub"] == ("cpu", "sub is not supported on bernoulli2")
    assert placed(m, X, "bayes")["sub"][0] == "bpu"


def test_bernoulli2_broadcast_is_nchw_or_nc11_only():
    # x (1,8,16,16) * mean over C (1,1,16,16): not an NC11 operand
    got = placed(Binary(torch.mul), X, "bernoulli2")["mul"]
    assert got == ("cpu", "mul: operands (1,8,16,16) and (1,1,16,16): only NCHW with NCHW or NC11 broadcast on bernoulli2")


class Layout(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = self.conv(x)
        a = y.reshape(1, -1)  # moves data in NCHW
        b = torch.flatten(self.pool(y), 1)  # (1,8,1,1) -> (1,8): folds away
        return a, b


def test_layout_ops_on_bernoulli2_run_on_bpu_only_when_they_fold_away():
    got = placed(Layout(), X, "bernoulli2")
    assert got["reshape"] == ("cpu", "reshape: reshape (1,8,16,16) -> (1,2048) moves data (bernoulli2 runs layout ops on CPU unless they fold away) on bernoulli2")
    assert got["flatten"] == ("bpu", "flatten supported on bernoulli2")
    assert placed(Layout(), X, "bayes")["reshape"] == ("bpu", "reshape supported on bayes")


class Followers(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = taq.QuantStub()
        self.q2 = taq.QuantStub()
        self.conv = nn.Conv2d(8, 8, 1)
        self.id = nn.Identity()
        self.drop = nn.Dropout()
        self.dequant = taq.DeQuantStub()

    def forward(self, x):
        a = self.drop(self.id(self.conv(self.quant(x))))
        b = self.id(F.selu(self.q2(x)))  # a QuantStub feeding only CPU ops is a no-op
        return self.dequant(a), self.dequant(b)


def test_followers_take_their_producers_side():
    got = placed(Followers(), X, "bayes")
    assert got["quant"] == ("bpu", "quantizes the input of the BPU")
    assert got["id_1"] == ("bpu", "follows its producer 'conv'")
    assert got["drop"] == ("bpu", "follows its producer 'id_1'")
    assert got["dequant"] == ("bpu", "dequantizes the BPU output")
    assert got["q2"] == ("cpu", "QuantStub before CPU ops only is a no-op")
    assert got["id_2"] == ("cpu", "follows its producer 'selu'")
    assert got["dequant_1"] == ("cpu", "DeQuantStub after CPU op 'id_2' is a no-op")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return F.relu(self.conv(x))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x):
        return self.b(self.a(x))


def test_hybrid_module_type_covers_functionals_inside_and_module_name_wins():
    got = placed(TwoBlocks(), X, "bayes", {"module_type": [Block], "module_name": ["b"]})
    assert got["a_conv"] == ("cpu", "hybrid_dict module_type Block")
    assert got["relu"] == ("cpu", "hybrid_dict module_type Block")  # functional inside a Block
    assert got["b_conv"] == ("cpu", 'hybrid_dict module_name "b"')
    assert got["relu_1"] == ("cpu", 'hybrid_dict module_name "b"')


def test_hybrid_module_name_of_a_leaf_only_forces_that_module():
    got = placed(TwoBlocks(), X, "bayes", {"module_name": ["a.conv"]})
    assert got["a_conv"] == ("cpu", 'hybrid_dict module_name "a.conv"')
    assert got["relu"] == ("bpu", "relu supported on bayes")  # a sibling in the same block is not forced


def test_hybrid_module_type_matching_nothing_warns():
    with pytest.warns(QCompilerWarning, match="no module of type LSTM"):
        placed(TwoBlocks(), X, "bayes", {"module_type": [nn.LSTM]})


class Gate(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.conv(x))


def test_non_traceable_leaf_runs_on_cpu():
    got = placed(Gated(), X, "bayes", leaves=["gate"])
    assert got["gate"] == ("cpu", "module 'gate' (Gate) has no BPU implementation")


def test_second_run_reports_unmodified():
    gm = trace(Seq(nn.Conv2d(8, 8, 1)))
    propagate_shapes(gm, X)
    ctx = CompileContext(march=March.BAYES)
    assert place(gm, ctx).modified
    assert not place(gm, ctx).modified


class Clamped(nn.Module):
    def __init__(self, lo, hi):
        super().__init__()
        self.conv, self.lo, self.hi, self.ht = nn.Conv2d(8, 8, 1), lo, hi, nn.Hardtanh(-1.0, 1.0)

    def forward(self, x):
        y = self.conv(x)
        return torch.clamp(y, self.lo, self.hi) + self.ht(y)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("lo, hi, where", [(0, None, "bpu"), (0.0, 6.0, "bpu"), (0, 5, "cpu"), (-1, 6, "cpu")])
def test_clamp_is_a_bpu_relu_only_with_relu_bounds(march, lo, hi, where):
    p = placed(Clamped(lo, hi), X, march)
    assert p["clamp"][0] == where
    if where == "cpu":
        assert p["clamp"][1] == ("call_function clamp has no BPU implementation; a clamp runs on the BPU only "
                                 "as a ReLU (bounds 0, none) or a ReLU6 (bounds 0, 6)")
    else:
        assert p["clamp"][1] == f"{'relu' if hi is None else 'relu6'} supported on {march}"
    assert p["ht"] == ("cpu", "module 'ht' (Hardtanh) has no BPU implementation; a clamp runs on the BPU only "
                              "as a ReLU (bounds 0, none) or a ReLU6 (bounds 0, 6)")


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv_with_non_zero_padding_mode_is_cpu(march, mode):
    """The BPU pads with zeros: converting these would silently zero-pad the borders."""
    for padding in (1, "same"):
        p = placed(Seq(nn.Conv2d(8, 8, 3, padding=padding, padding_mode=mode)), X, march)
        assert p["body_0"] == ("cpu", f"conv2d: padding_mode='{mode}' (the BPU pads with zeros) on {march}")
    # without padding the mode changes nothing: BPU
    assert placed(Seq(nn.Conv2d(8, 8, 3, padding_mode=mode)), X, march)["body_0"][0] == "bpu"


def test_verifier_raises_pass_errors_not_asserts():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    gm = trace(m)
    ctx = CompileContext(march=March.BAYES, example_inputs=(torch.rand(1, 3, 8, 8),))
    place(gm, ctx)
    verify_placed(gm, ctx)  # a placed graph passes
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    reason = node.meta.pop(META_REASON)
    with pytest.raises(PassError, match=f"place: node '{node.name}' is placed without a reason"):
        verify_placed(gm, ctx)
    node.meta[META_REASON] = reason
    del node.meta[META_PLACEMENT]
    with pytest.raises(PassError, match=f"place: node '{node.name}' has no placement"):
        verify_placed(gm, ctx)


class ConstantPassedOn(nn.Module):
    """A parameter through a passthrough op (``clone``, ``contiguous``) into a BPU sub."""

    def __init__(self, method):
        super().__init__()
        self.method = method
        self.conv, self.head = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)
        self.p = nn.Parameter(torch.full((1, 8, 1, 1), 0.25))

    def forward(self, x):
        return self.head(self.conv(x) - getattr(self.p, self.method)())


@pytest.mark.parametrize("method", ["clone", "contiguous"])
def test_a_passthrough_of_a_constant_is_cpu_and_the_model_compiles(method):
    """On the BPU it read an unquantized constant: convert raised 'input 0 is not a quantized BPU value'."""
    import qcompiler

    model = ConstantPassedOn(method).eval()
    where = placed(model, X, "bayes")
    assert where[method] == ("cpu", "identity of the constant 'p': a constant reaches the BPU only as an operand")
    assert where["p"][0] == "cpu" and where["sub"][0] == "bpu"
    cm = qcompiler.compile(model, (X,), march="bayes", progress=False)
    assert torch.equal(cm(X), cm.converted(X)) and (cm(X) - model(X)).abs().max() < 0.05
