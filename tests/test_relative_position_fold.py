"""BEiT's and T5's relative-position index / bias, built from constants only (``torch.zeros`` + writes
into slices, ``arange``), is folded into a constant buffer: the attention's bias add reaches the BPU
and no CPU island computes the index (issue 33)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.ir.capture import capture
from qcompiler.march import March
from qcompiler.passes.base import CompileContext, PassManager
from qcompiler.passes.pipeline import PARTITION_PIPELINE

INDEX_WORDS = ("zeros", "arange", "setitem", "relative", "index")


class SliceWrittenIndex(nn.Module):
    """BEiT's pattern in small: a zero tensor whose slices are written, then added to the scores."""

    def __init__(self, from_input: bool = False):
        super().__init__()
        self.from_input = from_input

    def forward(self, x):
        index = torch.zeros(4, 4)
        index[0, :] = x[0, 0] if self.from_input else 3.0
        index[1:, 0] = 2.0
        return x + index


@pytest.mark.parametrize("from_input", [False, True])
def test_a_slice_written_zeros_is_folded_only_when_it_reads_no_input(from_input):
    x = torch.randn(4, 4)
    gm = capture(SliceWrittenIndex(from_input).eval(), (x,), mode="export")  # fx would run the writes itself
    gm = PassManager(PARTITION_PIPELINE).run(gm, CompileContext(march=March.NASH, example_inputs=(x,))).gm
    left = [n.name for n in gm.graph.nodes if n.op.startswith("call_") and n.name.startswith(("zeros", "setitem"))
            and n.op != "call_module"]
    folded = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("qc_folded_")]
    if from_input:  # negative: a write reads x, so the writes run on every call (only their operands fold)
        assert [n for n in left if n.startswith("setitem")] == ["setitem_", "setitem__1", "setitem__2"], left
    else:
        assert left == [] and len(folded) == 1, (folded, left)
        assert torch.equal(getattr(gm, folded[0]), SliceWrittenIndex()(torch.zeros(4, 4)))
    assert torch.equal(gm(x), SliceWrittenIndex(from_input)(x))


def _beit():
    transformers = pytest.importorskip("transformers")
    model = transformers.BeitModel(transformers.BeitConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, use_relative_position_bias=True))
    return model, {"pixel_values": torch.randn(2, 3, 32, 32)}


def _t5():
    transformers = pytest.importorskip("transformers")
    model = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    return model, {"input_ids": torch.randint(0, 100, (2, 16))}


@pytest.mark.parametrize("march", ["nash", "bayes"])
@pytest.mark.parametrize("name", ["beit", "t5"])
def test_the_relative_position_bias_is_a_constant_of_a_bpu_add(name, march):
    torch.manual_seed(0)
    model, inputs = {"beit": _beit, "t5": _t5}[name]()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = qcompiler.compile(model, inputs, march=march, progress=False)
    assert cm.torch_islands() == {}  # the index chain was an eager-torch island (no ONNX zeros / arange)
    cpu = [n for s in cm.runtime.steps if s.kind != "bpu" for n in s.nodes]
    assert not [n for n in cpu if any(w in n for w in INDEX_WORDS)], cpu
    graph = [n.name for n in cm.converted.graph.nodes if n.op.startswith("call_")]
    assert not [n for n in graph if any(w in n for w in INDEX_WORDS)], graph
    heads, tokens = 2, {"beit": 17, "t5": 16}[name]
    biases = [m for m in cm.converted.modules() if isinstance(getattr(m, "constant", None), torch.Tensor)
              and tuple(m.constant.shape[-3:]) == (heads, tokens, tokens)]
    assert len(biases) >= 1  # the bias add takes the folded bias as its constant operand
    ref = model(**inputs).last_hidden_state
    out = cm(**inputs)
    out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())
    assert sqnr > 25, float(sqnr)  # the tolerance of the other Hugging Face end-to-end tests
