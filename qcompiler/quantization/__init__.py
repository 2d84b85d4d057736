"""Quantization: stubs, observers, the QTensor (and, later, qconfigs, fake quant, convert)."""

from qcompiler.quantization.observer import MinMaxObserver
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

__all__ = [
    "QuantStub",
    "DeQuantStub",
    "MinMaxObserver",
    "QDType",
    "QTensor",
    "qint8",
    "quint8",
    "qint16",
    "qint32",
    "quantize_per_tensor",
    "quantize_per_channel",
]
