"""torch.ao QConfigs, translated to the march's scheme.

Models written for torch.ao's quantization carry ``module.qconfig`` attributes (a
torch.ao ``QConfig`` of observer factories) and may be prepared with a
``QConfigMapping``. The BPU computes on symmetric int8 / int16 with zero point 0
(MARCH_OPS.md), so such a config cannot be taken literally. It is translated:

* the activation observer's family is kept where qcompiler has one
  (``HistogramObserver`` -> ``histogram-mse``, ``MinMaxObserver`` /
  ``MovingAverageMinMaxObserver`` -> ``minmax``); a QAT prepare uses qcompiler's
  moving-average ``FakeQuantize``;
* the dtype becomes ``qint8`` (``quint8`` / ``qint8``, affine or symmetric) or ``qint16``
  (16-bit ranges), always symmetric with zero point 0; ``reduce_range`` is dropped;
* weights are observed per output channel (axis 0), symmetric int8;
* a dynamic (``PlaceholderObserver``) or float16 config keeps the op float, on the CPU.

Every change is recorded as text; ``prepare`` reports them in one warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from qcompiler.compat import torch_ao as ao
from qcompiler.errors import ConfigError

__all__ = ["KEEP_FLOAT", "NOT_QUANTIZED", "AoTranslation", "is_torch_ao_qconfig", "translate", "qconfig_mapping_to_dict"]

KEEP_FLOAT = "float"  # translate(): the op stays float (on the CPU)


class _NotQuantized:
    """A ``None`` entry of a QConfigMapping: torch.ao's "not quantized" (a qconfig_dict None is
    a missing config, an error for a BPU op; this one keeps the op float on the CPU)."""

    def __repr__(self) -> str:
        return "NOT_QUANTIZED"


NOT_QUANTIZED = _NotQuantized()

# torch.ao activation observer class name -> qcompiler observer name (calibration)
_OBSERVER_FAMILY = {
    "HistogramObserver": "histogram-mse",
    "MinMaxObserver": "minmax",
    "MovingAverageMinMaxObserver": "minmax",
    "PerChannelMinMaxObserver": "minmax",
    "MovingAveragePerChannelMinMaxObserver": "minmax",
}
_FLOAT_OBSERVERS = ("PlaceholderObserver", "NoopObserver")


@dataclass(frozen=True)
class AoTranslation:
    """A torch.ao QConfig in qcompiler terms: the observer family (or KEEP_FLOAT), the dtype, what changed."""

    observer: str
    dtype: str
    changes: tuple[str, ...]


def is_torch_ao_qconfig(value: Any) -> bool:
    return ao.is_qconfig(value)


def _observer(factory: Any, where: str) -> Any:
    """An instance of the observer a torch.ao factory builds (a fake quant's inner observer)."""
    try:
        obj = factory()
    except Exception as exc:  # a user's factory: report it, naming where it came from
        raise ConfigError(f"{where}: the torch.ao observer factory {factory!r} failed "
                          f"({type(exc).__name__}: {exc})") from None
    return getattr(obj, "activation_post_process", obj)


def _bits(obs: Any) -> int:
    lo, hi = getattr(obs, "quant_min", None), getattr(obs, "quant_max", None)
    if isinstance(lo, int) and isinstance(hi, int):
        return max(hi - lo + 1, 2).bit_length() - 1
    return 8


def translate(value: Any, where: str) -> AoTranslation:
    """The qcompiler equivalent of the torch.ao QConfig ``value`` (found at ``where``)."""
    act = _observer(value.activation, f"{where}.activation") if value.activation is not None else None
    name = type(act).__name__ if act is not None else "None"
    dtype = getattr(act, "dtype", None)
    if act is None or name in _FLOAT_OBSERVERS or dtype in (torch.float16, torch.float32, torch.bfloat16):
        kind = "dynamic / float" if act is not None else "no activation observer"
        return AoTranslation(KEEP_FLOAT, "qint8", (f"{name} ({kind}): not a BPU scheme, the op stays float "
                                                   f"on the CPU",))
    changes = []
    family = _OBSERVER_FAMILY.get(name)
    if family is None:
        family = "minmax"
        changes.append(f"{name} has no qcompiler equivalent: minmax")
    else:
        changes.append(f"{name} -> {family}")
    bits = _bits(act)
    ours = "qint16" if bits > 8 else "qint8"
    scheme = str(getattr(act, "qscheme", "")).replace("torch.", "")
    if dtype != torch.qint8 or "symmetric" not in scheme or bits not in (8, 16):
        changes.append(f"{str(dtype).replace('torch.', '')} {scheme or 'per_tensor'} -> {ours} symmetric, zero point 0")
    if getattr(act, "reduce_range", False):
        changes.append("reduce_range dropped (the BPU accumulates in int32 without it)")
    if value.weight is not None:
        w = _observer(value.weight, f"{where}.weight")
        w_scheme = str(getattr(w, "qscheme", ""))
        if "per_channel" not in w_scheme or "symmetric" not in w_scheme or getattr(w, "dtype", None) != torch.qint8:
            changes.append(f"weight {type(w).__name__} ({str(getattr(w, 'dtype', '')).replace('torch.', '')}, "
                           f"{w_scheme.replace('torch.', '')}) -> qint8 symmetric per output channel")
    return AoTranslation(family, ours, tuple(changes))


def qconfig_mapping_to_dict(mapping: Any) -> tuple[dict, list[str]]:
    """A torch.ao ``QConfigMapping`` as a qconfig_dict (its torch.ao QConfigs are translated
    when the dict is parsed), plus what has no qconfig_dict form and is left out."""
    out: dict = {"": mapping.global_qconfig}
    dropped = []
    types = [(t, NOT_QUANTIZED if qc is None else qc) for t, qc in mapping.object_type_qconfigs.items()
             if isinstance(t, type)]
    dropped += [f"object_type {getattr(t, '__name__', t)!r} (a function: use the module that calls it)"
                for t in mapping.object_type_qconfigs if not isinstance(t, type)]
    if types:
        out["module_type"] = types
    if mapping.module_name_qconfigs:
        out["module_name"] = [(n, NOT_QUANTIZED if qc is None else qc) for n, qc in mapping.module_name_qconfigs.items()]
    dropped += [f"module_name_regex {r!r}" for r in mapping.module_name_regex_qconfigs]
    dropped += [f"module_name_object_type_order {k!r}" for k in mapping.module_name_object_type_order_qconfigs]
    return out, dropped


def is_qconfig_mapping(value: Any) -> bool:
    return ao.is_qconfig_mapping(value)


def describe(value: Any) -> str:
    """Short name of a torch.ao QConfig for messages."""
    try:
        act = _observer(value.activation, "") if value.activation is not None else None
    except ConfigError:
        act = None
    return f"torch.ao QConfig({type(act).__name__ if act is not None else 'None'})"
