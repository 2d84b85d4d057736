"""nn.MultiheadAttention on a CPU island (backends/onnx/rules/attention.py): onnxruntime against eager
torch (both outputs, atol 1e-5), sequence-first and batch_first, separate q/k/v weights, a float mask,
per-head weights, need_weights=False; and the options the rule refuses, which run in an eager-torch
island with torch's values."""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
import torch.nn as nn
from onnx_modules import op_types

import qcompiler
from qcompiler.backends.eager import TORCH

ATOL = RTOL = 1e-5


class Attn(nn.Module):
    def __init__(self, call, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, **kw)
        self.call = call

    def forward(self, q, k, v):
        return self.call(self.attn, q, k, v)


def compiled(m: nn.Module, *inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no op runs on the BPU": the attention is forced to the CPU
        return qcompiler.compile(m.eval(), inputs, hybrid_dict={"module_name": ["attn"]}, progress=False)


def run_both(m: nn.Module, *inputs):
    cm = compiled(m, *inputs)
    with torch.no_grad():
        ref = m(*inputs)
    return cm, cm(*inputs), ref


def assert_outputs_close(got, ref):
    got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
        else:
            assert g.shape == r.shape and g.dtype == r.dtype
            torch.testing.assert_close(g, r, atol=ATOL, rtol=RTOL)


g = torch.Generator().manual_seed(0)
Q, K = torch.randn(3, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
MASK = torch.randn(3, 5, generator=g)

CASES = [
    ("sequence first", lambda a, q, k, v: a(q, k, v), {}, (Q, K, K)),
    ("batch_first", lambda a, q, k, v: a(q, k, v), {"batch_first": True}, (Q.transpose(0, 1), K.transpose(0, 1),
                                                                              K.transpose(0, 1))),
    ("self attention, no bias", lambda a, q, k, v: a(q, q, q), {"bias": False}, (Q, Q, Q)),
    ("kdim / vdim", lambda a, q, k, v: a(q, k, v), {"kdim": 4, "vdim": 6}, (Q, K[..., :4], K[..., :6])),
    ("float attn_mask", lambda a, q, k, v: a(q, k, v, attn_mask=MASK), {}, (Q, K, K)),
    ("per-head weights", lambda a, q, k, v: a(q, k, v, average_attn_weights=False), {}, (Q, K, K)),
    ("need_weights=False", lambda a, q, k, v: a(q, k, v, need_weights=False)[0], {}, (Q, K, K)),
]


@pytest.mark.parametrize("name, call, kw, inputs", CASES, ids=[c[0] for c in CASES])
def test_attention_runs_in_onnxruntime_like_torch(name, call, kw, inputs):
    cm, got, ref = run_both(Attn(call, **kw), *inputs)
    assert [s.kind for s in cm.runtime.steps] == ["cpu"], cm.summary()
    assert_outputs_close(got, ref)


def test_the_island_is_matmul_and_softmax(tmp_path):
    cm = compiled(Attn(lambda a, q, k, v: a(q, k, v)), Q, K, K)
    (path,) = [p for p in cm.dump(tmp_path) if p.suffix == ".onnx"]
    assert {"MatMul", "Softmax", "ReduceMean"} <= op_types(onnx.load(str(path)))


@pytest.mark.parametrize("name, call, kw, inputs", [
    ("key_padding_mask", lambda a, q, k, v: a(q, k, v, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), {},
     (Q, K, K)),
    ("bool attn_mask", lambda a, q, k, v: a(q, k, v, attn_mask=MASK > 0.5), {}, (Q, K, K)),
    ("add_zero_attn", lambda a, q, k, v: a(q, k, v), {"add_zero_attn": True}, (Q, K, K)),
    ("unbatched", lambda a, q, k, v: a(q, k, v), {}, (Q[:, 0], K[:, 0], K[:, 0])),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_the_rule_refuses_runs_in_an_eager_island(name, call, kw, inputs):
    cm, got, ref = run_both(Attn(call, **kw), *inputs)
    steps = cm.runtime.steps
    assert [s.kind for s in steps] == [TORCH]
    assert "MultiheadAttention with" in steps[0].reason
    assert_outputs_close(got, ref)
