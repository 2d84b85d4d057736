"""CPU-island coverage of torch's element-wise math, log-softmax and normalization (issue 13).

Each case is a tiny module in one spelling (module, ``F.*``, ``torch.*``, Tensor method,
operator): ``qcompiler.partition`` places it (none of these ops is a BPU op, so it runs on the
CPU), ``emit_graph`` emits opset 11, ``onnx.checker`` (full check) accepts it and onnxruntime
must match torch within atol = rtol = 1e-5 (looser only where a case says why). Inputs are
chosen inside each function's domain (positive for sqrt / log, away from 0 for reciprocal).
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
from onnx_modules import Fn, Fn2, Wrap, op_types

import qcompiler
from qcompiler.backends.onnx.emitter import emit_graph
from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_PLACEMENT, META_REASON

ATOL = RTOL = 1e-5


def emit(module: nn.Module, *inputs) -> onnx.ModelProto:
    if type(module).__module__.startswith("torch.nn"):
        module = Wrap(module)
    gm = qcompiler.partition(module.eval(), inputs, march="bayes")
    model = emit_graph(gm)
    onnx.checker.check_model(model, full_check=True)
    return model


def check(module: nn.Module, *inputs, atol=ATOL, rtol=RTOL) -> onnx.ModelProto:
    """Emit ``module`` and compare onnxruntime with torch (shape, dtype and values)."""
    model = emit(module, *inputs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)})[0]
    with torch.no_grad():
        ref = module.eval()(*inputs).numpy()
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.shape, ref.dtype)
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)
    return model


g = torch.Generator().manual_seed(0)
X = torch.randn(2, 4, 5, 6, generator=g) * 2           # any real
POS = torch.rand(2, 4, 5, 6, generator=g) * 5 + 0.05  # log / sqrt / rsqrt domain
Y = torch.randn(2, 4, 5, 6, generator=g)
ROW = torch.randn(1, 4, 1, 6, generator=g)              # broadcasts against X
UNIT = torch.tanh(X) * 0.95                             # asin / acos / atanh domain
AWAY = X.sign() * (X.abs() + 0.1)                       # reciprocal: away from 0
# log1p where 1 + x loses x's digits in float32 (the naive Log(1 + x) is off by up to 6e-2 relative)
TINY = torch.tensor([[1e-7, -1e-7, 3e-6, 1e-4, -5e-4, 0.0, 0.3, 2.0, 50.0, -0.9, 1e-30, math.inf]])
HALVES = torch.tensor([[-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49, -0.51, 3.7, -3.2]])
INTS = torch.tensor([[-3, -1, 0, 2, 5, 7]])


UNARY_CASES = {
    # op: ([spellings], input)
    "sqrt": ([torch.sqrt, lambda x: x.sqrt()], POS),
    "rsqrt": ([torch.rsqrt, lambda x: x.rsqrt()], POS),
    "log": ([torch.log, lambda x: x.log()], POS),
    "log1p": ([torch.log1p, lambda x: x.log1p()], TINY),
    "sin": ([torch.sin, lambda x: x.sin()], X),
    "cos": ([torch.cos, lambda x: x.cos()], X),
    "tan": ([torch.tan, lambda x: x.tan()], X.clamp(-1.3, 1.3)),
    "erf": ([lambda x: x.erf()], X),
    "reciprocal": ([torch.reciprocal, lambda x: x.reciprocal()], AWAY),
    "floor": ([torch.floor, lambda x: x.floor()], HALVES),
    "ceil": ([torch.ceil, lambda x: x.ceil()], HALVES),
    "round": ([torch.round, lambda x: x.round()], HALVES),  # half to even, as Round-11
    "sign": ([torch.sign, lambda x: x.sign()], torch.cat([X.flatten()[:10], torch.zeros(3)])),
    "pow": ([lambda x: x ** 2, lambda x: x ** 0.5, lambda x: torch.pow(x, 3), lambda x: x.pow(-1.5),
             lambda x: 2 ** x, lambda x: torch.pow(1.5, x)], POS),
    "mish": ([F.mish, nn.Mish()], X * 10),
    "softplus": ([F.softplus, lambda x: F.softplus(x, beta=2, threshold=5), nn.Softplus(beta=0.5, threshold=3)],
                 X * 10),
    "logsigmoid": ([F.logsigmoid, nn.LogSigmoid()], torch.cat([X.flatten(), torch.tensor([-100.0, 100.0])])),
    "softsign": ([F.softsign, nn.Softsign()], X),
    "celu": ([F.celu, lambda x: F.celu(x, alpha=0.5), lambda x: torch.celu(x, 2.0), nn.CELU(1.5)], X),
    "threshold": ([lambda x: F.threshold(x, 0.1, 20.0), lambda x: torch.threshold(x, -0.5, 0),
                   nn.Threshold(0.2, -1.0)], X),
    "glu": ([F.glu, lambda x: F.glu(x, dim=1), lambda x: F.glu(x, -1),
             nn.GLU(1)], X),
    "asin": ([torch.asin, lambda x: x.asin()], UNIT),
    "acos": ([torch.acos, lambda x: x.acos()], UNIT),
    "atan": ([torch.atan, lambda x: x.atan()], X),
    "sinh": ([torch.sinh, lambda x: x.sinh()], X),
    "cosh": ([torch.cosh, lambda x: x.cosh()], X),
    "asinh": ([torch.asinh, lambda x: x.asinh()], X),
    "acosh": ([torch.acosh, lambda x: x.acosh()], POS + 1),
    "atanh": ([torch.atanh, lambda x: x.atanh()], UNIT),
    "log2": ([torch.log2, lambda x: x.log2()], POS),
    "log10": ([torch.log10, lambda x: x.log10()], POS),
    "exp2": ([torch.exp2, lambda x: x.exp2()], X),
    "square": ([torch.square, lambda x: x.square()], X),
    "trunc": ([torch.trunc, lambda x: x.trunc(), torch.fix, lambda x: x.fix()], HALVES),
    "clamp_min / clamp_max": ([lambda x: torch.clamp_max(x, 0.3), lambda x: x.clamp_max(-0.2),
                               lambda x: x.clamp_min(0.4), lambda x: torch.clamp_min(x, -1)], X),
}


@pytest.mark.parametrize("op, i", [(op, i) for op, (fns, _) in UNARY_CASES.items() for i in range(len(fns))])
def test_unary_math_matches_torch(op, i):
    fns, x = UNARY_CASES[op]
    fn = fns[i]
    check(fn if isinstance(fn, nn.Module) else Fn(fn), x)


def test_log1p_keeps_the_digits_of_small_inputs():
    """Log(1 + x) would be 6% off at x = 1e-7 in float32; the emitted form is exact to 1e-6 relative."""
    model = check(Fn(torch.log1p), TINY, atol=0, rtol=1e-6)
    assert {"Log", "Where"} <= op_types(model)


def test_round_is_half_to_even_and_takes_decimals():
    model = check(Fn(torch.round), HALVES, atol=0, rtol=0)  # bit-exact
    assert "Round" in op_types(model)
    check(Fn(lambda x: torch.round(x, decimals=2)), X * 3.3)
    check(Fn(lambda x: x.round(decimals=-1)), X * 33)


def test_integer_inputs_follow_torch_dtypes():
    """floor / ceil / round are the identity on integers; sqrt of an integer is float32; int ** int stays int."""
    for fn in (torch.floor, torch.ceil, torch.round, torch.trunc, torch.sign, torch.square, lambda x: x ** 2,
               lambda x: x * 0 + 3 ** x.abs()):
        check(Fn(fn), INTS, atol=0, rtol=0)
    check(Fn(torch.sqrt), INTS.abs())
    check(Fn(torch.log2), INTS.abs() + 1)


BINARY_CASES = [
    ("pow tensor exponent", lambda a, b: torch.pow(a, b), POS, Y),
    ("pow method", lambda a, b: a.pow(b), POS, Y),
    ("pow operator", lambda a, b: a ** b, POS, ROW),
    ("minimum", torch.minimum, X, Y),
    ("minimum method, broadcast", lambda a, b: a.minimum(b), X, ROW),
    ("maximum", torch.maximum, X, ROW),
    ("maximum method", lambda a, b: a.maximum(b), X, Y),
    ("clamp tensor bounds", lambda a, b: torch.clamp(a, min=b, max=b + 1), X, ROW),
    ("clamp_min tensor", lambda a, b: a.clamp_min(b), X, Y),
    ("clamp_max tensor", lambda a, b: torch.clamp_max(a, b), X, ROW),
    ("minimum of ints", torch.minimum, INTS, INTS.flip(1)),
    ("maximum of ints", lambda a, b: a.maximum(b), INTS, INTS.flip(1)),
]


@pytest.mark.parametrize("name, fn, a, b", BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_binary_math_matches_torch(name, fn, a, b):
    check(Fn2(fn), a, b)


SOFTMAX_CASES = [
    ("F.log_softmax dim 1", lambda x: F.log_softmax(x, dim=1)),
    ("F.log_softmax last", lambda x: F.log_softmax(x, -1)),
    ("torch.log_softmax dim 2", lambda x: torch.log_softmax(x, 2)),
    ("torch.log_softmax dtype", lambda x: torch.log_softmax(x, 0, torch.float64)),
    ("method", lambda x: x.log_softmax(1)),
    ("method dim=0", lambda x: x.log_softmax(dim=0)),
    ("method dtype", lambda x: x.log_softmax(3, torch.float64)),
    ("module", nn.LogSoftmax(dim=1)),
    ("F.softmin", lambda x: F.softmin(x, dim=2)),
    ("F.softmin last", lambda x: F.softmin(x, -1)),
    ("softmin module", nn.Softmin(dim=1)),
    ("softmax method dtype", lambda x: x.softmax(1, torch.float64)),
]


@pytest.mark.parametrize("name, fn", SOFTMAX_CASES, ids=[c[0] for c in SOFTMAX_CASES])
def test_log_softmax_and_softmin_over_any_dim(name, fn):
    model = check(fn if isinstance(fn, nn.Module) else Fn(fn), X * 3)
    assert op_types(model) & {"LogSoftmax", "Softmax"}


def _randomized(m: nn.Module) -> nn.Module:
    """Non-trivial affine weights and running statistics (the defaults, 1 and 0, test nothing)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5 if "var" in name or "weight" in name
                        else torch.randn(t.shape, generator=gen))
    return m


class FunctionalGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return F.group_norm(x, 2, self.w, self.b, eps=1e-3)


class FunctionalInstanceNorm(nn.Module):
    def __init__(self, use_input_stats):
        super().__init__()
        self.use_input_stats = use_input_stats
        self.register_buffer("rm", torch.randn(4))
        self.register_buffer("rv", torch.rand(4) + 0.5)
        self.w, self.b = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return F.instance_norm(x, self.rm.clone(), self.rv.clone(), self.w, self.b,
                               use_input_stats=self.use_input_stats, eps=1e-4)


X3 = X.reshape(2, 4, 30)
X5 = X.reshape(2, 4, 5, 3, 2)
NORM_CASES = [
    # (name, module, input); InstanceNormalization and the reductions sum in another order than
    # torch: a few float32 ulps on outputs of magnitude ~3 (so atol 1e-5 is kept, rtol 1e-5)
    ("GroupNorm", _randomized(nn.GroupNorm(2, 4)), X),
    ("GroupNorm no affine, 3-d", nn.GroupNorm(4, 4, affine=False), X3),
    ("GroupNorm one group, 2-d", _randomized(nn.GroupNorm(1, 4)), X[:, :, 0, 0]),
    ("F.group_norm", FunctionalGroupNorm(), X),
    ("F.group_norm no weight", Fn(lambda x: F.group_norm(x, 2)), X5),
    ("InstanceNorm1d", nn.InstanceNorm1d(4), X3),
    ("InstanceNorm2d affine", _randomized(nn.InstanceNorm2d(4, affine=True)), X),
    ("InstanceNorm2d running stats", _randomized(nn.InstanceNorm2d(4, track_running_stats=True)), X),
    ("InstanceNorm3d affine, running stats", _randomized(nn.InstanceNorm3d(4, affine=True, track_running_stats=True)),
     X5),
    ("F.instance_norm", Fn(F.instance_norm), X),
    ("F.instance_norm with stats", FunctionalInstanceNorm(True), X3),
    ("F.instance_norm running stats", FunctionalInstanceNorm(False), X),
    ("F.normalize", Fn(F.normalize), X),
    ("F.normalize p=1 last dim", Fn(lambda x: F.normalize(x, p=1, dim=-1)), X),
    ("F.normalize p=3 dim 2", Fn(lambda x: F.normalize(x, 3, 2)), X),
    ("F.normalize p=inf", Fn(lambda x: F.normalize(x, p=math.inf, dim=1)), X),
    ("F.normalize zero rows (eps)", Fn(lambda x: F.normalize(x, dim=1, eps=1e-3)), X * (X > 1)),
    ("InstanceNorm1d unbatched", nn.InstanceNorm1d(4), X3[0]),
    ("InstanceNorm2d unbatched, affine, running stats",
     _randomized(nn.InstanceNorm2d(4, affine=True, track_running_stats=True)), X[0]),
    ("InstanceNorm2d unbatched, affine", _randomized(nn.InstanceNorm2d(4, affine=True)), X[0]),
    ("LocalResponseNorm", nn.LocalResponseNorm(3), X),
    ("F.local_response_norm 3-d", Fn(lambda x: F.local_response_norm(x, 5, alpha=1e-2, beta=0.5, k=2.0)), X3),
    ("LocalResponseNorm even size", nn.LocalResponseNorm(4, alpha=0.5, beta=0.6, k=1.5), X),
    ("F.local_response_norm even size, 5-d", Fn(lambda x: F.local_response_norm(x, 2, alpha=0.3)), X5),
    ("F.local_response_norm odd size, 5-d", Fn(lambda x: F.local_response_norm(x, 3, alpha=0.3)), X5),
]


