"""The RNN family (LSTM, GRU, RNN and their cells) and EmbeddingBag on CPU islands.

Each variant is traced and partitioned (``qcompiler.partition``: the ops are no BPU ops, so
they are placed on the CPU), emitted at opset 11, checked with ``onnx.checker`` (full
check), run in onnxruntime and compared with torch within atol = rtol = 1e-5 (float32:
onnxruntime's recurrent kernels and reductions sum in another order than torch's; today every
case also passes at atol 1e-6, the margin is for other CPUs' vector paths).
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.backends.onnx.emitter import emit_graph, emit_subgraph
from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.partitions import partitions
from qcompiler.onnx import export_to_onnx, inference_session
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.prepare import prepare_calibration_fx

ATOL, RTOL = 1e-5, 1e-5


def flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in flat(v)]


def check(module: nn.Module, *inputs, march: str = "bayes") -> onnx.ModelProto:
    """Emit ``module`` and compare onnxruntime with torch; returns the model."""
    module = module.eval()
    gm = qcompiler.partition(module, inputs, march=march)
    model = emit_graph(gm)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), flat(inputs))})
    with torch.no_grad():
        ref = flat(module(*inputs))
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        assert o.shape == tuple(r.shape)
        np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=RTOL)
    return model


def count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(n.op_type == op_type for n in model.graph.node)


class Rec(nn.Module):
    """Calls a recurrent module (a leaf of the traced graph) without an initial state."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)


class RecState(Rec):
    """... and with one (a tensor, or LSTM's (h, c) tuple)."""

    def forward(self, x, hx):
        return self.m(x, hx)


def rec(m: nn.Module, hx: tuple) -> Rec:
    return RecState(m) if hx else Rec(m)


# ---------------------------------------------------------------------------
# sequence modules

