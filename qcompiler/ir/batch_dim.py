"""Is a converted graph per-sample along dim 0?  The proof behind the batch split (qcompiler.parallel).

Splitting a batch into chunks and concatenating the chunks' outputs gives the unsplit output
bit for bit only when every output row depends on its own input row alone, computed the same
way whatever the batch size.  :func:`split_refusal` checks that node by node, from each node's
canonical op (``META_OP``), its arguments and the shapes shape propagation recorded:

* every graph input is a tensor whose dim 0 is the batch; the analysis follows, for each value,
  which of its dims is the batch (``_Batched(d)``), or that it does not depend on the batch
  (constants, weights, sizes of other dims), or that it *is* the batch size (``x.size(0)``,
  usable only as the batch entry of a reshape);
* each op has a rule (:data:`RULES`, by canonical op; the families by their tags in the op
  registry, qcompiler.ir.ops) that says where its output's batch dim is, and refuses when
  the op would mix samples: a reduction, softmax, split or cat over the batch dim, a reshape
  that folds it or fixes its size, a batch-norm or dropout in training, advanced indexing, an
  op without a rule (an opaque module, an RNN, random numbers);
* every model output is batched along dim 0;
* on the CPU (onnxruntime and eager-torch islands compute in float) only ops whose every
  output element is computed by the same exact or correctly rounded operations whatever the
  tensor's length are allowed (:data:`CPU_EXACT`, the ops tagged so: layout ops, comparisons,
  clamps, single arithmetic ops, max pools).  A float convolution, GEMM, sum or transcendental
  may pick its kernel, blocking or vector tail by the tensor's size, so its bits could change
  with the batch size; such a model is not split.  BPU ops compute exact integers: any per-sample BPU
  op is allowed.

None means proven; a string names the first node that stops it and why.

:func:`batch_refusal` is the same analysis without the CPU rule: whether the graph is per-sample
at all, whatever the float rounding.  It decides where the ONNX export gets a symbolic batch axis
(qcompiler.onnx): an exported graph runs at any batch size when every row is its own sample's,
even where a float kernel may round its last bit differently at another size.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import BPU, META_OP, META_TENSOR, TensorInfo, placement
from qcompiler.ir.ops import Binding, Tag, bind, callee, emit_op, tagged
from qcompiler.nn.quantized import QuantizedSameScale

__all__ = ["split_refusal", "batch_refusal", "RULES", "CPU_EXACT"]


@dataclass(frozen=True)
class _Batched:
    dim: int  # the tensor's batch dim


class _BatchSize:  # an int equal to the batch size (x.size(0), x.shape[0])
    pass


@dataclass(frozen=True)
class _Sizes:
    dim: int  # a torch.Size whose entry ``dim`` is the batch size (x.shape, x.size())
    rank: int


CONST = None  # does not depend on the batch
BATCH_SIZE = _BatchSize()


class Refused(Exception):
    """Raised by a rule: the reason splitting is not proven safe at this node."""


def _info(node: Any) -> Any:
    return node.meta.get(META_TENSOR) if isinstance(node, fx.Node) else None


def _shape(node: Any) -> tuple:
    info = _info(node)
    if not isinstance(info, TensorInfo):
        raise Refused("no recorded tensor shape")
    return tuple(info.shape)


def _norm(dim: Any, rank: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise Refused(f"dim {dim!r} is not a constant int")
    if not -rank <= dim < max(rank, 1):
        raise Refused(f"dim {dim} out of range for rank {rank}")
    return dim % max(rank, 1)


class _Call:
    """A node's callee seen uniformly: its spelling's name, tensor input (first argument), module
    (a converted same-scale module's float module), and its arguments by name (read when a rule
    asks: :func:`qcompiler.ir.ops.bind`)."""

    def __init__(self, node: fx.Node, modules: dict[str, nn.Module]) -> None:
        self.node, self.modules, self.module = node, modules, None
        self.first = node.args[0] if node.args else None
        spelled = callee(node, modules)
        self.name = spelled.name if spelled is not None else getattr(node.target, "__name__", str(node.target))
        if node.op == "call_module":
            m = modules[node.target]
            self.module = m
            if isinstance(m, QuantizedSameScale) and m.method is None and m.function is None \
                    and m.float_module is not None:
                self.module = m.float_module
            if spelled is None:
                self.name = type(m).__name__

    @cached_property
    def arguments(self) -> Binding:
        """The call's arguments by name (defaults filled in)."""
        bound = bind(self.node, self.modules)
        if bound is None:
            raise Refused(f"no argument signature for {self.name!r}")
        return bound


