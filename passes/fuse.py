"""The fuse pass: conv / conv-transpose / linear with a following BN, residual add
and ReLU become one fused module (``qcompiler.nn.fused``), BN folded into the weights.

Why: the BPU runs such a chain as one op, so it must be quantized as one op
(no observer on the values inside it), and BN is not a deployed op at all.

The patterns are the data table ``PATTERNS`` below.  A row is a base op followed
by an optional BN, an add (required if the row says so) and an optional
activation.  For each base node, in graph order, the rows for its op are tried
in table order and the first that covers at least two nodes is fused; within a
row the optional parts are taken greedily.  A pattern fires only if

* the base is an ``nn.Conv2d`` / ``nn.ConvTranspose2d`` / ``nn.Linear`` module (exact
  class, no hooks) called by exactly one node, not read by ``get_attr`` nodes, and
  not inside a module that a node calls or reads as a whole;
* every value inside it has exactly one user, the next node of the pattern;
  identity nodes in between (an exact ``nn.Identity`` module without hooks,
  ``x.contiguous()``) are looked through and erased with the pattern: what
  torch.ao's ``fuse_modules`` leaves in place of a BN or ReLU
  it folded, or a BN a user replaced by ``nn.Identity``, must not leave a conv
  unfused (its output would be quantized before its ReLU);
* all its nodes have the same placement (``META_PLACEMENT``; missing == missing);
* the BN is an ``nn.BatchNorm2d/1d`` module with running statistics (folded with
  eval semantics whatever its training flag; a linear's BN only on a 2-D output);
* the add has exactly two tensor operands of the same shape, and the operand not
  coming from the base does not itself depend on the base (no cycle).

* no in-place op (``inplace=True``, ``x.op_()``) changes the base's input between
  the base and the add, where the fused node will read it (best effort: views of
  the input are not followed).

The fused module replaces the base module at the base's path; the base node is
re-targeted and keeps its name and meta, plus ``META_FUSED_FROM`` and ``META_OP``
(``META_TENSOR`` comes from the last pattern node).  It stays where the base was,
or, with an add, moves to where the add was: both operands exist there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import PassError
from qcompiler.ir.meta import META_FUSED_FROM, META_OP, META_PLACEMENT, META_TENSOR, shape
from qcompiler.ir.ops import node_op
from qcompiler.nn.fused import FusedModule, build_fused
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.place import PLACEMENT


@dataclass(frozen=True)
class FusionPattern:
    """One table row: ``base (+bn) [+add] (+act)``; bn/act optional, add required iff ``add``."""

    base: str
    bn: Optional[str]
    add: bool
    acts: tuple[str, ...]

    def __str__(self) -> str:
        parts = [self.base]
        if self.bn:
            parts.append(f"(+{self.bn})")
        if self.add:
            parts.append("+add")
        if self.acts:
            parts.append(f"(+{'|'.join(self.acts)})")
        return "".join(parts)


# Tried in order for each base node; a row with a required add comes before the
# same base without it.
PATTERNS: tuple[FusionPattern, ...] = (
    #             base                bn              add    activations
    FusionPattern("conv2d",           "batch_norm",   True,  ("relu",)),
    FusionPattern("conv2d",           "batch_norm",   False, ("relu", "relu6")),
    FusionPattern("conv_transpose2d", "batch_norm",   False, ("relu",)),
    FusionPattern("linear",           "batch_norm1d", False, ("relu",)),
)

# The module classes each op must be (exactly: subclasses may change forward) when
# it is a base or a BN.  Activations may also be functional (F.relu, torch.relu,
# .relu(), F.relu6): any call_function / call_method whose canonical op matches.
BASE_MODULES: dict[str, type] = {
    "conv2d": nn.Conv2d,
    "conv_transpose2d": nn.ConvTranspose2d,
    "linear": nn.Linear,
}
BN_MODULES: dict[str, type] = {"batch_norm": nn.BatchNorm2d, "batch_norm1d": nn.BatchNorm1d}
# nn.Hardtanh is "relu6" only with bounds (0, 6) (qcompiler.ir.ops.clamp_op)
ACT_MODULES: dict[str, tuple[type, ...]] = {"relu": (nn.ReLU,), "relu6": (nn.ReLU6, nn.Hardtanh)}


@dataclass
class _Match:
    pattern: FusionPattern
    nodes: list[fx.Node]  # pattern order: base, [bn], [add], [act]
    base_module: nn.Module
    bn_module: Optional[nn.Module] = None
    add_node: Optional[fx.Node] = None
    other: Optional[fx.Node] = None  # the add's operand that does not come from the base
    act: Optional[str] = None
    identities: list[fx.Node] = field(default_factory=list)  # looked through; erased with the pattern


class _Matcher:
    """Finds patterns in one graph; call ``moved`` after re-positioning a node."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.modules = dict(gm.named_modules())
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        # how many nodes call or read each module path or something under it, and the
        # exact targets: a base must be used by its node only, and no enclosing module
        # may be called or read as a whole (it would see the fused module)
        self.refs: dict[str, int] = {}
        self.targets: set[str] = set()
        for n in gm.graph.nodes:
            if n.op in ("call_module", "get_attr"):
                self.targets.add(n.target)
                parts = n.target.split(".")
                for i in range(1, len(parts) + 1):
                    key = ".".join(parts[:i])
                    self.refs[key] = self.refs.get(key, 0) + 1

    def moved(self, node: fx.Node, to: fx.Node) -> None:
        self.order[node] = self.order[to]

    def match(self, node: fx.Node) -> Optional[_Match]:
        if node.op != "call_module":
            return None
        module = self.modules.get(node.target)
        op = node_op(node, self.modules) if module is not None else None
        if op not in BASE_MODULES or type(module) is not BASE_MODULES[op] or _has_hooks(module):
            return None
        if self.refs.get(node.target, 0) != 1 or node.kwargs or len(node.args) != 1:
            return None
        parts = node.target.split(".")
        if any(".".join(parts[:i]) in self.targets for i in range(1, len(parts))):
            return None
        if not isinstance(node.args[0], fx.Node):
            return None
        for pattern in PATTERNS:
            if pattern.base == op:
                found = self._match_row(pattern, node, module)
                if found is not None:
                    return found
        return None

    def _match_row(self, pattern: FusionPattern, base: fx.Node, module: nn.Module) -> Optional[_Match]:
        m = _Match(pattern, [base], module)
        where = base.meta.get(META_PLACEMENT)
        cur = base
        if pattern.bn is not None:
            nxt, value, skipped = self._next_through_identities(cur, where)
            bn = self._bn_module(nxt, value, pattern.bn, base, module) if nxt is not None else None
            if bn is not None:
                m.nodes.append(nxt)
                m.identities += skipped
                m.bn_module = bn
                cur = nxt
        if pattern.add:
            nxt, value, skipped = self._next_through_identities(cur, where)
            other = self._add_other(nxt, value, base) if nxt is not None else None
            if other is None:
                return None
            m.nodes.append(nxt)
            m.identities += skipped
            m.add_node, m.other = nxt, other
            cur = nxt
        if pattern.acts:
            nxt, value, skipped = self._next_through_identities(cur, where)
            act = self._act(nxt, value, pattern.acts) if nxt is not None else None
            if act is not None:
                m.nodes.append(nxt)
                m.identities += skipped
                m.act = act
        return m if len(m.nodes) > 1 else None

    def _next_through_identities(
        self, node: fx.Node, where: Optional[str]
    ) -> tuple[Optional[fx.Node], fx.Node, list[fx.Node]]:
        """The next pattern candidate after ``node``, the value it reads, and the identities skipped.

        The candidate is ``node``'s only user, looking through identity nodes;
        every node on the way must have one user and ``node``'s placement.
        """
        skipped: list[fx.Node] = []
        value = node
        while True:
            user = _next(value, where)
            if user is None or not self._is_identity(user, value):
                return user, value, skipped
            skipped.append(user)
            value = user

    def _is_identity(self, node: fx.Node, value: fx.Node) -> bool:
        """True if ``node`` returns ``value`` itself: an exact ``nn.Identity`` without hooks, ``.contiguous()``."""
        if node.args != (value,) or node.kwargs:
            return False
        if node.op == "call_module":
            module = self.modules.get(node.target)
            return type(module) is nn.Identity and not _has_hooks(module)
        return node.op == "call_method" and node.target == "contiguous"

    def _bn_module(
        self, node: fx.Node, value: fx.Node, bn_op: str, base: fx.Node, base_module: nn.Module
    ) -> Optional[nn.Module]:
        """The BN module ``node`` applies to ``value``, if it can be folded into the base."""
        if node.op != "call_module" or node.args != (value,) or node.kwargs:
            return None
        bn = self.modules.get(node.target)
        if type(bn) is not BN_MODULES[bn_op] or _has_hooks(bn):
            return None
        if bn.running_mean is None or bn.running_var is None:
            return None  # track_running_stats=False: batch statistics even in eval, not foldable
        if isinstance(base_module, (nn.Conv2d, nn.ConvTranspose2d)):
            out_features = base_module.out_channels
        else:
            out_features = base_module.out_features
            out_shape = shape(base)
            if out_shape is None or len(out_shape) != 2:
                return None  # BatchNorm1d normalizes dim 1, the linear's features only on (N, C)
        return bn if bn.num_features == out_features else None

    def _add_other(self, node: fx.Node, value: fx.Node, base: fx.Node) -> Optional[fx.Node]:
        """The second operand if ``node`` is a two-tensor add of ``value`` that can be fused."""
        if node.op not in ("call_function", "call_method") or node_op(node, self.modules) != "add":
            return None
        if node.kwargs or len(node.args) != 2 or list(node.args).count(value) != 1:
            return None
        other = node.args[1] if node.args[0] is value else node.args[0]
        if not isinstance(other, fx.Node):
            return None  # x + scalar/constant is not a residual add
        s_value, s_other = shape(value), shape(other)
        if s_value is not None and s_other is not None and s_value != s_other:
            return None  # broadcasting add, not an element-wise residual
        if self._depends_on(other, base):
            return None  # fusing would make the fused node an input of itself
        if self._mutated_between(base.args[0], base, node):
            return None  # the base would read its input after an in-place op changed it
        return other

    def _act(self, node: fx.Node, value: fx.Node, acts: tuple[str, ...]) -> Optional[str]:
        """The activation op name if ``node`` applies one of ``acts`` to ``value`` alone."""
        op = node_op(node, self.modules)
        if op not in acts or node.all_input_nodes != [value]:
            return None
        if node.op == "call_module":
            module = self.modules[node.target]
            if type(module) not in ACT_MODULES[op] or _has_hooks(module) or node.args != (value,):
                return None
            return op
        first = node.args[0] if node.args else node.kwargs.get("input")
        return op if first is value else None

    def _mutated_between(self, value: fx.Node, start: fx.Node, end: fx.Node) -> bool:
        """True if a user of ``value`` strictly between ``start`` and ``end`` may change it in place.

        Best effort (aliases through views are not followed): ``inplace=True``
        functions and modules, and ``x.op_()`` methods.
        """
        lo, hi = self.order[start], self.order[end]
        for user in value.users:
            if not lo < self.order.get(user, lo) < hi:
                continue
            first = user.args[0] if user.args else user.kwargs.get("input")
            if first is not value:
                continue
            if user.kwargs.get("inplace") is True:
                return True
            if user.op == "call_method" and user.target.endswith("_") and not user.target.endswith("__"):
                return True
            if user.op == "call_module" and getattr(self.modules.get(user.target), "inplace", False):
                return True
            if user.op == "call_function" and getattr(user.target, "__name__", "").endswith("_"):
                return True
        return False

    def _depends_on(self, node: fx.Node, base: fx.Node) -> bool:
        """True if ``node`` is ``base`` or computed from it (walks inputs, pruned by graph order)."""
        limit = self.order[base]
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n is base:
                return True
            if n in seen or self.order.get(n, limit + 1) <= limit:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return False


