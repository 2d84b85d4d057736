"""CPU islands on onnxruntime: one InferenceSession per island, created once."""

from qcompiler.backends.ort.island import OrtIsland, check_island

__all__ = ["OrtIsland", "check_island"]
