"""qcompiler: a quantization compiler for BPU + CPU targets, built on torch.fx."""

from qcompiler.errors import (
    ArtifactError,
    CalibrationError,
    ConfigError,
    PassError,
    QCompilerError,
    TraceError,
    UnsupportedOpError,
)
from qcompiler.frontend import partition
from qcompiler.march import March, get_march, set_march

__version__ = "0.1.0"

__all__ = [
    "partition",
    "March",
    "set_march",
    "get_march",
    "QCompilerError",
    "ConfigError",
    "TraceError",
    "UnsupportedOpError",
    "CalibrationError",
    "PassError",
    "ArtifactError",
]
