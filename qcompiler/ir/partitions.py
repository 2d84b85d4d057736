"""Partitions as data: what the partition pass produces and dumps/lowering read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from qcompiler.ir.meta import (
    BPU, CPU, GM_PARTITIONS, META_PARTITION, META_STUB, QUANTIZER_STUBS, carries_tensor, placement,
)


@dataclass
class Partition:
    """A maximal connected group of nodes with one placement.

    ``inputs``/``outputs`` are the names of the nodes whose values cross
    into/out of the partition, in graph order.
    """

    name: str
    placement: str
    nodes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "placement": self.placement,
            "nodes": list(self.nodes),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }


def is_quantizer_node(node: fx.Node) -> bool:
    """An observer / constant fake-quant node (``*_activation_post_process`` after an op): it only
    records or fake-quantizes a value and convert folds it away, so it is not an op of a partition."""
    return node.meta.get(META_STUB) in QUANTIZER_STUBS


def partitions(gm: fx.GraphModule, *, quantizers: bool = False) -> list[Partition]:
    """The partitions of ``gm`` in the order the partition pass recorded (a topological order).

    Their contents are read from the graph as it is now, not from the pass's snapshot (later
    passes add observers and convert removes them): ``nodes`` are the partition's ops in graph
    order, quantizer nodes (:func:`is_quantizer_node`) left out, so every dump and
    ``CompiledModel.summary()`` count the same ops; ``inputs``/``outputs`` are the values
    crossing into/out of the partition, in graph order. Partitions left without a node are dropped.
    ``quantizers=True`` keeps the quantizer nodes in ``nodes`` (the ONNX sidecar maps every
    exported node, Q/DQ included, to its partition).
    """
    members: dict[str, set[fx.Node]] = {}
    for node in gm.graph.nodes:
        part = node.meta.get(META_PARTITION)
        if part is not None and node.op not in ("placeholder", "output"):
            members.setdefault(part, set()).add(node)
    result = []
    for recorded in gm.meta.get(GM_PARTITIONS, []):
        inside = members.get(recorded.name)
        if not inside:
            continue
        p = Partition(recorded.name, recorded.placement)
        crossing_in: set[fx.Node] = set()
        for node in gm.graph.nodes:
            if node in inside:
                if quantizers or not is_quantizer_node(node):
                    p.nodes.append(node.name)
                crossing_in.update(a for a in node.all_input_nodes if a not in inside)
                if any(u not in inside for u in node.users):
                    p.outputs.append(node.name)
        p.inputs = [n.name for n in gm.graph.nodes if n in crossing_in]
        result.append(p)
    return result


def boundary_edges(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """Tensor edges (producer, consumer) between a BPU and a CPU node, in graph order."""
    edges = []
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            a, b = placement(src), placement(node)
            if {a, b} == {BPU, CPU} and carries_tensor(src):
                edges.append((src.name, node.name))
    return edges


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Ops per placement (``{"bpu": 20, "cpu": 9}``; both keys always there): the ops of the
    partitions (:func:`partitions`, quantizer nodes left out). The one count every output prints:
    the dump's JSON, ``qcompiler compile`` and ``partition``, and the report's overview."""
    counts = {BPU: 0, CPU: 0}
    for p in partitions(gm):
        counts[p.placement] = counts.get(p.placement, 0) + len(p.nodes)
    return counts


def format_op_counts(gm: fx.GraphModule) -> str:
    """``ops per placement: bpu 20, cpu 9`` (:func:`op_counts`)."""
    return "ops per placement: " + ", ".join(f"{k} {v}" for k, v in op_counts(gm).items())


def summary_line(gm: fx.GraphModule) -> str:
    """``partitions: 3 bpu, 3 cpu; BPU<->CPU boundary edges: 5``"""
    parts = partitions(gm)
    nb = sum(p.placement == BPU for p in parts)
    nc = sum(p.placement == CPU for p in parts)
    return f"partitions: {nb} bpu, {nc} cpu; BPU<->CPU boundary edges: {len(boundary_edges(gm))}"


def partition_of(node: fx.Node) -> str | None:
    return node.meta.get(META_PARTITION)
