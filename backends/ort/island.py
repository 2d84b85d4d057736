"""A CPU partition as an onnxruntime session.

The island's ONNX model comes from the one emitter (``qcompiler.backends.onnx``);
its inputs and outputs are named after the FX values crossing the island's
boundary, a tuple value ``v`` as ``v.0``, ``v.1``...
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch

from qcompiler.errors import ArtifactError, ConfigError


def flatten_value(name: str, value: Any) -> dict[str, Any]:
    """``{name: tensor}``, or ``{name.0: ..., name.1: ...}`` for (nested) tuples, as the emitter names them."""
    if isinstance(value, (tuple, list)):
        out: dict[str, Any] = {}
        for i, v in enumerate(value):
            out.update(flatten_value(f"{name}.{i}", v))
        return out
    return {name: value}


class OrtIsland:
    """Run one CPU island: float tensors in, float tensors out."""

    def __init__(self, name: str, model_bytes: bytes, inputs: Sequence[str], outputs: Sequence[str],
                 threads: int = 1) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"ort threads must be a positive int, got {threads!r}")
        self.name, self.model_bytes = name, model_bytes
        self.inputs, self.outputs = list(inputs), list(outputs)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        self._feed_names = [i.name for i in self.session.get_inputs()]
        self._fetch_names = [o.name for o in self.session.get_outputs()]

    def run(self, env: dict[str, Any]) -> dict[str, Any]:
        """Read this island's inputs from ``env`` (FX value names) and return its outputs by name."""
        flat: dict[str, Any] = {}
        for name in self.inputs:
            flat.update(flatten_value(name, env[name]))
        feeds = {}
        for n in self._feed_names:
            v = flat[n]
            feeds[n] = v.detach().contiguous().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        results = dict(zip(self._fetch_names, self.session.run(self._fetch_names, feeds)))
        return {name: _unflatten(name, results) for name in self.outputs}


def _unflatten(name: str, results: dict[str, np.ndarray]) -> Any:
    if name in results:
        a = results[name]  # np.ascontiguousarray would make a 0-d result 1-d
        return torch.from_numpy(a if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(a.shape))
    items, i = [], 0
    while any(k == f"{name}.{i}" or k.startswith(f"{name}.{i}.") for k in results):
        items.append(_unflatten(f"{name}.{i}", results))
        i += 1
    if not items:
        raise KeyError(name)
    return tuple(items)


def check_island(name: str, model_bytes: bytes, inputs: Sequence[str], outputs: Sequence[str]) -> set[str]:
    """ArtifactError unless ``model_bytes`` is an ONNX model that carries all its data and whose
    graph reads and writes the step's values (``v`` or ``v.0``, ``v.1``... for tuples).
    Returns the graph's input names.

    An initializer or constant with external data would make onnxruntime read a file named
    by the island (resolved against the current directory): islands must be self-contained.
    """
    try:
        model = onnx.ModelProto()
        model.ParseFromString(model_bytes)
    except Exception as exc:  # protobuf raises DecodeError / RuntimeError by implementation
        raise ArtifactError(f"island '{name}': not an ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.HasField("graph"):
        raise ArtifactError(f"island '{name}': not an ONNX model (no graph)")
    for where, tensor in _tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.external_data):
            location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
            raise ArtifactError(f"island '{name}': {where} '{tensor.name}' refers to external data "
                                f"(location {location!r}); islands must be self-contained")
    feeds = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    for feed in feeds:
        if not any(feed == v or feed.startswith(f"{v}.") for v in inputs):
            raise ArtifactError(f"island '{name}': graph input '{feed}' is none of the step's inputs "
                                f"({', '.join(inputs)})")
    fetches = {o.name for o in model.graph.output}
    for v in outputs:
        if not any(f == v or f.startswith(f"{v}.") for f in fetches):
            raise ArtifactError(f"island '{name}': the step's output '{v}' is not a graph output")
    return feeds


def _tensors(model):
    """(where, TensorProto) of every tensor in the model: initializers, sparse initializers and
    tensor attributes, in the main graph, subgraphs and functions (iteratively: no recursion)."""
    graphs = [("graph", model.graph)]
    nodes = [("function", n) for f in model.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            where, g = graphs.pop()
            for t in g.initializer:
                yield f"{where} initializer", t
            for st in g.sparse_initializer:
                yield f"{where} sparse initializer", st.values
                yield f"{where} sparse initializer", st.indices
            nodes.extend((f"{where} node '{n.name}'", n) for n in g.node)
            continue
        where, n = nodes.pop()
        for a in n.attribute:
            if a.HasField("t"):
                yield f"{where} attribute '{a.name}'", a.t
            for t in a.tensors:
                yield f"{where} attribute '{a.name}'", t
            if a.HasField("sparse_tensor"):
                yield f"{where} attribute '{a.name}'", a.sparse_tensor.values
            for st in a.sparse_tensors:
                yield f"{where} attribute '{a.name}'", st.values
            if a.HasField("g"):
                graphs.append((f"{where} subgraph", a.g))
            graphs.extend((f"{where} subgraph", g) for g in a.graphs)
