"""Partitions as data: what the partition pass produces and dumps/lowering read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from qcompiler.ir.meta import BPU, CPU, META_PARTITION, carries_tensor, placement

GM_PARTITIONS = "qc_partitions"  # key in gm.meta


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


def partitions(gm: fx.GraphModule) -> list[Partition]:
    """The partitions recorded on ``gm`` by the partition pass, in a topological order."""
    return list(gm.meta.get(GM_PARTITIONS, []))


def boundary_edges(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """Tensor edges (producer, consumer) between a BPU and a CPU node, in graph order."""
    edges = []
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            a, b = placement(src), placement(node)
            if {a, b} == {BPU, CPU} and carries_tensor(src):
                edges.append((src.name, node.name))
    return edges


def summary_line(gm: fx.GraphModule) -> str:
    """``partitions: 3 bpu, 3 cpu; BPU<->CPU boundary edges: 5``"""
    parts = partitions(gm)
    nb = sum(p.placement == BPU for p in parts)
    nc = sum(p.placement == CPU for p in parts)
    return f"partitions: {nb} bpu, {nc} cpu; BPU<->CPU boundary edges: {len(boundary_edges(gm))}"


def partition_of(node: fx.Node) -> str | None:
    return node.meta.get(META_PARTITION)
