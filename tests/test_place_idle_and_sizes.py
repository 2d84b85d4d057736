"""Placement fixes of issue 33: a BPU region that does no BPU work between CPU ops stays on the CPU,
and size reads (``x.dim()``, ``x.size()``, ``x.shape``, ``x.ndim``, ``x.numel()``) are never BPU ops."""

import pytest
import torch
import torch.ao.quantization as taq
import torch.nn as nn

import qcompiler
from qcompiler.backends.bpu import TABLES
from qcompiler.backends.bpu.support import WORK_OPS
from qcompiler.hybrid import parse_hybrid_dict
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_OP, META_PARTITION, META_REASON, placement
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.place import place
from test_onnx_3d import Block3d  # noqa: E402  (r3d_18's BasicBlock)

IDLE = "does no multiply-accumulate or pooling and sits between CPU ops"


def placements(gm):
    return {n.name: (placement(n), n.meta.get(META_REASON)) for n in gm.graph.nodes
            if n.op not in ("placeholder", "output")}


def placed(model, x, march="bayes", hybrid=None):
    """The place pass alone (before fusion merges an add or a relu into its conv)."""
    gm = trace(model)
    propagate_shapes(gm, x)
    ctx = CompileContext(march=March(march), example_inputs=(x,), hybrid_dict=parse_hybrid_dict(hybrid, model))
    return placements(place(gm, ctx).gm)


class R3dLike(nn.Module):
    """r3d_18, small, with a mean head (tests/test_onnx_3d.py's has AdaptiveAvgPool3d)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 8, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Block3d(8), Block3d(8))
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.layer1(self.stem(x))
        return self.fc(x.mean((2, 3, 4)))


X3 = torch.randn(1, 3, 4, 16, 16)


def test_residual_adds_between_cpu_conv3d_blocks_stay_on_the_cpu():
    gm = qcompiler.partition(R3dLike().eval(), X3, march="bayes")
    got = placements(gm)
    for add in ("add", "add_1"):
        where, why = got[add]
        assert where == "cpu" and why.startswith("add supported on bayes, but on the CPU: its BPU region (add") \
            and IDLE in why, (add, why)
    # only the linear head is on the BPU: one BPU partition, nothing between the blocks
    bpu = sorted({n.meta[META_PARTITION] for n in gm.graph.nodes if placement(n) == "bpu"})
    assert bpu == ["bpu0"]
    assert got["fc"][0] == "bpu"


class ConvAddCpu(nn.Module):
    """BPU conv -> add (with a CPU value) -> CPU op: the add is joined to the conv's region."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.erf(self.conv(x) + torch.erf(x))


X2 = torch.randn(1, 4, 8, 8)


def test_an_add_in_a_region_with_a_conv_is_kept_on_the_bpu():
    got = placed(ConvAddCpu().eval(), X2)
    assert got["conv"][0] == "bpu" and got["add"] == ("bpu", "add supported on bayes")


class LoneAdd(nn.Module):
    def forward(self, x):
        return torch.erf(torch.erf(x) + torch.erf(x * 2).sin())


def test_a_lone_add_between_cpu_ops_moves_and_a_graph_input_or_output_keeps_it():
    got = placed(LoneAdd().eval(), X2)
    assert got["add"][0] == "cpu" and IDLE in got["add"][1]
    # the mul reads the graph input: not between CPU ops, kept
    assert got["mul"] == ("bpu", "mul supported on bayes")

    class AddToOutput(nn.Module):
        def forward(self, x):
            return torch.erf(x) + torch.erf(x)

    got = placed(AddToOutput().eval(), X2)
    assert got["add"] == ("bpu", "add supported on bayes")