def _input(call: _Call, states: dict) -> Optional[tuple[int, int]]:
    """(batch dim, rank) of the call's first argument, or None when it does not depend on the batch."""
    s = states.get(call.first) if isinstance(call.first, fx.Node) else CONST
    if s is CONST:
        return None
    return _batched(s, "the input"), len(_shape(call.first))


def _batched(state: Any, what: str) -> int:
    if not isinstance(state, _Batched):
        raise Refused(f"{what} is not a batched tensor")
    return state.dim


# ---------------------------------------------------------------------------- rules
# rule(call, states of the node's args (same nesting), out shape) -> the output's state

Rule = Callable[[_Call, list, Any], Any]


def _tensor_inputs(node: fx.Node, states: dict) -> list[tuple[fx.Node, Any]]:
    return [(a, states[a]) for a in node.all_input_nodes]


def _elementwise(call: _Call, states: dict, out_info: Any) -> Any:
    """Each output element from the same-position elements of the inputs (broadcasting from the right)."""
    ins = _tensor_inputs(call.node, states)
    for a, s in ins:
        if isinstance(s, (_BatchSize, _Sizes, tuple)):
            raise Refused(f"'{a.name}' (a batch size or tuple) is an operand")
    batched = [(a, s) for a, s in ins if isinstance(s, _Batched)]
    if not batched:
        return CONST
    out = tuple(out_info.shape) if isinstance(out_info, TensorInfo) else None
    if out is None:
        raise Refused("no recorded output shape")
    dims = set()
    for a, s in batched:
        shp = _shape(a)
        d = s.dim + len(out) - len(shp)
        if out[d] != shp[s.dim]:
            raise Refused(f"'{a.name}' is broadcast along its batch dim")
        dims.add(d)
    if len(dims) != 1:
        raise Refused("operands have their batch in different dims")
    d = dims.pop()
    constants = [a for a, s in ins if s is CONST and isinstance(_info(a), TensorInfo)]
    inner = getattr(call.module, "constant", None)  # a constant operand held by the module
    shapes = [_shape(a) for a in constants] + ([tuple(inner.shape)] if isinstance(inner, torch.Tensor) else [])
    for shp in shapes:
        k = d - (len(out) - len(shp))
        if 0 <= k < len(shp) and shp[k] != 1:
            raise Refused(f"a constant of shape {list(shp)} lies along the batch dim")
    return _Batched(d)


def _leading(call: _Call, states: dict, out_info: Any) -> Any:
    """Ops over (N, C, spatial...) (:data:`Tag.SPATIAL`): the batch must be dim 0 and stays dim 0."""
    s = states.get(call.first) if isinstance(call.first, fx.Node) else CONST
    if s is CONST:
        _others(call, states, None)
        return CONST
    if _batched(s, "the input") != 0:
        raise Refused("the batch is not dim 0 of its (N, C, ...) input")
    if not isinstance(out_info, TensorInfo) or out_info.shape[0] != _shape(call.first)[0]:
        raise Refused("the output's dim 0 is not the batch")
    _others(call, states, 0)
    return _Batched(0)


def _others(call: _Call, states: dict, d: Optional[int]) -> None:
    """Operands besides the first (a fused add's other input, weights): constants, or batched in
    the output's batch dim ``d`` with the same size (a residual added to a conv's output)."""
    out_rank = len(_shape(call.first)) if d is not None else 0
    for a, st in _tensor_inputs(call.node, states):
        if a is call.first:
            continue
        if st is CONST:  # broadcast onto every sample only if it is 1 (or absent) along the batch dim
            shp = _shape(a) if d is not None and isinstance(_info(a), TensorInfo) else ()
            k = d - (out_rank - len(shp)) if shp else -1
            if 0 <= k < len(shp) and shp[k] != 1:
                raise Refused(f"a constant operand '{a.name}' of shape {list(shp)} lies along the batch dim")
            continue
        if d is None or st != _Batched(d) or _shape(a)[d] != _shape(call.first)[d]:
            raise Refused(f"operand '{a.name}' depends on the batch in another way than the input")


