"""The build config file of ``qcompiler build``: one TOML file per model recording what a
``qcompiler compile`` run is given as flags, so a build can be repeated and reviewed (issue 35).

TOML because Python reads it without a dependency (``tomllib``), it has comments, and its
tables map one to one onto the flags. The fields (each one flag of ``qcompiler compile``)::

    model = "my_models.py:build"      # MODEL; a relative file path is relative to this file
    march = "bayes"
    out = "out/my_model"              # --out, relative to this file
    capture = "auto"
    weight_rounding = false
    int16_budget = 0.1
    qconfig = "my_qconfig.json"       # --qconfig FILE
    fixes = "fixes.json"              # 'qcompiler build THIS --report' writes the advice here; a build
                                      # applies it when it exists (as --qconfig and --hybrid FILE)
    leaf_modules = ["head"]           # --leaf-module

    [[inputs]]                        # one table per positional input: --input-shape / --input-dtype
    shape = [1, 3, 224, 224]
    dtype = "float32"

    [hybrid]                          # --hybrid-module-name / --hybrid-module-type / --hybrid FILE
    module_name = ["conv3"]
    module_type = ["torch.nn.PReLU"]
    file = "my_hybrid.json"

    [calibration]                     # data = FILE | images = DIR | random = N, as the flags
    images = "photos"
    batch_size = 8
    limit = 64

    [calibration.preprocess]          # the image preprocessing flags
    resize = 256                      # or [height, width]
    crop = 224
    mean = [0.485, 0.456, 0.406]
    std = [0.229, 0.224, 0.225]
    channel_order = "rgb"
    pixel_max = 1
    layout = "nchw"

Every mistake is a ConfigError naming the file, the line and the key. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Optional

from qcompiler.errors import ConfigError

INPUT_DTYPES = ("float32", "int64")
CAPTURES = ("fx", "export", "auto")
CHANNEL_ORDERS = ("rgb", "bgr", "gray")
LAYOUTS = ("nchw", "nhwc")

# table -> {key: kind}; kinds: str, path, bool, int, float, size, floats, strs, or a tuple of choices
SCHEMA: dict[str, dict[str, Any]] = {
    "": {"model": "model", "march": "str", "out": "path", "capture": CAPTURES, "weight_rounding": "bool",
         "int16_budget": "float", "qconfig": "path", "fixes": "path", "leaf_modules": "strs", "inputs": "tables",
         "hybrid": "table", "calibration": "table"},
    "inputs": {"shape": "shape", "dtype": INPUT_DTYPES},
    "hybrid": {"module_name": "strs", "module_type": "strs", "file": "path"},
    "calibration": {"data": "path", "images": "path", "random": "int", "batch_size": "int", "limit": "int",
                    "preprocess": "table"},
    "calibration.preprocess": {"resize": "size", "crop": "size", "mean": "floats", "std": "floats",
                               "channel_order": CHANNEL_ORDERS, "pixel_max": (1, 255), "layout": LAYOUTS},
}
REQUIRED = ("model", "out")


class _Source:
    """The config text, to find the line of a key for the messages."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.lines = path, text.splitlines()

    def line(self, table: str, key: str, occurrence: int = 0) -> int:
        """1-based line of ``key = ...`` in ``table`` (its ``occurrence``-th ``[[inputs]]``), or of the
        ``[table.key]`` header for a sub-table; 0 if not found."""
        current, seen = "", -1
        sub = f"{table}.{key}" if table else key
        for i, raw in enumerate(self.lines, 1):
            line = raw.split("#", 1)[0].strip()
            header = re.fullmatch(r"\[\[?\s*([\w.\s]+?)\s*\]\]?", line)
            if header:
                current = header.group(1).replace(" ", "")
                if current == sub:
                    return i
                seen += line.startswith("[[") and current == table
                continue
            if current == table and re.match(rf"{re.escape(key)}\s*=", line) and (table != "inputs" or seen == occurrence):
                return i
        return 0

    def error(self, table: str, key: str, message: str, occurrence: int = 0) -> ConfigError:
        line = self.line(table, key, occurrence)
        where = f"{self.path}:{line}" if line else str(self.path)
        name = f"{table}.{key}" if table else key
        if table == "inputs":
            name = f"inputs[{occurrence}].{key}"
        return ConfigError(f"{where}: {name}: {message}")


