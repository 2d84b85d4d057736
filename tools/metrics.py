"""Output metrics of the numeric tools, and the per-layer comparison's columns.

Shared by :mod:`.quant_analysis` (which computes them) and :mod:`.report` (which draws them),
so that neither imports the other's module (docs/design.md, "Layers").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qcompiler.compat.torch_private import pytree
from qcompiler.errors import ConfigError
from qcompiler.ir.structure import is_structured
from qcompiler.quantization.qtensor import QTensor

__all__ = ["METRICS", "COMPARE_COLUMNS", "compute_metric"]

METRICS = ("L1", "COSINE", "ATOL", "SQNR")
# metric -> True when a larger value is worse
_LARGER_IS_WORSE = {"L1": True, "ATOL": True, "COSINE": False, "SQNR": False}
COMPARE_COLUMNS = (
    "index", "mod_name", "base_op_type", "analy_op_type", "shape", "quant_dtype", "qscale",
    "Cosine", "L1", "Atol", "max_qscale_diff",
    "base_min", "base_max", "base_mean", "analy_min", "analy_max", "analy_mean",
)


def _check_metric(metric: str) -> str:
    m = str(metric).upper()
    if m not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; allowed: {', '.join(METRICS)}")
    return m


def _to_float(x: Any, copy: bool = False) -> Any:
    """Dequantize QTensors (anything with ``dequantize``), recursively through tuples/lists/dicts.

    ``copy``: tensors are copied, not detached views.  A recorder that keeps a layer's output needs
    it: a later in-place op of the model (``y += 1``, an ``inplace=True`` activation) would otherwise
    change the recorded value."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone() if copy else x.detach()
    if isinstance(x, QTensor):
        return x.dequantize().detach()
    if isinstance(x, (tuple, list)):
        items = (_to_float(v, copy) for v in x)
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        return {k: _to_float(v, copy) for k, v in x.items()}
    return x


def _flat(x: Any) -> list[torch.Tensor]:
    x = _to_float(x)
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _flat(x[k])]
    return []


def _cat(x: Any) -> torch.Tensor:
    ts = [t.double().reshape(-1) for t in _flat(x) if t.is_floating_point() or not t.dtype.is_complex]
    return torch.cat(ts) if ts else torch.zeros(0, dtype=torch.float64)


def compute_metric(metric: str, base: Any, analy: Any) -> float:
    """L1 (mean abs diff), ATOL (max abs diff), COSINE similarity or SQNR (dB) of analy vs base.

    A structured output (a dict, ModelOutput, namedtuple) against a flat one (what a prepared or
    converted graph returns for it, :mod:`qcompiler.ir.structure`) is compared leaf by leaf in the
    structure's own order; two dicts by sorted key, as always."""
    metric = _check_metric(metric)
    if is_structured(base) != is_structured(analy):
        base, analy = (tuple(pytree.tree_leaves(v)) if is_structured(v) else v for v in (base, analy))
    b, a = _cat(base), _cat(analy)
    if b.numel() != a.numel():
        raise ConfigError(f"the two models' outputs differ in size ({b.numel()} vs {a.numel()} values): "
                          "they do not correspond")
    if b.numel() == 0:
        return float("nan")
    d = a - b
    if metric == "L1":
        return float(d.abs().mean())
    if metric == "ATOL":
        return float(d.abs().max())
    if metric == "COSINE":
        nb, na = float(b.norm()), float(a.norm())
        if nb == 0 and na == 0:
            return 1.0
        if nb == 0 or na == 0:
            return 0.0
        return float((a * b).sum() / (nb * na))
    sig, err = float((b * b).sum()), float((d * d).sum())
    if err == 0:
        return float("inf")
    if sig == 0:
        return float("-inf")
    return 10 * math.log10(sig / err)
