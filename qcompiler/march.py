"""BPU generations ("marches") and the process-wide default march.

Every entry point takes ``march=`` which overrides the global set here.
March names are case-insensitive everywhere (``"Bayes"``, ``"BAYES"`` and
``"bayes"`` are the same march: ``--march``, ``set_march``, ``march=`` of the
API and ``March("Bayes")``); anything else is a ConfigError listing the marches.
"""

from __future__ import annotations

import difflib
import enum
from typing import Optional, Union

from qcompiler.errors import ConfigError


class March(str, enum.Enum):
    """A BPU generation. The value is the name users type on the command line."""

    BERNOULLI2 = "bernoulli2"  # RDK X3
    BAYES = "bayes"  # J5 / RDK Ultra
    NASH = "nash"  # J6-class, transformer era (backends/bpu/nash.py)
    # the accuracy-debugging guide's spellings of the same generation: aliases, one table
    NASH_M = "nash"
    NASH_E = "nash"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> "March":
        """``March("Bayes")``: the same case-insensitive lookup as :func:`to_march` (ConfigError otherwise)."""
        return to_march(value)  # type: ignore[arg-type]


_DEFAULT_MARCH = March.BAYES
_current: March = _DEFAULT_MARCH

MarchLike = Union[March, str]


def to_march(value: MarchLike) -> March:
    """Parse a March or its name (case-insensitive); ConfigError lists the choices."""
    if isinstance(value, March):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for name, m in March.__members__.items():  # with the aliases (NASH_M, NASH_E)
            if key in (m.value, name.lower()):
                return m
    allowed = ", ".join(m.value for m in March)
    close = difflib.get_close_matches(str(value).lower(), [m.value for m in March], n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"unknown march {value!r}; allowed: {allowed}.{hint}")


def set_march(march: MarchLike) -> None:
    """Set the process-wide default march used when an entry point gets ``march=None``."""
    global _current
    _current = to_march(march)


def get_march() -> March:
    """The process-wide default march (``March.BAYES`` until ``set_march`` is called)."""
    return _current


def resolve_march(march: Optional[MarchLike]) -> March:
    """The march an entry point should use: its own argument, else the global one."""
    return get_march() if march is None else to_march(march)
