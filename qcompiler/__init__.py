"""qcompiler: a quantization compiler for BPU + CPU targets, built on torch.fx.

The top of the layering (docs/design.md, "Layers"): the public API re-exported from the
modules that define it, including the staged workflow (prepare / convert / export).
"""

import importlib
import sys

# Public name -> defining module. Imported on first use (module ``__getattr__``), all at once, so that
# ``import qcompiler`` stays cheap: ``qcompiler --help`` and argument errors of the command line
# (tools/cli.py) must not wait for torch (issue 35). The first public name used imports every module
# below, as the eager imports did, so nothing depends on which name is touched first.
_EXPORTS = {
    "distributed": "qcompiler.distributed",
    "CompiledModel": "qcompiler.compiled", "compile": "qcompiler.compiled", "load": "qcompiler.compiled",
    "export": "qcompiler.deploy",
    "ArtifactError": "qcompiler.errors", "CalibrationError": "qcompiler.errors", "ConfigError": "qcompiler.errors",
    "PassError": "qcompiler.errors", "QCompilerError": "qcompiler.errors", "TraceError": "qcompiler.errors",
    "UnsupportedOpError": "qcompiler.errors",
    "partition": "qcompiler.frontend",
    "March": "qcompiler.march", "get_march": "qcompiler.march", "set_march": "qcompiler.march",
    "export_to_onnx": "qcompiler.onnx",
    "convert_fx": "qcompiler.quantization.convert",
    "auto_int16": "qcompiler.quantization.mixed_precision",
    "prepare_calibration_fx": "qcompiler.quantization.prepare", "prepare_qat_fx": "qcompiler.quantization.prepare",
    "prepare": "qcompiler.quantization.prepare_one_call",
    "QDType": "qcompiler.quantization.qtensor", "QTensor": "qcompiler.quantization.qtensor",
    "qint8": "qcompiler.quantization.qtensor", "qint16": "qcompiler.quantization.qtensor",
    "qint32": "qcompiler.quantization.qtensor", "quint8": "qcompiler.quantization.qtensor",
    "quantize_per_channel": "qcompiler.quantization.qtensor", "quantize_per_tensor": "qcompiler.quantization.qtensor",
    "optimize_weight_rounding": "qcompiler.quantization.weight_rounding",
}


def _load_all() -> None:
    """Bind every public name (importing its module), as the package's eager imports once did."""
    here = sys.modules[__name__]
    for name, module in _EXPORTS.items():
        if name not in here.__dict__:
            value = importlib.import_module(module)
            here.__dict__[name] = value if module.endswith("." + name) else getattr(value, name)


def __getattr__(name: str):
    """A public name (see ``_EXPORTS``; the first one binds them all) or a submodule (``qcompiler.ir``
    after ``import qcompiler``)."""
    if name in _EXPORTS:
        _load_all()
        return globals()[name]
    if not name.startswith("__"):  # a submodule: what the eager imports once bound as a side effect
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))


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
