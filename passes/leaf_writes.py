"""An opaque node that writes its input in place gets its own copy, and later reads read what it wrote.

``y = self.c(x); s = self.l(x); return y + s``, ``l`` a leaf (code run as a whole, in eager torch)
doing ``x.mul_(2)``: nothing in the graph said ``l`` writes ``x``, so the partition schedule ran
``l``'s island before the BPU step of ``c`` (which also needs ``s``) and ``c`` read the doubled ``x``,
a wrong answer with no error.  The reference is program order: reads of ``x`` before ``l`` see the old
values, reads after it the written ones.  Shape propagation records which inputs a node wrote
(``META_INPUT_WRITES``: their version counters moved).  For each input ``x`` that an opaque node
(a call whose op the compiler does not know: it runs as Python) writes, unless ``x`` is the node's
alone (no other reader, no alias, not a graph input), this pass

* gives the node a copy, ``x_for_l = x.clone()`` just before it, kept on the CPU beside it; nothing
  but the node and its write below reads the copy, so no schedule lets the write reach another reader;
* where ``x``, or a value sharing its storage, is read after the node: adds the in-place write
  ``x_after_l = leaf_write_(x, x_for_l, l)`` right after it (reading ``l``'s output orders it after
  ``l``), and the later reads of ``x`` read that, as passes/inplace_reads does for an in-place op.
  It is then an ordinary in-place op: passes/view_writes re-makes or writes back the views it
  changes, and passes/out_of_place computes it as ``leaf_write`` (the copy itself).  A node that
  returns the very input it wrote (``x.mul_(2); return x``) is that write itself: the later reads
  read its result, which is then one tensor with ``x`` as in eager torch (a later write of either
  is a write of both).

Readers before the node read ``x``, which nothing writes any more, and readers after it read through
a data edge from it: partitioning needs no anti-dependency edges, any topological order of the
partitions computes what the graph does in order, and the BPU work stays where it was.  The price is
one copy of each written input per call.  A write this cannot copy is warned about, naming the node:
into a parameter or buffer, into a value that is not one tensor, into an input sharing memory with
another input of the node, or by an op the compiler lowers (the BPU or ONNX computes it out of place).
Writes are seen on the example inputs: a write that only other inputs make the node do is not.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch.fx as fx

from qcompiler.errors import PassError, QCompilerWarning
from qcompiler.ir.inplace import (META_INPUT_WRITES, META_RETURNED_INPUT, UNKNOWN_STORAGE, leaf_write, leaf_write_,
                                  mutated_input)
from qcompiler.ir.meta import META_AUTO_LEAF, META_STORAGE, META_TENSOR, TensorInfo
from qcompiler.ir.ops import node_op
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.shape_prop import TENSOR_META


def _what(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return f"module '{node.target}' ({type(gm.get_submodule(node.target)).__name__})"
    return f"function {getattr(node.target, '__name__', node.target)} (node '{node.name}')"


class _Sharing:
    """The nodes by storage key (shape propagation's ``META_STORAGE``) and their order.  Keys are compared
    among values alive at one time only: a freed tensor's storage address may be taken again."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.by_key: dict[int, list[fx.Node]] = {}
        for n in gm.graph.nodes:
            self.add(n)
        self.renumber()

    def add(self, node: fx.Node) -> None:
        for key in node.meta.get(META_STORAGE, ()):
            self.by_key.setdefault(key, []).append(node)

    def renumber(self) -> None:
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)}

    def aliases(self, value: fx.Node, node: fx.Node) -> list[fx.Node]:
        """Values other than ``value`` that may share its storage (unknown storage may be anything) and are
        alive at ``node``: made before it, read by it or after it."""
        order, at = self.order, self.order[node]
        keys = set(value.meta.get(META_STORAGE) or ()) | {UNKNOWN_STORAGE}
        found = {n for k in keys for n in self.by_key.get(k, ())
                 if n is not value and order[n] < at and any(order[u] >= at for u in n.users)}
        return sorted(found, key=order.__getitem__)


def _is_write_of(user: fx.Node, copy: fx.Node, node: fx.Node) -> bool:
    """Is ``user`` this pass's write of what ``node`` wrote into ``copy``?"""
    return user.op == "call_function" and user.target in (leaf_write_, leaf_write) and \
        tuple(user.args[1:3]) == (copy, node)


def _alone(value: fx.Node, node: fx.Node, sharing: _Sharing) -> bool:
    """Is ``value`` the node's alone, so that its write reaches nobody: no graph input, no reader but the
    node (and this pass's write of it), no alias alive at the node?"""
    return value.op != "placeholder" and all(u is node or _is_write_of(u, value, node) for u in value.users) \
        and not sharing.aliases(value, node)


