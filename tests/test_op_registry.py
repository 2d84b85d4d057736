"""The op registry (qcompiler.ir.ops): one definition per op, tags, and the one argument reader ``bind``."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.backends.bpu import bayes, bernoulli2
from qcompiler.errors import UnsupportedOpError
from qcompiler.ir import batch_dim, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REASON
from qcompiler.ir.ops import (
    FUNCTION_OPS, LAYOUT_OPS, META_OPS, METHOD_OPS, MODULE_OPS, OPS, PASSTHROUGH_OPS, Tag, bind, names, tagged,
)
from qcompiler.ir.ops.catalogue import CATALOGUE
from qcompiler.quantization import prepare_calibration_fx

# ------------------------------------------------------------------------------------- the registry


def test_every_spelling_belongs_to_exactly_one_op():
    seen: dict[object, str] = {}
    for op in CATALOGUE:
        for spelling in op.spellings:
            assert spelling not in seen, f"{spelling!r} spells {seen[spelling]!r} and {op.name!r}"
            seen[spelling] = op.name
    assert len({op.name for op in CATALOGUE}) == len(CATALOGUE) == len(OPS)


def test_the_spelling_tables_are_derived_from_the_definitions():
    for table, kind in ((MODULE_OPS, "modules"), (FUNCTION_OPS, "functions"), (METHOD_OPS, "methods")):
        for spelling, op in table.items():
            assert spelling in getattr(OPS[op], kind)
    assert FUNCTION_OPS[torch.cat] == FUNCTION_OPS[torch.concat] == names.CAT
    assert METHOD_OPS["view"] == METHOD_OPS["squeeze"] == names.RESHAPE
    assert torch.clamp not in FUNCTION_OPS and "clamp" in OPS  # clamps canonicalize by their bounds


def test_every_op_of_the_march_tables_is_defined():
    for march in (bayes, bernoulli2):
        ops = set(march.TABLE.rules)
        assert ops and ops <= set(OPS), sorted(ops - set(OPS))
    constants = {v for k, v in vars(names).items() if k.isupper()}
    assert constants <= set(OPS), sorted(constants - set(OPS))


def test_tags_query_the_groups():
    assert PASSTHROUGH_OPS == tagged(Tag.PASSTHROUGH) == {"identity", "dropout"}
    assert LAYOUT_OPS == {"reshape", "flatten", "permute", "transpose"}
    assert META_OPS == {"size"}
    assert {"conv2d", "max_pool2d", "interpolate", "batch_norm"} <= tagged(Tag.SPATIAL)
    assert {"sum", "mean", "amax"} <= tagged(Tag.REDUCTION)
    assert "softmax" in tagged(Tag.ALONG_DIM) and "softmax" not in tagged(Tag.CPU_EXACT)
    assert tagged(Tag.TRAINING) == {"dropout", "batch_norm", "batch_norm1d", "batch_norm3d"}


def test_the_batch_rules_come_from_the_tags():
    assert batch_dim.CPU_EXACT == tagged(Tag.CPU_EXACT)
    for op in tagged(Tag.ELEMENTWISE) - tagged(Tag.TRAINING):
        assert batch_dim.RULES[op] is batch_dim._elementwise, op
    for op in tagged(Tag.SPATIAL) - tagged(Tag.TRAINING):
        assert batch_dim.RULES[op] is batch_dim._leading, op
    families = [tagged(t) for t in (Tag.ELEMENTWISE, Tag.SPATIAL, Tag.ALONG_DIM, Tag.REDUCTION)]
    assert sum(len(f) for f in families) == len(set().union(*families)), "an op in two families"


# ------------------------------------------------------------------------------------------- bind


def _bound(fn, modules=None):
    """The bindings of every call node of ``fn(module, x[, y])`` traced (in a module holding ``modules``)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in (modules or {}).items():
                setattr(self, k, v)

        def forward(self, x, y):
            return fn(self, x, y) if fn.__code__.co_argcount == 3 else fn(self, x)

    gm = trace(M())
    mods = dict(gm.named_modules())
    return [bind(n, mods) for n in gm.graph.nodes if n.op.startswith("call_")]


