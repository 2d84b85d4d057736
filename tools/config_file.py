"""qconfig / hybrid config files (JSON) for the command line: ``qcompiler compile --qconfig F --hybrid F``.

One file may hold both sections (``qcompiler report --apply FILE`` writes it so)::

    {"qconfig": {"global": {"dtype": "qint8", "observer": "histogram-mse"},
                 "module_name": {"layer1.0.conv2": {"dtype": "qint16"},
                                 "layer3.1.conv1": {"observer": "percentile"}}},
     "hybrid":  {"module_name": ["fc"], "module_type": ["torch.nn.PReLU"]}}

``--qconfig`` reads the ``"qconfig"`` section (or the whole object when it has none), ``--hybrid`` the
``"hybrid"`` one likewise. A qconfig entry is a calibration qconfig
(``get_default_calib_qconfig(dtype, observer)``); unset fields take the global entry's. Every error
names the file and the key, and says what is allowed. Only a regular file of at most
:data:`MAX_CONFIG_BYTES` is read (a FIFO or a device is refused before a byte is read).
"""

from __future__ import annotations

import json
import os
import reprlib
import stat
from pathlib import Path
from typing import Any, Union

from qcompiler.atomic_write import write_file
from qcompiler.errors import ConfigError
from qcompiler.quantization.observer import DTYPES, OBSERVERS
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.tools.case_file import file_kind

__all__ = ["read_qconfig_file", "read_hybrid_file", "write_config_file", "QCONFIG_FIELDS"]

QCONFIG_FIELDS = ("dtype", "observer")
QCONFIG_KEYS = ("global", "module_name")
HYBRID_KEYS = ("module_name", "module_type")
MAX_CONFIG_BYTES = 16 << 20
"""A config file is a few KB (one entry per module); a bigger file is refused unread."""
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 4, 6, 6, 60, 60


def _short(value: Any) -> str:
    """``repr(value)``, bounded in length and depth, for messages (values come from the file)."""
    return _SHORT.repr(value)


def _read(p: Path, option: str) -> bytes:
    """The bytes of the regular file ``p``; ConfigError for anything else or more than MAX_CONFIG_BYTES.

    Opened non-blocking and checked with fstat before reading: a FIFO would block the open and the
    read, and a device such as /dev/zero never ends."""
    def too_big(size: int) -> ConfigError:
        return ConfigError(f"{option} {p}: {size} bytes, more than the {MAX_CONFIG_BYTES} a config file may "
                           f"have (qconfig and hybrid files are a few KB)")

    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{option} {p}: not a regular file ({file_kind(st.st_mode)}); give the path of "
                                  f"a JSON file")
            if st.st_size > MAX_CONFIG_BYTES:
                raise too_big(st.st_size)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # one more: a file that grew since fstat
    except OSError as exc:
        raise ConfigError(f"{option} {p}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise too_big(len(data))
    return data


def _load(path: Union[str, Path], option: str) -> Any:
    p = Path(path)
    try:
        text = _read(p, option).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{option} {p}: not a UTF-8 text (JSON) file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option} {p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:  # as the .qc manifest and bad-case loaders: json's parser recurses per level
        raise ConfigError(f"{option} {p}: nested too deep to be a config file (qconfig and hybrid files nest "
                          f"at most 4 levels)") from None


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
                          f"got {_short(value)}")
    unknown = [k for k in value if k not in QCONFIG_FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; allowed: "
                          + ", ".join(repr(k) for k in QCONFIG_FIELDS))
    out = dict(default, **value)
    for field, allowed in (("dtype", DTYPES), ("observer", OBSERVERS)):
        if not isinstance(out[field], str) or out[field] not in allowed:  # a list or an object is no name
            raise ConfigError(f"{where}[{field!r}]: {_short(out[field])} is not one of "
                              + ", ".join(repr(a) for a in allowed))
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
            raise ConfigError(f"{option} {path}: [{key!r}] must be a list of strings, got {_short(value)}")
        out[key] = list(value)
    return out


def write_config_file(path: Union[str, Path], config: dict) -> Path:
    """Write ``{"qconfig": ..., "hybrid": ...}`` as JSON (atomically)."""
    p = Path(path)
    write_file(p, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"), "--apply")
    return p
