"""Patterns over FX nodes, and the worklist that applies rewrites of them.

A pattern states what a rewrite looks for as data, so a rewrite row reads its node in a few
lines instead of parsing arguments by hand (the shape of torch.fx's ``SubgraphMatcher`` and
onnxscript's rewriter patterns, on our canonical ops):

* :class:`Op` matches a call node by its canonical op (:func:`qcompiler.ir.ops.node_op`),
  each named argument by a pattern of its own, and the called module by a :class:`Var`;
* :class:`Var` matches any value, optionally checked by a predicate (``Var()`` is "any");
* :class:`Const` matches a constant (no FX node) that a predicate accepts;
* :class:`AnyOf` matches the first of several op patterns that does.

A pattern with a ``name`` binds what it matched; ``match`` returns the bindings, or None.
Arguments are read by name with :func:`qcompiler.ir.ops.bind`, so a pattern names torch's
parameters whatever the spelling.

:class:`Rewriter` makes a replacement's edits to the graph and keeps the worklist: every node
once in graph order, then again each node an edit touched (changed, created, or whose users
changed), so a driver reaches a fixed point without restarting from the top of the graph.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.modules import set_module
from qcompiler.ir.ops import Binding, bind, node_op

Bindings = dict[str, Any]


def _always(value: Any) -> bool:
    return True


def one_of(*values: Any) -> Callable[[Any], bool]:
    """A predicate: the value equals one of ``values``."""
    return lambda v: v in values


def arguments(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Binding]:
    """``node``'s arguments by name (:func:`~qcompiler.ir.ops.bind`), or None when it calls no known op
    or the call does not fit its op's signature: a pattern declines such a call, it does not fail."""
    try:
        return bind(node, modules)
    except UnsupportedOpError:
        return None


Pattern = Union["Op", "AnyOf", "Var", "Const"]


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


class _Root:
    """A pattern that can be rooted at a node: :meth:`match` gives its bindings there."""

    def match(self, node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Bindings]:
        """The bindings of this pattern rooted at ``node``, or None if it does not match."""
        bindings: Bindings = {}
        return bindings if self.match_into(node, modules, bindings) else None


@dataclass(frozen=True)
class Op(_Root):
    """A call node whose canonical op is ``op``, bound under ``name``: each argument named in ``args``
    matches its pattern, and ``module`` (if given) matches the module a ``call_module`` node calls."""

    op: str
    args: Mapping[str, Pattern] = field(default_factory=dict)
    name: Optional[str] = None
    module: Optional[Var] = None

    @property
    def ops(self) -> frozenset[str]:
        """The canonical ops a node this pattern matches can have."""
        return frozenset({self.op})

    def match_into(self, value: Any, modules: Mapping[str, nn.Module], bindings: Bindings) -> bool:
        if not isinstance(value, fx.Node) or node_op(value, modules) != self.op:
            return False
        if self.module is not None and not (value.op == "call_module"
                                            and self.module.match_into(modules[value.target], modules, bindings)):
            return False
        args = arguments(value, modules) if self.args else {}
        if args is None or not all(k in args and p.match_into(args[k], modules, bindings)
                                   for k, p in self.args.items()):
            return False
        return _bind(bindings, self.name, value)


@dataclass(frozen=True)
class AnyOf(_Root):
    """The first of ``alternatives`` that matches, with its bindings (a spelling that names an argument
    otherwise, a value computed in more than one way)."""

    alternatives: tuple[Op, ...]

    @property
    def ops(self) -> frozenset[str]:
        return frozenset().union(*(p.ops for p in self.alternatives))

    def match_into(self, value: Any, modules: Mapping[str, nn.Module], bindings: Bindings) -> bool:
        for p in self.alternatives:
            trial = dict(bindings)
            if p.match_into(value, modules, trial):
                bindings.update(trial)
                return True
        return False


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


__all__ = ["AnyOf", "Bindings", "Const", "Op", "Pattern", "Rewriter", "Var", "arguments", "one_of"]
