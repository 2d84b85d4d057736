"""Every canonical op, defined once: name, group tags, argument signature and spellings.

A row names the op (a constant of :mod:`.names` for the ops the BPU side speaks of), the
:class:`~.opdef.Tag` groups it belongs to, the :class:`~.opdef.Signature` its arguments
bind by (torch's parameter names after the tensor inputs, with their defaults; ``forms``
for a spelling whose signature differs) and its spellings: module classes, call_function
targets, method names. The spelling tables (:data:`~.registry.MODULE_OPS` ...) are derived
from these rows, and a spelling given twice is an error at import.

Tags that change what the batch split proves (``ELEMENTWISE``, ``SPATIAL``, ``ALONG_DIM``,
``REDUCTION``, ``CPU_EXACT``) are given only to ops checked for it (qcompiler.ir.batch_dim):
an op without them stops the split. A signature is written where a pass reads the op's
arguments; ``bind`` refuses the others rather than guess.

Clamps (``torch.clamp``, ``F.hardtanh``, ``nn.Hardtanh`` ...) are spellings of ``clamp``,
canonicalized by their bounds to ``relu`` / ``relu6`` (qcompiler.ir.ops.canonical). Ops
without spellings are the names converted modules carry (``requantize``, ``constant``,
``global_avg_pool``).
"""

from __future__ import annotations

import builtins
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.compat import torch_ao as ao
from qcompiler.ir.ops.names import (
    ADAPTIVE_AVG_POOL2D, ADD, AVG_POOL2D, BATCH_NORM, CAT, CONSTANT, CONV2D, CONV_TRANSPOSE2D, DEQUANT, DIV,
    DROPOUT, EXP, FLATTEN, GETITEM, GLOBAL_AVG_POOL, IDENTITY, INTERPOLATE, LEAKY_RELU, LINEAR, MATMUL,
    MAX_POOL2D, MEAN, MUL, PERMUTE, PRELU, QUANT, RELU, RELU6, REQUANTIZE, RESHAPE, SIGMOID, SILU, SUB, TANH,
    TRANSPOSE,
)
from qcompiler.ir.ops.opdef import OpDef, Tag, define, sig
from qcompiler.ir.setitem import setitem
from qcompiler.nn.functional import masked_softmax as _masked_softmax

_EW, _SPATIAL, _ALONG, _REDUCE = Tag.ELEMENTWISE, Tag.SPATIAL, Tag.ALONG_DIM, Tag.REDUCTION
_EXACT, _TRAIN, _LAYOUT = Tag.CPU_EXACT, Tag.TRAINING, Tag.LAYOUT

