"""``x[index] = value`` in a graph.

torch.fx has no ``Proxy.__setitem__``: ``y[:, :2] = 0`` and ``y[..., 0:2] *= 2`` (``y[i] = y[i] * 2``
to Python), common in detection heads, failed to trace, and the whole model ran in torch, unquantized.
The tracer records them as :func:`setitem_`, which writes ``x`` in place like the statement and, unlike
``operator.setitem``, returns it, so that reads after the write can go through its result
(passes/inplace_reads).  On a tensor, :func:`setitem` is its out-of-place twin (passes/out_of_place),
a CPU op with an ONNX rule (backends/onnx/rules/index.py); on a list or a dict it stays as it is.
passes/view_writes adds ``setitem_`` nodes itself, to write a write through a view back into its input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def setitem_(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``x[index] = value``, then ``x`` (changed in place)."""
    x[index] = value
    return x


def setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """A copy of ``x`` with ``[index] = value``: the values ``setitem_`` leaves in ``x``, ``x`` untouched."""
    out = x.clone()
    out[index] = value
    return out


# graph passes that drop unread nodes must keep a write whose result nobody reads (like operator.setitem)
fx.node._side_effectful_functions.add(setitem_)

__all__ = ["setitem", "setitem_"]
