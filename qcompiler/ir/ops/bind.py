"""One reader of a node's arguments: :func:`bind` gives them by name, whatever the spelling.

Positional arguments take the names of the op's own :class:`~.opdef.Signature` (so a
``dim`` given by position is never lost, whatever torch's schema matching makes of an
overloaded ``torch.cat`` / ``torch.mean``), then keywords, then the defaults. A module
spelling gives its parameters from the module's attributes (torch's modules keep their
functional parameter names: ``negative_slope``, ``kernel_size``, ``dim``...). A call that
does not fit the signature (an unknown keyword, too many positional arguments, a missing
one) raises :class:`~qcompiler.errors.UnsupportedOpError` naming the node: no binding is
ever guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.meta import META_OP
from qcompiler.ir.ops.opdef import REQUIRED, OpDef, Signature
from qcompiler.ir.ops.registry import OPS, definition
from qcompiler.nn.quantized import QuantizedSameScale


@dataclass(frozen=True)
class Callee:
    """What a call node calls, seen by its spelling: the op, the spelling's name (a function's
    ``__name__``, a method name, a module class name), its signature, and the module whose
    attributes give the parameters (a module spelling; None for function and method calls)."""

    op: OpDef
    name: str
    signature: Optional[Signature]
    module: Optional[nn.Module] = None


def callee(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Callee]:
    """The :class:`Callee` of ``node``, or None for placeholders, outputs, get_attr and calls of
    no known op. A converted same-scale module stands for the call it stores; another converted
    or fused module keeps the call's arguments, read by the signature of the op the call was
    placed as (``META_OP``), else of its ``qc_op``; so does a function no op spells (a prepared
    model's stand-in such as ``qcompiler.nn.qat.prelu``) once placement has named its op."""
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return _function(node.target) or _placed_as(node, name, node.meta.get(META_OP))
    if node.op == "call_method":
        return _method(node.target)
    if node.op != "call_module":
        return None
    m = modules[node.target]
    if isinstance(m, QuantizedSameScale):
        if m.method is not None:
            return _method(m.method)
        if m.function is not None:
            return _function(m.function)
        if m.float_module is not None:
            m = m.float_module
    for cls in type(m).__mro__:
        op = definition(cls)
        if op is not None:
            return Callee(op, type(m).__name__, op.signature_of(cls), m)
    return _placed_as(node, type(m).__name__, node.meta.get(META_OP) or getattr(m, "qc_op", None))


def _placed_as(node: fx.Node, name: str, op_name: Optional[str]) -> Optional[Callee]:
    """A call read by the signature of the op it stands for (``op_name``), or None for no known op."""
    op = OPS.get(op_name or "")
    return Callee(op, name, op.signature) if op is not None else None


def _function(target: Any) -> Optional[Callee]:
    op = definition(target)
    return Callee(op, getattr(target, "__name__", str(target)), op.signature_of(target)) if op is not None else None


def _method(name: str) -> Optional[Callee]:
    op = definition(name)
    return Callee(op, name, op.signature_of(name)) if op is not None else None


@dataclass(frozen=True)
class Binding(Mapping[str, Any]):
    """A call's arguments by name (a read-only mapping), with the op and spelling they came from."""

    op: str
    spelling: str
    arguments: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arguments)

    def __len__(self) -> int:
        return len(self.arguments)


def bind(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Binding]:
    """``node``'s arguments by name (inputs and parameters, defaults filled in), or None when it
    calls no known op; raises UnsupportedOpError when the call does not fit its op's signature.

    ``modules`` is ``dict(gm.named_modules())``.
    """
    c = callee(node, modules)
    if c is None:
        return None
    what = f"node '{node.name}' ({c.name}, op '{c.op.name}')"
    if c.signature is None:
        raise UnsupportedOpError(f"{what}: op '{c.op.name}' has no argument signature yet "
                                 f"(qcompiler.ir.ops.catalogue); its arguments are not read by name")
    args = read_arguments(c.signature, node.args, node.kwargs, c.module, what)
    return Binding(c.op.name, c.name, args)


def read_arguments(signature: Signature, args: Sequence[Any], kwargs: Mapping[str, Any],
                   module: Optional[nn.Module], what: str) -> dict[str, Any]:
    """Bind ``args`` / ``kwargs`` by ``signature`` (the parameters from ``module``'s attributes when
    given: a module call passes only its inputs); ``what`` names the call in errors."""
    out = dict(zip(signature.inputs, args))
    rest = list(args[len(signature.inputs):])
    if module is not None:
        if rest:
            raise UnsupportedOpError(f"{what}: {len(args)} positional arguments to a module with inputs "
                                     f"({', '.join(signature.inputs)})")
        out.update({name: getattr(module, name) for name, _ in signature.params if hasattr(module, name)})
    else:
        slots = [name for name, _ in signature.positional]
        if len(rest) > len(slots) and signature.varargs is None:
            raise UnsupportedOpError(f"{what}: {len(rest)} positional arguments after the inputs; its signature "
                                     f"has {len(slots)} ({', '.join(slots) or 'none'})")
        out.update(zip(slots, rest))
        extra = rest[len(slots):]
        if extra:  # *varargs: x.view(2, 3) or x.view((2, 3))
            whole = len(extra) == 1 and isinstance(extra[0], (tuple, list))
            out[signature.varargs] = extra[0] if whole else tuple(extra)
    for name, value in kwargs.items():
        if name not in signature.names:
            raise UnsupportedOpError(f"{what}: unknown keyword argument {name}={value!r} (its signature has "
                                     f"{', '.join(signature.names)})")
        if name in out:
            raise UnsupportedOpError(f"{what}: argument {name!r} given twice")
        out[name] = value
    missing = [n for n in signature.inputs if n not in out]
    missing += [n for n, default in signature.params if n not in out and default is REQUIRED]
    if missing:
        raise UnsupportedOpError(f"{what}: missing argument(s) {', '.join(missing)}")
    out.update({n: default for n, default in signature.params if n not in out})
    return out
