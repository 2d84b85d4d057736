"""Readable, annotated listings of a graph for dumps and golden tests."""

from __future__ import annotations

import torch.fx as fx

from qcompiler.ir.meta import (
    META_OP,
    META_PARTITION,
    META_PLACEMENT,
    META_REASON,
    META_TENSOR,
    format_tensor_info,
)
from qcompiler.ir.ops import describe_target


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, tuple):
        return "(" + ", ".join(_arg(x) for x in a) + ("," if len(a) == 1 else "") + ")"
    if isinstance(a, list):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v)}" for k, v in a.items()) + "}"
    return repr(a)


def _call(args, kwargs) -> str:
    parts = [_arg(a) for a in args] + [f"{k}={_arg(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def node_statement(node: fx.Node, modules: dict) -> str:
    """One node as a Python-like statement: ``conv0 = self.conv0(quant)``."""
    if node.op == "placeholder":
        return f"{node.name} = <input {node.target}>"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    if node.op == "call_module":
        return f"{node.name} = self.{node.target}({_call(node.args, node.kwargs)})"
    if node.op == "call_method":
        obj, *rest = node.args
        return f"{node.name} = {_arg(obj)}.{node.target}({_call(rest, node.kwargs)})"
    return f"{node.name} = {describe_target(node, modules)}({_call(node.args, node.kwargs)})"


def annotation(node: fx.Node) -> str:
    """``[bpu0] conv2d f32[1,3,8,8] -- reason`` for whatever facts the node has."""
    parts = []
    if META_PARTITION in node.meta:
        parts.append(f"[{node.meta[META_PARTITION]}]")
    elif META_PLACEMENT in node.meta:
        parts.append(f"[{node.meta[META_PLACEMENT]}]")
    if node.meta.get(META_OP):
        parts.append(node.meta[META_OP])
    if META_TENSOR in node.meta:
        parts.append(format_tensor_info(node.meta[META_TENSOR]))
    if node.meta.get(META_REASON):
        parts.append(f"-- {node.meta[META_REASON]}")
    return " ".join(parts)


def annotated_code(gm: fx.GraphModule) -> str:
    """The graph as statements, each followed by its placement, op, shape and reason."""
    modules = dict(gm.named_modules())
    rows = [(node_statement(n, modules), annotation(n)) for n in gm.graph.nodes]
    width = min(max((len(s) for s, _ in rows), default=0), 72)
    lines = [f"# {type(gm).__name__}"]
    for stmt, note in rows:
        lines.append(f"{stmt:<{width}}  # {note}" if note else stmt)
    return "\n".join(lines) + "\n"


def forward_sequence(gm: fx.GraphModule) -> list[str]:
    """Names of the call nodes in graph order: what a golden test compares as text."""
    return [n.name for n in gm.graph.nodes if n.op.startswith("call_")]
