"""Write files whole or not at all, with the permissions of a plain ``open(path, "w")``.

Each payload goes to a temporary file next to its target, which then replaces the target
(``os.replace``): a failure never leaves a half-written file, and a reader never sees one.
The temporary file is created with mode 0o666 minus the umask, like every other file
qcompiler writes (``tempfile.mkstemp`` would make it 0600, and the replaced file with it).

The target paths are checked before anything is written: an empty path, a directory, or a
path below an existing file is a ConfigError naming the path; missing parent directories
are created. An OSError while writing names the target, not the temporary file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Sequence, Union

from qcompiler.errors import ConfigError

PathLike = Union[str, os.PathLike]


def check_target(path: PathLike, what: str) -> Path:
    """``path`` as a Path, if a file can be written there (parents may be missing); else a
    ConfigError prefixed with ``what`` (e.g. "save") that names the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what}: the path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ConfigError(f"{what}: the path must be text, got {type(text).__name__} {text!r}")
    if not text.strip():
        raise ConfigError(f"{what}: the path is empty; give a file path")
    target = Path(text)
    if target.is_dir():
        raise ConfigError(f"{what}: {str(target)!r} is a directory; give a file path")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{what}: cannot write {str(target)!r}: {str(parent)!r} is a file, not a directory")
    return target


def write_files(items: Sequence[tuple[PathLike, bytes]], what: str) -> list[Path]:
    """Write every ``(path, data)``: all targets are checked first, then written to temporary
    files, then each replaces its target; on a failure no temporary file is left behind."""
    targets = [(check_target(path, what), data) for path, data in items]
    temps: list[Path] = []
    target = targets[0][0] if targets else None
    try:
        for target, data in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        for (target, _), tmp in zip(targets, temps):
            os.replace(tmp, target)
    except OSError as exc:
        ours = exc.filename is None or str(exc.filename).endswith(".tmp")  # the temporary file: name the target
        reason = exc.strerror or str(exc)  # an OSError raised with a message only has no strerror
        raise OSError(exc.errno, f"{what}: {reason}", str(target if ours else exc.filename)) from None
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    return [t for t, _ in targets]


def write_file(path: PathLike, data: bytes, what: str) -> Path:
    """Write one file (see :func:`write_files`); returns its path."""
    return write_files([(path, data)], what)[0]


__all__ = ["check_target", "write_file", "write_files"]
