"""Rewrites that keep work on the BPU: an op the march lacks, said as one it has.

Each rewrite is a row of :data:`REWRITES`: a name, a pattern rooted at a canonical op
(:mod:`qcompiler.ir.pattern`), a ``condition`` on the pattern's bindings that returns what
the rewrite needs or None to decline, a ``replace`` that edits the graph, and the note that
the placement shows as the reason (``node.meta[META_REWRITE]``). The pass runs the rows
to a fixed point before placement, so the rewritten nodes are placed like any other: one
worklist visits every node once, then the nodes each rewrite touched. Its verifier checks
that no row still matches. Every row computes the same float values: bit for bit, except
that a conv with the padding inside may sum its products in another order than torch's conv
of the padded input (float32 rounding, a few ULPs; tests/test_rewrite.py states the tolerance).

* ``F.pad`` with zeros (constant mode, value 0), read by nothing else, before a conv or an
  average pool (counting the padding) whose only caller it is, its input not changed in place
  between the two (the layer would read the changed value): the padding moves into the
  conv / pool when the march's constraints accept the new padding. The sides may differ
  (TF-style "same" padding, ``F.pad(x, (0, 1, 0, 1))`` before a stride-2 conv): the layer then
  holds four sides ``(top, left, bottom, right)`` (``fixed_point.pads4``; the conv with
  ``padding_mode="constant"``, the pool as ``PaddedAvgPool2d``: ``qcompiler.nn.fused``), which
  every later stage reads. Never into a max pool: its padding is -inf, not zeros.
* ``F.pad`` / ``torch.constant_pad_nd`` by zero sizes, in any mode (transformers' Swin pads to a
  multiple of its window unconditionally): a copy of its input, which its readers then read (exact;
  no march runs a pad). Declined where a write in place reaches the input or the copy (their
  storages, from shape propagation), and where the pad is a graph output.
* ``nn.Conv2d(..., padding="same" | "valid")``: the padding as the numbers torch computes
  (``dilation * (kernel - 1)`` per dim, the odd one at the bottom / right: four sides then),
  which every later stage reads.
* a ``view`` / ``reshape`` to sizes read from tensors (``x.view(x.size(0), -1)``, the SE block's
  ``y.view(b, c, 1, 1)`` after ``b, c, _, _ = x.size()``): the numbers the example gives, the
  batch entry as -1, and the size reads removed (a size read is no BPU op; it stopped convert).
  Declined unless every other computed entry is arithmetic on sizes of non-batch dims (the batch
  size in arithmetic, or a size read that equals the batch size, may change with the batch).
* ``x.reshape(t.shape[:k])`` (a leading slice of a shape, transformers' EfficientNet pooler): the
  numbers the example gives, the batch as -1, where ``t``'s dim 0 is the batch and no other size
  equals it.
* an ``nn.AvgPool2d`` without padding or divisor whose one window covers the map (output 1x1, the
  kernel at least the input's size: ``AvgPool2d(hidden_dim, ceil_mode=True)``): the global average
  pool (``nn.AdaptiveAvgPool2d(1)``), which the BPU runs; the same mean of H * W values, equal to
  float32 rounding (tests/test_rewrite_pooler.py: 1e-6).
* ``x[:, None]`` (only full slices, Nones and an Ellipsis): ``unsqueeze`` calls, which are
  the layout op "reshape" (a BPU op on bayes) instead of an index.
* ``x / c`` (``torch.div``, ``Tensor.div``, ``torch.true_divide``) by a finite non-zero Python number
  without a rounding mode, where the march refuses that div and accepts a mul by a number (nash:
  attention's ``/ sqrt(d)``): ``x * (1 / c)``. Not bit for bit: ``1 / c`` is rounded once more, so
  the two differ by at most 1 ULP of ``x / c`` (tests/test_div_by_constant.py); declined for a ``c``
  or ``1 / c`` outside float32's normal range, where that bound would not hold.
* ``x.masked_fill(mask, v)`` / ``torch.where(mask, x, y)`` with a constant boolean mask (a buffer or a
  folded constant: transformers' attention mask of a model without padding) that selects one operand
  everywhere: that operand, exact; declined where the mask broadcasts the operand to a larger shape.
* ``AdaptiveAvgPool1d(1)`` / ``F.adaptive_avg_pool1d(x, 1)`` (Swin's pooler), where the march refuses
  the pool and runs the mean: ``x.mean(-1, keepdim=True)``, equal to float32 rounding
  (tests/test_pool1d_as_mean.py: 1e-6).
"""

from __future__ import annotations

import math
import operator
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu import op_table
from qcompiler.backends.bpu.op_info import op_info
from qcompiler.errors import PassError
from qcompiler.ir.inplace import META_INPUT_WRITES, mutated_input, schema_writes
from qcompiler.ir.meta import META_OP, META_REWRITE, META_SCOPE, META_STORAGE, META_TENSOR, TensorInfo
from qcompiler.ir.ops import node_op
from qcompiler.ir.ops.names import (ADAPTIVE_AVG_POOL1D, AVG_POOL2D, CONV2D, DIV, GETITEM, MASKED_FILL, MEAN, MUL,
                                    RESHAPE, SELECT, SPLIT, WHERE)
