"""Look-ups of user-given module names and types, with helpful errors."""

from __future__ import annotations

import difflib
import importlib
from typing import Iterable

import torch.nn as nn

from qcompiler.errors import ConfigError


def check_module_names(model: nn.Module, names: Iterable[str], key: str) -> None:
    """Raise ConfigError if a name is not a submodule path of ``model``, suggesting close ones."""
    known = [n for n, _ in model.named_modules() if n]
    known_set = set(known)
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"{key}: expected module names (str), got {name!r} ({type(name).__name__})")
        if name not in known_set:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(
                f"{key}: module {name!r} is not in the model {type(model).__name__}.{hint} "
                f"Names are dotted paths as printed by model.named_modules()."
            )


def resolve_type(spec, key: str) -> type:
    """A module class given as a class or as a dotted path ``package.module.Class``."""
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise ConfigError(f"{key}: {spec.__qualname__} is not an nn.Module subclass")
        return spec
    if isinstance(spec, str) and "." in spec:
        mod_name, _, attr = spec.rpartition(".")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{key}: cannot import module type {spec!r}: {exc}") from None
        return resolve_type(obj, key)
    raise ConfigError(
        f"{key}: expected an nn.Module class or a dotted path like 'torch.nn.PReLU', got {spec!r}"
    )
