"""ONNX rules of the op-catalogue benchmark (issue 13): arith, logic, casts, creation, views, matrix
products, losses and norms (backends/onnx/rules/arith.py, creation.py, views.py, loss.py and the additions
to conv.py, reduce.py, norm.py, pool.py).

Each case is a tiny module: ``qcompiler.partition`` places it (these ops run on the CPU), ``emit_graph``
emits opset 11, ``onnx.checker`` (full check) accepts it, and onnxruntime must match eager torch in every
output's shape and dtype, values within atol = rtol = 1e-5 (integers and booleans exactly). Inputs hold
the edge values each formula has to get right (signed zeros, NaN, infinities, exact ties). Negative tests:
an argument a rule cannot express raises UnsupportedOpError naming the node, and ``compile`` then runs
that node in an eager-torch island with the right values."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx_modules import Fn, flat, op_types

import qcompiler
from qcompiler.backends.eager import TORCH
from qcompiler.backends.onnx.emitter import emit_graph
from qcompiler.errors import UnsupportedOpError

ATOL = RTOL = 1e-5


class FnN(Fn):
    def forward(self, *xs):
        return self.fn(*xs)


def module(fn, n: int):
    names = ", ".join(f"x{i}" for i in range(n))
    ns: dict = {}
    exec(f"def forward(self, {names}):\n    return self.fn({names})\n", ns)  # fx traces named parameters
    return type("M", (FnN,), {"forward": ns["forward"]})(fn)


def emit(fn, *inputs) -> onnx.ModelProto:
    gm = qcompiler.partition(module(fn, len(inputs)).eval(), inputs, march="bayes")
    model = emit_graph(gm)
    onnx.checker.check_model(model, full_check=True)
    return model


def check(fn, *inputs, atol=ATOL, rtol=RTOL) -> onnx.ModelProto:
    """Emit ``fn`` of ``inputs`` and compare every output of onnxruntime with torch (shape, dtype, values)."""
    model = emit(fn, *inputs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)}
    got = sess.run(None, feeds)
    with torch.no_grad():
        ref = [t.numpy() for t in flat(fn(*inputs))]
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, g.dtype, r.shape, r.dtype)
        if r.dtype.kind in "fc":
            np.testing.assert_allclose(g, r, atol=atol, rtol=rtol)
        else:
            np.testing.assert_array_equal(g, r)
    return model


gen = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, generator=gen) * 3
Y = torch.randn(3, 4, generator=gen) * 3
ROW = torch.randn(1, 4, generator=gen)
EDGE = torch.tensor([[0.0, -0.0, 1.5, -1.5, 2.5, -2.5, math.inf, -math.inf, math.nan, 7.0]])
SIGNS = torch.tensor([[1.0, -1.0, 0.0, -0.0, 3.0, -3.0, math.inf, -math.inf, 2.0, -2.0]])
INTS = torch.tensor([[-7, -3, -1, 0, 2, 5, 9]])
DIVISORS = torch.tensor([[2, 2, 3, 4, -3, -2, 4]])
PROB = torch.rand(3, 4, generator=gen) * 0.9 + 0.05
B1, B2, B_IN = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 4, 5, generator=gen), torch.randn(3, 5, generator=gen)

BINARY = [
    ("fmod", torch.fmod, X, Y),
    ("remainder", torch.remainder, X, Y),
    ("remainder ints", torch.remainder, INTS, DIVISORS),
    ("fmod ints", torch.fmod, INTS, DIVISORS),
    ("remainder scalar", lambda a: torch.remainder(a, -1.5), X),
    ("floor_divide", torch.floor_divide, X, Y),
    ("floor_divide ints", torch.floor_divide, INTS, DIVISORS),
    ("div trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc"), X, Y),
    ("atan2", torch.atan2, X, Y),
    ("atan2 axes and zeros", torch.atan2, SIGNS, SIGNS.flip(1)),
    ("rsub", lambda a, b: torch.rsub(a, b, alpha=2), X, Y),
    ("__rsub__", lambda a: 2 - a, X),
    ("__rtruediv__", lambda a: 3 / a, X),
    ("__rpow__", lambda a: 2 ** a, X),
    ("lerp scalar weight", lambda a, b: torch.lerp(a, b, 0.3), X, Y),
    ("lerp tensor weight", lambda a, b, w: torch.lerp(a, b, w), X, Y, PROB),
    ("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), X, Y, ROW),
    ("addcdiv", lambda a, b, c: torch.addcdiv(a, b, c, value=-2), X, Y, PROB),
    ("copysign", torch.copysign, EDGE.nan_to_num(), SIGNS),
    ("fmax with NaN", torch.fmax, EDGE, SIGNS),
    ("fmin with NaN", torch.fmin, EDGE, SIGNS.flip(1)),
    ("logaddexp", torch.logaddexp, X, Y),
    ("logaddexp infinities", torch.logaddexp, SIGNS, SIGNS),
    ("logaddexp2", torch.logaddexp2, X, ROW),
    ("heaviside", torch.heaviside, SIGNS, torch.full((1, 10), 0.5)),
    ("xlogy", torch.xlogy, torch.tensor([[0.0, 0.0, 2.0, 1.5]]), torch.tensor([[0.0, math.nan, 3.0, 0.5]])),
    ("xlog1py", torch.special.xlog1py, X, PROB),
    ("ldexp", torch.ldexp, X, INTS[:, :4].float().expand(3, 4)),
    ("hypot", torch.hypot, X, Y),
    ("float_power", torch.float_power, PROB, X),
    ("isclose", lambda a, b: torch.isclose(a, b, rtol=0.1, atol=0.5), X, Y),
    ("isclose equal_nan", lambda a, b: torch.isclose(a, b, equal_nan=True), EDGE, EDGE),
    ("logical_and", torch.logical_and, X.round(), Y.round()),
    ("logical_or", torch.logical_or, INTS, DIVISORS - 2),
    ("logical_xor", torch.logical_xor, X > 0, Y > 0),
    ("logical_not", torch.logical_not, EDGE),
    ("mm", torch.mm, X, Y.t()),
    ("dot", torch.dot, X[0], Y[0]),
    ("mv", torch.mv, X, Y[0]),
    ("vdot", torch.vdot, X[1], Y[1]),
    ("addmm", lambda a, b, c: torch.addmm(a, b, c, beta=0.5, alpha=2), ROW[:, :3], X, Y.t()),
    ("addmm beta 0 ignores NaN", lambda a, b, c: torch.addmm(a, b, c, beta=0), EDGE[:, :3], X, Y.t()),
    ("baddbmm", lambda a, b, c: torch.baddbmm(a, b, c, alpha=0.5), B_IN, B1, B2),
    ("addmv", torch.addmv, X[:, 0], X, Y[0]),
    ("addbmm", lambda a, b, c: torch.addbmm(a, b, c, beta=2), B_IN, B1, B2),
    ("addr", lambda a, b, c: torch.addr(a, b, c, alpha=3), X, X[:, 0], Y[0]),
]


@pytest.mark.parametrize("case", BINARY, ids=[c[0] for c in BINARY])
def test_binary_and_matrix_ops_match_torch(case):
    _, fn, *inputs = case
    check(fn, *inputs)


UNARY = [
    ("tanhshrink", F.tanhshrink, X),
    ("softshrink", lambda a: F.softshrink(a, 0.7), X),
    ("hardshrink", lambda a: F.hardshrink(a, 1.2), X),
    ("logit", torch.logit, PROB),
    ("logit eps", lambda a: torch.logit(a, eps=0.2), PROB),
    ("nan_to_num", torch.nan_to_num, EDGE),
    ("nan_to_num values", lambda a: torch.nan_to_num(a, nan=1.0, posinf=9.0, neginf=-9.0), EDGE),
    ("isnan", torch.isnan, EDGE),
    ("isinf", torch.isinf, EDGE),
    ("isfinite", torch.isfinite, EDGE),
    ("isfinite ints", torch.isfinite, INTS),
    ("deg2rad", torch.deg2rad, X),
    ("rad2deg", torch.rad2deg, X),
    ("frac", torch.frac, EDGE.nan_to_num(posinf=1e6, neginf=-1e6)),
    ("entr", torch.special.entr, torch.tensor([[0.0, 0.5, 2.0, -1.0, math.nan]])),
    ("ndtr", torch.special.ndtr, X),
    ("sgn", torch.sgn, SIGNS),
    ("expm1", torch.expm1, X),
    ("erfc", torch.erfc, X),
    ("sinc", torch.sinc, torch.cat([X.flatten(), torch.zeros(1)])),
    ("signbit", torch.signbit, SIGNS),
    ("signbit ints", torch.signbit, INTS),
    ("isposinf", torch.isposinf, EDGE),
    ("isneginf", torch.isneginf, EDGE),
    ("isreal", torch.isreal, EDGE),
    ("long", lambda a: a.long(), X),
    ("bool", lambda a: a.bool(), EDGE),
    ("half", lambda a: a.half(), X),
    ("double", lambda a: a.double(), X),
    ("to dtype", lambda a: a.to(torch.int32), X),
    ("to the same dtype", lambda a: a.to(torch.float32), X),
    ("clone", torch.clone, X),
    ("zeros_like", torch.zeros_like, X),
    ("ones_like int", lambda a: torch.ones_like(a, dtype=torch.int64), X),
    ("full_like", lambda a: torch.full_like(a, 2.5), X),
    ("new_zeros", lambda a: a.new_zeros((2, 5)), X),
    ("new_full", lambda a: a.new_full((4,), -3.0), INTS),
]


@pytest.mark.parametrize("name, fn, x", UNARY, ids=[c[0] for c in UNARY])
def test_unary_ops_casts_and_creation_match_torch(name, fn, x):
    check(fn, x)


def test_a_like_tensor_takes_the_runtime_shape():
    """zeros_like reads Shape(x) in the graph, so a CPU island with a dynamic batch stays right."""
    model = emit(torch.zeros_like, X)
    assert {"Shape", "ConstantOfShape"} <= op_types(model)


def test_random_like_ops_have_the_shape_dtype_and_range():
    for fn, onnx_op in ((torch.randn_like, "RandomNormalLike"), (torch.rand_like, "RandomUniformLike")):
        model = emit(fn, X)
        assert onnx_op in op_types(model)
        (got,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {model.graph.input[0].name: X.numpy()})
        assert got.shape == X.shape and got.dtype == np.float32
    assert 0 <= got.min() and got.max() < 1


@pytest.mark.parametrize("fn, why", [
    (lambda a: torch.linalg.norm(a, ord=2), "ord"),
    (lambda a: F.mse_loss(a, a, reduce=False), "deprecated reduce"),
    (lambda a: torch.addcmul(a, a, a, value=a.sum()), "tensor value"),
    (lambda a: a.new_full((2,), a.sum()), "fill value"),
])
def test_arguments_a_rule_cannot_express_are_refused(fn, why):
    with pytest.raises(UnsupportedOpError, match="cannot emit node"):
        emit(fn, X)


def test_a_refused_node_runs_in_an_eager_island_with_torch_values():
    """The fallback: compile puts the node the emitter refuses into a torch island; values are torch's."""
    fn = module(lambda a: torch.addcmul(a, a, a, value=a.sum()), 1)
    with pytest.warns(qcompiler.errors.QCompilerWarning):
        cm = qcompiler.compile(fn, (X,), progress=False)
    assert [s.kind for s in cm.runtime.steps] == [TORCH] or TORCH in [s.kind for s in cm.runtime.steps]
    torch.testing.assert_close(cm(X), fn(X), rtol=1e-5, atol=1e-5)
