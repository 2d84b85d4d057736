"""Fused modules made by the fuse pass: a conv / conv-transpose / linear with any
BatchNorm folded into its weights, then an optional residual add and ReLU/ReLU6.

One module per fused pattern lets later passes quantize and place the pattern as
one op (the BPU computes conv+bn+add+relu in one instruction), so no observer
sits on the intermediate values.  The tracer keeps these modules whole
(``qc_leaf``) and ``qcompiler.ir.ops.module_op`` reads their op from ``qc_op``.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.compat.torch_private import global_forward_hooks, global_forward_pre_hooks, is_functorch_wrapped_tensor
from qcompiler.quantization.fixed_point import pads4

__all__ = [
    "FusedModule",
    "FusedConv2d",
    "FusedConvTranspose2d",
    "FusedLinear",
    "fold_bn",
    "build_fused",
    "ZERO_PADDING_MODES",
    "PaddedAvgPool2d",
    "with_zero_padding",
]

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d)
_BaseModule = Union[nn.Conv2d, nn.ConvTranspose2d, nn.Linear]


class FusedModule(nn.Module):
    """``act(op(x) [+ other])``: the shared body of the fused modules.

    ``op`` is the base layer (BN already folded into it), ``act`` is None,
    ``nn.ReLU()`` or ``nn.ReLU6()``, ``with_add`` says whether forward takes the
    residual operand, and ``fused_from`` names the original ops in pattern order.
    """

    qc_leaf = True
    qc_op: str = ""
    op_type: type = nn.Module

    def __init__(
        self,
        op: nn.Module,
        act: Optional[nn.Module] = None,
        with_add: bool = False,
        fused_from: Optional[Sequence[str]] = None,
    ) -> None:
        super().__init__()
        if not isinstance(op, self.op_type):
            raise TypeError(f"{type(self).__name__} needs an {self.op_type.__name__}, got {type(op).__name__}")
        if act is not None and not isinstance(act, (nn.ReLU, nn.ReLU6)):
            raise TypeError(f"act must be None, nn.ReLU or nn.ReLU6, got {type(act).__name__}")
        self.op = op
        self.act = act
        self.with_add = bool(with_add)
        if fused_from is None:
            fused_from = (self.qc_op,) + (("add",) if with_add else ()) + ((_act_op(act),) if act is not None else ())
        self.fused_from = tuple(fused_from)

    @property
    def weight(self) -> torch.Tensor:
        return self.op.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.op.bias

    def forward(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.op(x)
        own = self._owns(y, x)
        if self.with_add:
            if other is None:
                raise TypeError(f"{type(self).__name__}({self.extra_repr()}) needs the add's second operand")
            if own and _adds_in_place(y, other):
                y.add_(other)
            else:
                y = y + other
                own = not _recorded(y) and not _transformed(y)
        elif other is not None:
            raise TypeError(f"{type(self).__name__}({self.extra_repr()}) has no add; got a second input")
        if self.act is not None:
            act = self.act
            if own and type(act) in _ACT_IN_PLACE and not act._forward_hooks and not act._forward_pre_hooks \
                    and not global_forward_pre_hooks:
                y = _ACT_IN_PLACE[type(act)](y)
            else:
                y = act(y)
        return y

    def _owns(self, y: torch.Tensor, x: torch.Tensor) -> bool:
        """May the add and the activation write ``y``, the base layer's output, in place?

        In place they compute the same values (the same kernels) without allocating and
        faulting in a new activation per step: one calibration batch of mobilenet_v2 at
        4x3x224x224, 75 -> 66 ms (docs/performance.md, "Fused activations in place").  Only
        when nothing else can hold ``y``: autograd is not recording it (QAT training keeps the
        out-of-place ops), no torch.func transform wraps it (``vmap`` hides batch dims from its
        shape), it is a new tensor (not ``x``, not a view), and no forward hook or observer of the base
        layer saw it (a hook may keep the tensor it was shown).  The activation is called as a module
        where it has hooks of its own.
        """
        op = self.op
        return (
            not _recorded(y)
            and not _transformed(y)
            and y is not x
            and y._base is None
            and getattr(op, "activation_post_process", None) is None
            and not op._forward_hooks
            and not global_forward_hooks
        )

    def extra_repr(self) -> str:
        return "+".join(self.fused_from)


def _recorded(y: torch.Tensor) -> bool:
    """Does autograd record ``y`` (an in-place op on it could break a saved tensor)?"""
    return torch.is_grad_enabled() and y.requires_grad


def _transformed(t: torch.Tensor) -> bool:
    """Is ``t`` wrapped by a torch.func transform (``vmap``'s batch dims are not in its shape)?"""
    return is_functorch_wrapped_tensor(t)


def _adds_in_place(y: torch.Tensor, other: torch.Tensor) -> bool:
    """Is ``y.add_(other)`` the same tensor as ``y + other``: same shape and dtype out?"""
    return (
        isinstance(other, torch.Tensor)
        and not _recorded(other)
        and not _transformed(other)
        and torch.result_type(y, other) == y.dtype
        and torch.broadcast_shapes(y.shape, other.shape) == y.shape
    )


# exact classes only: a subclass may compute something else
_ACT_IN_PLACE = {nn.ReLU: F.relu_, nn.ReLU6: lambda y: F.hardtanh_(y, 0.0, 6.0)}


class FusedConv2d(FusedModule):
    """nn.Conv2d (+BN folded) (+add) (+relu|relu6)."""

    qc_op = "conv2d"
    op_type = nn.Conv2d


class FusedConvTranspose2d(FusedModule):
    """nn.ConvTranspose2d (+BN folded) (+relu)."""

    qc_op = "conv_transpose2d"
    op_type = nn.ConvTranspose2d


class FusedLinear(FusedModule):
    """nn.Linear (+BatchNorm1d folded) (+relu)."""

    qc_op = "linear"
    op_type = nn.Linear


_FUSED_FOR = ((nn.ConvTranspose2d, FusedConvTranspose2d), (nn.Conv2d, FusedConv2d), (nn.Linear, FusedLinear))


def _act_op(act: nn.Module) -> str:
    return "relu6" if isinstance(act, nn.ReLU6) else "relu"


def _bn_op(bn: nn.Module) -> str:
    return "batch_norm1d" if isinstance(bn, nn.BatchNorm1d) else "batch_norm"


def _shallow_param_copy(module: nn.Module) -> nn.Module:
    """A new module object of the same class and settings, sharing its parameters
    (no weight copy; tied weights stay tied)."""
    memo = {id(p): p for p in module.parameters(recurse=False)}
    return copy.deepcopy(module, memo)


def fold_bn(base: _BaseModule, bn: nn.Module) -> _BaseModule:
    """A new ``base`` layer computing ``bn(base(x))`` with the BN's running statistics.

    BN is folded with eval semantics whatever its training flag, because the
    deployed model runs BN in eval mode.  ``base`` and ``bn`` are not modified;
    the result always has a bias.  Scaling is per output channel: dim 0 of a
    conv / linear weight, dim 1 (per group) of a conv-transpose weight, whose
    layout is ``(in, out/groups, kh, kw)``.
    """
    if not isinstance(bn, _BN_TYPES):
        raise TypeError(f"fold_bn: expected nn.BatchNorm1d/2d, got {type(bn).__name__}")
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("fold_bn: the BatchNorm has no running statistics (track_running_stats=False)")
    weight = base.weight
    if isinstance(base, nn.ConvTranspose2d):
        out_features = weight.shape[1] * base.groups
    elif isinstance(base, (nn.Conv2d, nn.Linear)):
        out_features = weight.shape[0]
    else:
        raise TypeError(f"fold_bn: expected nn.Conv2d, nn.ConvTranspose2d or nn.Linear, got {type(base).__name__}")
    if bn.num_features != out_features:
        raise ValueError(f"fold_bn: BatchNorm has {bn.num_features} features, the layer has {out_features} outputs")

    with torch.no_grad():
        f64 = torch.float64
        mean, var = bn.running_mean.to(f64), bn.running_var.to(f64)
        gamma = bn.weight.to(f64) if bn.weight is not None else torch.ones_like(mean)
        beta = bn.bias.to(f64) if bn.bias is not None else torch.zeros_like(mean)
        scale = gamma / torch.sqrt(var + bn.eps)
        bias = base.bias.to(f64) if base.bias is not None else torch.zeros_like(mean)
        new_bias = (bias - mean) * scale + beta
        # the per-channel vectors are exact in float64; the weight (large) is scaled in its own
        # dtype: one rounding per element, and no float64 copy of the whole weight
        scale = scale.to(weight.dtype)
        w = weight
        if isinstance(base, nn.ConvTranspose2d):
            g = base.groups
            grouped = w.reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
            new_w = (grouped * scale.reshape(g, 1, w.shape[1], *([1] * (w.dim() - 2)))).reshape(w.shape)
        else:
            new_w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))

    fused = _shallow_param_copy(base)
    fused.weight = nn.Parameter(new_w.to(weight.dtype), requires_grad=weight.requires_grad)
    bias_grad = base.bias.requires_grad if base.bias is not None else weight.requires_grad
    fused.bias = nn.Parameter(new_bias.to(weight.dtype), requires_grad=bias_grad)
    return fused