from qcompiler.ir.pattern import AnyOf, Bindings, Const, Op, Rewriter, Var, arguments, one_of
from qcompiler.nn.fused import ZERO_PADDING_MODES, PaddedAvgPool2d, with_zero_padding
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.shape_prop import TENSOR_META
from qcompiler.quantization.fixed_point import pads4


@dataclass(frozen=True)
class Match:
    """Where a row's pattern matched: its bindings (``match["name"]``), the graph module, its modules by
    name and the compile context (None when a test asks a row alone)."""

    bindings: Bindings
    gm: fx.GraphModule
    modules: Mapping[str, nn.Module]
    ctx: Optional[CompileContext]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]


@dataclass(frozen=True)
class Rewrite:
    """One row: ``pattern`` rooted at a canonical op; ``condition(match)`` returns what the replacement needs,
    or None to decline; ``replace(match, data, rewriter)`` edits the graph through ``rewriter`` and returns
    the node that carries ``note``."""

    name: str
    pattern: Union[Op, AnyOf]
    condition: Callable[[Match], Any]
    replace: Callable[[Match, Any, Rewriter], fx.Node]
    note: str

    def _match(self, node: fx.Node, gm: fx.GraphModule, ctx: Optional[CompileContext],
               modules: Mapping[str, nn.Module]) -> Optional[tuple[Match, Any]]:
        bindings = self.pattern.match(node, modules)
        if bindings is None:
            return None
        found = Match(bindings, gm, modules, ctx)
        data = self.condition(found)
        return None if data is None else (found, data)

    def match(self, node: fx.Node, gm: fx.GraphModule, ctx: Optional[CompileContext],
              modules: Optional[Mapping[str, nn.Module]] = None) -> Any:
        """What the replacement needs if this row rewrites ``node``, else None."""
        found = self._match(node, gm, ctx, dict(gm.named_modules()) if modules is None else modules)
        return None if found is None else found[1]

    def apply(self, node: fx.Node, gm: fx.GraphModule, ctx: CompileContext, rewriter: Rewriter) -> bool:
        """Rewrite ``node`` if this row matches it (its note on the result, the nodes it touched queued
        again); whether it did."""
        found = self._match(node, gm, ctx, rewriter.modules)
        if found is None:
            return False
        new = self.replace(*found, rewriter)
        new.meta[META_REWRITE] = self.note
        new.meta.pop(META_OP, None)
        rewriter.touched(new)
        return True


def _tensor_info(value: Any) -> Optional[TensorInfo]:
    info = value.meta.get(META_TENSOR) if isinstance(value, fx.Node) else None
    return info if isinstance(info, TensorInfo) else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------- F.pad(0) -> conv / pool padding


def _is_4d(value: Any) -> bool:
    info = _tensor_info(value)
    return info is not None and len(info.shape) == 4


def _foldable_pads(pads: Any) -> bool:
    """F.pad's ``(l, r)`` or ``(l, r, t, b)`` as ints >= 0: the sides a 2-D layer's padding can take."""
    return isinstance(pads, (list, tuple)) and len(pads) in (2, 4) and all(_is_int(p) and p >= 0 for p in pads)


# F.pad(x, pads) with zeros on a 4-D value
ZERO_PAD = Op("pad", {"input": Var("x", _is_4d), "pad": Const(_foldable_pads, "pads"),
                      "mode": Const(one_of("constant")), "value": Const(one_of(None, 0, 0.0))}, name="pad")


def _padded_layer(user: fx.Node, gm: fx.GraphModule) -> Optional[nn.Module]:
    """The conv / average pool module ``user`` calls, if the padding can move into it."""
    if user.op != "call_module":
        return None
    m = gm.get_submodule(user.target)
    if len(gm.graph.find_nodes(op="call_module", target=user.target)) != 1:
        return None  # a shared module: its other calls are not padded
    if type(m) is nn.Conv2d and m.padding_mode in ZERO_PADDING_MODES and isinstance(m.padding, tuple):
        return m
    if type(m) in (nn.AvgPool2d, PaddedAvgPool2d) and m.count_include_pad and not m.ceil_mode \
            and m.divisor_override is None:
        return m
    return None


def _march_accepts(user: fx.Node, new: nn.Module, found: Match) -> bool:
    """The march's constraints hold for the layer ``new`` in place of ``user``'s, reading the pad's input."""
    if isinstance(new, nn.AvgPool2d):
        k = new.kernel_size if isinstance(new.kernel_size, tuple) else (new.kernel_size, new.kernel_size)
        t, l, b, r = pads4(new.padding)
        if max(t, b) > k[0] // 2 or max(l, r) > k[1] // 2:  # torch: at most half the kernel (either side)
            return False
    modules = ChainMap({user.target: new}, found.modules)
    saved = user.args, user.kwargs
    user.replace_input_with(found["pad"], found["x"])  # the layer reads the unpadded input
    try:
        ok, _ = op_table(found.ctx.march).check(op_info(user, node_op(user, modules), modules))
    finally:
        user.args, user.kwargs = saved
    return ok


