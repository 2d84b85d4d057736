"""Lowering of the ops that move data without arithmetic (identity, flatten, reshape, squeeze, unsqueeze,
permute, transpose, getitem: the input's grid passes through) and of cat, which requantizes each input."""

from __future__ import annotations

import functools
import operator
from typing import Callable

import torch

from qcompiler.backends.bpu.lowering.registry import lowers
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

# (ctx, the node's arguments after its input, its keyword arguments) -> (BPU op kind, attrs)
LayoutAttrs = Callable[..., tuple[str, dict]]


def same_scale(*ops: str, emits: tuple[str, ...], bare: bool = False) -> Callable[[LayoutAttrs], LayoutAttrs]:
    """Register ``fn(ctx, args, kwargs) -> (kind, attrs)`` as the rule of the same-scale ``ops``.

    The rule checks what every such op needs: a per-tensor input, static other arguments, and a module
    that says what it computes (a function, a method or the float module it replaces), unless a ``bare``
    module is the op itself (the identity). The output keeps the input's grid.
    """
    def deco(fn: LayoutAttrs) -> LayoutAttrs:
        @functools.wraps(fn)
        def rule(ctx):
            x = ctx.arg(0)
            ctx.per_tensor(x)
            out = ctx.out()
            args, kwargs = ctx.rest()
            ctx.constant_args(args + list(kwargs.values()))
            m = ctx.module
            if not bare and m.function is None and m.method is None and m.float_module is None:
                raise ctx.fail(f"cannot tell what the converted '{m.qc_op}' computes")
            kind, attrs = fn(ctx, args, kwargs)
            return ctx.emit(kind, [x.name], {**attrs, **out})
        lowers(qnn.QuantizedSameScale, *ops, emits=emits)(rule)
        return fn
    return deco


def _target(m: qnn.QuantizedSameScale):
    """The tensor method name or the torch function the module applies (None for a float module)."""
    return m.method if m.method is not None else m.function


@same_scale("identity", "dropout", emits=("identity",), bare=True)
def identity(ctx, args, kwargs):
    """identity, and dropout in eval mode: the input itself."""
    if ctx.module.qc_op == "dropout" and kwargs.get("training", args[1] if len(args) > 1 else False):
        raise ctx.fail("dropout in training mode")
    return "identity", {}


@same_scale("flatten", emits=("flatten",))
def flatten(ctx, args, kwargs):
    """nn.Flatten (its dims) or torch.flatten / Tensor.flatten (the call's)."""
    dims = ctx.args
    return "flatten", {"start_dim": int(dims["start_dim"]), "end_dim": int(dims["end_dim"])}


def _reshape(ctx, args, kwargs) -> tuple[str, dict]:
    shp = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
    if "shape" in kwargs:
        shp = kwargs["shape"]
    return "reshape", {"shape": [int(s) for s in shp]}


def _squeeze(ctx, args, kwargs) -> tuple[str, dict]:
    dim = args[0] if args else kwargs.get("dim")
    if isinstance(dim, (list, tuple)):
        raise ctx.fail("squeeze over several dims")
    return "squeeze", {"dim": None if dim is None else int(dim)}


def _unsqueeze(ctx, args, kwargs) -> tuple[str, dict]:
    return "unsqueeze", {"dim": int(args[0] if args else kwargs["dim"])}


# the spellings convert canonicalizes to "reshape" -> the BPU op each one is
RESHAPES: dict[str, LayoutAttrs] = {"reshape": _reshape, "view": _reshape, "squeeze": _squeeze,
                                    "unsqueeze": _unsqueeze}


@same_scale("reshape", emits=("reshape", "squeeze", "unsqueeze"))
def reshape(ctx, args, kwargs):
    """reshape / view, squeeze and unsqueeze, by the spelling the module applies."""
    target = _target(ctx.module)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    spelled = RESHAPES.get(name)
    if spelled is None:
        raise ctx.fail(f"reshape spelled {name!r}")
    return spelled(ctx, args, kwargs)


@same_scale("permute", emits=("permute",))
def permute(ctx, args, kwargs):
    """permute with its dims as varargs, one sequence, or the keyword."""
    dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    if "dims" in kwargs:
        dims = kwargs["dims"]
    return "permute", {"dims": [int(d) for d in dims]}


@same_scale("transpose", emits=("transpose",))
def transpose(ctx, args, kwargs):
    """transpose of two dims."""
    dims = ctx.args
    return "transpose", {"dim0": int(dims["dim0"]), "dim1": int(dims["dim1"])}


@same_scale("getitem", emits=("getitem",))
def getitem(ctx, args, kwargs):
    """x[index] with a static index."""
    if _target(ctx.module) is not operator.getitem:
        raise ctx.fail("getitem spelled differently than operator.getitem")
    return "getitem", {"index": ctx.index(args[0])}


@lowers(qnn.QuantizedCat, "cat", emits=("cat",))
def cat(ctx):
    """cat along a static dim: each input requantized to the output scale with the multipliers int_cat
    computes on every call, computed once the same way."""
    m, tensors_arg = ctx.module, ctx.arg(0, "tensors")
    if not isinstance(tensors_arg, (list, tuple)):
        raise ctx.fail("cat of a non-list argument")
    names = []
    for i, t in enumerate(tensors_arg):
        s = ctx.per_tensor(t, f"input {i}")
        if s.scale != m.in_scales[i]:
            raise ctx.fail(f"input {i} scale {s.scale!r} differs from the module's {m.in_scales[i]!r}")
        names.append(t.name)
    dim = ctx.args["dim"]
    ctx.constant_args([dim])
    so = fp._f64(m.out_scale, "out_scale")
    Ms, ns = [], []
    for i, s in enumerate(m.in_scales):
        M, n = fp.requant_params(fp._f64(s, f"in_scales[{i}]") / so, mult_bits=qnn.MULT_BITS,
                                 max_shift=qnn.MAX_SHIFT)
        Ms.append(int(M))
        ns.append(int(n))
    return ctx.emit("cat", names, {"dim": int(dim), **ctx.out()},
                    {"M": torch.tensor(Ms, dtype=torch.int64), "n": torch.tensor(ns, dtype=torch.int64)})
