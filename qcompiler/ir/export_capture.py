"""Capture with ``torch.export``, lowered into the IR the fx tracer produces.

Where symbolic tracing cannot run a model (transformers' ``wrapper(self, *args, **kwargs)``
forwards, Python on values torch.fx cannot see) ``torch.export.export(strict=False)`` usually
can: it runs the forward on fake tensors and records ATen ops. :func:`export_graph` rewrites
that program into the graph the rest of the pipeline knows, so rewrite, placement, fusion,
convert, lowering and the ONNX export see what they see after fx tracing:

* each ATen call becomes a torch spelling of its canonical op, found through the op
  catalogue's ``aten`` slot (qcompiler.ir.ops.catalogue); where ATen's schema differs from the
  op's signature, the catalogue's form for the overload names its arguments;
* a conv / linear / norm / embedding / activation that is the whole forward of the module it
  ran in (its parameters that module's own, with the module's hyperparameters) becomes a
  ``call_module`` of that submodule, as the tracer leaves it;
* lifted parameters and buffers become ``get_attr`` of their dotted paths in the model;
* ``nn_module_stack`` becomes META_SCOPE, so hybrid_dict / qconfig_dict speak of the same paths;
* ``scaled_dot_product_attention`` is written out as matmul, scale, mask, softmax and matmul;
* an ATen op no catalogue row spells stays a call of that overload (placement keeps it on the CPU).

Inputs: the graph's placeholders are the tensor leaves of ``tree_flatten((args, kwargs))``; the
other leaves (None, ints, bools) are constants baked into the program. Outputs: a single tensor or
a flat tuple of tensors is returned as it is; any other structure as the flat tuple of its leaves,
with its TreeSpec in ``gm.meta[GM_OUTPUT_SPEC]``.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind

from qcompiler.compat.torch_private import HigherOrderOperator, OpOverload, pytree
from qcompiler.errors import TraceError
from qcompiler.ir.attention import attention_arguments, decline_reason, scale_of, write_attention
from qcompiler.ir.export_leaves import LEAF_OP, leaves_as_calls
from qcompiler.ir.inplace import schema_writes
from qcompiler.ir.meta import GM_OUTPUT_SPEC, META_SCOPE, ScopeEntry
from qcompiler.ir.ops.bind import read_arguments
from qcompiler.ir.ops.names import INTERPOLATE
from qcompiler.ir.ops.opdef import REQUIRED, OpDef, Signature
from qcompiler.ir.names import check_module_names, resolve_type
from qcompiler.ir.ops.registry import definition

_A = torch.ops.aten
# ATen calls that compute nothing the graph keeps: export's own checks of its inputs' metadata
_DROPPED = frozenset({_A._assert_tensor_metadata.default, _A._assert_async.default, _A._assert_async.msg,
                      _A._assert_scalar.default, _A.sym_constrain_range_for_size.default})
# the arguments of an ATen call that name a parameter or buffer of the module a call_module would call
_OWN_TENSORS = ("weight", "bias", "running_mean", "running_var")
# hyperparameters that may differ between a module and its call without changing the values computed
_FREE = frozenset({"training", "momentum", "inplace", "cudnn_enabled", "cudnn_enable", "scale_grad_by_freq",
                   "sparse", "padding_idx"})


# what an exported program returns besides the user's outputs when its forward writes state or inputs
_WRITES = frozenset({OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION,
                     getattr(OutputKind, "PARAMETER_MUTATION", OutputKind.BUFFER_MUTATION)})


def export_program(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """``torch.export.export(model, args, kwargs, strict=False)``; TraceError with torch's reason if it
    fails, or if the forward writes a buffer, parameter or input in place (the lowering has no form
    for the write-back, and dropping it would be a wrong answer: the fx path keeps such writers)."""
    try:
        program = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # torch raises many types here; all mean "cannot export"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err = TraceError(f"torch.export cannot capture the top-level module ({type(model).__name__}): {reason}")
        err.module_path = ""
        err.reason = reason
        err.code_error = False
        raise err from None
    written = [spec.target for spec in program.graph_signature.output_specs if spec.kind in _WRITES]
    written += _written_inputs(program)
    if written:  # the IR has no form for the write-back: dropping it would lose the model's state
        reason = (f"its forward writes {written[0]!r} in place, state the exported graph would drop; "
                  f"capture='fx' runs the writing module as a whole in torch")
        err = TraceError(f"torch.export cannot capture {type(model).__name__}: {reason}")
        err.module_path, err.reason, err.code_error = "", reason, False
        raise err
    return program


def _written_inputs(program: torch.export.ExportedProgram) -> list[str]:
    """The parameters, buffers and user inputs an in-place ATen call of the program writes, directly
    or through a view (torch 2.13's export keeps ``aten.mul_`` on a buffer in the graph instead of
    returning a BUFFER_MUTATION)."""
    names = {spec.arg.name: spec.target or spec.arg.name for spec in program.graph_signature.input_specs
             if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.USER_INPUT)
             and hasattr(spec.arg, "name")}
    written = []
    for node in program.graph.nodes:
        for value in schema_writes(node):
            while value.op == "call_function" and _is_view(value):
                value = value.args[0]
            if value.op == "placeholder" and value.name in names:
                written.append(names[value.name])
    return written


def _is_view(node: fx.Node) -> bool:
    """Whether an ATen call returns an alias of its first argument (a view, not a write)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not isinstance(node.args[0] if node.args else None, fx.Node):
        return False
    first = schema.arguments[0].alias_info
    return first is not None and not first.is_write


