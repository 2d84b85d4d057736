"""``F.scaled_dot_product_attention`` in a traced graph said as matmul, softmax and matmul.

A symbolic trace keeps the call as one node that no march table and no opset-11 rule knows, so
it ran as an eager-torch island (which ``export_onnx`` refuses) with the work around it split
off. This pass writes each call as ``qcompiler.ir.attention.write_attention`` says (the same
steps torch.export's capture writes): on every march the matmuls are then BPU work, and on a
march that runs softmax (nash) the attention stays in the BPU partition. Each new node carries its
shape (computed on meta tensors, so it is torch's own shape rule) and the scope of the call.

The result equals torch's fused kernel up to float32 summation order and the softmax's own
rounding (tests/test_attention_rewrite.py states the tolerance). Left as it is, with the reason in
``META_REWRITE``: the cases :func:`qcompiler.ir.attention.decline_reason` names, and operands
without known shapes or of a non-float dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from qcompiler.errors import PassError
from qcompiler.ir.attention import attention_arguments, decline_reason, scale_of, write_attention
from qcompiler.ir.meta import META_REWRITE, META_SCOPE, META_TENSOR, TensorInfo
from qcompiler.ir.shape_prop import dtype_name
from qcompiler.passes.base import CompileContext, Decline, Pass, PassResult, rewrite_each
from qcompiler.passes.shape_prop import TENSOR_META

NOTE = "scaled_dot_product_attention rewritten as matmul, scale, mask, softmax and matmul"
DECLINED = "scaled_dot_product_attention not rewritten"
_TORCH_DTYPES = {dtype_name(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                              torch.bool)}
_FLOAT = ("f32", "f64", "f16", "bf16")


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def _meta(value: Any) -> Any:
    """A meta tensor shaped like ``value`` (a node with a TensorInfo), or the value itself."""
    if not isinstance(value, fx.Node):
        return value
    info = value.meta[META_TENSOR]
    return torch.empty(info.shape, dtype=_TORCH_DTYPES[info.dtype], device="meta")


def plan(node: fx.Node) -> dict[str, Any]:
    """The call's arguments when the pass can write it; raises :class:`Decline` with the reason otherwise."""
    a = attention_arguments(node.args, node.kwargs)
    why = decline_reason(a)
    if why is not None:
        raise Decline(why)
    tensors = [a[n] for n in ("query", "key", "value", "attn_mask") if a[n] is not None]
    infos = [t.meta.get(META_TENSOR) if isinstance(t, fx.Node) else None for t in tensors]
    if not all(isinstance(i, TensorInfo) and i.dtype in _TORCH_DTYPES for i in infos):
        raise Decline("an operand is no tensor with a known shape and dtype")
    if any(i.dtype not in _FLOAT for i in infos[:3]):
        raise Decline("query, key and value are not all floating point")
    return a


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> None:
    a = plan(node)
    scope = node.meta.get(META_SCOPE)
    added: list[fx.Node] = []

    def call(target, args: tuple) -> fx.Node:
        new = gm.graph.call_function(target, args)
        out = target(*(_meta(x) for x in args))
        new.meta[META_TENSOR] = TensorInfo(tuple(out.shape), dtype_name(out.dtype))
        new.meta[META_SCOPE] = scope
        added.append(new)
        return new

    mask = a["attn_mask"]
    is_bool = mask is not None and mask.meta[META_TENSOR].dtype == dtype_name(torch.bool)
    with gm.graph.inserting_before(node):
        out = write_attention(call, a["query"], a["key"], a["value"], mask, is_bool,
                              scale_of(a, a["query"].meta[META_TENSOR].shape[-1]))
    for new in added:
        new.meta[META_REWRITE] = NOTE
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def rewrite_attention(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Every scaled_dot_product_attention said as matmul / softmax where it can be; the others keep
    the reason."""
    return rewrite_each(gm, _is_attention, lambda n: _rewrite(gm, n), DECLINED, META_REWRITE)


def verify_attention(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        if not _is_attention(node):
            continue
        try:
            plan(node)
        except Decline:
            continue
        raise PassError(f"attention: node '{node.name}' could be written as matmul / softmax but was left")


ATTENTION_AS_MATMUL = Pass("attention", rewrite_attention, verify_attention, requires=(TENSOR_META,))

__all__ = ["ATTENTION_AS_MATMUL", "NOTE", "plan", "rewrite_attention"]
