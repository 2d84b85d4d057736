"""What an ONNX emit rule works with: value names, the graph builder and the per-node context.

The bottom of the ONNX backend (docs/design.md, "Layers"): the rules (:mod:`.rules`), the
registry (:mod:`.registry`), the quantization state (:mod:`.quant`) and the emitter
(:mod:`.emitter`) import it; it imports none of them. :class:`NodeContext` knows the
emitter only through the attributes it reads (``builder``, ``quant``, ``modules``,
``value_of``, ``path_of``, ``record_onnx_node``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import onnx
import torch
import torch.fx as fx
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_PARTITION, META_TENSOR, TensorInfo
from qcompiler.ir.ops import Signature, describe_target, read_arguments

if TYPE_CHECKING:
    from qcompiler.backends.onnx.emitter import OnnxEmitter

OPSET_VERSION = 11  # the opset qcompiler emits (the registry picks rules for it)
INT64_MAX = 2 ** 63 - 1

# TensorInfo dtype strings (qcompiler.ir.shape_prop) -> ONNX element types
DTYPE_TO_ONNX = {
    "f32": TensorProto.FLOAT,
    "f64": TensorProto.DOUBLE,
    "f16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "i64": TensorProto.INT64,
    "i32": TensorProto.INT32,
    "i16": TensorProto.INT16,
    "i8": TensorProto.INT8,
    "u8": TensorProto.UINT8,
    "bool": TensorProto.BOOL,
}
TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})

_MISSING = object()

Value = Any  # a tensor name (str), a python value, or a (nested) tuple/list of them


class Tensor(str):
    """A tensor name inside a value structure (a plain ``str`` subclass, so python
    strings that are *arguments* -- e.g. ``mode="bilinear"`` -- are never mistaken for one)."""

    __slots__ = ()


def is_tensor(v: Any) -> bool:
    return isinstance(v, Tensor)


# ---------------------------------------------------------------------------
# graph builder: names, nodes, initializers


class GraphBuilder:
    """Collects ONNX nodes and initializers with unique, deterministic names."""

    def __init__(self, reserved: Iterable[str] = ()) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self._init_arrays: dict[str, np.ndarray] = {}
        self.used: set[str] = set()
        self.reserved: set[str] = set(reserved)
        self.node_names: set[str] = set()
        self.dtypes: dict[str, int] = {}
        self.renamed: dict[str, str] = {}

    # -- names
    def fresh(self, base: str) -> Tensor:
        """A tensor name not used yet (and not an FX node name), ``base`` if free."""
        name, k = base, 1
        while name in self.used or name in self.reserved:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return Tensor(name)

    def claim(self, name: str) -> Tensor:
        """``name`` itself if no tensor has it yet, else a fresh variant."""
        if name not in self.used:
            self.used.add(name)
            return Tensor(name)
        return self.fresh(name)

    def node_name(self, base: str) -> str:
        name, k = base, 1
        while name in self.node_names:
            name, k = f"{base}_{k}", k + 1
        self.node_names.add(name)
        return name

    # -- initializers
    def initializer(self, name: str, array: np.ndarray) -> Tensor:
        """An initializer called ``name`` (a module path); the same name with the same
        contents is shared (a module called twice), different contents get a fresh name."""
        array = np.asarray(array)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            array = np.ascontiguousarray(array)
        old = self._init_arrays.get(name)
        if old is not None and old.dtype == array.dtype and old.shape == array.shape and np.array_equal(old, array):
            return Tensor(name)
        t = self.claim(name) if old is None else self.fresh(name)
        self._init_arrays[t] = array
        self.initializers[t] = numpy_helper.from_array(array, t)
        self.dtypes[t] = helper.np_dtype_to_tensor_dtype(array.dtype)
        return t

    def is_initializer(self, name: str) -> bool:
        return name in self.initializers

    def initializer_array(self, name: str) -> Optional[np.ndarray]:
        return self._init_arrays.get(name)

    # -- nodes
    def add_node(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
                 attrs: dict) -> onnx.NodeProto:
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = helper.make_node(op_type, list(inputs), list(outputs), name=name, **attrs)
        self.nodes.append(node)
        return node

    def rename_in(self, start: int, old: str, new: str) -> None:
        """Rename tensor ``old`` to ``new`` in the nodes from index ``start`` on."""
        for node in self.nodes[start:]:
            for i, n in enumerate(node.input):
                if n == old:
                    node.input[i] = new
            for i, n in enumerate(node.output):
                if n == old:
                    node.output[i] = new
        if old in self.dtypes:
            self.dtypes[new] = self.dtypes[old]
        self.used.add(new)
        self.renamed[old] = new

    def final_name(self, name: str) -> str:
        seen = set()
        while name in self.renamed and name not in seen:
            seen.add(name)
            name = self.renamed[name]
        return name

    def produced_since(self, start: int) -> set[str]:
        return {o for node in self.nodes[start:] for o in node.output}


# ---------------------------------------------------------------------------
# the view of one call that rules read


@dataclass
class Call:
    """What a rule emits: a call's kind, target, FX arguments and module.

    Rules read the input with ``ctx.x()`` (index 0 for every kind of call: the module's first
    argument, the function's ``input``, the method's ``self``) and the other arguments by name
    with :meth:`NodeContext.kw`; :meth:`arg` (the keyword if given, else the positional
    argument) is for the rules whose signature is not one of torch's (tuple indexing, sizes).
    """

    kind: str  # "call_module" | "call_function" | "call_method"
    target: Any
    args: tuple
    kwargs: dict
    module: Optional[nn.Module] = None
    path: Optional[str] = None  # module path (call_module)

    def arg(self, index: Optional[int], name: Optional[str], default: Any = _MISSING) -> Any:
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        if index is not None and index < len(self.args):
            return self.args[index]
        if default is _MISSING:
            raise KeyError(name or index)
        return default

    @property
    def method(self) -> Optional[str]:
        return self.target if self.kind == "call_method" else None


def call_of(node: fx.Node, modules: dict[str, nn.Module]) -> Call:
    module = modules.get(node.target) if node.op == "call_module" else None
    return Call(node.op, node.target, tuple(node.args), dict(node.kwargs), module,
                node.target if node.op == "call_module" else None)


@dataclass(frozen=True)
class ModuleTensor:
    """A parameter or buffer of the called module, as :meth:`NodeContext.kw` gives it; the
    rule turns it into an initializer named ``<module path>.<attr>`` with ``ctx.tensor``."""

    module: nn.Module
    attr: str
    path: Optional[str]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.module, self.attr).shape)


# ---------------------------------------------------------------------------
# per-node context handed to rules


class NodeContext:
    """Everything a rule needs to emit one FX node: its call, values and a builder."""

    def __init__(self, emitter: "OnnxEmitter", node: fx.Node, call: Call, op: Optional[str]) -> None:
        self.emitter = emitter
        self.b = emitter.builder
        self.node = node
        self.call = call
        self.op = op
        self.quant = emitter.quant
        part = node.meta.get(META_PARTITION)
        self.prefix = f"{part}/{node.name}" if part else node.name
        self._main_named = False

    # -- arguments
    @property
    def module(self) -> Optional[nn.Module]:
        return self.call.module

    @property
    def path(self) -> Optional[str]:
        return self.call.path

    def arg(self, index: Optional[int], name: Optional[str], default: Any = _MISSING) -> Any:
        return self.call.arg(index, name, default)

    def kw(self, **params: Any) -> dict[str, Any]:
        """The call's arguments by name, whatever its spelling; ``params`` are the op's parameters
        after the input, in the functional signature's order, with their defaults (``REQUIRED``
        for none).

        * ``F.op(x, a, b=...)`` / ``torch.op`` / ``x.op(a, b=...)``: positional arguments after the
          input take the names of ``params`` in order; keywords keep theirs.
        * ``nn.Module`` calls: each name is the module attribute of that name (torch's modules
          keep their functional parameter names: ``negative_slope``, ``kernel_size``, ``dim``...);
          a parameter or buffer comes as a :class:`ModuleTensor` (``ctx.tensor`` names it by path).
          ``training`` is never read from a module (its train flag is state; the export is eval).

        So one rule body serves every spelling (no ``if ctx.module`` branch). The reading is
        :func:`qcompiler.ir.ops.read_arguments`'s, the one every pass uses; a call that does
        not fit ``params`` (too many positional arguments, an unknown keyword, a missing
        required one) is unsupported.
        """
        call, m = self.call, self.call.module
        signature = Signature(("input",), tuple(params.items()))
        # a module call's other inputs and keywords are the rule's to read (ctx.arg); keywords the
        # rule does not name (``inplace=False``) are kept as given: torch checked them
        args, kwargs = (call.args[:1], {}) if m is not None else (call.args, call.kwargs)
        named = {k: v for k, v in kwargs.items() if k in signature.names}
        try:
            out = read_arguments(signature, args, named, m, describe_target(self.node, self.emitter.modules))
        except UnsupportedOpError as e:
            raise self.unsupported(str(e)) from None
        out.update({k: v for k, v in kwargs.items() if k not in signature.names})
        out.pop("input", None)
        if m is not None:
            if "training" in params:  # a module's train flag is its state, not an argument of the call
                out["training"] = params["training"]
            for name in params:
                if (name in m._parameters or name in m._buffers) and out[name] is not None:
                    out[name] = ModuleTensor(m, name, call.path)
        return out

    def value(self, a: Any) -> Value:
        """An FX argument with every Node replaced by its emitted value."""
        return self.emitter.value_of(a, self.node)

    def tensor(self, a: Any, dtype: Optional[int] = None) -> Tensor:
        """A tensor name for an FX argument; python numbers become constants of ``dtype``
        (default: float32), tensors of another dtype are cast to ``dtype`` when given; a
        :class:`ModuleTensor` becomes the initializer ``<path>.<attr>``."""
        if isinstance(a, ModuleTensor):
            return self.param(a.module, a.attr, a.path)
        v = self.value(a)
        if is_tensor(v):
            if dtype is not None and self.dtype(v) != dtype:
                return self.make("Cast", [v], tag="cast", to=dtype, dtype=dtype)
            return v
        if isinstance(v, (bool, int, float)) or (isinstance(v, (list, tuple)) and all(
                isinstance(e, (bool, int, float)) for e in v)):
            return self.const("const", v, dtype if dtype is not None else TensorProto.FLOAT)
        raise self.unsupported(f"expected a tensor argument, got {type(v).__name__}")

    def x(self, dtype: Optional[int] = None) -> Tensor:
        """The input tensor (argument 0 / ``input``)."""
        return self.tensor(self.arg(0, "input"), dtype)

    def shape(self, a: Any = _MISSING) -> Optional[tuple[int, ...]]:
        """Static shape of an FX argument (default: argument 0) from shape propagation."""
        if a is _MISSING:
            a = self.arg(0, "input")
        if isinstance(a, ModuleTensor):
            return a.shape
        if isinstance(a, fx.Node):
            info = a.meta.get(META_TENSOR)
            return info.shape if isinstance(info, TensorInfo) else None
        return None

    def rank(self, a: Any = _MISSING) -> int:
        s = self.shape(a)
        if s is None:
            raise self.unsupported("the input's rank is unknown (run shape propagation first)")
        return len(s)

    def out_shape(self) -> Optional[tuple[int, ...]]:
        info = self.node.meta.get(META_TENSOR)
        return info.shape if isinstance(info, TensorInfo) else None

    def out_dtype(self) -> Optional[int]:
        info = self.node.meta.get(META_TENSOR)
        return DTYPE_TO_ONNX.get(info.dtype) if isinstance(info, TensorInfo) else None

    def dtype(self, t: str) -> int:
        return self.b.dtypes.get(t, TensorProto.FLOAT)

    # -- building
    def make(self, op_type: str, inputs: Sequence[str], *, outputs: int = 1, tag: Optional[str] = None,
             dtype: Optional[int] = None, **attrs: Any) -> Union[Tensor, list[Tensor]]:
        """Add one ONNX node; returns its output name (or names when ``outputs > 1``).

        The first untagged node of an FX node is named ``<prefix>``, the others
        ``<prefix>/<tag or op type>``. ``dtype`` is the output element type when it is
        not the first input's.
        """
        if tag is None and not self._main_named:
            name = self.b.node_name(self.prefix)
            self._main_named = True
        else:
            name = self.b.node_name(f"{self.prefix}/{tag or op_type.lower()}")
        base = f"{self.node.name}/{tag or op_type.lower()}"
        outs = [self.b.fresh(base if outputs == 1 else f"{base}_{i}") for i in range(outputs)]
        self.b.add_node(op_type, inputs, outs, name, attrs)
        out_dtype = dtype
        if out_dtype is None:
            first = next((i for i in inputs if i), None)
            out_dtype = self.b.dtypes.get(first, TensorProto.FLOAT) if first is not None else TensorProto.FLOAT
        for o in outs:
            self.b.dtypes[o] = out_dtype
        self.emitter.record_onnx_node(self.node, name)
        return outs[0] if outputs == 1 else outs

    def const(self, tag: str, value: Any, dtype: int = TensorProto.FLOAT) -> Tensor:
        """A constant initializer ``<node>/<tag>`` (a python scalar becomes a 0-d tensor)."""
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        try:
            arr = np.asarray(value, dtype=np_dtype)
        except OverflowError:  # torch wraps such a number around in an integer tensor; numpy refuses it
            raise self.unsupported(f"the number {value!r} does not fit {np.dtype(np_dtype).name}") from None
        return self.b.initializer(f"{self.node.name}/{tag}", arr)

    def initializer(self, name: str, array: np.ndarray) -> Tensor:
        """A named initializer (a module path such as ``conv1.op.weight``)."""
        return self.b.initializer(name, array)

    def param(self, module: nn.Module, attr: str, path: Optional[str] = None,
              transform: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> Optional[Tensor]:
        """The float parameter/buffer ``attr`` of ``module`` as an initializer ``<path>.<attr>``."""
        t = getattr(module, attr, None)
        if t is None:
            return None
        arr = to_numpy(t)
        if transform is not None:
            arr = transform(arr)
        path = path if path is not None else self.emitter.path_of(module)
        return self.initializer(f"{path}.{attr}" if path else attr, arr)

    def identity(self, t: str) -> Tensor:
        return self.make("Identity", [t])

    def unsupported(self, why: str) -> UnsupportedOpError:
        what = describe_target(self.node, self.emitter.modules)
        if self.op is not None:
            what += f", op '{self.op}'"
        return UnsupportedOpError(f"cannot emit node '{self.node.name}' ({what}) to ONNX opset 11: {why}")


def to_numpy(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype in (torch.float64, torch.float16, torch.bfloat16):
            t = t.float()
        return t.numpy().copy()
    return np.asarray(t)
