"""Which graph nodes change a value in place, and which of them change the model's own state.

``a.mul_(2.0)`` writes into ``a``; passes that reorder or copy values must know it
(:mod:`~qcompiler.passes.inplace_reads`, eager islands, the pad fold).  A write into a parameter
or buffer (``self.mean.mul_(0.5)``) is state that outlives the call: a traced graph cannot hold it,
so tracing makes the module doing it a leaf (:mod:`~qcompiler.ir.auto_leaf`).  Most in-place
methods have an out-of-place twin (``x.add_(y)``: ``x.add(y)``), which passes/out_of_place.py puts
in their place once every later read goes through their result.  An opaque node (a leaf module) that
writes its input is seen doing so by shape propagation (``META_INPUT_WRITES``); passes/leaf_writes.py
gives it a copy and says the write as :func:`leaf_write_`.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.ir.meta import META_STORAGE, META_TENSOR, META_WRITE_BACK, TensorInfo
from qcompiler.ir.setitem import setitem, setitem_

# torch.nn modules whose ``inplace=True`` writes the result into their input (exactly these classes: a
# module of another class may keep an ``inplace`` flag it does not act on, as timm's GELU does)
INPLACE_MODULES = frozenset({
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.SiLU, nn.Mish, nn.Hardtanh, nn.Hardswish,
    nn.Hardsigmoid, nn.Threshold, nn.RReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.AlphaDropout, nn.FeatureAlphaDropout,
})


# methods named like in-place ops that change no tensor's values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


def mutated_input(node: fx.Node, gm: fx.GraphModule) -> Optional[fx.Node]:
    """The value ``node`` changes in place (its first argument), or None: a tensor method ``x.op_()``,
    a ``torch`` function ``op_`` (``F.leaky_relu_`` and its like too), a ``torch.nn.functional`` one
    with ``inplace=True``, a module of :data:`INPLACE_MODULES` with ``inplace=True``, ``x[index] = value``
    (:func:`~qcompiler.ir.setitem.setitem_`).  (A user function
    or module with such a name or flag is not taken at its word.)"""
    first = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method":
        return first if _in_place_name(node.target) else None
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return first if type(mod) in INPLACE_MODULES and getattr(mod, "inplace", False) is True else None
    if node.op == "call_function":
        if node.target is setitem_ or node.target is leaf_write_:  # x[index] = value; what a leaf wrote
            return first
        where = getattr(node.target, "__module__", None) or ""
        if where == "torch.nn.functional" and node.kwargs.get("inplace") is True:
            return first
        if where in ("torch", "torch._C._nn") and _in_place_name(getattr(node.target, "__name__", "")):
            return first  # torch._C._nn: F.leaky_relu_, F.elu_, F.hardtanh_
    return None


# the names of a node's inputs whose tensors it changed in place while shape propagation ran it (their
# version counters moved): how an opaque node (a leaf module, an untraceable function) is seen writing its input
META_INPUT_WRITES = "qc_input_writes"
# the name of the input whose very tensor a node returned (``x.mul_(2); return x``), or None
META_RETURNED_INPUT = "qc_returned_input"


def schema_writes(node: fx.Node) -> list[fx.Node]:
    """The arguments an ATen overload's schema marks as written (``Tensor(a!)``): what a graph captured
    by torch.export changes in place (``aten.copy_``, ``aten.add_.Tensor``, ``aten.fill_``), which
    :func:`mutated_input` does not read from a name. Empty for anything but an ATen call."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    out: list[fx.Node] = []
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        out.extend(v for v in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(v, fx.Node))
    return out


def leaf_write_(value: torch.Tensor, copy: torch.Tensor, result: object) -> torch.Tensor:
    """``value`` given what an opaque node wrote into ``copy``, its copy of ``value`` (passes/leaf_writes.py):
    in place, as the node would have written ``value`` itself.  ``result``, the node's output, is read only
    to order this after the node."""
    return value.copy_(copy)


def leaf_write(value: torch.Tensor, copy: torch.Tensor, result: object) -> torch.Tensor:
    """:func:`leaf_write_` out of place: the copy as the opaque node left it (the copy has no other reader)."""
    return copy


