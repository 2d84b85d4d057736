"""``scaled_dot_product_attention`` as the ops every backend has: one definition for both captures.

``softmax(q @ k^T * scale + mask) @ v``: ``transpose(k, -2, -1)``, ``torch.matmul``, ``torch.mul`` by
the scale (a number: ``1 / sqrt(q.shape[-1])`` unless given), the mask (a float mask added, a
boolean one as ``masked_fill(scores, ~mask, -inf)``, as torch reads them), ``torch.softmax(-1)`` and
``torch.matmul``. ONNX opset 11 has no attention op, and on a march that runs softmax the whole
attention then stays on the BPU. torch.export's capture (``qcompiler.ir.export_capture``) and the
traced graph's pass (``passes/attention.py``) both write it with :func:`write_attention`.

Left as it is (:func:`decline_reason`): dropout (``dropout_p`` not 0: training), ``is_causal`` (the
mask would be a constant of the call's sizes; not written yet), ``enable_gqa`` (key / value heads
repeated), a scale that is not a number.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")  # positional, then keywords
DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def attention_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in (torch's signature: six positional, then
    ``scale`` and ``enable_gqa`` by keyword)."""
    bound = dict(DEFAULTS)
    bound.update(zip(PARAMETERS, args))
    bound.update(kwargs)
    return bound


def decline_reason(a: Mapping[str, Any]) -> Optional[str]:
    """Why this call is left as one attention op, or None when :func:`write_attention` can say it."""
    if a.get("dropout_p"):
        return f"dropout_p={a['dropout_p']!r} (attention dropout is training-time)"
    if a.get("is_causal"):
        return "is_causal=True (the causal mask is not written as a constant yet)"
    if a.get("enable_gqa"):
        return "enable_gqa=True (grouped key / value heads)"
    scale = a.get("scale")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        return f"scale {scale!r} is not a number"
    return None


def scale_of(a: Mapping[str, Any], head_dim: int) -> float:
    """The scale the call uses: its own, else ``1 / sqrt(head_dim)`` (torch's default)."""
    scale = a.get("scale")
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def write_attention(call: Callable[[Any, tuple], Any], q: Any, k: Any, v: Any, mask: Any, mask_is_bool: bool,
                    scale: float) -> Any:
    """The attention as ``call(target, args)`` steps (each returns the new value); the output."""
    scores = call(torch.matmul, (q, call(torch.transpose, (k, -2, -1))))
    scores = call(torch.mul, (scores, scale))
    if mask is not None:
        if mask_is_bool:
            scores = call(torch.masked_fill, (scores, call(torch.logical_not, (mask,)), float("-inf")))
        else:
            scores = call(torch.add, (scores, mask))
    return call(torch.matmul, (call(torch.softmax, (scores, -1)), v))


__all__ = ["DEFAULTS", "PARAMETERS", "attention_arguments", "decline_reason", "scale_of", "write_attention"]