@pytest.mark.parametrize("name, m, x", NORM_CASES, ids=[c[0] for c in NORM_CASES])
def test_normalization_matches_torch_eval(name, m, x):
    check(m, x)


def test_group_norm_is_instance_normalization_between_reshapes():
    model = check(_randomized(nn.GroupNorm(2, 4)), X)
    assert [n.op_type for n in model.graph.node][:4] == ["Reshape", "InstanceNormalization", "Shape", "Reshape"]


def test_these_ops_are_placed_on_the_cpu_with_the_reason():
    gm = qcompiler.partition(Fn(lambda x: torch.sqrt(x).log_softmax(1)), (POS,), march="bayes")
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["sqrt"].meta[META_PLACEMENT] == "cpu"
    assert nodes["sqrt"].meta[META_REASON] == "sqrt is not supported on bayes"
    assert nodes["log_softmax"].meta[META_REASON] == "log_softmax is not supported on bayes"


# ---------------------------------------------------------------------------
# what is refused: an UnsupportedOpError naming the node, the op and why

REFUSED = [
    ("normalize p=0", Fn(lambda x: F.normalize(x, p=0)), X,
     r"node 'normalize' \(F.normalize, op 'normalize'\).*p=0 \(p must be > 0\)"),
    ("normalize p<0", Fn(lambda x: F.normalize(x, p=-1.0)), X, r"node 'normalize' .*p=-1.0 \(p must be > 0\)"),
    ("integer clamp, tensor bounds", Fn2(lambda a, b: a.clamp_max(b)), (INTS, INTS.flip(1)),
     r"node 'clamp_max' \(\.clamp_max, op 'clamp'\).*integer tensor with tensor bounds"),
    ("log_softmax to bfloat16", Fn(lambda x: x.log_softmax(1, torch.bfloat16)), X,
     r"node 'log_softmax' \(\.log_softmax, op 'log_softmax'\).*dtype torch.bfloat16"),
]


