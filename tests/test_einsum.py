"""passes/einsum.py: einsum as sums, permutes, reshapes and matmul (golden code), equal to torch.einsum
within float32 summation order (a hypothesis property over random equations and shapes); the
equations it does not handle stay einsum and go to the CPU with the reason."""

from __future__ import annotations

import string

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import qcompiler
from qcompiler.errors import PassError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_REASON, META_REWRITE
from qcompiler.march import March
from qcompiler.passes.base import CompileContext, PassManager
from qcompiler.passes.einsum import EINSUM_TO_MATMUL, rewrite_einsum, verify_einsum
from qcompiler.passes.pipeline import PARTITION_PIPELINE

# torch.einsum may contract in another order than a matmul of the merged dims: float32 rounding only
RTOL, ATOL = 1e-5, 1e-5


class Einsum1(nn.Module):
    def __init__(self, equation: str):
        super().__init__()
        self.equation = equation

    def forward(self, a):
        return torch.einsum(self.equation, a)


class Einsum2(Einsum1):
    def forward(self, a, b):
        return torch.einsum(self.equation, a, b)


class Einsum3(Einsum1):
    def forward(self, a, b, c):
        return torch.einsum(self.equation, [a, b, c])  # the list spelling


def Einsum(equation: str) -> nn.Module:
    return (Einsum1, Einsum2, Einsum3)[equation.split("->")[0].count(",")](equation)


def _rewritten(equation, *xs):
    gm = trace(Einsum(equation))
    propagate_shapes(gm, xs)
    ctx = CompileContext(march=March.BAYES, example_inputs=xs)
    return gm, rewrite_einsum(gm, ctx), ctx


def _body(gm) -> list[str]:
    return [line.strip() for line in gm.code.strip().splitlines()[1:] if line.strip()]


def _einsums(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.einsum]


def test_attention_scores_are_one_permute_and_a_matmul():
    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    gm, result, ctx = _rewritten("bqc,bkc->bqk", q, k)
    assert result.modified
    assert _body(gm) == [
        "permute = b.permute((0, 2, 1));  b = None",
        "matmul = torch.matmul(a, permute);  a = permute = None",
        "return matmul",
    ]
    torch.testing.assert_close(gm(q, k), torch.einsum("bqc,bkc->bqk", q, k), rtol=RTOL, atol=ATOL)
    q3, k3 = torch.randn(3, 5, 8), torch.randn(3, 7, 8)  # another batch size
    torch.testing.assert_close(gm(q3, k3), torch.einsum("bqc,bkc->bqk", q3, k3), rtol=RTOL, atol=ATOL)
    verify_einsum(gm, ctx)


def test_an_einsum_captured_by_torch_export_is_rewritten_too():
    """aten.einsum(equation, [a, b]) is lowered to torch.einsum through the catalogue: the same rewrite."""
    from qcompiler.ir.capture import capture

    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    gm = capture(Einsum("bqc,bkc->bqk"), (q, k), mode="export")
    assert len(_einsums(gm)) == 1
    propagate_shapes(gm, (q, k))
    assert rewrite_einsum(gm, CompileContext(march=March.BAYES, example_inputs=(q, k))).modified
    assert not _einsums(gm) and torch.matmul in [n.target for n in gm.graph.nodes]
    torch.testing.assert_close(gm(q, k), torch.einsum("bqc,bkc->bqk", q, k), rtol=RTOL, atol=ATOL)


def test_a_linear_like_equation_is_one_matmul_keeping_the_leading_dims():
    x, w = torch.randn(2, 3, 4, 8), torch.randn(8, 6)
    gm, result, _ = _rewritten("bhwc,cd->bhwd", x, w)
    assert _body(gm) == ["matmul = torch.matmul(a, b);  a = b = None", "return matmul"]
    torch.testing.assert_close(gm(x, w), torch.einsum("bhwc,cd->bhwd", x, w), rtol=RTOL, atol=ATOL)


def test_merged_dims_reshape_with_the_batch_as_minus_one():
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 4, 5, 6)
    gm, _, _ = _rewritten("bxyz,byzw->bxw", a, b)
    assert _body(gm) == [
        "reshape = a.reshape((-1, 3, 20));  a = None",
        "reshape_1 = b.reshape((-1, 20, 6));  b = None",
        "matmul = torch.matmul(reshape, reshape_1);  reshape = reshape_1 = None",
        "return matmul",
    ]
    a3, b3 = torch.randn(3, 3, 4, 5), torch.randn(3, 4, 5, 6)
    torch.testing.assert_close(gm(a3, b3), torch.einsum("bxyz,byzw->bxw", a3, b3), rtol=RTOL, atol=ATOL)


