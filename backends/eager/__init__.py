"""CPU islands in eager torch: what ONNX opset 11 cannot express still runs (never pickled)."""

from qcompiler.backends.eager.island import TORCH, EagerIsland, island_module

__all__ = ["TORCH", "EagerIsland", "island_module"]
