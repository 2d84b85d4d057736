"""The allow-list of islands (``backends/onnx/allowlist.py``) covers everything the emitter writes.

``load`` refuses an island holding an op type or attribute the list lacks, so a rule that writes
something new must fail here, not in a user's ``load``:

* statically: every ONNX op type named in the emitter's sources is allowed, and the attributes of
  each literal ``ctx.make("Op", ..., attr=...)`` are allowed on that op; the list names nothing the
  sources never name, and only attributes the opset-11 schema has;
* by emitting: the zoo (float graphs, compiled islands, quantized exports), the case tables of the
  ONNX emitter tests, and modules for the rules whose attributes are computed, each checked with
  the check ``load`` runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import onnx
import onnx.defs
import pytest
import test_onnx_arith as arith_cases
import test_onnx_math as math_cases
import test_onnx_shape_ops as shape_cases
import test_onnx_views as view_cases
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx_modules import Fn, Fn2, Wrap

import qcompiler
import qcompiler.zoo as zoo
from qcompiler.backends.onnx import emit_graph, registry
from qcompiler.backends.onnx.allowlist import ALLOWED, OPSET
from qcompiler.backends.ort.island import check_vocabulary
from qcompiler.errors import ArtifactError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for p in (ROOT / "backends" / "onnx").rglob("*.py") if p.name != "allowlist.py")
ONNX_OPS = frozenset(s.name for s in onnx.defs.get_all_schemas_with_history())
_NOT_ATTRIBUTES = {"outputs", "tag", "dtype"}  # NodeContext.make's own keywords


# ---------------------------------------------------------------------------- statically, from the sources


def named_ops(source: str) -> set[str]:
    """Every string constant of ``source`` that is an ONNX op type (of any domain and opset)."""
    return {n.value for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in ONNX_OPS}


def literal_nodes(source: str) -> list[tuple[int, str, set[str]]]:
    """(line, op type, attribute keywords) of each ``make("Op", ..., k=...)`` / ``add_node("Op", ...)``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("make", "add_node") \
                and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
            out.append((n.lineno, n.args[0].value, {k.arg for k in n.keywords if k.arg} - _NOT_ATTRIBUTES))
    return out


def test_the_source_scans_find_what_they_look_for():
    src = 'UNARY = {"x": "Hardmax"}\nctx.make("Conv", [x], tag="c", group=2, **attrs)\nname = "conv"\n'
    assert named_ops(src) == {"Hardmax", "Conv"}
    assert literal_nodes(src) == [(2, "Conv", {"group"})]
    everything = set().union(*(named_ops(p.read_text()) for p in SOURCES))
    assert len(everything) > 100 and {"Conv", "Resize", "LSTM", "QuantizeLinear"} <= everything


def test_every_op_type_the_emitter_names_is_allowed():
    missing = {f"{op} ({p.relative_to(ROOT)})" for p in SOURCES for op in named_ops(p.read_text()) if op not in ALLOWED}
    assert not missing, f"op types the emitter names but backends/onnx/allowlist.py lacks: {sorted(missing)}"


def test_every_literal_attribute_is_allowed():
    missing = [f"{p.relative_to(ROOT)}:{line}: {op}.{a}" for p in SOURCES
               for line, op, attrs in literal_nodes(p.read_text())
               for a in sorted(attrs - ALLOWED.get(op, frozenset()))]
    assert not missing, f"attributes the rules write but backends/onnx/allowlist.py lacks: {missing}"


def test_the_list_holds_only_what_the_emitter_names():
    """No dead entries: each op type is named in the emitter's sources, each attribute is in its
    opset-11 schema (the type ``load`` compares with) and named in the sources."""
    text = "\n".join(p.read_text() for p in SOURCES)
    named = set().union(*(named_ops(p.read_text()) for p in SOURCES))
    assert set(ALLOWED) <= named, sorted(set(ALLOWED) - named)
    for op, attrs in ALLOWED.items():
        schema = onnx.defs.get_schema(op, OPSET, "")
        assert attrs <= set(schema.attributes), (op, sorted(attrs - set(schema.attributes)))
        assert all(a in text for a in attrs), (op, [a for a in attrs if a not in text])


# ---------------------------------------------------------------------------- by emitting


def allowed(model: onnx.ModelProto, what: str) -> None:
    """The check ``load`` runs on an island (an ArtifactError names the node and op / attribute)."""
    check_vocabulary(model, what)


class Fn3(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y, z):
        return self.fn(x, y, z)