def _eval_only(inner: Rule) -> Rule:
    """A module or function that mixes samples (batch-norm statistics) or draws random numbers in
    training (:data:`Tag.TRAINING`): a module's ``training`` flag, or the function's ``training``
    argument must be False."""
    def rule(call: _Call, states: dict, out_info: Any) -> Any:
        if call.module is not None:
            training = call.module.training
        elif call.node.op == "call_function":
            training = call.arguments["training"]
        else:
            training = True  # a method spelling: not read, so not proven
        if training is not False:
            raise Refused("in training mode it mixes samples or draws random numbers")
        return inner(call, states, out_info)
    return rule


def _last_dims(count: Callable[[_Call, int], int]) -> Rule:
    """Ops over the last ``count`` dims (linear: 1; layer_norm: len(normalized_shape)); the batch must be before."""
    def rule(call: _Call, states: dict, out_info: Any) -> Any:
        s = states.get(call.first) if isinstance(call.first, fx.Node) else CONST
        if s is CONST:
            _others(call, states, None)
            return CONST
        rank = len(_shape(call.first))
        d = _batched(s, "the input")
        if d >= rank - count(call, rank):
            raise Refused("it works over the batch dim")
        _others(call, states, d)
        return _Batched(d)
    return rule


def _normalized_count(call: _Call, rank: int) -> int:
    if call.module is not None and hasattr(call.module, "normalized_shape"):
        return len(tuple(call.module.normalized_shape))
    shape = call.arguments["normalized_shape"]
    if isinstance(shape, int):
        return 1
    if isinstance(shape, (tuple, list)):
        return len(shape)
    raise Refused("normalized_shape is not constant")


def _pad_count(call: _Call, rank: int) -> int:
    pad = call.arguments["pad"]
    if not isinstance(pad, (tuple, list)):
        raise Refused("the padding is not constant")
    return (len(pad) + 1) // 2


def _along_dim(reduces: bool) -> Rule:
    """softmax / cumsum / flip (reduces=False: :data:`Tag.ALONG_DIM`) and sum / mean / amax ...
    (reduces=True: :data:`Tag.REDUCTION`) over the ``dim`` (``dims``) argument (a module's ``dim``
    attribute); keepdim follows it. A reduction over no dim given (None, or ``()``) is over all."""
    def rule(call: _Call, states: dict, out_info: Any) -> Any:
        got = _input(call, states)
        if got is None:
            return CONST
        d, rank = got
        args = call.arguments
        dim = args["dims"] if "dims" in args else args["dim"]
        if dim is None or (reduces and isinstance(dim, (tuple, list)) and not dim):
            raise Refused("it reduces over every dim, the batch too")
        dims = {_norm(x, rank) for x in (dim if isinstance(dim, (tuple, list)) else (dim,))}
        if d in dims:
            raise Refused("it reduces over the batch dim")
        keep = args["keepdim"] if reduces else True
        if keep is not True and keep is not False:
            raise Refused("keepdim is not constant")
        return _Batched(d if keep else d - sum(x < d for x in dims))
    return rule


