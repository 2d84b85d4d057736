"""Fold what depends only on parameters, buffers and constants into one constant buffer.

Swin's relative-position bias (``table[index].view(N, N, -1).permute(2, 0, 1)``, in torchvision a
``torch.fx.wrap``'ed function), a positional embedding's ``pos_embed[:, :n]``: computed from the
model's own tensors alone, such a subgraph is the same on every call, yet placed it becomes CPU
work with no input (an eager-torch island when a function has no ONNX form). It is evaluated once
here, with the very torch calls of the graph (so the constant is bit-exact), and each of its
values read by the rest of the graph becomes a ``get_attr`` of a new buffer ``qc_folded_<node>``
(a Python number or tuple, e.g. a size read, becomes a literal argument). Dead nodes go.

A value is constant when every input is: a ``get_attr`` of a tensor, a literal, a call with no
inputs (``torch.arange(7)``). Not constant, so never folded:

* anything that reads a graph input;
* in training mode (QAT; the module owning the tensor has ``training`` set), a parameter that
  requires grad (its value changes with each step), and the buffers a module updates by itself
  (batch norm's running statistics: ops tagged ``TRAINING``; observers and fake quants);
* a value the graph changes in place (``self.buf.add_(1)``), with everything it was made from;
* a call drawing random numbers (its name has ``rand``, ``normal``, ``bernoulli``, ``dropout``
  ...), or any call that gives other values when run again or writes into its inputs (each
  subgraph is run twice on copies of its leaves, and the copies' version counters checked);
* a module call, unless the module is a catalogued op in eval mode (an opaque leaf may keep state);
* a broadcast that makes its result larger than its inputs (``expand``, ``expand_as``,
  ``broadcast_to``, ``repeat``, ``tile``): folding would store the materialised copy (an expand
  is a view: free in torch, a memory cost as a constant), unless its result has at most
  :data:`SMALL_BROADCAST` elements. The broadcast stays, reading the folded value; and no folded
  value may exceed :data:`MAX_FOLDED_ELEMENTS` elements.

It runs after ``out_of_place`` (a chain of writes into a fresh tensor, BEiT's and T5's
``torch.zeros`` + slice writes making a relative-position index, is pure by then; a write into the
model's state stays in place and is not folded) and before placement; the new ``get_attr`` nodes get
their shapes here. An eval dropout inside such a subgraph is gone by then (``remove_identities``). The verifier
fails if a constant call is still read by a non-constant node.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.compat import torch_ao as ao
from qcompiler.errors import PassError
from qcompiler.ir.inplace import mutated_input, schema_writes
from qcompiler.ir.meta import META_SCOPE, META_TENSOR, scope
from qcompiler.ir.ops import OPS, Tag, module_op, node_op
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.passes.base import CompileContext, Pass, PassResult

MAX_FOLDED_ELEMENTS = 1 << 24  # 64 MiB of float32: a larger constant is left to be computed
# a broadcast up to this many elements is folded like any call (GPT-2's position ids expanded to the
# batch, with the mask arithmetic after them: constant glue that was an eager island)
SMALL_BROADCAST = 1 << 16
# broadcasts whose output may be much larger than their input: folded only if not larger
GROWING_OPS = frozenset({"expand", "expand_as", "broadcast_to", "broadcast_tensors", "repeat", "tile"})
_RANDOM_WORDS = ("rand", "normal", "bernoulli", "multinomial", "poisson", "dropout", "empty", "uniform",
                 "exponential", "cauchy", "geometric", "log_normal")
FOLDED_PREFIX = "qc_folded_"


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _random(node: fx.Node) -> bool:
    name = _name(node).lower()
    return any(word in name for word in _RANDOM_WORDS)


def _owner(gm: fx.GraphModule, target: str) -> nn.Module:
    """The module holding the tensor ``target`` names, for its training flag: the innermost module along
    the path that is the model's own. A GraphModule reaches a ``get_attr`` of a module it does not call
    through plain ``nn.Module()`` stand-ins (fx's ``_copy_attr``), which are always in training mode."""
    owner: nn.Module = gm
    m: nn.Module = gm
    for part in target.split(".")[:-1]:
        m = getattr(m, part)
        if type(m) is not nn.Module:
            owner = m
    return owner


def _self_updating(m: nn.Module) -> bool:
    """A module that changes its own buffers in training (batch statistics, observers)."""
    if isinstance(m, ao.OBSERVER_TYPES):
        return True
    op = OPS.get(module_op(m) or "")
    return op is not None and Tag.TRAINING in op.tags


def constant_attr(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.Tensor]:
    """The tensor a ``get_attr`` node reads, if it does not change between calls; else None."""
    try:
        value = _attr(gm, node.target)
    except AttributeError:
        return None
    if not isinstance(value, torch.Tensor):
        return None
    owner = _owner(gm, node.target)
    if owner.training:
        if isinstance(value, nn.Parameter) and value.requires_grad:
            return None
        if _self_updating(owner):
            return None
    return value


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _foldable_call(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """A call whose value may be computed once: not random, not writing, not a stateful module."""
    if node.op not in ("call_function", "call_method", "call_module") or _random(node):
        return False
    if node.op == "call_module":
        m = modules[node.target]
        return module_op(m) is not None and not m.training
    return True


def written_inputs(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The values ``node`` changes in place: :func:`~qcompiler.ir.inplace.mutated_input`'s, and for an ATen
    overload (a graph captured by torch.export keeps ``aten.copy_`` / ``aten.add_.Tensor`` / ``aten.fill_``)
    every argument its schema marks as written (``Tensor(a!)``)."""
    return [w for w in (mutated_input(node, gm),) if w is not None] + schema_writes(node)


def _tainted(gm: fx.GraphModule) -> set[fx.Node]:
    """The values the graph changes in place, and everything they were made from."""
    out: set[fx.Node] = set()
    stack = [w for n in gm.graph.nodes for w in written_inputs(n, gm)]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(n.all_input_nodes)
    return out


def _numel(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (tuple, list)):
        return sum(_numel(x) for x in v)
    return 0


def _literal(v: Any) -> bool:
    """A value that may stand in the graph as an argument: numbers, bools, and tuples of them."""
    if isinstance(v, (bool, int, float)):
        return True
    return isinstance(v, (tuple, list)) and all(_literal(x) for x in v)


def _run(node: fx.Node, env: Mapping[fx.Node, Any], modules: Mapping[str, nn.Module]) -> Any:
    args = fx.map_arg(node.args, lambda n: env[n])
    kwargs = fx.map_arg(node.kwargs, lambda n: env[n])
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    return modules[node.target](*args, **kwargs)


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _same(a: Any, b: Any) -> bool:
    """The same values, bit for bit (a NaN equals a NaN in the same place)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits (so NaNs compare equal), or ``t`` for a dtype without an int of its size."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
    return t.contiguous().view(ints[t.dtype]) if t.dtype in ints and t.dim() > 0 else t


def constant_values(gm: fx.GraphModule) -> dict[fx.Node, Any]:
    """Every constant node's value (get_attr leaves included), computed twice on copies of the leaves
    (copied only where a call reads them): a node whose two values differ, or that wrote into a leaf
    copy, is not constant."""
    modules = dict(gm.named_modules())
    tainted = _tainted(gm)
    runs: list[dict[fx.Node, Any]] = [{}, {}]
    versions: dict[fx.Node, list[int]] = {}
    consts: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node in tainted:
                continue
            if node.op == "get_attr":
                value = constant_attr(gm, node)
                if value is not None:
                    consts[node] = value  # copied below only if a call reads it
                continue
            if not _foldable_call(node, modules) or any(i not in consts for i in node.all_input_nodes):
                continue
            for leaf in node.all_input_nodes:
                if leaf not in runs[0]:  # a get_attr: each run reads its own copy
                    for env in runs:
                        env[leaf] = _clone(consts[leaf])
                    versions[leaf] = [env[leaf]._version for env in runs]
            try:
                values = [_run(node, env, modules) for env in runs]
            except Exception:  # noqa: BLE001 - whatever fails here is left to run as it did
                continue
            written = any(env[i]._version != versions[i][k] for k, env in enumerate(runs)
                          for i in node.all_input_nodes if i in versions)
            if written or not _same(*values) or _numel(values[0]) > MAX_FOLDED_ELEMENTS:
                continue
            if node_op(node, modules) in GROWING_OPS and _numel(values[0]) > SMALL_BROADCAST and \
                    _numel(values[0]) > sum(_numel(runs[0][i]) for i in node.all_input_nodes):
                continue
            for env, v in zip(runs, values):
                env[node] = v
            versions.update({node: [v._version for v in values]} if isinstance(values[0], torch.Tensor) else {})
            consts[node] = values[0]
    return consts


def _roots(gm: fx.GraphModule, consts: Mapping[fx.Node, Any]) -> list[fx.Node]:
    """The constant calls a non-constant node (or the output) reads, whose value can be stored."""
    return [n for n in consts if n.op != "get_attr" and any(u not in consts for u in n.users)
            and (isinstance(consts[n], torch.Tensor) or _literal(consts[n]))]


def _buffer_name(gm: fx.GraphModule, node: fx.Node) -> str:
    name, i = f"{FOLDED_PREFIX}{node.name}", 0
    while hasattr(gm, name):
        i += 1
        name = f"{FOLDED_PREFIX}{node.name}_{i}"
    return name


def fold_constants(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    consts = constant_values(gm)
    roots = _roots(gm, consts)
    for node in roots:
        value = consts[node]
        if isinstance(value, torch.Tensor):
            name = _buffer_name(gm, node)
            gm.register_buffer(name, value.detach().clone())
            with gm.graph.inserting_before(node):
                new = gm.graph.get_attr(name)
            new.meta[META_SCOPE] = scope(node)
            node.replace_all_uses_with(new, delete_user_cb=lambda u: u not in consts)
        else:
            literal = tuple(value) if isinstance(value, torch.Size) else value
            for user in [u for u in node.users if u not in consts]:
                user.args = fx.map_arg(user.args, lambda n: literal if n is node else n)
                user.kwargs = fx.map_arg(user.kwargs, lambda n: literal if n is node else n)
    for node in reversed(list(consts)):  # the folded subgraphs, now read by nothing
        if not node.users and node.graph is gm.graph:
            gm.graph.erase_node(node)
    if roots:
        gm.graph.lint()
        gm.recompile()
        if any(META_TENSOR in n.meta for n in gm.graph.nodes):  # the new get_attr nodes get their shapes too
            propagate_shapes(gm, ctx.example_inputs)
    return PassResult(gm, bool(roots))


def verify_folded(gm: fx.GraphModule, ctx: CompileContext) -> None:
    consts = constant_values(gm)
    left = _roots(gm, consts)
    if left:
        raise PassError(f"fold_constants: node '{left[0].name}' depends only on parameters and constants "
                        f"but was not folded")


FOLD_CONSTANTS = Pass("fold_constants", fold_constants, verify_folded)

__all__ = ["FOLD_CONSTANTS", "GROWING_OPS", "MAX_FOLDED_ELEMENTS", "constant_values", "fold_constants",
           "written_inputs"]
