"""Property tests of placement + stubs + partitioning on random DAG models (hypothesis).

Random models are real ``nn.Module``s: a ``ModuleList`` of small op modules and
an index plan saying which earlier values each op reads.  Every value has the
shape (1, C, H, W) so any value can feed any op.  For each model and march we
check the invariants of ``qcompiler.partition`` (placement, partitions, stubs,
float outputs, determinism).  A few hand-computed cases sit at the end.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import networkx as nx
import pytest
import torch
import torch.ao.quantization as taq
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from partition_reference import group_nodes_reference

import qcompiler
from benchmarks.partition_scaling import GRAPHS
from qcompiler.ir.meta import (
    BPU,
    CPU,
    META_OP,
    META_PARTITION,
    META_PLACEMENT,
    META_REASON,
    META_STUB,
    carries_tensor,
    placement,
)
from qcompiler.ir.ops import PASSTHROUGH_OPS
from qcompiler.ir.partitions import partitions
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.insert_stubs import insert_stubs
from qcompiler.passes.partition import group_nodes, initial_groups
from qcompiler.passes.place import place
from qcompiler.quantization.stubs import DeQuantStub, QuantStub

C, H, W = 4, 8, 8
MARCHES = ("bayes", "bernoulli2")

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # reproducible in CI: the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@contextlib.contextmanager
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency (ms each on a loaded CI box)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------- random models


class Fn(nn.Module):
    """Calls a torch function on its inputs (traced into: nodes are scoped to this module)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class CatConv(nn.Module):
    """cat(a, b) along channels, then a 1x1 conv back to C channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2 * C, C, 1)

    def forward(self, a, b):
        return self.conv(torch.cat([a, b], dim=1))


# kind -> (arity, module factory)
KINDS: dict[str, tuple[int, object]] = {
    # BPU-supported on both marches
    "conv1": (1, lambda: nn.Conv2d(C, C, 1)),
    "conv3": (1, lambda: nn.Conv2d(C, C, 3, padding=1)),
    "relu": (1, nn.ReLU),
    "relu_fn": (1, lambda: Fn(F.relu)),
    "add": (2, lambda: Fn(operator.add)),
    "mul": (2, lambda: Fn(operator.mul)),
    "catconv": (2, CatConv),
    "maxpool": (1, lambda: nn.MaxPool2d(3, stride=1, padding=1)),
    "sigmoid": (1, lambda: Fn(torch.sigmoid)),
    # CPU on both marches
    "selu": (1, lambda: Fn(F.selu)),
    "gelu": (1, lambda: Fn(F.gelu)),
    "elu": (1, lambda: Fn(F.elu)),
    "erf": (1, lambda: Fn(torch.erf)),
    # CPU on bayes, BPU on bernoulli2
    "prelu": (1, lambda: nn.PReLU(C)),
    # computes nothing: follows its producer
    "identity": (1, nn.Identity),
}


@dataclass(frozen=True)
class Spec:
    steps: tuple[tuple[str, tuple[int, ...]], ...]  # (kind, indices of earlier values)
    outputs: tuple[int, ...]
    quant: str  # "", "ours", "torch"
    dequant: bool

    def module_names(self) -> list[str]:
        return [f"ops.{i}" for i in range(len(self.steps))]


class DagModel(nn.Module):
    """value 0 = input (or quant(input)); value i+1 = ops[i](values at plan[i])."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.quant = {"": None, "ours": QuantStub, "torch": taq.QuantStub}[spec.quant]
        self.quant = self.quant() if self.quant is not None else None
        self.ops = nn.ModuleList(KINDS[kind][1]() for kind, _ in spec.steps)
        self.plan = tuple(args for _, args in spec.steps)
        self.outputs = spec.outputs
        self.dequant = DeQuantStub() if spec.dequant else None

    def forward(self, x):
        values = [self.quant(x) if self.quant is not None else x]
        for op, args in zip(self.ops, self.plan):
            values.append(op(*[values[i] for i in args]))
        outs = [values[i] for i in self.outputs]
        if self.dequant is not None:
            outs = [self.dequant(o) for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def build(spec: Spec, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(seed)
    model = DagModel(spec).eval()
    return model, (torch.randn(1, C, H, W),)


@st.composite
def specs(draw, max_ops: int = 12) -> Spec:
    n = draw(st.integers(1, max_ops))
    steps = []
    for i in range(n):
        kind = draw(st.sampled_from(sorted(KINDS)))
        # mostly recent values (chains), sometimes any earlier one (long skips, fan-out)
        pick = st.one_of(st.integers(max(0, i - 2), i), st.integers(0, i))
        steps.append((kind, tuple(draw(pick) for _ in range(KINDS[kind][0]))))
    outputs = tuple(draw(st.lists(st.integers(0, n), min_size=1, max_size=3)))
    return Spec(tuple(steps), outputs, draw(st.sampled_from(["", "ours", "torch"])), draw(st.booleans()))


@st.composite
def specs_with_hybrid(draw):
    spec = draw(specs())
    names = spec.module_names() + (["quant"] if spec.quant else []) + (["dequant"] if spec.dequant else [])
    forced = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
    return spec, forced


# ---------------------------------------------------------------- invariants


def _placed(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _module(gm: fx.GraphModule, node: fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def same_outputs(a, b) -> bool:
    """Exact equality of (nested tuples of) tensors; NaN equals NaN at the same place."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if torch.equal(a, b):
            return True
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_outputs(x, y) for x, y in zip(a, b))
    return False


def partition_graph(gm: fx.GraphModule) -> tuple[nx.DiGraph, dict[str, str]]:
    """Edge P -> Q when a node of P feeds a node of Q; and node name -> partition name."""
    owner = {name: p.name for p in partitions(gm) for name in p.nodes}
    g = nx.DiGraph()
    g.add_nodes_from(p.name for p in partitions(gm))
    for node in _placed(gm):
        for src in node.all_input_nodes:
            if src.name in owner and owner[src.name] != owner[node.name]:
                g.add_edge(owner[src.name], owner[node.name])
    return g, owner


def check_invariants(gm: fx.GraphModule) -> None:
    placed = _placed(gm)
    by_name = {n.name: n for n in placed}
    parts = partitions(gm)

    # placement and reason on every placed node
    for n in placed:
        assert placement(n) in (BPU, CPU), f"{n.name}: placement {placement(n)!r}"
        assert isinstance(n.meta.get(META_REASON), str) and n.meta[META_REASON], f"{n.name}: no reason"

    # partitions: non-empty, unique names, one placement, cover every placed node exactly once
    names = [p.name for p in parts]
    assert len(set(names)) == len(names), names
    seen: dict[str, str] = {}
    for p in parts:
        assert p.nodes, f"empty partition {p.name}"
        assert p.placement in (BPU, CPU)
        for name in p.nodes:
            assert name not in seen, f"{name} in {seen[name]} and {p.name}"
            seen[name] = p.name
            assert name in by_name, f"{p.name} lists unknown node {name}"
            assert placement(by_name[name]) == p.placement, f"{name} in {p.name} is {placement(by_name[name])}"
            assert by_name[name].meta.get(META_PARTITION) == p.name
    assert set(seen) == set(by_name), f"unpartitioned: {set(by_name) - set(seen)}"

    # names numbered 0.. consecutively per placement, in list order
    for where in (BPU, CPU):
        mine = [p.name for p in parts if p.placement == where]
        assert mine == [f"{where}{k}" for k in range(len(mine))], mine

    # each partition is weakly connected by its internal edges
    for p in parts:
        inside = set(p.nodes)
        g = nx.Graph()
        g.add_nodes_from(inside)
        for name in inside:
            for src in by_name[name].all_input_nodes:
                if src.name in inside:
                    g.add_edge(src.name, name)
        assert nx.is_connected(g), f"{p.name} is not connected: {list(nx.connected_components(g))}"

    # partition graph acyclic, list order topological
    pg, owner = partition_graph(gm)
    assert nx.is_directed_acyclic_graph(pg), f"cycle: {nx.find_cycle(pg)}"
    index = {name: k for k, name in enumerate(names)}
    for a, b in pg.edges:
        assert index[a] < index[b], f"{a} -> {b} but {b} is listed first"

    # maximality: merging two adjacent partitions of one placement must create a cycle
    kind = {p.name: p.placement for p in parts}
    for a, b in pg.edges:
        if kind[a] == kind[b]:
            merged = nx.contracted_nodes(pg, a, b, self_loops=False)
            assert not nx.is_directed_acyclic_graph(merged), f"{a} and {b} could be merged"

    # inputs/outputs of each partition: the values crossing its boundary, in graph order
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for p in parts:
        inside = set(p.nodes)
        ins = {s.name for n in inside for s in by_name[n].all_input_nodes if s.name not in inside}
        outs = {n for n in inside if any(u.name not in inside for u in by_name[n].users)}
        assert p.inputs == sorted(ins, key=order.__getitem__), (p.name, p.inputs, ins)
        assert p.outputs == sorted(outs, key=order.__getitem__), (p.name, p.outputs, outs)

    # stubs at every boundary
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            if not carries_tensor(src):
                continue
            if placement(src) == BPU and (node.op == "output" or placement(node) == CPU):
                assert isinstance(_module(gm, src), (DeQuantStub, taq.DeQuantStub)), (
                    f"BPU -> CPU edge {src.name} -> {node.name} without a DeQuantStub"
                )
            float_src = src.op == "placeholder" or (placement(src) == CPU and src.op != "get_attr")
            if float_src and placement(node) == BPU:
                observer = node.meta.get(META_STUB) == "activation_post_process" and node.name.endswith(
                    "_activation_post_process"
                )
                user_stub = isinstance(_module(gm, node), (QuantStub, taq.QuantStub))
                assert observer or user_stub, f"float -> BPU edge {src.name} -> {node.name} without an observer"


def summary(gm: fx.GraphModule) -> list[tuple]:
    return [(p.name, p.placement, tuple(p.nodes), tuple(p.inputs), tuple(p.outputs)) for p in partitions(gm)]


def run_and_check(model: nn.Module, inputs: tuple, march: str, hybrid_dict=None) -> fx.GraphModule:
    gm = qcompiler.partition(model, inputs, march=march, hybrid_dict=hybrid_dict)
    check_invariants(gm)
    with torch.no_grad():
        assert same_outputs(gm(*inputs), model(*inputs)), "partitioned graph changed the float outputs"
    return gm


# ---------------------------------------------------------------- random properties


@SETTINGS
@given(specs())
def test_random_dag_invariants(spec):
    model, inputs = build(spec)
    with one_thread():
        for march in MARCHES:
            gm = run_and_check(model, inputs, march)
            again = qcompiler.partition(model, inputs, march=march)
            assert summary(again) == summary(gm), "partitioning is not deterministic"


@SETTINGS
@given(specs_with_hybrid())
def test_random_dag_with_hybrid_dict(spec_forced):
    spec, forced = spec_forced
    model, inputs = build(spec)
    hybrid = {"module_name": forced} if forced else None
    with one_thread():
        for march in MARCHES:
            gm = run_and_check(model, inputs, march, hybrid)
            for node in _placed(gm):
                scopes = [e.path for e in node.meta.get("qc_scope", ())]
                if not any(p == f or p.startswith(f + ".") for p in scopes for f in forced):
                    continue
                if node.meta.get(META_OP) in PASSTHROUGH_OPS and all(placement(u) == BPU for u in node.users):
                    continue  # documented: insert_stubs looks through a CPU identity feeding only the BPU
                assert placement(node) == CPU, f"{node.name} is inside a forced module but on {placement(node)}"


# ---------------------------------------------------------------- hand-written cases


class TwoBranches(nn.Module):
    """x -> a (conv) -> add;  x -> selu (CPU) -> e (conv) -> add."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.e = nn.Conv2d(C, C, 1)

    def forward(self, x):
        return self.a(x) + self.e(F.selu(x))


class SkipAroundCpu(nn.Module):
    """x -> a (conv) -> selu (CPU) -> e (conv) -> add(a, e): a and e cannot share a partition."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.e = nn.Conv2d(C, C, 1)

    def forward(self, x):
        a = self.a(x)
        return a + self.e(F.selu(a))


def _parts(gm) -> list[tuple[str, list[str]]]:
    return [(p.name, list(p.nodes)) for p in partitions(gm)]


@pytest.mark.parametrize("march", MARCHES)
def test_two_parallel_branches_one_bpu_partition(march):
    # a+add fuse into `a`; the BPU side {a, e, observers, dequant} has no path through
    # the CPU op back into itself, so the minimum (one BPU partition) is acyclic.
    torch.manual_seed(0)
    model, inputs = TwoBranches().eval(), (torch.randn(1, C, H, W),)
    gm = run_and_check(model, inputs, march)
    assert _parts(gm) == [
        ("cpu0", ["selu"]),
        ("bpu0", ["x_activation_post_process", "selu_activation_post_process", "e", "a", "output_input_dequant_0"]),
    ]


@pytest.mark.parametrize("march", MARCHES)
def test_skip_around_cpu_op_needs_two_bpu_partitions(march):
    # a -> selu -> e and a -> e (the add fused into e): putting a and e together
    # would make a cycle through cpu0, so two BPU partitions is the minimum.
    torch.manual_seed(0)
    model, inputs = SkipAroundCpu().eval(), (torch.randn(1, C, H, W),)
    gm = run_and_check(model, inputs, march)
    assert _parts(gm) == [
        ("bpu0", ["x_activation_post_process", "a", "selu_input_dequant_0"]),
        ("cpu0", ["selu"]),
        ("bpu1", ["selu_activation_post_process", "e", "output_input_dequant_0"]),
    ]


@pytest.mark.parametrize("march,expected", [
    ("bayes", [("bpu0", ["x_activation_post_process", "ops_0", "ops_1_input_dequant_0"]),
               ("cpu0", ["ops_1"]),
               ("bpu1", ["ops_1_activation_post_process", "ops_2", "output_input_dequant_0"])]),
    ("bernoulli2", [("bpu0", ["x_activation_post_process", "ops_0", "ops_1", "ops_2", "output_input_dequant_0"])]),
])
def test_prelu_depends_on_march(march, expected):
    # conv -> PReLU -> conv: PReLU is CPU on bayes only
    model, inputs = build(Spec((("conv3", (0,)), ("prelu", (1,)), ("conv1", (2,))), (3,), "", False))
    gm = run_and_check(model, inputs, march)
    assert _parts(gm) == expected


@pytest.mark.parametrize("march", MARCHES)
def test_hybrid_relu_breaks_fusion_and_partition(march):
    # conv -> relu (forced to CPU) -> conv: no conv+relu fusion across the sides
    model, inputs = build(Spec((("conv3", (0,)), ("relu", (1,)), ("conv1", (2,))), (3,), "ours", True))
    gm = run_and_check(model, inputs, march, {"module_name": ["ops.1"]})
    assert _parts(gm) == [
        ("bpu0", ["quant", "ops_0", "ops_1_input_dequant_0"]),
        ("cpu0", ["ops_1"]),
        ("bpu1", ["ops_1_activation_post_process", "ops_2", "dequant"]),
    ]


def test_hybrid_identity_between_cpu_and_bpu_is_looked_through():
    # elu (CPU) -> identity (forced CPU) -> conv: the observer goes before the identity,
    # which then follows it onto the BPU (insert_stubs docstring), whatever hybrid_dict said.
    model, inputs = build(Spec((("elu", (0,)), ("identity", (1,)), ("conv1", (2,))), (3,), "", False))
    gm = run_and_check(model, inputs, "bayes", {"module_name": ["ops.1"]})
    assert _parts(gm) == [
        ("cpu0", ["elu"]),
        ("bpu0", ["elu_activation_post_process", "ops_1", "ops_2", "output_input_dequant_0"]),
    ]
    assert [n.args[0].name for n in gm.graph.nodes if n.name == "ops_1"] == ["elu_activation_post_process"]


@pytest.mark.parametrize("march", MARCHES)
def test_tuple_outputs_exact(march):
    # conv+relu fuse; outputs: the fused value, a CPU value and the raw input
    spec = Spec((("conv3", (0,)), ("relu_fn", (1,)), ("gelu", (2,)), ("add", (2, 3))), (2, 3, 4, 0), "", False)
    model, inputs = build(spec)
    gm = run_and_check(model, inputs, march)
    out = gm(*inputs)
    assert isinstance(out, tuple) and len(out) == 4 and out[3] is inputs[0]


def test_partition_inputs_outputs_in_graph_order():
    # regression: inputs/outputs were once listed in order of first use (bpu0.outputs ==
    # ['selu_input_dequant_0', 'a']); qcompiler/ir/partitions.py documents graph order
    torch.manual_seed(0)
    model, inputs = SkipAroundCpu().eval(), (torch.randn(1, C, H, W),)
    gm = qcompiler.partition(model, inputs, march="bayes")
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for p in partitions(gm):
        assert p.inputs == sorted(p.inputs, key=order.__getitem__), (p.name, "inputs", p.inputs)
        assert p.outputs == sorted(p.outputs, key=order.__getitem__), (p.name, "outputs", p.outputs)
    assert [(p.name, p.inputs, p.outputs) for p in partitions(gm)] == [
        ("bpu0", ["x"], ["a", "selu_input_dequant_0"]),
        ("cpu0", ["selu_input_dequant_0"], ["selu"]),
        ("bpu1", ["a", "selu"], ["output_input_dequant_0"]),
    ]


# ---------------------------------------------------------------- merge step vs the slow reference


def _placed_graph(inputs: list[tuple[int, ...]], sides: list[str]) -> list[fx.Node]:
    """Call nodes ``i`` reading the values ``inputs[i]`` (0 = the graph input, k = node k-1), placed ``sides[i]``."""
    g = fx.Graph()
    values = [g.placeholder("x")]
    for args, where in zip(inputs, sides):
        node = g.call_function(torch.add, tuple(values[k] for k in args))
        node.meta[META_PLACEMENT] = where
        values.append(node)
    g.output(values[-1])
    return [n for n in g.nodes if n.op == "call_function"]


@st.composite
def placed_dags(draw, max_nodes: int = 60):
    n = draw(st.integers(1, max_nodes))
    cpu_share = draw(st.sampled_from([0.1, 0.3, 0.5]))
    inputs, sides = [], []
    for i in range(n):
        # mostly recent values (chains), sometimes any earlier one (long skips, fan-out)
        pick = st.one_of(st.integers(max(0, i - 2), i), st.integers(0, i))
        inputs.append(tuple(draw(st.lists(pick, min_size=1, max_size=3))))
        sides.append(CPU if draw(st.floats(0, 1)) < cpu_share else BPU)
    return inputs, sides


@settings(SETTINGS, max_examples=200)
@given(placed_dags())
def test_merge_step_equals_the_slow_reference(dag):
    nodes = _placed_graph(*dag)
    assert group_nodes(nodes) == group_nodes_reference(nodes)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("size", [200, 1000])
def test_merge_step_equals_the_slow_reference_on_benchmark_graphs(graph, size):
    gm = place(GRAPHS[graph](size, seed=size) if graph == "mixed" else GRAPHS[graph](size),
               CompileContext(march=March.BAYES)).gm
    gm = insert_stubs(gm, CompileContext(march=March.BAYES)).gm
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    groups = group_nodes(nodes)
    assert groups == group_nodes_reference(nodes)
    if graph == "merge-heavy":  # at least one merge per block of 8 ops: the case the merge step is for
        uf = initial_groups(nodes)[0]
        assert len({uf.find(i) for i in range(len(nodes))}) - len(groups) >= size // 8
