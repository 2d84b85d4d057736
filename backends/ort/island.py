"""A CPU partition as an onnxruntime session.

The island's ONNX model comes from the one emitter (``qcompiler.backends.onnx``);
its inputs and outputs are named after the FX values crossing the island's
boundary, a tuple value ``v`` as ``v.0``, ``v.1``...
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnxruntime as ort
import torch

from qcompiler.errors import ConfigError


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
        return torch.from_numpy(np.ascontiguousarray(results[name]))
    items, i = [], 0
    while any(k == f"{name}.{i}" or k.startswith(f"{name}.{i}.") for k in results):
        items.append(_unflatten(f"{name}.{i}", results))
        i += 1
    if not items:
        raise KeyError(name)
    return tuple(items)
