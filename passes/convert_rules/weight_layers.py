"""Weight-layer rules: conv2d, conv_transpose2d and linear (plain or fused with BN, an add and a
ReLU / ReLU6) become a ``QuantizedWeightLayer`` with integer weights; a standalone BatchNorm2d
becomes one too, as a depthwise 1x1 conv."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import CalibrationError, UnsupportedOpError
from qcompiler.nn import fused
from qcompiler.nn import quantized as qnn
from qcompiler.nn.qat import bn_affine, bn_weight, has_weight_layer, output_channel_scales
from qcompiler.passes.convert_rules.context import ConvertContext, qparams_of
from qcompiler.passes.convert_rules.registry import converts
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fake_quantize import FakeQuantize, observe_final_weight


def _weight_module(module: nn.Module):
    """(base layer with weight_fake_quant, activation name, with_add) of an observed weight layer."""
    if isinstance(module, fused.FusedModule):
        act = None if module.act is None else ("relu6" if isinstance(module.act, nn.ReLU6) else "relu")
        return module.op, act, module.with_add
    return module, None, False


def _weight_params(base: nn.Module, where: str):
    """(integer weights, per-output-channel scales, output-channel axis) of a layer's final weight."""
    wfq = getattr(base, "weight_fake_quant", None)
    axis = 1 if isinstance(base, nn.ConvTranspose2d) else 0
    w = base.weight.detach()
    if wfq is None:
        raise CalibrationError(f"{where}: weight has no fake quant; prepare the model first")
    if isinstance(wfq, FakeQuantize):
        scale = wfq.scale.detach().clone()
    else:
        observe_final_weight(wfq, w)
        scale = wfq.calculate_qparams()[0]
    dtype = wfq.dtype
    q = fp.quantize(w, scale, dtype, axis=axis if scale.numel() > 1 else None)
    return q, output_channel_scales(base, scale.reshape(-1)), axis


def _geometry(base: nn.Module, node: fx.Node) -> dict:
    """Stride, padding, dilation and groups (and output padding) of a conv; nothing for a linear."""
    if isinstance(base, nn.Linear):
        return {}
    mode = getattr(base, "padding_mode", "zeros")
    if mode not in fused.ZERO_PADDING_MODES and any(base._reversed_padding_repeated_twice):
        # placement keeps these off the BPU (constraints.zero_padding); a forced one must not zero-pad silently
        raise UnsupportedOpError(f"node '{node.name}': padding_mode='{mode}' has no fixed-point lowering (the BPU "
                                 f"pads with zeros); run this conv on CPU (hybrid_dict)")
    padding = base.padding if isinstance(base, nn.ConvTranspose2d) else tuple(fp.padding_attr(base.padding))
    g = {"stride": base.stride, "padding": padding, "dilation": base.dilation, "groups": base.groups}
    if isinstance(base, nn.ConvTranspose2d):
        g["output_padding"] = base.output_padding
    return g


@converts("conv2d", "conv_transpose2d", "linear")
def weight_layer(ctx: ConvertContext) -> qnn.QuantizedWeightLayer:
    """An observed layer module: its output grid is its own quantizer's (none: a high-precision
    output); a fused add's operand must be a quantized BPU value."""
    if ctx.module is None or not has_weight_layer(ctx.module):
        raise UnsupportedOpError(f"{ctx.where}: {ctx.op} has a fixed-point lowering only as an nn.Conv2d, "
                                 f"nn.ConvTranspose2d or nn.Linear module; run this call on CPU (hybrid_dict)")
    qin = ctx.input()
    base, act, with_add = _weight_module(ctx.module)
    q_w, w_scale, _ = _weight_params(base, ctx.where)
    apq = getattr(ctx.module, "activation_post_process", None)
    out = None if apq is None else qparams_of(apq, f"{ctx.where} output")
    other_scale = None
    if with_add:
        other_scale = ctx.scale_of(ctx.operand(1))
        if other_scale is None:
            raise UnsupportedOpError(f"{ctx.where}: the add operand is not a quantized BPU value")
    bias = base.bias.detach() if base.bias is not None else None
    return qnn.QuantizedWeightLayer(
        ctx.op, q_w, w_scale, bias, qin.scale, None if out is None else out.scale,
        "qint8" if out is None else out.dtype, _geometry(base, ctx.node), act, other_scale, name=ctx.node.name,
    )


@converts("batch_norm")
def batch_norm(ctx: ConvertContext) -> qnn.QuantizedWeightLayer:
    """A standalone BatchNorm2d as a depthwise 1x1 conv: per-channel int8 weights ``+-127`` at
    scale ``|a_c| / 127`` (``qat.bn_weight``) and an int32 bias, like the fake-quant model."""
    qin, module = ctx.input(), ctx.module
    if not isinstance(module, nn.BatchNorm2d) or module.running_mean is None:
        raise UnsupportedOpError(f"{ctx.where}: only an nn.BatchNorm2d with running statistics has a fixed-point "
                                 f"lowering (a per-channel affine); run this one on CPU (hybrid_dict)")
    a, b = bn_affine(module)
    q, scale = bn_weight(a)
    c = q.numel()
    geometry = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": c}
    return qnn.QuantizedWeightLayer("conv2d", q.reshape(c, 1, 1, 1), scale, b, qin.scale, ctx.out.scale,
                                    ctx.out.dtype, geometry, name=ctx.node.name)
