"""qcompiler's own model zoo: small, deterministic reference models for tests and demos.

The registry is a plain data table (:data:`MODELS`, name -> :class:`ModelSpec`).
Use :func:`names` to list models, :func:`get` to build one (fresh, eval mode,
weights fixed by a per-model seed, global RNG untouched), :func:`example_inputs`
for matching deterministic positional inputs and :func:`describe` for a
one-paragraph summary.  Unknown names raise :class:`~qcompiler.errors.ConfigError`
with close-match suggestions.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Tuple

from torch import nn

from qcompiler.errors import ConfigError

from . import hybrid as _hybrid
from . import lstm as _lstm
from . import mobilenet as _mobilenet
from . import resnet as _resnet
from . import transformer as _transformer
from . import unet as _unet

__all__ = ["ModelSpec", "MODELS", "names", "get", "example_inputs", "describe", "spec"]


@dataclass(frozen=True)
class ModelSpec:
    """One zoo entry: how to build the model and its inputs, and what it is."""

    factory: Callable[..., nn.Module]
    """Builds the model; keyword args only (sizes such as ``num_classes``)."""
    example_inputs: Callable[..., tuple]
    """``(batch=1, **kwargs) -> tuple`` of positional forward args."""
    input_shape: Tuple[int, ...]
    """Shape of the first default example input (batch 1)."""
    description: str


_MODELS: Dict[str, ModelSpec] = {
    "resnet18": ModelSpec(
        _resnet.resnet18, _resnet.example_inputs, _resnet.INPUT_SHAPE,
        "ResNet-18 (torchvision layout, BasicBlock x [2,2,2,2], 11.7M params); "
        "BN stats perturbed so BN folding is observable.",
    ),
    "resnet50": ModelSpec(
        _resnet.resnet50, _resnet.example_inputs, _resnet.INPUT_SHAPE,
        "ResNet-50 (torchvision layout, Bottleneck x [3,4,6,3], 25.6M params); "
        "BN stats perturbed so BN folding is observable.",
    ),
    "mobilenet_v2": ModelSpec(
        _mobilenet.mobilenet_v2, _mobilenet.example_inputs, _mobilenet.INPUT_SHAPE,
        "MobileNetV2 (torchvision layout, depthwise convs, ReLU6, inverted residuals, 3.5M params); "
        "BN stats perturbed.",
    ),
    "unet": ModelSpec(
        _unet.unet, _unet.example_inputs, _unet.INPUT_SHAPE,
        "Small 3-level UNet (16/32/64 channels): skip concatenation, max-pool, bilinear "
        "interpolate and nearest nn.Upsample; 2-class 1x1 head.",
    ),
    "transformer_block": ModelSpec(
        _transformer.transformer_block, _transformer.example_inputs, _transformer.INPUT_SHAPE,
        "One explicit pre-norm transformer encoder block (d_model 64, 4 heads, FFN 128, GELU), "
        "attention written with matmul/softmax; fx-traceable.",
    ),
    "lstm_seq": ModelSpec(
        _lstm.lstm_seq, _lstm.example_inputs, _lstm.INPUT_SHAPE,
        "Embedding(100, 32) -> LSTM(32, 64) -> Linear(64, 10) per step; forward(tokens, (h0, c0)) "
        "returns (logits, (h_n, c_n)).",
    ),
    "hybrid": ModelSpec(
        _hybrid.hybrid, _hybrid.example_inputs, _hybrid.INPUT_SHAPE,
        "The hybrid BPU/CPU QAT guide model: QuantStub, 1x1 convs, PReLU, SELU (module and "
        "functional), a reused nn.Identity, DeQuantStub.",
    ),
}

MODELS: Mapping[str, ModelSpec] = MappingProxyType(_MODELS)
"""Read-only view of the registry table."""


def names() -> List[str]:
    """Sorted names of all zoo models."""
    return sorted(_MODELS)


def spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; raises ConfigError for unknown names."""
    if not isinstance(name, str):
        raise ConfigError(f"zoo model name must be a str, got {type(name).__name__}; "
                          f"known models: {', '.join(names())}")
    try:
        return _MODELS[name]
    except KeyError:
        pass
    close = difflib.get_close_matches(name, names(), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"unknown zoo model {name!r}.{hint} Known models: {', '.join(names())}.")


def _params(fn: Callable[..., Any]) -> Dict[str, inspect.Parameter]:
    """Named keyword parameters of ``fn`` (ignores ``*args``/``**kwargs`` catch-alls)."""
    return {
        p.name: p for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _check_kwargs(name: str, what: str, kwargs: Mapping[str, Any], allowed: Mapping[str, inspect.Parameter]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        opts = ", ".join(f"{k}={p.default!r}" for k, p in allowed.items())
        raise ConfigError(f"zoo model {name!r}: unknown {what} argument(s) {unknown}; accepted: {opts}")


def get(name: str, **kwargs: Any) -> nn.Module:
    """Build a fresh ``name`` model in eval mode with deterministic weights.

    ``kwargs`` override the factory's size defaults (e.g. ``num_classes=10``).
    The global RNG state is not changed.
    """
    entry = spec(name)
    _check_kwargs(name, "model", kwargs, _params(entry.factory))
    model = entry.factory(**kwargs)
    return model.eval()


def example_inputs(name: str, batch: int = 1, **kwargs: Any) -> tuple:
    """Deterministic positional inputs for ``name`` with batch size ``batch``.

    ``kwargs`` may repeat model kwargs given to :func:`get` (those that change
    input shapes, e.g. ``channels`` for ``hybrid``, are honoured; others are
    ignored) or input-only options such as ``image_size``.
    """
    entry = spec(name)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"zoo model {name!r}: batch must be a positive int, got {batch!r}")
    allowed = dict(_params(entry.factory))
    allowed.update((k, p) for k, p in _params(entry.example_inputs).items() if k != "batch")
    _check_kwargs(name, "example-input", kwargs, allowed)
    return entry.example_inputs(batch=batch, **kwargs)


def describe(name: str) -> str:
    """One-paragraph human summary: what the model is, default input and options."""
    entry = spec(name)
    opts = ", ".join(f"{k}={p.default!r}" for k, p in _params(entry.factory).items())
    return (f"{name}: {entry.description} Default input shape: {tuple(entry.input_shape)}. "
            f"Options: {opts or 'none'}.")