def _reshape(call: _Call, states: dict, out_info: Any) -> Any:
    s = states.get(call.first) if isinstance(call.first, fx.Node) else CONST
    extra = [states[a] for a in call.node.all_input_nodes if a is not call.first]
    if any(st is not CONST and st is not BATCH_SIZE for st in extra):
        raise Refused("a reshape argument depends on the batch in an unknown way")
    if s is CONST:
        if extra and any(st is BATCH_SIZE for st in extra):
            raise Refused("a constant is reshaped to the batch size")
        return CONST
    d = _batched(s, "the input")
    shp = _shape(call.first)
    rank = len(shp)
    name = call.name
    if name in ("contiguous", "clone", "detach", "to", "float", "type", "Identity", "Dropout"):
        return _Batched(d)
    if name in ("flatten", "Flatten"):
        start, end = _norm(call.arguments["start_dim"], rank), _norm(call.arguments["end_dim"], rank)
        if start <= d <= end and start != end:
            raise Refused("it flattens the batch dim into others")
        return _Batched(d if d < start else d - max(0, end - start))
    if name == "unsqueeze":
        dim = _norm(call.arguments["dim"], rank + 1)
        return _Batched(d + (dim <= d))
    if name == "squeeze":
        dim = call.arguments["dim"]
        if dim is None:
            raise Refused("squeeze() without a dim removes the batch dim when a chunk has one sample")
        dims = {_norm(x, rank) for x in (dim if isinstance(dim, (tuple, list)) else (dim,))}
        if d in dims:
            raise Refused("it squeezes the batch dim")
        return _Batched(d - sum(x < d and shp[x] == 1 for x in dims))
    if name in ("view", "reshape"):
        target = call.arguments["size" if name == "view" else "shape"]
        if not isinstance(target, (tuple, list)):
            raise Refused("the target shape is not a list")
        out = tuple(out_info.shape) if isinstance(out_info, TensorInfo) else None
        if out is None or len(out) != len(target):
            raise Refused("no recorded output shape")
        marks = [i for i, t in enumerate(target) if isinstance(t, fx.Node) and states[t] is BATCH_SIZE]
        for t in target:
            if isinstance(t, fx.Node) and states[t] not in (CONST, BATCH_SIZE):
                raise Refused("a target size depends on the batch in an unknown way")
        if len(marks) > 1:
            raise Refused("the batch size appears twice in the target shape")
        p = marks[0] if marks else next((i for i, t in enumerate(target) if not isinstance(t, fx.Node) and t == -1),
                                        None)
        if p is None:
            raise Refused("it reshapes to a fixed shape (give the batch entry as x.size(0) or -1)")
        prod = lambda xs: int(torch.tensor(xs, dtype=torch.int64).prod()) if len(xs) else 1  # noqa: E731
        if prod(out[:p]) != prod(shp[:d]) or out[p] != shp[d] or prod(out[p + 1:]) != prod(shp[d + 1:]):
            raise Refused("it moves samples across the batch dim")
        return _Batched(p)
    raise Refused(f"no batch rule for the reshape spelling '{name}'")


def _permute(call: _Call, states: dict, out_info: Any) -> Any:
    got = _input(call, states)
    if got is None:
        return CONST
    d, rank = got
    if call.name == "t":
        return _Batched(1 - d if rank == 2 else d)
    if call.name == "transpose":
        a, b = _norm(call.arguments["dim0"], rank), _norm(call.arguments["dim1"], rank)
        return _Batched(b if d == a else a if d == b else d)
    order = [_norm(x, rank) for x in call.arguments["dims"]]
    if sorted(order) != list(range(rank)):
        raise Refused("not a permutation")
    return _Batched(order.index(d))


def _cat(stack: bool) -> Rule:
    def rule(call: _Call, states: dict, out_info: Any) -> Any:
        items = call.first if isinstance(call.first, (tuple, list)) else None
        if items is None:
            raise Refused("the operand list is not a literal list")
        st = [states[a] if isinstance(a, fx.Node) else CONST for a in items]
        if all(x is CONST for x in st):
            return CONST
        if not all(isinstance(x, _Batched) for x in st) or len({x.dim for x in st}) != 1:
            raise Refused("it joins batched and constant tensors, or tensors batched in different dims")
        d = st[0].dim
        rank = len(_shape(items[0]))
        dim = _norm(call.arguments["dim"], rank + stack)
        if not stack and dim == d:
            raise Refused("it concatenates along the batch dim")
        return _Batched(d + (stack and dim <= d))
    return rule