UNKNOWN_STORAGE = -1  # a tensor whose storage cannot be read (sparse, mkldnn): it may alias anything


def storage_key(t: torch.Tensor) -> int:
    """An opaque key of ``t``'s storage (the StorageImpl's address), equal for views and for ops returning
    their input, on meta tensors too; :data:`UNKNOWN_STORAGE` for a layout without one."""
    if t.layout != torch.strided:
        return UNKNOWN_STORAGE
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return UNKNOWN_STORAGE


# In-place tensor methods with an out-of-place twin that computes the same value whenever every tensor
# involved has one dtype (in place, the result keeps ``x``'s dtype where the twin would promote; where the
# dtypes differ, eager torch refuses the in-place op or the twin would give another dtype).  Comparisons
# and logical ops are left out: in place they write 0 / 1 in ``x``'s dtype, where the twin gives bool.
OUT_OF_PLACE_TWINS = frozenset(f"{name}_" for name in (
    "relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "log", "log1p", "sin", "cos", "tan", "erf",
    "reciprocal", "floor", "ceil", "round", "sign", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "log2", "log10", "exp2", "square", "trunc", "fix", "logit", "nan_to_num",
    "add", "sub", "mul", "div", "pow", "true_divide", "atan2", "fmod", "remainder", "floor_divide", "lerp",
    "addcmul", "addcdiv", "addmm", "baddbmm", "addmv", "masked_fill", "scatter",
    "squeeze", "unsqueeze", "transpose", "t",
    "clamp", "clip", "clamp_min", "clamp_max",
) if hasattr(torch.Tensor, f"{name}_"))


# operands whose dtype never takes part in the result's (a bool mask, an int64 index): (position, keyword)
_NOT_PROMOTED = {"masked_fill_": (1, "mask"), "scatter_": (2, "index")}

# in-place methods that overwrite every element of ``x`` with a value broadcast to ``x`` and converted to its
# dtype (``x.copy_(src)``, ``x.fill_(v)``): exactly what ``x[...] = value`` does, so their twin is
# :func:`~qcompiler.ir.setitem.setitem` with the index ``...`` (one op with an ONNX rule, whatever the dtypes)
WHOLE_WRITES = frozenset({"copy_", "fill_"})


def _twin(node: fx.Node) -> Union[str, Callable, None]:
    """The twin's target if ``node`` is one of :data:`OUT_OF_PLACE_TWINS` and shape propagation recorded one
    dtype for it and each tensor it reads (a mask or an index aside), or ``x[index] = value`` (its twin,
    :func:`~qcompiler.ir.setitem.setitem`, converts ``value`` as the statement does, whatever the dtypes), or
    one of :data:`WHOLE_WRITES` (``setitem`` too, at ``...``: :func:`as_twin`), or :func:`leaf_write_` (its
    twin :func:`leaf_write`); else None."""
    if node.op == "call_function" and node.target in (setitem_, leaf_write_):  # on a tensor (a list has no copy)
        if not isinstance(node.args[0].meta.get(META_TENSOR), TensorInfo):
            return None
        return setitem if node.target is setitem_ else leaf_write
    if node.op == "call_method" and node.target in WHOLE_WRITES:  # x.copy_(src) / x.fill_(v), no options
        if len(node.args) != 2 or node.kwargs or not isinstance(node.args[0].meta.get(META_TENSOR), TensorInfo):
            return None
        return setitem
    if node.op != "call_method" or node.target not in OUT_OF_PLACE_TWINS:
        return None
    info = node.meta.get(META_TENSOR)
    if not isinstance(info, TensorInfo):
        return None
    where = _NOT_PROMOTED.get(node.target)
    skip = None
    if where is not None:
        skip = node.args[where[0]] if len(node.args) > where[0] else node.kwargs.get(where[1])
    for read in node.all_input_nodes:
        if read is skip:
            continue
        r = read.meta.get(META_TENSOR)
        if not isinstance(r, TensorInfo) or r.dtype != info.dtype:
            return None
    return node.target[:-1]


