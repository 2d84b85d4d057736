"""The rewrite row div_by_number_as_mul (passes/rewrite.py): x / c by a Python number becomes
x * (1 / c) where the march refuses the div and runs the mul (nash: attention's / sqrt(d)).

Tolerance: x * (1 / c) rounds 1 / c once more than x / c, so the outputs may differ, by at most
1 ULP of x / c (measured with torch.nextafter below), never more."""

from __future__ import annotations

import copy
import dataclasses
import math
import operator

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.dump import partition_table
from qcompiler.ir.meta import META_REWRITE
from qcompiler.march import March
from qcompiler.passes import rewrite as rw
from qcompiler.passes.base import CompileContext

NOTE = "x / c by a number rewritten as x * (1 / c) (within 1 ULP), a mul the march runs"
ROW = next(r for r in rw.REWRITES if r.name == "div_by_number_as_mul")


class Div(nn.Module):
    """A linear, then its output divided as ``spelling`` says."""

    def __init__(self, spelling: str, c=8.0, **kw):
        super().__init__()
        self.lin, self.spelling, self.c, self.kw = nn.Linear(16, 16), spelling, c, kw

    def forward(self, x):
        y, c = self.lin(x), self.c
        if self.spelling == "op":
            return y / c
        if self.spelling == "torch.div":
            return torch.div(y, c, **self.kw)
        if self.spelling == "method":
            return y.div(c, **self.kw)
        if self.spelling == "true_divide":
            return torch.true_divide(y, c)
        if self.spelling == "tensor":
            return y / self.lin.weight.sum()  # a tensor divisor (computed from a parameter)
        raise ValueError(self.spelling)


X = torch.randn(2, 4, 16)


def _run(model, march, x=X):
    gm = trace(copy.deepcopy(model).eval())
    propagate_shapes(gm, (x,))
    ctx = CompileContext(march=march, example_inputs=(x,))
    return gm, ctx, rw.rewrite(gm, ctx)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| in ULPs of ``want`` where ``want`` is finite; where it overflowed, ``got``
    must be the same infinity (else: inf ULPs)."""
    fin = torch.isfinite(want)
    if not torch.equal(got[~fin], want[~fin]):
        return math.inf
    got, want = got[fin], want[fin]
    ulp = (torch.nextafter(want.abs(), torch.tensor(math.inf, dtype=want.dtype)) - want.abs()).double()
    return float(((got.double() - want.double()).abs() / ulp).max())


def _muls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul]


@pytest.mark.parametrize("spelling", ["op", "torch.div", "method", "true_divide"])
@pytest.mark.parametrize("c", [8.0, math.sqrt(64.0), 3, -0.125, 7.3])
def test_every_spelling_becomes_a_mul_by_the_reciprocal_on_nash(spelling, c):
    model = Div(spelling, c)
    with torch.no_grad():
        ref = model(X)
    gm, ctx, result = _run(model, March.NASH)
    assert result.modified
    (mul,) = _muls(gm)
    assert mul.args[1] == rw.reciprocal(c, "f32") and mul.meta[META_REWRITE] == NOTE
    assert abs(mul.args[1] * c - 1.0) < 2 ** -23
    assert not any(n.op in ("call_function", "call_method") and "div" in str(n.target) for n in gm.graph.nodes)
    with torch.no_grad():
        got = gm(X)
    assert _ulps(got, ref) <= 1.0
    assert not rw.rewrite(gm, ctx).modified  # a fixed point
    rw.verify_rewritten(gm, ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_reciprocal_is_within_one_ulp_over_many_values_and_divisors(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g, dtype=dtype) * 10.0 ** torch.randint(-20, 20, (100_000,), generator=g)
    name = {torch.float32: "f32", torch.float64: "f64"}[dtype]
    divisors = [3.0, 7.0, 0.1, 1e-3, -5.5, 1e20, 1e-20, 2.0 ** -126, 2.0 ** 126] + [math.sqrt(k) for k in range(2, 200)]
    for c in divisors:
        assert rw._divisor(c)
        assert _ulps(x * rw.reciprocal(c, name), x / c) <= 1.0, c
    # and the bound is needed: not bit for bit (the tolerance is not slack)
    assert not torch.equal(x * rw.reciprocal(3.0, name), x / 3.0)


@pytest.mark.parametrize("c", [0, 0.0, math.inf, -math.inf, math.nan, 1e-39, 1e39, True])
def test_divisors_outside_the_stated_bound_are_not_numbers_it_rewrites(c):
    assert not rw._divisor(c)


@pytest.mark.parametrize("model", [
    Div("torch.div", 8.0, rounding_mode="floor"),
    Div("method", 8.0, rounding_mode="trunc"),
    Div("tensor"),
    Div("op", 0.0),
    Div("op", 1e-40),
], ids=["floor", "trunc", "tensor-divisor", "zero", "reciprocal-overflows"])
def test_what_the_row_declines(model):
    gm, ctx, result = _run(model, March.NASH)
    assert not result.modified and not _muls(gm)
    for node in gm.graph.nodes:
        assert ROW.match(node, gm, ctx) is None


class Divided(nn.Module):
    """A linear divided by a number, as a first-class op (div runs where its march has it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) / 8.0


