"""Run a user's model for inspection without changing it (shared by the debugging tools).

A model in train mode would update its BatchNorm running statistics (and compute
with batch statistics), and enabled observers would move its quantization
scales: a tool that only looks at a model must leave it as it found it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from qcompiler.batches import fresh_args
from qcompiler.errors import ConfigError
from qcompiler.ir.shape_prop import eval_mode
from qcompiler.quantization.fake_quantize import FakeQuantizeBase

__all__ = ["evaluating", "run_inspected"]


@contextlib.contextmanager
def _observers_off(model: nn.Module) -> Iterator[None]:
    """Stop every fake quant's observer; restore each switch on exit."""
    saved = [(m, m.observer_enabled.clone()) for m in model.modules() if isinstance(m, FakeQuantizeBase)]
    for m, _ in saved:
        m.disable_observer()
    try:
        yield
    finally:
        for m, state in saved:
            m.observer_enabled.copy_(state)


@contextlib.contextmanager
def evaluating(*models: Any) -> Iterator[None]:
    """Eval mode, observers off and no_grad for ``models`` (non-modules only get no_grad);
    every training flag and observer switch is restored on exit, also on error."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if isinstance(model, nn.Module):
                stack.enter_context(eval_mode(model))
                stack.enter_context(_observers_off(model))
        stack.enter_context(torch.no_grad())
        yield


def run_inspected(model: Any, which: str, args: tuple) -> Any:
    """``model(*args)`` under :func:`evaluating`; a failure is a ConfigError naming ``which`` model
    (e.g. "baseline") and the inputs, chained to the original error, not a traceback from torch."""
    try:
        with evaluating(model):
            return model(*fresh_args(args))  # a model may change its input in place; it is run again
    except ConfigError:
        raise
    except Exception as e:
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)
        raise ConfigError(f"the {which} model ({type(model).__name__}) failed on the given inputs ({shapes}): "
                          f"{type(e).__name__}: {e}; check that the data matches the model's inputs") from e
