"""Write files whole or not at all, with the permissions of a plain ``open(path, "w")``.

Each payload goes to a temporary file next to its target, which then replaces the target
(``os.replace``): a failure never leaves a half-written file, and a reader never sees one.
The temporary file is created with mode 0o666 minus the umask, like every other file
qcompiler writes (``tempfile.mkstemp`` would make it 0600, and the replaced file with it).

The target paths are checked before anything is written; a path no file can be written to is
a ConfigError naming the path and saying what to give instead: not a str / os.PathLike, empty,
holding a NUL byte, ending in a path separator (that names a directory), a name longer than
the file system allows, a directory, a path below an existing file, or an existing entry that
is not a regular file. ``os.replace`` would put a regular file in place of a device node, a
FIFO or a socket (as root: ``/dev/null`` becomes a file), so only regular files are ever
replaced. Missing parent directories are created. An OSError while writing (a full disk,
``/proc``) stays an OSError, prefixed with the caller's name, naming the target, not the
temporary file.

Symbolic links are followed, as ``open(path, "w")`` follows them: a link to a regular file
has that file replaced (the temporary file goes next to it, so the replacement is atomic
there too) and the link stays a link; a link to a directory or a device is refused like the
entry it points to, named by the link's path; a dangling link creates the file it points to.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Optional, Sequence, Union

from qcompiler.errors import ConfigError

PathLike = Union[str, os.PathLike]

NAME_MAX = 255  # bytes in one file name on Linux's file systems (ext4, xfs, btrfs, tmpfs)


def check_path(path: object, what: str, kind: str = "file", give: Optional[str] = None) -> str:
    """The text of ``path`` (a str or os.PathLike of str), if it can name a ``kind`` ("file" or
    "directory") at all; else a ConfigError prefixed with ``what`` that says what to give (``give``,
    e.g. "the path of a JSON file", also ends the message about a wrong type)."""
    if not isinstance(path, (str, os.PathLike)):
        hint = f"; give {give}" if give else ""
        raise ConfigError(f"{what}: the path must be a str or os.PathLike, got {type(path).__name__}{hint}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ConfigError(f"{what}: the path must be text, got {type(text).__name__} {text!r}")
    if not text.strip():
        here = " ('.' for the current directory)" if kind == "directory" else ""
        raise ConfigError(f"{what}: the path is empty; give {give or f'a {kind} path{here}'}")
    if "\0" in text:
        raise ConfigError(f"{what}: the path {text!r} contains a NUL byte ('\\x00'), which no file name can "
                          "hold; remove it")
    return text


def describe(mode: int) -> str:
    """What kind of file system entry ``mode`` (``st_mode``) is, for messages."""
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
             (stat.S_ISREG, "a regular file")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _shown(text: str) -> str:
    """``text`` quoted for a message; a very long path is shortened around the middle."""
    return repr(text) if len(text) <= 160 else f"{text[:60]!r}...{text[-40:]!r} ({len(text)} characters)"


def stat_or_none(text: str, what: str) -> Optional[os.stat_result]:
    """``os.stat(text)`` (links followed), or None when nothing is there. A name too long or a
    symlink loop is a ConfigError naming the path; any other OSError (permissions) is prefixed."""
    try:
        return os.stat(text)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            longest = max(Path(text).parts, key=lambda p: len(os.fsencode(p)))
            size = len(os.fsencode(longest))
            name = "its name" if longest == text else f"the name {_shown(longest)} in it"
            why = (f"{name} is {size} bytes, over the {NAME_MAX} bytes a file name may have" if size > NAME_MAX
                   else f"the path is {len(os.fsencode(text))} bytes, longer than the system allows")
            raise ConfigError(f"{what}: cannot use {_shown(text)}: {why}; give a shorter path") from None
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{what}: cannot use {_shown(text)}: its symbolic links form a loop; give a path "
                              "that leads to a file") from None
        raise OSError(exc.errno, f"{what}: {exc.strerror}", text) from None


def _check_ancestors(text: str, what: str, verb: str = "write") -> None:
    """The nearest existing ancestor of ``text`` must be a directory (the others get created)."""
    parent = Path(text).parent
    while (st := stat_or_none(str(parent), what)) is None and parent != parent.parent:
        parent = parent.parent
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else describe(st.st_mode)
        raise ConfigError(f"{what}: cannot {verb} {_shown(text)}: {str(parent)!r} is {kind}, not a directory")


def check_target(path: PathLike, what: str) -> Path:
    """``path`` as a Path, if a file can be written there (parents may be missing); else a
    ConfigError prefixed with ``what`` (e.g. "save") that names the path (module docstring)."""
    text = check_path(path, what)
    st = stat_or_none(text, what)
    link = f" (a symbolic link to {os.path.realpath(text)!r})" if os.path.islink(text) else ""
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: {text!r} is a directory{link}; give a file path")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}: {text!r} is {describe(st.st_mode)}{link}, not a regular file; qcompiler "
                          "replaces only regular files: give the path of a file to write")
    if text.endswith(os.sep) or (os.altsep and text.endswith(os.altsep)):
        raise ConfigError(f"{what}: {text!r} ends with a path separator, so it names a directory; give a file "
                          f"path (without the trailing {text[-1]!r})")
    _check_ancestors(text, what)
    return Path(text)


def check_directory(path: object, what: str) -> Path:
    """``path`` as a Path, if it is a directory or one can be created there; else a ConfigError
    prefixed with ``what`` that names the path. Nothing is created here (:func:`make_directory`)."""
    text = check_path(path, what, kind="directory")
    st = stat_or_none(text, what)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = "an existing file" if stat.S_ISREG(st.st_mode) else describe(st.st_mode)
        raise ConfigError(f"{what}: {text!r} is {kind}, not a directory; give a directory path (it gets "
                          "several files)")
    if st is None:
        _check_ancestors(text, what, verb="create")
    return Path(text)


def make_directory(path: Path, what: str) -> None:
    """``path`` and its missing parents created; an OSError (e.g. in ``/proc``) prefixed with ``what``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"{what}: cannot create the directory: {exc.strerror or exc}", str(path)) from None