def _cannot_copy(node: fx.Node, value: fx.Node, lowered: bool, sharing: _Sharing) -> Optional[str]:
    """Why the write of ``value`` by ``node`` cannot be given a copy (``lowered``: the compiler knows the
    op and computes it on the BPU or in ONNX), or None."""
    if lowered:
        return "the compiler lowers this op, computing a new value instead"
    if value.op == "get_attr":
        return f"'{value.name}' is the model's state (a parameter or buffer)"
    if not isinstance(value.meta.get(META_TENSOR), TensorInfo):
        return f"'{value.name}' is not one tensor"
    aliases = sharing.aliases(value, node)
    shared = [a.name for a in node.all_input_nodes if a in aliases]
    if shared:
        return f"'{value.name}' shares memory with its input(s) {', '.join(repr(s) for s in shared)}"
    return None


def _insert(gm: fx.GraphModule, where, op: str, target, args: tuple, name: str, like: fx.Node,
            reason: str) -> fx.Node:
    with where:
        new = gm.graph.create_node(op, target, args, {}, name=name)
    new.meta[META_TENSOR] = like.meta.get(META_TENSOR)
    new.meta[META_AUTO_LEAF] = reason  # placement keeps it on the CPU with the node, for this reason
    return new


def _writes(gm: fx.GraphModule):
    """``(node, name)`` for each input (by name) an opaque node wrote while shape propagation ran it
    (the in-place ops the other passes know, ``x.mul_(2)`` or ``ReLU(inplace=True)``, left out)."""
    for node in list(gm.graph.nodes):
        if node.meta.get(META_INPUT_WRITES) and mutated_input(node, gm) is None:
            for name in node.meta[META_INPUT_WRITES]:
                yield node, name


def leaf_writes(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modules = dict(gm.named_modules())
    by_name = {n.name: n for n in gm.graph.nodes}
    sharing = _Sharing(gm)
    now: dict[fx.Node, fx.Node] = {}  # a written value -> what its later reads read now
    changed = False
    for node, name in _writes(gm):
        value = by_name.get(name)
        while value in now:  # the node reads what an earlier write of it was rewired to
            value = now[value]
        if value is None or value not in node.all_input_nodes or _alone(value, node, sharing):
            continue
        why = _cannot_copy(node, value, node_op(node, modules) is not None, sharing)
        if why is not None:
            warnings.warn(f"{_what(node, gm)} changes its input '{value.name}' in place, which the compiler cannot "
                          f"give it a copy of ({why}): other steps of the compiled model may see the write where "
                          f"the model did not, or miss it. Write it out of place (y = x * 2 for x.mul_(2)) or copy "
                          f"the input (self.l(x.clone())).", QCompilerWarning, stacklevel=2)
            continue
        order, at = sharing.order, sharing.order[node]
        later = [u for u in value.users if order[u] > at]
        aliased = any(order[u] > at for n in sharing.aliases(value, node) for u in n.users)
        copy = _insert(gm, gm.graph.inserting_before(node), "call_method", "clone", (value,),
                       f"{value.name}_for_{node.name}", value,
                       f"a copy of '{value.name}' for '{node.name}', which writes it in place: on the CPU with it")
        node.replace_input_with(value, copy)
        changed = True
        returned = node.meta.get(META_RETURNED_INPUT) == name  # ``x.mul_(2); return x``: the node *is* the write
        write = None
        if aliased or (later and not returned):  # views of ``value`` follow the write (view_writes)
            write = _insert(gm, gm.graph.inserting_after(node), "call_function", leaf_write_, (value, copy, node),
                            f"{value.name}_after_{node.name}", value,
                            f"'{value.name}' as '{node.name}' wrote it in place: on the CPU with it")
            write.meta[META_STORAGE] = value.meta.get(META_STORAGE)  # in place: it is ``value``
            sharing.add(write)
        if later:
            now[value] = reader = node if returned else write
            for user in later:
                user.replace_input_with(value, reader)
        sharing.renumber()
    if changed:
        gm.graph.lint()
        gm.recompile()
        propagate_shapes(gm, ctx.example_inputs)  # the copies' storages, and which inputs each node writes now
    return PassResult(gm, changed)


def verify_leaf_writes(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """Every input an opaque node writes is its alone (its copy), or was warned about."""
    modules = dict(gm.named_modules())
    sharing = _Sharing(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for node, name in _writes(gm):
        value = by_name.get(name)
        if value is not None and not _alone(value, node, sharing) \
                and _cannot_copy(node, value, node_op(node, modules) is not None, sharing) is None:
            raise PassError(f"leaf_writes: '{node.name}' writes '{name}', which other nodes read, in place")


LEAF_WRITES = Pass("leaf_writes", leaf_writes, verify_leaf_writes, requires=(TENSOR_META,))