def _one(fn, **kw):
    (b,) = _bound(fn, **kw)
    return b


def _args(b, *keys):
    return tuple(b[k] for k in keys)


def test_bind_conv2d_positional_keyword_default_and_module():
    w = torch.zeros(4, 3, 3, 3)
    pos = _one(lambda m, x: F.conv2d(x, w, None, 2, 1))
    kw = _one(lambda m, x: F.conv2d(x, weight=w, stride=2, padding=1))
    assert _args(pos, "stride", "padding", "dilation", "groups") == _args(kw, "stride", "padding", "dilation",
                                                                          "groups") == (2, 1, 1, 1)
    assert pos.op == "conv2d" and pos["bias"] is None and kw["bias"] is None
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
    mod = _one(lambda m, x: m.conv(x), modules={"conv": conv})
    assert mod["weight"] is conv.weight and _args(mod, "stride", "padding", "groups") == ((2, 2), (1, 1), 1)


@pytest.mark.parametrize("fn, dim", [
    (lambda m, a, b: torch.cat([a, b], 1), 1),
    (lambda m, a, b: torch.cat([a, b], dim=1), 1),
    (lambda m, a, b: torch.cat((a, b)), 0),
    (lambda m, a, b: torch.concat([a, b], -1), -1),
])
def test_bind_cat(fn, dim):
    b = _one(fn)
    assert b["dim"] == dim and len(b["tensors"]) == 2


@pytest.mark.parametrize("op, fn, dim, keepdim", [
    ("mean", lambda m, x: torch.mean(x, (2, 3), True), (2, 3), True),
    ("mean", lambda m, x: torch.mean(x, dim=(2, 3), keepdim=True), (2, 3), True),
    ("mean", lambda m, x: x.mean([2, 3]), [2, 3], False),
    ("mean", lambda m, x: x.mean(), None, False),
    ("sum", lambda m, x: torch.sum(x, 1), 1, False),
    ("sum", lambda m, x: x.sum(1, True), 1, True),
    ("sum", lambda m, x: torch.sum(x, dim=1, keepdim=False), 1, False),
])
def test_bind_reductions(op, fn, dim, keepdim):
    b = _one(fn)
    assert (b.op, b["dim"], b["keepdim"], b["dtype"]) == (op, dim, keepdim, None)


@pytest.mark.parametrize("fn", [
    lambda m, x: F.softmax(x, 1),
    lambda m, x: F.softmax(x, dim=1),
    lambda m, x: torch.softmax(x, 1),
    lambda m, x: x.softmax(1),
    lambda m, x: m.softmax(x),
])
def test_bind_softmax_every_spelling(fn):
    b = _one(fn, modules={"softmax": nn.Softmax(dim=1)})
    assert b.op == "softmax" and b["dim"] == 1


def test_bind_interpolate_positional_keyword_and_module():
    pos = _one(lambda m, x: F.interpolate(x, None, 2.0, "bilinear", False))
    kw = _one(lambda m, x: F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False))
    keys = ("size", "scale_factor", "mode", "align_corners", "antialias")
    assert _args(pos, *keys) == _args(kw, *keys) == (None, 2.0, "bilinear", False, False)
    mod = _one(lambda m, x: m.up(x), modules={"up": nn.Upsample(scale_factor=2.0, mode="bilinear")})
    assert _args(mod, "scale_factor", "mode", "antialias") == (2.0, "bilinear", False)


def test_bind_layout_ops():
    views = _bound(lambda m, x: (x.view(2, -1), x.view((2, -1)), torch.reshape(x, (2, -1)), x.reshape(shape=(2, -1))))
    assert [tuple(v.get("size", v.get("shape"))) for v in views if v is not None] == [(2, -1)] * 4
    perms = _bound(lambda m, x: (x.permute(0, 2, 1), x.permute((0, 2, 1)), torch.permute(x, dims=(0, 2, 1))))
    assert [tuple(p["dims"]) for p in perms if p is not None] == [(0, 2, 1)] * 3
    t1, t2 = [b for b in _bound(lambda m, x: (x.transpose(1, 2), torch.transpose(x, dim0=1, dim1=2))) if b]
    assert _args(t1, "dim0", "dim1") == _args(t2, "dim0", "dim1") == (1, 2)
    sq, unsq = [b for b in _bound(lambda m, x: (x.squeeze(), x.unsqueeze(-1))) if b]
    assert (sq.spelling, sq["dim"], unsq.spelling, unsq["dim"]) == ("squeeze", None, "unsqueeze", -1)