def _changed_between(value: fx.Node, start: fx.Node, end: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether a node after ``start`` and before ``end`` changes ``value`` in place: the layer would then
    read the changed value where the pad read the old one (``p = F.pad(a); a.mul_(2); conv(p)``)."""
    n = start.next
    while n is not end and n.op != "root":
        if mutated_input(n, gm) is value:
            return True
        n = n.next
    return False


def _fold_pad(found: Match) -> Optional[tuple[fx.Node, nn.Module]]:
    """The pad's only user and its layer with the padding inside, if the pad is that layer's input, the
    input is not changed in place in between, and the march accepts the new padding."""
    pad = found["pad"]
    if len(pad.users) != 1:
        return None
    user = next(iter(pad.users))
    args = arguments(user, found.modules)
    if args is None or args["input"] is not pad or _changed_between(found["x"], pad, user, found.gm):
        return None
    m = _padded_layer(user, found.gm)
    if m is None:
        return None
    l, r, *tb = found["pads"]
    t, b = tb if tb else (0, 0)
    new = with_zero_padding(m, tuple(a + p for a, p in zip(pads4(m.padding), (t, l, b, r))))
    return (user, new) if _march_accepts(user, new, found) else None


def _replace_pad(found: Match, data: tuple[fx.Node, nn.Module], rewriter: Rewriter) -> fx.Node:
    user, new = data
    rewriter.set_module(user.target, new)
    user.replace_input_with(found["pad"], found["x"])
    rewriter.erase(found["pad"])
    return user


# --------------------------------------------------------------------------- F.pad by zero sizes -> its input


def _zero_pads(pads: Any) -> bool:
    return isinstance(pads, (list, tuple)) and len(pads) > 0 and all(_is_int(p) and p == 0 for p in pads)


# F.pad(x, (0, 0, ...)) in any mode (transformers' Swin pads to a multiple of its window unconditionally),
# torch.constant_pad_nd(x, (0, ...))
NO_PAD = AnyOf((Op("pad", {"input": Var("x", lambda v: _tensor_info(v) is not None), "pad": Const(_zero_pads)},
                   name="pad"),
                Op("constant_pad_nd", {"input": Var("x", lambda v: _tensor_info(v) is not None),
                                       "pad": Const(_zero_pads)}, name="pad")))


def _written_storages(gm: fx.GraphModule) -> Optional[set]:
    """The storages some node of ``gm`` changes in place (a named in-place op, an ATen write, an opaque
    node seen writing its input); None when one of the written values has no recorded storage."""
    out: set = set()
    for n in gm.graph.nodes:
        written = [mutated_input(n, gm), *schema_writes(n)]
        names = n.meta.get(META_INPUT_WRITES) or ()
        written += [a for a in n.all_input_nodes if a.name in names]
        for value in filter(None, written):
            keys = value.meta.get(META_STORAGE)
            if not keys:
                return None
            out |= set(keys)
    return out


def _unpadded_input(found: Match) -> Optional[fx.Node]:
    """The pad's input, which its readers can take instead: the pad of zero sizes copies it, so only
    where no write in place reaches either (the copy would have kept the two apart) and the pad is no
    graph output (which would then alias the input)."""
    pad, x = found["pad"], found["x"]
    if _tensor_info(pad) != _tensor_info(x) or any(u.op == "output" for u in pad.users):
        return None
    keys = [pad.meta.get(META_STORAGE), x.meta.get(META_STORAGE)]
    written = _written_storages(found.gm)
    if written is None or not all(keys) or written & (set(keys[0]) | set(keys[1])):
        return None
    return x


def _replace_by_input(found: Match, x: fx.Node, rewriter: Rewriter) -> fx.Node:
    pad = found["pad"]
    users = list(pad.users)
    pad.replace_all_uses_with(x)
    rewriter.erase(pad)
    rewriter.touched(*users)
    return x


# --------------------------------------------------------------------------- padding="same" / "valid" -> numbers


def _string_padded(m: nn.Module) -> bool:
    return type(m) is nn.Conv2d and isinstance(m.padding, str) and m.padding_mode in ZERO_PADDING_MODES


# an nn.Conv2d built with padding="same" or "valid" (zeros)
STRING_PADDED_CONV = Op(CONV2D, name="node", module=Var("conv", _string_padded))


def _torch_padding(found: Match) -> tuple[int, int, int, int]:
    """``(t, l, b, r)`` of the conv's string padding as torch computes it: ``dilation * (kernel - 1)``
    per dim, the odd one on the bottom / right."""
    m = found["conv"]
    if m.padding == "valid":
        return 0, 0, 0, 0
    (dh, dw), (kh, kw) = m.dilation, m.kernel_size
    th, tw = dh * (kh - 1), dw * (kw - 1)
    return th // 2, tw // 2, th - th // 2, tw - tw // 2


def _replace_string_padding(found: Match, pads: tuple[int, int, int, int], rewriter: Rewriter) -> fx.Node:
    rewriter.set_module(found["node"].target, with_zero_padding(found["conv"], pads))
    return found["node"]


# --------------------------------------------------------------------------- x.view(x.size(0), -1) -> x.view(-1, n)


_DIM = Const(lambda d: isinstance(d, int), "d")
SIZE_READ = AnyOf((  # the tensor t and dim d of a size read
    Op("size", {"input": Var("t"), "dim": _DIM}),  # t.size(d)
    Op(GETITEM, {"input": Op("size", {"input": Var("t"), "dim": Const(one_of(None))}), "index": _DIM}),  # t.size()[d]
    Op(GETITEM, {"input": Op("getattr", {"input": Var("t"), "name": Const(one_of("shape"))}),
                 "index": _DIM}),  # t.shape[d]
))


def _size_of(n: Any, modules: Mapping[str, nn.Module]) -> Optional[tuple[Any, int]]:
    """``(tensor, dim)`` when ``n`` is ``t.size(d)``, ``t.size()[d]`` or ``t.shape[d]`` (d an int)."""
    b = SIZE_READ.match(n, modules)
    return None if b is None else (b["t"], b["d"])


_SIZE_ARITH = (operator.mul, operator.add, operator.sub, operator.floordiv)


def _batch_free(n: fx.Node, batch: Optional[int], modules: Mapping[str, nn.Module]) -> bool:
    """``n`` is integer arithmetic on size reads of dims other than 0 whose example sizes differ from
    the batch size (so it does not change with the batch: a number may replace it)."""
    src = _size_of(n, modules)
    if src is not None:
        t, d = src
        info = _tensor_info(t)
        if info is None or not -len(info.shape) <= d < len(info.shape):
            return False
        return d % len(info.shape) != 0 and info.shape[d] != batch
    if n.op == "call_function" and n.target in _SIZE_ARITH and not n.kwargs:
        return all(_batch_free(a, batch, modules) if isinstance(a, fx.Node) else isinstance(a, int) for a in n.args)
    return False


def _example_batch(gm: fx.GraphModule) -> Optional[int]:
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    info = _tensor_info(first)
    return info.shape[0] if info is not None and len(info.shape) else None


def _computed_shape(entries: Any) -> bool:
    """Shape entries that are ints and at least one value computed in the graph."""
    return isinstance(entries, (tuple, list)) and any(isinstance(e, fx.Node) for e in entries) \
        and all(isinstance(e, fx.Node) or _is_int(e) for e in entries)


# x.reshape(...) / torch.reshape(x, shape), and x.view(...) (whose entries torch names size), to entries
# computed in the graph
SIZED_RESHAPE = AnyOf(tuple(Op(RESHAPE, {"input": Var("x"), entries: Var("shape", _computed_shape)}, name="node")
                            for entries in ("shape", "size")))


def _shape_as_numbers(found: Match) -> Optional[list[int]]:
    """The new shape of a reshape whose entries are computed from sizes (``x.view(x.size(0), -1)``,
    ``y.view(b, c, 1, 1)`` after ``b, c, _, _ = x.size()``): every entry the number the example
    gives, but the batch entry -1, so only the batch may vary, as for the model's inputs. The batch
    entry is the one read from dim 0 of a tensor whose dim 0 is the example's batch size (a -1
    elsewhere then gets its number), else the one given as -1; no such entry, or more than one:
    declined."""
    entries, info = list(found["shape"]), _tensor_info(found["node"])
    if info is None or len(entries) != len(info.shape):
        return None
    batch = _example_batch(found.gm)
    from_batch = []
    for i, e in enumerate(entries):
        src = _size_of(e, found.modules)
        if src is not None and src[1] == 0:
            t = _tensor_info(src[0])
            if t is not None and len(t.shape) and t.shape[0] == batch and info.shape[i] == batch:
                from_batch.append(i)
    for i, e in enumerate(entries):  # every other computed entry: sizes of non-batch dims only
        if isinstance(e, fx.Node) and i not in from_batch and not _batch_free(e, batch, found.modules):
            return None
    minus_one = [i for i, e in enumerate(entries) if e == -1 and not isinstance(e, fx.Node)]
    pos = from_batch if from_batch else minus_one
    if len(pos) != 1:
        return None
    new = [int(d) for d in info.shape]
    new[pos[0]] = -1
    return new


def _replace_sizes(found: Match, new: list[int], rewriter: Rewriter) -> fx.Node:
    node = found["node"]
    spread = node.op == "call_method" and not isinstance(node.args[1], (tuple, list))  # x.view(a, b)
    node.kwargs = {}
    node.args = (found["x"], *new) if spread else (found["x"], tuple(new))
    dead, erased = [e for e in found["shape"] if isinstance(e, fx.Node)], set()
    while dead:  # the size reads and the arithmetic on them that nothing else uses
        n = dead.pop()
        if n.op not in ("call_method", "call_function") or n in erased:
            continue
        if all(not u.users and _size_of(u, rewriter.modules) is not None for u in n.users):
            for u in list(n.users):  # `b, c, _, _ = x.size()`: the unused _
                rewriter.erase(u)
                erased.add(u)
        if not n.users:
            dead.extend(a for a in n.all_input_nodes if a.op in ("call_method", "call_function"))
            rewriter.erase(n)
            erased.add(n)
    return node


def _leading(index: Any) -> bool:
    return isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1)


# t.shape[:k]
_SHAPE_SLICE = Op(GETITEM, {"input": Op("getattr", {"input": Var("t"), "name": Const(one_of("shape"))}),
                            "index": Const(_leading, "index")}, name="sliced")
# x.reshape(t.shape[:k]) (transformers' EfficientNet pooler: pooled.reshape(pooled.shape[:2])); a method's
# one shape argument binds as the 1-tuple of it
SHAPE_SLICE_RESHAPE = AnyOf(tuple(Op(RESHAPE, {"input": Var("x"), entries: Var("shape")}, name="node")
                                  for entries in ("shape", "size")))


def _shape_slice_as_numbers(found: Match) -> Optional[tuple[list[int], fx.Node]]:
    """The numbers of a reshape to the leading sizes of a tensor whose dim 0 is the example's batch:
    the batch as -1, the other sizes (non-batch dims) as the example gives them; and the slice node."""
    shape = found["shape"]
    shape = shape[0] if isinstance(shape, (tuple, list)) and len(shape) == 1 else shape
    inner = _SHAPE_SLICE.match(shape, found.modules) if isinstance(shape, fx.Node) else None
    if inner is None:
        return None
    t, info, batch = _tensor_info(inner["t"]), _tensor_info(found["node"]), _example_batch(found.gm)
    if t is None or info is None or not len(info.shape) or batch is None:
        return None
    if t.shape[0] != batch or info.shape[0] != batch or any(d == batch for d in info.shape[1:]):
        return None  # (a size equal to the batch elsewhere may be the batch: declined)
    return [-1] + [int(d) for d in info.shape[1:]], shape


def _replace_shape_slice(found: Match, data: tuple[list[int], fx.Node], rewriter: Rewriter) -> fx.Node:
    node, (new, sliced) = found["node"], data
    node.kwargs = {}
    node.args = (found["x"], tuple(new))
    for n in (sliced, sliced.args[0]):  # the slice, then the shape read, where nothing else reads them
        if not n.users:
            rewriter.erase(n)
    return node


# --------------------------------------------------------------------------- x[:, None] -> unsqueeze


def _as_tuple(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _unsqueezing(index: Any) -> bool:
    """Only full slices, Nones (at least one) and at most one Ellipsis."""
    idx = _as_tuple(index)
    return None in idx and sum(i is Ellipsis for i in idx) <= 1 \
        and all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in idx)


# x[index] with an index of full slices, Nones and an Ellipsis
NONE_INDEX = Op(GETITEM, {"input": Var("x", lambda v: _tensor_info(v) is not None),
                          "index": Const(_unsqueezing, "index")}, name="node")


def _unsqueezed_dims(found: Match) -> Optional[list[int]]:
    """The output dims that ``None`` adds, if the slices do not outnumber the input's dims."""
    idx, rank = _as_tuple(found["index"]), len(_tensor_info(found["x"]).shape)
    covered = sum(isinstance(i, slice) for i in idx)
    if covered > rank:
        return None
    dims, out = [], 0
    for i in idx:
        if i is None:
            dims.append(out)
            out += 1
        elif i is Ellipsis:
            out += rank - covered
        else:
            out += 1
    return dims


