"""Does an exported graph with a symbolic batch axis really run at any batch size?

The export declares dim 0 of every input and output symbolic only for graphs proven per-sample
(:func:`qcompiler.ir.batch_dim.batch_refusal`), whose reshapes take the batch as ``x.size(0)``
or ``-1``. An emit rule may still write a size it read from the traced shapes into a constant
(a Reshape target, an Expand shape): that constant holds the traced batch, and onnxruntime
fails (or mixes samples) at another one. :func:`batch_fixing_node` finds such a node with ONNX
shape inference, which follows the symbolic batch through the graph: the first node that turns
tensors of a symbolic size into a tensor of a fixed size, when an output's dim 0 ends fixed.
"""

from __future__ import annotations

from typing import Optional

import onnx
from onnx import TensorProto

__all__ = ["batch_fixing_node"]

# ops whose output is a size, not a sample's data: fixed whatever the batch
_SIZE_OPS = frozenset({"Shape", "Size"})


def batch_fixing_node(model: onnx.ModelProto) -> Optional[str]:
    """The name of the node that fixes the batch of ``model`` (inputs with a symbolic dim 0), or
    None when every output's dim 0 stays symbolic (or unknown) under ONNX shape inference."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for o in probe.graph.output:
        o.type.tensor_type.ClearField("shape")
    del probe.graph.value_info[:]
    try:
        graph = onnx.shape_inference.infer_shapes(probe, data_prop=True).graph
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return None
    shapes = {vi.name: vi.type.tensor_type for vi in [*graph.input, *graph.value_info, *graph.output]
              if vi.type.tensor_type.HasField("shape")}
    fixed_output = any(o.name in shapes and shapes[o.name].shape.dim
                       and shapes[o.name].shape.dim[0].HasField("dim_value") for o in graph.output)
    if not fixed_output:
        return None
    for node in graph.node:
        if node.op_type in _SIZE_OPS:
            continue
        varying = [i for i in node.input if i in shapes and not _static(shapes[i])
                   and shapes[i].elem_type != TensorProto.INT64]
        made = [o for o in node.output if o in shapes and _static(shapes[o])]
        if varying and made:
            return node.name or node.output[0]
    return None


def _static(t: onnx.TypeProto.Tensor) -> bool:
    return all(d.HasField("dim_value") for d in t.shape.dim)