def _call_node(target, args, kwargs=None, op="call_function"):
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.create_node(op, target, (x, *args), kwargs or {}, name="bad")
    g.output(node)
    return node


@pytest.mark.parametrize("node, message", [
    (_call_node(F.conv2d, (None,), {"strides": 2}), "unknown keyword argument strides=2"),
    (_call_node(torch.cat, (1, 2)), "2 positional arguments after the inputs; its signature has 1 (dim)"),
    (_call_node("transpose", (1,), op="call_method"), "missing argument(s) dim1"),
    (_call_node(torch.mean, (1,), {"dim": 2}), "argument 'dim' given twice"),
    (_call_node(F.pixel_shuffle, ()), "op 'pixel_shuffle' has no argument signature yet"),
])
def test_bind_refuses_calls_that_do_not_fit(node, message):
    with pytest.raises(UnsupportedOpError, match=r"node 'bad'") as err:
        bind(node, {})
    assert message in str(err.value)


def test_bind_is_none_for_what_calls_no_op():
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(operator.invert, (x,))
    assert bind(node, {}) is None and bind(x, {}) is None


# ----------------------------------------------------------------- placement by position or keyword

X = torch.rand(2, 4, 8, 8)


class _Pair(nn.Module):
    """Two convs whose outputs one op joins or reduces: ``op(self, a, b)``."""

    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.op = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), op

    def forward(self, x):
        return self.op(self.a(x), self.b(x))


def _placements(op):
    prepared = prepare_calibration_fx(_Pair(op).eval(), None, hybrid=True, example_inputs=(X,), march="bayes")
    return [(n.name, n.meta[META_PLACEMENT], n.meta[META_REASON]) for n in prepared.graph.nodes
            if META_PLACEMENT in n.meta and n.op != "get_attr"]


@pytest.mark.parametrize("by_position, by_keyword, node, expected", [
    (lambda a, b: torch.cat([a, b], 1), lambda a, b: torch.cat([a, b], dim=1), "cat",
     ("bpu", "cat supported on bayes")),
    (lambda a, b: torch.mean(a + b, (2, 3), True), lambda a, b: torch.mean(a + b, dim=(2, 3), keepdim=True), "mean",
     ("bpu", "mean supported on bayes")),
    (lambda a, b: torch.softmax(a + b, 1), lambda a, b: torch.softmax(a + b, dim=1), "softmax",
     ("cpu", "softmax is not supported on bayes")),
    (lambda a, b: torch.sum(a + b, 1), lambda a, b: torch.sum(a + b, dim=1), "sum_1",
     ("cpu", "sum is not supported on bayes")),
])
def test_placement_with_dim_by_position_is_placement_with_dim_by_keyword(by_position, by_keyword, node, expected):
    pos, kw = _placements(by_position), _placements(by_keyword)
    assert pos == kw
    assert {name: (where, why) for name, where, why in pos}[node] == expected


def test_placement_does_not_lean_on_torch_schema_matching(monkeypatch):
    """torch <= 2.12's normalized_arguments raises "schema match was ambiguous" for a cat with dim by
    position (issue 36); placement reads arguments with bind, so a cat along dim 1 stays on the BPU."""
    def ambiguous(*args, **kwargs):
        raise RuntimeError("Tried to normalize arguments to torch.cat but the schema match was ambiguous!")

    monkeypatch.setattr(fx.Node, "normalized_arguments", ambiguous)
    pos = {name: (where, why) for name, where, why in _placements(lambda a, b: torch.cat([a, b], 1))}
    assert pos["cat"] == ("bpu", "cat supported on bayes")
