"""Tracing that does not stop at untraceable code: what fails to trace runs as a whole, in torch.

``torch.fx`` symbolic tracing fails on data-dependent Python (``if x.sum() > 0``, loops over a
tensor's values, ``torch``'s control-flow operators...). :func:`trace_or_fallback` then does what
the TraceError would tell the user to do, and warns:

* the failure is inside a submodule: the deepest module on the tracer's stack when it failed
  becomes a leaf (called as a whole, like ``prepare_custom_config_dict``'s
  ``non_traceable_module_name``), and tracing starts again; repeated until the model traces;
* the failure is in the top-level ``forward``: the statement of the forward where it failed is cut
  out into an eager-torch island (:mod:`qcompiler.ir.glue`) and tracing starts again, so the
  submodules called around it stay in the graph; where no statement can be cut, the graph is one
  call of the whole model.

A module whose forward changes a parameter or buffer in place keeps state from call to call, which
a graph cannot hold: it becomes a leaf the same way (:func:`_raise_on_state_writes`).

Each such node carries ``META_AUTO_LEAF`` (why), so placement keeps it on the CPU, where it runs
as an eager-torch island (ONNX has no form for arbitrary Python): the model compiles and runs,
but ``export_onnx`` and ``save`` refuse it (docs/stubs_and_tracing.md). With ``strict=True``
(``prepare_custom_config_dict={"strict_tracing": True}``) the TraceError is raised instead, and
so it is for an error in the model's code (a NameError: the forward fails eagerly too).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import QCompilerWarning, TraceError
from qcompiler.ir.glue import GLUE_CONSTANTS, GLUE_PREFIX, ForwardCuts, Fresh, GlueIsland
from qcompiler.ir.inplace import UNKNOWN_STORAGE, state_writes, storage_key
from qcompiler.ir.meta import META_AUTO_LEAF, META_SCOPE, ScopeEntry, scope
from qcompiler.ir.names import resolve_type
from qcompiler.ir.shape_prop import normalize_inputs
from qcompiler.ir.state import ModelState, tensor_attributes, tracked
from qcompiler.ir.tracer import QTracer, forward_signature, is_user_file, leaf_fix, module_where, trace

WHOLE_MODEL = "model"  # the submodule name of a model that runs as one leaf


def trace_or_fallback(model: nn.Module, *, leaf_module_names: Sequence[str] = (),
                      leaf_module_types: Sequence[Any] = (), example_inputs: Any = None,
                      strict: bool = False, pristine: Optional[nn.Module] = None) -> fx.GraphModule:
    """:func:`~qcompiler.ir.tracer.trace`, making untraceable modules leaves (see the module doc).
    ``pristine``: the model ``model`` is a copy of, whose tensors undo what tracing wrote into the
    copy's (without it, tracing ``model`` itself, only its buffers can be put back)."""
    leaves = list(leaf_module_names)
    leaf_types = [resolve_type(t, "non_traceable_module_class") for t in leaf_module_types]
    auto: dict[str, str] = {}  # module path -> why it is a leaf
    cuts: dict[str, ForwardCuts] = {}  # module path -> the statements cut out of its forward
    glue: dict[str, str] = {}  # GlueIsland path -> why its statements are cut out
    while True:
        state, attributes = ModelState(model, pristine), set(vars(model))
        try:
            try:
                gm = trace(model, leaf_module_names=leaves, leaf_module_types=leaf_module_types,
                           example_inputs=example_inputs)
            finally:
                written, lost = state.restore()
            for island, bound in gm.meta.pop(GLUE_CONSTANTS, ()):  # put back by restore() with the rest
                island.bound = bound
                island.fresh = {island.reads[i] for i, v in bound.items() if isinstance(v, Fresh)}
            if _return_filled_containers(model, cuts):
                continue  # the forward was rewritten: trace again
            _fresh_constants(gm, model, attributes)
            tracer = QTracer(leaves, leaf_types)
            _raise_on_state_writes(model, gm, state, written, lost,
                                   lambda path: tracer.is_leaf_module(model.get_submodule(path), path))
            break
        except TraceError as err:
            if strict or getattr(err, "code_error", False) or err.module_path in leaves:
                raise
            if not err.module_path:
                island = _cut_statement(model, err, cuts)
                if island is not None:
                    glue[island.name] = err.reason
                    _warn_glue(model, err, island)
                    continue
                gm = whole_model_graph(model, example_inputs, err)
                _warn_whole(model, err)
                return gm
            auto[err.module_path] = err.reason
            leaves.append(err.module_path)
            _warn_leaf(model, err)
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in glue:
            island = gm.get_submodule(node.target)
            node.meta[META_AUTO_LEAF] = (f"lines {island.lines[0]}-{island.lines[1]} of {type(model).__name__}."
                                         f"forward cannot be traced ({glue[node.target]}): they run in eager "
                                         f"torch on the CPU")
        if node.op == "call_module" and node.target in auto:
            module = gm.get_submodule(node.target)
            node.meta[META_AUTO_LEAF] = (f"module '{node.target}' ({type(module).__name__}) cannot be traced "
                                         f"({auto[node.target]}): it runs as a whole, in eager torch on the CPU")
    return gm


