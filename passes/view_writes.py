"""Views read after an in-place write, and writes through views, said with the write's result.

``v = y[:, :4]; y.mul_(2); h(v)``: in eager ``v`` shares ``y``'s memory and ``h`` sees the doubled values.
The graph's ``h(v)`` reads the node ``v``, which keeps the old values once the write runs out of place or
behind a BPU stub (each reader gets its own dequantized copy).  ``v = y[:, :2]; v.clamp_(0, 1); g(y)``:
the write reaches ``y`` through the view.  This pass turns both into data edges, after which the write
has no alias read after it and passes/out_of_place computes it out of place:

* **replay**: a view of the written tensor made before the write and read after it is made again from
  the write's result, right after the write (``v2 = n[:, :4]``, views of views in turn), and its later
  reads read the new one;
* **write-back**: a write into a view ``v = y[index]`` (ints, slices, None, Ellipsis; ``select``,
  ``narrow`` and torch.export's ``aten.slice.Tensor`` said as one) is written back,
  ``s = setitem_(y, index, n)`` right after it; into ``v = y.view(...)`` (``reshape``, ``flatten``,
  ``view_as``, ``reshape_as``, ``squeeze``, ``unsqueeze``, ``contiguous``, ``detach``, and ``float``,
  ``to`` ... where they return their input: same elements in the same order) as
  ``setitem_(y, Ellipsis, n.reshape_as(y))``.  The later reads of ``y`` read ``s``,
  itself a write of ``y``, taken in turn (``y``'s other views, ``y`` a view of something else).

A view here is a value made by one op from the tensor and sharing its storage (shape propagation's
``META_STORAGE``).  A layout write (``transpose_``, ``squeeze_`` ...) changes no values: nothing is
re-made or written back across one.  Other aliases (a view whose inverse is not known, such as a
transpose written into) are left as they were: out_of_place keeps the write in place and convert_fx
warns where a stub splits it.  A write whose storage no node outside its own chain of writes shares is
skipped after one look at the nodes sharing it (``Tensors.has_aliases``, as out_of_place's alias check).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional

import torch
import torch.fx as fx

from qcompiler.ir.inplace import METADATA_WRITES, Tensors
from qcompiler.ir.meta import META_STORAGE, META_TENSOR, META_WRITE_BACK, TensorInfo
from qcompiler.ir.setitem import setitem_
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.shape_prop import TENSOR_META

# views written back whole: the same elements in the same order as their input (the conversions return
# their input itself when they share its storage and dtype, which _written_back_into checks)
_RESHAPES = frozenset({"view", "reshape", "flatten", "view_as", "reshape_as", "squeeze", "unsqueeze",
                       "contiguous", "detach", "float", "double", "half", "bfloat16", "to", "type", "type_as"})


_ATEN_SLICE = torch.ops.aten.slice.Tensor  # torch.export's x[:, 1:], kept as the ATen call


class _Graph(Tensors):
    """The graph's tensors (:class:`~qcompiler.ir.inplace.Tensors`) kept up to date as the pass adds nodes,
    with positions: exact fractions, so any number of insertions in one place keeps them apart."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.at = {n: Fraction(i) for i, n in enumerate(gm.graph.nodes)}

    def rebuild(self) -> None:
        """The tensors read from the graph again (positions kept): after a replay rewired a later write
        into an old view, that write belongs to the new view's tensor."""
        Tensors.__init__(self, self.gm)

    def added(self, anchor: fx.Node, new: fx.Node, writes: Optional[fx.Node] = None) -> None:
        """``new`` was inserted right after ``anchor``; it writes ``writes`` in place, if given."""
        nxt = new.next
        self.at[new] = (self.at[anchor] + self.at[nxt]) / 2 if nxt in self.at else self.at[anchor] + 1
        self.add(new, writes)
        if writes is not None:
            self.members[self.root[new]].sort(key=self.at.__getitem__)


def _tensor(node: fx.Node) -> bool:
    """Is ``node`` one tensor (not a list or tuple, whose storages are its elements')?"""
    return isinstance(node.meta.get(META_TENSOR), TensorInfo)


def _metadata_write(node: fx.Node) -> bool:
    """``transpose_``, ``squeeze_`` ...: a write of the layout, not of the values (see inplace.py)."""
    return node.op == "call_method" and node.target in METADATA_WRITES


def _shares(a: fx.Node, b: fx.Node) -> bool:
    sa, sb = a.meta.get(META_STORAGE), b.meta.get(META_STORAGE)
    return bool(sa and sb and (sa & sb))


