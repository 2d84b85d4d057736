"""A CPU island in eager torch, for what ONNX opset 11 cannot express.

A CPU partition whose nodes the ONNX emitter cannot emit (an opaque leaf module, an op
with no opset-11 form) still runs: its nodes are copied into a standalone
``fx.GraphModule`` (the same modules and functions the converted model calls, so the
island computes what the converted model computes, bit for bit) and called on the CPU.
The runtime runs it through the same ``run(env) -> outputs`` interface as an
:class:`~qcompiler.backends.ort.island.OrtIsland`.

Such an island is Python code: an artifact cannot hold it without pickling, so
``CompiledModel.save`` refuses it and ``export_onnx`` names it (docs/design.md).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.ir.inplace import mutated_input

TORCH = "torch"  # the step kind of an eager-torch island


def island_module(gm: fx.GraphModule, nodes: Sequence[str], inputs: Sequence[str],
                  outputs: Sequence[str]) -> fx.GraphModule:
    """The nodes ``nodes`` of ``gm`` as a GraphModule taking ``inputs`` and returning the tuple ``outputs``
    (values by FX name); it shares ``gm``'s submodules and attributes.

    An in-place op on a value that leaves the island (an input or an output) runs on a clone of it: other
    steps share that tensor, and the partitioner may run one of its earlier readers after this island
    (:mod:`~qcompiler.passes.inplace_reads` made every later read go through the op's result, so the
    op's own value is the only one that must change).  In-place ops on values the island keeps to itself
    run as they are."""
    by_name = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in (*nodes, *inputs) if n not in by_name]
    if missing:
        raise ConfigError(f"eager island: no node named {', '.join(repr(m) for m in missing)} in the graph")
    wanted = set(nodes)
    graph = fx.Graph()
    values: dict[str, fx.Node] = {name: graph.placeholder(name) for name in inputs}

    def arg(node: fx.Node) -> fx.Node:
        if node.name not in values:
            raise ConfigError(f"eager island: node reads '{node.name}', which is neither in the island "
                              f"nor one of its inputs")
        return values[node.name]

    shared = {*inputs, *outputs}
    for node in gm.graph.nodes:  # graph order is a topological order
        if node.name not in wanted:
            continue
        copy = graph.node_copy(node, arg)
        changed = mutated_input(node, gm)
        if changed is not None and changed.name in shared:
            _change_a_clone(graph, copy, values[changed.name])
        values[node.name] = copy
    graph.output(tuple(values[o] for o in outputs))
    return fx.GraphModule(gm, graph, class_name="EagerIsland")


def _change_a_clone(graph: fx.Graph, node: fx.Node, value: fx.Node) -> None:
    """Make the in-place ``node`` change a clone of ``value`` (its first argument) made just before it."""
    with graph.inserting_before(node):
        clone = graph.call_method("clone", (value,))
    if node.args:
        node.args = (clone, *node.args[1:])
    else:
        node.kwargs = {**node.kwargs, "input": clone}


class EagerIsland:
    """Run one CPU island in eager torch: values in by FX name, values out by FX name."""

    def __init__(self, name: str, module: fx.GraphModule, inputs: Sequence[str], outputs: Sequence[str],
                 reason: str) -> None:
        self.name, self.module, self.reason = name, module, reason
        self.inputs, self.outputs = list(inputs), list(outputs)
        self._warned = False

    @classmethod
    def from_graph(cls, name: str, gm: fx.GraphModule, nodes: Sequence[str], inputs: Sequence[str],
                   outputs: Sequence[str], reason: str) -> "EagerIsland":
        return cls(name, island_module(gm, nodes, inputs, outputs), inputs, outputs, reason)

    def run(self, env: dict[str, Any]) -> dict[str, Any]:
        feeds = [env[name] for name in self.inputs]
        versions = [_version(v) for v in feeds]
        with torch.no_grad():
            results = self.module(*feeds)
        if not self._warned and any(_version(v) != was for v, was in zip(feeds, versions)):
            self._warn_write([n for n, v, was in zip(self.inputs, feeds, versions) if _version(v) != was])
        return dict(zip(self.outputs, results))

    def _warn_write(self, names: list[str]) -> None:
        """An input changed in place: a write compile did not see (the island's in-place ops on shared values
        run on clones, and passes/leaf_writes gave each leaf a copy of what shape propagation saw it write)."""
        self._warned = True  # once per island
        modules = [str(n.target) for n in self.module.graph.nodes if n.op == "call_module"]
        warnings.warn(f"torch island {self.name} changed its input {', '.join(repr(n) for n in names)} in place "
                      f"(modules: {', '.join(modules) or 'none'}) without a copy of its own: other steps may see the "
                      f"write where the model did not, or miss it. compile warned if it saw the write and could not "
                      f"copy it; else the example inputs did not make the module write (a write under "
                      f"data-dependent control flow): compile with inputs that do, or write out of place in the "
                      f"module (y = x * 2 for x.mul_(2)).", QCompilerWarning, stacklevel=4)

    def code(self) -> str:
        """The island's Python code (for dumps), headed by why it runs in torch."""
        return f"# torch island {self.name}: {self.reason}\n{self.module.code.strip()}\n"


def _version(value: Any) -> Optional[int]:
    """The version counter of a tensor (moved by each in-place write), None for anything else."""
    return value._version if isinstance(value, torch.Tensor) and not value.is_inference() else None


__all__ = ["TORCH", "EagerIsland", "island_module"]