def _cut_statement(model: nn.Module, err: TraceError, cuts: dict[str, ForwardCuts]) -> Optional[GlueIsland]:
    """Cut the top-level statement of ``model``'s forward where tracing failed into a GlueIsland
    (:mod:`qcompiler.ir.glue`); None where that cannot be done (the caller runs the whole model)."""
    if type(model).__module__.startswith("torch.nn."):  # torch's own layer (an nn.GRU as the whole model):
        return None  # its one call is the op the rules know; cut statements would leave _VF calls
    forward = cuts.get("") or ForwardCuts.parse(model)
    if forward is None or len(forward.cuts) >= MAX_CUTS:
        return None
    lines = [line for code, line in getattr(err, "frames", ()) if code is forward.code]
    index = forward.statement_at(lines[-1]) if lines else None
    if index is None:
        return None
    island = forward.cut(model, index, lambda i: f"{GLUE_PREFIX}{i}")
    if island is not None:
        cuts[""] = forward
    return island


def _return_filled_containers(model: nn.Module, cuts: dict[str, ForwardCuts]) -> bool:
    """A list the traced code made and an island fills (``sizes = []`` then a loop appending) is a
    constant of the trace; where code after the island reads it, the island returns it, so that the
    later code reads what the call filled in. True if a forward was rewritten for that."""
    forward = cuts.get("")
    if forward is None:
        return False
    names = forward.island_names(lambda i: f"{GLUE_PREFIX}{i}")
    changed = False
    for name in names.values():
        island = getattr(model, name)
        missing = {n for n in island.fresh if n in island.later_reads and n not in (island.writes or ())}
        if missing and island.writes is not None:
            forward.also_return(model, island, missing, names)
            changed = True
    return changed


MAX_CUTS = 32  # statements cut out of one forward before giving up (each retry traces the model again)


def _fresh_constants(gm: fx.GraphModule, model: nn.Module, attributes: set[str]) -> None:
    """A tensor the forward makes from constants (``bias = torch.zeros(1, 4, 1, 1)``) runs eagerly while
    tracing and becomes one constant of the graph (fx sets it on the model as ``_tensor_constant0``):
    eager torch makes it anew on each call, the graph keeps one.  A constant written in place would then
    carry the writes from call to call; each call gets a copy of it instead (the writes are the call's
    own, as in eager torch), which every read of the constant reads (passes/inplace_reads then orders
    the reads after a write).  Not for a constant sharing memory with any other tensor the model or the
    graph holds (:func:`_held_storages`): a view fx made of a buffer (``self.mean[0]``), of a plain
    tensor attribute, or of another constant; those writes reach the other tensor, so they are state.
    (A module-level tensor written in forward is taken for a fresh one: nothing here tells them apart.)
    ``attributes``: the model's own attribute names before tracing (fx's constants are the new ones)."""
    written = {attr for _, attr in state_writes(gm)}
    if not any(_FX_CONSTANT.fullmatch(attr) and attr not in attributes for attr in written):
        return
    held = _held_storages(model, gm, written)
    first: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node.target not in written or not _FX_CONSTANT.fullmatch(node.target):
            continue
        constant = getattr(gm, node.target, None)
        if node.target in attributes or not isinstance(constant, torch.Tensor) \
                or storage_key(constant) in held:
            continue
        if node.target in first:  # each read of the constant is its own get_attr: all read the one copy
            node.replace_all_uses_with(first[node.target])
            gm.graph.erase_node(node)
            continue
        with gm.graph.inserting_after(node):
            fresh = gm.graph.call_method("clone", (node,))
        fresh.meta[META_SCOPE] = scope(node)  # later passes (a folded copy's quantizer) name it by it
        node.replace_all_uses_with(fresh, delete_user_cb=lambda user: user is not fresh)
        first[node.target] = fresh
    gm.recompile()


_FX_CONSTANT = re.compile(r"_tensor_constant\d+")


def _held_storages(model: nn.Module, gm: fx.GraphModule, written: set[str]) -> set[int]:
    """Storage keys of every tensor the model or the graph holds, the written constants aside: the
    parameters, buffers and plain tensor attributes of every module, and fx's other constants (a view
    fx made of a constant is a constant of its own).  Unknown storage counts as held."""
    held = {UNKNOWN_STORAGE}
    held.update(storage_key(t) for root in (model, gm) for name, t in tensor_attributes(root)
                if name not in written and tracked(t))
    keys = [storage_key(getattr(gm, attr)) for attr in written if isinstance(getattr(gm, attr, None), torch.Tensor)]
    held.update(k for k in keys if keys.count(k) > 1)  # two written constants, one memory
    return held