class _Tensors:
    """Questions about the tensors of a graph as they are just before position ``at``."""

    def __init__(self, graph: _Graph, at: Fraction) -> None:
        self.graph, self.at = graph, at

    def before(self, v: fx.Node) -> list[fx.Node]:
        """The nodes before ``at`` whose result is the tensor ``v`` is (``v`` and the writes into it)."""
        at = self.graph.at
        return [m for m in self.graph.family(v) if at[m] < self.at]

    def relaid(self, v: fx.Node, after: Fraction) -> bool:
        """Did a layout write (``transpose_`` ...) change the tensor ``v`` is between ``after`` and ``at``?"""
        at = self.graph.at
        return any(_metadata_write(m) and after < at[m] < self.at for m in self.graph.family(v))

    def views(self, v: fx.Node, skip) -> list[fx.Node]:
        """Values made before ``at`` by one op from the tensor ``v`` is (its first argument), sharing its
        storage: views (and ops returning their input); none of ``skip``."""
        at, writes = self.graph.at, self.graph.writes
        return [u for m in self.before(v) for u in m.users
                if at[u] < self.at and u not in skip and u.args and u.args[0] is m and u not in writes
                and u.op in ("call_method", "call_function") and _shares(u, m) and _tensor(u) and _tensor(m)]

    def late_reads(self, v: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
        """``(node, reader)``: reads after ``at`` of the tensor ``v`` is, as it was before ``at``."""
        at = self.graph.at
        return [(m, u) for m in self.before(v) for u in m.users if at[u] > self.at]

    def read_later(self, v: fx.Node, skip) -> bool:
        """Is the tensor ``v`` is, or a view of it (in turn), read after ``at``?"""
        return bool(self.late_reads(v)) or any(self.read_later(w, skip) for w in self.views(v, skip))


def _copy_after(anchor: fx.Node, like: fx.Node, args: tuple, graph: _Graph) -> fx.Node:
    g = graph.gm.graph
    with g.inserting_after(anchor):
        new = g.create_node(like.op, like.target, args, dict(like.kwargs), name=f"{like.name}_after")
    new.meta = dict(like.meta)
    graph.added(anchor, new)
    return new


def _replay(node: fx.Node, graph: _Graph) -> fx.Node:
    """Views of the tensor ``node`` writes, made before it and read after it (they or the writes into
    them), made again from ``node``; returns the last node added (``node`` if none), after which later
    additions go.  Not after a layout write (the old views keep their values), and not for a view made
    before a layout write of the tensor or written in its own layout since (its values are not those
    of the same op on the relaid tensor)."""
    if _metadata_write(node):
        return node
    tensors = _Tensors(graph, graph.at[node])
    family = set(graph.family(node))
    anchor, replaced, moved = node, [], False
    stack = [(v, node) for v in tensors.views(node, family)]
    while stack:
        v, base_now = stack.pop()
        if not tensors.read_later(v, family) or tensors.relaid(node, graph.at[v]) \
                or tensors.relaid(v, graph.at[v] - 1):
            continue
        readers = tensors.late_reads(v)
        children = tensors.views(v, family)
        again = _copy_after(anchor, v, (base_now,) + tuple(v.args[1:]), graph)
        anchor = again
        for old, u in readers:
            u.replace_input_with(old, again)
            moved |= u in graph.writes  # a later write into the view: now into the new one
        stack.extend((w, again) for w in children)
        replaced.append(v)
    for v in reversed(replaced):  # views of views first
        if not v.users:  # every read was late: the old view is dead
            graph.gm.graph.erase_node(v)
    if moved:
        graph.rebuild()
    return anchor


def _basic_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(it is None or it is Ellipsis or (isinstance(it, int) and not isinstance(it, bool))
               or (isinstance(it, slice) and all(b is None or isinstance(b, (int, fx.Node))
                                                 for b in (it.start, it.stop, it.step)))
               for it in items)


def _same_dtype(a: fx.Node, b: fx.Node) -> bool:
    ia, ib = a.meta.get(META_TENSOR), b.meta.get(META_TENSOR)
    return isinstance(ia, TensorInfo) and isinstance(ib, TensorInfo) and ia.dtype == ib.dtype


def _write_back(node: fx.Node, anchor: fx.Node, graph: _Graph) -> Optional[fx.Node]:
    """``setitem_`` of the tensor ``node`` wrote through a view into the view's input (as that input is
    just before ``node``: its last write before, or itself), added after ``anchor`` when that input is
    read after ``node`` (itself, a view of it, or what it is a view of, in turn); the later reads of it
    then read the write-back.  None where nothing is written back: after a layout write, or where one
    came between the view and the write (the view's elements no longer sit where its index says)."""
    if _metadata_write(node):
        return None
    tensors = _Tensors(graph, graph.at[node])
    family = graph.family(node)
    root = family[0]
    source = _written_back_into(root)
    if source is None or tensors.relaid(root, graph.at[root] - 1) or tensors.relaid(source, graph.at[root]):
        return None
    if not _read_later_up(source, tensors, set(family)):
        return None
    base = tensors.before(source)[-1]
    readers = [u for u in base.users if graph.at[u] > tensors.at]
    g = graph.gm.graph
    index = _as_index(root)
    if index is not None:
        value = node
    else:
        with g.inserting_after(anchor):
            value = g.call_method("reshape_as", (node, base))
        value.meta = dict(node.meta)
        value.meta[META_TENSOR] = base.meta.get(META_TENSOR)
        value.meta[META_WRITE_BACK] = node.name  # reads only the base's shape
        graph.added(anchor, value)
        index, anchor = Ellipsis, value
    with g.inserting_after(anchor):
        back = g.call_function(setitem_, (base, index, value))
    back.meta = dict(node.meta)
    back.meta[META_TENSOR] = base.meta.get(META_TENSOR)
    back.meta[META_STORAGE] = base.meta.get(META_STORAGE)
    back.meta[META_WRITE_BACK] = node.name
    graph.added(anchor, back, writes=base)
    for u in readers:
        u.replace_input_with(base, back)
    return back


def _written_back_into(view: fx.Node) -> Optional[fx.Node]:
    """The node a write into ``view`` can be written back into: ``view``'s input, when ``view`` is a
    basic-index getitem or a reshape of it, of one dtype, sharing its storage; else None."""
    if view.op not in ("call_method", "call_function") or not view.args or not isinstance(view.args[0], fx.Node):
        return None
    source = view.args[0]
    if not _shares(view, source) or not _same_dtype(view, source):
        return None
    if _as_index(view) is not None:
        return source
    return source if view.op == "call_method" and view.target in _RESHAPES else None


def _as_index(view: fx.Node):
    """The basic index ``x[index]`` that ``view`` is of its input: a getitem's, or ``select(dim, i)`` /
    ``narrow(dim, start, length)`` said as one (ints, ``start >= 0``); None for any other op."""
    name = view.target if view.op == "call_method" else getattr(view.target, "__name__", "")
    args = view.args
    if name == "getitem" and view.op == "call_function" and len(args) == 2 and _basic_index(args[1]):
        return args[1]
    if view.op == "call_function" and view.target is _ATEN_SLICE:
        return _slice_index(view)
    if view.kwargs or name not in ("select", "narrow") or len(args) != (3 if name == "select" else 4):
        return None
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in args[1:]):
        return None
    info = args[0].meta.get(META_TENSOR)
    if not isinstance(info, TensorInfo) or not -len(info.shape) <= args[1] < len(info.shape):
        return None
    lead = (slice(None),) * (args[1] % len(info.shape))
    if name == "select":
        return lead + (args[2],)
    start, length = args[2], args[3]
    return lead + (slice(start, start + length),) if start >= 0 else None


