"""Rewrites that keep work on the BPU: an op the march lacks, said as one it has.

Each rewrite is a row of :data:`REWRITES`: a name, the canonical op (or getitem) it is
rooted at, a ``match`` that returns what the rewrite needs or None to decline, a
``replace`` that edits the graph, and the note that the placement shows as the reason
(``node.meta[META_REWRITE]``). The pass runs the rows to a fixed point before placement,
so the rewritten nodes are placed like any other; its verifier checks that no row still
matches. Every row computes the same float values: bit for bit, except that a conv with the
padding inside may sum its products in another order than torch's conv of the padded input
(float32 rounding, a few ULPs; tests/test_rewrite.py states the tolerance).

* ``F.pad`` with zeros (constant mode, value 0), read by nothing else, before a conv or an
  average pool (counting the padding) whose only caller it is, its input not changed in place
  between the two (the layer would read the changed value): the padding moves into the
  conv / pool when the march's constraints accept the new padding. The sides may differ
  (TF-style "same" padding, ``F.pad(x, (0, 1, 0, 1))`` before a stride-2 conv): the layer then
  holds four sides ``(top, left, bottom, right)`` (``fixed_point.pads4``; the conv with
  ``padding_mode="constant"``, the pool as ``PaddedAvgPool2d``: ``qcompiler.nn.fused``), which
  every later stage reads. Never into a max pool: its padding is -inf, not zeros.
* ``nn.Conv2d(..., padding="same" | "valid")``: the padding as the numbers torch computes
  (``dilation * (kernel - 1)`` per dim, the odd one at the bottom / right: four sides then),
  which every later stage reads.
* a ``view`` / ``reshape`` to sizes read from tensors (``x.view(x.size(0), -1)``, the SE block's
  ``y.view(b, c, 1, 1)`` after ``b, c, _, _ = x.size()``): the numbers the example gives, the
  batch entry as -1, and the size reads removed (a size read is no BPU op; it stopped convert).
  Declined unless every other computed entry is arithmetic on sizes of non-batch dims (the batch
  size in arithmetic, or a size read that equals the batch size, may change with the batch).
* ``x[:, None]`` (only full slices, Nones and an Ellipsis): ``unsqueeze`` calls, which are
  the layout op "reshape" (a BPU op on bayes) instead of an index.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu import op_table
from qcompiler.backends.bpu.op_info import op_info
from qcompiler.errors import PassError
from qcompiler.ir.inplace import mutated_input
from qcompiler.ir.meta import META_OP, META_REWRITE, META_SCOPE, META_TENSOR, TensorInfo
from qcompiler.ir.modules import set_module
from qcompiler.ir.ops import node_op
from qcompiler.nn.fused import ZERO_PADDING_MODES, PaddedAvgPool2d, with_zero_padding
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.quantization.fixed_point import pads4


@dataclass(frozen=True)
class Rewrite:
    """One row: ``match(node, gm, ctx) -> match data or None``; ``replace(node, data, gm) -> new node``."""

    name: str
    root: str
    match: Callable[[fx.Node, fx.GraphModule, CompileContext], Any]
    replace: Callable[[fx.Node, Any, fx.GraphModule], fx.Node]
    note: str


def _root(node: fx.Node, modules: dict) -> Optional[str]:
    if node.op == "call_function" and getattr(node.target, "__name__", None) == "getitem":
        return "getitem"
    return node_op(node, modules) if node.op.startswith("call_") else None


# --------------------------------------------------------------------------- F.pad(0) -> conv / pool padding


def _zero_pad(node: fx.Node) -> Optional[tuple[int, int, int, int]]:
    """``(top, left, bottom, right)`` of ``F.pad(x, (l, r[, t, b]))`` with zeros on a 4-D value; else None."""
    if node.op != "call_function" or len(node.args) < 2 or not isinstance(node.args[1], (list, tuple)):
        return None
    pads = node.args[1]
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
    if mode != "constant" or value not in (None, 0, 0.0) or len(pads) not in (2, 4):
        return None
    if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pads):
        return None
    l, r, *tb = pads
    t, b = tb if tb else (0, 0)
    info = node.args[0].meta.get(META_TENSOR) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(info, TensorInfo) or len(info.shape) != 4:
        return None
    return t, l, b, r


def _padded_layer(user: fx.Node, gm: fx.GraphModule) -> Optional[nn.Module]:
    """The conv / average pool module ``user`` calls, if the padding can move into it."""
    if user.op != "call_module":
        return None
    m = gm.get_submodule(user.target)
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == user.target)
    if calls != 1:
        return None  # a shared module: its other calls are not padded
    if type(m) is nn.Conv2d and m.padding_mode in ZERO_PADDING_MODES and isinstance(m.padding, tuple):
        return m
    if type(m) in (nn.AvgPool2d, PaddedAvgPool2d) and m.count_include_pad and not m.ceil_mode \
            and m.divisor_override is None:
        return m
    return None


def _with_padding(m: nn.Module, pad: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    return tuple(a + b for a, b in zip(pads4(m.padding), pad))


def _march_accepts(user: fx.Node, new: nn.Module, gm: fx.GraphModule, ctx: CompileContext) -> bool:
    """The march's constraints hold for the layer ``new`` in place of ``user``'s, reading the pad's input."""
    if isinstance(new, nn.AvgPool2d):
        k = new.kernel_size if isinstance(new.kernel_size, tuple) else (new.kernel_size, new.kernel_size)
        t, l, b, r = pads4(new.padding)
        if max(t, b) > k[0] // 2 or max(l, r) > k[1] // 2:  # torch: at most half the kernel (either side)
            return False
    modules = {**dict(gm.named_modules()), user.target: new}
    saved = user.args
    user.args = (user.args[0].args[0],) + tuple(user.args[1:])  # the layer reads the unpadded input
    try:
        ok, _ = op_table(ctx.march).check(op_info(user, node_op(user, modules), gm, modules))
    finally:
        user.args = saved
    return ok


