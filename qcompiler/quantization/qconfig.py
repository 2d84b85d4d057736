"""QConfig: how an op's output and weight are observed / fake-quantized; qconfig_dict parsing.

A :class:`QConfig` holds zero-argument factories (each call builds a fresh
module) for the output (``activation``) and the weight, plus the dtypes.
The defaults follow the hybrid QAT guide:

* :func:`get_default_calib_qconfig`: ``CalibFakeQuantize`` everywhere (the
  calibration model returns exactly the float outputs); activations use a
  histogram observer, weights only record per-channel min/max.
* :func:`get_default_qat_qconfig`: ``FakeQuantize`` with moving-average
  min/max observers, per tensor for activations, per output channel (axis 0)
  for weights.
* :func:`get_default_qat_out_qconfig`: high-precision output -- the op emits
  its int32 accumulator with its scale, so there is no output fake quant.

A ``qconfig_dict`` (``{"": qc, "module_type": [(type, qc), ...],
"module_name": [(name, qc), ...]}``) is validated by
:func:`parse_qconfig_dict` into a :class:`QConfigResolver`, which answers
"which qconfig does the node with this module scope get?" with the priority
``global < module_type < module_name < module.qconfig``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn

from qcompiler.errors import ConfigError
from qcompiler.ir.meta import ScopeEntry
from qcompiler.ir.names import check_module_names, resolve_type
from qcompiler.quantization import torch_ao
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qcompiler.quantization.observer import (
    OBSERVERS,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    check_dtype,
    make_observer,
)

__all__ = [
    "QConfig",
    "KINDS",
    "get_default_calib_qconfig",
    "get_default_calib_out_qconfig",
    "get_default_qat_qconfig",
    "get_default_qat_out_qconfig",
    "QCONFIG_DICT_KEYS",
    "QConfigResolver",
    "parse_qconfig_dict",
    "with_activation_dtype",
]

KINDS = ("calibration", "qat")
QCONFIG_DICT_KEYS = ("", "module_type", "module_name")


@dataclass(frozen=True)
class QConfig:
    """How to quantize one op: output and weight factories, dtypes, kind.

    ``activation``/``weight``: zero-argument factories returning an observer
    or fake-quant module, or None (not observed).  ``out_high_precision``:
    the op emits its int32 accumulator with its scale, so ``activation`` must
    be None.  ``kind``: ``"calibration"`` or ``"qat"``.
    """

    activation: Optional[Callable[[], nn.Module]] = None
    weight: Optional[Callable[[], nn.Module]] = None
    dtype: str = "qint8"
    weight_dtype: str = "qint8"
    out_high_precision: bool = False
    kind: str = "qat"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", check_dtype(self.dtype, "QConfig.dtype"))
        object.__setattr__(self, "weight_dtype", check_dtype(self.weight_dtype, "QConfig.weight_dtype"))
        for field in ("activation", "weight"):
            f = getattr(self, field)
            if f is not None and (not callable(f) or isinstance(f, nn.Module)):
                raise ConfigError(
                    f"QConfig.{field} must be a zero-argument factory (e.g. a class or "
                    f"functools.partial) or None, got {f!r}; pass the factory, not a module instance"
                )
        if not isinstance(self.out_high_precision, bool):
            raise ConfigError(f"QConfig.out_high_precision must be a bool, got {self.out_high_precision!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"QConfig.kind: unknown kind {self.kind!r}; allowed: "
                              + ", ".join(repr(k) for k in KINDS))
        if self.out_high_precision and self.activation is not None:
            raise ConfigError("QConfig: out_high_precision=True emits the int32 accumulator, so the "
                              "output has no fake quant; set activation=None")


@dataclass(frozen=True)
class _Factory:
    """A picklable, comparable zero-argument factory with a readable repr."""

    label: str
    fn: Callable[..., nn.Module]
    args: tuple = ()

    def __call__(self) -> nn.Module:
        return self.fn(*self.args)

    def __repr__(self) -> str:
        return self.label


def _calib_activation(observer: str, dtype: str) -> nn.Module:
    return CalibFakeQuantize(make_observer(observer, dtype))


def _calib_weight(dtype: str) -> nn.Module:
    return CalibFakeQuantize(PerChannelMinMaxObserver(ch_axis=0, dtype=dtype))


def _qat_activation(dtype: str) -> nn.Module:
    return FakeQuantize(MovingAverageMinMaxObserver(dtype=dtype), dtype)


def _qat_weight(dtype: str) -> nn.Module:
    return FakeQuantize(MovingAveragePerChannelMinMaxObserver(ch_axis=0, dtype=dtype), dtype, ch_axis=0)


def _check_observer(name: Any) -> str:
    if not isinstance(name, str) or name not in OBSERVERS:
        raise ConfigError(f"unknown observer {name!r}; allowed: " + ", ".join(repr(k) for k in OBSERVERS))
    return name


def _weight_factory(kind: str, weight_dtype: str) -> _Factory:
    if kind == "calibration":
        return _Factory(f"CalibFakeQuantize(PerChannelMinMaxObserver, ch_axis=0, dtype={weight_dtype})",
                        _calib_weight, (weight_dtype,))
    return _Factory(f"FakeQuantize(MovingAveragePerChannelMinMaxObserver, ch_axis=0, dtype={weight_dtype})",
                    _qat_weight, (weight_dtype,))


def get_default_calib_qconfig(dtype="qint8", observer: str = "histogram-mse",
                              weight_dtype="qint8") -> QConfig:
    """Calibration: activations ``CalibFakeQuantize(<observer>)``, weights record per-channel min/max."""
    dtype = check_dtype(dtype)
    weight_dtype = check_dtype(weight_dtype, "weight_dtype")
    observer = _check_observer(observer)
    return QConfig(
        activation=_Factory(f"CalibFakeQuantize({observer}, dtype={dtype})", _calib_activation,
                            (observer, dtype)),
        weight=_weight_factory("calibration", weight_dtype),
        dtype=dtype, weight_dtype=weight_dtype, kind="calibration",
    )


def get_default_calib_out_qconfig(weight_dtype="qint8") -> QConfig:
    """Calibration for a high-precision output op: no output observer, weights recorded."""
    weight_dtype = check_dtype(weight_dtype, "weight_dtype")
    return QConfig(activation=None, weight=_weight_factory("calibration", weight_dtype),
                   weight_dtype=weight_dtype, out_high_precision=True, kind="calibration")


def get_default_qat_qconfig(dtype="qint8", weight_dtype="qint8") -> QConfig:
    """QAT: moving-average min/max ``FakeQuantize``; activations per tensor, weights per channel (axis 0)."""
    dtype = check_dtype(dtype)
    weight_dtype = check_dtype(weight_dtype, "weight_dtype")
    return QConfig(
        activation=_Factory(f"FakeQuantize(MovingAverageMinMaxObserver, dtype={dtype})",
                            _qat_activation, (dtype,)),
        weight=_weight_factory("qat", weight_dtype),
        dtype=dtype, weight_dtype=weight_dtype, kind="qat",
    )


def get_default_qat_out_qconfig(weight_dtype="qint8") -> QConfig:
    """QAT with a high-precision output: the op emits its int32 accumulator, no output fake quant."""
    weight_dtype = check_dtype(weight_dtype, "weight_dtype")
    return QConfig(activation=None, weight=_weight_factory("qat", weight_dtype),
                   weight_dtype=weight_dtype, out_high_precision=True, kind="qat")


def with_activation_dtype(qc: QConfig, dtype: str) -> Optional[QConfig]:
    """``qc`` with its output quantized as ``dtype`` (same observer, same weights), or None when its
    activation factory is not one of the defaults above (a user's own factory is left as it is)."""
    dtype = check_dtype(dtype)
    f = qc.activation
    if not isinstance(f, _Factory):
        return None
    if f.fn is _calib_activation:
        observer = f.args[0]
        act = _Factory(f"CalibFakeQuantize({observer}, dtype={dtype})", _calib_activation, (observer, dtype))
    elif f.fn is _qat_activation:
        act = _Factory(f"FakeQuantize(MovingAverageMinMaxObserver, dtype={dtype})", _qat_activation, (dtype,))
    else:
        return None
    return QConfig(activation=act, weight=qc.weight, dtype=dtype, weight_dtype=qc.weight_dtype,
                   out_high_precision=qc.out_high_precision, kind=qc.kind)


# ---------------------------------------------------------------------------
# qconfig_dict

_MISSING = object()


class _Coercer:
    """Checks qconfig values and translates torch.ao ones (:mod:`.torch_ao`) to the scheme of ``kind``,
    once per object, recording what changed (``notes``, by where the config was found)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.notes: dict[str, str] = {}
        self._cache: dict[int, tuple[Any, Optional[QConfig]]] = {}

    def __call__(self, value: Any, where: str) -> Optional[QConfig]:
        if value is None or isinstance(value, QConfig):
            return value
        if value is torch_ao.NOT_QUANTIZED:
            self.notes[where] = "None in a torch.ao QConfigMapping (not quantized): the op stays float on the CPU"
            return None
        if not torch_ao.is_torch_ao_qconfig(value):
            raise ConfigError(f"{where} must be a qcompiler QConfig or None (or a torch.ao QConfig, which is "
                              f"translated), got {type(value).__name__}")
        hit = self._cache.get(id(value))
        if hit is None:
            t = torch_ao.translate(value, where)
            if t.observer == torch_ao.KEEP_FLOAT:
                qc = None
            elif self.kind == "calibration":
                qc = get_default_calib_qconfig(dtype=t.dtype, observer=t.observer)
            else:
                qc = get_default_qat_qconfig(dtype=t.dtype)
            hit = self._cache[id(value)] = (value, qc)  # keep value alive: ids stay unique
            self.notes[where] = f"{torch_ao.describe(value)}: {'; '.join(t.changes)}"
        return hit[1]

    def rename(self, where: str, new: str) -> None:
        """File the note made at ``where`` (an entry's index) under ``new`` (what it configures)."""
        if where in self.notes:
            self.notes[new] = self.notes.pop(where)


def _pairs(value: Any, key: str, first: str, coerce: "_Coercer") -> list[tuple[Any, Any]]:
    shape = f"qconfig_dict[{key!r}] must be a list of ({first}, QConfig or None) pairs"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(f"{shape}, got {type(value).__name__}")
    if len(value) == 2 and not isinstance(value[0], (list, tuple)):
        raise ConfigError(f"{shape}, got a single pair {tuple(value)!r}; wrap it in a list")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise ConfigError(f"{shape}; entry {i} is {item!r}")
        out.append((item[0], coerce(item[1], f"qconfig_dict[{key!r}][{i}][1]")))
    return out


class QConfigResolver:
    """Answers which qconfig a node gets from its module scope.

    Priority (lowest first): the global qconfig ``""`` (a ``qconfig``
    attribute on the root model acts at this level and overrides ``""``) <
    ``module_type`` < ``module_name`` < a ``qconfig`` attribute on a
    (non-root) module of the scope.  Within each level the innermost
    matching scope entry wins, so a functional op inside ``conv1`` inherits
    ``conv1``'s qconfig and ``"conv1"`` covers ``"conv1.conv"`` unless that
    has its own entry.  A ``module_type`` entry matches the exact class first,
    then a subclass (first listed wins).  A ``qconfig`` attribute set to None
    means "not quantized" and overrides the levels below it.
    """

    def __init__(self, model: nn.Module, global_qconfig: Optional[QConfig] = None,
                 module_type: Sequence[tuple[type, Optional[QConfig]]] = (),
                 module_name: Optional[Mapping[str, Optional[QConfig]]] = None, *,
                 coerce: Optional[_Coercer] = None) -> None:
        self.model = model
        self.global_qconfig = global_qconfig
        self.module_type = tuple(module_type)
        self.module_name = dict(module_name or {})
        self._coerce = coerce if coerce is not None else _Coercer("qat")

    @property
    def translated(self) -> dict[str, str]:
        """torch.ao qconfigs met so far, by where they were found -> what the translation changed."""
        return dict(self._coerce.notes)

    # -- look-ups ---------------------------------------------------------
    def _module_at(self, path: str) -> Optional[nn.Module]:
        try:
            return self.model.get_submodule(path) if path else self.model
        except AttributeError:
            return None

    def _attr(self, module: Optional[nn.Module], where: str) -> Any:
        if module is None:
            return _MISSING
        value = getattr(module, "qconfig", _MISSING)
        if value is _MISSING:
            return _MISSING
        return self._coerce(value, f"{where}.qconfig")

    def _type_match(self, typ: type) -> Any:
        for t, qc in self.module_type:
            if typ is t:
                return qc
        for t, qc in self.module_type:
            if isinstance(typ, type) and issubclass(typ, t):
                return qc
        return _MISSING

    def for_scope(self, scope_entries: Sequence[ScopeEntry], module: Optional[nn.Module] = None
                  ) -> Optional[QConfig]:
        """The qconfig of a node whose scope is ``scope_entries`` (root first).

        ``module``: the module the node calls, if any; its ``qconfig``
        attribute counts as the innermost one.
        """
        return self._lookup(scope_entries, module)[0]

    def is_global(self, scope_entries: Sequence[ScopeEntry], module: Optional[nn.Module] = None) -> bool:
        """Does the node's qconfig come from the global level (``qconfig_dict[""]``, a root ``qconfig``
        attribute, or the default)? A march's per-op default type applies only there."""
        return self._lookup(scope_entries, module)[1] is None

    def float_reason(self, scope_entries: Sequence[ScopeEntry], module: Optional[nn.Module] = None
                     ) -> Optional[str]:
        """Why the node stays float, when torch.ao's annotations say so: a module's ``qconfig = None``
        attribute, a None entry of a QConfigMapping, or a torch.ao config with no BPU form (dynamic,
        float16). None otherwise: a qcompiler qconfig_dict entry of None, or no global qconfig, is a
        configuration error for a BPU op, reported where the qconfig is needed."""
        qc, where = self._lookup(scope_entries, module)
        if qc is not None or where is None:
            return None
        note = self._coerce.notes.get(where)
        if note is not None:
            return f"{where} is {note}"
        if where.endswith(".qconfig"):
            return f"{where} is None (not quantized): the op stays float on the CPU"
        return None

    def _lookup(self, scope_entries: Sequence[ScopeEntry], module: Optional[nn.Module]
                ) -> tuple[Optional[QConfig], Optional[str]]:
        """``(qconfig, where it came from)``; where is None for the global / root level."""
        entries = tuple(scope_entries)
        inner_first = entries[::-1]
        # module.qconfig attributes (non-root), innermost first
        if module is not None and module is not self.model:
            inner = entries[-1] if entries else None
            where = (f"module '{inner.path}'" if inner is not None and inner.path and inner.module_type is type(module)
                     else f"module {type(module).__name__}")
            qc = self._attr(module, where)
            if qc is not _MISSING:
                return qc, f"{where}.qconfig"
        for e in inner_first:
            if e.path:
                where = f"module '{e.path}'"
                qc = self._attr(self._module_at(e.path), where)
                if qc is not _MISSING:
                    return qc, f"{where}.qconfig"
        for e in inner_first:
            if e.path in self.module_name:
                return self.module_name[e.path], f"qconfig_dict['module_name'] {e.path!r}"
        for e in inner_first:
            qc = self._type_match(e.module_type)
            if qc is not _MISSING:
                return qc, f"qconfig_dict['module_type'] {e.module_type.__qualname__}"
        qc = self._attr(self.model, "the root model")
        if qc is not _MISSING:
            return qc, None
        return self.global_qconfig, None

    def scope_of(self, path: str) -> tuple[ScopeEntry, ...]:
        """The scope entries of the module at ``path`` (root first), built from the model."""
        check_module_names(self.model, [path] if path else [], "module name")
        out = [ScopeEntry("", type(self.model))]
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            p = ".".join(parts[:k])
            out.append(ScopeEntry(p, type(self.model.get_submodule(p))))
        return tuple(out)

    def for_module_name(self, path: str) -> Optional[QConfig]:
        """The qconfig of the module at dotted ``path`` ("" for the root)."""
        return self.for_scope(self.scope_of(path))

    def __repr__(self) -> str:
        return (f"QConfigResolver(global={self.global_qconfig is not None}, "
                f"module_type={len(self.module_type)}, module_name={len(self.module_name)})")


def parse_qconfig_dict(qconfig_dict: Any, model: nn.Module, kind: str = "qat") -> QConfigResolver:
    """Validate a qconfig_dict against ``model`` and return its :class:`QConfigResolver`.

    Keys: ``""`` (global QConfig or None), ``"module_type"`` (list of
    ``(nn.Module class or dotted path, QConfig or None)``), ``"module_name"``
    (list of ``(dotted module path, QConfig or None)``).  Unknown keys,
    malformed values, duplicate entries and names not in ``model`` raise
    ConfigError.  None means an empty dict (nothing quantized).

    torch.ao QConfigs (anywhere, and as ``module.qconfig`` attributes) are translated to the
    scheme of ``kind`` (:mod:`.torch_ao`); a torch.ao ``QConfigMapping`` may stand for the dict.
    """
    coerce = _Coercer(kind)
    if qconfig_dict is None:
        qconfig_dict = {}
    if torch_ao.is_qconfig_mapping(qconfig_dict):
        qconfig_dict, dropped = torch_ao.qconfig_mapping_to_dict(qconfig_dict)
        for item in dropped:
            coerce.notes[f"QConfigMapping {item}"] = "no qconfig_dict form: left out"
    if not isinstance(qconfig_dict, Mapping):
        raise ConfigError(f"qconfig_dict must be a dict with keys "
                          f"{', '.join(repr(k) for k in QCONFIG_DICT_KEYS)}, got {type(qconfig_dict).__name__}")
    unknown = [k for k in qconfig_dict if k not in QCONFIG_DICT_KEYS]
    if unknown:
        raise ConfigError(f"qconfig_dict: unknown key {unknown[0]!r}; allowed: "
                          + ", ".join(repr(k) for k in QCONFIG_DICT_KEYS))
    global_qc = coerce(qconfig_dict.get(""), "qconfig_dict['']")

    types: list[tuple[type, Optional[QConfig]]] = []
    for i, (spec, qc) in enumerate(_pairs(qconfig_dict.get("module_type", []), "module_type", "module type", coerce)):
        typ = resolve_type(spec, f"qconfig_dict['module_type'][{i}]")
        coerce.rename(f"qconfig_dict['module_type'][{i}][1]", f"qconfig_dict['module_type'] {typ.__qualname__}")
        if any(t is typ for t, _ in types):
            raise ConfigError(f"qconfig_dict['module_type']: {typ.__qualname__} is listed twice; keep one entry")
        types.append((typ, qc))

    names: dict[str, Optional[QConfig]] = {}
    name_pairs = _pairs(qconfig_dict.get("module_name", []), "module_name", "module name", coerce)
    check_module_names(model, [n for n, _ in name_pairs], "qconfig_dict['module_name']")
    for i, (name, qc) in enumerate(name_pairs):
        coerce.rename(f"qconfig_dict['module_name'][{i}][1]", f"qconfig_dict['module_name'] {name!r}")
        if name in names:
            raise ConfigError(f"qconfig_dict['module_name']: {name!r} is listed twice; keep one entry")
        names[name] = qc
    return QConfigResolver(model, global_qc, types, names, coerce=coerce)