def _split(call: _Call, states: dict, out_info: Any) -> Any:
    s = states.get(call.first) if isinstance(call.first, fx.Node) else CONST
    if not isinstance(out_info, (tuple, list)):
        raise Refused("no recorded outputs")
    if s is CONST:
        return tuple(CONST for _ in out_info)
    d = _batched(s, "the input")
    rank = len(_shape(call.first))
    if call.name == "unbind":
        dim = _norm(call.arguments["dim"], rank)
        if dim == d:
            raise Refused("it unbinds the batch dim")
        return tuple(_Batched(d - (dim < d)) for _ in out_info)
    dim = _norm(call.arguments["dim"], rank)
    if dim == d:
        raise Refused("it splits along the batch dim")
    return tuple(_Batched(d) for _ in out_info)


def _matmul(call: _Call, states: dict, out_info: Any) -> Any:
    a, b = call.node.args[0], call.node.args[1]
    sa = states[a] if isinstance(a, fx.Node) else CONST
    sb = states[b] if isinstance(b, fx.Node) else CONST
    if not isinstance(out_info, TensorInfo):
        raise Refused("no recorded output shape")
    rank = len(out_info.shape)
    dims = set()
    for s, node, contracted in ((sa, a, 1), (sb, b, 2)):
        if s is CONST:
            continue
        shp = _shape(node)
        d = _batched(s, "an operand")
        if len(shp) < 2:
            raise Refused("a 1-d operand is batched")
        if d == len(shp) - contracted:
            raise Refused("it sums over the batch dim")
        if d < len(shp) - 2:
            od = d + rank - len(shp)
            if out_info.shape[od] != shp[d]:
                raise Refused("an operand is broadcast along the batch dim")
        else:  # the rows of a, the columns of b
            od = rank - 2 if contracted == 1 else rank - 1
        dims.add(od)
    if not dims:
        return CONST
    if len(dims) != 1:
        raise Refused("both operands are batched in different dims")
    od = dims.pop()
    for s, node in ((sa, a), (sb, b)):  # a constant operand must not broadcast along the batch dim
        if s is CONST and isinstance(node, fx.Node) and od < rank - 2:
            shp = _shape(node)
            k = od - (rank - len(shp))
            if 0 <= k < len(shp) - 2 and shp[k] != 1:
                raise Refused("a constant operand lies along the batch dim")
    return _Batched(od)


# tensor attributes that do not depend on the batch (x.T, x.mT, x.data ... do: they are refused)
_BATCH_FREE_ATTRS = frozenset({"dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_quantized"})


def _size(call: _Call, states: dict, out_info: Any) -> Any:
    s = states.get(call.first) if isinstance(call.first, fx.Node) else CONST
    if call.name == "dim" or s is CONST:
        return CONST
    d = _batched(s, "the input")
    if call.name == "getattr":
        name = call.arguments["name"]
        if name == "shape":
            return _Sizes(d, len(_shape(call.first)))
        if name in _BATCH_FREE_ATTRS:
            return CONST
        raise Refused(f"attribute '{name}' of a batched tensor (only {', '.join(sorted(_BATCH_FREE_ATTRS))} "
                      f"and shape are known not to depend on the batch)")
    dim = call.arguments["dim"]
    if dim is None:
        return _Sizes(d, len(_shape(call.first)))
    return BATCH_SIZE if _norm(dim, len(_shape(call.first))) == d else CONST


def _getitem(call: _Call, states: dict, out_info: Any) -> Any:
    base, idx = call.node.args[0], call.node.args[1]
    s = states[base] if isinstance(base, fx.Node) else CONST
    if isinstance(idx, fx.Node) or (isinstance(idx, (tuple, list)) and any(isinstance(i, fx.Node) for i in idx)):
        if s is CONST and all(states[a] is CONST for a in call.node.all_input_nodes):
            return CONST
        raise Refused("indexing with a computed index")
    if isinstance(s, tuple):  # an element of a split / a multi-output op
        return s[idx] if isinstance(idx, int) else s[idx]
    if isinstance(s, _Sizes):
        if isinstance(idx, int):
            return BATCH_SIZE if idx % s.rank == s.dim else CONST
        raise Refused("a slice of a shape that holds the batch size")
    if s is CONST:
        return CONST
    if not isinstance(s, _Batched):
        raise Refused("indexing a value that is not a batched tensor")
    _check_slice_bounds(idx, states)
    return _Batched(_indexed_batch_dim(s.dim, len(_shape(base)), idx))