def _match_pad(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext):
    pad = _zero_pad(node)
    if pad is None or len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if not user.args or user.args[0] is not node or _changed_between(node.args[0], node, user, gm):
        return None
    m = _padded_layer(user, gm)
    if m is None:
        return None
    new = with_zero_padding(m, _with_padding(m, pad))
    return (user, new) if _march_accepts(user, new, gm, ctx) else None


def _changed_between(value: fx.Node, start: fx.Node, end: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether a node after ``start`` and before ``end`` changes ``value`` in place: the layer would then
    read the changed value where the pad read the old one (``p = F.pad(a); a.mul_(2); conv(p)``)."""
    n = start.next
    while n is not end and n.op != "root":
        if mutated_input(n, gm) is value:
            return True
        n = n.next
    return False


def _replace_pad(node: fx.Node, data, gm: fx.GraphModule) -> fx.Node:
    user, new = data
    set_module(gm, user.target, new)
    user.args = (node.args[0],) + tuple(user.args[1:])
    gm.graph.erase_node(node)
    return user


# --------------------------------------------------------------------------- padding="same" / "valid" -> numbers


def _match_string_padding(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext):
    """``(t, l, b, r)`` of an nn.Conv2d built with ``padding="same"`` or ``"valid"`` (zeros), as torch
    computes it: ``dilation * (kernel - 1)`` per dim, the odd one on the bottom / right."""
    if node.op != "call_module":
        return None
    m = gm.get_submodule(node.target)
    if type(m) is not nn.Conv2d or not isinstance(m.padding, str) or m.padding_mode not in ZERO_PADDING_MODES:
        return None
    if m.padding == "valid":
        return m, (0, 0, 0, 0)
    (dh, dw), (kh, kw) = m.dilation, m.kernel_size
    th, tw = dh * (kh - 1), dw * (kw - 1)
    return m, (th // 2, tw // 2, th - th // 2, tw - tw // 2)


def _replace_string_padding(node: fx.Node, data, gm: fx.GraphModule) -> fx.Node:
    m, pads = data
    set_module(gm, node.target, with_zero_padding(m, pads))
    return node


# --------------------------------------------------------------------------- x.view(x.size(0), -1) -> x.view(-1, n)


def _shape_args(node: fx.Node) -> Optional[tuple[list, Callable[[list], None]]]:
    """The shape entries of ``x.view(...)`` / ``x.reshape(...)`` / ``torch.reshape(x, shape)`` and a
    setter that writes new entries back; None for anything else."""
    if node.op == "call_method" and node.target in ("view", "reshape") and len(node.args) >= 2 and not node.kwargs:
        if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
            return list(node.args[1]), lambda new: setattr(node, "args", (node.args[0], tuple(new)))
        return list(node.args[1:]), lambda new: setattr(node, "args", (node.args[0], *new))
    if node.op == "call_function" and node.target is torch.reshape and len(node.args) == 2 and not node.kwargs \
            and isinstance(node.args[1], (tuple, list)):
        return list(node.args[1]), lambda new: setattr(node, "args", (node.args[0], tuple(new)))
    return None


def _size_of(n: Any) -> Optional[tuple[fx.Node, int]]:
    """``(tensor, dim)`` when ``n`` is ``t.size(d)``, ``t.size()[d]`` or ``t.shape[d]`` (d an int)."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method" and n.target == "size" and len(n.args) == 2 and isinstance(n.args[1], int):
        return n.args[0], n.args[1]
    if n.op == "call_function" and getattr(n.target, "__name__", None) == "getitem" and len(n.args) == 2 \
            and isinstance(n.args[1], int) and isinstance(n.args[0], fx.Node):
        src = n.args[0]
        if (src.op == "call_method" and src.target == "size" and len(src.args) == 1) or \
                (src.op == "call_function" and src.target is getattr and src.args[1:] == ("shape",)):
            return src.args[0], n.args[1]
    return None


_SIZE_ARITH = (operator.mul, operator.add, operator.sub, operator.floordiv)


def _batch_free(n: fx.Node, batch: Optional[int]) -> bool:
    """``n`` is integer arithmetic on size reads of dims other than 0 whose example sizes differ from
    the batch size (so it does not change with the batch: a number may replace it)."""
    src = _size_of(n)
    if src is not None:
        t, d = src
        info = t.meta.get(META_TENSOR) if isinstance(t, fx.Node) else None
        if not isinstance(info, TensorInfo) or not -len(info.shape) <= d < len(info.shape):
            return False
        return d % len(info.shape) != 0 and info.shape[d] != batch
    if n.op == "call_function" and n.target in _SIZE_ARITH and not n.kwargs:
        return all(_batch_free(a, batch) if isinstance(a, fx.Node) else isinstance(a, int) for a in n.args)
    return False


def _example_batch(gm: fx.GraphModule) -> Optional[int]:
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    info = first.meta.get(META_TENSOR) if first is not None else None
    return info.shape[0] if isinstance(info, TensorInfo) and len(info.shape) else None


def _match_dynamic_shape(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext):
    """The new shape of a reshape whose entries are computed from sizes (``x.view(x.size(0), -1)``,
    ``y.view(b, c, 1, 1)`` after ``b, c, _, _ = x.size()``): every entry the number the example
    gives, but the batch entry -1, so only the batch may vary, as for the model's inputs. The batch
    entry is the one read from dim 0 of a tensor whose dim 0 is the example's batch size (a -1
    elsewhere then gets its number), else the one given as -1; no such entry, or more than one:
    declined."""
    found = _shape_args(node)
    info = node.meta.get(META_TENSOR)
    if found is None or not isinstance(info, TensorInfo):
        return None
    entries, _ = found
    if not any(isinstance(e, fx.Node) for e in entries) or len(entries) != len(info.shape):
        return None
    if not all(isinstance(e, (fx.Node, int)) and not isinstance(e, bool) for e in entries):
        return None
    batch = _example_batch(gm)
    from_batch = []
    for i, e in enumerate(entries):
        src = _size_of(e)
        if src is not None and src[1] == 0:
            t = src[0].meta.get(META_TENSOR) if isinstance(src[0], fx.Node) else None
            if isinstance(t, TensorInfo) and len(t.shape) and t.shape[0] == batch and info.shape[i] == batch:
                from_batch.append(i)
    for i, e in enumerate(entries):  # every other computed entry: sizes of non-batch dims only
        if isinstance(e, fx.Node) and i not in from_batch and not _batch_free(e, batch):
            return None
    minus_one = [i for i, e in enumerate(entries) if e == -1 and not isinstance(e, fx.Node)]
    pos = from_batch if from_batch else minus_one
    if len(pos) != 1:
        return None
    new = [int(d) for d in info.shape]
    new[pos[0]] = -1
    return new


def _replace_dynamic_shape(node: fx.Node, new: list, gm: fx.GraphModule) -> fx.Node:
    entries, set_entries = _shape_args(node)
    set_entries(new)
    dead, erased = [e for e in entries if isinstance(e, fx.Node)], set()
    while dead:  # the size reads and the arithmetic on them that nothing else uses
        n = dead.pop()
        if n.op not in ("call_method", "call_function") or n in erased:
            continue
        if all(not u.users and _size_of(u) is not None for u in n.users):  # `b, c, _, _ = x.size()`: the unused _
            for u in list(n.users):
                gm.graph.erase_node(u)
                erased.add(u)
        if not n.users:
            dead.extend(a for a in n.all_input_nodes if a.op in ("call_method", "call_function"))
            gm.graph.erase_node(n)
            erased.add(n)
    return node


# --------------------------------------------------------------------------- x[:, None] -> unsqueeze


def _match_index(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext):
    """The output dims that ``None`` adds, if the index is only full slices, Nones and one Ellipsis."""
    if len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return None
    info = node.args[0].meta.get(META_TENSOR)
    if not isinstance(info, TensorInfo):
        return None
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if None not in idx or sum(i is Ellipsis for i in idx) > 1:
        return None
    if not all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in idx):
        return None
    rank = len(info.shape)
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