class StubbedAdd(nn.Module):
    """The user's own QuantStub / DeQuantStub around an add between CPU ops: the user asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = taq.QuantStub(), taq.DeQuantStub()

    def forward(self, x):
        y = self.quant(torch.erf(x))
        return torch.erf(self.dequant(y + y))


def test_a_region_holding_the_user_s_stubs_is_kept():
    got = placed(StubbedAdd().eval(), X2)
    assert got["add"] == ("bpu", "add supported on bayes")
    assert got["quant"][0] == "bpu"


class HybridConvRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.relu = nn.Conv2d(4, 4, 1), nn.ReLU()

    def forward(self, x):
        return torch.erf(self.relu(self.conv(x)))


def test_hybrid_dict_moves_a_conv_and_the_relu_left_alone_follows():
    """hybrid_dict only forces to the CPU: with the conv forced there the relu does no BPU work."""
    got = placed(HybridConvRelu().eval(), X2)
    assert got["conv"][0] == got["relu"][0] == "bpu"  # the conv is the region's work
    got = placed(HybridConvRelu().eval(), X2, hybrid={"module_name": ["conv"]})
    assert got["conv"] == ("cpu", 'hybrid_dict module_name "conv"')
    assert got["relu"][0] == "cpu" and IDLE in got["relu"][1]


def test_every_work_op_is_a_bpu_op_of_some_march():
    ops = set().union(*(t.rules for t in TABLES.values()))
    assert WORK_OPS <= ops
    assert not {"add", "relu", "reshape", "cat"} & WORK_OPS


def test_the_r3d_like_model_compiles_without_boundaries_around_its_adds():
    m = R3dLike().eval()
    cm = qcompiler.compile(m, X3, march="bayes", calib_data=[torch.randn(1, 3, 4, 16, 16) for _ in range(2)],
                           progress=False)
    assert [p["placement"] for p in cm.partitions] == ["cpu", "bpu"]
    ref = m(X3)
    assert ((cm(X3) - ref).norm() / ref.norm()).item() < 0.05  # only the int8 linear head is quantized


# --------------------------------------------------------------------------- size reads

class SizeReads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y + 1, y.dim(), y.size(), y.shape, y.ndim, y.numel(), y.size(1), torch.numel(y)


def test_size_reads_of_a_bpu_value_are_on_the_cpu():
    gm = qcompiler.partition(SizeReads().eval(), torch.randn(1, 3, 8, 8), march="bayes")
    got = placements(gm)
    reads = {"dim": "conv.dim()", "size": "conv.size()", "getattr_1": "conv.shape", "getattr_2": "conv.ndim",
             "numel": "conv.numel()", "size_1": "conv.size()", "numel_1": "numel(conv)"}
    for name, spelled in reads.items():
        assert got[name] == ("cpu", f"{spelled} is a host-side value, not a tensor: on the CPU"), name
    # negative: the tensor values around them keep their places
    assert got["conv"][0] == got["add"][0] == "bpu"
    cm = qcompiler.compile(SizeReads().eval(), torch.randn(1, 3, 8, 8), march="bayes", progress=False)
    out = cm(torch.randn(1, 3, 8, 8))
    assert out[1:] == (4, torch.Size([1, 4, 8, 8]), torch.Size([1, 4, 8, 8]), 4, 256, 4, 256)


class EncoderBlock(nn.Module):
    """torchvision's ViT EncoderBlock, small: LayerNorm -> MHA(need_weights=False) -> dropout -> add, MLP."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, d), nn.Dropout(0.0))

    def forward(self, input):
        torch._assert(input.dim() == 3, f"Expected (batch_size, seq_length, hidden_dim) got {input.shape}")
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


class TinyViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, 16, 4, 4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.pos_embedding = nn.Parameter(torch.randn(1, 5, 16) * 0.02)
        self.layers = nn.Sequential(EncoderBlock(), EncoderBlock())
        self.ln, self.head = nn.LayerNorm(16), nn.Linear(16, 10)

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, 16, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        torch._assert(x.dim() == 3, "Expected (batch_size, seq_length, hidden_dim)")
        x = self.layers(x + self.pos_embedding)
        return self.head(self.ln(x)[:, 0])


def test_a_vit_with_multihead_attention_compiles_with_its_dim_reads_on_the_cpu():
    torch.manual_seed(0)
    m, x = TinyViT().eval(), torch.randn(2, 3, 8, 8)
    gm = qcompiler.partition(m, x, march="bayes")
    dims = [n for n in gm.graph.nodes if n.meta.get(META_OP) == "size"]
    assert len(dims) == 3 and all(placement(n) == "cpu" for n in dims)
    cm = qcompiler.compile(m, x, march="bayes", calib_data=[torch.randn(2, 3, 8, 8) for _ in range(4)],
                           progress=False)
    ref = m(x)
    assert ((cm(x) - ref).norm() / ref.norm()).item() < 0.2  # int8 linears and conv of a random ViT


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_a_tensor_valued_follower_still_follows_its_bpu_producer(march):
    m = nn.Sequential(nn.Conv2d(4, 4, 1), nn.Identity(), nn.Conv2d(4, 4, 1))
    got = placed(m.eval(), X2, march)
    assert got["_1"] == ("bpu", "follows its producer '_0'")
