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
from qcompiler.compiled import CompiledModel, compile, load
from qcompiler.frontend import partition
from qcompiler.march import March, get_march, set_march
from qcompiler.quantization.qtensor import (
    QDType,
    QTensor,
    qint8,
    qint16,
    qint32,
    quantize_per_channel,
    quantize_per_tensor,
    quint8,
)

__version__ = "0.1.0"

__all__ = [
    "compile",
    "load",
    "CompiledModel",
    "partition",
    "March",
    "QTensor",
    "QDType",
    "quantize_per_tensor",
    "quantize_per_channel",
    "qint8",
    "quint8",
    "qint16",
    "qint32",
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
