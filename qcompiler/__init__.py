"""qcompiler: a quantization compiler for BPU + CPU targets, built on torch.fx.

The top of the layering (docs/design.md, "Layers"): the public API re-exported from the
modules that define it, including the staged workflow (prepare / convert / export).
"""

from qcompiler import distributed
from qcompiler.compiled import CompiledModel, compile, load
from qcompiler.deploy import export
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
from qcompiler.onnx import export_to_onnx
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.mixed_precision import auto_int16
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.prepare_one_call import prepare  # also makes qcompiler.quantization.prepare callable
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
from qcompiler.quantization.weight_rounding import optimize_weight_rounding

__version__ = "0.1.0"

__all__ = [
    "compile",
    "export",
    "prepare",
    "load",
    "CompiledModel",
    "partition",
    "prepare_calibration_fx",
    "prepare_qat_fx",
    "convert_fx",
    "optimize_weight_rounding",
    "auto_int16",
    "export_to_onnx",
    "distributed",
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