def _replace_index(found: Match, dims: list[int], rewriter: Rewriter) -> fx.Node:
    node, value = found["node"], found["x"]
    info = value.meta[META_TENSOR]
    with found.gm.graph.inserting_before(node):
        for d in dims:  # ascending output dims: each unsqueeze keeps the earlier ones in place
            value = found.gm.graph.call_method("unsqueeze", (value, d))
            value.meta[META_SCOPE] = node.meta.get(META_SCOPE)
            info = TensorInfo(info.shape[:d] + (1,) + info.shape[d:], info.dtype)
            value.meta[META_TENSOR] = info  # every step has its shape (the emitter reads ranks)
            rewriter.touched(value)
    node.replace_all_uses_with(value)
    rewriter.erase(node)
    return value


# --------------------------------------------------------------------------- a pool over the whole map -> global


def _plain_avg_pool(m: nn.Module) -> bool:
    return type(m) is nn.AvgPool2d and m.divisor_override is None and m.padding in (0, (0, 0))


# an nn.AvgPool2d without padding (transformers' EfficientNet pooler: AvgPool2d(hidden_dim, ceil_mode=True))
WHOLE_MAP_POOL = Op(AVG_POOL2D, {"input": Var("x", _is_4d)}, name="node", module=Var("pool", _plain_avg_pool))


