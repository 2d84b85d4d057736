"""Reductions, layout, indexing and pooling ops in CPU islands: ONNX opset 11 vs eager torch.

Each case traces and partitions a tiny module (``qcompiler.partition``), emits the whole graph
(``emit_graph``), checks it with ``onnx.checker`` (full check), runs it in onnxruntime and
compares every output with torch: shapes (0-d included) and dtypes equal, values bit-exact for
integer outputs and for the layout / indexing ops (they move data, compute nothing), and
within atol = rtol = 1e-5 for float reductions (their summation order differs from torch's).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx_modules import Fn, Fn2, Wrap, flat, op_list

import qcompiler
from qcompiler.backends.onnx.emitter import emit_graph
from qcompiler.backends.onnx.rules.pool import adaptive_windows
from qcompiler.errors import UnsupportedOpError

EXACT, CLOSE = "exact", "close"


def emit(module: nn.Module, inputs: tuple) -> onnx.ModelProto:
    gm = qcompiler.partition(module.eval(), inputs, march="bayes")
    model = emit_graph(gm)
    onnx.checker.check_model(model, full_check=True)
    return model


def check(module: nn.Module, *inputs, mode: str = EXACT, atol: float = 1e-5, rtol: float = 1e-5) -> onnx.ModelProto:
    model = emit(module, inputs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), flat(inputs))}
    outs = sess.run(None, feeds)
    with torch.no_grad():
        ref = flat(module(*inputs))
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        r = r.numpy()
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
        if mode == EXACT or r.dtype.kind in "iub":
            np.testing.assert_array_equal(o, r)
        else:
            np.testing.assert_allclose(o, r, atol=atol, rtol=rtol)
    return model


torch.manual_seed(0)
X = torch.randn(2, 3, 5, 4)
M = torch.randn(3, 5)
I = torch.randint(-5, 6, (3, 5), dtype=torch.int32)
B = torch.rand(3, 5) > 0.5

# ---------------------------------------------------------------------------
# reductions: (id, fn, inputs)

REDUCTIONS = [
    ("torch.sum", lambda x: torch.sum(x), (X,)),
    ("torch.sum dim", lambda x: torch.sum(x, 1), (X,)),
    ("torch.sum dims keepdim", lambda x: torch.sum(x, dim=(1, -1), keepdim=True), (X,)),
    ("x.sum dim", lambda x: x.sum(-2), (X,)),
    ("x.sum dtype f64", lambda x: x.sum(1, dtype=torch.float64), (M,)),
    ("torch.sum int32 -> int64", lambda x: torch.sum(x, 0), (I,)),
    ("x.sum bool -> int64", lambda x: x.sum(), (B,)),
    ("torch.mean all", lambda x: torch.mean(x), (X,)),
    ("x.mean dims keepdim", lambda x: x.mean((0, 2), keepdim=True), (X,)),
    ("x.mean dtype", lambda x: x.mean(1, dtype=torch.float64), (M,)),
    ("torch.max", lambda x: torch.max(x), (X,)),
    ("torch.max dim", lambda x: torch.max(x, 1), (X,)),
    ("x.max dim keepdim", lambda x: x.max(dim=-1, keepdim=True), (X,)),
    ("x.max dim [0]", lambda x: x.max(2)[0] + 1, (X,)),
    ("torch.max other", lambda x: torch.max(x, x[:, :1]), (X,)),
    ("torch.max dim .values .indices", lambda x: (torch.max(x, 1).values * 2.0, torch.max(x, 1).indices), (X,)),
    ("torch.min", lambda x: torch.min(x), (M,)),
    ("torch.min dim", lambda x: torch.min(x, 0), (M,)),
    ("x.min dim int", lambda x: x.min(1), (I,)),
    ("torch.min other", lambda x: torch.min(x, x.flip(0)), (M,)),
    ("torch.amax dims", lambda x: torch.amax(x, (1, 2)), (X,)),
    ("x.amax all", lambda x: x.amax(), (X,)),
    ("torch.amin keepdim", lambda x: torch.amin(x, -1, keepdim=True), (X,)),
    ("torch.argmax", lambda x: torch.argmax(x), (X,)),
    ("torch.argmax keepdim no dim", lambda x: torch.argmax(x, keepdim=True), (M,)),
    ("x.argmax dim", lambda x: x.argmax(1), (X,)),
    ("torch.argmin dim keepdim", lambda x: torch.argmin(x, dim=-1, keepdim=True), (X,)),
    ("x.argmin", lambda x: x.argmin(), (M,)),
    ("torch.prod", lambda x: torch.prod(x), (M,)),
    ("x.prod dim keepdim", lambda x: x.prod(1, keepdim=True), (M,)),
    ("torch.prod int", lambda x: torch.prod(x, 0), (I,)),
    ("torch.std", lambda x: torch.std(x), (X,)),
    ("torch.std unbiased=False", lambda x: torch.std(x, False), (X,)),
    ("torch.std dim unbiased keepdim", lambda x: torch.std(x, 1, False, True), (X,)),
    ("x.std dims", lambda x: x.std((2, 3)), (X,)),
    ("torch.var correction=0", lambda x: torch.var(x, dim=1, correction=0), (X,)),
    ("x.var correction=2 keepdim", lambda x: x.var(-1, correction=2, keepdim=True), (X,)),
    ("torch.var unbiased kw", lambda x: torch.var(x, dim=0, unbiased=True), (M,)),
    ("torch.std_mean", lambda x: torch.std_mean(x), (X,)),
    ("torch.var_mean dim keepdim", lambda x: torch.var_mean(x, 1, keepdim=True), (X,)),
    ("torch.std_mean dims correction", lambda x: torch.std_mean(x, (0, 2), correction=0), (X,)),
    ("torch.norm", lambda x: torch.norm(x), (X,)),
    ("torch.norm p=1 dim", lambda x: torch.norm(x, p=1, dim=1), (X,)),
    ("torch.norm fro dims keepdim", lambda x: torch.norm(x, "fro", (2, 3), True), (X,)),
    ("torch.norm inf", lambda x: torch.norm(x, float("inf"), dim=-1), (X,)),
    ("torch.norm -inf", lambda x: torch.norm(x, -math.inf, dim=0), (M,)),
    ("torch.norm p=3", lambda x: torch.norm(x, 3, 1), (M,)),
    ("torch.norm p=0", lambda x: torch.norm(x, 0, 1), (M.relu(),)),
    ("x.norm dim", lambda x: x.norm(dim=1, keepdim=True), (X,)),
    ("x.norm p=1", lambda x: x.norm(1), (X,)),
    ("vector_norm", lambda x: torch.linalg.vector_norm(x), (X,)),
    ("vector_norm ord=1 dim", lambda x: torch.linalg.vector_norm(x, 1, dim=(1, 2)), (X,)),
    ("vector_norm ord=inf keepdim", lambda x: torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True), (X,)),
    ("torch.cumsum", lambda x: torch.cumsum(x, 1), (X,)),
    ("x.cumsum negative dim", lambda x: x.cumsum(-1), (X,)),
    ("x.cumsum int -> int64", lambda x: x.cumsum(dim=0), (I,)),
    ("torch.cumsum dtype", lambda x: torch.cumsum(x, 0, dtype=torch.float64), (M,)),
    ("torch.logsumexp", lambda x: torch.logsumexp(x, 1), (X,)),
    ("x.logsumexp dims keepdim", lambda x: x.logsumexp((2, 3), keepdim=True), (X,)),
    ("logsumexp large", lambda x: torch.logsumexp(x * 200.0, -1), (X,)),
    ("torch.all", lambda x: torch.all(x), (B,)),
    ("x.all dim float", lambda x: (x > -1).all(1), (X,)),
    ("torch.any dim keepdim", lambda x: torch.any(x, 0, keepdim=True), (B,)),
    ("x.any", lambda x: x.any(), (M,)),
]


@pytest.mark.parametrize("fn, inputs", [c[1:] for c in REDUCTIONS], ids=[c[0] for c in REDUCTIONS])
def test_reductions(fn, inputs):
    check(Fn(fn), *inputs, mode=CLOSE)


@pytest.mark.filterwarnings("ignore::UserWarning")  # std() of one element: "degrees of freedom is <= 0"
@pytest.mark.parametrize("fn", [
    lambda x: torch.var_mean(x, False), lambda x: x.std(), lambda x: torch.var(x, correction=0, keepdim=True),
    lambda x: torch.linalg.vector_norm(x, ord=0), lambda x: torch.norm(x, 3), lambda x: (x.sum(), x.amax(),
    torch.max(x, 0), x.argmin(), x.cumsum(0), x.logsumexp(()), x.any(), x.prod()),
], ids=["var_mean", "std", "var keepdim", "vector_norm ord=0", "norm p=3", "sum amax max argmin cumsum lse any prod"])
def test_reductions_of_a_zero_d_tensor(fn):
    check(Fn(fn), torch.tensor(0.75), mode=CLOSE)


def test_zero_d_results_stay_zero_d():
    model = check(Fn(lambda x: (x.sum(), torch.argmax(x), x.max(), torch.norm(x))), M, mode=CLOSE)
    assert all(not o.type.tensor_type.shape.dim for o in model.graph.output)


def test_max_with_dim_is_a_values_indices_pair():
    model = check(Fn(lambda x: torch.max(x, 1)), X)
    assert op_list(model) == ["ReduceMax", "ArgMax"]
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [onnx.TensorProto.FLOAT,
                                                                          onnx.TensorProto.INT64]


# ---------------------------------------------------------------------------
# layout (bit-exact)

X3 = torch.randn(2, 8, 3, 4)
LAYOUT = [
    ("torch.stack", lambda x: torch.stack([x, x * 2.0, x + 1.0]), (M,)),
    ("torch.stack dim=-1", lambda x: torch.stack((x, -x), dim=-1), (X,)),
    ("torch.stack dim=1", lambda x: torch.stack([x, x], 1), (M,)),
    ("torch.stack of a tuple value", lambda x: torch.stack(x.unbind(1), dim=2), (X,)),
    ("x.expand", lambda x: x[:, :1].expand(3, 7), (M,)),
    ("x.expand -1 and new dims", lambda x: x[:1].expand(4, -1, 3, -1, -1), (X,)),
    ("x.expand sizes tuple", lambda x: x[:, :1].expand((3, 5)), (M,)),
    ("x.expand from size()", lambda x: x[:, :1].expand(x.size(0), 6), (M,)),
    ("x.expand_as", lambda x: x[:1, :, :1].expand_as(x), (X,)),
    ("x.repeat", lambda x: x.repeat(2, 3), (M,)),
    ("x.repeat more dims", lambda x: x.repeat(2, 1, 1, 2, 1), (X,)),
    ("x.repeat tuple", lambda x: x.repeat((1, 2)), (I,)),
    ("torch.tile fewer dims", lambda x: torch.tile(x, (2,)), (X,)),
    ("x.tile more dims", lambda x: x.tile(2, 1, 3), (M,)),
    ("x.T 2-D", lambda x: x.T, (M,)),
    ("x.T 4-D", lambda x: x.T + 0.0, (X,)),
    ("x.t()", lambda x: x.t(), (M,)),
    ("torch.t 1-D", lambda x: torch.t(x[0]), (M,)),
    ("x.mT", lambda x: x.mT, (X,)),
    ("torch.flip", lambda x: torch.flip(x, [0, 2]), (X,)),
    ("x.flip variadic", lambda x: x.flip(-1, 1), (X,)),
    ("x.flip int", lambda x: x.flip(0), (I,)),
    ("torch.roll", lambda x: torch.roll(x, 2, 1), (X,)),
    ("torch.roll negative, dims", lambda x: torch.roll(x, (-1, 7), (0, -1)), (X,)),
    ("x.roll flat", lambda x: x.roll(4), (M,)),
    ("x.roll zero", lambda x: x.roll(5, 1), (M,)),
    ("F.pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), (X3,)),
    ("F.pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), (torch.randn(2, 3, 4, 6),)),
    ("shuffle round trip", lambda x: F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2), (X3,)),
    ("torch.unbind", lambda x: torch.unbind(x), (M,)),
    ("x.unbind dim", lambda x: x.unbind(dim=-1), (X,)),
    ("unbind [1]", lambda x: x.unbind(1)[1] * 2.0, (X,)),
    ("x.narrow", lambda x: x.narrow(1, 1, 3), (M,)),
    ("torch.narrow negative start", lambda x: torch.narrow(x, -1, -3, 2), (X,)),
    ("torch.movedim", lambda x: torch.movedim(x, 1, -1), (X,)),
    ("x.movedim lists", lambda x: x.movedim((0, 3), (2, 0)), (X,)),
    ("torch.moveaxis", lambda x: torch.moveaxis(x, -1, 0), (M,)),
]


@pytest.mark.filterwarnings("ignore:The use of `x.T` on tensors of dimension other than 2:UserWarning")
@pytest.mark.parametrize("fn, inputs", [c[1:] for c in LAYOUT], ids=[c[0] for c in LAYOUT])
def test_layout(fn, inputs):
    check(Fn(fn), *inputs)


@pytest.mark.parametrize("module, x", [
    (nn.PixelShuffle(2), X3),
    (nn.PixelUnshuffle(2), torch.randn(1, 2, 6, 4)),
], ids=["nn.PixelShuffle", "nn.PixelUnshuffle"])
def test_pixel_shuffle_modules(module, x):
    check(Wrap(module), x)


def test_roll_is_slice_and_concat_at_a_shift_mod_the_run_time_size():
    assert op_list(check(Fn(lambda x: torch.roll(x, 1, 0)), M)) == ["Shape", "Gather", "Mod", "Neg", "Slice",
                                                                       "Slice", "Concat"]


# ---------------------------------------------------------------------------
# indexing (bit-exact)

IDX = torch.tensor([[0, 2, 1, 0, 2], [1, 1, 0, 2, 0]])
PERM = torch.tensor([[2, 0, 1, 1, 0], [0, 1, 2, 0, 2], [1, 2, 0, 2, 1]])  # each column a permutation of 0..2
TIES = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0], [0.5, 0.5, -1.0, 0.5, 2.0, -1.0]])


class Indexed(nn.Module):
    """``fn(x, index)`` with the index a buffer (a constant of the graph)."""

    def __init__(self, fn, index):
        super().__init__()
        self.fn = fn
        self.register_buffer("index", index)

    def forward(self, x):
        return self.fn(x, self.index)


INDEXING = [
    ("torch.gather", lambda x, i: torch.gather(x, 0, i), IDX),
    ("x.gather dim", lambda x, i: x.gather(dim=1, index=i), IDX.clamp(max=1)),
    ("torch.index_select", lambda x, i: torch.index_select(x, 1, i), torch.tensor([4, 0, 0, 2])),
    ("x.index_select 0-d", lambda x, i: x.index_select(0, i), torch.tensor(2)),
    ("x.masked_fill", lambda x, i: x.masked_fill(x > 0.3, -1.5), IDX),
    ("torch.masked_fill broadcast mask", lambda x, i: torch.masked_fill(x, (x[0] > 0), 0.0), IDX),
    ("masked_fill 0-d tensor value", lambda x, i: x.masked_fill(x < 0, x.max()), IDX),
    ("torch.scatter src", lambda x, i: torch.scatter(x, 0, i, -x), PERM),
    ("x.scatter value", lambda x, i: x.scatter(0, i[:2], 9.0), PERM),
    ("x.scatter larger src", lambda x, i: x.scatter(1, i[:, :2] % 2 + torch.tensor([[0, 2]]), x * 10.0), PERM),
]


@pytest.mark.parametrize("fn, index", [c[1:] for c in INDEXING], ids=[c[0] for c in INDEXING])
def test_indexing(fn, index):
    check(Indexed(fn, index), M)


def test_masked_fill_with_a_mask_input():
    check(Fn2(lambda x, m: x.masked_fill(m, float("-inf"))), M, B)


SORTING = [
    ("torch.topk", lambda x: torch.topk(x, 2)),
    ("x.topk smallest dim", lambda x: x.topk(3, dim=0, largest=False)),
    ("x.topk values only", lambda x: x.topk(2, 1)[0] * 2.0),
    ("torch.sort", lambda x: torch.sort(x)),
    ("x.sort descending dim", lambda x: x.sort(0, descending=True)),
    ("torch.sort stable", lambda x: torch.sort(x, stable=True, dim=1)),
    ("x.topk .indices", lambda x: x.topk(2, 0).indices),
    ("x.sort .values", lambda x: x.sort(1).values - 1.0),
    ("torch.argsort", lambda x: torch.argsort(x, dim=1)),
    ("x.argsort descending stable", lambda x: x.argsort(descending=True, stable=True)),
]


@pytest.mark.parametrize("fn", [c[1] for c in SORTING], ids=[c[0] for c in SORTING])
def test_topk_and_sort(fn):
    check(Fn(fn), M)


def test_sort_with_ties_keeps_equal_values_in_order():
    check(Fn(lambda x: torch.sort(x, dim=1, stable=True)), TIES)
    check(Fn(lambda x: x.argsort(dim=1, descending=True, stable=True)), TIES)
    check(Fn(lambda x: torch.sort(x, dim=0, descending=True, stable=True)), TIES)


# ---------------------------------------------------------------------------
# pooling


def test_adaptive_windows_are_torchs():
    assert adaptive_windows(3, 2) == [(0, 2), (1, 3)]
    assert adaptive_windows(7, 3) == [(0, 3), (2, 5), (4, 7)]
    assert adaptive_windows(2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]


X33 = torch.randn(2, 3, 3, 3)
POOLS = [
    ("nn.AdaptiveAvgPool2d 2x2 over 3x3", nn.AdaptiveAvgPool2d(2), X33),
    ("nn.AdaptiveAvgPool2d 3x5 over 7x5", nn.AdaptiveAvgPool2d((3, 5)), torch.randn(1, 2, 7, 5)),
    ("nn.AdaptiveAvgPool2d 4x3 over 2x5", nn.AdaptiveAvgPool2d((4, 3)), torch.randn(1, 2, 2, 5)),
    ("nn.AdaptiveAvgPool2d divides", nn.AdaptiveAvgPool2d((2, 3)), torch.randn(1, 2, 4, 9)),
    ("nn.AdaptiveMaxPool2d 2x2 over 3x3", nn.AdaptiveMaxPool2d(2), X33),
    ("nn.AdaptiveMaxPool2d 1x1", nn.AdaptiveMaxPool2d(1), X33),
    ("nn.AdaptiveMaxPool2d divides", nn.AdaptiveMaxPool2d((2, 1)), torch.randn(1, 2, 6, 5)),
    ("nn.AdaptiveAvgPool1d 3 over 7", nn.AdaptiveAvgPool1d(3), torch.randn(2, 3, 7)),
    ("nn.AdaptiveAvgPool2d unbatched", nn.AdaptiveAvgPool2d((2, 4)), torch.randn(3, 5, 4)),
    ("nn.AdaptiveMaxPool2d unbatched divides", nn.AdaptiveMaxPool2d(2), torch.randn(3, 4, 4)),
    ("nn.AdaptiveMaxPool1d unbatched 1", nn.AdaptiveMaxPool1d(1), torch.randn(3, 5)),
    ("nn.AdaptiveMaxPool1d 4 over 10", nn.AdaptiveMaxPool1d(4), torch.randn(2, 3, 10)),
    ("nn.MaxPool1d", nn.MaxPool1d(3, 2, padding=1), torch.randn(2, 3, 10)),
    ("nn.MaxPool1d ceil dilation", nn.MaxPool1d(2, 2, ceil_mode=True, dilation=2), torch.randn(2, 3, 9)),
    ("nn.AvgPool1d", nn.AvgPool1d(3, 2, padding=1, count_include_pad=False), torch.randn(2, 3, 10)),
    ("nn.AvgPool1d ceil", nn.AvgPool1d(2, ceil_mode=True), torch.randn(2, 3, 9)),
]


@pytest.mark.parametrize("module, x", [c[1:] for c in POOLS], ids=[c[0] for c in POOLS])
def test_pools(module, x):
    check(Wrap(module), x, mode=CLOSE)


@pytest.mark.parametrize("fn, x", [
    (lambda x: F.adaptive_avg_pool2d(x, 2), X33),
    (lambda x: F.adaptive_max_pool2d(x, (2, 3)), torch.randn(1, 2, 5, 4)),
    (lambda x: F.adaptive_avg_pool1d(x, 2), torch.randn(1, 2, 5)),
    (lambda x: F.adaptive_max_pool1d(x, 3), torch.randn(1, 2, 5)),
    (lambda x: F.max_pool1d(x, 2), torch.randn(1, 2, 7)),
    (lambda x: F.avg_pool1d(x, 3, stride=1, padding=1), torch.randn(1, 2, 7)),
], ids=["F.adaptive_avg_pool2d", "F.adaptive_max_pool2d", "F.adaptive_avg_pool1d", "F.adaptive_max_pool1d",
        "F.max_pool1d", "F.avg_pool1d"])
def test_functional_pools(fn, x):
    check(Fn(fn), x, mode=CLOSE)


def test_an_adaptive_pool_that_does_not_divide_needs_no_average_pool():
    model = check(Wrap(nn.AdaptiveAvgPool2d(2)), X33, mode=CLOSE)
    assert "AveragePool" not in op_list(model)
    assert op_list(model).count("ReduceMean") == 4  # 2 + 2 separable windows for the 2x2 cells


# ---------------------------------------------------------------------------
# refused forms: an UnsupportedOpError that names the node and why

REFUSED = [
    ("norm nuc", lambda x: torch.norm(x, "nuc"), M, r"node 'norm'.*op 'norm'.*p='nuc' \(a matrix norm"),
    ("scatter reduce", lambda x: x.scatter(0, x.argsort(0), x, reduce="add"), M,
     r"node 'scatter'.*reduce='add' \(ScatterElements-11 has no reduction\)"),
    ("F.max_pool1d return_indices, unbatched", lambda x: F.max_pool1d(x, 2, return_indices=True)[1],
     torch.randn(2, 6), r"node 'max_pool1d_with_indices' \(F.max_pool1d_with_indices.*input is not \(N, C"),
    ("nn.AdaptiveMaxPool2d return_indices", nn.AdaptiveMaxPool2d(2, return_indices=True), X33,
     r"node 'm' \(AdaptiveMaxPool2d, op 'adaptive_max_pool2d'\).*: return_indices=True"),
    ("topk k from a tensor", lambda x: x.topk(x.size(0)), M, r"node 'topk'.*k=.* \(a python int is emitted\)"),
    ("pixel_shuffle 3-D", lambda x: F.pixel_shuffle(x, 2), torch.randn(8, 2, 2),
     r"node 'pixel_shuffle'.*pixel_shuffle of a 3-D tensor"),
    ("narrow at a tensor start", lambda x: x.narrow(1, x[0].argmin(), 1), M,
     r"node 'narrow'.*narrow with tensor arguments"),
    ("gather of a 0-d tensor", lambda x: torch.gather(x[0, 0], 0, x[0, :1].argmax()), M,
     r"node 'gather'.*gather of a 0-d tensor"),
    ("var_mean of an empty tensor", lambda x: torch.var_mean(x[:, :0], 1), M, r"node 'var_mean'.*of an empty tensor"),
    ("roll of an empty tensor", lambda x: x[:0].roll(1, 0), M, r"node 'roll'.*roll of an empty tensor"),
    ("logsumexp of ints", lambda x: torch.logsumexp(x, 1), I, r"node 'logsumexp'.*non-float tensor"),
]


@pytest.mark.parametrize("fn, x, match", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_forms_name_the_node_and_why(fn, x, match):
    with pytest.raises(UnsupportedOpError, match=match):
        emit(Wrap(fn) if isinstance(fn, nn.Module) else Fn(fn), (x,))


def test_topk_sorted_false_gives_the_sorted_topk():
    """torch leaves the order of ``sorted=False`` unspecified; the island gives the sorted one: the same
    elements as torch's, and exactly ``sorted=True``'s result."""
    model = emit(Fn(lambda x: torch.topk(x, 4, sorted=False)), (M,))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values, indices = sess.run(None, {sess.get_inputs()[0].name: M.numpy()})
    ref = torch.topk(M, 4, sorted=True)
    np.testing.assert_array_equal(values, ref.values.numpy())
    np.testing.assert_array_equal(indices, ref.indices.numpy())
    unsorted = torch.topk(M, 4, sorted=False)
    assert sorted(unsorted.indices.flatten().tolist()) == sorted(ref.indices.flatten().tolist())


# ---------------------------------------------------------------------------
# end to end: a BPU conv feeds these ops in an ONNX CPU island


class ConvThenShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x):
        y = self.conv(x)  # 3x3 out of 5x5
        p = self.pool(y)  # 2x2 over 3x3: no AveragePool form
        s = torch.sum(p, dim=(2, 3))
        v, i = torch.max(p.flatten(1), 1)
        t = torch.stack([s.T, s.t()], 0).repeat(1, 1, 2)
        # sizes along the batch dim are read at run time: std's count, roll's shift, sort's k, narrow
        b = s.std(0) + torch.roll(s, 1, 0).sum(0) + s.roll(3).narrow(0, -1, 1)[0] + s.sort(0).values[-1]
        return t, v + s.norm(dim=1), i, torch.topk(s, 3)[1], b


def test_compile_runs_a_bpu_conv_into_an_onnx_cpu_island():
    torch.manual_seed(0)
    model = ConvThenShapes().eval()
    x = torch.randn(2, 3, 5, 5)
    calib = [torch.randn(2, 3, 5, 5) for _ in range(3)]
    cm = qcompiler.compile(model, (x,), march="bayes", calib_data=calib, progress=False)
    kinds = [s.kind for s in cm.runtime.steps]
    assert "cpu" in kinds and "torch" not in kinds and "bpu" in kinds, kinds
    assert cm.torch_islands() == {}
    for batch in (x, torch.randn(5, 3, 5, 5)):  # the example's batch size and another
        got, ref = flat(cm(batch)), flat(cm.converted(batch))
        assert len(got) == len(ref) == 5
        for g, r in zip(got, ref):
            assert g.dtype == r.dtype and g.shape == r.shape
            if r.dtype == torch.int64:
                assert torch.equal(g, r)
            else:
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


class _Rank3And5(nn.Module):
    """ConvTranspose1d and BatchNorm3d have op names of their own (not the 2-D ones the BPU runs),
    and an adaptive pool's None output size keeps the input's size."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.pool = nn.AdaptiveAvgPool2d((3, None))
        self.up = nn.ConvTranspose1d(4, 2, 3, stride=2)
        self.bn = nn.BatchNorm3d(2)

    def forward(self, x):
        y = self.up(self.pool(self.conv(x)).flatten(2))
        return self.bn(y[:, :, None, None, :])


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_conv_transpose1d_batch_norm3d_and_a_none_output_size_run_in_onnx(march):
    torch.manual_seed(0)
    m = _Rank3And5().eval()
    m.bn.running_mean.uniform_()
    m.bn.running_var.uniform_(0.5, 2.0)
    x = torch.rand(1, 3, 8, 8)
    cm = qcompiler.compile(m, (x,), march=march, progress=False)
    assert cm.torch_islands() == {}
    nodes = {n.name: n for n in cm.converted.graph.nodes}
    assert nodes["up"].meta["qc_placement"] == "cpu" and nodes["bn"].meta["qc_placement"] == "cpu"
    assert nodes["pool"].meta["qc_reason"].startswith("adaptive_avg_pool2d: adaptive_avg_pool2d to 3x6 is not a global pool")
    torch.testing.assert_close(cm(x), cm.converted(x), atol=1e-5, rtol=1e-5)  # the CPU part: onnxruntime vs torch