def _check(src: _Source, table: str, key: str, kind: Any, value: Any, occurrence: int = 0) -> Any:
    """``value`` of ``key`` checked against its ``kind`` (see SCHEMA); returns it normalized."""
    def bad(expected: str) -> ConfigError:
        return src.error(table, key, f"expected {expected}, got {value!r}", occurrence)

    if isinstance(kind, tuple):
        if value not in kind or isinstance(value, bool):
            raise bad(f"one of {', '.join(map(repr, kind))}")
        return value
    if kind in ("str", "path", "model"):
        if not isinstance(value, str) or not value.strip():
            raise bad("a non-empty string")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("a positive integer")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if kind == "strs":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise bad("a list of strings")
        return value
    if kind == "shape":
        if not isinstance(value, list) or not value or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
            raise bad("a list of positive integers, e.g. [1, 3, 224, 224]")
        return tuple(value)
    if kind == "size":
        sizes = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(sizes, list) or len(sizes) not in (1, 2) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
            raise bad("a positive integer N or [height, width]")
        return tuple(sizes)
    if kind == "floats":
        values = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        if not isinstance(values, list) or not values or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise bad("a number or a list of numbers")
        return tuple(float(v) for v in values)
    raise bad("a table")


def _keys(src: _Source, table: str, data: dict, occurrence: int = 0) -> dict:
    """``data``'s keys checked against the schema of ``table`` (unknown keys name the close ones)."""
    schema = SCHEMA[table]
    out = {}
    for key, value in data.items():
        if key not in schema:
            close = difflib.get_close_matches(key, list(schema), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known keys: {', '.join(schema)}."
            raise src.error(table, key, f"unknown key.{hint}", occurrence)
        kind = schema[key]
        if kind == "table":
            sub = f"{table}.{key}" if table else key
            if not isinstance(value, dict):
                raise src.error(table, key, f"expected a table [{sub}], got {value!r}", occurrence)
            out[key] = _keys(src, sub, value)
        elif kind == "tables":
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise src.error(table, key, f"expected [[{key}]] tables, got {value!r}", occurrence)
            out[key] = [_keys(src, key, v, i) for i, v in enumerate(value)]
        else:
            out[key] = _check(src, table, key, kind, value, occurrence)
    return out


def _resolve(base: Path, path: Optional[str]) -> Optional[str]:
    """``path`` relative to the config file's folder (absolute paths stay)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else base / p)


def _resolve_model(base: Path, model: str) -> str:
    target, sep, attr = model.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target) and not Path(target).is_absolute():
        return f"{base / target}:{attr}"
    return model


def read_build_config(path: str) -> argparse.Namespace:
    """The ``qcompiler compile`` arguments a build config file stands for (the flags' Namespace)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"build config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"build config {path}: not a text file; write it in TOML (see 'qcompiler build --help')") \
            from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"build config {path}: not valid TOML ({exc})") from None
    src = _Source(file, text)
    cfg = _keys(src, "", data)
    for key in REQUIRED:
        if key not in cfg:
            raise ConfigError(f"{path}: the key {key!r} is required (e.g. {key} = "
                              f"{json.dumps('zoo:resnet18' if key == 'model' else 'out/model')})")
    base = file.resolve().parent
    calib, hybrid = cfg.get("calibration", {}), cfg.get("hybrid", {})
    pre = calib.get("preprocess", {})
    sources = [k for k in ("data", "images", "random") if k in calib]
    if len(sources) > 1:
        raise src.error("calibration", sources[1], f"give one of data, images, random (it has {', '.join(sources)})")
    if pre and "images" not in calib:
        raise src.error("calibration", "preprocess", "[calibration.preprocess] applies to calibration.images only")
    inputs = cfg.get("inputs", [])
    for i, item in enumerate(inputs):
        if "shape" not in item:
            raise ConfigError(f"{path}: inputs[{i}]: 'shape' is required (e.g. shape = [1, 3, 224, 224])")
    ns = argparse.Namespace(
        command="compile", func="cmd_build", model=_resolve_model(base, cfg["model"]),
        input_shape=[item["shape"] for item in inputs] or None,
        input_dtype=[item.get("dtype", "float32") for item in inputs] if any("dtype" in i for i in inputs) else None,
        march=cfg.get("march"), capture=cfg.get("capture", "auto"),
        hybrid_module_name=hybrid.get("module_name", []), hybrid_module_type=hybrid.get("module_type", []),
        hybrid=_resolve(base, hybrid.get("file")), leaf_module=cfg.get("leaf_modules", []),
        qconfig=_resolve(base, cfg.get("qconfig")), weight_rounding=cfg.get("weight_rounding", False),
        int16_budget=cfg.get("int16_budget"), out=_resolve(base, cfg["out"]),
        calib_data=_resolve(base, calib.get("data")), calib_images=_resolve(base, calib.get("images")),
        calib_random=calib.get("random"), calib_batch_size=calib.get("batch_size", 8), calib_limit=calib.get("limit"),
        resize=pre.get("resize"), crop=pre.get("crop"), mean=pre.get("mean"), std=pre.get("std"),
        channel_order=pre.get("channel_order"), layout=pre.get("layout"),
        pixel_max=str(pre["pixel_max"]) if "pixel_max" in pre else None,
        fixes=_resolve(base, cfg.get("fixes")), print_config=False, config=str(file),
    )
    return ns


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(_toml(v) for v in value) + "]"


def to_build_config(args: argparse.Namespace) -> str:
    """The build config (TOML) of a ``compile`` Namespace: what ``qcompiler build`` reads back."""
    def size(v):
        return None if v is None else (v[0] if len(v) == 1 else list(v))

    lines = ["# qcompiler build config: 'qcompiler build THIS_FILE' repeats the run", f"model = {_toml(args.model)}"]
    top = {"march": args.march, "out": str(args.out), "capture": args.capture,
           "weight_rounding": args.weight_rounding, "int16_budget": args.int16_budget, "qconfig": args.qconfig,
           "fixes": getattr(args, "fixes", None), "leaf_modules": list(args.leaf_module) or None}
    lines += [f"{k} = {_toml(v)}" for k, v in top.items() if v is not None]
    dtypes = list(args.input_dtype or [])
    for i, shape in enumerate(args.input_shape or []):
        lines += ["", "[[inputs]]", f"shape = {_toml(list(shape))}", f"dtype = {_toml(dtypes[i] if i < len(dtypes) else 'float32')}"]
    hybrid = {"module_name": list(args.hybrid_module_name) or None, "module_type": list(args.hybrid_module_type) or None,
              "file": args.hybrid}
    if any(v is not None for v in hybrid.values()):
        lines += ["", "[hybrid]"] + [f"{k} = {_toml(v)}" for k, v in hybrid.items() if v is not None]
    calib = {"data": args.calib_data, "images": getattr(args, "calib_images", None), "random": args.calib_random,
             "batch_size": args.calib_batch_size, "limit": getattr(args, "calib_limit", None)}
    lines += ["", "[calibration]"] + [f"{k} = {_toml(v)}" for k, v in calib.items() if v is not None]
    pre = {"resize": size(getattr(args, "resize", None)), "crop": size(getattr(args, "crop", None)),
           "mean": getattr(args, "mean", None), "std": getattr(args, "std", None),
           "channel_order": getattr(args, "channel_order", None),
           "pixel_max": int(args.pixel_max) if getattr(args, "pixel_max", None) else None,
           "layout": getattr(args, "layout", None)}
    pre = {k: (list(v) if isinstance(v, tuple) else v) for k, v in pre.items() if v is not None}
    if pre:
        lines += ["", "[calibration.preprocess]"] + [f"{k} = {_toml(v)}" for k, v in pre.items()]
    return "\n".join(lines) + "\n"


def report_args(args: argparse.Namespace) -> argparse.Namespace:
    """``qcompiler build CONFIG --report``: the ``qcompiler report`` arguments of a build config. The
    report is measured on the config's calibration data, goes to ``OUT/report`` and writes its advice
    to the config's ``fixes`` file (default ``OUT/fixes.json``), which the next ``qcompiler build
    CONFIG`` applies. An existing fixes file is not applied here: the advice is for the config as written."""
    ns = argparse.Namespace(**vars(args))
    fixes = getattr(args, "fixes", None) or str(Path(args.out) / "fixes.json")
    ns.command, ns.func, ns.out = "report", "cmd_report", str(Path(args.out) / "report")
    ns.metric, ns.target_sqnr, ns.advise, ns.apply, ns.fixes = "L1", None, 3, fixes, fixes
    return ns


__all__ = ["SCHEMA", "read_build_config", "report_args", "to_build_config"]
