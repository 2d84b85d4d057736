"""Observed / fake-quantized versions of the BPU layers that carry weights.

A prepared model swaps each BPU conv, conv-transpose, linear and fused layer
for the class here of the same name, which fake-quantizes its weight with
``weight_fake_quant`` and its output with ``activation_post_process`` (both
children, so ``print(model)`` shows where they sit, as the hybrid-QAT guide
does). Either may be None: no weight quantization / a high-precision output.
Parameters are shared with the float layer, not copied.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.nn import fused


class _Observed:
    """Mixin: the two quantization points of a layer and how to build one from a float layer."""

    weight_fake_quant: Optional[nn.Module]
    activation_post_process: Optional[nn.Module]

    @classmethod
    def from_float(
        cls,
        module: nn.Module,
        weight_fake_quant: Optional[nn.Module],
        activation_post_process: Optional[nn.Module],
    ) -> nn.Module:
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)
        # own containers: adding children to the new layer must not touch the float one
        new._parameters = dict(module._parameters)
        new._buffers = dict(module._buffers)
        new._modules = dict(module._modules)
        new.weight_fake_quant = weight_fake_quant
        new.activation_post_process = activation_post_process
        return new

    def _qweight(self) -> torch.Tensor:
        w = self.weight
        return self.weight_fake_quant(w) if self.weight_fake_quant is not None else w

    def _qout(self, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(y) if self.activation_post_process is not None else y


class Conv2d(_Observed, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._qout(self._conv_forward(x, self._qweight(), self.bias))


class ConvTranspose2d(_Observed, nn.ConvTranspose2d):
    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        output_padding = self._output_padding(
            x, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation
        )
        y = F.conv_transpose2d(
            x, self._qweight(), self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation
        )
        return self._qout(y)


class Linear(_Observed, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._qout(F.linear(x, self._qweight(), self.bias))


class _ObservedFused(_Observed):
    """Fused layers: the weight is fake-quantized inside ``op``; the output after the activation."""

    def forward(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._qout(super().forward(x, other))

    def _qweight(self) -> torch.Tensor:  # the inner op does it
        raise NotImplementedError


class FusedConv2d(_ObservedFused, fused.FusedConv2d):
    pass


class FusedConvTranspose2d(_ObservedFused, fused.FusedConvTranspose2d):
    pass


class FusedLinear(_ObservedFused, fused.FusedLinear):
    pass


# float class -> observed class; the fused ones also swap their inner op
OBSERVED_CLASS: dict[type, type] = {
    nn.Conv2d: Conv2d,
    nn.ConvTranspose2d: ConvTranspose2d,
    nn.Linear: Linear,
    fused.FusedConv2d: FusedConv2d,
    fused.FusedConvTranspose2d: FusedConvTranspose2d,
    fused.FusedLinear: FusedLinear,
}
FLOAT_CLASS: dict[type, type] = {v: k for k, v in OBSERVED_CLASS.items()}


def observe_layer(
    module: nn.Module, weight_fake_quant: Optional[nn.Module], activation_post_process: Optional[nn.Module]
) -> nn.Module:
    """The observed version of a float (or already observed) weight layer."""
    base_cls = FLOAT_CLASS.get(type(module), type(module))
    cls = OBSERVED_CLASS[base_cls]
    if isinstance(module, fused.FusedModule):
        op = module.op
        op_float = FLOAT_CLASS.get(type(op), type(op))
        inner = OBSERVED_CLASS[op_float].from_float(op, weight_fake_quant, None)
        new = cls.from_float(module, None, activation_post_process)
        new.op = inner
        return new
    return cls.from_float(module, weight_fake_quant, activation_post_process)


def has_weight_layer(module: nn.Module) -> bool:
    return type(module) in OBSERVED_CLASS or type(module) in FLOAT_CLASS