def _whole_map(found: Match) -> Optional[bool]:
    """True where the pool's one window covers the whole map: its output is 1x1 and its kernel is at
    least the input's size, so each output is the mean of all H * W inputs (no padding counted)."""
    info, out = _tensor_info(found["x"]), _tensor_info(found["node"])
    if info is None or out is None or len(out.shape) != 4 or tuple(out.shape[2:]) != (1, 1):
        return None
    k = found["pool"].kernel_size
    kh, kw = (k, k) if isinstance(k, int) else k
    return True if kh >= info.shape[2] and kw >= info.shape[3] else None


def _replace_whole_map(found: Match, _: bool, rewriter: Rewriter) -> fx.Node:
    rewriter.set_module(found["node"].target, nn.AdaptiveAvgPool2d(1))
    return found["node"]


# --------------------------------------------------------------------------- x / c -> x * (1 / c)

_F32_NORMAL = (2.0 ** -126, 2.0 ** 126)  # c and 1 / c both normal float32 numbers


def _divisor(c: Any) -> bool:
    """A Python number (no bool) whose reciprocal is exact to 1 ULP: finite, non-zero, c and 1 / c normal
    float32 numbers."""
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c) or c == 0:
        return False
    return _F32_NORMAL[0] <= abs(c) <= _F32_NORMAL[1]


def _float_tensor(v: Any) -> bool:
    """A float32 / float64 tensor (the 1-ULP bound is stated, and tested, for those)."""
    info = _tensor_info(v)
    return info is not None and info.dtype in ("f32", "f64")


