"""The partition pass alone: grouping, acyclicity, maximality, naming, determinism."""

import networkx as nx
import torch
import torch.fx as fx

from qcompiler.ir.meta import META_PARTITION, META_TENSOR, TensorInfo, set_placement
from qcompiler.ir.partitions import boundary_edges, partitions
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.partition import partition


def graph(spec, cpu):
    """Build a GraphModule from [(name, [input names])]; names in ``cpu`` are CPU, the rest BPU."""
    g = fx.Graph()
    env = {"x": g.placeholder("x")}
    for name, inputs in spec:
        args = [env[i] for i in inputs]
        fn = torch.relu if len(args) == 1 else torch.add
        node = g.call_function(fn, tuple(args))
        node.name = name
        set_placement(node, "cpu" if name in cpu else "bpu", "test")
        node.meta[META_TENSOR] = TensorInfo((1, 4), "f32")
        env[name] = node
    g.output(env[spec[-1][0]])
    return fx.GraphModule(torch.nn.Module(), g)


def run(spec, cpu):
    gm = graph(spec, cpu)
    result = partition(gm, CompileContext(march=March.BAYES))
    return gm, result, [(p.name, p.nodes) for p in partitions(gm)]


def test_a_bpu_path_around_a_cpu_node_cannot_merge():
    # a -> c(cpu) -> d, and a -> d: {a, d} together would form a cycle through c
    _, _, parts = run([("a", ["x"]), ("c", ["a"]), ("d", ["a", "c"])], cpu={"c"})
    assert parts == [("bpu0", ["a"]), ("cpu0", ["c"]), ("bpu1", ["d"])]


def test_parallel_branches_merge_when_no_cycle():
    # x -> a -> add ; x -> s(cpu) -> e -> add : a, e and add form one BPU partition
    _, _, parts = run([("a", ["x"]), ("s", ["x"]), ("e", ["s"]), ("add", ["a", "e"])], cpu={"s"})
    assert parts == [("cpu0", ["s"]), ("bpu0", ["a", "e", "add"])]


def test_disconnected_groups_stay_separate():
    _, _, parts = run([("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"])], cpu={"c"})
    assert parts == [("bpu0", ["a"]), ("bpu1", ["b"]), ("cpu0", ["c"])]


def test_merge_through_a_later_group_is_refused():
    # a -> b ; a -> c(cpu) -> d ; b -> d ; levels put b with a, d after c: a,b,d cannot all merge
    _, _, parts = run([("a", ["x"]), ("b", ["a"]), ("c", ["a"]), ("d", ["b", "c"])], cpu={"c"})
    assert parts == [("bpu0", ["a", "b"]), ("cpu0", ["c"]), ("bpu1", ["d"])]


def test_partition_meta_inputs_outputs_and_boundaries():
    gm, result, _ = run([("a", ["x"]), ("c", ["a"]), ("d", ["a", "c"])], cpu={"c"})
    assert result.modified
    p = {q.name: q for q in partitions(gm)}
    assert (p["bpu0"].inputs, p["bpu0"].outputs) == (["x"], ["a"])
    assert (p["cpu0"].inputs, p["cpu0"].outputs) == (["a"], ["c"])
    assert (p["bpu1"].inputs, p["bpu1"].outputs) == (["a", "c"], ["d"])
    assert {n.name: n.meta[META_PARTITION] for n in gm.graph.nodes if META_PARTITION in n.meta} == {
        "a": "bpu0", "c": "cpu0", "d": "bpu1"}
    assert boundary_edges(gm) == [("a", "c"), ("c", "d")]
    # a second run changes nothing
    assert not partition(gm, CompileContext(march=March.BAYES)).modified


def test_random_alternation_is_acyclic_and_deterministic():
    import random

    rng = random.Random(7)
    spec, names = [], ["x"]
    for i in range(300):
        k = rng.choice([1, 2])
        inputs = [rng.choice(names[-6:]) for _ in range(k)]
        spec.append((f"n{i}", inputs))
        names.append(f"n{i}")
    cpu = {f"n{i}" for i in range(300) if rng.random() < 0.2}
    gm1, _, parts1 = run(spec, cpu)
    _, _, parts2 = run(spec, cpu)
    assert parts1 == parts2
    owner = {n: name for name, nodes in parts1 for n in nodes}
    dag = nx.DiGraph()
    dag.add_nodes_from(name for name, _ in parts1)
    for node in gm1.graph.nodes:
        for src in node.all_input_nodes:
            if src.name in owner and node.name in owner and owner[src.name] != owner[node.name]:
                dag.add_edge(owner[src.name], owner[node.name])
    assert nx.is_directed_acyclic_graph(dag)
    order = [name for name, _ in parts1]
    assert all(order.index(a) < order.index(b) for a, b in dag.edges)
    # maximal: no edge between two same-placement partitions can be contracted
    for a, b in list(dag.edges):
        if a[:3] == b[:3]:
            merged = nx.contracted_nodes(dag, a, b, self_loops=False)
            assert not nx.is_directed_acyclic_graph(merged), (a, b)
