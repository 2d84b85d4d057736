"""``softmax(masked_fill(x, fill, -inf), dim)`` as one op: ``qcompiler.nn.functional.masked_softmax``.

Attention with a boolean mask is written ``scores.masked_fill(logical_not(mask), -inf)`` then
``softmax(-1)`` (``qcompiler.ir.attention``, Hugging Face's eager attention). Apart, the -inf scores
are a float value that no quantizer can take (the BPU softmax's input observer saw -inf); fused, the
scores stay finite and the mask is a second input: on nash the BPU runs the fused op
(``fixed_point.int_masked_softmax``), elsewhere the CPU runs its float definition. A
``logical_not`` (or ``~`` / ``bitwise_not`` of a bool tensor) in front of the mask folds into the op's
polarity (``fill_mask_is_true=False``).

Float values: equal to torch's two ops bit for bit where a row keeps at least one position; a row
with every position filled is 0 (torch: NaN). Applied on every march. Declined: a fill other than
-inf, a mask that is not a bool tensor, a masked_fill read by anything else, a softmax with a dtype
or without a constant int dim.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from qcompiler.errors import PassError
from qcompiler.ir.meta import META_REWRITE, META_SCOPE, META_TENSOR, TensorInfo
from qcompiler.ir.ops import node_op
from qcompiler.ir.pattern import Bindings, Const, Op, Var, arguments
from qcompiler.nn.functional import masked_softmax
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.shape_prop import TENSOR_META

NOTE = "softmax(masked_fill(x, mask, -inf)) fused as masked_softmax (the -inf never materializes)"
_FLOAT = ("f32", "f64", "f16", "bf16")


def _info(v: Any) -> Optional[TensorInfo]:
    info = v.meta.get(META_TENSOR) if isinstance(v, fx.Node) else None
    return info if isinstance(info, TensorInfo) else None


def _float_tensor(v: Any) -> bool:
    info = _info(v)
    return info is not None and info.dtype in _FLOAT


def _bool_tensor(v: Any) -> bool:
    info = _info(v)
    return info is not None and info.dtype == "bool"


def _neg_inf(v: Any) -> bool:
    return isinstance(v, float) and math.isinf(v) and v < 0


def _int_dim(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pattern(mask) -> Op:
    fill = Op("masked_fill", {"input": Var("x", _float_tensor), "mask": mask, "value": Const(_neg_inf)}, name="fill")
    return Op("softmax", {"input": fill, "dim": Const(_int_dim, "dim")}, name="softmax")


# softmax(masked_fill(x, m, -inf), dim) with a bool tensor m
MASK = _pattern(Var("m", _bool_tensor))


# ~t and bitwise_not(t) negate a bool tensor as logical_not does (on other dtypes they are not negations)
_BOOL_NEGATIONS = (operator.invert, torch.bitwise_not, "bitwise_not")


def _negated(m: fx.Node, modules) -> Optional[fx.Node]:
    """The bool tensor ``m`` negates when ``m`` is ``logical_not(t)`` (torch.logical_not / the method), or
    ``~t`` / ``bitwise_not(t)`` of a bool ``t``."""
    if m.kwargs or len(m.args) != 1:
        return None
    if node_op(m, modules) != "logical_not" and not (m.op in ("call_function", "call_method")
                                                      and m.target in _BOOL_NEGATIONS):
        return None
    return m.args[0] if _bool_tensor(m.args[0]) else None


def plan(node: fx.Node, modules) -> Optional[tuple[Bindings, fx.Node, bool]]:
    """``(bindings, mask, fill_mask_is_true)`` when ``node`` is a softmax to fuse, else None; a
    ``logical_not`` in front of the mask gives its input and ``fill_mask_is_true=False``."""
    b = MASK.match(node, modules)
    if b is None:
        return None
    args = arguments(node, modules)
    if args is None or args.get("dtype") is not None or len(b["fill"].users) != 1:
        return None
    inner = _negated(b["m"], modules)
    return (b, b["m"], True) if inner is None else (b, inner, False)


def fuse_masked_softmax(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Every softmax of a -inf masked_fill as one masked_softmax call."""
    modules = dict(gm.named_modules())
    modified = False
    for node in list(gm.graph.nodes):
        found = plan(node, modules) if node.op.startswith("call_") else None
        if found is None:
            continue
        b, mask, polarity = found
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(masked_softmax, (b["x"], mask, b["dim"], polarity))
        new.meta[META_TENSOR] = node.meta.get(META_TENSOR)
        new.meta[META_SCOPE] = node.meta.get(META_SCOPE)
        new.meta[META_REWRITE] = NOTE
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for dead in (b["fill"], b["m"]):  # the masked_fill, then a logical_not nothing else reads
            if not dead.users and dead.op in ("call_function", "call_method"):
                gm.graph.erase_node(dead)
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def verify_fused(gm: fx.GraphModule, ctx: CompileContext) -> None:
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op.startswith("call_") and plan(node, modules) is not None:
            raise PassError(f"masked_softmax: softmax '{node.name}' of a -inf masked_fill was left unfused")


MASKED_SOFTMAX = Pass("masked_softmax", fuse_masked_softmax, verify_fused, requires=(TENSOR_META,))

__all__ = ["MASKED_SOFTMAX", "NOTE", "fuse_masked_softmax", "plan"]