SEQ = {
    "lstm": (nn.LSTM, {}),
    "gru": (nn.GRU, {}),
    "rnn_tanh": (nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
}
SEQ_CONFIGS = {
    "1layer": {},
    "batch_first": {"batch_first": True},
    "2layer_bidir": {"num_layers": 2, "bidirectional": True},
    "3layer_batch_first_nobias": {"num_layers": 3, "batch_first": True, "bias": False},
    "bidir_batch_first": {"bidirectional": True, "batch_first": True},
}
IN, HID, SEQ_LEN, BATCH = 5, 4, 6, 3


def _state(kind: str, layers: int, *batch: int):
    h = torch.randn(layers, *batch, HID)
    return ((h, torch.randn(layers, *batch, HID)),) if kind == "lstm" else (h,)


@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("config", SEQ_CONFIGS)
@pytest.mark.parametrize("kind", SEQ)
def test_sequence_modules(kind, config, with_state):
    cls, base = SEQ[kind]
    kw = {**base, **SEQ_CONFIGS[config]}
    torch.manual_seed(0)
    m = cls(IN, HID, **kw)
    x = torch.randn(BATCH, SEQ_LEN, IN) if kw.get("batch_first") else torch.randn(SEQ_LEN, BATCH, IN)
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    hx = _state(kind, layers, BATCH) if with_state else ()
    model = check(rec(m, hx), x, *hx)
    op = {"lstm": "LSTM", "gru": "GRU"}.get(kind, "RNN")
    assert count(model, op) == kw.get("num_layers", 1)  # one ONNX node per layer, both directions in it
    node = next(n for n in model.graph.node if n.op_type == op)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if kind == "gru":
        assert attrs["linear_before_reset"] == 1  # torch applies the reset gate after the recurrent matmul
    if kind.startswith("rnn"):
        act = kw["nonlinearity"].capitalize().encode()
        assert attrs["activations"] == [act] * (2 if kw.get("bidirectional") else 1)


@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("kind", SEQ)
def test_sequence_modules_unbatched(kind, with_state):
    """A 2-D input ``[seq, input]`` (batch_first does not apply); states ``[layers * dirs, hidden]``."""
    cls, base = SEQ[kind]
    torch.manual_seed(1)
    m = cls(IN, HID, num_layers=2, bidirectional=True, batch_first=True, **base)
    hx = _state(kind, 4) if with_state else ()
    check(rec(m, hx), torch.randn(SEQ_LEN, IN), *hx)


def test_gru_gate_order_matters():
    """torch's GRU gates are (r, z, n), ONNX's (z, r, h): distinct gate weights would be far off if swapped."""
    torch.manual_seed(2)
    m = nn.GRU(IN, HID)
    with torch.no_grad():
        m.weight_ih_l0[:HID] += 3.0  # only the reset gate's input weights move
    check(Rec(m), torch.randn(SEQ_LEN, BATCH, IN))


# ---------------------------------------------------------------------------
# cells

CELLS = {
    "lstm_cell": (nn.LSTMCell, {}),
    "gru_cell": (nn.GRUCell, {}),
    "rnn_cell_tanh": (nn.RNNCell, {"nonlinearity": "tanh"}),
    "rnn_cell_relu": (nn.RNNCell, {"nonlinearity": "relu"}),
}


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("kind", CELLS)
def test_cells(kind, with_state, bias, batched):
    cls, base = CELLS[kind]
    torch.manual_seed(3)
    m = cls(IN, HID, bias=bias, **base)
    batch = (BATCH,) if batched else ()
    x = torch.randn(*batch, IN)
    hx = ()
    if with_state:
        h = torch.randn(*batch, HID)
        hx = ((h, torch.randn(*batch, HID)),) if kind == "lstm_cell" else (h,)
    model = check(rec(m, hx), x, *hx)
    assert count(model, {"lstm_cell": "LSTM", "gru_cell": "GRU"}.get(kind, "RNN")) == 1


class CellLoop(nn.Module):
    """A GRUCell unrolled over time, its state carried between steps (the usual cell use)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(IN, HID)
        self.fc = nn.Linear(HID, 2)

    def forward(self, x):
        h = None
        for t in range(4):  # a fixed number of steps: FX unrolls the loop
            h = self.cell(x[t], h)
        return self.fc(h)


def test_cell_unrolled_over_time():
    torch.manual_seed(4)
    model = check(CellLoop(), torch.randn(4, BATCH, IN))
    assert count(model, "GRU") == 4


# ---------------------------------------------------------------------------
# EmbeddingBag

ROWS, DIM = 10, 3


class Bag(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, **kw)

    def forward(self, idx, offsets):
        return self.bag(idx, offsets)


class Bag2d(Bag):
    def forward(self, idx):
        return self.bag(idx)


IDX1 = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
OFFSETS = torch.tensor([0, 3, 3, 6])  # bag 1 is empty, the last bag runs to the end
# include_last_offset: the last offset is the number of indices (CSR; torch's own bags disagree
# between modes when it is smaller: sum ignores the tail, max takes it, mean divides by it)
OFFSETS_LAST = torch.tensor([0, 3, 3, 6, 8])
IDX2 = torch.tensor([[1, 2, 4], [4, 3, 2], [0, 0, 0]])  # the last bag is all padding with padding_idx=0
IDX_PAD = torch.tensor([0, 2, 5, 0, 0, 0, 9, 1])  # with OFFSETS and padding_idx=0: bag 2 holds only padding


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("case", ["offsets", "include_last_offset", "2d", "padding_offsets", "padding_2d"])
def test_embedding_bag_module(mode, case):
    kw = {"include_last_offset": True} if case == "include_last_offset" else {}
    if case.startswith("padding"):
        kw["padding_idx"] = 0
    torch.manual_seed(5)
    m = (Bag2d if case.endswith("2d") else Bag)(mode=mode, **kw)
    inputs = {"offsets": (IDX1, OFFSETS), "include_last_offset": (IDX1, OFFSETS_LAST), "2d": (IDX2,),
              "padding_offsets": (IDX_PAD, OFFSETS), "padding_2d": (IDX2,)}[case]
    with torch.no_grad():
        ref = m(*inputs)
    if case in ("offsets", "padding_offsets"):
        assert torch.equal(ref[1], torch.zeros(DIM))  # the empty bag is zeros in every mode
    if case == "padding_offsets":
        assert torch.equal(ref[2], torch.zeros(DIM))  # so is a bag of padding only
    check(m, *inputs)


class WeightedBag(Bag):
    def __init__(self):
        super().__init__(mode="sum")

    def forward(self, idx, offsets, weights):
        return self.bag(idx, offsets, weights)


class WeightedBag2d(WeightedBag):
    def forward(self, idx, weights):
        return self.bag(idx, per_sample_weights=weights)


@pytest.mark.parametrize("case", ["offsets", "2d"])
def test_embedding_bag_per_sample_weights(case):
    torch.manual_seed(6)
    if case == "offsets":
        check(WeightedBag(), IDX1, OFFSETS, torch.rand(8))
    else:
        check(WeightedBag2d(), IDX2, torch.rand(3, 3))


class FnBag(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(ROWS, DIM))
        self.kw = kw

    def forward(self, idx, offsets, psw):
        return F.embedding_bag(idx, self.weight, offsets, per_sample_weights=psw, **self.kw)


@pytest.mark.parametrize("kw", [{"mode": "sum"}, {"mode": "sum", "include_last_offset": True, "padding_idx": -1}],
                         ids=["sum", "last_offset_negative_padding"])
def test_functional_embedding_bag(kw):
    torch.manual_seed(7)
    offsets = OFFSETS_LAST if kw.get("include_last_offset") else OFFSETS
    check(FnBag(**kw), IDX1, offsets, torch.rand(8))


def test_functional_embedding_bag_positional_mean_int32():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(ROWS, DIM))

        def forward(self, idx, offsets):
            return F.embedding_bag(idx, self.weight, offsets)  # mode defaults to "mean"

    torch.manual_seed(8)
    check(M(), IDX1.int(), OFFSETS.int())


class GruAndBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(IN, HID, num_layers=2, bidirectional=True, batch_first=True)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=0)

    def forward(self, x, idx, offsets):
        return self.gru(x), self.bag(idx, offsets)


def test_islands_with_dynamic_sizes_run_other_batches_tokens_and_bags():
    """The emitted ops read sizes from their inputs: an island declared with free boundary dims
    runs another batch (GRU) and other numbers of tokens and bags (EmbeddingBag, empty bags too)."""
    torch.manual_seed(10)
    m = GruAndBag().eval()
    gm = qcompiler.partition(m, (torch.randn(BATCH, SEQ_LEN, IN), IDX1, OFFSETS), march="bayes")
    x, idx, offsets = torch.randn(5, SEQ_LEN + 2, IN), torch.tensor([0, 3, 3, 7, 1, 2, 0, 9, 0, 4, 4]), \
        torch.tensor([0, 0, 2, 5, 5, 9])
    feeds = {"x": x.numpy(), "idx": idx.numpy(), "offsets": offsets.numpy()}
    with torch.no_grad():
        out, h_n = m.gru(x)
        ref = {"gru.0": out, "gru.1": h_n, "bag": m.bag(idx, offsets)}
    assert ref["bag"].shape == (6, DIM)
    got = {}
    for p in partitions(gm):  # two independent CPU islands
        model = emit_subgraph(gm, p.nodes, p.inputs, p.outputs, dynamic_batch=True)
        onnx.checker.check_model(model, full_check=True)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        got.update(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        assert got[name].shape == tuple(r.shape)
        np.testing.assert_allclose(got[name], r.numpy(), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------
# placement and errors


def test_recurrent_and_bag_ops_are_placed_on_the_cpu_with_a_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.cell, self.bag = nn.GRU(IN, HID), nn.LSTMCell(IN, HID), nn.EmbeddingBag(ROWS, DIM)

        def forward(self, x, idx, offsets):
            return self.gru(x)[0], self.cell(x[0])[0], self.bag(idx, offsets)

    gm = qcompiler.partition(M(), (torch.randn(SEQ_LEN, BATCH, IN), IDX1, OFFSETS), march="bernoulli2")
    got = {n.name: (n.meta["qc_op"], n.meta["qc_placement"], n.meta["qc_reason"]) for n in gm.graph.nodes
           if n.op == "call_module"}
    assert got == {"gru": ("gru", "cpu", "gru is not supported on bernoulli2"),
                   "cell": ("lstm_cell", "cpu", "lstm_cell is not supported on bernoulli2"),
                   "bag": ("embedding_bag", "cpu", "embedding_bag is not supported on bernoulli2")}


class ProjLstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(IN, HID, proj_size=2)

    def forward(self, x):
        return self.lstm(x)[0]


class MaxNormBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, max_norm=1.0)

    def forward(self, idx, offsets):
        return self.bag(idx, offsets)


class NotAGru(nn.Module):
    """A leaf module that calls itself a GRU (``qc_op``) without being one."""

    qc_op, qc_leaf = "gru", True

    def forward(self, x):
        return x * 2


class CallsNotAGru(nn.Module):
    def __init__(self):
        super().__init__()
        self.rec = NotAGru()

    def forward(self, x):
        return self.rec(x)


@pytest.mark.parametrize("module,inputs,match", [
    (ProjLstm(), (torch.randn(SEQ_LEN, BATCH, IN),),
     r"cannot emit node 'lstm' \(LSTM, op 'lstm'\).*proj_size=2 .*use proj_size=0 and an nn.Linear"),
    (MaxNormBag(), (IDX1, OFFSETS), r"cannot emit node 'bag' \(EmbeddingBag, op 'embedding_bag'\).*max_norm"),
    (CallsNotAGru(), (torch.randn(SEQ_LEN, BATCH, IN),),
     r"cannot emit node 'rec' \(NotAGru, op 'gru'\).*only nn.GRU modules"),
], ids=["lstm_proj_size", "bag_max_norm", "not_a_gru"])
def test_unsupported_variants_name_the_node_and_why(module, inputs, match):
    gm = qcompiler.partition(module.eval(), inputs, march="bayes")
    with pytest.raises(UnsupportedOpError, match=match):
        emit_graph(gm)


# ---------------------------------------------------------------------------
# end to end: a conv on the BPU feeding a GRU on the CPU, and an EmbeddingBag island


class ConvGruBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.gru = nn.GRU(8, HID, num_layers=2, batch_first=True, bidirectional=True)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="max")

    def forward(self, img, idx, offsets):
        f = self.relu(self.conv(img))  # [N, 8, 4, 4]
        seq = f.flatten(2).transpose(1, 2)  # [N, 16, 8]
        out, h = self.gru(seq)
        return out, h, self.bag(idx, offsets)


MARCHES = ["bayes", "bernoulli2"]


def _conv_gru_bag():
    torch.manual_seed(9)
    calib = [(torch.rand(2, 3, 4, 4), IDX1, OFFSETS) for _ in range(2)]
    return ConvGruBag().eval(), (torch.rand(2, 3, 4, 4), IDX1, OFFSETS), calib


@pytest.mark.parametrize("march", MARCHES)
def test_compile_conv_on_bpu_gru_and_bag_on_cpu(march, tmp_path):
    model, x, calib = _conv_gru_bag()
    cm = qcompiler.compile(model, x, march=march, calib_data=calib, progress=False)
    placement = {p["name"]: p["placement"] for p in cm.partitions}
    assert "bpu" in placement.values() and "cpu" in placement.values()
    out, ref = cm(*x), cm.converted(*x)
    assert len(flat(out)) == len(flat(ref)) == 3
    for a, b in zip(flat(out), flat(ref)):
        # the CPU islands are float (onnxruntime vs torch); their BPU input is the same fixed-point tensor
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    with torch.no_grad():  # and the GRU really saw the quantized conv: close to, but not, the float model
        float_out = model(*x)[0]
    assert 0 < (out[0] - float_out).abs().max() < 0.1
    loaded = qcompiler.load(cm.save(tmp_path / "m.qc"))  # the islands survive save / load unchanged
    assert all(torch.equal(a, b) for a, b in zip(flat(loaded(*x)), flat(out)))


def _staged_export(model, x, calib, march):
    """The staged API: calibrate ``model`` on ``calib``, then (the calibrated model exported to ONNX,
    as bytes; the converted model's outputs on ``x``, flattened)."""
    cal = prepare_calibration_fx(model, None, example_inputs=x, hybrid=True, march=march).eval()
    with torch.no_grad():
        for batch in calib:
            cal(*batch)
        ref = flat(convert_fx(cal)(*x))
    f = io.BytesIO()
    export_to_onnx(cal, x, f)
    return f.getvalue(), ref


@pytest.mark.parametrize("march", MARCHES)
def test_staged_api_exports_the_cpu_gru_and_bag(march):
    """prepare -> calibrate -> convert, and export_to_onnx of the calibrated model: the exported
    graph (Q/DQ around the conv, float GRU and bag) gives the converted model's outputs."""
    model, x, calib = _conv_gru_bag()
    exported, ref = _staged_export(model, x, calib, march)
    model_proto = onnx.load_from_string(exported)
    assert {"GRU", "DequantizeLinear", "Gather", "ReduceMax"} <= {n.op_type for n in model_proto.graph.node}
    sess = inference_session(model_proto)
    outs = sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), flat(x))})
    assert len(outs) == len(ref) == 3
    for o, r in zip(outs, ref):
        np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=RTOL)


