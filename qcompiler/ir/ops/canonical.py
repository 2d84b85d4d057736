"""The canonical op of an FX node, and the clamps canonicalized by their bounds.

``torch.clamp(x, min=0)``, ``x.clamp_min(0)`` are "relu" and ``torch.clamp(x, 0, 6)``,
``F.hardtanh(x, 0, 6)``, ``nn.Hardtanh(0, 6)`` are "relu6" (the same values, bit for bit),
so they place, fuse and convert like the ReLUs MARCH_OPS.md lists; clamps with other
bounds have no canonical op (they run on CPU; :func:`emit_op` names them "clamp" for the
CPU backends, which read the bounds with :func:`clamp_bounds`).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import UnsupportedOpError
from qcompiler.ir.ops.bind import bind
from qcompiler.ir.ops.registry import CLAMP, CLAMP_OP, FUNCTION_OPS, METHOD_OPS, MODULE_OPS

_CLAMP_FUNCTIONS = frozenset(CLAMP_OP.functions)
_CLAMP_METHODS = frozenset(CLAMP_OP.methods)


def is_number(v: object) -> bool:
    """A Python int or float operand (a bool is not one): a constant baked into the op."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def clamp_op(lower: object, upper: object) -> Optional[str]:
    """"relu" for bounds (0, None), "relu6" for (0, 6), else None; bounds must be Python numbers."""
    if not is_number(lower) or lower != 0:
        return None
    if upper is None:
        return "relu"
    return "relu6" if is_number(upper) and upper == 6 else None


def module_op(module: nn.Module) -> Optional[str]:
    """The canonical op of a module class, looking along its MRO; ``qc_op`` attributes win."""
    explicit = getattr(type(module), "qc_op", None)
    if explicit is not None:
        return explicit
    for cls in type(module).__mro__:
        op = MODULE_OPS.get(cls)
        if op is not None:
            return op
    if isinstance(module, nn.Hardtanh):
        return clamp_op(module.min_val, module.max_val)
    return None


def node_op(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The canonical op of a node, or None for placeholders, outputs, get_attr and unknown calls.

    ``modules`` is ``dict(gm.named_modules())``.
    """
    if node.op == "call_module":
        return module_op(modules[node.target])
    if node.op == "call_function":
        try:
            op = FUNCTION_OPS.get(node.target)
        except TypeError:  # unhashable target
            return None
    elif node.op == "call_method":
        op = METHOD_OPS.get(node.target)
    else:
        return None
    if is_clamp(node, modules):
        bounds = clamp_bounds(node, modules)
        return clamp_op(*bounds) if bounds is not None else None
    return op


def is_clamp(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """True if ``node`` is a clamp / clip / hardtanh spelling, whatever its bounds."""
    if node.op == "call_module":
        return isinstance(modules.get(node.target), nn.Hardtanh)
    if node.op == "call_function":
        try:
            return node.target in _CLAMP_FUNCTIONS
        except TypeError:  # unhashable target
            return False
    return node.op == "call_method" and node.target in _CLAMP_METHODS


def clamp_bounds(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[tuple[object, object]]:
    """``(lower, upper)`` of any clamp spelling (None for no bound; an FX node for a tensor bound),
    or None when ``node`` is no clamp or its arguments do not parse."""
    if node.op == "call_module":
        m = modules.get(node.target)
        return (m.min_val, m.max_val) if isinstance(m, nn.Hardtanh) else None
    if not is_clamp(node, modules):
        return None
    try:
        args = bind(node, modules)
    except UnsupportedOpError:
        return None
    # a parameter named min* is the lower bound, max* the upper (clamp_max has only the upper)
    lower = next((v for name, v in args.items() if name.startswith("min")), None)
    upper = next((v for name, v in args.items() if name.startswith("max")), None)
    return lower, upper


def emit_op(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The op a backend computes ``node`` as: its canonical op, or "clamp" for a clamp spelling
    whose bounds are no ReLU's (it has no canonical op: nothing but the CPU runs it)."""
    op = node_op(node, modules)
    if op is None and is_clamp(node, modules):
        return CLAMP
    return op


def describe_target(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    """Short human name of what a node calls: ``Conv2d``, ``torch.add``, ``.view``."""
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_function":
        mod = getattr(node.target, "__module__", None) or ""
        name = getattr(node.target, "__name__", str(node.target))
        if mod in ("_operator", "operator"):
            return f"operator.{name}"
        if mod.startswith("torch.nn.functional"):
            return f"F.{name}"
        if mod == "torch" or mod.startswith("torch._C") or not mod:
            return f"torch.{name}"
        return f"{mod}.{name}"
    if node.op == "call_method":
        return f".{node.target}"
    return str(node.target)