@pytest.mark.parametrize("name, m, x, match", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_forms_name_the_node_and_why(name, m, x, match):
    with pytest.raises(UnsupportedOpError, match=match):
        emit(m, *(x if isinstance(x, tuple) else (x,)))


# ---------------------------------------------------------------------------
# end to end: a BPU conv feeds these ops, whose CPU island is ONNX (not eager torch)


class ConvThenMath(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x):
        y = self.conv(x)
        z = torch.sqrt(y.abs() + 1) + torch.maximum(y, y.sin()) + F.mish(y) + torch.pow(y, 2).log1p()
        return F.log_softmax(self.gn(z), dim=1), F.normalize(y, dim=1)


def test_compile_runs_the_cpu_part_as_an_onnx_island(tmp_path):
    torch.manual_seed(0)
    model = _randomized(ConvThenMath()).eval()
    x = torch.rand(1, 3, 8, 8)
    cm = qcompiler.compile(model, x, march="bayes", calib_data=[torch.rand(1, 3, 8, 8) for _ in range(2)],
                           progress=False)
    kinds = [s.kind for s in cm.runtime.steps]
    assert "bpu" in kinds and "cpu" in kinds and "torch" not in kinds, kinds
    assert cm.torch_islands() == {}
    outs, refs = cm(x), cm.converted(x)  # onnxruntime vs the converted model's float CPU ops
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)  # log_softmax of ~10-magnitude values
    cm.export_onnx(tmp_path / "m.onnx")  # no torch island to refuse
    onnx.checker.check_model(onnx.load(tmp_path / "m.onnx"), full_check=True)
