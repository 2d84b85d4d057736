"""Look-ups of user-given module names and types, with helpful errors."""

from __future__ import annotations

import difflib
import inspect
import sys
from typing import Iterable, Optional

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


TYPES_LISTED = 30  # module types named in an error, at most


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _loaded(name: str) -> object:
    """What the dotted ``name`` reaches from a module already in ``sys.modules``; None if nothing.

    Attributes are looked up statically: a module's ``__getattr__`` (which may import) never runs."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        try:
            for part in parts[i:]:
                obj = inspect.getattr_static(obj, part)
        except AttributeError:
            continue
        return obj
    return None


def _model_types(model: Optional[nn.Module]) -> str:
    """``; the model's module types: a.B, c.D`` (at most TYPES_LISTED), or "" without a model."""
    if model is None:
        return ""
    names = sorted({_dotted(type(m)) for m in model.modules()})
    shown = ", ".join(names[:TYPES_LISTED]) + (f", ... (+{len(names) - TYPES_LISTED})"
                                               if len(names) > TYPES_LISTED else "")
    return f"; the model's module types: {shown}"


def resolve_type(spec, key: str, model: Optional[nn.Module] = None) -> type:
    """A module class given as a class or as a dotted name like ``torch.nn.PReLU``.

    A name is never imported: names come from config files, and importing one would run any
    installed module. It matches a class of ``model``'s modules, or a base of one, by
    ``__module__.__qualname__``, or else a class reached through modules already loaded (so
    ``torch.nn.PReLU`` works for a model without PReLU, and the caller can warn). Anything else is
    a ConfigError naming ``key`` and listing the model's module types.
    """
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise ConfigError(f"{key}: {spec.__qualname__} is not an nn.Module subclass")
        return spec
    if isinstance(spec, str) and "." in spec:
        ours = {} if model is None else {_dotted(c): c for m in model.modules() for c in type(m).__mro__}
        typ = ours.get(spec) or _loaded(spec)
        if isinstance(typ, type) and issubclass(typ, nn.Module):
            return typ
        if isinstance(typ, type):
            reason = f"{_dotted(typ)} is not an nn.Module subclass"
        elif typ is not None:
            reason = f"it names a {type(typ).__name__}, not a class"
        else:
            reason = ("not a class of the model's modules or their bases, nor of a loaded module"
                      if model is not None else "not a class of a loaded module") + " (names are never imported)"
        raise ConfigError(f"{key}: cannot import module type {spec!r}: {reason}{_model_types(model)}")
    raise ConfigError(
        f"{key}: expected an nn.Module class or a dotted path like 'torch.nn.PReLU', got {spec!r}"
        + _model_types(model)
    )