class Fn4(Fn3):
    def forward(self, x, y, z, w):
        return self.fn(x, y, z, w)


def _tensors(items) -> list[torch.Tensor]:
    out = []
    for v in items:
        out.extend(_tensors(v) if isinstance(v, (tuple, list)) else [v] if isinstance(v, torch.Tensor) else [])
    return out


def _as_module(fn, n: int) -> nn.Module:
    if isinstance(fn, nn.Module):
        return Wrap(fn) if type(fn).__module__.startswith("torch.nn") else fn
    return {1: Fn, 2: Fn2, 3: Fn3, 4: Fn4}[n](fn)


def _table_cases():
    """(id, module, inputs) of the case tables of the ONNX emitter tests: what they prove runs, is allowed."""
    tables = {"arith.BINARY": arith_cases.BINARY, "arith.UNARY": arith_cases.UNARY, "views.CASES": view_cases.CASES,
              "math.BINARY": math_cases.BINARY_CASES, "math.NORM": math_cases.NORM_CASES,
              "shape.REDUCTIONS": shape_cases.REDUCTIONS, "shape.LAYOUT": shape_cases.LAYOUT,
              "shape.POOLS": shape_cases.POOLS}
    for table, cases in tables.items():
        for name, fn, *rest in cases:
            inputs = _tensors(rest)
            yield f"{table}: {name}", _as_module(fn, len(inputs)), inputs
    for name, fn in math_cases.SOFTMAX_CASES:
        yield f"math.SOFTMAX: {name}", _as_module(fn, 1), [math_cases.X * 3]
    for name, fn in shape_cases.SORTING:
        yield f"shape.SORTING: {name}", _as_module(fn, 1), [shape_cases.M]
    for name, fn, index in shape_cases.INDEXING:
        yield f"shape.INDEXING: {name}", shape_cases.Indexed(fn, index), [shape_cases.M]
    for op, (fns, x) in math_cases.UNARY_CASES.items():
        for i, fn in enumerate(fns):
            yield f"math.UNARY: {op} {i}", _as_module(fn, 1), [x]


X4 = torch.randn(2, 4, 9, 11)
SEQ = torch.randn(5, 2, 6)


def _computed_attributes():
    """Modules reaching the rules whose attributes are computed (``**attrs``), in every form."""
    yield "max_pool", nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True), [X4]
    yield "max_pool indices", Fn(lambda x: F.max_pool2d(x, 2, return_indices=True)), [X4]
    yield "adaptive max", nn.AdaptiveMaxPool2d((3, 4)), [X4]
    yield "adaptive max 1x1", nn.AdaptiveMaxPool2d(1), [X4]
    yield "adaptive avg", nn.AdaptiveAvgPool2d((4, 5)), [X4]
    yield "avg pool", nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), [X4]
    for mode, kw in (("nearest", {}), ("nearest-exact", {}), ("bilinear", {"align_corners": True}),
                     ("bilinear", {}), ("bicubic", {})):
        yield f"interpolate {mode}", Fn(lambda x, m=mode, k=kw: F.interpolate(x, scale_factor=2, mode=m, **k)), [X4]
        yield f"interpolate {mode} size", Fn(lambda x, m=mode, k=kw: F.interpolate(x, size=(5, 7), mode=m, **k)), [X4]
    yield "lstm", nn.LSTM(6, 8, num_layers=2, bidirectional=True), [SEQ]
    yield "gru", nn.GRU(6, 8, bidirectional=True), [SEQ]
    yield "rnn relu", nn.RNN(6, 8, nonlinearity="relu"), [SEQ]
    yield "rnn tanh", nn.RNN(6, 8, bidirectional=True), [SEQ]
    yield "lstm cell", nn.LSTMCell(6, 8), [SEQ[0]]
    yield "gru cell", nn.GRUCell(6, 8), [SEQ[0]]
    yield "rnn cell", nn.RNNCell(6, 8), [SEQ[0]]
    for p in (1, 2):
        yield f"normalize p={p}", Fn(lambda x, p=p: F.normalize(x, p=p)), [X4]
    for p in (1, 2, float("inf")):
        yield f"dist p={p}", Fn2(lambda a, b, p=p: torch.dist(a, b, p)), [X4, X4.flip(0)]
    yield "amax", Fn(lambda x: x.amax(1, keepdim=True)), [X4]
    yield "argmin", Fn(lambda x: x.argmin(2)), [X4]
    yield "argmax all", Fn(lambda x: x.argmax()), [X4]
    yield "prod", Fn(lambda x: x.prod(1)), [X4]
    yield "sum all", Fn(lambda x: x.sum()), [X4]
    yield "mse sum", Fn2(lambda a, b: F.mse_loss(a, b, reduction="sum")), [X4, X4.flip(0)]
    yield "l1 mean", Fn2(lambda a, b: F.l1_loss(a, b)), [X4, X4.flip(0)]
    yield "embedding bag", nn.EmbeddingBag(10, 4, mode="max"), [torch.tensor([[1, 2, 3], [4, 5, 9]])]
    yield "attention", nn.MultiheadAttention(8, 2), [torch.randn(3, 2, 8)] * 3
    yield "activations", nn.Sequential(nn.ELU(0.5), nn.SELU(), nn.Hardsigmoid(), nn.LeakyReLU(0.2), nn.CELU(),
                                       nn.PReLU(), nn.Softplus(), nn.Softsign(), nn.Hardswish()), [X4]
    yield "norms", nn.Sequential(nn.BatchNorm2d(4), nn.InstanceNorm2d(4), nn.LocalResponseNorm(3),
                                 nn.GroupNorm(2, 4), nn.LayerNorm(11)), [X4]
    yield "convs", nn.Sequential(nn.Conv2d(4, 6, 3, 2, 1, groups=2), nn.ConvTranspose2d(6, 4, 3, 2, 1, 1),
                                 nn.PixelShuffle(2), nn.Flatten(), nn.Linear(480, 3)), [X4]


