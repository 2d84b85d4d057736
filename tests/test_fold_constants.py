"""passes/fold_constants.py: parameter-only subgraphs become one bit-exact buffer (golden code); what
reads an input, trains (QAT), is written in place, draws random numbers or only broadcasts is not folded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn as nn

from qcompiler.errors import PassError
from qcompiler.ir import trace
from qcompiler.ir.capture import capture
from qcompiler.ir.meta import META_TENSOR
from qcompiler.march import March
from qcompiler.passes.base import CompileContext, PassManager
from qcompiler.passes.fold_constants import FOLD_CONSTANTS, fold_constants, verify_folded
from qcompiler.passes.pipeline import PARTITION_PIPELINE
from qcompiler.quantization import get_default_qat_qconfig, prepare_qat_fx

X = torch.rand(2, 3, 16)
CTX = CompileContext(march=March.BAYES, example_inputs=(X,))


def relative_position_bias(table, index, window):
    """torchvision's swin _get_relative_position_bias, an fx.wrap'ed function of parameters only."""
    n = window * window
    bias = table[index.view(-1)].view(n, n, -1)
    return bias.permute(2, 0, 1).contiguous().unsqueeze(0)


torch.fx.wrap("relative_position_bias")


class RelPosBias(nn.Module):
    def __init__(self, window=4, heads=3):
        super().__init__()
        self.window = window
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1])

    def forward(self, x):  # x: (b, heads, n*n) -> (b, heads, n, n) attention logits
        b = relative_position_bias(self.table, self.index, self.window)
        return x.view(x.shape[0], 3, 16, 1) + b


class PosEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 5, 16))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.pos[:, 1:4] * self.scale.exp() + self.pos.size(1)


def _trace(model):
    return trace(copy.deepcopy(model))


def _body(gm) -> list[str]:
    return [line.strip() for line in gm.code.strip().splitlines()[1:] if line.strip()]


def test_a_relative_position_bias_becomes_one_buffer_bit_exact():
    torch.manual_seed(0)
    model = RelPosBias().eval()
    x = torch.rand(2, 3, 16)
    gm = _trace(model)
    assert fold_constants(gm, CTX).modified
    assert _body(gm) == [
        "qc_folded_relative_position_bias = self.qc_folded_relative_position_bias",
        "getattr_1 = x.shape",
        "getitem = getattr_1[0];  getattr_1 = None",
        "view = x.view(getitem, 3, 16, 1);  x = getitem = None",
        "add = view + qc_folded_relative_position_bias;  view = qc_folded_relative_position_bias = None",
        "return add",
    ]
    assert torch.equal(gm.qc_folded_relative_position_bias,
                       relative_position_bias(model.table, model.index, 4).detach())
    assert torch.equal(gm(x), model(x))
    verify_folded(gm, CTX)
    assert not fold_constants(gm, CTX).modified  # a fixed point


def test_a_positional_embedding_slice_and_a_size_read_fold():
    torch.manual_seed(0)
    model = PosEmbed().eval()
    gm = _trace(model)
    assert fold_constants(gm, CTX).modified
    assert _body(gm) == ["qc_folded_mul = self.qc_folded_mul",
                         "add = x + qc_folded_mul;  x = qc_folded_mul = None",
                         "add_1 = add + 5;  add = None",  # pos.size(1) as the number
                         "return add_1"]
    assert torch.equal(gm(X), model(X))


def test_a_subgraph_that_reads_an_input_is_not_folded():
    class ReadsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return (self.w * x).sum(-1) + x.mean()

    gm = _trace(ReadsInput().eval())
    code = gm.code
    assert not fold_constants(gm, CTX).modified
    assert gm.code == code


def test_qat_does_not_fold_trainable_parameters():
    """In training mode the table trains: its bias is computed on every call, not stored."""
    gm = _trace(RelPosBias().train())
    assert not fold_constants(gm, CTX).modified
    assert relative_position_bias in [n.target for n in gm.graph.nodes]
    torch.manual_seed(0)
    qat = prepare_qat_fx(RelPosBias().train(), {"": get_default_qat_qconfig()}, example_inputs=(X,))
    assert relative_position_bias in [n.target for n in qat.graph.nodes]
    assert not any(name.startswith("qc_folded_") for name, _ in qat.named_buffers())


def test_in_training_mode_a_frozen_parameter_and_a_plain_buffer_still_fold():
    model = RelPosBias().train()
    model.table.requires_grad_(False)
    gm = _trace(model)
    assert fold_constants(gm, CTX).modified
    assert hasattr(gm, "qc_folded_relative_position_bias")


def _reads_running_mean(training: bool) -> torch.fx.GraphModule:
    """``bn(x) + bn.running_mean.view(1, 3, 1) * 2.0`` with the buffer read as a get_attr (as torch.export
    captures it; fx's tracer bakes a buffer read into a constant)."""
    root = nn.Module()
    root.bn = nn.BatchNorm1d(3)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    mean = g.get_attr("bn.running_mean")
    scaled = g.call_function(torch.mul, (g.call_method("view", (mean, 1, 3, 1)), 2.0))
    g.output(g.call_function(torch.add, (g.call_module("bn", (x,)), scaled)))
    return torch.fx.GraphModule(root.train(training), g)


def test_running_statistics_in_training_are_not_constant():
    assert not fold_constants(_reads_running_mean(training=True), CTX).modified
    gm = _reads_running_mean(training=False)
    assert fold_constants(gm, CTX).modified
    assert torch.equal(gm(X), gm.bn(X) + gm.bn.running_mean.view(1, 3, 1) * 2.0)


def test_a_value_written_in_place_is_not_folded():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.count = nn.Parameter(torch.zeros(16))

        def forward(self, x):
            c = self.count * 1.0  # would fold, but for the write
            c.add_(x.sum())
            return x + c

    model = Counter().eval()
    gm = _trace(model)
    assert not fold_constants(gm, CTX).modified
    assert torch.equal(gm(X), model(X)) and torch.equal(gm(X), model(X))


def test_random_calls_are_not_folded():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x + torch.randn_like(self.w) + torch.rand(16)

    gm = _trace(Noisy().eval())
    assert not fold_constants(gm, CTX).modified


_calls = [0]


def drifting(w):
    """Deterministic-looking name, other values each call: the second run tells."""
    _calls[0] += 1
    return w * _calls[0]


torch.fx.wrap("drifting")


def test_a_function_that_gives_other_values_when_run_again_is_not_folded():
    class Drift(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x + drifting(self.w)

    gm = _trace(Drift().eval())
    assert not fold_constants(gm, CTX).modified


def test_an_expand_stays_and_reads_the_folded_value():
    """A large broadcast of a constant is not materialised: what it broadcasts is folded, the expand
    stays (above SMALL_BROADCAST elements)."""

    class Expands(nn.Module):
        def __init__(self):
            super().__init__()
            self.cls = nn.Parameter(torch.randn(1, 1, 16))

        def forward(self, x):
            return torch.cat([(self.cls * 2.0).expand(2, 4096, 16), x], dim=1)

    model = Expands().eval()
    gm = _trace(model)
    assert fold_constants(gm, CTX).modified
    assert _body(gm)[:2] == ["qc_folded_mul = self.qc_folded_mul",
                             "expand = qc_folded_mul.expand(2, 4096, 16);  qc_folded_mul = None"]
    assert gm.qc_folded_mul.shape == (1, 1, 16)
    assert torch.equal(gm(X), model(X))


def test_a_small_broadcast_is_folded_with_what_reads_it():
    """A mask or position table broadcast to the batch (GPT-2's position ids): small, so folded, and so
    is the constant arithmetic after it (it would otherwise be an island of constant glue)."""

    class SmallExpand(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("positions", torch.arange(16))

        def forward(self, x):
            ids = self.positions.unsqueeze(0).expand(2, 16)
            return x + (ids.diff(dim=-1, prepend=ids[:, :1]) != 1).float().unsqueeze(1)

    model = SmallExpand().eval()
    gm = capture(model, (X,), mode="export")  # (symbolic tracing computes it while tracing)
    assert any("expand" in str(n.target) for n in gm.graph.nodes)
    assert fold_constants(gm, CTX).modified
    assert not any("expand" in str(n.target) for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))


def test_the_verifier_names_a_constant_left_unfolded():
    gm = _trace(RelPosBias().eval())
    with pytest.raises(PassError, match=r"fold_constants: node 'relative_position_bias' depends only on parameters"):
        verify_folded(gm, CTX)


def test_the_partition_pipeline_folds_once_the_writes_are_out_of_place():
    """After out_of_place (a chain of writes is pure by then), before the passes that place ops; the
    folded buffers' get_attr nodes have their shapes (later passes require them)."""
    names = [p.name for p in PARTITION_PIPELINE]
    assert names.index("out_of_place") < names.index("fold_constants") < names.index("einsum")
    assert FOLD_CONSTANTS in PARTITION_PIPELINE
    gm = PassManager(PARTITION_PIPELINE).run(_trace(RelPosBias().eval()), CTX).gm
    assert relative_position_bias not in [n.target for n in gm.graph.nodes]
    folded = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("qc_folded_")]
    assert [n.meta[META_TENSOR].shape for n in folded] == [(1, 3, 16, 16)]


@pytest.mark.parametrize("training", [False, True])
def test_a_graph_captured_by_torch_export_folds_the_same(training):
    """torch.export lowers the gather + view + permute to catalogue spellings and the parameters to get_attr."""

    torch.manual_seed(0)
    model = RelPosBias().train(training)
    gm = capture(model, (X,), mode="export")
    assert any(n.op == "get_attr" and n.target == "table" for n in gm.graph.nodes)
    assert fold_constants(gm, CTX).modified  # in training too: the integer index buffer's view(-1)
    tables = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "table"]
    assert len(tables) == (1 if training else 0)
    if not training:
        assert torch.equal(gm(X), model(X))


