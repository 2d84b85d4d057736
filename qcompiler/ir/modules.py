"""Small helpers for the submodules of a GraphModule that several passes need."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn


def set_module(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    """Install ``module`` at the dotted ``path`` (replacing what is there)."""
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)


def free_name(gm: fx.GraphModule, base: str, sep: str = "_") -> str:
    """``base``, or ``base<sep>1``, ``base<sep>2``... : a root attribute name not yet used on ``gm``."""
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}{sep}{k}", k + 1
    return name
