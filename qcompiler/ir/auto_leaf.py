"""Tracing that does not stop at untraceable code: what fails to trace runs as a whole, in torch.

``torch.fx`` symbolic tracing fails on data-dependent Python (``if x.sum() > 0``, loops over a
tensor's values, ``torch``'s control-flow operators...). :func:`trace_or_fallback` then does what
the TraceError would tell the user to do, and warns:

* the failure is inside a submodule: the deepest module on the tracer's stack when it failed
  becomes a leaf (called as a whole, like ``prepare_custom_config_dict``'s
  ``non_traceable_module_name``), and tracing starts again; repeated until the model traces;
* the failure is in the top-level ``forward``: the graph is one call of the whole model.

Each such node carries ``META_AUTO_LEAF`` (why), so placement keeps it on the CPU, where it runs
as an eager-torch island (ONNX has no form for arbitrary Python): the model compiles and runs,
but ``export_onnx`` and ``save`` refuse it (docs/stubs_and_tracing.md). With ``strict=True``
(``prepare_custom_config_dict={"strict_tracing": True}``) the TraceError is raised instead, and
so it is for an error in the model's code (a NameError: the forward fails eagerly too).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional, Sequence

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import QCompilerWarning, TraceError
from qcompiler.ir.meta import META_AUTO_LEAF, META_SCOPE, ScopeEntry
from qcompiler.ir.shape_prop import normalize_inputs
from qcompiler.ir.tracer import trace

WHOLE_MODEL = "model"  # the submodule name of a model that runs as one leaf


def trace_or_fallback(model: nn.Module, *, leaf_module_names: Sequence[str] = (),
                      leaf_module_types: Sequence[Any] = (), example_inputs: Any = None,
                      strict: bool = False) -> fx.GraphModule:
    """:func:`~qcompiler.ir.tracer.trace`, making untraceable modules leaves (see the module doc)."""
    leaves = list(leaf_module_names)
    auto: dict[str, str] = {}  # module path -> why it is a leaf
    while True:
        try:
            gm = trace(model, leaf_module_names=leaves, leaf_module_types=leaf_module_types,
                       example_inputs=example_inputs)
            break
        except TraceError as err:
            if strict or getattr(err, "code_error", False) or err.module_path in leaves:
                raise
            if not err.module_path:
                gm = whole_model_graph(model, example_inputs, err)
                _warn_whole(model, err)
                return gm
            auto[err.module_path] = err.reason
            leaves.append(err.module_path)
            _warn_leaf(model, err)
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in auto:
            module = gm.get_submodule(node.target)
            node.meta[META_AUTO_LEAF] = (f"module '{node.target}' ({type(module).__name__}) cannot be traced "
                                         f"({auto[node.target]}): it runs as a whole, in eager torch on the CPU")
    return gm


def _warn_leaf(model: nn.Module, err: TraceError) -> None:
    path = err.module_path
    warnings.warn(
        f"{type(model).__name__}: {err} Done automatically: '{path}' is a leaf that runs as a whole in eager "
        f"torch on the CPU (export_onnx and save refuse it). Name it yourself to silence this warning, "
        f"or pass prepare_custom_config_dict={{'strict_tracing': True}} to stop here instead.",
        QCompilerWarning, stacklevel=4)


def _warn_whole(model: nn.Module, err: TraceError) -> None:
    warnings.warn(
        f"{type(model).__name__}: {err} Done instead: the whole model runs as one eager-torch island on the "
        f"CPU, with nothing on the BPU (export_onnx and save refuse it). To quantize it, move the untraceable "
        f"code into a submodule (which then becomes a leaf); pass prepare_custom_config_dict="
        f"{{'strict_tracing': True}} to stop here instead.", QCompilerWarning, stacklevel=4)


def _input_names(model: nn.Module, n: Optional[int]) -> list[str]:
    """Names of the first ``n`` positional ``forward`` parameters (all required ones for None)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if n is None:
        n = sum(p.default is p.empty for p in positional)
    names = [p.name for p in positional[:n]]
    return names + [f"input_{i}" for i in range(len(names), n)]  # *args


def whole_model_graph(model: nn.Module, example_inputs: Any, err: TraceError) -> fx.GraphModule:
    """A graph of one node calling ``model`` (as submodule ``WHOLE_MODEL``) on the inputs."""
    n = None if example_inputs is None else len(normalize_inputs(example_inputs))
    root = nn.Module()
    root.add_module(WHOLE_MODEL, model)
    top = ScopeEntry("", type(model))
    graph = fx.Graph()
    inputs = []
    for name in _input_names(model, n):
        ph = graph.placeholder(name)
        ph.meta[META_SCOPE] = (top,)
        inputs.append(ph)
    call = graph.call_module(WHOLE_MODEL, tuple(inputs))
    call.meta[META_SCOPE] = (top, ScopeEntry(WHOLE_MODEL, type(model)))
    call.meta[META_AUTO_LEAF] = (f"the model's forward cannot be traced ({err.reason}): the whole model runs "
                                 f"in eager torch on the CPU")
    graph.output(call)
    return fx.GraphModule(root, graph, class_name=type(model).__name__)


__all__ = ["trace_or_fallback", "whole_model_graph", "WHOLE_MODEL"]