class ConvThen(nn.Module):
    """A conv (BPU) whose features feed one recurrent module of ``kind`` (CPU)."""

    def __init__(self, kind: str):
        super().__init__()
        cls, base = {**SEQ, **CELLS}[kind]
        self.cell = kind in CELLS
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.rec = cls(4 * 2 * 2 if self.cell else 4, HID, **base)

    def forward(self, img):
        f = self.conv(img)  # [N, 4, 2, 2]
        return self.rec(f.flatten(1) if self.cell else f.flatten(2).transpose(1, 2).transpose(0, 1))


FAMILY = ["lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_cell_tanh", "rnn_cell_relu"]


@pytest.mark.parametrize("kind", FAMILY)
def test_every_kind_compiles_and_exports_after_a_bpu_conv(kind):
    """compile (runtime vs converted model) and the staged API (export vs converted model), per kind."""
    torch.manual_seed(11)
    model, x = ConvThen(kind).eval(), (torch.rand(2, 3, 2, 2),)
    calib = [(torch.rand(2, 3, 2, 2),) for _ in range(2)]
    cm = qcompiler.compile(model, x, march="bayes", calib_data=calib, progress=False)
    for a, b in zip(flat(cm(*x)), flat(cm.converted(*x))):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    exported, ref = _staged_export(model, x, calib, "bernoulli2")
    sess = inference_session(exported)
    outs = sess.run(None, {sess.get_inputs()[0].name: x[0].numpy()})
    # (out, h_n), LSTM's (out, (h_n, c_n)), a cell's h' or LSTMCell's (h', c'): flattened
    assert len(outs) == len(ref) == {"lstm": 3, "lstm_cell": 2}.get(kind, 1 if kind in CELLS else 2)
    for o, r in zip(outs, ref):
        np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=RTOL)
