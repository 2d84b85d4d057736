"""The ONNX backend: one opset-11 emitter for CPU islands and whole-model export.

* :func:`emit_graph` -- a whole GraphModule (float, partitioned, prepared or converted);
* :func:`emit_subgraph` -- a CPU island (node names + boundary values);
* ``op_table`` -- the data table of emit rules, ``rules`` -- the float rules,
  ``quant`` -- Q/DQ, dequantized weights and the sidecar of a quantized export.

The user-facing export is ``qcompiler.onnx.export_to_onnx``.
"""

from qcompiler.backends.onnx.emitter import (
    OPSET_VERSION,
    EmitResult,
    OnnxEmitter,
    emit_graph,
    emit_subgraph,
)

__all__ = ["emit_graph", "emit_subgraph", "OnnxEmitter", "EmitResult", "OPSET_VERSION"]
