"""Patterns over FX nodes, and the worklist that applies rewrites of them.

A pattern states what a rewrite looks for as data, so a rewrite row reads its node in a few
lines instead of parsing arguments by hand (the shape of torch.fx's ``SubgraphMatcher`` and
onnxscript's rewriter patterns, on our canonical ops):

* :class:`Op` matches a call node by its canonical op (:func:`qcompiler.ir.ops.node_op`),
  each named argument by a pattern of its own, and the called module by a :class:`Var`;
* :class:`Var` matches any value, optionally checked by a predicate (``Var()`` is "any");
* :class:`Const` matches a constant (no FX node) that a predicate accepts.

A pattern with a ``name`` binds what it matched; :meth:`Op.match` returns the bindings, or None.
Arguments are read by name with :func:`arguments`, the one reader the patterns use.

:class:`Rewriter` makes a replacement's edits to the graph and keeps the worklist: every node
once in graph order, then again each node an edit touched (changed, created, or whose users
changed), so a driver reaches a fixed point without restarting from the top of the graph.
"""

from __future__ import annotations

import builtins
import inspect
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.ir.modules import set_module
from qcompiler.ir.ops import node_op

Bindings = dict[str, Any]


def _always(value: Any) -> bool:
    return True


def one_of(*values: Any) -> Callable[[Any], bool]:
    """A predicate: the value equals one of ``values``."""
    return lambda v: v in values


# The parameters of each spelling the patterns read (a function, a method name, a module class),
# said as a Python signature. A call that does not bind to its spelling's signature matches no
# pattern that reads arguments. bind() in qcompiler/ir/ops.py replaces this table when it lands.
_SIGNATURES: dict[object, inspect.Signature] = {spelling: inspect.signature(params) for spelling, params in {
    F.pad: lambda input, pad, mode="constant", value=None: None,
    operator.getitem: lambda input, index: None,
    builtins.getattr: lambda input, name: None,
    torch.reshape: lambda input, shape: None,
    "view": lambda input, *shape: None,
    "reshape": lambda input, *shape: None,
    "size": lambda input, dim=None: None,
    nn.Conv2d: lambda input: None,
    nn.AvgPool2d: lambda input: None,
}.items()}


def _signature(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[inspect.Signature]:
    if node.op == "call_module":
        return next((_SIGNATURES[c] for c in type(modules[node.target]).__mro__ if c in _SIGNATURES), None)
    if node.op in ("call_function", "call_method"):
        try:
            return _SIGNATURES.get(node.target)
        except TypeError:  # an unhashable target
            return None
    return None


def arguments(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Bindings]:
    """``node``'s arguments by parameter name, defaults filled in (a method's ``*shape`` given as one
    sequence is that sequence); None when its spelling is not known or the call does not bind."""
    sig = _signature(node, modules)
    if sig is None:
        return None
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    args = dict(bound.arguments)
    if node.op == "call_method" and "shape" in args and len(args["shape"]) == 1 \
            and isinstance(args["shape"][0], (tuple, list)):
        args["shape"] = args["shape"][0]  # x.view((a, b)) is x.view(a, b)
    return args


Pattern = Union["Op", "Var", "Const"]


def _bind(bindings: Bindings, name: Optional[str], value: Any) -> bool:
    """Record ``value`` under ``name``; False if the name is already bound to another value."""
    if name is None:
        return True
    if name in bindings:
        return bindings[name] is value
    bindings[name] = value
    return True


@dataclass(frozen=True)
class Var:
    """Any value (an FX node or a constant) that ``where`` accepts, bound under ``name``."""

    name: Optional[str] = None
    where: Callable[[Any], bool] = _always

    def match_into(self, value: Any, modules: Mapping[str, nn.Module], bindings: Bindings) -> bool:
        return self.where(value) and _bind(bindings, self.name, value)


@dataclass(frozen=True)
class Const:
    """A constant argument (no FX node) that ``where`` accepts, bound under ``name``."""

    where: Callable[[Any], bool]
    name: Optional[str] = None

    def match_into(self, value: Any, modules: Mapping[str, nn.Module], bindings: Bindings) -> bool:
        return not isinstance(value, fx.Node) and self.where(value) and _bind(bindings, self.name, value)


@dataclass(frozen=True)
class Op:
    """A call node whose canonical op is ``op``, bound under ``name``: each argument named in ``args``
    matches its pattern, and ``module`` (if given) matches the module a ``call_module`` node calls."""

    op: str
    args: Mapping[str, Pattern] = field(default_factory=dict)
    name: Optional[str] = None
    module: Optional[Var] = None

    def match(self, node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Bindings]:
        """The bindings of this pattern rooted at ``node``, or None if it does not match."""
        bindings: Bindings = {}
        return bindings if self.match_into(node, modules, bindings) else None

    def match_into(self, value: Any, modules: Mapping[str, nn.Module], bindings: Bindings) -> bool:
        if not isinstance(value, fx.Node) or node_op(value, modules) != self.op:
            return False
        if self.module is not None and not (value.op == "call_module"
                                            and self.module.match_into(modules[value.target], modules, bindings)):
            return False
        args = arguments(value, modules) if self.args else {}
        if args is None or not all(p.match_into(args[k], modules, bindings) for k, p in self.args.items()):
            return False
        return _bind(bindings, self.name, value)


def first_match(patterns: Iterable[Op], node: Any, modules: Mapping[str, nn.Module]) -> Optional[Bindings]:
    """The bindings of the first of ``patterns`` that matches ``node``, or None."""
    if not isinstance(node, fx.Node):
        return None
    return next((b for p in patterns if (b := p.match(node, modules)) is not None), None)


class Rewriter:
    """The graph edits of rewrites, and the worklist they feed.

    The worklist starts as every node in graph order and visits each once; a node an edit touches
    is queued again (at the back, unless it is still waiting), so a rewrite that enables another
    is seen without a restart. Edits must go through here: :meth:`touched` for a node changed or
    created, :meth:`erase` and :meth:`set_module` for the rest.
    """

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.modules: dict[str, nn.Module] = dict(gm.named_modules())
        self._queue: deque[fx.Node] = deque(gm.graph.nodes)
        self._waiting: set[fx.Node] = set(self._queue)
        self._erased: set[fx.Node] = set()

    def next(self) -> Optional[fx.Node]:
        """The next node to visit, or None when the worklist is empty."""
        while self._queue:
            node = self._queue.popleft()
            self._waiting.discard(node)
            if node not in self._erased:
                return node
        return None

    def _queue_again(self, nodes: Iterable[fx.Node]) -> None:
        for n in nodes:
            if n not in self._waiting and n not in self._erased:
                self._queue.append(n)
                self._waiting.add(n)

    def touched(self, *nodes: fx.Node) -> None:
        """``nodes`` were changed or created: visit them, their users and their inputs again (a rewrite
        rooted at an input may now match: its users changed)."""
        for n in nodes:
            self._queue_again((n, *n.users, *n.all_input_nodes))

    def erase(self, node: fx.Node) -> None:
        """Erase ``node`` (it has no users) and visit its inputs again: their users changed."""
        inputs = node.all_input_nodes
        self.gm.graph.erase_node(node)
        self._erased.add(node)
        self._queue_again(inputs)

    def set_module(self, target: str, module: nn.Module) -> None:
        """Install ``module`` at ``target``, keeping :attr:`modules` current."""
        set_module(self.gm, target, module)
        self.modules[target] = module


__all__ = ["Bindings", "Const", "Op", "Pattern", "Rewriter", "Var", "arguments", "first_match", "one_of"]
