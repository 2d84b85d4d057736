"""passes/attention.py: a traced F.scaled_dot_product_attention said as matmul, softmax and matmul."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REWRITE, META_TENSOR
from qcompiler.march import March
from qcompiler.passes.attention import NOTE, rewrite_attention, verify_attention
from qcompiler.passes.base import CompileContext

# float32 fused kernel vs matmul + softmax + matmul: summation order and softmax rounding (measured <= 3e-7)
ATOL = 2e-6


class Heads(nn.Module):
    """q / k / v projections split into heads, then ``F.scaled_dot_product_attention(**extra)``."""

    def __init__(self, d=16, heads=2, mask=None, **extra):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.extra = heads, extra
        if mask is not None:
            self.register_buffer("mask", mask)
        else:
            self.mask = None

    def split(self, t):
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, **self.extra)
        b, h, n, e = y.shape
        return self.o(y.transpose(1, 2).reshape(b, n, h * e))


def _rewritten(model, x, march=March.BAYES):
    gm = trace(model.eval())
    propagate_shapes(gm, (x,))
    ctx = CompileContext(march=march, example_inputs=(x,))
    result = rewrite_attention(gm, ctx)
    return result.gm, result.modified, ctx


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
BOOL_MASK = torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) > 0.3
BOOL_MASK[:, 0] = True  # no row masked out entirely (torch's kernel gives NaN there, as the rewrite does)


@pytest.mark.parametrize("case, model", [
    ("plain", lambda: Heads()),
    ("own scale", lambda: Heads(scale=0.3)),
    ("float mask", lambda: Heads(mask=torch.randn(1, 1, 5, 5, generator=torch.Generator().manual_seed(2)))),
    ("bool mask", lambda: Heads(mask=BOOL_MASK)),
])
def test_the_rewrite_computes_what_torch_computes(case, model):
    torch.manual_seed(0)
    m = model()
    with torch.no_grad():
        want = m.eval()(X)
        gm, modified, ctx = _rewritten(m, X)
        got = gm(X)
    assert modified
    assert F.scaled_dot_product_attention not in _targets(gm)
    assert _targets(gm).count(torch.matmul) == 2 and torch.softmax in _targets(gm)
    assert (torch.masked_fill in _targets(gm)) == (case == "bool mask")
    assert (torch.add in _targets(gm)) == (case == "float mask")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    verify_attention(gm, ctx)  # nothing left that could be rewritten


def test_every_new_node_has_torch_s_shape_and_the_note():
    gm, _, _ = _rewritten(Heads(), X)
    new = [n for n in gm.graph.nodes if n.meta.get(META_REWRITE) == NOTE]
    assert [n.target for n in new] == [torch.transpose, torch.matmul, torch.mul, torch.softmax, torch.matmul]
    assert [n.meta[META_TENSOR].shape for n in new] == [(2, 2, 8, 5), (2, 2, 5, 5), (2, 2, 5, 5), (2, 2, 5, 5),
                                                        (2, 2, 5, 8)]
    scale = next(n for n in new if n.target is torch.mul).args[1]
    assert scale == pytest.approx(1 / 8 ** 0.5, rel=1e-15)


@pytest.mark.parametrize("extra, reason", [
    ({"is_causal": True}, "is_causal=True"),
    ({"dropout_p": 0.1}, "dropout_p=0.1"),
    ({"enable_gqa": True}, "enable_gqa=True"),
])
def test_what_the_rewrite_cannot_say_is_left_with_the_reason(extra, reason):
    gm, modified, ctx = _rewritten(Heads(**extra), X)
    assert not modified
    (node,) = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert reason in node.meta[META_REWRITE] and "not rewritten" in node.meta[META_REWRITE]
    verify_attention(gm, ctx)  # a declined call is no verifier failure


def test_on_nash_the_attention_leaves_no_eager_island_and_matches_the_float_model():
    """The pipeline: on every march the call is gone (it was an eager-torch island); the matmuls are BPU
    work, and the compiled model stays close to the float one."""
    torch.manual_seed(0)
    m = Heads().eval()
    batches = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for march in ("bayes", "nash"):
        cm = qcompiler.compile(m, (X,), march=march, calib_data=batches, progress=False)
        assert cm.torch_islands() == {}, march
        placed = {n.target: n.meta.get(META_PLACEMENT) for n in cm.converted.graph.nodes
                  if n.meta.get(META_REWRITE) == NOTE}
        assert F.scaled_dot_product_attention not in _targets(cm.converted)
        with torch.no_grad():
            want, got = m(X), cm(X)
        sqnr = 10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())
        assert sqnr > 20, (march, float(sqnr), placed)
