"""torch.ao quantization classes, when torch still ships them.

qcompiler does not use torch.ao's FX quantization workflow; it only *recognizes* the objects a
model written for it carries, so the hybrid-QAT guide's models keep working:

* ``QuantStub`` / ``DeQuantStub`` modules (treated like ours);
* ``QConfig`` / ``QConfigMapping`` values (translated by :mod:`qcompiler.quantization.torch_ao`);
* torch.ao observers and fake quants left on a module (``ObserverBase`` / ``FakeQuantizeBase``),
  which constant folding must not fold away;
* ``FloatFunctional`` (``torch.ao.nn.quantized``), whose methods the tracer routes to torch ops.

torch deprecates ``torch.ao.quantization`` and plans to delete it. When an import fails, every
name here is ``None`` and every tuple empty: nothing can carry the classes then, and qcompiler's
own stubs (``qc_op``-marked) stand in for torch's; :data:`AVAILABLE` says which case holds.
This is the one module that imports torch.ao (tests/test_compat.py checks it, and that the
package imports and compiles with torch.ao blocked).
"""

from __future__ import annotations

from typing import Any, Optional

try:  # deprecated FX-mode quantization: may be removed by a torch release
    from torch.ao.quantization import DeQuantStub, FakeQuantizeBase, ObserverBase, QConfig, QConfigMapping, QuantStub
except ImportError:  # torch without torch.ao.quantization: ours stand in
    DeQuantStub = FakeQuantizeBase = ObserverBase = QConfig = QConfigMapping = QuantStub = None  # type: ignore[assignment,misc]

try:
    from torch.ao.nn.quantized import FloatFunctional
except ImportError:
    FloatFunctional = None  # type: ignore[assignment,misc]

__all__ = ["AVAILABLE", "QuantStub", "DeQuantStub", "QConfig", "QConfigMapping", "ObserverBase",
           "FakeQuantizeBase", "FloatFunctional", "STUB_TYPES", "QUANT_STUB_TYPES", "DEQUANT_STUB_TYPES",
           "OBSERVER_TYPES", "is_qconfig", "is_qconfig_mapping"]

AVAILABLE: bool = QuantStub is not None


def _present(*classes: Optional[type]) -> tuple[type, ...]:
    return tuple(c for c in classes if c is not None)


QUANT_STUB_TYPES: tuple[type, ...] = _present(QuantStub)
DEQUANT_STUB_TYPES: tuple[type, ...] = _present(DeQuantStub)
STUB_TYPES: tuple[type, ...] = QUANT_STUB_TYPES + DEQUANT_STUB_TYPES
# torch.ao observers / fake quants: stateful modules, never constants
OBSERVER_TYPES: tuple[type, ...] = _present(ObserverBase, FakeQuantizeBase)


def is_qconfig(value: Any) -> bool:
    """True for a torch.ao ``QConfig`` (False always once torch drops the class)."""
    return QConfig is not None and isinstance(value, QConfig)


def is_qconfig_mapping(value: Any) -> bool:
    """True for a torch.ao ``QConfigMapping`` (False always once torch drops the class)."""
    return QConfigMapping is not None and isinstance(value, QConfigMapping)