class Nested(nn.Module):
    """The bias two modules down: the GraphModule reaches ``blocks.0.table`` through nn.Module() stand-ins
    (fx's _copy_attr), whose training flag is always True; the model's own modules decide."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([RelPosBias()])

    def forward(self, x):
        return self.blocks[0](x)


@pytest.mark.parametrize("capture_mode", ["fx", "export"])
def test_a_nested_module_folds_in_eval_mode_only(capture_mode):

    torch.manual_seed(0)
    model = Nested().eval()
    gm = capture(model, (X,), mode=capture_mode)
    assert any(n.op == "get_attr" and n.target == "blocks.0.table" for n in gm.graph.nodes)
    assert fold_constants(gm, CTX).modified
    assert not any(n.op == "get_attr" and n.target == "blocks.0.table" for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))
    gm = capture(Nested().train(), (X,), mode=capture_mode)
    fold_constants(gm, CTX)
    assert any(n.op == "get_attr" and n.target == "blocks.0.table" for n in gm.graph.nodes)


def test_an_aten_in_place_write_is_seen_through_its_schema():
    """torch.export keeps aten.add_ / copy_ / fill_; their schemas (``Tensor(a!)``) say what they write:
    ``w * 2`` written by ``add_(x)`` is no constant."""
    aten = torch.ops.aten
    root = nn.Module()
    root.w = nn.Parameter(torch.ones(16))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    doubled = g.call_function(aten.mul.Tensor, (g.get_attr("w"), 2.0))
    g.call_function(aten.add_.Tensor, (doubled, g.call_function(aten.sum.default, (x,))))
    g.output(g.call_function(aten.add.Tensor, (doubled, 1.0)))
    gm = torch.fx.GraphModule(root.eval(), g)
    expected = gm(X)
    assert not fold_constants(gm, CTX).modified
    assert torch.equal(gm(X), expected) and torch.equal(gm(X), expected)
