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
  torch.fx's Proxy does not support item assignment.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sysconfig
import traceback
import typing
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.ao.quantization as taq
import torch.fx as fx
import torch.nn as nn
from torch.ao.nn.quantized import FloatFunctional

from qcompiler.errors import TraceError
from qcompiler.ir.meta import META_SCOPE, ScopeEntry
from qcompiler.ir.names import check_module_names, resolve_type
from qcompiler.ir.setitem import setitem_
from qcompiler.ir.shape_prop import normalize_inputs

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
    return isinstance(module, (taq.QuantStub, taq.DeQuantStub)) or getattr(
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

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_stub(m) or getattr(type(m), "qc_leaf", False):
            return True
        if module_qualified_name in self.leaf_module_names:
            return True
        if self.leaf_module_types and isinstance(m, self.leaf_module_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return QProxy(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """fx's root arguments, with each of ``constant_args`` passed as its value and its
        placeholder removed (fx's own ``concrete_args`` would keep it, plus guard nodes)."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        for i, arg in enumerate(args):
            node = arg.node if isinstance(arg, fx.Proxy) else None
            if node is not None and node.op == "placeholder" and node.target in self.constant_args:
                args[i] = self.constant_args[node.target]
                self.graph.erase_node(node)
        return fn, args

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
            return super().trace(root, concrete_args)

    @contextlib.contextmanager
    def _float_functional_as_functions(self):
        """Route FloatFunctional methods to torch functions scoped to the FloatFunctional."""
        tracer = self
        saved = {name: FloatFunctional.__dict__[name] for name in _FLOAT_FUNCTIONAL_OPS if name in FloatFunctional.__dict__}

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
    (see the module docstring). The GraphModule shares submodules with ``model``:
    copy the model first if the graph will be rewritten.  Raises TraceError naming
    the module and source line where tracing failed.
    """
    check_module_names(model, leaf_module_names, "non_traceable_module_name")
    types = tuple(resolve_type(t, "non_traceable_module_class") for t in leaf_module_types)
    tracer = QTracer(leaf_module_names, types)
    if example_inputs is not None:
        defaults = unsupplied_defaults(model, len(normalize_inputs(example_inputs)))
        tracer.constant_args = {k: v for k, v in defaults.items() if k not in (concrete_args or {})}
    try:
        graph = tracer.trace(model, concrete_args)
    except Exception as exc:  # torch raises many types here; we report them all the same way
        raise _trace_error(model, tracer, exc, example_inputs is not None) from None
    _resolve_string_annotations(graph, model)
    return fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)


def unsupplied_defaults(model: nn.Module, n_inputs: int) -> dict[str, Any]:
    """``{name: default}`` of the ``forward`` parameters with a default that ``n_inputs``
    positional inputs leave out (keyword-only ones always)."""
    out = {}
    params = inspect.signature(model.forward).parameters.values()
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
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
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
    err.module_path = path
    err.reason = reason  # torch's message, first line
    err.code_error = isinstance(exc, (NameError, ImportError))  # the forward fails eagerly too
    return err