_UNARY = sig()
_BINARY = sig(inputs=("input", "other"))
_CONV = sig("weight", ("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))
_CONV_T = sig("weight", ("bias", None), ("stride", 1), ("padding", 0), ("output_padding", 0), ("groups", 1),
              ("dilation", 1))
_BATCH_NORM = sig("running_mean", "running_var", ("weight", None), ("bias", None), ("training", False),
                  ("momentum", 0.1), ("eps", 1e-5))
_MAX_POOL = sig("kernel_size", ("stride", None), ("padding", 0), ("dilation", 1), ("ceil_mode", False),
                ("return_indices", False))
_AVG_POOL = sig("kernel_size", ("stride", None), ("padding", 0), ("ceil_mode", False), ("count_include_pad", True),
                ("divisor_override", None))
_ADAPTIVE_POOL = sig("output_size")
_SOFTMAX = sig(("dim", None), ("_stacklevel", 3), ("dtype", None))  # F.softmax; torch.softmax has no _stacklevel
_SOFTMAX_TORCH = sig("dim", ("dtype", None))
_REDUCE_DIM = sig(("dim", None), ("keepdim", False), "*", ("dtype", None))  # sum, mean, prod


def _aten(*overloads: str) -> tuple:
    """ATen overloads by name (``"add.Tensor"`` -> ``torch.ops.aten.add.Tensor``): an op's spellings in
    graphs captured by torch.export."""
    out = []
    for name in overloads:
        packet, _, overload = name.partition(".")
        out.append(getattr(getattr(torch.ops.aten, packet), overload or "default"))
    return tuple(out)


_A = torch.ops.aten
# ATen schemas whose arguments differ from the op's signature (order, names, a backend's flags): the
# forms of those overloads. A value equal to the form's default is the op's default (max_pool2d's stride=[])
_BATCH_NORM_ATEN = sig("weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                       ("cudnn_enabled", True))
_LAYER_NORM_ATEN = sig("normalized_shape", ("weight", None), ("bias", None), ("eps", 1e-5), ("cudnn_enable", True))
_GROUP_NORM_ATEN = sig("num_groups", ("weight", None), ("bias", None), ("eps", 1e-5), ("cudnn_enabled", True))
_EMBEDDING_ATEN = sig(("padding_idx", -1), ("scale_grad_by_freq", False), ("sparse", False), inputs=("weight", "input"))
_MAX_POOL_ATEN = sig("kernel_size", ("stride", []), ("padding", 0), ("dilation", 1), ("ceil_mode", False))
_AVG_POOL_ATEN = sig("kernel_size", ("stride", []), ("padding", 0), ("ceil_mode", False), ("count_include_pad", True),
                     ("divisor_override", None))

_DROPOUT = sig(("p", 0.5), ("training", True), ("inplace", False))  # F.dropout, F.dropout1d/2d/3d
_ALPHA_DROPOUT = sig(("p", 0.5), ("training", False), ("inplace", False))  # F.alpha_dropout: training defaults False
# torch.dropout(input, p, train) and its kin
_DROPOUT_TORCH = (torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout)
_SPLIT_BY = {  # the split spellings: how many or which pieces, then dim
    torch.split: sig("split_size_or_sections", ("dim", 0), inputs=("tensor",)),
    "split": sig("split_size", ("dim", 0)),
    torch.chunk: sig("chunks", ("dim", 0)), "chunk": sig("chunks", ("dim", 0)),
    torch.unsafe_chunk: sig("chunks", ("dim", 0)), "unsafe_chunk": sig("chunks", ("dim", 0)),
    torch.split_with_sizes: sig("split_sizes", ("dim", 0)), "split_with_sizes": sig("split_sizes", ("dim", 0)),
    torch.split_with_sizes_copy: sig("split_sizes", ("dim", 0)),
    torch.unsafe_split: sig("split_size", ("dim", 0)), "unsafe_split": sig("split_size", ("dim", 0)),
    torch.tensor_split: sig("indices_or_sections", ("dim", 0)),
    "tensor_split": sig("indices_or_sections", ("dim", 0)),
}

CATALOGUE: tuple[OpDef, ...] = (
    # --- convolution, linear, normalization: BPU ops and their CPU relatives
    define("conv1d", _SPATIAL,
           aten=_aten("conv1d.default"), signature=_CONV, modules=(nn.Conv1d,), functions=(torch.conv1d,)),
    define(CONV2D, _SPATIAL,
           aten=_aten("conv2d.default", "conv2d.padding"),
           signature=_CONV, modules=(nn.Conv2d,), functions=(F.conv2d,)),
    define("conv3d", _SPATIAL,
           aten=_aten("conv3d.default"), signature=_CONV, modules=(nn.Conv3d,), functions=(torch.conv3d,)),
    define("conv_transpose1d", _SPATIAL, signature=_CONV_T, modules=(nn.ConvTranspose1d,),
           functions=(torch.conv_transpose1d,)),
    define(CONV_TRANSPOSE2D, _SPATIAL,
           aten=_aten("conv_transpose2d.input"), signature=_CONV_T, modules=(nn.ConvTranspose2d,),
           functions=(F.conv_transpose2d,)),
    define("conv_transpose3d", _SPATIAL, signature=_CONV_T, modules=(nn.ConvTranspose3d,),
           functions=(torch.conv_transpose3d,)),
    define(LINEAR,
           aten=_aten("linear.default"),
           signature=sig("weight", ("bias", None)), modules=(nn.Linear,), functions=(F.linear,)),
    define("batch_norm1d", _SPATIAL, _TRAIN, signature=_BATCH_NORM, modules=(nn.BatchNorm1d,)),
    define(BATCH_NORM, _SPATIAL, _TRAIN,
           aten=_aten("batch_norm.default"), signature=_BATCH_NORM, modules=(nn.BatchNorm2d,),
           functions=(F.batch_norm,),
           forms={_A.batch_norm.default: _BATCH_NORM_ATEN}),
    define("batch_norm3d", _SPATIAL, _TRAIN, signature=_BATCH_NORM, modules=(nn.BatchNorm3d,)),
    define("layer_norm",
           aten=_aten("layer_norm.default"),
           signature=sig("normalized_shape", ("weight", None), ("bias", None), ("eps", 1e-5)),
           modules=(nn.LayerNorm,), functions=(F.layer_norm,),
           forms={_A.layer_norm.default: _LAYER_NORM_ATEN}),
    define("rms_norm", signature=sig("normalized_shape", ("weight", None), ("eps", None)), functions=(F.rms_norm,)),
    define("group_norm", _SPATIAL,
           aten=_aten("group_norm.default"),
           signature=sig("num_groups", ("weight", None), ("bias", None), ("eps", 1e-5)),
           modules=(nn.GroupNorm,), functions=(F.group_norm, torch.group_norm),
           forms={_A.group_norm.default: _GROUP_NORM_ATEN}),
    define("instance_norm", _SPATIAL, modules=(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
           functions=(F.instance_norm,)),
    define("local_response_norm", _SPATIAL, modules=(nn.LocalResponseNorm,), functions=(F.local_response_norm,)),
    define("native_layer_norm", functions=(torch.native_layer_norm,)),
    define("normalize", _ALONG, signature=sig(("p", 2.0), ("dim", 1), ("eps", 1e-12), ("out", None)),
           functions=(F.normalize,)),
    # --- activations
    define(RELU, _EW, _EXACT,
           aten=_aten("relu.default"),
           signature=sig(("inplace", False)), modules=(nn.ReLU,), functions=(F.relu, torch.relu),
           methods=("relu",), forms={torch.relu: _UNARY, "relu": _UNARY}),
    define(RELU6, _EW, _EXACT, signature=sig(("inplace", False)), modules=(nn.ReLU6,), functions=(F.relu6,)),
    define("clamp", _EW, _EXACT,
           aten=_aten("clamp.default", "clamp_min.default", "clamp_max.default", "hardtanh.default"),
           signature=sig(("min", None), ("max", None)),
           modules=(nn.Hardtanh,), functions=(torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max, F.hardtanh),
           methods=("clamp", "clip", "clamp_min", "clamp_max"),
           forms={torch.clamp_min: sig(("min", None)), "clamp_min": sig(("min", None)),
                  torch.clamp_max: sig(("max", None)), "clamp_max": sig(("max", None)),
                  F.hardtanh: sig(("min_val", -1.0), ("max_val", 1.0), ("inplace", False)),
                  nn.Hardtanh: sig(("min_val", -1.0), ("max_val", 1.0), ("inplace", False))}),
    define(LEAKY_RELU, _EW, _EXACT,
           aten=_aten("leaky_relu.default"), signature=sig(("negative_slope", 0.01), ("inplace", False)),
           modules=(nn.LeakyReLU,), functions=(F.leaky_relu,)),
    define(PRELU, _SPATIAL, _EXACT,
           aten=_aten("prelu.default"), signature=sig("weight"), modules=(nn.PReLU,), functions=(F.prelu,)),
    define("selu", _EW, aten=_aten("selu.default"), modules=(nn.SELU,), functions=(F.selu, torch.selu)),
    define("elu", _EW, signature=sig(("alpha", 1.0), ("inplace", False)), modules=(nn.ELU,), functions=(F.elu,)),
    define("gelu", _EW, aten=_aten("gelu.default"), signature=sig("*", ("approximate", "none")), modules=(nn.GELU,),
           functions=(F.gelu,)),
    define(SILU, _EW, aten=_aten("silu.default"), modules=(nn.SiLU,), functions=(F.silu,)),
    define(SIGMOID, _EW,
           aten=_aten("sigmoid.default"), signature=_UNARY, modules=(nn.Sigmoid,), functions=(torch.sigmoid, F.sigmoid),
           methods=("sigmoid",)),
    define(TANH, _EW,
           aten=_aten("tanh.default"),
           signature=_UNARY, modules=(nn.Tanh,), functions=(torch.tanh, F.tanh), methods=("tanh",)),
    define("hardsigmoid", _EW,
           aten=_aten("hardsigmoid.default"), modules=(nn.Hardsigmoid,), functions=(F.hardsigmoid,)),
    define("hardswish", _EW, aten=_aten("hardswish.default"), modules=(nn.Hardswish,), functions=(F.hardswish,)),
    define("softplus", _EW, modules=(nn.Softplus,), functions=(F.softplus,)),
    define("mish", _EW, signature=sig(("inplace", False)), modules=(nn.Mish,), functions=(F.mish,)),
    define("glu", modules=(nn.GLU,), functions=(F.glu,)),
    define("logsigmoid", _EW, modules=(nn.LogSigmoid,), functions=(F.logsigmoid,)),
    define("softsign", _EW, modules=(nn.Softsign,), functions=(F.softsign,)),
    define("celu", _EW, modules=(nn.CELU,), functions=(F.celu, torch.celu)),
    define("threshold", _EW, modules=(nn.Threshold,), functions=(F.threshold, torch.threshold)),
    define("tanhshrink", _EW, functions=(F.tanhshrink,)),
    define("softshrink", _EW, functions=(F.softshrink,)),
    define("hardshrink", _EW, functions=(F.hardshrink,)),  # (torch.hardshrink is the same function)
    # --- softmax and friends: along one dim
    define("softmax", _ALONG,
           aten=_aten("softmax.int"), signature=_SOFTMAX, modules=(nn.Softmax,), functions=(F.softmax, torch.softmax),
           methods=("softmax",), forms={_A.softmax.int: _SOFTMAX_TORCH, torch.softmax: _SOFTMAX_TORCH,
                                         "softmax": _SOFTMAX_TORCH}),
    define("log_softmax", _ALONG, aten=_aten("log_softmax.int"), signature=_SOFTMAX, modules=(nn.LogSoftmax,),
           functions=(F.log_softmax, torch.log_softmax), methods=("log_softmax",),
           forms={_A.log_softmax.int: _SOFTMAX_TORCH, torch.log_softmax: _SOFTMAX_TORCH,
                  "log_softmax": _SOFTMAX_TORCH}),
    define("softmin", _ALONG, signature=_SOFTMAX, modules=(nn.Softmin,), functions=(F.softmin,)),
    # masked softmax: softmax(masked_fill(x, mask, -inf), dim) fused (passes/masked_softmax.py)
    define("masked_softmax", signature=sig("dim", ("fill_mask_is_true", True), inputs=("input", "mask")),
           functions=(_masked_softmax,)),
    define("cumsum", _ALONG,
           aten=_aten("cumsum.default"), signature=sig("dim", "*", ("dtype", None)), functions=(torch.cumsum,),
           methods=("cumsum",)),
    define("flip", _ALONG, _EXACT,
           aten=_aten("flip.default"), signature=sig("*dims"), functions=(torch.flip,), methods=("flip",)),
    # --- pooling and resizing
    define(MAX_POOL2D, _SPATIAL, _EXACT,
           aten=_aten("max_pool2d.default"), signature=_MAX_POOL, modules=(nn.MaxPool2d,), functions=(F.max_pool2d,),
           forms={_A.max_pool2d.default: _MAX_POOL_ATEN}),
    define(AVG_POOL2D, _SPATIAL,
           aten=_aten("avg_pool2d.default"), signature=_AVG_POOL, modules=(nn.AvgPool2d,), functions=(F.avg_pool2d,),
           forms={_A.avg_pool2d.default: _AVG_POOL_ATEN}),
    define(ADAPTIVE_AVG_POOL2D, _SPATIAL,
           aten=_aten("adaptive_avg_pool2d.default"), signature=_ADAPTIVE_POOL, modules=(nn.AdaptiveAvgPool2d,),
           functions=(F.adaptive_avg_pool2d,)),
    define(GLOBAL_AVG_POOL, _SPATIAL),  # a converted mean / adaptive_avg_pool2d to 1x1
    define("max_pool1d", _SPATIAL, _EXACT, signature=_MAX_POOL, modules=(nn.MaxPool1d,), functions=(F.max_pool1d,)),
    define("max_pool3d", _SPATIAL, _EXACT, signature=_MAX_POOL, modules=(nn.MaxPool3d,),
           functions=(F.max_pool3d, torch.max_pool3d)),
    define("avg_pool1d", _SPATIAL, modules=(nn.AvgPool1d,), functions=(F.avg_pool1d,)),
    define("avg_pool3d", _SPATIAL, signature=_AVG_POOL, modules=(nn.AvgPool3d,), functions=(F.avg_pool3d,)),
    define("adaptive_avg_pool3d", _SPATIAL, signature=_ADAPTIVE_POOL, modules=(nn.AdaptiveAvgPool3d,),
           functions=(F.adaptive_avg_pool3d,)),
    define("adaptive_avg_pool1d", _SPATIAL, aten=_aten("adaptive_avg_pool1d.default"), signature=_ADAPTIVE_POOL, modules=(nn.AdaptiveAvgPool1d,),
           functions=(F.adaptive_avg_pool1d,)),
    define("adaptive_max_pool1d", _SPATIAL, _EXACT, signature=sig("output_size", ("return_indices", False)),
           modules=(nn.AdaptiveMaxPool1d,), functions=(F.adaptive_max_pool1d,)),
    define("adaptive_max_pool2d", _SPATIAL, _EXACT, signature=sig("output_size", ("return_indices", False)),
           modules=(nn.AdaptiveMaxPool2d,), functions=(F.adaptive_max_pool2d,)),
    define("max_pool1d_with_indices", functions=(F.max_pool1d_with_indices,)),
    define("max_pool2d_with_indices", functions=(F.max_pool2d_with_indices,)),
    define("max_pool3d_with_indices", functions=(F.max_pool3d_with_indices,)),
    define(INTERPOLATE, _SPATIAL,  # ATen's upsample_<mode>Nd: its arguments by qcompiler.ir.export_capture
           aten=_aten("upsample_nearest1d.vec", "upsample_nearest2d.vec", "upsample_nearest3d.vec",
                      "upsample_linear1d.vec", "upsample_bilinear2d.vec", "upsample_trilinear3d.vec",
                      "upsample_bicubic2d.vec"),
           signature=sig(("size", None), ("scale_factor", None), ("mode", "nearest"),
                                                ("align_corners", None), ("recompute_scale_factor", None),
                                                ("antialias", False)),
           modules=(nn.Upsample,), functions=(F.interpolate,)),
    define("pixel_shuffle", _SPATIAL, modules=(nn.PixelShuffle,), functions=(F.pixel_shuffle,)),
    define("pixel_unshuffle", _SPATIAL, modules=(nn.PixelUnshuffle,), functions=(F.pixel_unshuffle,)),
    # --- recurrent, embedding, attention: CPU only
    define("lstm", modules=(nn.LSTM,)),
    define("gru", modules=(nn.GRU,)),
    define("rnn", modules=(nn.RNN,)),
    define("lstm_cell", modules=(nn.LSTMCell,)),
    define("gru_cell", modules=(nn.GRUCell,)),
    define("rnn_cell", modules=(nn.RNNCell,)),
    define("embedding", aten=_aten("embedding.default"),
           signature=sig("weight", ("padding_idx", None), ("max_norm", None), ("norm_type", 2.0),
                         ("scale_grad_by_freq", False), ("sparse", False)),
           modules=(nn.Embedding,), functions=(F.embedding,),
           forms={_A.embedding.default: _EMBEDDING_ATEN}),
    define("embedding_bag", modules=(nn.EmbeddingBag,), functions=(F.embedding_bag,)),
    define("multihead_attention", modules=(nn.MultiheadAttention,)),
    # --- moving no data: identities, dropout, stubs and converted-graph ops
    define(IDENTITY, Tag.PASSTHROUGH, _EW, _EXACT,
           aten=_aten("clone.default", "contiguous.default", "alias.default", "detach.default"),
           modules=(nn.Identity,),
           functions=(torch.clone, torch.conj, torch.conj_physical, torch.resolve_conj, torch.resolve_neg,
                      torch.positive, torch.alias_copy, torch.detach),
           # detach: the same values (it only cuts autograd; a QAT graph keeps calling torch's own detach)
           methods=("contiguous", "clone", "conj", "resolve_conj", "resolve_neg", "detach")),
    define(DROPOUT, Tag.PASSTHROUGH, _EW, _TRAIN, _EXACT, aten=_aten("dropout.default"), signature=_DROPOUT,
           modules=(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout),
           functions=(F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                      *_DROPOUT_TORCH),
           forms={_A.dropout.default: sig("p", "training"), F.alpha_dropout: _ALPHA_DROPOUT,
                  F.feature_alpha_dropout: _ALPHA_DROPOUT, **{f: sig("p", "train") for f in _DROPOUT_TORCH}}),
    define(QUANT, _EW, _EXACT, modules=ao.QUANT_STUB_TYPES),
    define(DEQUANT, _EW, _EXACT, modules=ao.DEQUANT_STUB_TYPES),
    define(REQUANTIZE, _EW, _EXACT),  # a converted graph's change of scale
    define(CONSTANT, _EXACT),  # a converted graph's constant tensor
    define("float", _EW, _EXACT, signature=_UNARY, methods=("float",)),
    define("cast", _EW, _EXACT,  # ATen's to.*: as .to(dtype) (qcompiler.ir.export_capture)
           aten=_aten("to.dtype", "to.dtype_layout", "to.device", "_to_copy"), methods=("bool", "byte", "char", "double", "half", "int", "long", "short", "to",
                                          "type_as")),
    # --- element-wise arithmetic and comparisons
    define(ADD, _EW, _EXACT,
           aten=_aten("add.Tensor", "add.Scalar"), signature=sig("*", ("alpha", 1), inputs=("input", "other")),
           functions=(operator.add, torch.add), methods=("add",)),
    define(SUB, _EW, _EXACT,
           aten=_aten("sub.Tensor", "sub.Scalar"), signature=sig("*", ("alpha", 1), inputs=("input", "other")),
           functions=(operator.sub, torch.sub), methods=("sub",)),
    define("rsub", _EW, _EXACT,
           aten=_aten("rsub.Scalar", "rsub.Tensor"), functions=(torch.rsub,), methods=("__rsub__",)),
    define(MUL, _EW, _EXACT,
           aten=_aten("mul.Tensor", "mul.Scalar"),
           signature=_BINARY, functions=(operator.mul, torch.mul), methods=("mul",)),
    define(DIV, _EW, _EXACT,
           aten=_aten("div.Tensor", "div.Scalar", "div.Tensor_mode"),
           signature=sig("*", ("rounding_mode", None), inputs=("input", "other")),
           functions=(operator.truediv, torch.div, torch.true_divide), methods=("div", "true_divide"),
           forms={torch.true_divide: _BINARY, "true_divide": _BINARY}),
    define("rdiv", _EW, _EXACT, methods=("__rdiv__", "__rtruediv__")),
    define(MATMUL,
           aten=_aten("matmul.default", "bmm.default", "mm.default"),
           signature=_BINARY, functions=(operator.matmul, torch.matmul, torch.bmm, torch.mm),
           methods=("matmul", "mm"), forms={f: sig(inputs=("input", "mat2")) for f in (torch.bmm, torch.mm, "mm")}),
    define(EXP, _EW, aten=_aten("exp.default"), signature=_UNARY, functions=(torch.exp,), methods=("exp",)),
    define("erf", _EW, aten=_aten("erf.default"), signature=_UNARY, functions=(torch.erf,), methods=("erf",)),
    define("neg", _EW, _EXACT,
           aten=_aten("neg.default"), signature=_UNARY, functions=(operator.neg, torch.neg), methods=("neg",)),
    define("abs", _EW, _EXACT,
           aten=_aten("abs.default"), signature=_UNARY, functions=(torch.abs, operator.abs), methods=("abs",)),
    *(define(op, _EW, _EXACT, signature=_BINARY, aten=_aten(f"{op}.Tensor", f"{op}.Scalar"),
             functions=(getattr(operator, op), getattr(torch, op)), methods=(op,))
      for op in ("gt", "lt", "ge", "le", "eq", "ne")),
    define("where", _EW, _EXACT,
           aten=_aten("where.self", "where.ScalarOther", "where.ScalarSelf"),
           signature=sig(inputs=("condition", "input", "other")), functions=(torch.where,)),
    define("sqrt", _EW, aten=_aten("sqrt.default"), signature=_UNARY, functions=(torch.sqrt,), methods=("sqrt",)),
    define("rsqrt", _EW, aten=_aten("rsqrt.default"), signature=_UNARY, functions=(torch.rsqrt,), methods=("rsqrt",)),
    define("log", _EW, aten=_aten("log.default"), signature=_UNARY, functions=(torch.log,), methods=("log",)),
    define("log1p", functions=(torch.log1p,), methods=("log1p",)),
    define("sin", _EW, aten=_aten("sin.default"), functions=(torch.sin,), methods=("sin",)),
    define("cos", _EW, aten=_aten("cos.default"), functions=(torch.cos,), methods=("cos",)),
    define("tan", functions=(torch.tan,), methods=("tan",)),
    define("pow", _EW,
           aten=_aten("pow.Tensor_Scalar", "pow.Tensor_Tensor"), signature=sig(inputs=("input", "exponent")),
           functions=(torch.pow, operator.pow), methods=("pow",)),
    define("reciprocal", _EW, aten=_aten("reciprocal.default"), signature=_UNARY, functions=(torch.reciprocal,),
           methods=("reciprocal",)),
    define("floor", _EW, _EXACT, functions=(torch.floor,), methods=("floor",)),
    define("ceil", _EW, _EXACT, functions=(torch.ceil,), methods=("ceil",)),
    define("round", _EW, _EXACT, functions=(torch.round,), methods=("round",)),
    define("sign", _EW, _EXACT, functions=(torch.sign, torch.sgn), methods=("sign", "sgn")),
    define("minimum", _EW, _EXACT,
           aten=_aten("minimum.default"), signature=_BINARY, functions=(torch.minimum,), methods=("minimum",)),
    define("maximum", _EW, _EXACT,
           aten=_aten("maximum.default"), signature=_BINARY, functions=(torch.maximum,), methods=("maximum",)),
    define("asin", functions=(torch.asin,), methods=("asin",)),
    define("acos", functions=(torch.acos,), methods=("acos",)),
    define("atan", functions=(torch.atan,), methods=("atan",)),
    define("sinh", functions=(torch.sinh,), methods=("sinh",)),
    define("cosh", functions=(torch.cosh,), methods=("cosh",)),
    define("asinh", functions=(torch.asinh,), methods=("asinh",)),
    define("acosh", functions=(torch.acosh,), methods=("acosh",)),
    define("atanh", functions=(torch.atanh,), methods=("atanh",)),
    define("log2", functions=(torch.log2,), methods=("log2",)),
    define("log10", functions=(torch.log10,), methods=("log10",)),
    define("exp2", functions=(torch.exp2,), methods=("exp2",)),
    define("square", _EW, aten=_aten("square.default"), functions=(torch.square,), methods=("square",)),
    define("trunc", _EW, _EXACT, functions=(torch.trunc, torch.fix), methods=("trunc", "fix")),
    define("logical_not", _EW, _EXACT, functions=(torch.logical_not,), methods=("logical_not",)),
    define("logical_and", _EW, _EXACT, functions=(torch.logical_and,), methods=("logical_and",)),
    define("logical_or", _EW, _EXACT, functions=(torch.logical_or,), methods=("logical_or",)),
    define("logical_xor", _EW, _EXACT, functions=(torch.logical_xor,), methods=("logical_xor",)),
    define("isnan", functions=(torch.isnan,), methods=("isnan",)),
    define("isinf", functions=(torch.isinf,), methods=("isinf",)),
    define("isfinite", functions=(torch.isfinite,), methods=("isfinite",)),
    define("atan2", functions=(torch.atan2, torch.arctan2), methods=("atan2",)),
    define("fmod", functions=(torch.fmod,), methods=("fmod",)),
    define("remainder", functions=(torch.remainder,), methods=("remainder",)),
    define("floor_divide", functions=(torch.floor_divide,), methods=("floor_divide",)),
    define("rpow", methods=("__rpow__",)),
    define("rmatmul", methods=("__rmatmul__",)),
    define("rmod", methods=("__rmod__",)),
    define("lerp", functions=(torch.lerp,), methods=("lerp",)),
    define("logit", functions=(torch.logit,), methods=("logit",)),
    define("nan_to_num", _EW, functions=(torch.nan_to_num,), methods=("nan_to_num",)),
    define("masked_fill", _EW, _EXACT,
           aten=_aten("masked_fill.Scalar", "masked_fill.Tensor"), signature=sig("value", inputs=("input", "mask")),
           functions=(torch.masked_fill,), methods=("masked_fill",)),
    define("copysign", functions=(torch.copysign,), methods=("copysign",)),
    define("deg2rad", functions=(torch.deg2rad,), methods=("deg2rad",)),
    define("rad2deg", functions=(torch.rad2deg,), methods=("rad2deg",)),
    define("fmax", functions=(torch.fmax,), methods=("fmax",)),
    define("fmin", functions=(torch.fmin,), methods=("fmin",)),
    define("frac", functions=(torch.frac,), methods=("frac",)),
    define("logaddexp", functions=(torch.logaddexp,), methods=("logaddexp",)),
    define("logaddexp2", functions=(torch.logaddexp2,), methods=("logaddexp2",)),
    define("heaviside", functions=(torch.heaviside,), methods=("heaviside",)),
    define("xlogy", functions=(torch.xlogy, torch.special.xlogy), methods=("xlogy",)),
    define("xlog1py", functions=(torch.special.xlog1py,)),
    define("entr", functions=(torch.special.entr,)),
    define("ndtr", functions=(torch.special.ndtr,)),
    define("ldexp", functions=(torch.ldexp,), methods=("ldexp",)),
    define("hypot", functions=(torch.hypot,), methods=("hypot",)),
    define("float_power", functions=(torch.float_power,), methods=("float_power",)),
    define("isclose", functions=(torch.isclose,), methods=("isclose",)),
    define("expm1", functions=(torch.expm1, torch.special.expm1), methods=("expm1",)),
    define("erfc", aten=_aten("erfc.default"), functions=(torch.erfc, torch.special.erfc), methods=("erfc",)),
    define("sinc", functions=(torch.sinc,), methods=("sinc",)),
    define("signbit", functions=(torch.signbit,), methods=("signbit",)),
    define("isposinf", functions=(torch.isposinf,), methods=("isposinf",)),
    define("isneginf", functions=(torch.isneginf,), methods=("isneginf",)),
    define("isreal", functions=(torch.isreal,), methods=("isreal",)),
    # --- products
    define("dot", functions=(torch.dot, torch.mv, torch.vdot), methods=("dot", "mv", "vdot")),
    define("einsum", aten=_aten("einsum.default"), signature=sig("*operands", inputs=("equation",)),
           functions=(torch.einsum,)),
    define("addmm", aten=_aten("addmm.default", "baddbmm.default"),
           functions=(torch.addmm, torch.baddbmm, torch.addmv), methods=("addmm", "baddbmm", "addmv")),
    define("addcmul", functions=(torch.addcmul,), methods=("addcmul",)),
    define("addcdiv", functions=(torch.addcdiv,), methods=("addcdiv",)),
    define("addbmm", functions=(torch.addbmm,), methods=("addbmm",)),
    define("addr", functions=(torch.addr,), methods=("addr",)),
    define("outer", functions=(torch.outer, torch.ger), methods=("outer",)),
    define("cross", functions=(torch.cross,), methods=("cross",)),
    define("linalg_cross", functions=(torch.linalg.cross,)),
    # --- reductions
    define("sum", _REDUCE,
           aten=_aten("sum.dim_IntList", "sum.default"),
           signature=_REDUCE_DIM, functions=(torch.sum,), methods=("sum",)),
    define(MEAN, _REDUCE,
           aten=_aten("mean.dim", "mean.default"), signature=_REDUCE_DIM, functions=(torch.mean,), methods=("mean",)),
    define("prod", _REDUCE, signature=_REDUCE_DIM, functions=(torch.prod,), methods=("prod",)),
    define("amax", _REDUCE,
           aten=_aten("amax.default"), signature=sig(("dim", ()), ("keepdim", False)), functions=(torch.amax,),
           methods=("amax",)),
    define("amin", _REDUCE,
           aten=_aten("amin.default"), signature=sig(("dim", ()), ("keepdim", False)), functions=(torch.amin,),
           methods=("amin",)),
    define("argmax", _REDUCE, signature=sig(("dim", None), ("keepdim", False)), functions=(torch.argmax,),
           methods=("argmax",)),
    define("argmin", _REDUCE, signature=sig(("dim", None), ("keepdim", False)), functions=(torch.argmin,),
           methods=("argmin",)),
    define("logsumexp", _REDUCE, signature=sig("dim", ("keepdim", False)), functions=(torch.logsumexp,),
           methods=("logsumexp",)),
    define("max", functions=(torch.max,), methods=("max",)),  # torch.max(x, dim) and torch.max(x, other)
    define("min", functions=(torch.min,), methods=("min",)),
    define("std", functions=(torch.std,), methods=("std",)),
    define("var", functions=(torch.var,), methods=("var",)),
    define("std_mean", functions=(torch.std_mean,)),
    define("var_mean", functions=(torch.var_mean,)),
    define("norm", functions=(torch.norm,), methods=("norm",)),
    define("vector_norm", functions=(torch.linalg.vector_norm,)),
    define("linalg_norm", functions=(torch.linalg.norm,)),
    define("matrix_norm", functions=(torch.linalg.matrix_norm,)),
    define("all", functions=(torch.all,), methods=("all",)),
    define("any", functions=(torch.any,), methods=("any",)),
    define("aminmax", functions=(torch.aminmax,), methods=("aminmax",)),
    define("nansum", functions=(torch.nansum,), methods=("nansum",)),
    define("nanmean", functions=(torch.nanmean,), methods=("nanmean",)),
    define("count_nonzero", functions=(torch.count_nonzero,), methods=("count_nonzero",)),
    define("logcumsumexp", functions=(torch.logcumsumexp,), methods=("logcumsumexp",)),
    define("trace", functions=(torch.trace,), methods=("trace",)),
    define("dist", functions=(torch.dist,), methods=("dist",)),
    define("cosine_similarity", functions=(torch.cosine_similarity,)),
    define("pairwise_distance", functions=(F.pairwise_distance,)),  # (torch.pairwise_distance is the same)
    # --- losses
    define("mse_loss", functions=(F.mse_loss,)),
    define("l1_loss", functions=(F.l1_loss,)),
    define("huber_loss", functions=(F.huber_loss,)),
    define("smooth_l1_loss", functions=(F.smooth_l1_loss,)),
    define("soft_margin_loss", functions=(F.soft_margin_loss,)),
    define("margin_ranking_loss", functions=(F.margin_ranking_loss,)),
    define("binary_cross_entropy_with_logits", functions=(F.binary_cross_entropy_with_logits,)),
    define("kl_div", functions=(F.kl_div,)),
    define("poisson_nll_loss", functions=(F.poisson_nll_loss,)),
    define("hinge_embedding_loss", functions=(F.hinge_embedding_loss,)),
    # --- layout: reshape, permute, join, split
    define(RESHAPE, _LAYOUT, _EXACT,
           aten=_aten("view.default", "reshape.default", "_unsafe_view.default", "squeeze.dim", "squeeze.dims",
                      "squeeze.default", "unsqueeze.default"),
           signature=sig("*shape"),
           functions=(torch.reshape, torch.squeeze, torch.unsqueeze),
           methods=("view", "reshape", "squeeze", "unsqueeze"),
           forms={"view": sig("*size"), torch.squeeze: sig(("dim", None)), "squeeze": sig(("dim", None)),
                  torch.unsqueeze: sig("dim"), "unsqueeze": sig("dim")}),
    define(FLATTEN, _LAYOUT, _EXACT,
           aten=_aten("flatten.using_ints"), signature=sig(("start_dim", 0), ("end_dim", -1)), modules=(nn.Flatten,),
           functions=(torch.flatten,), methods=("flatten",)),
    define(PERMUTE, _LAYOUT, _EXACT,
           aten=_aten("permute.default"), signature=sig("*dims"), functions=(torch.permute,), methods=("permute",)),
    define(TRANSPOSE, _LAYOUT, _EXACT,
           aten=_aten("transpose.int"), signature=sig("dim0", "dim1"), functions=(torch.transpose,),
           methods=("transpose",)),
    define("t", _EXACT, aten=_aten("t.default"), signature=_UNARY, functions=(torch.t,), methods=("t",)),
    define(CAT, _EXACT,
           aten=_aten("cat.default"),
           signature=sig(("dim", 0), inputs=("tensors",)), functions=(torch.cat, torch.concat)),
    define("stack", _EXACT,
           aten=_aten("stack.default"), signature=sig(("dim", 0), inputs=("tensors",)), functions=(torch.stack,)),
    define("split", _EXACT,
           aten=_aten("split.Tensor", "split_with_sizes.default", "chunk.default"),
           functions=tuple(f for f in _SPLIT_BY if not isinstance(f, str)),
           methods=tuple(m for m in _SPLIT_BY if isinstance(m, str)), forms=_SPLIT_BY),
    define("unbind", _EXACT,
           aten=_aten("unbind.int"), signature=sig(("dim", 0)), functions=(torch.unbind, torch.unbind_copy),
           methods=("unbind",)),
    define("tile", functions=(torch.tile,), methods=("tile",)),
    define("ravel", functions=(torch.ravel,), methods=("ravel",)),
    define("roll", functions=(torch.roll,), methods=("roll",)),
    define("narrow", functions=(torch.narrow, torch.narrow_copy), methods=("narrow",)),
    define("movedim", functions=(torch.movedim, torch.moveaxis), methods=("movedim", "moveaxis")),
    define("expand", aten=_aten("expand.default"), functions=(torch.expand_copy,), methods=("expand",)),
    define("expand_as", aten=_aten("expand_as.default"), methods=("expand_as",)),
    define("repeat", aten=_aten("repeat.default"), methods=("repeat",)),
    define("broadcast_to", functions=(torch.broadcast_to,), methods=("broadcast_to",)),
    define("broadcast_tensors", functions=(torch.broadcast_tensors,)),
    define("reshape_as", methods=("reshape_as", "view_as")),
    define("atleast_1d", functions=(torch.atleast_1d,)),
    define("atleast_2d", functions=(torch.atleast_2d,)),
    define("atleast_3d", functions=(torch.atleast_3d,)),
    define("hstack", functions=(torch.hstack,)),
    define("vstack", functions=(torch.vstack,)),
    define("fliplr", functions=(torch.fliplr,), methods=("fliplr",)),
    define("flipud", functions=(torch.flipud,), methods=("flipud",)),
    define("tril", aten=_aten("tril.default"), functions=(torch.tril,), methods=("tril",)),
    define("triu", aten=_aten("triu.default"), functions=(torch.triu,), methods=("triu",)),
    define("diff", functions=(torch.diff,), methods=("diff",)),
    define("pad", _EXACT,
           aten=_aten("pad.default"), signature=sig("pad", ("mode", "constant"), ("value", None)), functions=(F.pad,)),
    define("constant_pad_nd", _EXACT,
           aten=_aten("constant_pad_nd.default"),
           signature=sig("pad", ("value", 0)), functions=(torch.constant_pad_nd,)),
    # --- indexing, gathering, sorting
    define(GETITEM, _EXACT, signature=sig("index"), functions=(operator.getitem,)),
    define("setitem", _EXACT, signature=sig("index", "value"), functions=(setitem,)),  # x[index] = value, out of place
    define("slice", functions=(torch.ops.aten.slice.Tensor,)),
    define("select", aten=_aten("select.int"), signature=sig("dim", "index"), functions=(torch.select,),
           methods=("select",)),
    define("take", functions=(torch.take,), methods=("take",)),
    define("gather", aten=_aten("gather.default"), functions=(torch.gather,), methods=("gather",)),
    define("index_select",
           aten=_aten("index_select.default"), functions=(torch.index_select,), methods=("index_select",)),
    define("masked_select", functions=(torch.masked_select,), methods=("masked_select",)),
    define("scatter", functions=(torch.scatter,), methods=("scatter",)),
    define("nonzero", functions=(torch.nonzero, torch.argwhere), methods=("nonzero", "argwhere")),
    define("unique", functions=(torch.unique,), methods=("unique",)),
    define("topk", functions=(torch.topk,), methods=("topk",)),
    define("sort", functions=(torch.sort,), methods=("sort",)),
    define("argsort", functions=(torch.argsort,), methods=("argsort",)),
    # --- new tensors
    define("zeros_like", functions=(torch.zeros_like, torch.empty_like)),  # any values are right for empty_like
    define("ones_like", functions=(torch.ones_like,)),
    define("full_like", functions=(torch.full_like,)),
    define("randn_like", functions=(torch.randn_like,)),
    define("rand_like", functions=(torch.rand_like,)),
    define("new_zeros", methods=("new_zeros", "new_empty")),  # any values are right for new_empty
    define("new_ones", methods=("new_ones",)),
    define("new_full", methods=("new_full",)),
    # --- metadata
    define("size", Tag.META, _EXACT, signature=sig(("dim", None)), methods=("size", "dim"),
           forms={"dim": _UNARY}),
    define("getattr", _EXACT, signature=sig("name"), functions=(builtins.getattr,)),
)

__all__ = ["CATALOGUE"]
