"""``torch.einsum`` said as sums, permutes, reshapes and matmul (ONNX opset 11 has no Einsum).

An einsum left as it is runs as an eager-torch island (MaxViT: 126 of them), which
``export_onnx`` refuses. Each einsum node whose equation this pass can say is replaced, in
place, by ops every backend has: ``sum`` over an index only one operand has and the output
lacks, ``permute`` to put the indices in the order a matmul wants, ``reshape`` to merge
them, ``torch.matmul`` and the reshape / permute back to the output's order. Per operand pair
the indices split into *batch* (both operands and the output), *contracted* (both, not the
output), *left* (the first and the output) and *right* (the second and the output):

* no batch index: ``A[*left, K] @ B[K, R]``: a left operand keeps its own leading dims
  (``bij,jk->bik`` is one matmul, as a linear layer's), so the model's batch dim stays dim 0;
* else ``A[*batch, L, K] @ B[*batch, K, R]`` (the batch dims kept apart, not merged).

Handled: any one- or two-operand equation, explicit (``->``) or implicit output, with an
ellipsis (``...``, the dims aligned from the right as torch does), and three or more operands
contracted left to right (each step keeping the indices a later operand or the output needs).
The result equals ``torch.einsum`` up to float32 summation order (a matmul sums in its own
order, and a chain of three contracts in another association): tests/test_einsum.py states the
tolerance. Reshape entries are the example's numbers, the batch entry (dim 0 of the first
operand when it is the example's batch and stays the output's dim 0) as -1.

Left as einsum, with the reason in ``META_REWRITE`` (so the placement shows it on the CPU), and
the ONNX emitter's NOT_EMITTED note for ``einsum``: an index repeated in one operand (a diagonal
or trace, ``ii->i``), an index whose sizes differ between operands (a broadcast of size 1), a
non-float dtype, operands without shapes, an equation that does not parse. The verifier fails
if an einsum the pass can say is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import PassError, UnsupportedOpError
from qcompiler.ir.meta import META_REWRITE, META_SCOPE, META_TENSOR, TensorInfo
from qcompiler.ir.ops import bind, node_op
from qcompiler.ir.shape_prop import dtype_name
from qcompiler.passes.base import CompileContext, Decline, Pass, PassResult, rewrite_each
from qcompiler.passes.shape_prop import TENSOR_META

EINSUM = "einsum"
NOTE = "einsum rewritten as sums, permutes, reshapes and matmul"
DECLINED = "einsum not rewritten"
_FLOAT_DTYPES = frozenset(dtype_name(d) for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16))


@dataclass(frozen=True)
class Parsed:
    """An equation as index tokens: per operand, and the output (``"…0"`` ... for ellipsis dims)."""

    operands: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    sizes: Mapping[str, int]


def _term(term: str, rank: int, ell_rank: int) -> list[str]:
    before, _, after = term.partition("...")
    n_ell = rank - len(before) - len(after) if "..." in term else 0
    return list(before) + [f"…{ell_rank - n_ell + i}" for i in range(n_ell)] + list(after)


def parse(equation: Any, shapes: Sequence[Sequence[int]]) -> Parsed:
    """The tokens of ``equation`` for operands of ``shapes``; raises :class:`Decline` with the reason."""
    if not isinstance(equation, str):
        raise Decline(f"the equation {equation!r} is not a string")
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if "->" in rhs or len(terms) != len(shapes):
        raise Decline(f"equation {equation!r} does not fit {len(shapes)} operand(s)")
    for t in [*terms, rhs]:
        if t.count("...") > 1 or not all(c.isalpha() and c.isascii() for c in t.replace("...", "")):
            raise Decline(f"equation {equation!r} does not parse")
    n_ells = []
    for t, shape in zip(terms, shapes):
        explicit = len(t.replace("...", ""))
        if ("..." in t and explicit > len(shape)) or ("..." not in t and explicit != len(shape)):
            raise Decline(f"term {t!r} of {equation!r} does not fit an operand of rank {len(shape)}")
        n_ells.append(len(shape) - explicit if "..." in t else 0)
    ell_rank = max(n_ells, default=0)
    operands = tuple(tuple(_term(t, len(s), ell_rank)) for t, s in zip(terms, shapes))
    for tokens in operands:
        repeated = sorted({x for x in tokens if tokens.count(x) > 1})
        if repeated:
            raise Decline(f"index {repeated[0]!r} repeated in one operand of {equation!r} (a diagonal)")
    ells = [f"…{i}" for i in range(ell_rank)]
    if arrow and "..." in rhs:
        before, _, after = rhs.partition("...")
        output = tuple(before) + tuple(ells) + tuple(after)
    elif arrow:
        output = tuple(rhs)
    else:
        counts: dict[str, int] = {}
        for tokens in operands:
            for x in tokens:
                counts[x] = counts.get(x, 0) + 1
        output = tuple(ells) + tuple(sorted(x for x, c in counts.items() if c == 1 and not x.startswith("…")))
    known = {x for tokens in operands for x in tokens}
    if len(set(output)) != len(output) or not set(output) <= known:
        raise Decline(f"the output of {equation!r} repeats an index or names one no operand has")
    sizes: dict[str, int] = {}
    for tokens, shape in zip(operands, shapes):
        for x, n in zip(tokens, shape):
            if sizes.setdefault(x, int(n)) != int(n):
                raise Decline(f"index {x!r} of {equation!r} has sizes {sizes[x]} and {n} (a broadcast)")
    return Parsed(operands, output, sizes)


# ----------------------------------------------------------------------------- emitting the ops


class _Builder:
    """Adds nodes before the einsum, each with its shape, dtype and the einsum's scope."""

    def __init__(self, gm: fx.GraphModule, at: fx.Node, dtype: str, sizes: Mapping[str, int],
                 batch: Optional[str]) -> None:
        self.graph, self.at, self.dtype, self.sizes, self.batch = gm.graph, at, dtype, sizes, batch
        self.added: list[fx.Node] = []

    def _add(self, kind: str, target: Any, args: tuple, shape: Sequence[int]) -> fx.Node:
        with self.graph.inserting_before(self.at):
            n = self.graph.create_node(kind, target, args)
        n.meta[META_SCOPE] = self.at.meta.get(META_SCOPE)
        n.meta[META_TENSOR] = TensorInfo(tuple(int(d) for d in shape), self.dtype)
        self.added.append(n)
        return n

    def shape(self, tokens: Sequence[str]) -> list[int]:
        return [self.sizes[x] for x in tokens]

    def sum_out(self, value: Any, tokens: list[str], keep: set[str]) -> tuple[Any, list[str]]:
        dims = tuple(i for i, x in enumerate(tokens) if x not in keep)
        if not dims:
            return value, tokens
        left = [x for x in tokens if x in keep]
        return self._add("call_method", "sum", (value, dims), self.shape(left)), left

    def permute(self, value: Any, tokens: list[str], order: list[str]) -> Any:
        if tokens == order:
            return value
        return self._add("call_method", "permute", (value, tuple(tokens.index(x) for x in order)), self.shape(order))

    def reshape(self, value: Any, groups: list[list[str]], current: list[int]) -> Any:
        """``value`` with each group of tokens merged into one dim (an empty group: a dim of 1)."""
        shape = [math.prod(self.shape(g)) for g in groups]
        if shape == list(current):
            return value
        entries = list(shape)
        where = [i for i, g in enumerate(groups) if self.batch in g]
        if len(where) == 1:
            entries[where[0]] = -1
        return self._add("call_method", "reshape", (value, tuple(entries)), shape)

    def matmul(self, a: Any, b: Any, shape: list[int]) -> fx.Node:
        return self._add("call_function", torch.matmul, (a, b), shape)


