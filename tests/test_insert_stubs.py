"""The insert_stubs pass alone, on graphs placed by hand."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import CPU, META_STUB, placement, set_placement
from qcompiler.ir.printing import forward_sequence
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.insert_stubs import insert_stubs, verify_boundaries
from qcompiler.passes.place import place


def prepared(model, x, cpu=()):
    gm = trace(model)
    propagate_shapes(gm, x)
    ctx = CompileContext(march=March.BAYES)
    place(gm, ctx)
    for n in gm.graph.nodes:  # hand placement: everything named in cpu goes to the CPU
        if n.name in cpu:
            set_placement(n, CPU, "test")
    result = insert_stubs(gm, ctx)
    verify_boundaries(gm, ctx)
    return gm, result


class Fan(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.a(x)
        z = F.selu(y)  # cpu
        w = torch.cat([y, z], 1)  # forced cpu: two inputs, one from the BPU
        return self.b(z) + w.sum()


X = torch.rand(1, 4, 8, 8)


def test_one_dequant_per_bpu_producer_and_observer_only_for_bpu_users():
    gm, result = prepared(Fan(), X, cpu={"cat", "sum_1", "add"})
    assert result.modified
    assert forward_sequence(gm) == [
        "x_activation_post_process", "a", "selu_input_dequant_0", "selu", "selu_activation_post_process",
        "cat_input_dequant_0", "cat", "b", "sum_1", "add_input_dequant_0", "add",
    ]
    cat = next(n for n in gm.graph.nodes if n.name == "cat")
    # the CPU cat reads the dequantized BPU value and the raw (float) CPU value
    assert [a.name for a in cat.args[0]] == ["cat_input_dequant_0", "selu"]
    stubs = {n.name: n.meta[META_STUB] for n in gm.graph.nodes if META_STUB in n.meta}
    assert stubs["selu_activation_post_process"] == "activation_post_process"
    assert stubs["cat_input_dequant_0"] == "input_dequant"


def test_nothing_to_do_on_a_bpu_only_graph_with_explicit_stubs():
    from torch.ao.quantization import DeQuantStub, QuantStub

    class Stubbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.c, self.dq = QuantStub(), nn.Conv2d(4, 4, 1), DeQuantStub()

        def forward(self, x):
            return self.dq(self.c(self.q(x)))

    gm, result = prepared(Stubbed(), X)
    assert not result.modified
    assert forward_sequence(gm) == ["q", "c", "dq"]


def test_inputs_and_outputs_without_stubs_are_quantized_and_dequantized_there():
    gm, result = prepared(nn.Sequential(nn.Conv2d(4, 4, 1)), X)
    assert forward_sequence(gm) == ["input_1_activation_post_process", "_0", "output_input_dequant_0"]
    first = next(iter(gm.graph.nodes))
    assert first.op == "placeholder"


def test_cpu_first_and_last_op_need_no_stubs():
    class CpuEnds(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return F.gelu(self.c(F.selu(x)))

    gm, _ = prepared(CpuEnds(), X)
    assert forward_sequence(gm) == ["selu", "selu_activation_post_process", "c", "gelu_input_dequant_0", "gelu"]


def test_identity_after_cpu_node_is_looked_through_only_when_all_its_users_are_bpu():
    class Id(nn.Module):
        def __init__(self):
            super().__init__()
            self.ident = nn.Identity()
            self.c = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.ident(F.selu(x))
            return self.c(y), F.elu(y)  # the identity feeds BPU and CPU

    gm, _ = prepared(Id(), X)
    seq = forward_sequence(gm)
    # mixed users: the observer goes after the identity, and only the conv reads it
    assert seq[:3] == ["selu", "ident", "ident_activation_post_process"]
    elu = next(n for n in gm.graph.nodes if n.name == "elu")
    assert elu.args[0].name == "ident"
    node = next(n for n in gm.graph.nodes if n.name == "ident")
    assert placement(node) == CPU


def test_prepared_graph_is_float_exact():
    m = Fan()
    gm, _ = prepared(m, X, cpu={"cat", "sum_1", "add"})
    assert torch.equal(gm(X), m(X))
