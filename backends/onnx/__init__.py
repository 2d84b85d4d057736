"""The ONNX backend: one opset-11 emitter for CPU islands and whole-model export.

Layers inside the backend, each importing only the ones before it:

* :mod:`.context` -- value names, the graph builder and ``NodeContext`` (what a rule reads);
* :mod:`.registry` -- ``@emits(op, since=opset)``: canonical op / module class -> {opset: rule};
* :mod:`.quant` -- Q/DQ, dequantized weights and the sidecar of a quantized export;
* :mod:`.rules` -- one module per op family, registering its rules on import;
* :mod:`.emitter` -- :func:`emit_graph` (a whole GraphModule) and :func:`emit_subgraph`
  (a CPU island: node names + boundary values).

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
