"""Capture with torch.export (qcompiler.ir.export_capture): the same IR, placement, partitions and
converted outputs as symbolic tracing, bit for bit; module scopes; the capture modes; what export
cannot lower stays on the CPU with a reason naming the ATen op."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler import zoo
from qcompiler.errors import ConfigError, QCompilerWarning, TraceError
from qcompiler.frontend import partition
from qcompiler.ir.capture import GM_CAPTURE
from qcompiler.ir.export_capture import export_graph
from qcompiler.ir.meta import GM_INPUT_SPEC, GM_PARTITIONS, META_PLACEMENT, META_REASON, META_SCOPE

from graph_match import assert_same_graph


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        y = self.relu2(self.conv2(y)) + y
        return self.fc(y.mean((2, 3)))


class Attention(nn.Module):
    """Linear projections, matmul / softmax attention, layer norm, GELU MLP."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.d, self.t = heads, d, 5
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))

    def forward(self, x):
        b, t, d = 2, self.t, self.d
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(x)


def _seed(m):
    torch.manual_seed(0)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


def _compiled(model, x, capture):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        return qcompiler.compile(model, x, march="bayes", progress=False,
                                 prepare_custom_config_dict={"capture": capture})


CASES = {
    "conv": (lambda: _seed(ConvNet()), lambda: (torch.randn(2, 3, 8, 8),)),
    "attention": (lambda: _seed(Attention()), lambda: (torch.randn(2, 5, 16),)),  # batch 2: fixed in forward
    "transformer_block": (lambda: zoo.get("transformer_block"), lambda: zoo.example_inputs("transformer_block", 2)),
    "hybrid": (lambda: zoo.get("hybrid"), lambda: zoo.example_inputs("hybrid", 1)),  # stubs, a reused Identity
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_capture_is_bit_exact_with_fx(name):
    build, inputs = CASES[name]
    torch.manual_seed(1)
    x = inputs()
    model = build()
    fx_cm, ex_cm = _compiled(model, x, "fx"), _compiled(model, x, "export")
    assert fx_cm.converted.meta[GM_CAPTURE] == "fx" and ex_cm.converted.meta[GM_CAPTURE] == "export"
    # the same ops in the same places and partitions
    assert [(p.name, len(p.nodes)) for p in fx_cm.converted.meta[GM_PARTITIONS]] == \
        [(p.name, len(p.nodes)) for p in ex_cm.converted.meta[GM_PARTITIONS]]
    fx_place = [n.meta.get(META_PLACEMENT) for n in fx_cm.converted.graph.nodes if n.op != "get_attr"]
    ex_place = [n.meta.get(META_PLACEMENT) for n in ex_cm.converted.graph.nodes if n.op != "get_attr"]
    assert fx_place == ex_place
    assert "bpu" in fx_place
    got, want = ex_cm.converted(*x), fx_cm.converted(*x)
    assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "unet"])
def test_zoo_export_capture_is_bit_exact_with_fx(name):
    model, x = zoo.get(name), zoo.example_inputs(name, 1)
    fx_cm, ex_cm = _compiled(model, x, "fx"), _compiled(model, x, "export")
    assert [(p.name, len(p.nodes)) for p in fx_cm.converted.meta[GM_PARTITIONS]] == \
        [(p.name, len(p.nodes)) for p in ex_cm.converted.meta[GM_PARTITIONS]]
    assert torch.equal(ex_cm.converted(*x), fx_cm.converted(*x))