def _next(node: fx.Node, where: Optional[str]) -> Optional[fx.Node]:
    """The only user of ``node`` if it has the same placement, else None."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    return user if user.meta.get(META_PLACEMENT) == where else None


def _has_hooks(module: nn.Module) -> bool:
    """Hooks would see different values (or none) once the module is fused."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


# meta keys describing a node's value: the fused node takes them from the last pattern node
_VALUE_META = (META_TENSOR, "tensor_meta", "val", "example_value")


def _rewrite(gm: fx.GraphModule, m: _Match, matcher: _Matcher) -> None:
    base, last = m.nodes[0], m.nodes[-1]
    fused = build_fused(m.base_module, bn=m.bn_module, act=m.act, with_add=m.other is not None)
    parent, _, name = base.target.rpartition(".")
    setattr(gm.get_submodule(parent), name, fused)
    matcher.modules[base.target] = fused

    names = tuple(n.name for n in m.nodes)
    x = base.args[0]
    if m.add_node is not None:
        # With an add the fused node sits where the add was: both operands exist there
        # and it reads the second operand at the same point as before.
        m.add_node.prepend(base)
        matcher.moved(base, m.add_node)
        base.args = (x, m.other)
    # Without one it stays where the base was; the rest of the chain only read its values.
    for key in _VALUE_META:
        if key in last.meta:
            base.meta[key] = last.meta[key]
        else:
            base.meta.pop(key, None)
    base.meta[META_FUSED_FROM] = names
    base.meta[META_OP] = m.pattern.base
    last.replace_all_uses_with(base)
    for n in sorted(m.nodes[1:] + m.identities, key=matcher.order.__getitem__, reverse=True):
        gm.graph.erase_node(n)


