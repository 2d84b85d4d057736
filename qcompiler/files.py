"""Writing the tool's output files: whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

__all__ = ["atomic_write"]


def atomic_write(path: Path, data: Union[str, bytes]) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
