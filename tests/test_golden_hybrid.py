"""Golden test: the heterogeneous-QAT guide's HybridModel, march bayes, the guide's hybrid_dict."""

import torch
from conftest import assert_untouched, snapshot

import qcompiler
from qcompiler.ir.partitions import partitions, summary_line
from qcompiler.ir.printing import forward_sequence

# The prepared forward of the guide, node for node (observers of BPU ops are
# not graph nodes in our design; boundary observers are).
GOLDEN = (
    "quant, conv0, identity, prelu_input_dequant_0, prelu, selu, conv1_conv, conv1_prelu, "
    "selu_1, selu_1_activation_post_process, conv2, conv3_input_dequant_0, conv3, "
    "conv3_activation_post_process, identity_1, conv4, selu_2_input_dequant_0, selu_2, dequant"
)


def test_guide_forward_sequence(hybrid_model, guide_hybrid_dict):
    gm = qcompiler.partition(
        hybrid_model, torch.rand(1, 3, 224, 224), march=qcompiler.March.BAYES, hybrid_dict=guide_hybrid_dict
    )
    assert ", ".join(forward_sequence(gm)) == GOLDEN


def test_guide_modules_and_partitions(hybrid_model, guide_hybrid_dict):
    gm = qcompiler.partition(hybrid_model, torch.rand(1, 3, 32, 32), march="bayes", hybrid_dict=guide_hybrid_dict)
    modules = dict(gm.named_modules())
    for name in ("prelu_input_dequant", "conv3_input_dequant", "selu_2_input_dequant"):
        assert type(modules[name]).__name__ == "DeQuantStub"
    for name in ("selu_1_activation_post_process", "conv3_activation_post_process"):
        assert name in modules
    got = [(p.name, p.nodes) for p in partitions(gm)]
    assert got == [
        ("bpu0", ["quant", "conv0", "identity", "prelu_input_dequant_0"]),
        ("cpu0", ["prelu", "selu", "conv1_conv", "conv1_prelu", "selu_1"]),
        ("bpu1", ["selu_1_activation_post_process", "conv2", "conv3_input_dequant_0"]),
        ("cpu1", ["conv3"]),
        ("bpu2", ["conv3_activation_post_process", "identity_1", "conv4", "selu_2_input_dequant_0"]),
        ("cpu2", ["selu_2", "dequant"]),
    ]
    assert summary_line(gm) == "partitions: 3 bpu, 3 cpu; BPU<->CPU boundary edges: 5"


def test_guide_prepared_model_is_float_exact_and_model_untouched(hybrid_model, guide_hybrid_dict):
    x = torch.rand(2, 3, 16, 16)
    snap = snapshot(hybrid_model)
    ref = hybrid_model(x)
    gm = qcompiler.partition(hybrid_model, x, march="bayes", hybrid_dict=guide_hybrid_dict)
    assert torch.equal(gm(x), ref)
    assert_untouched(hybrid_model, snap)


def test_bernoulli2_keeps_prelu_on_bpu(hybrid_model, guide_hybrid_dict):
    gm = qcompiler.partition(hybrid_model, torch.rand(1, 3, 16, 16), march="bernoulli2", hybrid_dict=guide_hybrid_dict)
    seq = forward_sequence(gm)
    # prelu runs on the BPU on bernoulli2, so the first dequant moves to the selu after it
    assert "prelu_input_dequant_0" not in seq
    assert seq[:6] == ["quant", "conv0", "identity", "prelu", "selu_input_dequant_0", "selu"]


def test_global_march_is_used_and_overridden(hybrid_model, guide_hybrid_dict):
    x = torch.rand(1, 3, 16, 16)
    old = qcompiler.get_march()
    try:
        qcompiler.set_march("bernoulli2")
        gm = qcompiler.partition(hybrid_model, x, hybrid_dict=guide_hybrid_dict)
        assert gm.meta["qc_march"] is qcompiler.March.BERNOULLI2
        gm = qcompiler.partition(hybrid_model, x, hybrid_dict=guide_hybrid_dict, march="bayes")
        assert gm.meta["qc_march"] is qcompiler.March.BAYES
    finally:
        qcompiler.set_march(old)
