"""qconfig / hybrid config files (JSON) for the command line: ``qcompiler compile --qconfig F --hybrid F``.

One file may hold both sections (``qcompiler report --apply FILE`` writes it so)::

    {"qconfig": {"global": {"dtype": "qint8", "observer": "histogram-mse"},
                 "module_name": {"layer1.0.conv2": {"dtype": "qint16"},
                                 "layer3.1.conv1": {"observer": "percentile"}}},
     "hybrid":  {"module_name": ["fc"], "module_type": ["torch.nn.PReLU"]}}

``--qconfig`` reads the ``"qconfig"`` section (or the whole object when it has none), ``--hybrid`` the
``"hybrid"`` one likewise. A file with a section holds sections only: any other top-level key (a typo
such as ``"hybird"``) is an error, never silently skipped; a file without sections holds only the
keys of the one it is read as. A qconfig entry is a calibration qconfig
(``get_default_calib_qconfig(dtype, observer)``); unset fields take the global entry's. Every error
names the file and the key, and says what is allowed. Only a regular file of at most
:data:`MAX_CONFIG_BYTES` is read (a FIFO or a device is refused before a byte is read).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import reprlib
import stat
from pathlib import Path
from typing import Any, Union

from qcompiler.atomic_write import check_path, check_target, write_file
from qcompiler.errors import ConfigError
from qcompiler.quantization.observer import DTYPES, OBSERVERS
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.tools.case_file import file_kind

__all__ = ["read_qconfig_file", "read_hybrid_file", "write_config_file", "QCONFIG_FIELDS"]

QCONFIG_FIELDS = ("dtype", "observer")
QCONFIG_KEYS = ("global", "module_name")
HYBRID_KEYS = ("module_name", "module_type")
SECTIONS = ("qconfig", "hybrid")
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


def _path(path: Any, option: str) -> Path:
    """``path`` as a Path; ConfigError for what is no path (None, a number) or an empty one
    (``Path("")`` is the current directory): the writer's own check, worded for a JSON file."""
    return Path(check_path(path, option, give="the path of a JSON file"))


def _load(path: Union[str, Path], option: str) -> Any:
    p = _path(path, option)
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


def _unknown(key: str, allowed: tuple, where: str, also: str = "") -> ConfigError:
    """The error for an unknown key: it, the allowed ones (``also`` after them), and the closest
    allowed key when it looks like a typo."""
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where} unknown key {key!r}; allowed: {', '.join(repr(k) for k in allowed)}{also}{hint}")


def _section(data: Any, name: str, keys: tuple, option: str, path: Union[str, Path]) -> dict:
    """The object the reader of section ``name`` uses: ``data[name]`` in a file with sections
    (``{}`` if it has only the other one), else ``data`` itself. Every key is checked, the
    top-level keys next to a section too, so a typo is an error, never an ignored section."""
    if not isinstance(data, dict):
        raise ConfigError(f"{option} {path}: the file must hold a JSON object, got {type(data).__name__}")
    if not any(k in SECTIONS for k in data):  # a file of one kind: its keys are the section's
        for k in data:
            if k not in keys:
                raise _unknown(k, keys, f"{option} {path}:", f" (or a {name!r} section)")
        return data
    for k in data:
        if k not in SECTIONS:
            raise _unknown(k, SECTIONS, f"{option} {path}:", " (a file with sections holds nothing else)")
    if name not in data:
        return {}
    data, where = data[name], f"{option} {path}: [{name!r}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be an object, got {type(data).__name__}")
    for k in data:
        if k not in keys:
            raise _unknown(k, keys, where)
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


def _check_json(value: Any, where: str, option: str) -> None:
    """ConfigError naming the key at ``where`` if ``value`` is not plain JSON: objects with string
    keys, lists, strings, bools, None, ints and finite floats (NaN and Infinity are no JSON, and
    a reader would refuse the file)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{option}: key {_short(k)} in {where or 'the config'} is of type "
                                  f"{type(k).__name__}; JSON object keys are strings")
            _check_json(v, f"{where}[{k!r}]", option)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]", option)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{option}: {where or 'the config'} is {value}, which JSON cannot hold; give a finite number")
    elif not (value is None or isinstance(value, (str, int, float))):
        raise ConfigError(f"{option}: {where or 'the config'} is of type {type(value).__name__}, which JSON cannot "
                          f"hold; give strings, numbers, lists and objects")


def write_config_file(path: Union[str, Path], config: dict) -> Path:
    """Write ``{"qconfig": ..., "hybrid": ...}`` as JSON (atomically).

    The path and the content are checked before anything is written, so a bad call leaves no
    file: the path as :func:`qcompiler.atomic_write.check_target` does, the content must be a
    dict of plain JSON values (no NaN: ``json.dumps`` would write ``NaN``, which is no JSON)."""
    option = "--apply"
    p = check_target(path, option)
    if not isinstance(config, dict):
        raise ConfigError(f"{option} {p}: the config must be a dict like "
                          f"{{\"qconfig\": {{...}}, \"hybrid\": {{...}}}}, got {type(config).__name__}")
    try:
        _check_json(config, "", f"{option} {p}")
    except RecursionError:
        raise ConfigError(f"{option} {p}: the config nests too deep or contains itself; a config file "
                          f"nests at most 4 levels") from None
    text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False)
    write_file(p, (text + "\n").encode("utf-8"), option)
    return p
