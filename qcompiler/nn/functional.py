"""Float functions the compiler's rewrites call, so that a fused node is an ordinary call.

:func:`masked_softmax` is ``softmax(masked_fill(x, fill, -inf), dim)`` as one op (``passes/masked_softmax.py``
writes it): on nash the BPU runs it as ``fixed_point.int_masked_softmax``, on other marches the CPU runs
this float definition.
"""

from __future__ import annotations

import torch


def masked_softmax(input: torch.Tensor, mask: torch.Tensor, dim: int, fill_mask_is_true: bool = True
                   ) -> torch.Tensor:
    """``torch.softmax(input.masked_fill(fill, -inf), dim)`` with ``fill = mask`` (``fill_mask_is_true``)
    or ``fill = ~mask``; ``mask`` broadcasts to ``input``. A bool mask, or its 0/1 codes as numbers
    (the fake-quant model carries the quantized mask as 0.0 / 1.0: nonzero is True).

    Equal to torch's expression bit for bit where a row (the positions along ``dim``) keeps at least
    one position; a row with every position filled is 0 everywhere (torch gives NaN there: 0 / 0),
    the integer kernel's definition too."""
    m = mask if mask.dtype == torch.bool else mask != 0
    fill = m if fill_mask_is_true else torch.logical_not(m)
    y = torch.softmax(input.masked_fill(fill, float("-inf")), dim)
    dead = fill.expand(y.shape).all(dim, keepdim=True)
    return y.masked_fill(dead, 0.0)


__all__ = ["masked_softmax"]