# x / c, torch.div(x, c), x.div(c), torch.true_divide(x, c) on a float32 / float64 tensor x
DIV_BY_NUMBER = Op(DIV, {"input": Var("x", _float_tensor), "other": Const(_divisor, "c")}, name="node")


def _mul_by_reciprocal(found: Match) -> Optional[float]:
    """:func:`reciprocal` of ``c`` where the div has no rounding mode and the march refuses it but runs the mul (the rows
    ask the march: on one where div by a number runs, nothing changes)."""
    node = found["node"]
    args = arguments(node, found.modules)
    if args is None or args.get("rounding_mode") is not None or found.ctx is None:
        return None
    table = op_table(found.ctx.march)
    if not table.supports(MUL) or table.check(op_info(node, DIV, found.modules))[0]:
        return None
    if not table.check(op_info(node, MUL, found.modules))[0]:
        return None
    return reciprocal(found["c"], _tensor_info(found["x"]).dtype)


def reciprocal(c: float, dtype: str) -> float:
    """``1 / c`` as the tensor's float type rounds it: torch divides ``x`` by ``c`` rounded to that type,
    so the reciprocal of that number, rounded once, keeps ``x * (1 / c)`` within 1 ULP of ``x / c``
    (the reciprocal of the float64 ``c`` rounded to float32 reaches 2 ULPs)."""
    t = torch.float32 if dtype == "f32" else torch.float64
    return float(torch.tensor(1.0, dtype=t) / torch.tensor(c, dtype=t))


def _replace_div(found: Match, r: float, rewriter: Rewriter) -> fx.Node:
    node = found["node"]
    node.op, node.target = "call_function", operator.mul
    node.args, node.kwargs = (found["x"], r), {}
    return node


# --------------------------------------------------------------------------- a constant mask that selects nothing

def _constant_tensor(gm: fx.GraphModule, value: Any) -> Optional[torch.Tensor]:
    """The tensor a ``get_attr`` node reads (a folded constant, a buffer), or None."""
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    owner, _, attr = value.target.rpartition(".")
    try:
        t = getattr(gm.get_submodule(owner), attr)
    except AttributeError:
        return None
    return t if isinstance(t, torch.Tensor) else None


# x.masked_fill(mask, v) / torch.where(cond, x, y) with a constant mask or condition
UNIFORM_MASK = AnyOf((Op(MASKED_FILL, {"input": Var("x"), "mask": Var("mask")}, name="node"),
                     Op(WHERE, {"condition": Var("mask"), "input": Var("x"), "other": Var("y")}, name="node")))


def _selected_operand(found: Match) -> Optional[fx.Node]:
    """The operand the op returns unchanged where its constant boolean mask is uniform: a masked_fill
    whose mask has no True entry returns its input (the attention mask of a model without padding,
    folded to a constant by capture); ``where`` with an all-True / all-False condition returns its
    input / other. Only where that operand already has the output's shape and dtype (no broadcast)."""
    mask = _constant_tensor(found.gm, found["mask"])
    if mask is None or mask.dtype != torch.bool or mask.numel() == 0:
        return None
    node = found["node"]
    if node_op(node, found.modules) == MASKED_FILL:
        kept = found["x"] if not bool(mask.any()) else None
    else:
        kept = found["x"] if bool(mask.all()) else found["y"] if not bool(mask.any()) else None
    info, out = _tensor_info(kept), _tensor_info(node)
    return kept if info is not None and out is not None and info == out else None


def _replace_by_operand(found: Match, kept: fx.Node, rewriter: Rewriter) -> fx.Node:
    node = found["node"]
    node.replace_all_uses_with(kept)
    rewriter.erase(node)
    return kept


# --------------------------------------------------------------------------- a global 1-d average pool -> mean

GLOBAL_POOL1D = Op(ADAPTIVE_AVG_POOL1D, {"input": Var("x", lambda v: _tensor_info(v) is not None)}, name="node")


def _pool1d_as_mean(found: Match) -> Optional[bool]:
    """True where an ``adaptive_avg_pool1d`` to size 1 (Swin's pooler over the tokens) can be the mean over
    the last dim that the march runs (nash: a reduction over any dims) and the pool itself cannot."""
    node = found["node"]
    module = found.modules.get(node.target) if node.op == "call_module" else None
    size = module.output_size if module is not None else (arguments(node, found.modules) or {}).get("output_size")
    if size not in (1, (1,), [1]) or found.ctx is None:
        return None
    table = op_table(found.ctx.march)
    if table.check(op_info(node, ADAPTIVE_AVG_POOL1D, found.modules))[0]:
        return None
    saved = node.op, node.target, node.args, node.kwargs
    node.op, node.target, node.args, node.kwargs = "call_function", torch.mean, (found["x"], -1, True), {}
    try:
        ok, _ = table.check(op_info(node, MEAN, found.modules))
    finally:
        node.op, node.target, node.args, node.kwargs = saved
    return True if ok else None


def _replace_pool1d(found: Match, _: bool, rewriter: Rewriter) -> fx.Node:
    node = found["node"]
    node.op, node.target, node.args, node.kwargs = "call_function", torch.mean, (found["x"], -1, True), {}
    return node


