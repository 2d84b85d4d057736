"""The error hierarchy of qcompiler.

Every error a user can provoke with bad input is a :class:`QCompilerError`
subclass whose message names the node, module or key at fault and says how
to fix it.  An invariant of qcompiler's own (a pass's result, a table's rows) is checked with
an error too, never ``assert``, which ``python -O`` strips.
"""

from __future__ import annotations


class QCompilerError(Exception):
    """Base class of every error qcompiler raises on purpose."""


class ConfigError(QCompilerError, ValueError):
    """A configuration value (march, hybrid_dict, qconfig, inputs...) is wrong."""


class TraceError(QCompilerError):
    """The model cannot be traced into a graph by torch.fx."""


class UnsupportedOpError(QCompilerError):
    """An op has no lowering/emission rule where one is required."""


class CalibrationError(QCompilerError):
    """Calibration saw data it cannot use (NaN/Inf, observers that never ran)."""


class PassError(QCompilerError):
    """A compiler pass failed on an internal problem; names the pass and the passes before it."""


class InternalError(QCompilerError):
    """qcompiler broke an invariant of its own outside a pass (a table, a kernel's bookkeeping): a bug in qcompiler."""


class ArtifactError(QCompilerError):
    """A saved artifact is truncated, corrupted, foreign or from a newer format."""


class QCompilerWarning(UserWarning):
    """Warnings qcompiler emits about configs that are legal but likely wrong."""


__all__ = [
    "QCompilerError",
    "ConfigError",
    "TraceError",
    "UnsupportedOpError",
    "CalibrationError",
    "PassError",
    "InternalError",
    "ArtifactError",
    "QCompilerWarning",
]