_EMITTED = [pytest.param(m, x, id=name) for name, m, x in (*_table_cases(), *_computed_attributes())]


@pytest.mark.parametrize("module,inputs", _EMITTED)
def test_every_emitted_node_is_allowed(module, inputs):
    gm = qcompiler.partition(module.eval(), tuple(inputs), march="bayes")
    allowed(emit_graph(gm), "the emitted model")


ZOO = {"resnet18": dict(image_size=32), "mobilenet_v2": dict(image_size=32), "resnet50": dict(image_size=32),
       "unet": dict(image_size=32), "transformer_block": {}, "hybrid": dict(image_size=32), "lstm_seq": {}}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_float_graphs_are_allowed(name):
    x = zoo.example_inputs(name, **ZOO[name])
    allowed(emit_graph(qcompiler.partition(zoo.get(name), x, march="bayes")), name)


@pytest.mark.parametrize("name,march", [("hybrid", "bayes"), ("hybrid", "bernoulli2"), ("lstm_seq", "bayes"),
                                        ("transformer_block", "bayes"), ("resnet18", "bayes")])
def test_zoo_islands_and_quantized_exports_are_allowed(name, march, tmp_path, guide_hybrid_dict):
    x = zoo.example_inputs(name, **ZOO[name])
    kw = {"hybrid_dict": guide_hybrid_dict} if name == "hybrid" else {}
    cm = qcompiler.compile(zoo.get(name), x, march=march, progress=False, **kw)
    islands = cm.runtime.islands
    assert islands or name == "resnet18"  # (an all-BPU model has none)
    for step, data in islands.items():
        allowed(onnx.load_from_string(data), f"{name} island '{step}'")
    cm.export_onnx(tmp_path / "q.onnx")
    exported = onnx.load(tmp_path / "q.onnx")
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in exported.graph.node}
    allowed(exported, f"{name} quantized export")


# ---------------------------------------------------------------------------- a rule that writes something new


@pytest.mark.parametrize("rule,match", [
    (lambda ctx: ctx.make("Hardmax", [ctx.x()], axis=1),
     r"node 'bpu0/sigmoid' has op type 'Hardmax', which qcompiler never writes"),
    (lambda ctx: ctx.make("Concat", [ctx.x()], axis=0, new_axis=1),
     r"node 'bpu0/sigmoid' \(Concat\) has attribute 'new_axis', which qcompiler never writes on Concat"),
], ids=["new op type", "new attribute"])
def test_a_rule_writing_something_unlisted_fails_the_coverage_check(monkeypatch, rule, match):
    gm = qcompiler.partition(Fn(torch.sigmoid).eval(), (X4,), march="bayes")
    allowed(emit_graph(gm), "as the rules stand")
    monkeypatch.setitem(registry._OP_RULES, "sigmoid", {OPSET: rule})
    with pytest.raises(ArtifactError, match=match):
        allowed(emit_graph(gm), "with the new rule")
