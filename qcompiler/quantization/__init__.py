"""Quantization primitives: stubs, observers, fake quant, qconfigs, the QTensor and fixed-point math.

This package is the bottom layer (docs/design.md, "Layers"): the passes, the BPU tables and
the backends import primitives from it, so it must not import the workflow that is built on
them. ``prepare_calibration_fx``, ``prepare_qat_fx``, ``convert_fx`` and
``optimize_weight_rounding`` live one layer up (:mod:`.prepare`, :mod:`.convert`,
:mod:`.weight_rounding`) and are exported by ``qcompiler``; they stay reachable here, under the
path the hybrid-QAT guide uses, through a module ``__getattr__`` that imports them on first use.
"""

import importlib

from qcompiler.quantization.fake_quantize import (
    CalibFakeQuantize,
    FakeQuantize,
    FakeQuantizeBase,
    assign_qc_names,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
    fake_quantize,
    set_state,
)
from qcompiler.quantization.observer import (
    OBSERVERS,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    ObserverBase,
    PercentileObserver,
    PerChannelMinMaxObserver,
    make_observer,
)
from qcompiler.quantization.qconfig import (
    QConfig,
    QConfigResolver,
    get_default_calib_out_qconfig,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    parse_qconfig_dict,
)
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
from qcompiler.quantization.stubs import DeQuantStub, QuantStub

# The workflow (one layer up), by public name -> defining module; resolved by __getattr__.
WORKFLOW = {
    "prepare_calibration_fx": "qcompiler.quantization.prepare",
    "prepare_qat_fx": "qcompiler.quantization.prepare",
    "convert_fx": "qcompiler.quantization.convert",
    "optimize_weight_rounding": "qcompiler.quantization.weight_rounding",
    "LayerRounding": "qcompiler.quantization.weight_rounding",
    "RoundingReport": "qcompiler.quantization.weight_rounding",
    "auto_int16": "qcompiler.quantization.mixed_precision",
}


def __getattr__(name: str):
    """``from qcompiler.quantization import prepare_qat_fx`` (the guide's spelling) keeps working."""
    if name in WORKFLOW:
        return getattr(importlib.import_module(WORKFLOW[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(WORKFLOW))


__all__ = [
    *WORKFLOW,
    "QuantStub",
    "DeQuantStub",
    "ObserverBase",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "HistogramObserver",
    "PercentileObserver",
    "OBSERVERS",
    "make_observer",
    "FakeQuantizeBase",
    "FakeQuantize",
    "CalibFakeQuantize",
    "fake_quantize",
    "enable_observer",
    "disable_observer",
    "enable_fake_quant",
    "disable_fake_quant",
    "set_state",
    "assign_qc_names",
    "QConfig",
    "QConfigResolver",
    "parse_qconfig_dict",
    "get_default_calib_qconfig",
    "get_default_calib_out_qconfig",
    "get_default_qat_qconfig",
    "get_default_qat_out_qconfig",
    "QDType",
    "QTensor",
    "qint8",
    "quint8",
    "qint16",
    "qint32",
    "quantize_per_tensor",
    "quantize_per_channel",
]