ONE_OPERAND = {"ij->ji": (3, 4), "bij->bji": (2, 3, 4), "ij->j": (3, 4), "ijk->": (2, 3, 4), "ijk": (2, 3, 4),
               "ij->ij": (3, 4), "...ij->...ji": (2, 3, 4, 5), "bchw->bhwc": (2, 3, 4, 5), "ji": (3, 4)}


@pytest.mark.parametrize("equation", ONE_OPERAND, ids=ONE_OPERAND.keys())
def test_one_operand_is_permutes_and_sums(equation):
    x = torch.randn(*ONE_OPERAND[equation])
    gm, _, _ = _rewritten(equation, x)
    assert not _einsums(gm)
    assert {n.target for n in gm.graph.nodes if n.op in ("call_method", "call_function")} <= {"permute", "sum"}
    torch.testing.assert_close(gm(x), torch.einsum(equation, x), rtol=RTOL, atol=ATOL)


TWO_OPERANDS = {
    "ij,jk": ((3, 4), (4, 5)),  # implicit output: ik
    "i,i->": ((5,), (5,)),
    "i,j->ij": ((3,), (4,)),  # an outer product: nothing contracted
    "bhqd,bhkd->bhqk": ((2, 3, 4, 5), (2, 3, 6, 5)),
    "bhqk,bhkd->bqhd": ((2, 3, 4, 6), (2, 3, 6, 5)),
    "ij,kj->": ((3, 4), (5, 4)),  # the sum of a product, over an index only one side has too
    "abc,cd->da": ((2, 3, 4), (4, 5)),  # b summed on the left only
    "...ij,...jk->...ik": ((2, 3, 4, 5), (3, 5, 6)),  # ellipsis, aligned from the right
    "b...,b...->b": ((2, 3, 4), (2, 3, 4)),
    "nchw,oc->nohw": ((2, 3, 4, 5), (6, 3)),  # a 1x1 conv
    "b h i d, b h j d -> b h i j": ((2, 3, 4, 5), (2, 3, 6, 5)),  # spaces, as MaxViT writes it
}


@pytest.mark.parametrize("equation", TWO_OPERANDS, ids=TWO_OPERANDS.keys())
def test_two_operands_equal_torch_einsum(equation):
    torch.manual_seed(0)
    xs = [torch.randn(*s) for s in TWO_OPERANDS[equation]]
    gm, result, _ = _rewritten(equation, *xs)
    assert result.modified and not _einsums(gm)
    torch.testing.assert_close(gm(*xs), torch.einsum(equation, *xs), rtol=RTOL, atol=ATOL)


def test_three_operands_contract_left_to_right():
    torch.manual_seed(0)
    xs = [torch.randn(2, 3), torch.randn(3, 4), torch.randn(4, 5)]
    gm, _, _ = _rewritten("ij,jk,kl->il", *xs)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.matmul, torch.matmul]
    torch.testing.assert_close(gm(*xs), torch.einsum("ij,jk,kl->il", *xs), rtol=RTOL, atol=ATOL)


@st.composite
def equations(draw):
    """Two operands over up to 6 indices, each batch / contracted / left / right / summed on one side."""
    letters = draw(st.permutations(string.ascii_lowercase[:8]))[:draw(st.integers(1, 6))]
    roles = {x: draw(st.sampled_from(["batch", "contracted", "left", "right", "left_sum", "right_sum"]))
             for x in letters}
    sizes = {x: draw(st.integers(1, 4)) for x in letters}
    a = [x for x in letters if roles[x] in ("batch", "contracted", "left", "left_sum")]
    b = [x for x in letters if roles[x] in ("batch", "contracted", "right", "right_sum")]
    out = [x for x in letters if roles[x] in ("batch", "left", "right")]
    a, b, out = (draw(st.permutations(t)) for t in (a, b, out))
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}", [sizes[x] for x in a], [sizes[x] for x in b]


@settings(max_examples=60, deadline=None)
@given(equations(), st.integers(0, 2 ** 16))
def test_property_random_two_operand_equations_equal_torch_einsum(case, seed):
    equation, sa, sb = case
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(sa, generator=g), torch.randn(sb, generator=g)
    gm, _, _ = _rewritten(equation, a, b)
    assert not _einsums(gm), equation
    torch.testing.assert_close(gm(a, b), torch.einsum(equation, a, b), rtol=RTOL, atol=ATOL)


