"""Contracts that survive ``python -O``: no ``assert`` statement in the package; every verifier raises
PassError naming the node at fault on a graph broken on purpose (beside the same graph unbroken, which
passes); the facts a pass requires are checked before it runs and provided in order by each pipeline;
the options passes read are a typed record."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.bpu.support import OpRule, rules
from qcompiler.errors import ConfigError, InternalError, PassError
from qcompiler.frontend import build_graph
from qcompiler.ir import trace
from qcompiler.ir.meta import META_FUSED_FROM, META_PARTITION, META_PLACEMENT, META_TENSOR, set_placement
from qcompiler.march import March
from qcompiler.passes.base import CompileContext, CompileOptions, PassManager
from qcompiler.passes.fuse import verify_fuse
from qcompiler.passes.inplace_reads import INPLACE_READS, inplace_reads, verify_inplace_reads
from qcompiler.passes.insert_observers import OBSERVERS, verify_observed
from qcompiler.passes.insert_stubs import verify_boundaries
from qcompiler.passes.leaf_writes import LEAF_WRITES, verify_leaf_writes
from qcompiler.passes.out_of_place import OUT_OF_PLACE, verify_out_of_place
from qcompiler.passes.partition import PARTITION, PARTITIONS, verify_partitions
from qcompiler.passes.pipeline import PARTITION_PIPELINE, PREPARE_PIPELINE, REQUANTIZE_PIPELINE
from qcompiler.passes.place import PLACE, PLACEMENT, verify_placed
from qcompiler.passes.shape_prop import SHAPE_PROP, TENSOR_META, verify_shapes
from qcompiler.quantization import prepare_calibration_fx
from qcompiler.quantization.observer import MinMaxObserver

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("qcompiler", "passes", "backends", "tools")  # one package (pyproject.toml's package-dir)
X = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
CTX = CompileContext(march=March.BAYES, example_inputs=(X,))


def _sources() -> list[Path]:
    """Every .py file of the package, each once (qcompiler/ links the other folders: links not followed)."""
    return sorted(Path(d) / f for top in PACKAGE_DIRS for d, _, files in os.walk(ROOT / top)
                  for f in files if f.endswith(".py"))


def test_the_package_has_no_assert_statement():
    """``python -O`` strips asserts: a contract must raise an error of qcompiler.errors instead."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _sources()
             for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Assert)]
    assert len(_sources()) > 100 and not found, found