def test_rewritten_on_every_march_whose_div_refuses_a_number_and_whose_mul_runs():
    for march, x in ((March.BAYES, X), (March.BERNOULLI2, torch.randn(1, 2, 4, 16))):  # bernoulli2: 4-D only
        gm, _, result = _run(Div("op"), march, x)
        assert result.modified and len(_muls(gm)) == 1


def test_not_rewritten_where_the_march_refuses_the_mul_as_well():
    """bernoulli2 runs mul on 4-D values of at most 2048 channels (dim 1): with 4096, or on 3-D values,
    the div is left as it is."""
    gm, _, result = _run(Div("op"), March.BERNOULLI2, X)
    assert not result.modified
    x = torch.randn(1, 4096, 1, 16)
    gm, _, result = _run(Div("op"), March.BERNOULLI2, x)
    assert not result.modified and not _muls(gm)
    gm, _, result = _run(Div("op"), March.NASH, x)  # nash has no such limit
    assert result.modified


def test_not_rewritten_where_div_by_a_number_runs(monkeypatch):
    """On a march whose div row accepts a number divisor the div stays."""
    from qcompiler.backends.bpu import TABLES
    from qcompiler.backends.bpu.support import OpRule

    rules = dict(TABLES[March.NASH].rules)
    rules["div"] = OpRule("div", (), int16=True)  # a march that divides by numbers
    monkeypatch.setitem(TABLES, March.NASH, dataclasses.replace(TABLES[March.NASH], rules=rules))
    gm, _, result = _run(Div("op"), March.NASH)
    assert not result.modified and not _muls(gm)


def test_not_rewritten_where_the_mul_does_not_run(monkeypatch):
    from qcompiler.backends.bpu import TABLES

    rules = {k: v for k, v in TABLES[March.NASH].rules.items() if k != "mul"}
    monkeypatch.setitem(TABLES, March.NASH, dataclasses.replace(TABLES[March.NASH], rules=rules))
    gm, _, result = _run(Div("op"), March.NASH)
    assert not result.modified


class Attention(nn.Module):
    """Scaled dot-product scores: q @ k^T / sqrt(d)."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.d = nn.Linear(d, d), nn.Linear(d, d), d

    def forward(self, x):
        return torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) / math.sqrt(self.d)


def test_attention_scale_stays_on_the_bpu_in_the_pipeline():
    model = Attention().eval()
    gm = qcompiler.partition(copy.deepcopy(model), (X,), march="nash")
    rows = {r["node"]: r for r in partition_table(gm)}
    (mul,) = [r for r in rows.values() if r["reason"].endswith(f"({NOTE})")]
    assert mul["placement"] == "bpu" and mul["reason"].startswith("mul supported on nash")
    with torch.no_grad():
        assert _ulps(gm(X), model(X)) <= 1.0
    # on nash without the row the div would be on CPU: the table refuses a div by a number
    ok, why = rw.op_table(March.NASH).check(rw.op_info(next(iter(_div_nodes(model))), "div", {}))
    assert not ok and "feature-map operand" in why


def _div_nodes(model):
    gm = trace(copy.deepcopy(model))
    propagate_shapes(gm, (X,))
    return [n for n in gm.graph.nodes if n.target is operator.truediv]


def test_attention_compiles_on_nash_with_the_scale_on_the_bpu():
    torch.manual_seed(0)
    model = Attention().eval()
    cm = qcompiler.compile(model, (X,), march="nash", calib_data=[(X,)], progress=False)
    with torch.no_grad():
        y = cm(X)
    ref = model(X)
    assert y.shape == ref.shape
    assert (y - ref).abs().max() < 0.1 * ref.abs().max()  # int8 quantization error, not a wrong graph
