"""Capture "auto": when symbolic tracing fails, which models go to torch.export and which to the fx
fallback (qcompiler.ir.capture._fallback_first), and what export refuses rather than drop."""

import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import QCompilerWarning, TraceError
from qcompiler.ir.capture import GM_CAPTURE
from test_state_writes import PadCopy  # noqa: E402

X = torch.randn(2, 3, 8, 8)
SEQ = torch.randn(5, 2, 6)


def _partition(model, inputs, capture="auto"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = qcompiler.partition(model.eval(), inputs, march="bayes",
                                 prepare_custom_config_dict={"capture": capture})
    return gm, [str(w.message) for w in caught if issubclass(w.category, QCompilerWarning)]


class BufferEma(nn.Module):
    """A running mean written in place: state carried from call to call."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("mean", torch.zeros(1, 3, 1, 1))

    def forward(self, x):
        y = self.conv(x)
        self.mean.mul_(0.5).add_(y.mean((0, 2, 3), keepdim=True) * 0.5)
        return y - self.mean


@pytest.mark.parametrize("layer, inputs", [(nn.GRU(6, 8), (SEQ,)), (nn.LSTMCell(6, 8), (SEQ[0],)),
                                           (nn.MultiheadAttention(8, 2), (torch.randn(3, 2, 8),) * 3)],
                         ids=["gru", "lstm cell", "attention"])
def test_a_torch_layer_as_the_whole_model_is_one_call_not_exported(layer, inputs):
    gm, told = _partition(layer, inputs)
    assert gm.meta[GM_CAPTURE] == "fx"
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), type(layer)) for n in calls)
    assert not any("torch.export" in m for m in told)  # neither chosen nor blamed


def test_a_state_write_goes_to_the_fallback_which_keeps_the_state():
    model = BufferEma()
    gm, told = _partition(model, (X,))
    assert gm.meta[GM_CAPTURE] == "fx"
    assert any("buffer 'mean'" in m for m in told) and not any("captured with torch.export" in m for m in told)


def test_export_refuses_a_forward_that_writes_its_buffer():
    with pytest.raises(TraceError, match=r"torch.export cannot capture BufferEma: its forward writes 'mean' in place"):
        _partition(BufferEma(), (X,), capture="export")


def test_a_write_into_a_local_tensor_is_exported_and_computes_the_float_values():
    model = PadCopy().eval()  # a write into a tensor the forward made itself: no state
    gm, told = _partition(model, (X,))
    assert gm.meta[GM_CAPTURE] == "export"
    assert any("captured with torch.export" in m for m in told)
    assert torch.equal(gm(X), model(X))  # float, placed: the write is kept (passes/leaf_writes.py)


class Residual(nn.Module):
    """``hidden += residual``, as transformers' ResNet writes it: export keeps ``aten.add_``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        h += x
        return h.relu()


class AliasedWrite(nn.Module):
    """An in-place write whose alias is read after it: the write must stay in place."""

    def forward(self, x):
        y = x * 2
        v = y.view(-1)
        y.mul_(3)
        return v + 1


def test_an_exported_in_place_add_becomes_the_bpu_add():
    model = Residual().eval()
    gm, _ = _partition(model, (X,), capture="export")
    # aten.add_ -> x.add_ -> out of place -> fused into the conv (conv + add + relu), all on the BPU
    assert [n.op for n in gm.graph.nodes if n.meta.get("qc_placement") == "cpu"] == []
    assert not any(n.op == "call_function" and "aten" in str(n.target) for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))


def test_an_exported_in_place_write_read_through_an_alias_reaches_the_alias():
    model = AliasedWrite().eval()
    gm, _ = _partition(model, (X,), capture="export")
    # the view is made again after the write (passes/view_writes.py), so the alias reads the written value
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["mul", "view"]
    assert not any(n.op == "call_function" and "aten" in str(n.target) for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))


class ExpandAs(nn.Module):
    """DPT's readout: a token broadcast to the others' shape with expand_as."""

    def forward(self, x):
        tokens = x.flatten(2).transpose(1, 2)  # (N, HW, C)
        cls = tokens[:, :1]
        return tokens + cls.expand_as(tokens)


def test_an_exported_expand_as_is_the_method_and_exports(tmp_path):
    model = ExpandAs().eval()
    gm, _ = _partition(model, (X,), capture="export")
    assert [n.target for n in gm.graph.nodes if n.op == "call_method" and "expand" in n.target] == ["expand_as"]
    assert not any(n.op == "call_function" and "expand" in str(n.target) for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = qcompiler.compile(model, (X,), march="bayes", progress=False,
                               prepare_custom_config_dict={"capture": "export"})
    cm.export_onnx(tmp_path / "m.onnx")  # no eager island: an ONNX Expand of the shape