class Tensors:
    """A graph's tensors as in-place writes make them: which value each in-place node writes, each tensor's
    nodes (the node that made it, then the writes into it: ``y``, ``y.mul_(2)``, ``.add_(1)``) and the
    nodes by storage key (``META_STORAGE``).  Built in graph order; :meth:`add` registers a node a pass
    inserts.  Shared by out_of_place's alias check and passes/view_writes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.writes: dict[fx.Node, fx.Node] = {}  # in-place node -> the value it writes
        self.root: dict[fx.Node, fx.Node] = {}  # node -> the node that made its tensor
        self.members: dict[fx.Node, list[fx.Node]] = {}  # root -> the tensor's nodes
        self.sharing: dict[int, list[fx.Node]] = {}  # storage key -> the nodes holding it
        for n in gm.graph.nodes:
            self.add(n, mutated_input(n, gm))

    def add(self, node: fx.Node, writes: Optional[fx.Node] = None) -> None:
        """Register ``node``, an in-place write of ``writes`` if given (appended to that tensor's nodes)."""
        if writes is not None:
            self.writes[node] = writes
            root = self.root_of(writes)
            self.root[node] = root
            self.members[root].append(node)
        for key in node.meta.get(META_STORAGE, ()):
            self.sharing.setdefault(key, []).append(node)

    def root_of(self, v: fx.Node) -> fx.Node:
        root = self.root.get(v)
        if root is None:
            self.root[v], self.members[v] = v, [v]
            root = v
        return root

    def family(self, v: fx.Node) -> list[fx.Node]:
        """The nodes whose result is the tensor ``v`` is, the node that made it first."""
        return self.members[self.root_of(v)]

    def has_aliases(self, node: fx.Node) -> bool:
        """Does a node outside the tensor the write ``node`` writes share its storage, or one of unknown
        storage exist?  (Else that write has no alias to look at: one pass over the sharing nodes.)"""
        root = self.root_of(self.writes[node])
        keys = set(node.meta.get(META_STORAGE) or self.writes[node].meta.get(META_STORAGE) or ())
        return any(self.root_of(n) is not root for key in keys | {UNKNOWN_STORAGE}
                   for n in self.sharing.get(key, ()))


class _Storages(Tensors):
    """:class:`Tensors` with the graph's order and names, built once per graph for the alias check."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.by_name = {n.name: n for n in gm.graph.nodes}


def _aliases(node: fx.Node, gm: fx.GraphModule, graph: _Storages) -> Optional[list[fx.Node]]:
    """The values that may be aliases of the one ``node`` writes into and are read after the write, or
    None where nothing says which (no storage recorded): a value made before ``node``, outside the chain
    of in-place ops on that one tensor, sharing a storage with it (shape propagation's ``META_STORAGE``: a
    view, a slice, an op returning its input such as ``.float()`` or ``.contiguous()``).  passes/inplace_reads
    rewires only reads of the written value itself, and passes/view_writes the aliases it can re-make or
    write back, so such an alias sees the write only while it runs in place.  Reads by view_writes'
    write-backs of this write are none: they carry it.  A write into the model's state (a ``get_attr``
    sharing the storage: ``self.buf[1:3].fill_(1)``) has that ``get_attr`` for alias, read later or not:
    the next call reads what it wrote."""
    value = graph.writes.get(node)
    shared = value.meta.get(META_STORAGE) if value is not None else None
    if not shared or UNKNOWN_STORAGE in shared:
        return None
    state = [n for key in shared for n in graph.sharing.get(key, ()) if n.op == "get_attr"]
    if state:  # a parameter or buffer (or a view of one): the write outlives the call, only in place is it kept
        return state[:1]
    if not graph.has_aliases(node):  # the common case, a chain of writes and nothing else
        return []
    family = set(graph.family(value))
    shared = shared | {UNKNOWN_STORAGE}  # a value of unknown storage may be an alias too
    sharing = {n for key in shared for n in graph.sharing.get(key, ())}
    names = {n.name for n in family}
    order, at = graph.order, graph.order[node]
    metadata_kept = node.target not in METADATA_WRITES
    found = []
    for other in sorted(sharing, key=order.__getitem__):
        if order[other] >= at or other in family:
            continue
        if any(order[u] > at and not (metadata_kept and _reads_metadata_only(u))
               and not _writes_back(u, names, graph) for u in other.users):
            found.append(other)
    return found


def _writes_back(node: fx.Node, names: set[str], graph: "_Storages") -> bool:
    """Is ``node`` passes/view_writes' write-back of one of the nodes ``names``, or of a write-back of
    one, in turn (a write through a view of a view goes back up one view at a time)?"""
    seen = set()
    name = node.meta.get(META_WRITE_BACK)
    while name is not None and name not in names and name not in seen:
        seen.add(name)
        up = graph.by_name.get(name)
        name = up.meta.get(META_WRITE_BACK) if up is not None else None
    return name in names


# in-place methods that change a tensor's shape or strides, not only its values
METADATA_WRITES = frozenset({"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "as_strided_",
                              "resize_", "resize_as_"})


def _reads_metadata_only(node: fx.Node) -> bool:
    """``x.size(0)``, ``x.dim()``, ``x.shape``: a read no write of values changes."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 \
        and node.args[1] in ("shape", "dtype", "device", "ndim")