def _contract(b: _Builder, a_val: Any, ta: list[str], b_val: Any, tb: list[str],
              out: Sequence[str]) -> tuple[Any, list[str]]:
    """The product of two operands summed down to the tokens ``out`` (any order): value and its tokens."""
    a_val, ta = b.sum_out(a_val, ta, set(tb) | set(out))
    b_val, tb = b.sum_out(b_val, tb, set(ta) | set(out))
    batch = [x for x in out if x in ta and x in tb]
    contracted = [x for x in ta if x in tb and x not in out]
    left = [x for x in out if x in ta and x not in tb]
    right = [x for x in out if x in tb and x not in ta]
    a_val = b.permute(a_val, ta, batch + left + contracted)
    b_val = b.permute(b_val, tb, batch + contracted + right)
    a_shape, b_shape = b.shape(batch + left + contracted), b.shape(batch + contracted + right)
    r = math.prod(b.shape(right))
    if not batch and left:  # A[*left, K] @ B[K, R]: A keeps its leading dims
        a_groups = [[x] for x in left] + [contracted]
        mm_shape = b.shape(left) + [r]
    else:
        a_groups = [[x] for x in batch] + [left, contracted]
        mm_shape = b.shape(batch) + [math.prod(b.shape(left)), r]
    a_val = b.reshape(a_val, a_groups, a_shape)
    b_val = b.reshape(b_val, [[x] for x in batch] + [contracted, right], b_shape)
    product = b.matmul(a_val, b_val, mm_shape)
    tokens = batch + left + right
    product = b.reshape(product, [[x] for x in tokens], mm_shape)
    return product, tokens


