"""Goldens by structure: compare a graph with an expected one stated as a module or a function.

A golden test writes the graph it expects as a small ``nn.Module`` (or a function), which
:func:`assert_same_graph` traces with qcompiler's tracer and compares node by node, in graph order:

* the op kind (placeholder, call_module, call_function, call_method, get_attr, output);
* the target: for a module its path, its class, its public plain attributes (``in_channels``,
  ``kernel_size``, ``fused_from``...) and the shapes of its own parameters; a function by
  identity; a method by name; a ``get_attr`` by the value it fetches;
* the arguments: a node by its position in the graph, a constant by type and value;
* the meta the expected forward states with :func:`meta` (a partition, a placement).

Node names are not compared: they are torch.fx's, and a torch release may change them (as it may
change ``gm.code``), so such a golden depends on our compiler only. A failure names the first node
that differs and what differs in it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Union

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.ir.meta import META_PARTITION, META_PLACEMENT
from qcompiler.ir.tracer import QTracer, trace

# what an expected forward may state of a node, by keyword: the node meta key it sets
META_KEYS = {"partition": META_PARTITION, "placement": META_PLACEMENT}
# the attribute values that describe a module's configuration (a tensor or a submodule is state, and
# None is as often an empty slot for one, as QuantStub's activation_post_process, as a setting)
_PLAIN = (bool, int, float, str, torch.dtype)
# a module's attributes that are its mode, not its structure
_MODE_ATTRS = frozenset({"training"})
# the row of a node one graph lacks
_NO_NODE = (None, {})


def meta(value: Any, **facts: Any) -> Any:
    """In an expected forward: the node that made ``value`` carries ``facts`` (keys of META_KEYS).

    ``x = meta(self.conv(x), partition="bpu0", placement="bpu")``. Returns ``value``, so the
    forward reads as the model's; tracing it records the facts on the node, no node is added.
    """
    for key, fact in facts.items():
        value.node.meta[META_KEYS[key]] = fact
    return value


def in_partitions(*names: str) -> tuple[Callable[[Any], Any], ...]:
    """One marker per partition name: ``bpu0, cpu0 = in_partitions("bpu0", "cpu0")``, then
    ``x = bpu0(self.conv(x))`` states that the conv's node is in partition bpu0 (see :func:`meta`)."""
    return tuple(functools.partial(meta, partition=name) for name in names)


def assert_same_graph(actual: fx.GraphModule, expected: Union[nn.Module, Callable]) -> None:
    """Raise AssertionError naming the first node where ``actual`` differs from ``expected`` traced."""
    want = traced(expected)
    stated = [key for key in META_KEYS.values() if any(key in n.meta for n in want.graph.nodes)]
    rows = itertools.zip_longest(_rows(actual, stated), _rows(want, stated), fillvalue=_NO_NODE)
    for i, (got, exp) in enumerate(rows):
        if got[1] != exp[1]:
            raise AssertionError(_difference(i, got, exp))


def traced(expected: Union[nn.Module, Callable]) -> fx.GraphModule:
    """The graph of ``expected``, traced by qcompiler's tracer as the compiler traces a model (a
    GraphModule is taken as it is)."""
    if isinstance(expected, fx.GraphModule):
        return expected
    if isinstance(expected, nn.Module):  # each module it calls is one node, as in a compiled graph
        return trace(expected, leaf_module_types=(nn.Module,))
    tracer = QTracer()  # a function: fx traces it as the forward of an empty root module
    graph = tracer.trace(expected)
    return fx.GraphModule(tracer.root, graph)


def _rows(gm: fx.GraphModule, stated: list[str]) -> list[tuple[str, dict]]:
    """(name, {field: value}) per node in graph order; every value compares with ``==``."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    return [(node.name, {
        "op": node.op,
        "target": _target(gm, node),
        "args": _value(node.args, position),
        "kwargs": _value(node.kwargs, position),
        **{f"meta {key}": node.meta.get(key) for key in stated},
    }) for node in gm.graph.nodes]


def _target(gm: fx.GraphModule, node: fx.Node) -> Any:
    """What a node calls, by identity or configuration: never by a name torch.fx made up."""
    if node.op == "call_module":
        return (node.target, *_module_key(gm.get_submodule(node.target)))
    if node.op == "get_attr":
        return _constant(_fetch(gm, node.target))
    if node.op in ("placeholder", "output"):
        return node.op  # a placeholder's position is its identity, its name is the forward's
    return node.target  # a function object, or a method name


def _module_key(module: nn.Module) -> tuple:
    """A module's class, its plain configuration attributes and its own parameters' shapes (its
    children are not compared: a prepared layer's quantizers are the prepare pass's own business)."""
    attrs = {k: _value(v, {}) for k, v in sorted(vars(module).items())
             if not k.startswith("_") and k not in _MODE_ATTRS and _is_plain(v)}
    params = {k: tuple(p.shape) for k, p in module.named_parameters(recurse=False)}
    return type(module), attrs, params


def _is_plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or isinstance(v, (tuple, list)) and all(_is_plain(x) for x in v)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class _Ref:
    """An argument that is a node: the node's position in its graph, shown as ``%position``."""

    position: int

    def __repr__(self) -> str:
        return f"%{self.position}"


@dataclasses.dataclass(frozen=True, eq=False)
class _Exact:
    """A constant, equal to another of the same type and value only (1, 1.0 and True differ)."""

    value: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Exact) and type(self.value) is type(other.value) and self.value == other.value

    def __repr__(self) -> str:
        return repr(self.value)


def _value(a: Any, position: dict) -> Any:
    """An argument with each node replaced by its graph position and each constant by its value."""
    if isinstance(a, fx.Node):
        return _Ref(position[a])
    if isinstance(a, (tuple, list)):  # fx's immutable_list is a list
        return (tuple if isinstance(a, tuple) else list)(_value(x, position) for x in a)
    if isinstance(a, dict):
        return {k: _value(v, position) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(*(_value(x, position) for x in (a.start, a.stop, a.step)))
    return _constant(a)


def _constant(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return "tensor", a.dtype, tuple(a.shape), tuple(a.detach().flatten().tolist())
    return _Exact(a)


def _difference(i: int, got: tuple[str, dict], exp: tuple[str, dict]) -> str:
    fields = [f for f in {**got[1], **exp[1]} if got[1].get(f) != exp[1].get(f)]
    lines = [f"graphs differ at node {i} (actual {got[0]!r}, expected {exp[0]!r}) in {', '.join(fields)}:"]
    lines += [f"  {f}: actual {_show(got[1].get(f))}\n  {' ' * len(f)}  expected {_show(exp[1].get(f))}"
              for f in fields]
    return "\n".join(lines)


def _show(value: Any) -> str:
    """A field's value as a reader names it: a function by its module and name."""
    if callable(value) and hasattr(value, "__name__") and not isinstance(value, type):
        return f"{getattr(value, '__module__', None) or 'torch'}.{value.__name__}"
    return repr(value)