def _refuse_special(dest: Path, target: Path, what: str) -> None:
    """Just before ``os.replace``: ``dest`` must still be absent or a regular file (it may have
    changed since the check)."""
    try:
        mode = os.lstat(dest).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what}: {str(target)!r} is {describe(mode)}, not a regular file; qcompiler replaces "
                          "only regular files: give the path of a file to write")


def write_files(items: Sequence[tuple[PathLike, bytes]], what: str) -> list[Path]:
    """Write every ``(path, data)``: all targets are checked first, then written to temporary
    files, then each replaces its target; on a failure no temporary file is left behind.
    Returns the paths as given (a symbolic link's target is what gets written)."""
    targets = [(check_target(path, what), data) for path, data in items]
    temps: list[tuple[Path, Path]] = []  # (temporary file, the file it replaces)
    target = targets[0][0] if targets else None
    try:
        for target, data in targets:
            dest = Path(os.path.realpath(target))  # through symbolic links, as open() goes
            dest.parent.mkdir(parents=True, exist_ok=True)
            # the target's name, shortened: a long (legal) name must not make the temporary one too long
            tmp = dest.with_name(f".{dest.name[:32]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            temps.append((tmp, dest))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        for (target, _), (tmp, dest) in zip(targets, temps):
            _refuse_special(dest, target, what)
            os.replace(tmp, dest)
    except OSError as exc:
        ours = exc.filename is None or str(exc.filename).endswith(".tmp")  # the temporary file: name the target
        reason = exc.strerror or str(exc)  # an OSError raised with a message only has no strerror
        raise OSError(exc.errno, f"{what}: {reason}", str(target if ours else exc.filename)) from None
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
    return [t for t, _ in targets]


def write_file(path: PathLike, data: bytes, what: str) -> Path:
    """Write one file (see :func:`write_files`); returns its path."""
    return write_files([(path, data)], what)[0]


__all__ = ["check_path", "check_target", "check_directory", "make_directory", "describe", "stat_or_none",
           "write_file", "write_files"]