def aliased_writes(gm: fx.GraphModule) -> dict[fx.Node, Optional[list[fx.Node]]]:
    """The in-place nodes whose written value may have an alias read after the write, with those aliases
    (None: unknown) (:func:`_aliases`)."""
    graph = _Storages(gm)
    found = {}
    for n in gm.graph.nodes:
        if mutated_input(n, gm) is not None:
            aliases = _aliases(n, gm, graph)
            if aliases is None or aliases:
                found[n] = aliases
    return found


def out_of_place_twins(gm: fx.GraphModule,
                       aliased: Optional[dict] = None) -> dict[fx.Node, Union[str, Callable]]:
    """In-place nodes that may run as their out-of-place twin, with the twin's target: a ``call_method`` of
    :data:`OUT_OF_PLACE_TWINS` for which shape propagation recorded one dtype for the node and each tensor it
    reads, or ``x[index] = value``; and none of ``aliased`` (:func:`aliased_writes` of ``gm``, computed here
    if not given).  Decided on the graph as it is (a node already rewritten no longer counts as an in-place op)."""
    aliased = aliased_writes(gm) if aliased is None else aliased
    twins = {}
    for node in gm.graph.nodes:
        twin = _twin(node)
        if twin is not None and node not in aliased:
            twins[node] = twin
    return twins


def as_twin(node: fx.Node, twin: Union[str, Callable]) -> None:
    """Make ``node`` its out-of-place ``twin`` (:func:`out_of_place_twins`), in place in the graph: the
    target, and for ``x.copy_(src)`` / ``x.fill_(v)`` the call ``setitem(x, ..., src)``."""
    if node.op == "call_method" and node.target in WHOLE_WRITES:
        node.op, node.args = "call_function", (node.args[0], Ellipsis, node.args[1])
    node.target = twin


def state_writes(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """``(node, attribute)`` for each in-place node whose changed value is a parameter or buffer of
    the model (a ``get_attr``, followed back through a chain of in-place ops: ``self.m.mul_(a).add_(b)``).
    Writes through views (``self.m[0].fill_(1)``) are not followed."""
    writes = []
    for node in gm.graph.nodes:
        value = mutated_input(node, gm)
        while value is not None and value.op != "get_attr":
            value = mutated_input(value, gm)
        if value is not None:
            writes.append((node, value.target))
    return writes


__all__ = ["INPLACE_MODULES", "META_INPUT_WRITES", "META_RETURNED_INPUT", "METADATA_WRITES", "OUT_OF_PLACE_TWINS",
           "Tensors", "WHOLE_WRITES", "aliased_writes", "as_twin", "leaf_write", "leaf_write_", "mutated_input", "out_of_place_twins",
           "state_writes"]