def _indexed_batch_dim(d: int, rank: int, idx: Any) -> int:
    """Where the batch dim ``d`` of a rank-``rank`` tensor lands in ``x[idx]`` (ints, slices, None,
    Ellipsis); refused where the index selects from it."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        used = sum(i is not None for i in items if i is not Ellipsis)
        items = items[:k] + [slice(None)] * (rank - used) + items[k + 1:]
    pos, out = 0, 0
    for it in items:
        if it is None:
            out += 1
            continue
        if pos == d:
            if it != slice(None):
                raise Refused("indexing selects from the batch dim")
            return out
        if isinstance(it, int) and not isinstance(it, bool):
            pos += 1
        elif isinstance(it, slice):
            pos, out = pos + 1, out + 1
        else:
            raise Refused(f"index {it!r}")
    return out + (d - pos)


def _check_slice_bounds(idx: Any, states: dict) -> None:
    """Refused where a slice bound is computed from the batch (``y[:, :y.shape[0]]``: each chunk would
    cut at its own size)."""
    for it in idx if isinstance(idx, (tuple, list)) else (idx,):
        if isinstance(it, slice) and any(isinstance(b, fx.Node) and states.get(b) is not CONST
                                         for b in (it.start, it.stop, it.step)):
            raise Refused("a slice bound computed from the batch")


def _setitem(call: _Call, states: dict, out_info: Any) -> Any:
    """``x[idx] = value`` out of place: per sample when ``x`` is batched, the index leaves the batch dim
    whole (or is a mask batched like ``x``), and the value is a number, a constant that does not lie
    along the batch dim, or batched where the picked elements are."""
    base, idx, value = call.node.args[0], call.node.args[1], call.node.args[2]
    s = states[base] if isinstance(base, fx.Node) else CONST
    sv = states[value] if isinstance(value, fx.Node) else CONST
    if s is CONST:
        if sv is CONST and not (isinstance(idx, fx.Node) and states[idx] is not CONST):
            return CONST
        raise Refused("a batched value assigned into a constant")
    if not isinstance(s, _Batched):
        raise Refused("assigning into a value that is not a batched tensor")
    rank = len(_shape(base))
    if isinstance(idx, fx.Node):  # a boolean mask of x's shape, batched as x
        one = not isinstance(value, fx.Node) or math.prod(_shape(value)) == 1
        mask = isinstance(_info(idx), TensorInfo) and _info(idx).dtype == "bool"  # (an int index picks samples)
        if not mask or states[idx] != s or _shape(idx) != _shape(base) or sv is not CONST or not one:
            raise Refused("an index tensor, or a mask not batched as the tensor, or a value of many elements")
        return s
    if isinstance(idx, (tuple, list)) and any(isinstance(i, fx.Node) for i in idx):
        raise Refused("indexing with a computed index")
    _check_slice_bounds(idx, states)
    picked = _indexed_batch_dim(s.dim, rank, idx)
    picked_rank = rank - sum(isinstance(i, int) and not isinstance(i, bool)
                             for i in (idx if isinstance(idx, tuple) else (idx,))) \
        + sum(i is None for i in (idx if isinstance(idx, tuple) else (idx,)))
    if sv is CONST:
        vshape = _shape(value) if isinstance(value, fx.Node) else ()
        k = picked - (picked_rank - len(vshape or ()))
        if vshape is None or (0 <= k < len(vshape) and vshape[k] != 1):
            raise Refused("a constant value lies along the batch dim")
        return s
    if not isinstance(sv, _Batched) or sv.dim + (picked_rank - len(_shape(value))) != picked:
        raise Refused("the value's batch dim is not where the picked elements' is")
    return s


def _const_only(call: _Call, states: dict, out_info: Any) -> Any:
    if any(states[a] is not CONST for a in call.node.all_input_nodes):
        raise Refused("it depends on the batch")
    return CONST


# an op's family rule, by its tag in the op registry (qcompiler.ir.ops.catalogue)
_FAMILIES: tuple[tuple[Tag, Rule], ...] = (
    (Tag.ELEMENTWISE, _elementwise),
    (Tag.SPATIAL, _leading),
    (Tag.ALONG_DIM, _along_dim(False)),
    (Tag.REDUCTION, _along_dim(True)),
)

# the ops with a rule of their own
_OWN_RULES: dict[str, Rule] = {
    "linear": _last_dims(lambda call, rank: 1),
    "layer_norm": _last_dims(_normalized_count),
    "rms_norm": _last_dims(_normalized_count),
    "pad": _last_dims(_pad_count),
    "constant_pad_nd": _last_dims(_pad_count),
    "reshape": _reshape,
    "flatten": _reshape,
    "permute": _permute,
    "transpose": _permute,
    "t": _permute,
    "cat": _cat(False),
    "stack": _cat(True),
    "split": _split,
    "unbind": _split,
    "matmul": _matmul,
    "size": _size,
    "getattr": _size,
    "getitem": _getitem,
    "setitem": _setitem,
    "constant": _const_only,
}


def _family_rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for tag, rule in _FAMILIES:
        for op in sorted(tagged(tag)):
            rules[op] = _eval_only(rule) if op in tagged(Tag.TRAINING) else rule
    return rules


# canonical op -> rule.  Ops missing here stop the split (an unknown op may mix samples).
RULES: dict[str, Rule] = {**_family_rules(), **_OWN_RULES}

# Ops whose float result is the same bits whatever the tensor's length or layout (exact or one
# correctly rounded operation per element): the only ones allowed on the CPU.
CPU_EXACT = tagged(Tag.CPU_EXACT)


def _op(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem"
    return node.meta.get(META_OP) or emit_op(node, modules)


def _with_alpha(node: fx.Node) -> bool:
    return "alpha" in node.kwargs or "value" in node.kwargs


def split_refusal(gm: fx.GraphModule) -> Optional[str]:
    """None when every output row of ``gm`` provably depends only on the same row of every input
    (dim 0), computed alike at any batch size; else why not, naming the node."""
    return _refusal(gm, cpu_exact=True)


def batch_refusal(gm: fx.GraphModule) -> Optional[str]:
    """None when every output row of ``gm`` provably depends only on the same row of every input
    (dim 0), its float CPU ops allowed to round differently at another batch size; else why not,
    naming the node."""
    return _refusal(gm, cpu_exact=False)


def _refusal(gm: fx.GraphModule, *, cpu_exact: bool) -> Optional[str]:
    modules = dict(gm.named_modules())
    states: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        where = f"node '{node.name}'"
        try:
            if node.op == "placeholder":
                info = _info(node)
                if not isinstance(info, TensorInfo) or len(info.shape) < 1:
                    raise Refused("the input is not a tensor with a batch dim")
                states[node] = _Batched(0)
            elif node.op == "get_attr":
                states[node] = CONST
            elif node.op == "output":
                for leaf in _flat(node.args[0]):
                    if isinstance(leaf, fx.Node) and states[leaf] != _Batched(0):
                        raise Refused(f"the output '{leaf.name}' is not batched along dim 0")
            else:
                op = _op(node, modules)
                rule = RULES.get(op) if op else None
                if rule is None:
                    raise Refused(f"op {op or node.target!r} has no batch rule (it may mix samples)")
                on_cpu = cpu_exact and placement(node) != BPU
                if on_cpu and (op not in CPU_EXACT or (op in ("add", "sub", "rsub") and _with_alpha(node))):
                    # a float kernel whose rounding may depend on the tensor's length
                    if any(states[a] is not CONST for a in node.all_input_nodes):
                        raise Refused(f"{op} computes in float on the CPU, where its kernel may round differently "
                                      f"at another batch size")
                states[node] = rule(_Call(node, modules), states, _info(node))
        except Refused as why:
            return f"{where}: {why}"
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, UnsupportedOpError) as exc:
            return f"{where}: its arguments could not be read ({type(exc).__name__}: {exc})"
    return None


def _flat(x: Any) -> list:
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _flat(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _flat(v)]
    return [x]