def build_fused(
    base: _BaseModule,
    *,
    bn: Optional[nn.Module] = None,
    act: Optional[str] = None,
    with_add: bool = False,
) -> FusedModule:
    """The fused module for ``base`` (+``bn``) (+add) (+``act`` = "relu" | "relu6").

    ``base`` and ``bn`` are left untouched; without a BN the fused module's layer
    shares ``base``'s parameters.
    """
    for base_type, fused_type in _FUSED_FOR:
        if isinstance(base, base_type):
            break
    else:
        raise TypeError(f"build_fused: no fused module for {type(base).__name__}")
    op = fold_bn(base, bn) if bn is not None else _shallow_param_copy(base)
    if act is None:
        act_module = None
    elif act == "relu":
        act_module = nn.ReLU()
    elif act == "relu6":
        act_module = nn.ReLU6()
    else:
        raise ValueError(f"build_fused: act must be None, 'relu' or 'relu6', got {act!r}")
    names = (fused_type.qc_op,) + ((_bn_op(bn),) if bn is not None else ())
    names += ("add",) if with_add else ()
    names += (act,) if act is not None else ()
    return fused_type(op, act_module, with_add, names)


# ---------------------------------------------------------------------------- four-sided zero padding
# A zero F.pad folded into the conv / average pool after it (passes/rewrite.py) may pad each side by
# another amount. The layer then holds ``padding = (top, left, bottom, right)``
# (fixed_point.pads4), which every later stage reads; torch's layers pad both sides alike, so:
# * nn.Conv2d keeps its class, with ``padding_mode="constant"``: torch's own ``_conv_forward`` then
#   zero-pads by ``_reversed_padding_repeated_twice`` (left, right, top, bottom) before a conv with
#   padding 0, in the float layer, its fused copies and its QAT layer alike;
# * nn.AvgPool2d becomes a :class:`PaddedAvgPool2d`.

