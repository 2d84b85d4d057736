"""qcompiler: a quantization compiler for BPU + CPU targets, built on torch.fx.

The top of the layering (docs/design.md, "Layers"): the public API re-exported from the
modules that define it, including the staged workflow (prepare / convert / export).
"""

import importlib
import importlib.abc
import importlib.machinery
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
    # also makes the module qcompiler.quantization.prepare callable (prepare_one_call._CallableModule)
    "prepare": "qcompiler.quantization.prepare_one_call",
    "QDType": "qcompiler.quantization.qtensor", "QTensor": "qcompiler.quantization.qtensor",
    "qint8": "qcompiler.quantization.qtensor", "qint16": "qcompiler.quantization.qtensor",
    "qint32": "qcompiler.quantization.qtensor", "quint8": "qcompiler.quantization.qtensor",
    "quantize_per_channel": "qcompiler.quantization.qtensor", "quantize_per_tensor": "qcompiler.quantization.qtensor",
    "optimize_weight_rounding": "qcompiler.quantization.weight_rounding",
}


class _ThenImport(importlib.abc.MetaPathFinder):
    """Import ``then`` right after the module ``name`` first runs: the side effect an eager import in
    this file once had for every user (``prepare_one_call`` makes ``qcompiler.quantization.prepare``
    callable, so ``from qcompiler.quantization import prepare; prepare(model, x)`` works however the
    module is reached)."""

    def __init__(self, name: str, then: str) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the module is now being imported
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        inner, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                importlib.import_module(then)

        spec.loader = Loader()
        return spec


if "qcompiler.quantization.prepare" not in sys.modules:
    sys.meta_path.insert(0, _ThenImport("qcompiler.quantization.prepare", "qcompiler.quantization.prepare_one_call"))


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
