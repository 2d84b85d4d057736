"""``hybrid_dict``: the user's list of modules that must run on the CPU."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.ir.meta import ScopeEntry, scope
from qcompiler.ir.names import check_module_names, resolve_type

HYBRID_KEYS = ("module_type", "module_name")


@dataclass(frozen=True)
class HybridConfig:
    """Validated hybrid_dict: module paths and module classes forced to the CPU."""

    module_names: tuple[str, ...] = ()
    module_types: tuple[type, ...] = ()

    def match(self, node: fx.Node) -> Optional[str]:
        """The reason a node is forced to the CPU, or None.

        A node matches when it is, or was created inside, a named module or a module
        of a listed type. ``module_name`` is reported over ``module_type``
        (priority module_type < module_name).
        """
        entries = scope(node)
        for name in self.module_names:
            if any(_within(e, name) for e in entries):
                return f'hybrid_dict module_name "{name}"'
        for typ in self.module_types:
            if any(e.path and issubclass(e.module_type, typ) for e in entries):
                return f"hybrid_dict module_type {typ.__qualname__}"
        return None

    def differences(self, other: "HybridConfig") -> list[str]:
        """What ``other`` forces to the CPU that this config does not, and the reverse.

        Order and repeats do not matter: both lists are sets of modules forced to the CPU.
        """
        def listed(cfg: "HybridConfig") -> tuple[set[str], set[str]]:
            return set(cfg.module_names), {t.__qualname__ for t in cfg.module_types}

        (names, types), (other_names, other_types) = listed(self), listed(other)
        diffs = []
        for key, mine, theirs in (("module_name", names, other_names), ("module_type", types, other_types)):
            if theirs - mine:
                diffs.append(f"{key} {sorted(theirs - mine)} added")
            if mine - theirs:
                diffs.append(f"{key} {sorted(mine - theirs)} missing")
        return diffs


def _within(entry: ScopeEntry, name: str) -> bool:
    return entry.path == name or entry.path.startswith(name + ".")


def parse_hybrid_dict(hybrid_dict: Any, model: Optional[nn.Module]) -> HybridConfig:
    """Validate ``hybrid_dict`` against ``model``; ConfigError naming the bad key or name.

    A ``module_type`` that matches no module of the model is legal but warned about. A type given by
    name must name a class of the model's modules (or a base of one), or one of a module already
    loaded: names are never imported.
    With ``model=None`` only the form is checked (for comparing configs).
    """
    if hybrid_dict is None:
        return HybridConfig()
    if isinstance(hybrid_dict, HybridConfig):
        return hybrid_dict
    if not isinstance(hybrid_dict, dict):
        raise ConfigError(
            f"hybrid_dict must be a dict with keys {list(HYBRID_KEYS)}, got {type(hybrid_dict).__name__}"
        )
    unknown = [k for k in hybrid_dict if k not in HYBRID_KEYS]
    if unknown:
        raise ConfigError(f"hybrid_dict: unknown key {unknown[0]!r}; allowed keys: {', '.join(HYBRID_KEYS)}")
    names = hybrid_dict.get("module_name") or []
    types = hybrid_dict.get("module_type") or []
    for key, value in (("module_name", names), ("module_type", types)):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"hybrid_dict['{key}'] must be a list, got {type(value).__name__}")
    # names are matched against the model's classes, never imported (see resolve_type)
    resolved = tuple(resolve_type(t, f"hybrid_dict['module_type'][{i}]", model) for i, t in enumerate(types))
    if model is None:
        return HybridConfig(tuple(names), resolved)
    check_module_names(model, names, "hybrid_dict['module_name']")
    for typ in resolved:
        if not any(isinstance(m, typ) for _, m in model.named_modules()):
            warnings.warn(
                f"hybrid_dict['module_type']: no module of type {typ.__qualname__} in "
                f"{type(model).__name__}; the entry has no effect",
                QCompilerWarning,
                stacklevel=3,
            )
    return HybridConfig(tuple(names), resolved)