# --------------------------------------------------------------------------- max(x, dim)[0] -> amax(x, dim)

# torch.max(x, dim) / x.max(dim) / min: a (values, indices) pair, read below by getitem or attribute
MAX_MIN_PAIR = AnyOf((Op("max", name="pair"), Op("min", name="pair")))


def _pair_reads(user: fx.Node) -> Optional[str]:
    """"values" / "indices" where ``user`` reads that half of the pair (``[0]``, ``.values`` ...), else None."""
    if user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2:
        return {0: "values", 1: "indices"}.get(user.args[1]) if _is_int(user.args[1]) else None
    if user.op == "call_function" and user.target is getattr and len(user.args) == 2:
        return user.args[1] if user.args[1] in ("values", "indices") else None
    return None


def _values_only(found: Match) -> Optional[tuple[fx.Node, int, bool, list[fx.Node]]]:
    """``(x, dim, keepdim, values readers)`` of a max / min along a constant dim whose indices nothing reads
    (an unused ``_`` of ``v, _ = x.max(1)`` is no reader), where the march runs amax / amin."""
    pair = found["pair"]
    args, kwargs = list(pair.args), dict(pair.kwargs)
    if not args or not isinstance(args[0], fx.Node) or _tensor_info(args[0]) is None:
        return None
    rest = args[1:] + [kwargs.pop(k) for k in ("dim", "keepdim") if k in kwargs]
    if kwargs or not 1 <= len(rest) <= 2 or not _is_int(rest[0]):
        return None  # torch.max(x) (all values), torch.max(x, other), out=...
    keepdim = rest[1] if len(rest) == 2 else False
    if not isinstance(keepdim, bool):
        return None
    reads = [(u, _pair_reads(u)) for u in pair.users]
    if any(r is None or (r == "indices" and u.users) for u, r in reads):
        return None
    values = [u for u, r in reads if r == "values"]
    amax = "amax" if node_op(pair, found.modules) == "max" else "amin"
    if not values or found.ctx is None or not op_table(found.ctx.march).supports(amax):
        return None
    return args[0], rest[0], keepdim, values


def _replace_pair(found: Match, data: tuple, rewriter: Rewriter) -> fx.Node:
    pair = found["pair"]
    x, dim, keepdim, values = data
    fn = torch.amax if node_op(pair, rewriter.modules) == "max" else torch.amin
    with found.gm.graph.inserting_before(pair):
        new = found.gm.graph.call_function(fn, (x, dim, keepdim))
    new.meta[META_SCOPE] = pair.meta.get(META_SCOPE)
    new.meta[META_TENSOR] = values[0].meta.get(META_TENSOR)
    for v in values:
        v.replace_all_uses_with(new)
    for u in list(pair.users):
        rewriter.erase(u)
    rewriter.erase(pair)
    return new


# --------------------------------------------------------------------------- select / split as indexing

def _dim(d: Any, rank: int) -> Optional[int]:
    return d % rank if _is_int(d) and -rank <= d < rank else None


def _march_prefers(found: Match, op: str, target: Any, args: tuple) -> bool:
    """The march refuses ``found["node"]`` as it is and accepts it rewritten as ``target(*args)`` (op ``op``)."""
    node = found["node"]
    table = op_table(found.ctx.march)
    if table.check(op_info(node, node_op(node, found.modules), found.modules))[0]:
        return False
    saved = node.op, node.target, node.args, node.kwargs
    node.op, node.target, node.args, node.kwargs = "call_function", target, args, {}
    try:
        return table.check(op_info(node, op, found.modules))[0]
    finally:
        node.op, node.target, node.args, node.kwargs = saved


SELECT_CALL = Op(SELECT, {"input": Var("x", lambda v: _tensor_info(v) is not None)}, name="node")


def _select_index(found: Match) -> Optional[tuple]:
    """``x.select(d, i)`` (transformers' class-token read-out ``hidden[:, 0]`` as torch.export writes it) is
    ``x[:, ..., i]`` with ``d`` full slices first: the constant index the march's getitem takes."""
    args = arguments(found["node"], found.modules)
    rank = len(_tensor_info(found["x"]).shape)
    d = _dim(args.get("dim"), rank) if args else None
    if d is None or not _is_int(args.get("index")) or found.ctx is None:
        return None
    index = (slice(None),) * d + (args["index"],)
    return index if _march_prefers(found, GETITEM, operator.getitem, (found["x"], index)) else None


def _replace_select(found: Match, index: tuple, rewriter: Rewriter) -> fx.Node:
    node = found["node"]
    node.op, node.target, node.args, node.kwargs = "call_function", operator.getitem, (found["x"], index), {}
    return node


SPLIT_CALL = Op(SPLIT, {}, name="node")  # the input is "tensor" in torch.split, "input" in the others


