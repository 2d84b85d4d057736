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
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qcompiler.quantization.fixed_point import bias_codes, quantize, symmetric_scale
from qcompiler.quantization.observer import MinMaxObserver, MovingAverageMinMaxObserver


def output_channel_scales(layer: nn.Module, weight_scales: torch.Tensor) -> torch.Tensor:
    """One weight scale per output channel. A grouped transposed conv quantizes its weight
    ``(in, out/groups, kh, kw)`` along dim 1, so its out/groups scales repeat for every group."""
    groups = getattr(layer, "groups", 1)
    if isinstance(layer, nn.ConvTranspose2d) and groups > 1 and weight_scales.numel() > 1:
        return weight_scales.reshape(-1).repeat(groups)
    return weight_scales


def _fake_quantizing(fq) -> bool:
    """True for a FakeQuantize that currently fake-quantizes with a known scale."""
    return isinstance(fq, FakeQuantize) and bool(fq.fake_quant_enabled[0]) and getattr(fq, "_has_qparams", False)


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

    def _qweight(self, like: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = self.weight_fake_quant(w) if self.weight_fake_quant is not None else w
        return w.to(like.dtype)  # float64 while an evaluated fake-quant model carries exact values

    def _qbias(self) -> Optional[torch.Tensor]:
        """The bias on the int32 grid ``s_in * s_w`` the BPU adds it on, when both scales are known.

        ``s_in`` comes from the quantizer of the layer's input (``_qc_input_quantizer``, set by
        the insert_observers pass); without fake quant (calibration) the bias stays float.
        """
        b, wfq = self.bias, self.weight_fake_quant
        src = self.__dict__.get("_qc_input_quantizer")
        if b is None or not _fake_quantizing(wfq) or not _fake_quantizing(src):
            return b
        w_scale = output_channel_scales(self, wfq.scale)
        if not self.training:  # exact: the grid s_in * s_w as convert computes it (float64)
            scale = src.scale.double() * w_scale.double()
            return bias_codes(b.double(), scale) * scale
        scale = src.scale * w_scale
        on_grid = bias_codes(b, scale) * scale
        return b + (on_grid - b).detach()  # straight-through gradient

    def _qbias_like(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        b = self._qbias()
        return None if b is None else b.to(like.dtype)

    def _qout(self, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(y) if self.activation_post_process is not None else y


class Conv2d(_Observed, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._qout(self._conv_forward(x, self._qweight(x), self._qbias_like(x)))


class ConvTranspose2d(_Observed, nn.ConvTranspose2d):
    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        output_padding = self._output_padding(
            x, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation
        )
        y = F.conv_transpose2d(
            x, self._qweight(x), self._qbias_like(x), self.stride, self.padding, output_padding, self.groups,
            self.dilation
        )
        return self._qout(y)


class Linear(_Observed, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._qout(F.linear(x, self._qweight(x), self._qbias_like(x)))


class _ObservedFused(_Observed):
    """Fused layers: the weight is fake-quantized inside ``op``; the output after the activation."""

    def forward(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._qout(super().forward(x, other))

    def _qweight(self, like: torch.Tensor) -> torch.Tensor:  # the inner op does it
        raise NotImplementedError


class FusedConv2d(_ObservedFused, fused.FusedConv2d):
    pass


class FusedConvTranspose2d(_ObservedFused, fused.FusedConvTranspose2d):
    pass


class FusedLinear(_ObservedFused, fused.FusedLinear):
    pass


class PReLU(nn.PReLU):
    """nn.PReLU whose slope follows the input's dtype (float64 in an evaluated fake-quant model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight.to(x.dtype))


def prelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.prelu whose slope follows the input's dtype: the functional form of a BPU prelu in a
    prepared model (F.prelu refuses a float32 slope on the float64 values of an evaluated
    fake-quant model)."""
    return F.prelu(x, weight.to(x.dtype))


def bn_affine(bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` in float64 with ``bn(x) = a[c] * x + b[c]`` (running statistics, eval semantics).

    The one place both the fake-quant model and convert take a standalone BN's affine from.
    """
    with torch.no_grad():
        mean, var = bn.running_mean.double(), bn.running_var.double()
        gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(mean)
        beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(mean)
        a = gamma / torch.sqrt(var + bn.eps)
        return a, beta - mean * a


def bn_weight(a: torch.Tensor, dtype: str = "qint8") -> tuple[torch.Tensor, torch.Tensor]:
    """A BN factor as per-channel weights: scale ``|a_c| / qmax`` (float32) and the integer
    ``round(a_c / scale)`` (= +-qmax), so ``q * scale`` is ``a_c`` up to the scale's rounding."""
    scale = symmetric_scale(a.abs(), dtype)
    return quantize(a, scale, dtype, axis=0), scale


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d (unfused, on the BPU) following the input's dtype.

    Evaluated with fake quant on (its input quantizer fake-quantizes), it computes what the
    BPU computes, a depthwise 1x1 layer: ``x * (q_w * s_w) + b`` with the factor as
    :func:`bn_weight` and the bias on the grid ``s_in * s_w`` (as ``_Observed._qbias``), in
    float64. Otherwise (training, calibration) it is a plain BN.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.__dict__.get("_qc_input_quantizer")
        if not self.training and self.running_mean is not None and _fake_quantizing(src):
            a, b = bn_affine(self)
            q, s_w = bn_weight(a)
            grid = src.scale.double() * s_w.double()
            b = bias_codes(b, grid) * grid
            shape = (1, -1) + (1,) * (x.dim() - 2)
            w = q.double() * s_w.double()
            return (x.double() * w.reshape(shape) + b.reshape(shape)).to(x.dtype)
        if self.training or self.running_mean is None or x.dtype == self.running_mean.dtype:
            return super().forward(x)
        cast = [None if t is None else t.to(x.dtype) for t in (self.running_mean, self.running_var, self.weight, self.bias)]
        return F.batch_norm(x, cast[0], cast[1], cast[2], cast[3], False, 0.0, self.eps)


# BPU layers with parameters but no quantizers of their own: swapped so they follow the input dtype
DTYPE_FOLLOWING: dict[type, type] = {nn.PReLU: PReLU, nn.BatchNorm2d: BatchNorm2d}


def follow_input_dtype(module: nn.Module) -> nn.Module:
    """The same layer (shared parameters) computing in its input's dtype."""
    cls = DTYPE_FOLLOWING.get(type(module))
    if cls is None:
        return module
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new._parameters, new._buffers, new._modules = dict(module._parameters), dict(module._buffers), dict(module._modules)
    return new


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


def constant_quantizer(kind: str, dtype: str) -> nn.Module:
    """The quantizer of a constant tensor operand (a buffer or parameter a BPU add/sub/mul reads):
    per tensor and symmetric like a weight (scale max|c| / qmax), a calibration observer or a
    fake quant by ``kind`` ("calibration" / "qat"). Per tensor because the BPU adds or multiplies
    the constant with one multiplier. In QAT the range is the current value's
    (``averaging_constant=1``): a constant is known exactly at every step, and a lagging average
    would clip a learnable constant that starts at zero, whose STE gradient is then zero for good."""
    if kind == "calibration":
        return CalibFakeQuantize(MinMaxObserver(dtype=dtype))
    return FakeQuantize(MovingAverageMinMaxObserver(averaging_constant=1.0, dtype=dtype), dtype)


def set_input_quantizer(layer: nn.Module, quantizer: Optional[nn.Module]) -> None:
    """Tell an observed layer which quantizer gives its input its scale (for the bias grid).

    Kept out of ``_modules`` on purpose: it is a reference, not a child.
    """
    base = layer.op if isinstance(layer, fused.FusedModule) else layer
    object.__setattr__(base, "_qc_input_quantizer", quantizer)


def needs_input_quantizer(module: nn.Module) -> bool:
    """Layers whose bias is put on the grid ``s_in * s_w``: weight layers and the BPU BatchNorm2d."""
    return has_weight_layer(module) or isinstance(module, BatchNorm2d)


def has_weight_layer(module: nn.Module) -> bool:
    return type(module) in OBSERVED_CLASS or type(module) in FLOAT_CLASS
