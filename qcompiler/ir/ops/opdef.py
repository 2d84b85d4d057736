"""What defines a canonical op: its name, group tags, argument signature and spellings.

An :class:`OpDef` is one row of the op catalogue (:mod:`.catalogue`). Passes and tables ask
the registry (:mod:`.registry`) for the ops of a :class:`Tag` instead of listing names, and
read a node's arguments by name with :func:`qcompiler.ir.ops.bind`, which follows the op's
:class:`Signature`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union


class Tag(enum.Enum):
    """A group of ops that a pass or table treats alike (tinygrad's ``GroupOp``)."""

    PASSTHROUGH = "passthrough"  # moves no data and computes nothing: takes its producer's placement
    LAYOUT = "layout"  # only re-arranges or re-labels a tensor (the march table decides after a BPU producer)
    META = "meta"  # its result is metadata (sizes), not data
    ELEMENTWISE = "elementwise"  # each output element from the same-position input elements (batch split checked)
    SPATIAL = "spatial"  # over (N, C, spatial...) one sample at a time: dim 0 is and stays the batch
    ALONG_DIM = "along_dim"  # along its ``dim`` (or ``dims``) without dropping it: softmax, cumsum, flip
    REDUCTION = "reduction"  # reduces over its ``dim``; ``keepdim`` keeps it
    TRAINING = "training"  # mixes samples (batch statistics) or draws random numbers in training mode
    CPU_EXACT = "cpu_exact"  # the same float bits on the CPU whatever the tensor's length or layout


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of a parameter the call must give
KEYWORD_ONLY = "*"  # in :func:`sig`: the parameters after it are keyword-only

Param = tuple[str, Any]  # (name, default)


@dataclass(frozen=True)
class Signature:
    """How a call's arguments bind to names: torch's own parameter names, in positional order.

    ``inputs`` are the tensor operands every spelling passes first (a module's ``forward``
    arguments); ``positional`` the parameters after them, ``varargs`` a ``*name`` parameter
    that collects the positional arguments left (``x.view(2, 3)``; a single list or tuple is
    taken whole, as torch takes ``x.view((2, 3))``), ``keyword`` the keyword-only ones.
    """

    inputs: tuple[str, ...] = ("input",)
    positional: tuple[Param, ...] = ()
    varargs: Optional[str] = None
    keyword: tuple[Param, ...] = ()

    @property
    def params(self) -> tuple[Param, ...]:
        """Every parameter after the inputs with its default (a varargs one is required)."""
        varargs = ((self.varargs, REQUIRED),) if self.varargs is not None else ()
        return self.positional + varargs + self.keyword

    @property
    def names(self) -> tuple[str, ...]:
        return self.inputs + tuple(name for name, _ in self.params)


def sig(*params: Union[str, Param], inputs: tuple[str, ...] = ("input",)) -> Signature:
    """A :class:`Signature` written like a Python one: ``"name"`` (required), ``("name", default)``,
    ``"*"`` (the rest are keyword-only) or ``"*name"`` (varargs; the rest are keyword-only)."""
    positional: list[Param] = []
    keyword: list[Param] = []
    varargs: Optional[str] = None
    after_star = False
    for p in params:
        if isinstance(p, str) and p.startswith(KEYWORD_ONLY):
            if after_star:
                raise ValueError(f"signature {params!r}: a second '*'")
            after_star, varargs = True, (p[1:] or None)
            continue
        param = (p, REQUIRED) if isinstance(p, str) else p
        (keyword if after_star else positional).append(param)
    s = Signature(tuple(inputs), tuple(positional), varargs, tuple(keyword))
    if len(set(s.names)) != len(s.names):
        raise ValueError(f"signature {params!r}: a name appears twice")
    return s


Spelling = Union[type, Callable[..., Any], str]  # a module class, a call_function target, a method name


@dataclass(frozen=True)
class OpDef:
    """One canonical op: its name, tags, signature and every spelling that maps to it."""

    name: str
    tags: frozenset[Tag] = frozenset()
    signature: Optional[Signature] = None  # None: not written yet (``bind`` refuses to guess)
    modules: tuple[type, ...] = ()  # nn.Module classes (subclasses match too)
    functions: tuple[Callable[..., Any], ...] = ()  # call_function targets
    methods: tuple[str, ...] = ()  # call_method names
    aten: tuple[Any, ...] = ()  # ATen overloads (graphs captured by torch.export)
    forms: Mapping[Spelling, Signature] = field(default_factory=dict)  # spellings whose signature differs

    def signature_of(self, spelling: Spelling) -> Optional[Signature]:
        """The signature a call through ``spelling`` binds by."""
        return self.forms.get(spelling, self.signature)

    @property
    def spellings(self) -> tuple[Spelling, ...]:
        return self.modules + self.functions + self.methods + self.aten


def define(name: str, *tags: Tag, signature: Optional[Signature] = None, modules: tuple[type, ...] = (),
           functions: tuple[Callable[..., Any], ...] = (), methods: tuple[str, ...] = (),
           aten: tuple[Any, ...] = (), forms: Optional[Mapping[Spelling, Signature]] = None) -> OpDef:
    """An :class:`OpDef`; ``forms`` keys must be spellings of the op.

    ``aten``: the ATen overloads (``torch.ops.aten.add.Tensor``) a graph captured by torch.export
    spells the op with; a form for one names its arguments where ATen's schema differs from the
    op's signature (``batch_norm``'s order, ``layer_norm``'s ``cudnn_enable``), so the capture
    (qcompiler.ir.export_capture) rewrites the call into a torch spelling of the op."""
    op = OpDef(name, frozenset(tags), signature, tuple(modules), tuple(functions), tuple(methods), tuple(aten),
               dict(forms or {}))
    stray = [k for k in op.forms if k not in op.spellings]
    if stray:
        raise ValueError(f"op {name!r}: forms for spellings it does not have: {stray!r}")
    return op
