"""A model input (a bad case) as a file that cannot carry code: safetensors + a JSON structure.

The tensors are stored by safetensors; how they nest (tuples, lists, dicts with string
keys, and plain JSON scalars between them) is a JSON document in the safetensors
metadata.  Reading never unpickles: a pickle, or any other file, is an
:class:`~qcompiler.errors.ArtifactError` naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from qcompiler.errors import ArtifactError, ConfigError

__all__ = ["case_bytes", "load_case", "file_kind"]

FORMAT = "qcompiler.case"
MAX_NESTING = 32
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a ``stat`` mode that is not a regular file's is, for messages: "a FIFO", "a directory"..."""
    return next((kind for test, kind in _NOT_REGULAR if test(mode)), "a special file")


def case_bytes(case: Any) -> bytes:
    """``case`` (a tensor, or tuples/lists/dicts of tensors and JSON scalars) as file bytes."""
    tensors: dict[str, torch.Tensor] = {}

    def pack(v: Any, depth: int) -> Any:
        if depth > MAX_NESTING:
            raise ConfigError(f"bad case: nested deeper than {MAX_NESTING}")
        if isinstance(v, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = v.detach().cpu().contiguous()
            return {"tensor": key}
        if isinstance(v, (tuple, list)):
            return {type(v).__name__: [pack(x, depth + 1) for x in v]}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise ConfigError("bad case: dict keys must be strings to be saved")
            return {"dict": [[k, pack(x, depth + 1)] for k, x in v.items()]}
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"value": v}
        raise ConfigError(f"bad case: a {type(v).__name__} cannot be saved (tensors, tuples, lists, dicts and "
                          f"numbers/strings only)")

    structure = pack(case, 0)
    return st_save(tensors, metadata={"format": FORMAT, "structure": json.dumps(structure)})


def load_case(path: Union[str, Path]) -> Any:
    """The case saved by :func:`case_bytes` at ``path``; ArtifactError if the file is not one (anything
    but a regular file is refused before it is opened)."""
    p = Path(path)
    try:  # stat before opening: opening a FIFO blocks until a writer comes, and safe_open holds the GIL
        mode = os.stat(p).st_mode
    except OSError as exc:
        raise ArtifactError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{p}: not a regular file ({file_kind(mode)}); give the path of a bad-case file")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ArtifactError(f"{p}: not a qcompiler bad-case file (no '{FORMAT}' metadata)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        structure = json.loads(meta.get("structure", "null"))
    except ArtifactError:
        raise
    except (SafetensorError, OSError, ValueError, RecursionError) as exc:
        raise ArtifactError(f"{p}: not a qcompiler bad-case file (safetensors with a JSON structure; older "
                            f"pickle files are not read: find or set the bad case again) ({exc})") from None

    def unpack(s: Any, depth: int) -> Any:
        if depth > MAX_NESTING or not isinstance(s, dict) or len(s) != 1:
            raise ArtifactError(f"{p}: malformed bad-case structure near {str(s)[:60]!r}")
        (kind, v), = s.items()
        if kind == "tensor" and isinstance(v, str) and v in tensors:
            return tensors[v]
        if kind in ("tuple", "list") and isinstance(v, list):
            items = [unpack(x, depth + 1) for x in v]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict" and isinstance(v, list) and all(
                isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str) for kv in v):
            return {k: unpack(x, depth + 1) for k, x in v}
        if kind == "value" and (v is None or isinstance(v, (bool, int, float, str))):
            return v
        raise ArtifactError(f"{p}: malformed bad-case structure near {str(s)[:60]!r}")

    return unpack(structure, 0)