def _split_pieces(found: Match) -> Optional[tuple[int, list[tuple[int, int]]]]:
    """``(dim, [(start, length), ...])`` of a split / chunk whose every user takes one piece by a constant
    index (``q, k, v = x.split(d, 2)``): each piece is then ``x.narrow(dim, start, length)``, the same
    values. The pieces are torch's own (the call run on a meta tensor of the input's shape)."""
    node = found["node"]
    x = node.args[0] if node.args else None
    args = arguments(node, found.modules)
    info = _tensor_info(x)
    if args is None or info is None or found.ctx is None or not node.users \
            or not all(u.target is operator.getitem and _is_int(u.args[1]) for u in node.users):
        return None
    d = _dim(args.get("dim", 0), len(info.shape))
    if d is None:
        return None
    meta = torch.empty(info.shape, device="meta")
    rest = [a for a in node.args[1:]]
    try:
        pieces = (getattr(meta, node.target)(*rest, **node.kwargs) if node.op == "call_method"
                  else node.target(meta, *rest, **node.kwargs))
    except Exception:  # noqa: BLE001 -- a call torch refuses is left to fail where it is run
        return None
    lengths = [p.shape[d] for p in pieces]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    first = next(iter(node.users))
    ok = _march_prefers(found, "narrow", torch.narrow, (x, d, starts[first.args[1]], lengths[first.args[1]]))
    return (d, list(zip(starts, lengths))) if ok else None


def _replace_split(found: Match, plan: tuple[int, list[tuple[int, int]]], rewriter: Rewriter) -> fx.Node:
    node = found["node"]
    x = node.args[0]
    d, pieces = plan
    users = list(node.users)
    for user in users:
        start, length = pieces[user.args[1]]
        user.op, user.target, user.args, user.kwargs = "call_function", torch.narrow, (x, d, start, length), {}
        user.meta.pop(META_OP, None)
        rewriter.touched(user)
    rewriter.erase(node)
    return users[0]


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("pad_into_layer", ZERO_PAD, _fold_pad, _replace_pad,
            "F.pad with zeros folded into the padding of the conv / average pool after it"),
    Rewrite("zero_pad_removed", NO_PAD, _unpadded_input, _replace_by_input,
            "F.pad / constant_pad_nd by zero sizes (a copy) removed: its readers read its input"),
    Rewrite("conv_padding_as_numbers", STRING_PADDED_CONV, _torch_padding, _replace_string_padding,
            'conv padding="same" / "valid" written as the numbers torch computes'),
    Rewrite("reshape_sizes_as_numbers", SIZED_RESHAPE, _shape_as_numbers, _replace_sizes,
            "reshape to sizes read from tensors written as numbers, the batch as -1"),
    Rewrite("reshape_shape_slice_as_numbers", SHAPE_SLICE_RESHAPE, _shape_slice_as_numbers, _replace_shape_slice,
            "reshape to a slice of a tensor's shape written as numbers, the batch as -1"),
    Rewrite("index_as_unsqueeze", NONE_INDEX, _unsqueezed_dims, _replace_index,
            "x[:, None] indexing rewritten as unsqueeze (a reshape)"),
    Rewrite("whole_map_pool_as_global", WHOLE_MAP_POOL, _whole_map, _replace_whole_map,
            "an average pool whose one window covers the map rewritten as the global average pool"),
    Rewrite("div_by_number_as_mul", DIV_BY_NUMBER, _mul_by_reciprocal, _replace_div,
            "x / c by a number rewritten as x * (1 / c) (within 1 ULP), a mul the march runs"),
    Rewrite("max_values_as_amax", MAX_MIN_PAIR, _values_only, _replace_pair,
            "max / min along a dim whose indices are unused rewritten as amax / amin (the same values)"),
    Rewrite("uniform_constant_mask_removed", UNIFORM_MASK, _selected_operand, _replace_by_operand,
            "masked_fill / where with a constant mask that selects one operand everywhere removed"),
    Rewrite("global_pool1d_as_mean", GLOBAL_POOL1D, _pool1d_as_mean, _replace_pool1d,
            "adaptive_avg_pool1d to size 1 rewritten as the mean over the last dim (float32 rounding)"),
    Rewrite("select_as_index", SELECT_CALL, _select_index, _replace_select,
            "x.select(d, i) rewritten as the constant index x[:, ..., i]"),
    Rewrite("split_as_narrow", SPLIT_CALL, _split_pieces, _replace_split,
            "split / chunk read piece by piece rewritten as one narrow per piece"),
)
_BY_ROOT: dict[str, list[Rewrite]] = {}
for _row in REWRITES:
    for _op in sorted(_row.pattern.ops):
        _BY_ROOT.setdefault(_op, []).append(_row)


def rows_for(node: fx.Node, modules: Mapping[str, nn.Module]) -> list[Rewrite]:
    """The rows rooted at ``node``'s canonical op, in :data:`REWRITES` order."""
    return _BY_ROOT.get(node_op(node, modules), [])


def rewrite(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Every node once in graph order, each rewritten by the first row that matches it, then the nodes
    the rewrites touched, until none is left: a fixed point in work linear in the graph."""
    rewriter = Rewriter(gm)
    modified = False
    while (node := rewriter.next()) is not None:
        modified |= any(row.apply(node, gm, ctx, rewriter) for row in rows_for(node, rewriter.modules))
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def verify_rewritten(gm: fx.GraphModule, ctx: CompileContext) -> None:
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        for row in rows_for(node, modules):
            if row.match(node, gm, ctx, modules) is not None:
                raise PassError(f"rewrite: row '{row.name}' still matches node '{node.name}'")


REWRITE = Pass("rewrite", rewrite, verify_rewritten, requires=(TENSOR_META,))

__all__ = ["Match", "Rewrite", "REWRITES", "REWRITE", "rewrite", "rows_for"]
