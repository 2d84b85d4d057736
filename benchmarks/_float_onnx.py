"""The float model as an ONNX file for onnxruntime's static int8 quantizer, the benchmarks' peer.

torch.onnx's TorchScript exporter (``dynamo=False``) is deprecated and its dynamo exporter needs
``onnxscript``, so the benchmarks write the float model with the project's own exporter:
``qcompiler.onnx.export_to_onnx`` of the float ``qcompiler.partition`` (opset 11, BatchNorm folded
into the convs, the same float outputs), then ``onnx.version_converter`` up to opset 13, the first
opset whose DequantizeLinear has the ``axis`` that ``quantize_static(per_channel=True)`` writes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from qcompiler.errors import ConfigError

__all__ = ["PEER_OPSET", "export_float_onnx"]

EXPORT_OPSET = 11  # what qcompiler.onnx writes
PEER_OPSET = 13  # per-channel QDQ (DequantizeLinear's axis) starts here


def export_float_onnx(model: nn.Module, example: torch.Tensor, path: str, *, input_name: str = "x",
                      batch_axis: Optional[str] = "batch", opset: int = PEER_OPSET) -> str:
    """Write ``model`` (float, eval) traced on ``example`` to ``path`` as ONNX ``opset``; returns ``path``.

    ``input_name``: the graph input's name (the calibration reader's key). ``batch_axis``: the name
    of a symbolic dim 0 on the input (and the outputs that follow it), so one file runs every batch
    size; None leaves it to the exporter (dim 0 symbolic where the graph is proven per-sample). ``opset`` >= 11 (the exporter's; newer ones are converted to).
    The exporter's quantization sidecar (``<path>.quant.json``) is written next to the file.
    """
    import onnx
    from onnx import version_converter

    from qcompiler import partition
    from qcompiler.onnx import export_to_onnx

    if opset < EXPORT_OPSET:
        raise ConfigError(f"export_float_onnx(opset={opset!r}): the exporter writes opset {EXPORT_OPSET} and "
                          f"converts only upwards; pass opset >= {EXPORT_OPSET} (onnxruntime's per-channel "
                          f"quantizer needs {PEER_OPSET})")
    dynamic = {input_name: {0: batch_axis}} if batch_axis else None
    export_to_onnx(partition(model, (example,)), (example,), path, input_names=[input_name], dynamic_axes=dynamic)
    if opset > EXPORT_OPSET:
        onnx.save(version_converter.convert_version(onnx.load(path), opset), path)
    return path
