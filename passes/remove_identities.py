"""Remove what computes nothing at inference: each eval-mode dropout is replaced by its input.

An identity left in the graph costs a partition boundary or worse: a function the ONNX
emitter does not know (torchvision's ``stochastic_depth``) becomes an eager-torch island,
which ``export_onnx`` refuses. Removed, each in eval mode only (the mode the node was traced
in: a module's ``training`` flag, the call's ``training`` / ``train`` argument):

* the dropout op of the catalogue (:data:`~qcompiler.ir.ops.names.DROPOUT`): ``nn.Dropout``,
  ``Dropout1d/2d/3d``, ``AlphaDropout``, ``FeatureAlphaDropout``; ``F.dropout`` and its
  variants with ``training=False``; ``torch.dropout(x, p, train=False)`` and its variants.
  ``F.dropout(x, p)`` defaults to ``training=True`` and drops even in an eval-mode model:
  it stays. A ``training`` that is not a Python bool (a value computed in the graph) stays.
* ``nn.Identity`` is *kept*: it is no island (a passthrough on either side, emitted as ONNX
  ``Identity``), torch.ao's ``fuse_modules`` leaves one where a BN was, and the hybrid guide's
  golden graphs (tests/test_golden_hybrid.py) show its nodes; ``clone`` / ``contiguous`` stay too
  (a later in-place write may rely on the copy). :data:`REMOVED_MODULES` is where to add it.
* torchvision's ``stochastic_depth(input, p, mode, training)``, a ``torch.fx.wrap``'ed function
  (so a call_function in a traced graph), with ``training`` False; recognised by its
  ``__module__`` / ``__qualname__`` since torchvision is not a dependency.
* a DropPath module (timm's ``DropPath``, transformers' ``SwinDropPath``, ``ConvNextDropPath``
  ...: a class named ``*DropPath`` with a ``drop_prob``) in eval mode, when it is a leaf (traced
  through, its ``if not training: return x`` already leaves nothing).

It runs first (before ``inplace_reads``): an in-place eval dropout returns its input unchanged,
so every read of either is a read of the input. The verifier fails if one is left.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import PassError, UnsupportedOpError
from qcompiler.ir.ops import bind, node_op
from qcompiler.ir.ops.names import DROPOUT
from qcompiler.passes.base import CompileContext, Pass, PassResult

# torchvision.ops.stochastic_depth.stochastic_depth(input, p, mode, training=True)
STOCHASTIC_DEPTH = ("torchvision.ops.stochastic_depth", "stochastic_depth")
_STOCHASTIC_DEPTH_PARAMS = ("input", "p", "mode", "training")


def _is_false(v: Any) -> bool:
    return v is False


def _stochastic_depth_input(node: fx.Node) -> Optional[Any]:
    """The input of an eval-mode ``stochastic_depth`` call, or None."""
    if node.op != "call_function":
        return None
    where = (getattr(node.target, "__module__", None), getattr(node.target, "__qualname__", None))
    if where != STOCHASTIC_DEPTH:
        return None
    args = dict(zip(_STOCHASTIC_DEPTH_PARAMS, node.args))
    if len(node.args) > len(_STOCHASTIC_DEPTH_PARAMS) or any(k not in _STOCHASTIC_DEPTH_PARAMS for k in node.kwargs):
        return None
    args.update(node.kwargs)
    return args.get("input") if "input" in args and _is_false(args.get("training", True)) else None


# module classes removed in eval mode beside the catalogue's dropout modules and DropPath
REMOVED_MODULES: tuple[type, ...] = ()


def _is_drop_path(m: nn.Module) -> bool:
    return type(m).__name__.endswith("DropPath") and hasattr(m, "drop_prob")


def identity_input(node: fx.Node, modules: Mapping[str, nn.Module]) -> Optional[Any]:
    """The value an eval-mode identity ``node`` returns (its input), or None when ``node`` is none."""
    if node.op == "call_module":
        m = modules[node.target]
        if _is_drop_path(m) or type(m) in REMOVED_MODULES:
            if m.training:
                return None
            return node.args[0] if len(node.args) == 1 and not node.kwargs else None
    found = _stochastic_depth_input(node)
    if found is not None:
        return found
    if node_op(node, modules) != DROPOUT:
        return None
    try:
        args = bind(node, modules)
    except UnsupportedOpError:
        return None
    training = args.get("training", args.get("train"))
    return args["input"] if _is_false(training) else None


def remove_identities(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Every eval-mode identity's readers read its input; the identity is erased."""
    modules = dict(gm.named_modules())
    modified = False
    for node in list(gm.graph.nodes):
        value = identity_input(node, modules)
        if value is None:
            continue
        if isinstance(value, fx.Node):
            node.replace_all_uses_with(value)
        else:
            _replace_with_constant(node, value)
        gm.graph.erase_node(node)
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def _replace_with_constant(node: fx.Node, value: Any) -> None:
    """Readers of ``node`` take ``value`` (a dropout of a number: ``F.dropout(2.0, training=False)``)."""
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda n: value if n is node else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: value if n is node else n)


def verify_no_identities(gm: fx.GraphModule, ctx: CompileContext) -> None:
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if identity_input(node, modules) is not None:
            raise PassError(f"remove_identities: node '{node.name}' is an eval-mode identity still in the graph")


REMOVE_IDENTITIES = Pass("remove_identities", remove_identities, verify_no_identities)

__all__ = ["REMOVED_MODULES", "REMOVE_IDENTITIES", "STOCHASTIC_DEPTH", "identity_input", "remove_identities"]
