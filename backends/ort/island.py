"""A CPU partition as an onnxruntime session.

The island's ONNX model comes from the one emitter (``qcompiler.backends.onnx``);
its inputs and outputs are named after the FX values crossing the island's
boundary, a tuple value ``v`` as ``v.0``, ``v.1``... An island read from an
artifact is checked first (:func:`check_island`): self-contained, and written
in the emitter's vocabulary only (:mod:`qcompiler.backends.onnx.allowlist`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch

from qcompiler.backends.bpu.program_check import short
from qcompiler.backends.onnx.allowlist import ALLOWED, DOMAIN, OPSET
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
        # no constant folding: it runs the island's ops on its constants while the session is made, so
        # a 16-byte shape could make load allocate and fill gigabytes (docs/artifacts.md, "Threat model")
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"],
                                            disabled_optimizers=["ConstantFolding"])
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
    """ArtifactError unless ``model_bytes`` is an ONNX model that carries all its data, holds only
    what qcompiler's emitter writes (:func:`check_vocabulary`) and whose graph reads and writes the
    step's values (``v`` or ``v.0``, ``v.1``... for tuples). Returns the graph's input names.

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
    check_vocabulary(model, f"island '{name}'")
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


NOT_OURS = "the island is not one qcompiler writes (compile and save the model again)"


def check_vocabulary(model: onnx.ModelProto, where: str) -> None:
    """ArtifactError unless ``model`` imports only opset 11 of the default domain and each of its
    nodes is an op type of :data:`~qcompiler.backends.onnx.allowlist.ALLOWED` with only the
    attributes listed for it, each of its schema type: no custom domain, no local function, no
    subgraph (a ``Loop`` / ``If`` / ``Scan`` or a graph attribute), nothing onnxruntime could run
    that the emitter never writes. ``where`` starts the message ("island 'cpu0'")."""
    ours = f"qcompiler imports only the default ONNX domain at opset {OPSET}"
    for opset in model.opset_import:
        if (opset.domain, opset.version) != (DOMAIN, OPSET):
            raise ArtifactError(f"{where}: imports domain {short(opset.domain)} (version {opset.version}); {ours}; "
                                f"{NOT_OURS}")
    if len(model.opset_import) != 1:
        raise ArtifactError(f"{where}: imports {len(model.opset_import)} opsets; {ours}; {NOT_OURS}")
    if model.functions:
        names = ", ".join(short(f.name) for f in model.functions[:3])
        raise ArtifactError(f"{where}: defines {len(model.functions)} local function"
                            f"{'s' if len(model.functions) > 1 else ''} ({names}); qcompiler writes none; {NOT_OURS}")
    if model.training_info:
        raise ArtifactError(f"{where}: carries training info; qcompiler writes none; {NOT_OURS}")
    for i, node in enumerate(model.graph.node):
        what = f"node {short(node.name)}" if node.name else f"node {i} (unnamed)"
        if node.domain != DOMAIN:
            raise ArtifactError(f"{where}: {what} has op type {short(node.op_type)} of domain {short(node.domain)}; "
                                f"qcompiler writes only the default ONNX domain; {NOT_OURS}")
        allowed = ALLOWED.get(node.op_type)
        if allowed is None:
            raise ArtifactError(f"{where}: {what} has op type {short(node.op_type)}, which qcompiler never writes; "
                                f"{NOT_OURS}")
        for a in node.attribute:
            if a.name not in allowed:
                raise ArtifactError(f"{where}: {what} ({node.op_type}) has attribute {short(a.name)}, which qcompiler "
                                    f"never writes on {node.op_type}; {NOT_OURS}")
            want = _attribute_type(node.op_type, a.name)
            if a.ref_attr_name:
                raise ArtifactError(f"{where}: {what} ({node.op_type}) has attribute '{a.name}' referring to "
                                    f"function attribute {short(a.ref_attr_name)}; qcompiler writes its value; "
                                    f"{NOT_OURS}")
            if a.type != want:
                raise ArtifactError(f"{where}: {what} ({node.op_type}) has attribute '{a.name}' of type "
                                    f"{_type_name(a.type)}; qcompiler writes it as {_type_name(want)}; {NOT_OURS}")


def _attribute_type(op_type: str, attr: str) -> int:
    """The attribute's type in the opset-11 schema of ``op_type`` (what the emitter, whose islands
    pass ``onnx.checker``, writes)."""
    return onnx.defs.get_schema(op_type, OPSET, DOMAIN).attributes[attr].type


def _type_name(t: int) -> str:
    try:
        return onnx.AttributeProto.AttributeType.Name(t)
    except ValueError:
        return str(t)


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