def _in_place_method(node: fx.Node) -> Optional[str]:
    """The Tensor method name of an in-place ATen call on its first argument (``aten.add_.Tensor`` ->
    ``"add_"``), or None. torch 2.13's export keeps ``hidden += residual`` as ``aten.add_``; as the
    method the tracer records for it, inplace_reads and out_of_place make it the ``add`` every later
    stage knows (an ATen in-place overload was an eager-torch island no pass saw writing)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = schema.name.split("::")[-1]
    alias = schema.arguments[0].alias_info
    if not name.endswith("_") or name.startswith("_") or alias is None or not alias.is_write:
        return None
    if schema.arguments[0].name != "self" or not hasattr(torch.Tensor, name):
        return None
    return name


def export_graph(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *,
                 leaf_module_names: Sequence[str] = (), leaf_module_types: Sequence[Any] = ()) -> fx.GraphModule:
    """Capture ``model(*args, **kwargs)`` with torch.export and lower it into qcompiler's IR.

    Stubs, ``nn.Identity``, qcompiler's leaf modules and the ``leaf_module_names`` / ``_types`` are
    called as a whole (qcompiler.ir.export_leaves). The GraphModule holds ``model``'s submodules,
    parameters and buffers at their own paths (it shares them: copy the model first if the graph
    will be rewritten)."""
    kwargs = dict(kwargs or {})
    check_module_names(model, leaf_module_names, "non_traceable_module_name")
    types = tuple(resolve_type(t, "non_traceable_module_class") for t in leaf_module_types)
    with leaves_as_calls(model, tuple(leaf_module_names), types):
        program = export_program(model, tuple(args), kwargs)
    higher = next((n for n in program.graph.nodes if isinstance(n.target, HigherOrderOperator)), None)
    if higher is not None:  # torch.cond / map / while_loop: a subgraph our IR has no form for
        reason = f"control-flow operator {higher.target.__name__!r} (node '{higher.name}') has no lowering"
        err = TraceError(f"torch.export captured {type(model).__name__}, but its {reason}")
        err.module_path, err.reason, err.code_error = "", reason, False
        raise err
    return _Lowering(model, program, tuple(args), kwargs).run()


class _Lowering:
    """One exported program rewritten into a new fx.Graph over ``model``."""

    def __init__(self, model: nn.Module, program: torch.export.ExportedProgram, args: tuple, kwargs: dict) -> None:
        self.model = model
        self.program = program
        flat = pytree.tree_flatten_with_path((args, kwargs))[0]
        self.leaves = [leaf for _, leaf in flat]
        self.paths = [path for path, _ in flat]
        # positional inputs keep their structure: a nested one is one placeholder, indexed (as fx traces it);
        # keyword inputs are the flat tensor leaves (GM_INPUT_SPEC)
        self.positional = not kwargs
        self.arg_nodes: dict[int, fx.Node] = {}
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.modules = dict(model.named_modules())
        self.root = ScopeEntry("", type(model))
        self.attr_nodes: dict[str, fx.Node] = {}
        self.n_constants = 0
        # module invocations (nn_module_stack key of the innermost module) -> the ops run inside them
        self.calls: dict[str, list[fx.Node]] = {}
        for node in program.graph.nodes:
            key = _innermost(node)
            if node.op == "call_function" and key is not None and node.target not in _DROPPED:
                self.calls.setdefault(key[0], []).append(node)

    def run(self) -> fx.GraphModule:
        sig = self.program.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
        user = 0
        for node in self.program.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self._input(node, specs.get(node.name), user)
                if specs.get(node.name) is not None and specs[node.name].kind == InputKind.USER_INPUT:
                    user += 1
            elif node.op == "call_function":
                if node.target in _DROPPED:
                    continue
                self.env[node] = self._call(node)
            elif node.op == "get_attr":
                self.env[node] = self._attr(node.target, self._scope(node))
            elif node.op == "output":
                self._output(node)
        gm = fx.GraphModule(self.model, self.graph, class_name=type(self.model).__name__)
        spec = self.program.call_spec.out_spec
        if spec is not None and not _plain(spec):
            gm.meta[GM_OUTPUT_SPEC] = spec
        return gm

    # --- inputs and outputs

    def _input(self, node: fx.Node, spec: Any, user: int) -> Any:
        if spec is None or spec.kind == InputKind.USER_INPUT:
            leaf = self._user_leaf(user)
            if not isinstance(leaf, torch.Tensor) and leaf is not None:
                return leaf  # a non-tensor input: baked in
            path = self.paths[user] if user < len(self.paths) else ()
            if self.positional and len(path) > 2:
                return self._nested_input(path)
            ph = self.graph.placeholder(node.name)
            ph.meta[META_SCOPE] = (self.root,)
            return ph
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            return _Lazy(spec.target)
        if spec.kind == InputKind.CONSTANT_TENSOR:
            value = self.program.constants[spec.target]
            if isinstance(value, torch.Tensor):
                return _Lazy(self._register_constant(value))
            return value
        raise TraceError(f"torch.export capture: input {node.name!r} of kind {spec.kind.name} is not supported "
                         f"(only user inputs, parameters, buffers and constant tensors are)")

    def _nested_input(self, path: tuple) -> fx.Node:
        """The leaf at ``path`` (``(args, i, key...)``) of a nested positional input: getitems of its placeholder."""
        index = path[1].idx
        value = self.arg_nodes.get(index)
        if value is None:
            try:
                names = [p for p in inspect.signature(self.model.forward).parameters]
            except (TypeError, ValueError):
                names = []
            value = self.graph.placeholder(names[index] if index < len(names) else f"input_{index}")
            value.meta[META_SCOPE] = (self.root,)
            self.arg_nodes[index] = value
        for key in path[2:]:
            item = key.idx if hasattr(key, "idx") else key.key
            value = self._emit("call_function", operator.getitem, (value, item), {}, (self.root,))
        return value

    def _user_leaf(self, index: int) -> Any:
        """The leaf of the call's inputs behind the ``index``-th user input of the program."""
        return self.leaves[index] if index < len(self.leaves) else None

    def _register_constant(self, value: torch.Tensor) -> str:
        name = f"_qc_export_constant{self.n_constants}"
        while hasattr(self.model, name):
            self.n_constants += 1
            name = f"_qc_export_constant{self.n_constants}"
        self.n_constants += 1
        self.model.register_buffer(name, value.detach().clone())
        return name

    def _output(self, node: fx.Node) -> None:
        kinds = [s.kind for s in self.program.graph_signature.output_specs]
        flat = [self._value(a, (self.root,)) for a, k in zip(node.args[0], kinds) if k == OutputKind.USER_OUTPUT]
        spec = self.program.call_spec.out_spec
        single = spec is not None and spec.is_leaf() and len(flat) == 1
        out = self.graph.output(flat[0] if single else tuple(flat))
        out.meta[META_SCOPE] = (self.root,)

    # --- values

    def _attr(self, target: str, scope: tuple) -> fx.Node:
        node = self.attr_nodes.get(target)
        if node is None:
            node = self.graph.get_attr(target)
            node.meta[META_SCOPE] = scope
            self.attr_nodes[target] = node
        return node

    def _value(self, a: Any, scope: tuple) -> Any:
        """An argument of the program mapped into the new graph (parameters as get_attr nodes)."""
        if isinstance(a, fx.Node):
            v = self.env[a]
            return self._attr(v.target, scope) if isinstance(v, _Lazy) else v
        if isinstance(a, (list, tuple)):
            return type(a)(self._value(x, scope) for x in a)
        if isinstance(a, dict):
            return {k: self._value(v, scope) for k, v in a.items()}
        return a

    def _scope(self, node: fx.Node) -> tuple[ScopeEntry, ...]:
        stack = node.meta.get("nn_module_stack") or {}
        out = [self.root]
        for path, _ in stack.values():
            module = self.modules.get(path)
            if path and module is not None:
                out.append(ScopeEntry(path, type(module)))
        return tuple(out)

    # --- calls

    def _call(self, node: fx.Node) -> Any:
        scope = self._scope(node)
        if node.target is operator.getitem:
            return self._emit("call_function", operator.getitem, self._value(node.args, scope), {}, scope)
        if node.target is _A.scaled_dot_product_attention.default:
            lowered = self._attention(node, scope)
            if lowered is not None:
                return lowered
        if node.target is LEAF_OP:  # a leaf module, called as a whole
            inputs, path = node.args[0], node.args[1]
            return self._emit("call_module", path, tuple(self._value(a, scope) for a in inputs), {}, scope)
        if node.target is _A.addmm.default:
            lowered = self._addmm_as_linear(node, scope)
            if lowered is not None:
                return lowered
        op = definition(node.target)
        if op is not None and op.name == INTERPOLATE and node.target.overloadpacket.__name__.startswith("upsample_"):
            return self._interpolate(op, node, scope)
        if op is not None and op.name == "cast" and node.target.overloadpacket.__name__ in ("to", "_to_copy"):
            cast = self._cast(node, scope)
            if cast is not None:
                return cast
        if op is None and node.target is _A.__and__.Tensor and _dtype(node) == torch.bool:
            return self._emit("call_function", torch.logical_and, self._value(node.args, scope), {}, scope)
        method = _in_place_method(node) if op is None else None
        if method is not None:  # x.add_(y): the in-place passes see it as they see the tracer's methods
            return self._emit("call_method", method, self._value(node.args, scope),
                              self._value(node.kwargs, scope), scope)
        if op is None or not isinstance(node.target, OpOverload):
            return self._emit("call_function", node.target, self._value(node.args, scope),
                              self._value(node.kwargs, scope), scope)
        named = self._named(op, node)
        module_call = self._as_module(op, node, named)
        if module_call is not None:
            path, inputs = module_call
            return self._emit("call_module", path, tuple(self._value(a, scope) for a in inputs), {}, scope)
        return self._as_function(op, node, named, scope)

    def _emit(self, kind: str, target: Any, args: tuple, kwargs: dict, scope: tuple) -> fx.Node:
        n = self.graph.create_node(kind, target, tuple(args), dict(kwargs))
        n.meta[META_SCOPE] = scope
        return n

    def _named(self, op: OpDef, node: fx.Node) -> Optional[dict]:
        """The ATen call's arguments by the names of the catalogue's form for the overload (or the op's
        signature), values equal to the form's defaults left out; None if no signature binds them."""
        form = op.forms.get(node.target)
        signature = form or op.signature
        if signature is None:
            return None
        try:
            named = read_arguments(signature, node.args, node.kwargs, None, f"node '{node.name}'")
        except Exception:  # the ATen schema does not fit the op's signature: pass the arguments through
            return None
        if form is not None:
            defaults = dict(form.params)
            named = {k: v for k, v in named.items() if k not in defaults or not _same(v, defaults[k])}
        return named

    def _as_module(self, op: OpDef, node: fx.Node, named: Optional[dict]) -> Optional[tuple[str, tuple]]:
        """``(path, inputs)`` when ``node`` is the whole forward of the innermost module it ran in, a module
        of one of ``op``'s classes, with that module's own parameters and hyperparameters."""
        key = _innermost(node)
        if key is None or not op.modules:
            return None
        path = key[1]
        module = self.modules.get(path)
        if module is None or not isinstance(module, op.modules):
            return None
        ops = [n for n in self.calls.get(key[0], ()) if n.target is not operator.getitem]
        if ops != [node]:
            return None
        signature = op.signature_of(type(module)) or op.signature
        if signature is None or named is None:
            # no signature to read it by: the module's whole forward, if it owns no tensors and takes one input
            owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(False))
            tensors = [a for a in node.args if isinstance(a, fx.Node)]
            if owns or len(tensors) != 1 or node.args[0] is not tensors[0]:
                return None
            return path, (node.args[0],)
        for name in _OWN_TENSORS:
            if name not in signature.names and name not in named:
                continue
            mine = getattr(module, name, None)
            given = named.get(name)
            given_value = self.env[given] if isinstance(given, fx.Node) else given
            target = given_value.target if isinstance(given_value, _Lazy) else None
            if (mine is None) != (given is None):
                return None
            if mine is not None and (target is None or target != (f"{path}.{name}" if path else name)):
                return None
        for name, value in named.items():
            if name in signature.inputs or name in _OWN_TENSORS or name in _FREE or not hasattr(module, name):
                continue
            if not _same(value, getattr(module, name)):
                return None
        inputs = tuple(named[n] for n in signature.inputs if n in named)
        return path, inputs

    def _as_function(self, op: OpDef, node: fx.Node, named: Optional[dict], scope: tuple) -> fx.Node:
        target, kind = _spelling(op, node.target)
        if kind == "aten":
            return self._emit("call_function", node.target, self._value(node.args, scope),
                              self._value(node.kwargs, scope), scope)
        signature = op.signature_of(target)
        if named is None or signature is None or op.forms.get(node.target) is None:
            # ATen's positional order is the torch spelling's: pass the arguments through
            return self._emit(kind, target, self._value(node.args, scope), self._value(node.kwargs, scope), scope)
        args, kwargs = _arrange(signature, named)
        return self._emit(kind, target, self._value(tuple(args), scope), self._value(kwargs, scope), scope)

    def _cast(self, node: fx.Node, scope: tuple) -> Optional[fx.Node]:
        """ATen's ``to`` / ``_to_copy`` on the CPU device as ``x.to(dtype)`` (None: left as it is)."""
        source, out = node.args[0], _dtype(node)
        device = node.meta.get("val").device if node.meta.get("val") is not None else None
        if out is None or not isinstance(source, fx.Node) or (device is not None and device.type != "cpu"):
            return None
        return self._emit("call_method", "to", (self._value(source, scope), out), {}, scope)

    def _interpolate(self, op: OpDef, node: fx.Node, scope: tuple) -> fx.Node:
        """``upsample_<mode>Nd.vec(input, output_size, [align_corners,] scale_factors)`` as ``F.interpolate``
        (the mode from the overload's name), or the ``nn.Upsample`` module it is the whole forward of."""
        module_call = self._as_module(op, node, None)
        if module_call is not None:
            path, inputs = module_call
            return self._emit("call_module", path, tuple(self._value(a, scope) for a in inputs), {}, scope)
        mode = node.target.overloadpacket.__name__[len("upsample_"):-2]  # upsample_bilinear2d -> bilinear
        args = list(node.args)
        x, size, scales = args[0], args[1], args[-1]
        kwargs: dict = {"size": size, "scale_factor": scales, "mode": mode}
        if len(args) == 4:  # the linear modes: align_corners
            kwargs["align_corners"] = args[2]
        return self._emit("call_function", torch.nn.functional.interpolate, (self._value(x, scope),),
                          self._value(kwargs, scope), scope)

    def _addmm_as_linear(self, node: fx.Node, scope: tuple) -> Optional[fx.Node]:
        """``addmm(bias, x, weight)`` of parameters ``weight`` / ``bias`` of one module (transformers' Conv1D:
        GPT-2's projections) as a call of an ``nn.Linear`` added beside them, ``<module>.qc_linear``, whose
        weight is ``weight.t()`` (a copy) and bias ``bias`` itself: the BPU computes nn.Linear modules
        (None: left as it is). Training the graph trains the copy."""
        if node.kwargs or len(node.args) != 3:
            return None
        bias, _, weight = (self.env.get(a) if isinstance(a, fx.Node) else a for a in node.args)
        if not isinstance(weight, _Lazy) or not isinstance(bias, _Lazy):
            return None
        owner, _, w_attr = weight.target.rpartition(".")
        b_owner, _, b_attr = bias.target.rpartition(".")
        module = self.modules.get(owner)
        w, b = getattr(module, w_attr, None), getattr(module, b_attr, None)
        if owner != b_owner or not isinstance(w, nn.Parameter) or not isinstance(b, nn.Parameter) \
                or w.dim() != 2 or b.dim() != 1 or b.shape[0] != w.shape[1]:
            return None
        path = f"{owner}.qc_linear" if owner else "qc_linear"
        linear = self.modules.get(path)
        if linear is None:
            linear = nn.Linear(w.shape[0], w.shape[1])
            linear.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
            linear.bias = b
            module.add_module("qc_linear", linear)
            self.modules[path] = linear
        inner = scope + ((ScopeEntry(path, nn.Linear),) if owner else ())
        return self._emit("call_module", path, (self._value(node.args[1], scope),), {}, inner)

    def _attention(self, node: fx.Node, scope: tuple) -> Optional[fx.Node]:
        """scaled_dot_product_attention as softmax(q @ k^T * scale + mask) @ v (``qcompiler.ir.attention``;
        None: left as it is)."""
        a = attention_arguments(node.args, node.kwargs)
        q_val = a["query"].meta.get("val")
        if decline_reason(a) is not None or q_val is None:
            return None
        q, k, v = (self._value(a[n], scope) for n in ("query", "key", "value"))
        mask = a["attn_mask"]
        m = self._value(mask, scope) if mask is not None else None
        is_bool = mask is not None and mask.meta.get("val") is not None and mask.meta["val"].dtype == torch.bool
        return write_attention(lambda target, args: self._emit("call_function", target, args, {}, scope),
                               q, k, v, m, is_bool, scale_of(a, q_val.shape[-1]))


