"""Tracing a float model into an FX graph with module scopes.

Our tracer differs from ``torch.fx.Tracer`` in six ways:

* every node records the modules it was created inside (``META_SCOPE``), so a
  functional op inside ``conv1`` inherits ``conv1``'s qconfig and placement;
* QuantStub / DeQuantStub (torch's and ours), qcompiler's own modules and
  user-named modules are leaves (called as a whole, never traced into);
* ``FloatFunctional`` calls (``self.ff.add(a, b)``) become plain ``torch.add``
  nodes scoped to the FloatFunctional module, without its identity observer;
* a failure names the module and source line and says how to mark it a leaf,
  instead of surfacing torch's traceback;
* given ``example_inputs``, a ``forward`` parameter with a default that they do
  not supply is traced as that constant and is no input of the graph
  (``mask=None`` takes the ``None`` branch, ``scale=2.0`` multiplies by 2.0).
  torch.fx makes it an input and traces a Proxy in its place, so the graph
  failed when called with ``x`` alone.  A supplied parameter stays an input;
* ``x[index] = value`` is recorded (as :func:`qcompiler.ir.setitem.setitem_`) where
  torch.fx's Proxy does not support item assignment;
* the graph's inputs are what the example inputs supply (:func:`forward_signature`): a
  ``**kwargs`` parameter is no input (fx made it one, so the graph took one input more than the
  model), ``*args`` takes the example inputs left after the named parameters, and a decorated
  forward (``functools.wraps`` around ``wrapper(self, *args, **kwargs)``, as transformers 5 does)
  has the parameters of the function it wraps, while the wrapper is what runs (fx bound the
  wrapper's ``kwargs`` to the wrapped forward's second parameter). Given flat example inputs
  (``KeywordInputs``: keyword inputs, or a list / tuple / dict of tensors such as a detector's list
  of images), each tensor leaf is one placeholder, in ``torch.utils._pytree`` order, and the graph
  records the tree in ``GM_INPUT_SPEC``; given plain positional inputs, a list is one placeholder
  holding the list (which an eager island can take as it is).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sysconfig
import traceback
import types
import typing
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.compat.torch_ao import STUB_TYPES as _AO_STUBS
from qcompiler.compat.torch_ao import FloatFunctional
from qcompiler.compat.torch_private import pytree
from qcompiler.errors import TraceError
from qcompiler.ir.glue import GLUE_CONSTANTS, GlueIsland
from qcompiler.ir.meta import GM_INPUT_SPEC, META_SCOPE, ScopeEntry
from qcompiler.ir.names import check_module_names, resolve_type
from qcompiler.ir.setitem import setitem_
from qcompiler.ir.shape_prop import normalize_inputs
from qcompiler.ir.structure import mark_traced_output, recording_output

_TORCH_DIR = os.path.dirname(torch.__file__)
_QCOMPILER_DIR = os.path.dirname(os.path.dirname(__file__))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]

# FloatFunctional methods and the torch function each one stands for.
_FLOAT_FUNCTIONAL_OPS = {
    "add": torch.add,
    "mul": torch.mul,
    "cat": torch.cat,
    "matmul": torch.matmul,
    "add_scalar": torch.add,
    "mul_scalar": torch.mul,
}


def is_stub(module: nn.Module) -> bool:
    """QuantStub/DeQuantStub of torch.ao or of qcompiler (which mark themselves ``qc_op``)."""
    return isinstance(module, _AO_STUBS) or getattr(
        type(module), "qc_op", None
    ) in ("quant", "dequant")


class QProxy(fx.Proxy):
    """A Proxy that records ``x[index] = value`` (torch.fx's raises): :mod:`qcompiler.ir.setitem`."""

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", setitem_, (self, index, value), {})


# torch's messages name the type ("float() argument must be ... not 'Proxy'"): keep torch's word in them
QProxy.__name__ = QProxy.__qualname__ = "Proxy"


class QTracer(fx.Tracer):
    """torch.fx tracer that records module scope and knows qcompiler's leaves."""

    def __init__(
        self,
        leaf_module_names: Iterable[str] = (),
        leaf_module_types: Iterable[type] = (),
    ) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.leaf_module_names = frozenset(leaf_module_names)
        self.leaf_module_types = tuple(leaf_module_types)
        self._root_type: type = nn.Module
        # forward parameters traced as these constants instead of graph inputs
        self.constant_args: dict[str, Any] = {}
        # the example inputs, positional and keyword (None: not given), for :meth:`_supplied_args`
        self.example_args: Optional[tuple] = None
        self.example_kwargs: dict[str, Any] = {}
        # the example inputs came flat (KeywordInputs): the graph's placeholders are their tensor leaves
        self.flatten = False
        self.input_spec: Optional[pytree.TreeSpec] = None  # set where flatten is
        # (GlueIsland, its constants) of each island called: qcompiler.ir.auto_leaf binds them
        self.glue_constants: list[tuple[GlueIsland, dict[int, Any]]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_stub(m) or getattr(type(m), "qc_leaf", False):
            return True
        if module_qualified_name in self.leaf_module_names:
            return True
        if self.leaf_module_types and isinstance(m, self.leaf_module_types):
            return True
        if isinstance(m, _TRACED_THROUGH):  # nn.ZeroPad2d: its F.pad is what the rewrites fold into a conv
            return False
        if _layer_subclass(type(m)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        if isinstance(m, GlueIsland):  # its reads fx cannot record become its constants
            args, bound = m.split_constants(tuple(args), self.create_arg)
            if bound is not None:
                self.glue_constants.append((m, bound))
        return super().call_module(m, forward, args, kwargs)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return QProxy(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """fx's root arguments, with each of ``constant_args`` passed as its value and its
        placeholder removed (fx's own ``concrete_args`` would keep it, plus guard nodes); or
        :meth:`_supplied_args` where fx's reading of the signature would be wrong."""
        own = vars(self.root).get("forward") if is_module else None
        if isinstance(own, types.MethodType) and own.__self__ is self.root:
            root_fn = own.__func__  # a forward set on the instance (qcompiler.ir.glue's rewrite)
        if is_module and not concrete_args and self._needs_own_args(root_fn):
            fn, args = self._supplied_args(root_fn)
        else:
            fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
            for i, arg in enumerate(args):
                node = arg.node if isinstance(arg, fx.Proxy) else None
                if node is not None and node.op == "placeholder" and node.target in self.constant_args:
                    args[i] = self.constant_args[node.target]
                    self.graph.erase_node(node)
        return recording_output(fn, self), args  # the output's own classes, for structure.flatten_output

    def _needs_own_args(self, root_fn) -> bool:
        """fx reads the parameters of the innermost function's code and calls the outer one with them
        positionally, patched to drop ``*args`` / ``**kwargs``: wrong for a wrapper, for ``**kwargs``
        (made an input) and ``*args``; and it has no placeholders per tensor of a structured input."""
        params = forward_signature(root_fn).parameters.values()
        if root_fn is not inspect.unwrap(root_fn) or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return True
        return self.flatten

    def _supplied_args(self, root_fn):
        """Placeholders for what the example inputs supply, and a root function calling ``root_fn``
        (the wrapper, if decorated) with them as the user would: positional inputs positionally, keyword
        inputs by name; defaulted parameters left out take their defaults (``constant_args``), and
        ``**kwargs`` is empty. Without example inputs, each named positional parameter is an input."""
        params = list(forward_signature(root_fn).parameters.values())[1:]  # self
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        star = next((p for p in params if p.kind == p.VAR_POSITIONAL), None)
        if self.example_args is None:
            names = [p.name for p in positional]
            values: tuple = (None,) * len(names)
        else:
            values = tuple(self.example_args)
            names = [p.name for p in positional[:len(values)]]
            extra = len(values) - len(names)
            if extra > 0 and star is None:
                raise TypeError(f"forward takes {len(positional)} positional inputs, example_inputs give {len(values)}")
            names += [f"{star.name}_{i}" for i in range(extra)] if star is not None else []
        args = [self._placeholders(name, value) for name, value in zip(names, values)]
        kwargs = {name: self._placeholders(name, value) for name, value in self.example_kwargs.items()}
        if self.flatten:
            self.input_spec = pytree.tree_structure((tuple(values), dict(self.example_kwargs)))

        def root(module):
            return root_fn(module, *args, **kwargs)

        return root, [self.root]

    def _placeholders(self, name: str, value: Any) -> Any:
        """A placeholder for an input; with ``flatten``, one per tensor leaf of a list, tuple or dict
        (``images_0``, ``images_1``), the other leaves (None, ints) constants, in the same structure."""
        if not self.flatten:
            return self.create_proxy("placeholder", name, (), {})
        if isinstance(value, torch.Tensor):
            return self.create_proxy("placeholder", name, (), {})
        leaves, spec = pytree.tree_flatten(value)
        if spec.is_leaf():
            return value  # a constant leaf
        made = [self.create_proxy("placeholder", f"{name}_{i}", (), {}) if isinstance(leaf, torch.Tensor) else leaf
                for i, leaf in enumerate(leaves)]
        return pytree.tree_unflatten(made, spec)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind == "placeholder" and target in self.constant_args:
            name = f"_qc_constant_{target}"  # erased at once: leave its name to the ops (F.relu -> relu)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[META_SCOPE] = (ScopeEntry("", self._root_type),) + tuple(
            ScopeEntry(path, typ) for path, typ in self.module_stack.values()
        )
        return node

    def trace(self, root, concrete_args=None):
        self._root_type = type(root)
        with self._float_functional_as_functions():
            graph = super().trace(root, concrete_args)
        mark_traced_output(graph, getattr(self, "traced_output", None))
        return graph

    @contextlib.contextmanager
    def _float_functional_as_functions(self):
        """Route FloatFunctional methods to torch functions scoped to the FloatFunctional."""
        tracer = self
        saved = {name: FloatFunctional.__dict__[name] for name in _FLOAT_FUNCTIONAL_OPS
                 if FloatFunctional is not None and name in FloatFunctional.__dict__}

        def make(name, fn):
            def method(ff, *args, **kwargs):
                path = tracer.path_of_module(ff)
                key = f"{path}@ff{len(tracer.module_stack)}"
                tracer.module_stack[key] = (path, type(ff))
                try:
                    return fn(*args, **kwargs)
                finally:
                    tracer.module_stack.pop(key, None)

            return method

        try:
            for name in saved:
                fn = _FLOAT_FUNCTIONAL_OPS[name]
                setattr(FloatFunctional, name, make(name, fn))
            yield
        finally:
            for name, method in saved.items():
                setattr(FloatFunctional, name, method)


def forward_signature(forward: Any) -> inspect.Signature:
    """The parameters ``forward`` takes. A ``functools.wraps`` wrapper whose own parameters are only
    ``(self, *args, **kwargs)`` passes them on to the function it wraps: that one's signature
    (``__wrapped__``, or an explicit ``__signature__``). A wrapper with parameters of its own changed
    the signature on purpose: its own."""
    try:
        own = inspect.signature(forward, follow_wrapped=False)
    except (TypeError, ValueError):
        return inspect.Signature()
    rest = list(own.parameters.values())[0 if inspect.ismethod(forward) else 1:]
    generic = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest)
    if generic and hasattr(forward, "__wrapped__"):
        try:
            return inspect.signature(forward)
        except (TypeError, ValueError):
            return own
    return own


def _user_frame(tb) -> Optional[traceback.FrameSummary]:
    """The innermost traceback frame in user code (not torch, qcompiler or the stdlib)."""
    user = None
    for frame in traceback.extract_tb(tb):
        if is_user_file(frame.filename):
            user = frame
    return user


def is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's code (not torch, qcompiler, the stdlib or generated code)."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(
        (_TORCH_DIR, _QCOMPILER_DIR, _STDLIB_DIR))


def trace(
    model: nn.Module,
    *,
    leaf_module_names: Sequence[str] = (),
    leaf_module_types: Sequence[Any] = (),
    concrete_args: Optional[dict[str, Any]] = None,
    example_inputs: Any = None,
) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule named after the model's class.

    With ``example_inputs`` (the positional inputs the model will be called with),
    defaulted ``forward`` parameters they do not supply become constants, not inputs
    (see the module docstring). Flat example inputs (``qcompiler.ir.shape_prop.KeywordInputs``: the
    tuple of the tensor leaves, with ``args`` / ``kwargs``, the call they come from) make the graph's
    placeholders those leaves, and ``gm.meta[GM_INPUT_SPEC]`` their tree. The GraphModule shares submodules with ``model``:
    copy the model first if the graph will be rewritten.  Raises TraceError naming
    the module and source line where tracing failed.
    """
    check_module_names(model, leaf_module_names, "non_traceable_module_name")
    types = tuple(resolve_type(t, "non_traceable_module_class") for t in leaf_module_types)
    tracer = QTracer(leaf_module_names, types)
    if example_inputs is not None:
        flat = hasattr(example_inputs, "args") and hasattr(example_inputs, "kwargs")  # KeywordInputs
        tracer.flatten = flat
        tracer.example_args = tuple(example_inputs.args) if flat else normalize_inputs(example_inputs)
        tracer.example_kwargs = dict(example_inputs.kwargs) if flat else {}
        defaults = unsupplied_defaults(model, len(tracer.example_args))
        tracer.constant_args = {k: v for k, v in defaults.items()
                                if k not in (concrete_args or {}) and k not in tracer.example_kwargs}
    try:
        graph = tracer.trace(model, concrete_args)
    except Exception as exc:  # torch raises many types here; we report them all the same way
        raise _trace_error(model, tracer, exc, example_inputs is not None) from None
    _resolve_string_annotations(graph, model)
    gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    _as_base_layers(gm)
    if tracer.input_spec is not None:
        gm.meta[GM_INPUT_SPEC] = tracer.input_spec
    for island, bound in tracer.glue_constants:  # (trace_or_fallback binds them again after its restore)
        island.bound = bound
    if tracer.glue_constants:
        gm.meta[GLUE_CONSTANTS] = tracer.glue_constants
    return gm


def unsupplied_defaults(model: nn.Module, n_inputs: int) -> dict[str, Any]:
    """``{name: default}`` of the ``forward`` parameters with a default that ``n_inputs``
    positional inputs leave out (keyword-only ones always)."""
    out = {}
    params = forward_signature(model.forward).parameters.values()
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            continue
        if p.kind == p.KEYWORD_ONLY or i >= n_inputs:
            out[p.name] = p.default
    return out


def _resolve_string_annotations(graph: fx.Graph, model: nn.Module) -> None:
    """Placeholders of a model written with ``from __future__ import annotations`` carry their
    annotations as strings (``"torch.Tensor"``); torch.fx would emit them as globals that
    pickling (``torch.save`` of the GraphModule) cannot name. Resolve them to the types, or drop
    an annotation that cannot be resolved (it only documents the generated code)."""
    strings = [n for n in graph.nodes if isinstance(n.type, str)]
    if not strings:
        return
    try:
        hints = typing.get_type_hints(type(model).forward)
    except Exception:  # an annotation naming something not importable here
        hints = {}
    for node in strings:
        hint = hints.get(node.target) if node.op == "placeholder" else None
        node.type = hint if isinstance(hint, type) else None


def _defaulted_inputs(model: nn.Module, tracer: QTracer) -> list[str]:
    """Forward parameters with a default that became graph inputs (example_inputs gave them)."""
    params = forward_signature(model.forward).parameters.values()
    defaulted = {p.name for p in params if p.default is not p.empty}
    graph = getattr(tracer, "graph", None)
    placeholders = [n.target for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
    return [t for t in placeholders if t in defaulted and t not in tracer.constant_args]


def leaf_fix(path: str, what: str) -> str:
    """How to make the module at ``path`` (``""``: the top level, whose ``what`` code must move into a
    submodule) a leaf, in the words of the config and the CLI."""
    if path:
        return (f"Mark it a leaf so it is called as a whole (it then runs on CPU): "
                f"prepare_custom_config_dict={{'non_traceable_module_name': ['{path}']}} (CLI: --leaf-module {path}).")
    return (f"Move the {what} code into a submodule and mark that submodule a leaf "
            f"with prepare_custom_config_dict={{'non_traceable_module_name': [...]}} (it then runs on CPU).")


def module_where(path: str, typ: type) -> str:
    return f"module '{path}' ({typ.__name__})" if path else f"the top-level module ({typ.__name__})"


def _trace_error(model: nn.Module, tracer: QTracer, exc: Exception, inputs_given: bool) -> TraceError:
    stack = list(tracer.module_stack.values())
    path, typ = stack[-1] if stack else ("", type(model))
    where = module_where(path, typ)
    frame = _user_frame(exc.__traceback__)
    line = ""
    if frame is not None:
        code = (frame.line or "").strip()
        line = f" at {frame.filename}:{frame.lineno}" + (f" `{code}`" if code else "")
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (NameError, ImportError)):  # UnboundLocalError is a NameError
        # a bug in the forward's code, raised whatever the inputs: tracing is not the cause
        message = (f"cannot trace {where}{line}: {type(exc).__name__}: {reason}. This is an error in the "
                   f"model's code, not a tracing limit: its forward raises it when run eagerly too; fix the "
                   f"code (check that model(*example_inputs) runs).")
    else:
        fix = leaf_fix(path, "data-dependent")
        given = _defaulted_inputs(model, tracer) if inputs_given else []
        if given:
            fix += (f" If it branches on {', '.join(repr(g) for g in given)} (a forward parameter with a default, "
                    f"traced as an input because example_inputs gives it), leave it out of example_inputs: it is "
                    f"then traced as its default value.")
        message = f"cannot trace {where}{line}: {reason}. {fix}"
    err = TraceError(message)
    # (code, line) of each frame from the trace call to the failure: where in a forward it failed
    err.frames = [(f.f_code, lineno) for f, lineno in traceback.walk_tb(exc.__traceback__)]
    err.module_path = path
    err.reason = reason  # torch's message, first line
    err.code_error = isinstance(exc, (NameError, ImportError))  # the forward fails eagerly too
    return err


# torch modules traced into rather than called as a whole: a zero / constant padding is F.pad, which
# the rewrites move into the conv or pool after it (a ZeroPad2d leaf had no rule: an eager island)
_TRACED_THROUGH = (nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d)


def _layer_subclass(cls: type) -> bool:
    """Whether ``cls`` is a subclass, made outside torch, of a torch layer that keeps that layer's
    forward (transformers' ``EfficientNetDepthwiseConv2d(nn.Conv2d)`` only sets its arguments): a leaf
    like the layer itself, where fx would trace into ``F.conv2d`` of its weight."""
    if cls.__module__.startswith("torch."):
        return False
    base = _layer_base(cls)
    return base is not None and cls.forward is base.forward


# torch.nn classes that hold modules rather than compute: their subclasses are traced into
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _layer_base(cls: type) -> Optional[type]:
    """The nearest torch.nn layer class in ``cls``'s MRO (itself excluded): one fx calls as a leaf."""
    for c in cls.__mro__[1:]:
        if c is nn.Module or issubclass(c, _CONTAINERS):
            return None
        if c.__module__.startswith("torch.nn.modules"):
            return c
    return None


def _as_base_layers(gm: fx.GraphModule) -> None:
    """Each call of a :func:`_layer_subclass` module calls, in the graph, a twin of its torch base class
    with the same attributes and the same parameter objects: every later stage (fusion, observers,
    convert) matches layers by their exact class. The user's model keeps its own module."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not _layer_subclass(type(module)):
            continue
        twin = _layer_base(type(module)).__new__(_layer_base(type(module)))
        twin.__dict__.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        parent, _, name = node.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, name, twin)