ZERO_PADDING_MODES = ("zeros", "constant")  # conv padding modes that pad with zeros


class PaddedAvgPool2d(nn.AvgPool2d):
    """nn.AvgPool2d counting the padding, with four-sided zero ``padding = (t, l, b, r)``:
    ``avg_pool2d(F.pad(x, (l, r, t, b)))``, the same float ops as the graph it replaces."""

    qc_leaf = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, l, b, r = self.padding
        return F.avg_pool2d(F.pad(x, (l, r, t, b)), self.kernel_size, self.stride, 0, self.ceil_mode, True,
                            self.divisor_override)


def with_zero_padding(layer: nn.Module, padding) -> nn.Module:
    """A copy of ``layer`` (an nn.Conv2d with zero padding, or an nn.AvgPool2d counting its padding;
    parameters shared) that zero-pads by ``padding`` (a pair or ``(t, l, b, r)``)."""
    t, l, b, r = pads4(padding)
    symmetric = (t, l) == (b, r)
    if isinstance(layer, nn.AvgPool2d):
        cls = nn.AvgPool2d if symmetric else PaddedAvgPool2d
        return cls(layer.kernel_size, layer.stride, (t, l) if symmetric else (t, l, b, r), layer.ceil_mode,
                   True, layer.divisor_override)
    if not isinstance(layer, nn.Conv2d) or layer.padding_mode not in ZERO_PADDING_MODES:
        raise TypeError(f"with_zero_padding: expected a zero-padded nn.Conv2d or an nn.AvgPool2d, got {layer!r}")
    new = _shallow_param_copy(layer)
    new.padding = (t, l) if symmetric else (t, l, b, r)
    new.padding_mode = "zeros" if symmetric else "constant"
    new._reversed_padding_repeated_twice = (l, r, t, b)
    return new
