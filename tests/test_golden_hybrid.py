"""Golden test: the heterogeneous-QAT guide's HybridModel, march bayes, the guide's hybrid_dict."""

import torch
import torch.ao.quantization as taq
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_untouched, snapshot
from graph_match import assert_same_graph, meta

import qcompiler
from qcompiler.ir.meta import META_PARTITION
from qcompiler.ir.partitions import partitions, summary_line
from qcompiler.nn import qat
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qcompiler.quantization.observer import MinMaxObserver
from qcompiler.quantization.stubs import DeQuantStub, QuantStub

# The classes each stage gives the model's QuantStub, its BPU convs and the boundary observers it
# inserts: partition() keeps the model's modules and observes with bare observers; prepare swaps in
# qcompiler's stub and observed convs, and quantizes with calibration, then QAT, fake quants.
STAGES = {
    "partition": (taq.QuantStub, nn.Conv2d, MinMaxObserver),
    "calibration": (QuantStub, qat.Conv2d, lambda: CalibFakeQuantize(MinMaxObserver())),
    "qat": (QuantStub, qat.Conv2d, lambda: FakeQuantize(MinMaxObserver())),
}
# The prepared forward of the guide, a chain: per partition, the modules (by path) and functions it calls.
GUIDE_CHAIN = (
    ("bpu0", ("quant", "conv0", "identity", "prelu_input_dequant")),
    ("cpu0", ("prelu", F.selu, "conv1.conv", "conv1.prelu", F.selu)),
    ("bpu1", ("selu_1_activation_post_process", "conv2", "conv3_input_dequant")),
    ("cpu1", ("conv3",)),
    ("bpu2", ("conv3_activation_post_process", "identity", "conv4", "selu_2_input_dequant")),
    ("cpu2", (F.selu, "dequant")),
)
PARTITIONS = tuple(partition for partition, _ in GUIDE_CHAIN)
# On bernoulli2 the PReLU after conv0 runs on the BPU: the dequant moves to the SELU after it.
# conv1.prelu is supported too, but alone between the CPU conv1.conv (hybrid_dict) and a CPU SELU it
# does no BPU work (no multiply-accumulate): it stays on the CPU rather than making a BPU partition of
# a quantize, a PReLU and a dequantize (passes/place.py, idle regions).
BERNOULLI2_CHAIN = (
    ("bpu0", ("quant", "conv0", "identity", "prelu", "selu_input_dequant")),
    ("cpu0", (F.selu, "conv1.conv", "conv1.prelu", F.selu)),
    ("bpu1", ("selu_1_activation_post_process", "conv2", "conv3_input_dequant")),
    ("cpu1", ("conv3",)),
    ("bpu2", ("conv3_activation_post_process", "identity", "conv4", "selu_2_input_dequant")),
    ("cpu2", (F.selu, "dequant")),
)


class GuidePrepared(nn.Module):
    """The modules of ``chain`` (GUIDE_CHAIN: march bayes), called in its order (observers of BPU ops
    are not graph nodes in our design; boundary observers are). ``stage`` is a key of STAGES."""

    def __init__(self, stage: str = "partition", chain: tuple = GUIDE_CHAIN) -> None:
        super().__init__()
        self.chain = chain
        quant, bpu_conv, observer = STAGES[stage]
        self.quant, self.dequant = quant(), taq.DeQuantStub()
        self.conv0, self.conv2, self.conv4 = (bpu_conv(3, 3, 1) for _ in range(3))
        self.identity, self.prelu, self.conv3 = nn.Identity(), nn.PReLU(), nn.Conv2d(3, 3, 1)
        self.conv1 = nn.Module()  # the guide's conv block, conv1.conv forced to the CPU
        self.conv1.conv, self.conv1.prelu = nn.Conv2d(3, 3, 1), nn.PReLU()
        self.prelu_input_dequant, self.conv3_input_dequant = DeQuantStub(), DeQuantStub()
        self.selu_2_input_dequant = DeQuantStub()
        self.selu_1_activation_post_process, self.conv3_activation_post_process = observer(), observer()
        # where BERNOULLI2_CHAIN differs
        self.selu_input_dequant = DeQuantStub()

    def forward(self, input):
        x = input
        for partition, calls in self.chain:
            for call in calls:
                x = meta(self.get_submodule(call)(x) if isinstance(call, str) else call(x), partition=partition)
        return x


def test_guide_forward_sequence(hybrid_model, guide_hybrid_dict):
    gm = qcompiler.partition(
        hybrid_model, torch.rand(1, 3, 224, 224), march=qcompiler.March.BAYES, hybrid_dict=guide_hybrid_dict
    )
    assert_same_graph(gm, GuidePrepared())


def test_guide_modules_and_partitions(hybrid_model, guide_hybrid_dict):
    gm = qcompiler.partition(hybrid_model, torch.rand(1, 3, 32, 32), march="bayes", hybrid_dict=guide_hybrid_dict)
    assert_same_graph(gm, GuidePrepared())
    # partitions() lists each partition's nodes in graph order, the partitions in the order above
    assert [(p.name, p.nodes) for p in partitions(gm)] == [
        (name, [n.name for n in gm.graph.nodes if n.meta.get(META_PARTITION) == name]) for name in PARTITIONS]
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
    assert_same_graph(gm, GuidePrepared(chain=BERNOULLI2_CHAIN))


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
