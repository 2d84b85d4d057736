"""Quantization: stubs, observers (and, later, qconfigs, fake quant, convert)."""

from qcompiler.quantization.observer import MinMaxObserver
from qcompiler.quantization.stubs import DeQuantStub, QuantStub

__all__ = ["QuantStub", "DeQuantStub", "MinMaxObserver"]