class _Lazy:
    """A lifted parameter / buffer: a get_attr of ``target``, made where it is first read."""

    def __init__(self, target: str) -> None:
        self.target = target


def _dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype of the tensor an exported node makes (its ``val``), or None."""
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _innermost(node: fx.Node) -> Optional[tuple[str, str]]:
    """``(key, path)`` of the innermost module invocation ``node`` ran in (the root: None)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    key, (path, _) = list(stack.items())[-1]
    return (key, path) if path else None


def _plain(spec: pytree.TreeSpec) -> bool:
    """A lone tensor or a flat tuple of them: returned as the fx tracer returns it, with no spec."""
    if spec.is_leaf():
        return True
    return spec.type is tuple and all(spec.child(i).is_leaf() for i in range(spec.num_children))


def _same(a: Any, b: Any) -> bool:
    """Hyperparameters equal up to spelling: ``[1, 1]`` is ``(1, 1)`` is ``1``."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        ta = tuple(a) if isinstance(a, (list, tuple)) else None
        tb = tuple(b) if isinstance(b, (list, tuple)) else None
        if ta is None:
            ta = (a,) * len(tb)
        if tb is None:
            tb = (b,) * len(ta)
        return len(ta) == len(tb) and all(_same(x, y) for x, y in zip(ta, tb))
    if isinstance(a, (fx.Node, torch.Tensor)) or isinstance(b, (fx.Node, torch.Tensor)):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # incomparable values are different
        return False


def _spelling(op: OpDef, overload: Any) -> tuple[Any, str]:
    """The torch spelling an ATen call of ``op`` is written with: ``(function, "call_function")``,
    ``(method name, "call_method")`` or ``(overload, "aten")`` where the op has no other spelling.
    The spelling named like ATen's packet wins, a torch function before ``operator``'s."""
    packet = overload.overloadpacket.__name__
    named = [f for f in op.functions if getattr(f, "__name__", None) == packet]
    named.sort(key=lambda f: getattr(f, "__module__", "") in ("_operator", "operator"))
    if named:
        return named[0], "call_function"
    if packet in op.methods:
        return packet, "call_method"
    functions = [f for f in op.functions if getattr(f, "__module__", "") not in ("_operator", "operator")]
    if functions:
        return functions[0], "call_function"
    if op.methods:
        return op.methods[0], "call_method"
    return overload, "aten"


def _arrange(signature: Signature, named: dict) -> tuple[list, dict]:
    """Positional and keyword arguments of a call by ``signature`` from ``named`` (unknown names, flags
    of ATen's own, are dropped; parameters at their default are left out)."""
    args = [named[n] for n in signature.inputs if n in named]
    positional = [name for name, _ in signature.positional]
    defaults = dict(signature.params)
    last = max((i for i, p in enumerate(positional) if p in named), default=-1)
    for name in positional[:last + 1]:
        value = named.get(name, defaults[name])
        if value is REQUIRED:
            raise TraceError(f"torch.export capture: argument {name!r} missing")
        args.append(value)
    kwargs = {name: named[name] for name, _ in signature.keyword if name in named}
    if signature.varargs is not None and signature.varargs in named:
        args.append(named[signature.varargs])
    return args, kwargs


__all__ = ["export_graph", "export_program"]
