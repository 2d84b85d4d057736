"""One convention for calibration and analysis data: a batch is the model's positional
arguments as a tuple or list, or a single tensor for a one-input model."""

from __future__ import annotations

from typing import Any


def as_args(batch: Any) -> tuple:
    """The positional arguments a batch stands for."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