def fuse(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Fuse every pattern of ``PATTERNS`` in ``gm`` (in graph order) into a fused module."""
    matcher = _Matcher(gm)
    modified = False
    for node in list(gm.graph.nodes):
        if node not in matcher.order:
            continue  # erased as part of an earlier pattern
        m = matcher.match(node)
        if m is None:
            continue
        _rewrite(gm, m, matcher)
        for n in m.nodes[1:] + m.identities:
            del matcher.order[n]
        modified = True
    if modified:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return PassResult(gm, modified)


def verify_fuse(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """Every fused node is a FusedModule call with META_FUSED_FROM, and no pattern is left."""
    matcher = _Matcher(gm)
    for node in gm.graph.nodes:
        module: Any = matcher.modules.get(node.target) if node.op == "call_module" else None
        names = node.meta.get(META_FUSED_FROM)
        if isinstance(module, FusedModule):
            if not names or len(names) != len(module.fused_from):
                raise PassError(
                    f"fuse: node '{node.name}' calls {type(module).__name__}({module.extra_repr()}) "
                    f"but its {META_FUSED_FROM} is {names!r}"
                )
            if node.meta.get(META_OP) != module.qc_op:
                raise PassError(f"fuse: fused node '{node.name}' has {META_OP}={node.meta.get(META_OP)!r}")
        elif names is not None:
            raise PassError(f"fuse: node '{node.name}' has {META_FUSED_FROM}={names!r} but calls no fused module")
        m = matcher.match(node)
        if m is not None:
            raise PassError(
                f"fuse: pattern {m.pattern} was left unfused at nodes "
                f"{', '.join(n.name for n in m.nodes)}"
            )


FUSE = Pass("fuse", fuse, verify=verify_fuse, requires=(PLACEMENT,))