def _replace_index(node: fx.Node, dims, gm: fx.GraphModule) -> fx.Node:
    value = node.args[0]
    info = value.meta[META_TENSOR]
    with gm.graph.inserting_before(node):
        for d in dims:  # ascending output dims: each unsqueeze keeps the earlier ones in place
            value = gm.graph.call_method("unsqueeze", (value, d))
            value.meta[META_SCOPE] = node.meta.get(META_SCOPE)
            info = TensorInfo(info.shape[:d] + (1,) + info.shape[d:], info.dtype)
            value.meta[META_TENSOR] = info  # every step has its shape (the emitter reads ranks)
    node.replace_all_uses_with(value)
    gm.graph.erase_node(node)
    return value


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("pad_into_layer", "pad", _match_pad, _replace_pad,
            "F.pad with zeros folded into the padding of the conv / average pool after it"),
    Rewrite("conv_padding_as_numbers", "conv2d", _match_string_padding, _replace_string_padding,
            'conv padding="same" / "valid" written as the numbers torch computes'),
    Rewrite("reshape_sizes_as_numbers", "reshape", _match_dynamic_shape, _replace_dynamic_shape,
            "reshape to sizes read from tensors written as numbers, the batch as -1"),
    Rewrite("index_as_unsqueeze", "getitem", _match_index, _replace_index,
            "x[:, None] indexing rewritten as unsqueeze (a reshape)"),
)
_BY_ROOT: dict[str, list[Rewrite]] = {}
for _row in REWRITES:
    _BY_ROOT.setdefault(_row.root, []).append(_row)


def _first_match(gm: fx.GraphModule, ctx: CompileContext):
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        for row in _BY_ROOT.get(_root(node, modules), ()):
            data = row.match(node, gm, ctx)
            if data is not None:
                return node, row, data
    return None


def rewrite(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    while (found := _first_match(gm, ctx)) is not None:
        node, row, data = found
        new = row.replace(node, data, gm)
        new.meta[META_REWRITE] = row.note
        new.meta.pop(META_OP, None)
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def verify_rewritten(gm: fx.GraphModule, ctx: CompileContext) -> None:
    found = _first_match(gm, ctx)
    if found is not None:
        raise PassError(f"rewrite: row '{found[1].name}' still matches node '{found[0].name}'")


REWRITE = Pass("rewrite", rewrite, verify_rewritten)

__all__ = ["Rewrite", "REWRITES", "REWRITE", "rewrite"]