def test_exported_graph_is_the_traced_graph():
    """Structural golden: modules as call_module at their paths, ATen ops as torch spellings."""
    model = _seed(ConvNet())
    gm = export_graph(model, (torch.randn(1, 3, 8, 8),))

    class Expected(nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("conv", "bn", "relu", "conv2", "relu2", "fc"):
                setattr(self, name, getattr(model, name))

        def forward(self, x):
            y = self.relu(self.bn(self.conv(x)))
            y = torch.add(self.relu2(self.conv2(y)), y)
            return self.fc(torch.mean(y, [2, 3]))

    assert_same_graph(gm, Expected())
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(gm(x), model(x))


def test_a_functional_conv_on_a_modules_weight_with_other_stride_stays_a_function():
    """The call_module rule must not fire when the hyperparameters are not the module's."""

    class Strided(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x) + F.conv2d(x, self.conv.weight, self.conv.bias, stride=1)[:, :, :, :], \
                F.conv2d(x, self.conv.weight, None, 2)

    gm = export_graph(Strided().eval(), (torch.randn(1, 3, 9, 9),))
    calls = [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    assert ("call_module", "conv") in calls
    assert ("call_function", F.conv2d) in calls  # a second conv of the same weights is no module call


def test_leaf_modules_are_called_as_a_whole():
    """Stubs and user-named leaves are call_module under export, as after fx tracing; others are traced into."""
    from torch.ao.quantization import DeQuantStub, QuantStub

    class Stubbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.block = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU())
            self.head = nn.Sequential(nn.Conv2d(4, 4, 1), nn.Sigmoid())

        def forward(self, x):
            return self.dequant(self.head(self.block(self.quant(x))))

    model = Stubbed().eval()
    x = torch.randn(1, 3, 4, 4)
    gm = export_graph(model, (x,), leaf_module_names=["head"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["quant", "block.0", "block.1", "head",
                                                                           "dequant"]
    assert torch.equal(gm(x), model(x))
    assert not hasattr(model.head, "__dict__") or "forward" not in model.head.__dict__  # forwards restored


def test_scopes_follow_the_module_stack():
    model = _seed(Attention())
    gm = export_graph(model, (torch.randn(2, 5, 16),))
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    assert set(by_target) >= {"qkv", "proj", "norm", "mlp.0", "mlp.1", "mlp.2"}
    scope = by_target["mlp.1"].meta[META_SCOPE]
    assert [(e.path, e.module_type) for e in scope] == [("", Attention), ("mlp", nn.Sequential),
                                                         ("mlp.1", nn.GELU)]
    softmax = next(n for n in gm.graph.nodes if n.target in (F.softmax, torch.softmax))
    assert [e.path for e in softmax.meta[META_SCOPE]] == [""]


def test_hybrid_dict_by_module_name_with_export_capture():
    model = _seed(Attention())
    x = (torch.randn(2, 5, 16),)
    for capture in ("fx", "export"):
        gm = partition(model, x, march="bayes", hybrid_dict={"module_name": ["proj"]},
                       prepare_custom_config_dict={"capture": capture})
        placed = {n.target: n.meta.get(META_PLACEMENT) for n in gm.graph.nodes if n.op == "call_module"}
        assert placed["proj"] == "cpu" and placed["qkv"] == "bpu", capture


def test_keyword_inputs_set_the_input_spec():
    model = _seed(ConvNet())
    x = torch.randn(1, 3, 8, 8)
    for capture in ("fx", "export"):
        gm = partition(model, {"x": x}, march="bayes", prepare_custom_config_dict={"capture": capture})
        assert gm.meta[GM_INPUT_SPEC] == torch.utils._pytree.tree_flatten(((), {"x": x}))[1]
        assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]


def test_auto_uses_export_when_tracing_fails_and_says_why():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            if x.shape[0] > 0 and int(x.numel()) > 0:  # fx cannot take int() of a Proxy
                x = self.conv(x)
            return x

    with pytest.warns(QCompilerWarning, match="captured with torch.export, because symbolic tracing failed"):
        gm = partition(Branchy().eval(), torch.randn(1, 3, 4, 4), march="bayes")
    assert gm.meta[GM_CAPTURE] == "export"
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target == "conv"] == ["conv"]
    # capture="fx" does not try export: the conv runs as part of an eager leaf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        gm = partition(Branchy().eval(), torch.randn(1, 3, 4, 4), march="bayes",
                       prepare_custom_config_dict={"capture": "fx"})
    assert gm.meta[GM_CAPTURE] == "fx"
    assert "conv" not in {n.target for n in gm.graph.nodes if n.op == "call_module"}


def test_an_aten_op_with_no_row_runs_on_the_cpu_with_a_reason_naming_it():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return torch.special.i0(self.conv(x))  # no catalogue row spells aten.special_i0 / i0

    gm = partition(Odd().eval(), torch.randn(1, 3, 4, 4), march="bayes",
                   prepare_custom_config_dict={"capture": "export"})
    odd = next(n for n in gm.graph.nodes if n.op == "call_function" and "i0" in str(n.target))
    assert odd.meta[META_PLACEMENT] == "cpu"
    assert "i0" in odd.meta[META_REASON]
    conv = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "conv")
    assert conv.meta[META_PLACEMENT] == "bpu"


def test_bad_capture_value_is_a_config_error():
    with pytest.raises(ConfigError, match="prepare_custom_config_dict\\['capture'\\] must be one of 'fx', 'export', "
                                          "'auto', got 'dynamo'"):
        partition(ConvNet().eval(), torch.randn(1, 3, 8, 8), prepare_custom_config_dict={"capture": "dynamo"})


def test_export_failure_is_a_trace_error_naming_torch_export():
    class Bad(nn.Module):
        def forward(self, x):
            return x.numpy()

    with pytest.raises(TraceError, match="torch.export cannot capture the top-level module \\(Bad\\)"):
        partition(Bad(), torch.randn(2), prepare_custom_config_dict={"capture": "export"})


def test_fx_capture_is_unchanged_by_default_for_traceable_models():
    model = _seed(ConvNet())
    gm = partition(model, torch.randn(1, 3, 8, 8), march="bayes")
    assert gm.meta[GM_CAPTURE] == "fx"
    assert GM_INPUT_SPEC not in gm.meta


