"""CPU islands on onnxruntime: one InferenceSession per island, created once."""

from qcompiler.backends.ort.island import OrtIsland

__all__ = ["OrtIsland"]
