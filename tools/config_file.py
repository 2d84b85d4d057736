"""qconfig / hybrid config files (JSON) for the command line: ``qcompiler compile --qconfig F --hybrid F``.

One file may hold both sections (``qcompiler report --apply FILE`` writes it so)::

    {"qconfig": {"global": {"dtype": "qint8", "observer": "histogram-mse"},
                 "module_name": {"layer1.0.conv2": {"dtype": "qint16"},
                                 "layer3.1.conv1": {"observer": "percentile"}}},
     "hybrid":  {"module_name": ["fc"], "module_type": ["torch.nn.PReLU"]}}

``--qconfig`` reads the ``"qconfig"`` section (or the whole object when it has none), ``--hybrid`` the
``"hybrid"`` one likewise. A qconfig entry is a calibration qconfig
(``get_default_calib_qconfig(dtype, observer)``); unset fields take the global entry's. Every error
names the file and the key, and says what is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from qcompiler.atomic_write import write_file
from qcompiler.errors import ConfigError
from qcompiler.quantization.observer import DTYPES, OBSERVERS
from qcompiler.quantization.qconfig import get_default_calib_qconfig

__all__ = ["read_qconfig_file", "read_hybrid_file", "write_config_file", "QCONFIG_FIELDS"]

QCONFIG_FIELDS = ("dtype", "observer")
QCONFIG_KEYS = ("global", "module_name")
HYBRID_KEYS = ("module_name", "module_type")


def _load(path: Union[str, Path], option: str) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{option} {p}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{option} {p}: not a UTF-8 text (JSON) file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option} {p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def _section(data: Any, name: str, keys: tuple, option: str, path: Union[str, Path]) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"{option} {path}: the file must hold a JSON object, got {type(data).__name__}")
    if name in data:
        data = data[name]
        where = f"{option} {path}: [{name!r}]"
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be an object, got {type(data).__name__}")
    else:
        where = f"{option} {path}:"
        extra = [k for k in data if k not in keys and k in ("qconfig", "hybrid")]
        if extra:
            return {}
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise ConfigError(f"{where} unknown key {unknown[0]!r}; allowed: {', '.join(repr(k) for k in keys)}")
    return data


def _entry(value: Any, where: str, default: dict) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be an object like {{\"dtype\": \"qint16\", \"observer\": \"percentile\"}}, "
                          f"got {value!r}")
    unknown = [k for k in value if k not in QCONFIG_FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; allowed: "
                          + ", ".join(repr(k) for k in QCONFIG_FIELDS))
    out = dict(default, **value)
    if out["dtype"] not in DTYPES:
        raise ConfigError(f"{where}['dtype']: {out['dtype']!r} is not one of {', '.join(repr(d) for d in DTYPES)}")
    if out["observer"] not in OBSERVERS:
        raise ConfigError(f"{where}['observer']: {out['observer']!r} is not one of "
                          + ", ".join(repr(o) for o in OBSERVERS))
    return out


def read_qconfig_file(path: Union[str, Path], option: str = "--qconfig") -> dict:
    """The calibration ``qconfig_dict`` a JSON file describes (module names are checked against the
    model when it is prepared)."""
    data = _section(_load(path, option), "qconfig", QCONFIG_KEYS, option, path)
    default = _entry(data.get("global", {}), f"{option} {path}: ['global']",
                     {"dtype": "qint8", "observer": "histogram-mse"})
    names = data.get("module_name", {})
    if not isinstance(names, dict):
        raise ConfigError(f"{option} {path}: ['module_name'] must be an object {{module path: entry}}, "
                          f"got {type(names).__name__}")
    result: dict[str, Any] = {"": get_default_calib_qconfig(dtype=default["dtype"], observer=default["observer"])}
    entries = []
    for name, value in names.items():
        e = _entry(value, f"{option} {path}: ['module_name'][{name!r}]", default)
        entries.append((name, get_default_calib_qconfig(dtype=e["dtype"], observer=e["observer"])))
    if entries:
        result["module_name"] = entries
    return result


def read_hybrid_file(path: Union[str, Path], option: str = "--hybrid") -> dict:
    """The ``hybrid_dict`` a JSON file describes: lists of module paths / dotted class names."""
    data = _section(_load(path, option), "hybrid", HYBRID_KEYS, option, path)
    out = {}
    for key in HYBRID_KEYS:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{option} {path}: [{key!r}] must be a list of strings, got {value!r}")
        out[key] = list(value)
    return out


def write_config_file(path: Union[str, Path], config: dict) -> Path:
    """Write ``{"qconfig": ..., "hybrid": ...}`` as JSON (atomically)."""
    p = Path(path)
    write_file(p, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"), "--apply")
    return p