DECLINED = {
    "ii->i": (((3, 3),), "index 'i' repeated in one operand"),
    "ij,jk->ik": (((3, 1), (4, 5)), "index 'j' of 'ij,jk->ik' has sizes 1 and 4 (a broadcast)"),
}


@pytest.mark.parametrize("equation", DECLINED, ids=DECLINED.keys())
def test_an_equation_it_does_not_handle_stays_einsum_with_the_reason(equation):
    shapes, reason = DECLINED[equation]
    xs = [torch.randn(*s) for s in shapes]
    gm, result, ctx = _rewritten(equation, *xs)
    assert not result.modified
    (node,) = _einsums(gm)
    assert node.meta[META_REWRITE].startswith("einsum not rewritten: ") and reason in node.meta[META_REWRITE]
    verify_einsum(gm, ctx)  # nothing it could have rewritten is left
    placed = PassManager(PARTITION_PIPELINE).run(trace(Einsum(equation)), ctx).gm
    (node,) = _einsums(placed)
    assert node.meta["qc_placement"] == "cpu" and reason in node.meta[META_REASON]


def test_the_verifier_names_an_einsum_left_that_it_could_rewrite():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    gm = trace(Einsum("ij,jk->ik"))
    propagate_shapes(gm, (a, b))
    with pytest.raises(PassError, match=r"einsum: node 'einsum' could be rewritten into matmul but was left"):
        verify_einsum(gm, CompileContext(march=March.BAYES, example_inputs=(a, b)))


def test_the_pipeline_runs_it_after_shapes_and_before_placement():
    names = [p.name for p in PARTITION_PIPELINE]
    assert names.index("shape_prop") < names.index("einsum") < names.index("rewrite") < names.index("place")
    assert EINSUM_TO_MATMUL in PARTITION_PIPELINE


# ----------------------------------------------------------------------------- all three passes, compiled


def stochastic_depth(input, p, mode, training=True):
    """Stands for torchvision.ops.stochastic_depth (fx.wrap'ed there too)."""
    if not training or p == 0.0:
        return input
    return input * torch.empty(input.shape[0], 1, 1, 1).bernoulli_(1 - p) / (1 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


def relative_position_bias(table, index, n):
    """torchvision swin's _get_relative_position_bias: an fx.wrap'ed function of parameters only."""
    return table[index.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()


torch.fx.wrap("relative_position_bias")


class WindowBlock(nn.Module):
    """A Swin / MaxViT-like block: conv, dropout, stochastic depth, einsum attention with a
    relative-position bias."""

    def __init__(self, c=8, heads=2, window=4):
        super().__init__()
        self.heads, self.n = heads, window * window
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.drop = nn.Dropout(0.1)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1])

    def forward(self, x):  # x: (b, c, 4, 4)
        y = stochastic_depth(self.drop(torch.relu(self.conv(x))), 0.2, "row", self.training)
        x = x + y
        t = x.flatten(2).transpose(1, 2)  # (b, n, c)
        qkv = self.qkv(t).view(t.shape[0], self.n, 3, self.heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (b, n, h, d)
        a = torch.einsum("bqhd,bkhd->bhqk", q, k) + relative_position_bias(self.table, self.index, self.n)
        a = F.dropout(a.softmax(-1), 0.1, training=self.training)
        o = torch.einsum("bhqk,bkhd->bqhd", a, v).flatten(2)
        return self.proj(o)


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_window_block_compiles_with_no_eager_island_and_exports(capture, tmp_path):
    from test_export_exact import assert_export_is_compiled

    torch.manual_seed(0)
    model = WindowBlock().eval()
    x = torch.rand(2, 8, 4, 4)
    cm = qcompiler.compile(model, (x,), march="bayes", calib_data=[torch.rand(2, 8, 4, 4) for _ in range(4)],
                           progress=False, prepare_custom_config_dict={"capture": capture})
    assert cm.torch_islands() == {}
    names = {n.name for n in cm.converted.graph.nodes}
    assert not any(w in n for n in names for w in ("einsum", "dropout", "drop", "stochastic", "relative", "index"))
    assert sum(p["placement"] == "bpu" for p in cm.partitions) >= 1
    torch.testing.assert_close(cm.converted(x), model(x), rtol=0.0, atol=0.15)  # quantized vs float
    assert_export_is_compiled(cm, (x,), tmp_path)  # a valid ONNX model (full check), equal to the compiled one