def _raise_on_state_writes(model: nn.Module, gm: fx.GraphModule, state: ModelState, written: list[str],
                           lost: list[str], is_leaf: Callable[[str], bool]) -> None:
    """A TraceError if the traced forward changes a parameter or buffer in place: state that carries
    from one call to the next, which a graph of values cannot hold (the compiled model would compute
    with the value from before the write, with no error).  It names the module doing it, or the one
    owning the tensor for a write made while tracing, or the closest enclosing module that is not a
    leaf already; that module becomes a leaf and keeps its state as it runs in torch."""
    if lost:
        err = TraceError(f"tracing {type(model).__name__} changed its parameter '{lost[0]}' in place, which cannot "
                         f"be undone (the model is traced as it is, not a copy): change it outside forward, or "
                         f"mark the module doing it a leaf.")
        err.module_path, err.reason, err.code_error = "", "parameter changed while tracing", True  # no retry
        raise err
    if written:
        attr, path, op = written[0], written[0].rpartition(".")[0], None
    else:
        writes = state_writes(gm)
        if not writes:
            return
        node, attr = writes[0]
        path, op = (scope(node)[-1].path if scope(node) else ""), node
    while path and is_leaf(path):
        path = path.rpartition(".")[0]
    typ = type(model.get_submodule(path)) if path else type(model)
    if attr in state.params:
        what = f"its parameter '{attr}'"
    elif attr in state.buffers:
        what = f"its buffer '{attr}'"
    else:
        what = f"a tensor it holds ('{attr}', kept by fx as a constant)"
    how = f"`{op.name}`{_source(op)} changes" if op is not None else "tracing it changed"
    reason = f"{how} {what} in place, state a traced graph cannot hold"
    err = TraceError(f"cannot trace {module_where(path, typ)}: {reason} (each call would start from the "
                     f"value before the write). {leaf_fix(path, 'stateful')}")
    err.module_path, err.reason, err.code_error = path, reason, False
    # a parameter or buffer carried from call to call: capture "auto" keeps the fx fallback (the writer
    # runs as a leaf and keeps its state), where torch.export would fold the write away
    err.state_write = attr in state.params or attr in state.buffers
    raise err


_FRAME = re.compile(r'\s*File "(.+)", line (\d+)')


def _source(node: fx.Node) -> str:
    """`` at file:line `code` `` of the innermost user code that made ``node`` (fx records the stack
    in ``meta["stack_trace"]``), or ``""``."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    found = ""
    for i, line in enumerate(lines):
        frame = _FRAME.match(line)
        if frame and is_user_file(frame[1]):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            found = f" at {frame[1]}:{frame[2]}" + (f" `{code}`" if code else "")
    return found


def _warn_leaf(model: nn.Module, err: TraceError) -> None:
    path = err.module_path
    warnings.warn(
        f"{type(model).__name__}: {err} Done automatically: '{path}' is a leaf that runs as a whole in eager "
        f"torch on the CPU (export_onnx and save refuse it). Name it yourself to silence this warning, "
        f"or pass prepare_custom_config_dict={{'strict_tracing': True}} to stop here instead.",
        QCompilerWarning, stacklevel=4)


def _warn_glue(model: nn.Module, err: TraceError, island: GlueIsland) -> None:
    first, last = island.lines
    what = "the rest of forward, which returns from inside it" if island.writes is None else \
        f"writing {', '.join(island.writes) or 'nothing read later'}"
    warnings.warn(
        f"{type(model).__name__}: {err} Done instead: lines {first}-{last} of its forward (reading "
        f"{', '.join(island.reads) or 'no local'}; {what}) run as one eager-torch island on the CPU; the rest of "
        f"forward and the submodules it calls are traced and can run on the BPU (export_onnx and save refuse the "
        f"island). Move that code into a submodule to name it yourself, or pass prepare_custom_config_dict="
        f"{{'strict_tracing': True}} to stop here instead.", QCompilerWarning, stacklevel=4)


def _warn_whole(model: nn.Module, err: TraceError) -> None:
    warnings.warn(
        f"{type(model).__name__}: {err} Done instead: the whole model runs as one eager-torch island on the "
        f"CPU, with nothing on the BPU (export_onnx and save refuse it). To quantize it, move the untraceable "
        f"code into a submodule (which then becomes a leaf); pass prepare_custom_config_dict="
        f"{{'strict_tracing': True}} to stop here instead.", QCompilerWarning, stacklevel=4)


def _input_names(model: nn.Module, n: Optional[int]) -> list[str]:
    """Names of the first ``n`` positional ``forward`` parameters (all required ones for None)."""
    params = list(forward_signature(model.forward).parameters.values())
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
