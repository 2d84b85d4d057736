"""ONNX rules of the op-catalogue benchmark, part 2 (issue 13): views and selections
(backends/onnx/rules/views.py), losses and similarities (loss.py), and the norms, reductions and pools
added to reduce.py, norm.py and pool.py. Same harness as tests/test_onnx_arith.py: onnxruntime against
eager torch, every output's shape and dtype, values within 1e-5 (integers exactly); beside them the
arguments each rule refuses, and the fallback of lowering: an island whose ONNX form fails runs in
eager torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx_modules import op_types
from test_onnx_arith import check, emit, module

import qcompiler
from qcompiler.backends.eager import TORCH
from qcompiler.backends.onnx.emitter import emit_island
from qcompiler.errors import QCompilerWarning, UnsupportedOpError

gen = torch.Generator().manual_seed(1)
X = torch.randn(2, 3, 4, generator=gen)
Y = torch.randn(2, 3, 4, generator=gen)
V3 = torch.randn(4, 3, generator=gen)
W3 = torch.randn(4, 3, generator=gen)
MASK = torch.rand(3, 4, generator=gen) > 0.5
P = torch.softmax(torch.randn(2, 5, generator=gen), 1)
LOGP = torch.log_softmax(torch.randn(2, 5, generator=gen), 1)
SIGN = torch.randint(0, 2, (2, 5), generator=gen).float() * 2 - 1

CASES = [
    ("reshape_as", lambda a, b: a.reshape_as(b), X, Y.reshape(6, 4)),
    ("view_as", lambda a, b: a.view_as(b), X, Y.reshape(4, 6)),
    ("broadcast_to", lambda a: torch.broadcast_to(a, (3, 2, 3, 4)), X),
    ("broadcast_to -1", lambda a: a[:, :1].broadcast_to(-1, 3, 4), X),
    ("broadcast_tensors", lambda a, b: torch.broadcast_tensors(a, b), X[:, :1], Y[:1]),
    ("atleast_1d of 0-d", torch.atleast_1d, torch.tensor(3.0)),
    ("atleast_2d of 1-D", torch.atleast_2d, X[0, 0]),
    ("atleast_3d of 2-D", torch.atleast_3d, X[0]),
    ("atleast_3d of 1-D", torch.atleast_3d, X[0, 0]),
    ("atleast_2d of many", lambda a, b: torch.atleast_2d(a, b), X[0, 0], X),
    ("hstack", lambda a, b: torch.hstack([a, b]), X, Y),
    ("hstack 1-D", lambda a, b: torch.hstack((a, b)), X[0, 0], Y[0, 1]),
    ("vstack", lambda a, b: torch.vstack([a, b]), X[0, 0], Y[0, :2]),
    ("constant_pad_nd", lambda a: torch.constant_pad_nd(a, (1, 2, 0, 1), 0.5), X),
    ("constant_pad_nd crop", lambda a: torch.constant_pad_nd(a, (-1, 2, 1, -1)), X),
    ("select", lambda a: torch.select(a, 1, -1), X),
    ("select method", lambda a: a.select(2, 1), X),
    ("take", lambda a, i: torch.take(a, i), X, torch.tensor([[0, 5], [-1, 23]])),
    ("masked_select", torch.masked_select, X, MASK),
    ("masked_select broadcast", torch.masked_select, X[0, :, :1], MASK),
    ("fliplr", torch.fliplr, X),
    ("flipud", torch.flipud, X),
    ("diff", torch.diff, X),
    ("diff n=2 dim 0 prepend", lambda a, b: torch.diff(a, n=2, dim=1, prepend=b), X, Y[:, :1]),
    ("diff of bools", lambda a: torch.diff(a > 0), X),
    ("cross", lambda a, b: torch.cross(a, b, dim=1), V3, W3),
    ("linalg.cross", torch.linalg.cross, V3, W3),
    ("aten.slice", lambda a: torch.ops.aten.slice.Tensor(a, 2, 1, 3), X),
    ("aten.slice step", lambda a: torch.ops.aten.slice.Tensor(a, -1, 0, None, 2), X),
    ("expand_copy", lambda a: torch.expand_copy(a[:1], (3, 3, 4)), X),
    ("split_with_sizes", lambda a: torch.split_with_sizes(a, [1, 3], 2), X),
    ("aminmax", lambda a: torch.aminmax(a, dim=1), X),
    ("aminmax all", torch.aminmax, X),
    ("linalg.norm", torch.linalg.norm, X),
    ("linalg.norm dim keepdim", lambda a: torch.linalg.norm(a, dim=(0, 2), keepdim=True), X),
    ("matrix_norm", torch.linalg.matrix_norm, X),
    ("rms_norm", lambda a: F.rms_norm(a, (4,)), X),
    ("rms_norm weight eps", lambda a, w: F.rms_norm(a, (3, 4), w, eps=1e-3), X, Y[0]),
    ("bicubic upsample", lambda a: F.interpolate(a, scale_factor=2.0, mode="bicubic"), X.reshape(1, 2, 3, 4)),
    ("bicubic to a size", lambda a: F.interpolate(a, size=(5, 3), mode="bicubic"), X.reshape(1, 2, 3, 4)),
    ("bicubic align_corners", lambda a: F.interpolate(a, scale_factor=1.7, mode="bicubic", align_corners=True),
     X.reshape(1, 2, 3, 4)),
    ("native_layer_norm", lambda a, w, b: torch.native_layer_norm(a, (3, 4), w, b, 1e-5), X, Y[0], Y[1]),
    ("native_layer_norm no affine", lambda a: torch.native_layer_norm(a, (4,), None, None, 1e-3), X),
    ("max_pool2d indices", lambda a: F.max_pool2d(a, 2, return_indices=True), torch.randn(2, 3, 5, 6, generator=gen)),
    ("max_pool1d_with_indices ceil", lambda a: F.max_pool1d_with_indices(a, 2, 2, ceil_mode=True),
     torch.randn(2, 3, 7, generator=gen)),
    ("max_pool3d indices padded", lambda a: F.max_pool3d(a, 3, 2, padding=1, return_indices=True),
     torch.randn(1, 2, 4, 5, 3, generator=gen)),
    ("max_pool3d", lambda a: F.max_pool3d(a, (2, 1, 2)), torch.randn(1, 2, 4, 5, 3, generator=gen)),
    ("avg_pool3d", lambda a: F.avg_pool3d(a, 2, stride=1, padding=1), torch.randn(1, 2, 3, 4, 5, generator=gen)),
    ("tril", torch.tril, X),
    ("triu diagonal", lambda a: torch.triu(a, 1), X[0]),
    ("tril negative diagonal", lambda a: a.tril(-1), X.long()),
    ("trace", torch.trace, X[0]),
    ("trace of ints", torch.trace, X[0].long()),
    ("ravel", torch.ravel, X),
    ("outer", torch.outer, X[0, 0], Y[0, 1]),
    ("nonzero", torch.nonzero, X.round()),
    ("argwhere", torch.argwhere, MASK),
    ("unique", torch.unique, X.round()),
    ("unique inverse counts", lambda a: torch.unique(a, return_inverse=True, return_counts=True), X.round()),
    ("tensor_split", lambda a: torch.tensor_split(a, 3, dim=2), X),
    ("nansum", lambda a: torch.nansum(a, 1), torch.where(MASK, X[0], torch.nan)),
    ("nanmean", torch.nanmean, torch.where(MASK, X[0], torch.nan)),
    ("count_nonzero", lambda a: torch.count_nonzero(a, 1), X.round()),
    ("logcumsumexp", lambda a: torch.logcumsumexp(a, 1), X * 30),
    ("mse_loss", F.mse_loss, X, Y),
    ("huber_loss", lambda a, b: F.huber_loss(a, b, delta=0.7), X, Y),
    ("smooth_l1_loss", lambda a, b: F.smooth_l1_loss(a, b, beta=0.5, reduction="sum"), X, Y),
    ("pairwise_distance", F.pairwise_distance, X, Y),
    ("pairwise_distance p=1", lambda a, b: F.pairwise_distance(a, b, 1, keepdim=True), X, Y),
    ("poisson_nll_loss", F.poisson_nll_loss, X, Y.abs()),
    ("poisson_nll_loss rates", lambda a, b: F.poisson_nll_loss(a, b, log_input=False), X.abs(), Y.abs()),
    ("hinge_embedding_loss", lambda a, b: F.hinge_embedding_loss(a, b, margin=0.5), P, SIGN),
    ("dist", torch.dist, X, Y),
    ("dist inf", lambda a, b: torch.dist(a, b, float("inf")), X, Y),
    ("mse_loss sum", lambda a, b: F.mse_loss(a, b, reduction="sum"), X, Y),
    ("l1_loss none", lambda a, b: F.l1_loss(a, b, reduction="none"), X, Y),
    ("soft_margin_loss", F.soft_margin_loss, X.reshape(2, 12)[:, :5] * 5, SIGN),
    ("margin_ranking_loss", lambda a, b, y: F.margin_ranking_loss(a, b, y, margin=0.3), P, LOGP.exp(), SIGN),
    ("bce_with_logits", F.binary_cross_entropy_with_logits, X * 10, (Y > 0).float()),
    ("bce_with_logits weights", lambda a, b, w, p: F.binary_cross_entropy_with_logits(a, b, w, pos_weight=p),
     X, (Y > 0).float(), Y[0].abs(), Y[0, 0].abs()),
    ("kl_div", lambda a, b: F.kl_div(a, b, reduction="batchmean"), LOGP, torch.cat([P[:, :4], P[:, 4:] * 0], 1)),
    ("kl_div log_target", lambda a, b: F.kl_div(a, b, reduction="sum", log_target=True), LOGP, LOGP.flip(1)),
    ("cosine_similarity", F.cosine_similarity, X, Y),
    ("cosine_similarity broadcast, zero", lambda a, b: F.cosine_similarity(a, b, dim=-1), X, Y[:1] * 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_views_losses_and_norms_match_torch(case):
    _, fn, *inputs = case
    check(fn, *inputs)


def test_like_shapes_are_read_at_run_time():
    assert "Shape" in op_types(emit(lambda a, b: a.reshape_as(b), X, Y.reshape(6, 4)))
    assert "Shape" in op_types(emit(lambda a, b: torch.broadcast_tensors(a, b), X[:, :1], Y[:1]))


@pytest.mark.parametrize("fn, inputs", [
    (lambda a: torch.linalg.matrix_norm(a, ord=2), (X,)),  # singular values
    (lambda a: torch.full_like(a, a.sum()), (X,)),  # a fill value computed in the graph
    (lambda a, i: torch.gather(a, 0, i), (X[0, 0], torch.zeros(2, 0, dtype=torch.int64))),  # rank differs
    (lambda a, w: F.conv_transpose2d(a, w, stride=2, output_padding=3, dilation=4),
     (torch.randn(1, 2, 4, 4), torch.randn(2, 2, 3, 3))),  # output_padding >= stride
    (lambda a, b: F.kl_div(a, b, reduce=False), (LOGP, P)),
    (lambda a: torch.unique(a, sorted=False), (X,)),  # torch's unsorted order is not Unique's
    (lambda a, b: F.poisson_nll_loss(a, b, full=True), (X, Y.abs())),
    (lambda a: torch.nonzero(a, as_tuple=True), (X,)),
])
def test_arguments_a_rule_cannot_express_are_refused(fn, inputs):
    with pytest.raises(UnsupportedOpError, match="cannot emit node"):
        emit(fn, *inputs)


class Transposed(nn.Module):
    def forward(self, x):
        return x.permute(())


def test_an_island_whose_onnx_form_fails_runs_in_eager_torch():
    """emit_island turns any failure (here a 0-d permute the rule cannot build) into an UnsupportedOpError
    naming the island, and compile runs that island in eager torch with torch's values."""
    x = torch.tensor(2.5)
    gm = qcompiler.partition(Transposed(), (x,), march="bayes")
    nodes = [n.name for n in gm.graph.nodes if n.op == "call_method"]
    with pytest.raises(UnsupportedOpError, match=r"CPU island cpu0 \(nodes permute\): its ONNX form failed"):
        emit_island(gm, "cpu0", nodes, ["x"], nodes)
    with pytest.warns(QCompilerWarning):
        cm = qcompiler.compile(Transposed(), (x,), progress=False)
    assert [s.kind for s in cm.runtime.steps] == [TORCH]
    assert "its ONNX form failed" in cm.summary()
    out = cm(x)
    assert out.shape == () and float(out) == 2.5


def test_a_checker_rejected_island_runs_in_eager_torch():
    """An unbatched conv1d input (C, L) is legal in torch but not for ONNX Conv: the checker rejects the
    island, which then runs in torch."""
    w = torch.randn(4, 2, 3)
    fn = module(lambda a: F.conv1d(a, w), 1)
    x = torch.randn(2, 7)
    with pytest.warns(QCompilerWarning):
        cm = qcompiler.compile(fn, (x,), progress=False)
    assert TORCH in [s.kind for s in cm.runtime.steps]
    torch.testing.assert_close(cm(x), fn(x), rtol=1e-6, atol=1e-6)
    assert math.isfinite(float(cm(x).sum()))