def _slice_index(view: fx.Node):
    """``aten.slice.Tensor(x, dim, start, end, step)`` (what torch.export records for ``x[:, 1:]``) as the
    basic index ``x[:, start:end:step]``; None unless its arguments are ints (or None) and ``dim`` is one
    of ``x``'s."""
    named = dict(zip(("input", "dim", "start", "end", "step"), view.args), **view.kwargs)
    dim, start, end, step = (named.get(k, d) for k, d in (("dim", 0), ("start", None), ("end", None), ("step", 1)))
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (dim, start, end, step)):
        return None
    info = view.args[0].meta.get(META_TENSOR) if view.args else None
    if dim is None or not isinstance(info, TensorInfo) or not -len(info.shape) <= dim < len(info.shape):
        return None
    return (slice(None),) * (dim % len(info.shape)) + (slice(start, end, step),)


def _read_later_up(source: fx.Node, tensors: _Tensors, family: set) -> bool:
    """Is the tensor ``source`` is read after the write (itself or a view of it), or what it is a view
    of, in turn?"""
    if tensors.read_later(source, family):
        return True
    up = _written_back_into(tensors.graph.family(source)[0])
    return up is not None and _read_later_up(up, tensors, family)


def view_writes(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    graph = _Graph(gm)
    work = list(graph.writes)
    changed = False
    while work:
        node = work.pop(0)
        if node not in graph.writes or not _tensor(graph.writes[node]) or not graph.has_aliases(node):
            continue
        anchor = _replay(node, graph)
        back = _write_back(node, anchor, graph)
        changed |= anchor is not node or back is not None
        if back is not None:
            work.insert(0, back)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


VIEW_WRITES = Pass("view_writes", view_writes, requires=(TENSOR_META,))