def _batch_token(parsed: Parsed, shapes: Sequence[Sequence[int]], batch: Optional[int]) -> Optional[str]:
    """The token of the model's batch: dim 0 of the first operand, the example's batch size, and the
    output's dim 0 too; None when there is none (then every reshape entry is a number)."""
    first = parsed.operands[0]
    if batch is None or not first or not parsed.output or shapes[0][0] != batch:
        return None
    return first[0] if parsed.output[0] == first[0] else None


def _example_batch(gm: fx.GraphModule) -> Optional[int]:
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    info = first.meta.get(META_TENSOR) if first is not None else None
    return info.shape[0] if isinstance(info, TensorInfo) and info.shape else None


def _operands(node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[Any, list[fx.Node]]:
    try:
        args = bind(node, modules)
    except UnsupportedOpError as exc:
        raise Decline(str(exc)) from None
    operands = args["operands"]
    operands = list(operands) if isinstance(operands, (tuple, list)) else [operands]
    return args["equation"], operands


def plan(node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[Parsed, list[fx.Node], list[tuple[int, ...]]]:
    """What the rewrite of einsum ``node`` needs; raises :class:`Decline` with the reason."""
    equation, operands = _operands(node, modules)
    infos = [o.meta.get(META_TENSOR) if isinstance(o, fx.Node) else None for o in operands]
    if not operands or not all(isinstance(i, TensorInfo) for i in infos):
        raise Decline("an operand is no tensor with a known shape")
    out = node.meta.get(META_TENSOR)
    if not isinstance(out, TensorInfo) or any(i.dtype not in _FLOAT_DTYPES
                                              for i in [*infos, out]):
        raise Decline("its tensors are not all floating point")
    shapes = [tuple(i.shape) for i in infos]
    return parse(equation, shapes), operands, shapes


def _rewrite(gm: fx.GraphModule, node: fx.Node, modules: Mapping[str, nn.Module]) -> None:
    parsed, operands, shapes = plan(node, modules)
    info = node.meta[META_TENSOR]
    b = _Builder(gm, node, info.dtype, parsed.sizes, _batch_token(parsed, shapes, _example_batch(gm)))
    value: Any = operands[0]
    tokens = list(parsed.operands[0])
    rest = [list(t) for t in parsed.operands[1:]]
    if not rest:
        value, tokens = b.sum_out(value, tokens, set(parsed.output))
    for i, other in enumerate(rest):
        later = {x for t in rest[i + 1:] for x in t} | set(parsed.output)
        keep = [x for x in dict.fromkeys(tokens + other) if x in later]
        value, tokens = _contract(b, value, tokens, operands[i + 1], other, keep)
    value = b.permute(value, tokens, list(parsed.output))
    if isinstance(value, fx.Node) and value in b.added:
        value.meta[META_REWRITE] = NOTE
    node.replace_all_uses_with(value)
    gm.graph.erase_node(node)


def rewrite_einsum(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Every einsum said as matmul where its equation allows; the others keep the reason."""
    modules = dict(gm.named_modules())
    return rewrite_each(gm, lambda n: node_op(n, modules) == EINSUM, lambda n: _rewrite(gm, n, modules),
                        DECLINED, META_REWRITE)


def verify_einsum(gm: fx.GraphModule, ctx: CompileContext) -> None:
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node_op(node, modules) != EINSUM:
            continue
        try:
            plan(node, modules)
        except Decline:
            continue
        raise PassError(f"einsum: node '{node.name}' could be rewritten into matmul but was left")


EINSUM_TO_MATMUL = Pass("einsum", rewrite_einsum, verify_einsum, requires=(TENSOR_META,))

__all__ = ["Decline", "EINSUM_TO_MATMUL", "Parsed", "parse", "plan", "rewrite_einsum"]