class Net(nn.Module):
    """conv (BPU) -> atan (CPU on bayes) -> conv (BPU): stubs on both boundaries, three partitions."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.fc(torch.atan(torch.relu(self.conv(x))))


class MulThenRead(nn.Module):
    def forward(self, x):
        a = torch.relu(x)
        a.mul_(2.0)
        return torch.atan(a)


class Doubler(nn.Module):
    def forward(self, x):
        return x.mul_(2.0)


class LeafWrites(nn.Module):
    """An opaque leaf ``l`` writes its input, which the output reads too."""

    def __init__(self):
        super().__init__()
        self.l = Doubler()

    def forward(self, x):
        y = torch.relu(x)
        return self.l(y) + y


class AddInPlace(nn.Module):
    def forward(self, x):
        return torch.relu(x).add_(1.0)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def _partitioned():
    return qcompiler.partition(Net(), X)


def _calibration():
    return prepare_calibration_fx(Net(), example_inputs=X, hybrid=True, hybrid_dict={"module_name": ["fc"]})


def _no_shape(gm):
    del _node(gm, "atan").meta[META_TENSOR]


def _read_before_the_write(gm):
    """Undo inplace_reads: atan reads relu again, after mul_ changed it."""
    _node(gm, "atan").replace_input_with(_node(gm, "mul_"), _node(gm, "relu"))


def _unplaced(gm):
    del _node(gm, "atan").meta[META_PLACEMENT]


def _no_dequant(gm):
    _node(gm, "atan").replace_input_with(_node(gm, "atan_input_dequant_0"), _node(gm, "conv"))


def _in_no_partition(gm):
    _node(gm, "atan").meta[META_PARTITION] = "bpu0"


def _in_two_partitions(gm):
    first, second = gm.meta["qc_partitions"][:2]
    second.nodes.append(first.nodes[0])


def _fused_from_without_a_fused_module(gm):
    _node(gm, "atan").meta[META_FUSED_FROM] = ("atan",)


def _cpu_quantizer(gm):
    gm.fc.activation_post_process = MinMaxObserver()


# verifier, a graph it accepts, how to break it, what the PassError says (naming the node)
BROKEN = [
    (verify_shapes, _partitioned, _no_shape, r"node atan has no shape"),
    (verify_inplace_reads, lambda: inplace_reads(trace(MulThenRead()), CTX).gm, _read_before_the_write,
     r"\['atan'\] read relu after mul_ changed it in place"),
    (verify_placed, _partitioned, _unplaced, r"place: node 'atan' has no placement"),
    (verify_fuse, _partitioned, _fused_from_without_a_fused_module, r"fuse: node 'atan' has qc_fused_from"),
    (verify_boundaries, _partitioned, _no_dequant, r"BPU->CPU edge conv->atan without DeQuantStub"),
    (verify_partitions, _partitioned, _in_no_partition, r"node atan not in its partition"),
    (verify_partitions, _partitioned, _in_two_partitions,
     r"node x_activation_post_process in partitions bpu0 and cpu0"),
    (verify_observed, _calibration, _cpu_quantizer, r"CPU module fc \(node fc\) carries a quantizer"),
]


@pytest.mark.parametrize("verifier, build, break_, message", BROKEN,
                         ids=[f"{v.__name__}-{b.__name__}" for v, _, b, _ in BROKEN])
def test_a_verifier_accepts_its_graph_and_names_the_node_of_the_broken_one(verifier, build, break_, message):
    gm = build()
    verifier(gm, CTX)
    break_(gm)
    with pytest.raises(PassError, match=message):
        verifier(gm, CTX)


def test_out_of_place_names_an_op_left_in_place_with_a_twin():
    gm = PassManager([INPLACE_READS, SHAPE_PROP]).run(trace(AddInPlace()), CTX).gm
    with pytest.raises(PassError, match=r"\['add_'\] still run in place, with an out-of-place twin"):
        verify_out_of_place(gm, CTX)
    verify_out_of_place(OUT_OF_PLACE(gm, CTX).gm, CTX)


def test_leaf_writes_names_an_opaque_write_of_a_value_others_read():
    gm = PassManager([INPLACE_READS, SHAPE_PROP]).run(trace(LeafWrites(), leaf_module_names=["l"]), CTX).gm
    with pytest.raises(PassError, match=r"leaf_writes: 'l' writes 'relu', which other nodes read, in place"):
        verify_leaf_writes(gm, CTX)
    verify_leaf_writes(LEAF_WRITES(gm, CTX).gm, CTX)


def test_a_placement_off_the_two_sides_names_the_node():
    gm = _partitioned()
    node = _node(gm, "atan")
    set_placement(node, "cpu", "kept")
    with pytest.raises(PassError, match=r"node atan placed on 'gpu', not one of bpu, cpu"):
        set_placement(node, "gpu", "no such side")


def test_a_duplicate_op_table_row_names_the_op():
    assert set(rules(OpRule("conv2d"), OpRule("relu"))) == {"conv2d", "relu"}
    with pytest.raises(InternalError, match=r"duplicate op-table row 'relu'"):
        rules(OpRule("relu"), OpRule("conv2d"), OpRule("relu"))


# ----------------------------------------------------------------------------- facts a pass requires

FACTS = [  # a fact, a graph without it, the same graph once its provider ran
    (TENSOR_META, lambda: trace(Net()), lambda gm: SHAPE_PROP(gm, CTX).gm),
    (PLACEMENT, lambda: SHAPE_PROP(trace(Net()), CTX).gm, lambda gm: PLACE(gm, CTX).gm),
    (PARTITIONS, lambda: PassManager(PARTITION_PIPELINE[:-1]).run(trace(Net()), CTX).gm,
     lambda gm: PARTITION(gm, CTX).gm),
    (OBSERVERS, _partitioned, lambda gm: _calibration()),
]


@pytest.mark.parametrize("fact, without, provide", FACTS, ids=[f.name for f, _, _ in FACTS])
def test_a_fact_is_missing_until_its_provider_ran(fact, without, provide):
    gm = without()
    assert fact.missing(gm) is not None
    assert fact.missing(provide(gm)) is None


@pytest.mark.parametrize("pipeline", [PARTITION_PIPELINE, PREPARE_PIPELINE, PREPARE_PIPELINE + REQUANTIZE_PIPELINE],
                         ids=["partition", "prepare", "requantize"])
def test_every_pass_of_a_pipeline_finds_its_requirements_provided_before_it(pipeline):
    for i, p in enumerate(pipeline):
        assert all(fact.provider in pipeline[:i] for fact in p.requires), p.name
    assert any(p.requires for p in pipeline)


def test_the_manager_names_the_pass_the_missing_fact_and_its_provider():
    with pytest.raises(PassError, match=r"pass 'place' requires tensor metadata, which pass 'shape_prop' provides, "
                                        r"and node x has no shape: run 'shape_prop' before 'place'") as info:
        PassManager([INPLACE_READS, PLACE]).run(trace(Net()), CTX)
    assert info.value.pass_name == "place" and info.value.passes_before == ("inplace_reads",)
    PassManager([INPLACE_READS, SHAPE_PROP, PLACE]).run(trace(Net()), CTX)


# ----------------------------------------------------------------------------- options

def test_options_are_a_typed_record_and_an_unknown_name_is_a_config_error():
    options = CompileOptions.by_name({"optimize_graph": True})
    assert options == CompileOptions(optimize_graph=True) and options.activation_observer is MinMaxObserver
    with pytest.raises(ConfigError, match=r"unknown compile option 'optimise_graph'; the options are: "
                                          r"qconfig_resolver, optimize_graph, activation_observer"):
        build_graph(Net(), X, passes=PARTITION_PIPELINE, options={"optimise_graph": True})