class Conv1D(nn.Module):
    """transformers' Conv1D: addmm(bias, x, weight) with the weight stored (in, out)."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.weight.shape[1],))


def test_addmm_of_a_modules_weight_becomes_a_linear_module_on_the_bpu():
    model = nn.Sequential(Conv1D(8, 16), nn.ReLU(), Conv1D(16, 4)).eval()
    x = torch.randn(2, 3, 8)
    gm = partition(model, x, march="bayes", prepare_custom_config_dict={"capture": "export"})
    linears = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("qc_linear")]
    assert [n.target for n in linears] == ["0.qc_linear", "2.qc_linear"]
    assert all(n.meta[META_PLACEMENT] == "bpu" for n in linears)
    assert [e.path for e in linears[0].meta[META_SCOPE]] == ["", "0", "0.qc_linear"]
    assert torch.equal(gm.get_submodule("0.qc_linear").weight, model[0].weight.t())
    assert torch.equal(gm.get_submodule("0.qc_linear").bias, model[0].bias)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=1e-6)  # addmm and linear round alike to 1 ulp


def test_addmm_of_an_input_stays_addmm():
    class Free(nn.Module):
        def forward(self, b, x, w):
            return torch.addmm(b, x, w)

    gm = export_graph(Free(), (torch.randn(4), torch.randn(3, 2), torch.randn(2, 4)))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.addmm]
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]


def test_integer_tensors_stay_on_the_cpu():
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.fc = nn.Linear(8, 8)

        def forward(self, ids):
            return self.fc(self.emb(ids.view(2, -1)))

    gm = partition(Tokens().eval(), {"ids": torch.randint(0, 10, (2, 3))}, march="bayes")
    view = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view")
    assert view.meta[META_PLACEMENT] == "cpu" and "integer tensor (i64[2,3])" in view.meta[META_REASON]
    fc = next(n for n in gm.graph.nodes if n.target == "fc")
    assert fc.meta[META_PLACEMENT] == "bpu"  # the float value after the embedding goes back to the BPU


def _hf_cases():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return {
        "bert": (transformers.BertModel(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)),
            {"input_ids": torch.randint(0, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}),
        "gpt2": (transformers.GPT2Model(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16, use_cache=False,
            bos_token_id=0, eos_token_id=0)), {"input_ids": torch.randint(0, 100, (2, 8))}),
        "vit": (transformers.ViTModel(transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
            patch_size=4)), {"pixel_values": torch.randn(2, 3, 16, 16)}),
    }


def _macs_on_bpu(gm, args):
    from torch.utils.flop_counter import FlopCounterMode

    totals = {"bpu": 0, "cpu": 0}

    class Counter(torch.fx.Interpreter):
        def run_node(self, n):
            with FlopCounterMode(display=False) as counter:
                out = super().run_node(n)
            totals["bpu" if n.meta.get(META_PLACEMENT) == "bpu" else "cpu"] += counter.get_total_flops() // 2
            return out

    with torch.no_grad():
        Counter(gm).run(*args)
    return totals["bpu"] / max(1, totals["bpu"] + totals["cpu"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
def test_hugging_face_models_compile_with_their_macs_on_the_bpu(name):
    model, inputs = _hf_cases()[name]
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = qcompiler.compile(model, inputs, march="bayes", progress=False)
    assert cm.converted.meta[GM_CAPTURE] == "export"
    gm = cm.converted
    for p in gm.parameters():
        p.requires_grad_(False)
    from qcompiler.ir.shape_prop import normalize_inputs
    assert _macs_on_bpu(gm, tuple(normalize_inputs(inputs))) >= 0.8
    ref = model(**inputs)[0]
    out = torch.utils._pytree.tree_flatten(cm.converted(*normalize_inputs(inputs)))[0][0]
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())
    assert sqnr > 25, float(sqnr)


def test_a_nested_positional_input_is_one_placeholder_indexed_like_fx():
    """lstm_seq's forward(tokens, (h0, c0)): export keeps (h0, c0) one input, as the fx tracer does."""
    model, x = zoo.get("lstm_seq"), zoo.example_inputs("lstm_seq", 2)
    gm = export_graph(model, x)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.target for n in placeholders] == ["input", "hidden"]
    assert sorted(u.args[1] for u in placeholders[1].users) == [0, 1]
    assert GM_INPUT_SPEC not in gm.meta
    fx_cm, ex_cm = _compiled(model, x, "fx"), _compiled(model, x, "export")
    got = torch.utils._pytree.tree_flatten(ex_cm.converted(*x))[0]
    want = torch.utils._pytree.tree_flatten(fx_cm.converted(*x))[0]
    assert len(got) == len(want) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_casts_and_bool_ands_take_torch_spellings():
    class Mask(nn.Module):
        def forward(self, x, m, k):
            keep = (m > 0) & (x > 0)  # bools: logical_and
            bits = k & 6  # ints: a bitwise and, no canonical op
            return x * keep.to(torch.float32), bits

    x, m, k = torch.randn(2, 4), torch.randn(2, 4), torch.arange(8).reshape(2, 4)
    gm = export_graph(Mask(), (x, m, k))
    calls = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert torch.logical_and in calls and "to" in calls
    assert torch.ops.aten.__and__.Scalar in calls or torch.ops.aten.bitwise_and.Scalar in calls
    got, want = gm(x, m, k), Mask()(x, m, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
