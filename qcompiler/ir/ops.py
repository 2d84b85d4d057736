"""Canonical op names for FX nodes.

Passes, the op-support tables and the emitters speak of ops by one canonical
name ("conv2d", "add", "reshape"...) whatever spelling the model used: an
``nn.Conv2d`` module, ``F.conv2d``, ``x + y``, ``torch.add`` or ``x.add``.
The tables below are the single place where spellings are mapped.

Clamps are canonicalized by their bounds: ``torch.clamp(x, min=0)``,
``x.clamp_min(0)`` are "relu" and ``torch.clamp(x, 0, 6)``, ``F.hardtanh(x, 0, 6)``,
``nn.Hardtanh(0, 6)`` are "relu6" (the same values, bit for bit), so they place,
fuse and convert like the ReLUs MARCH_OPS.md lists; clamps with other
bounds have no canonical op (they run on CPU; :func:`emit_op` names them "clamp" for the
CPU backends, which read the bounds with :func:`clamp_bounds`).

Ops only the CPU runs (``neg``, ``abs``, the comparisons, ``pad``, ``getattr``) are named
here too: one table of spellings serves the placement, the passes and the ONNX emitter.
"""

from __future__ import annotations

import builtins
import operator
from typing import Optional

import torch
import torch.ao.quantization as taq
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.ir.setitem import setitem

# nn.Module classes -> op. Subclasses match too (checked along the MRO).
MODULE_OPS: dict[type, str] = {
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.Linear: "linear",
    nn.BatchNorm1d: "batch_norm1d",
    nn.BatchNorm2d: "batch_norm",
    nn.BatchNorm3d: "batch_norm3d",
    nn.ReLU: "relu",
    nn.ReLU6: "relu6",
    nn.LeakyReLU: "leaky_relu",
    nn.PReLU: "prelu",
    nn.SELU: "selu",
    nn.ELU: "elu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.Hardsigmoid: "hardsigmoid",
    nn.Hardswish: "hardswish",
    nn.Softmax: "softmax",
    nn.LayerNorm: "layer_norm",
    nn.GroupNorm: "group_norm",
    nn.MaxPool2d: "max_pool2d",
    nn.AvgPool2d: "avg_pool2d",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.Upsample: "interpolate",
    nn.LSTM: "lstm",
    nn.GRU: "gru",
    nn.RNN: "rnn",
    nn.LSTMCell: "lstm_cell",
    nn.GRUCell: "gru_cell",
    nn.RNNCell: "rnn_cell",
    nn.Embedding: "embedding",
    nn.EmbeddingBag: "embedding_bag",
    nn.MultiheadAttention: "multihead_attention",
    nn.Flatten: "flatten",
    nn.Identity: "identity",
    nn.Dropout: "dropout",
    nn.Dropout2d: "dropout",
    taq.QuantStub: "quant",
    taq.DeQuantStub: "dequant",
    # --- element-wise math, log-softmax and normalization on the CPU (ONNX rules: onnx/rules/elementwise.py,
    # norm.py; issue 13). Not BPU ops: placement sends them to the CPU.
    nn.Softplus: "softplus",
    nn.Mish: "mish",
    nn.GLU: "glu",
    nn.LogSigmoid: "logsigmoid",
    nn.Softsign: "softsign",
    nn.CELU: "celu",
    nn.Threshold: "threshold",
    nn.LogSoftmax: "log_softmax",
    nn.Softmin: "softmin",
    nn.InstanceNorm1d: "instance_norm",
    nn.InstanceNorm2d: "instance_norm",
    nn.InstanceNorm3d: "instance_norm",
    nn.LocalResponseNorm: "local_response_norm",
    # --- end of element-wise math block
    # --- shape / reduction / index / pool ops the CPU islands emit (ops-shape branch) ---
    nn.PixelShuffle: "pixel_shuffle",
    nn.PixelUnshuffle: "pixel_unshuffle",
    nn.MaxPool1d: "max_pool1d",
    nn.AvgPool1d: "avg_pool1d",
    nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d",
    nn.AdaptiveMaxPool1d: "adaptive_max_pool1d",
    nn.AdaptiveMaxPool2d: "adaptive_max_pool2d",
    # --- end ops-shape ---
}

# call_function targets -> op
FUNCTION_OPS: dict[object, str] = {
    F.conv2d: "conv2d",
    F.conv_transpose2d: "conv_transpose2d",
    F.linear: "linear",
    F.relu: "relu",
    torch.relu: "relu",
    F.relu6: "relu6",
    F.leaky_relu: "leaky_relu",
    F.prelu: "prelu",
    F.selu: "selu",
    torch.selu: "selu",
    F.elu: "elu",
    F.gelu: "gelu",
    F.silu: "silu",
    F.hardsigmoid: "hardsigmoid",
    F.hardswish: "hardswish",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    torch.exp: "exp",
    torch.erf: "erf",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    F.layer_norm: "layer_norm",
    F.batch_norm: "batch_norm",
    F.max_pool2d: "max_pool2d",
    F.avg_pool2d: "avg_pool2d",
    F.adaptive_avg_pool2d: "adaptive_avg_pool2d",
    F.interpolate: "interpolate",
    F.embedding: "embedding",
    F.embedding_bag: "embedding_bag",
    F.dropout: "dropout",
    operator.add: "add",
    torch.add: "add",
    operator.sub: "sub",
    torch.sub: "sub",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    torch.bmm: "matmul",
    torch.cat: "cat",
    torch.concat: "cat",
    torch.flatten: "flatten",
    torch.reshape: "reshape",
    torch.transpose: "transpose",
    torch.permute: "permute",
    torch.squeeze: "reshape",
    torch.unsqueeze: "reshape",
    torch.mean: "mean",
    torch.where: "where",
    torch.chunk: "split",
    torch.split: "split",  # torch.functional.split
    operator.getitem: "getitem",
    setitem: "setitem",  # x[index] = value, out of place (qcompiler.ir.setitem)
    builtins.getattr: "getattr",
    F.pad: "pad",
    operator.neg: "neg",
    torch.neg: "neg",
    torch.abs: "abs",
    operator.abs: "abs",
    operator.gt: "gt",
    operator.lt: "lt",
    operator.ge: "ge",
    operator.le: "le",
    operator.eq: "eq",
    operator.ne: "ne",
    torch.gt: "gt",
    torch.lt: "lt",
    torch.ge: "ge",
    torch.le: "le",
    torch.eq: "eq",
    torch.ne: "ne",
    # --- element-wise math, log-softmax and normalization on the CPU (ONNX rules: onnx/rules/elementwise.py,
    # norm.py; issue 13). Not BPU ops: placement sends them to the CPU.
    torch.sqrt: "sqrt",
    torch.rsqrt: "rsqrt",
    torch.log: "log",
    torch.log1p: "log1p",
    torch.sin: "sin",
    torch.cos: "cos",
    torch.tan: "tan",
    torch.pow: "pow",
    operator.pow: "pow",
    torch.reciprocal: "reciprocal",
    torch.floor: "floor",
    torch.ceil: "ceil",
    torch.round: "round",
    torch.sign: "sign",
    torch.minimum: "minimum",
    torch.maximum: "maximum",
    F.mish: "mish",
    F.softplus: "softplus",
    F.glu: "glu",
    F.logsigmoid: "logsigmoid",
    F.softsign: "softsign",
    F.celu: "celu",
    torch.celu: "celu",
    F.threshold: "threshold",
    torch.threshold: "threshold",
    F.log_softmax: "log_softmax",
    torch.log_softmax: "log_softmax",
    F.softmin: "softmin",
    F.group_norm: "group_norm",
    torch.group_norm: "group_norm",
    F.instance_norm: "instance_norm",
    F.normalize: "normalize",
    F.local_response_norm: "local_response_norm",
    torch.asin: "asin",
    torch.acos: "acos",
    torch.atan: "atan",
    torch.sinh: "sinh",
    torch.cosh: "cosh",
    torch.asinh: "asinh",
    torch.acosh: "acosh",
    torch.atanh: "atanh",
    torch.log2: "log2",
    torch.log10: "log10",
    torch.exp2: "exp2",
    torch.square: "square",
    torch.trunc: "trunc",
    torch.fix: "trunc",
    # --- end of element-wise math block
    # --- shape / reduction / index / pool ops the CPU islands emit (ops-shape branch) ---
    torch.sum: "sum",
    torch.prod: "prod",
    torch.max: "max",  # torch.max(x, dim) and torch.max(x, other) (element-wise): one rule reads which
    torch.min: "min",
    torch.amax: "amax",
    torch.amin: "amin",
    torch.argmax: "argmax",
    torch.argmin: "argmin",
    torch.std: "std",
    torch.var: "var",
    torch.std_mean: "std_mean",
    torch.var_mean: "var_mean",
    torch.norm: "norm",
    torch.linalg.vector_norm: "vector_norm",
    torch.cumsum: "cumsum",
    torch.logsumexp: "logsumexp",
    torch.all: "all",
    torch.any: "any",
    torch.stack: "stack",
    torch.tile: "tile",
    torch.t: "t",
    torch.flip: "flip",
    torch.roll: "roll",
    F.pixel_shuffle: "pixel_shuffle",
    F.pixel_unshuffle: "pixel_unshuffle",
    torch.unbind: "unbind",
    torch.narrow: "narrow",
    torch.movedim: "movedim",
    torch.moveaxis: "movedim",
    torch.gather: "gather",
    torch.index_select: "index_select",
    torch.masked_fill: "masked_fill",
    torch.scatter: "scatter",
    torch.topk: "topk",
    torch.sort: "sort",
    torch.argsort: "argsort",
    F.max_pool1d: "max_pool1d",
    F.avg_pool1d: "avg_pool1d",
    F.adaptive_avg_pool1d: "adaptive_avg_pool1d",
    F.adaptive_max_pool1d: "adaptive_max_pool1d",
    F.adaptive_max_pool2d: "adaptive_max_pool2d",
    # --- end ops-shape ---
    # --- ops of torch's OpInfo catalogue the CPU islands emit (benchmarks/op_catalogue.py; issue 13) ---
    torch.true_divide: "div",
    torch.mm: "matmul",
    torch.dot: "dot",
    torch.mv: "dot",
    torch.addmm: "addmm",
    torch.baddbmm: "addmm",
    torch.addmv: "addmm",
    torch.addcmul: "addcmul",
    torch.addcdiv: "addcdiv",
    torch.conv1d: "conv1d",
    torch.conv3d: "conv3d",
    torch.conv_transpose1d: "conv_transpose1d",
    torch.conv_transpose3d: "conv_transpose3d",
    torch.clone: "identity",
    torch.conj: "identity",
    torch.conj_physical: "identity",
    torch.resolve_conj: "identity",
    torch.resolve_neg: "identity",
    torch.positive: "identity",
    torch.logical_not: "logical_not",
    torch.logical_and: "logical_and",
    torch.logical_or: "logical_or",
    torch.logical_xor: "logical_xor",
    torch.isnan: "isnan",
    torch.isinf: "isinf",
    torch.isfinite: "isfinite",
    torch.atan2: "atan2",
    torch.arctan2: "atan2",
    torch.fmod: "fmod",
    torch.remainder: "remainder",
    torch.floor_divide: "floor_divide",
    torch.rsub: "rsub",
    torch.lerp: "lerp",
    torch.logit: "logit",
    torch.nan_to_num: "nan_to_num",
    F.tanhshrink: "tanhshrink",
    F.softshrink: "softshrink",
    F.hardshrink: "hardshrink",
    torch.hardshrink: "hardshrink",
    torch.broadcast_to: "broadcast_to",
    torch.atleast_1d: "atleast_1d",
    torch.atleast_2d: "atleast_2d",
    torch.atleast_3d: "atleast_3d",
    torch.hstack: "hstack",
    torch.vstack: "vstack",
    torch.split_with_sizes: "split",
    torch.unsafe_split: "split",
    torch.unsafe_chunk: "split",
    torch.constant_pad_nd: "constant_pad_nd",
    torch.select: "select",
    torch.take: "take",
    torch.masked_select: "masked_select",
    torch.zeros_like: "zeros_like",
    torch.ones_like: "ones_like",
    torch.full_like: "full_like",
    torch.empty_like: "zeros_like",  # any values are right for empty_like: zeros are deterministic
    torch.randn_like: "randn_like",
    torch.rand_like: "rand_like",
    torch.vdot: "dot",
    torch.addbmm: "addbmm",
    torch.addr: "addr",
    torch.sgn: "sign",
    torch.copysign: "copysign",
    torch.deg2rad: "deg2rad",
    torch.rad2deg: "rad2deg",
    torch.fmax: "fmax",
    torch.fmin: "fmin",
    torch.frac: "frac",
    torch.logaddexp: "logaddexp",
    torch.logaddexp2: "logaddexp2",
    torch.heaviside: "heaviside",
    torch.xlogy: "xlogy",
    torch.special.xlogy: "xlogy",
    torch.special.xlog1py: "xlog1py",
    torch.special.entr: "entr",
    torch.special.ndtr: "ndtr",
    torch.ldexp: "ldexp",
    torch.hypot: "hypot",
    torch.float_power: "float_power",
    torch.isclose: "isclose",
    torch.expand_copy: "expand",
    torch.alias_copy: "identity",
    torch.narrow_copy: "narrow",
    torch.unbind_copy: "unbind",
    torch.split_with_sizes_copy: "split",
    torch.fliplr: "fliplr",
    torch.flipud: "flipud",
    torch.diff: "diff",
    torch.cross: "cross",
    torch.linalg.cross: "linalg_cross",
    torch.broadcast_tensors: "broadcast_tensors",
    torch.ops.aten.slice.Tensor: "slice",
    torch.aminmax: "aminmax",
    torch.linalg.norm: "linalg_norm",
    torch.linalg.matrix_norm: "matrix_norm",
    F.avg_pool3d: "avg_pool3d",
    F.rms_norm: "rms_norm",
    F.mse_loss: "mse_loss",
    F.l1_loss: "l1_loss",
    F.soft_margin_loss: "soft_margin_loss",
    F.margin_ranking_loss: "margin_ranking_loss",
    F.binary_cross_entropy_with_logits: "binary_cross_entropy_with_logits",
    F.kl_div: "kl_div",
    torch.cosine_similarity: "cosine_similarity",
    torch.expm1: "expm1",
    torch.special.expm1: "expm1",
    torch.erfc: "erfc",
    torch.special.erfc: "erfc",
    torch.sinc: "sinc",
    torch.signbit: "signbit",
    torch.isposinf: "isposinf",
    torch.isneginf: "isneginf",
    torch.isreal: "isreal",
    torch.nansum: "nansum",
    torch.nanmean: "nanmean",
    torch.count_nonzero: "count_nonzero",
    torch.logcumsumexp: "logcumsumexp",
    torch.tril: "tril",
    torch.triu: "triu",
    torch.trace: "trace",
    torch.ravel: "ravel",
    torch.outer: "outer",
    torch.ger: "outer",
    torch.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.unique: "unique",
    torch.tensor_split: "split",
    F.huber_loss: "huber_loss",
    F.smooth_l1_loss: "smooth_l1_loss",
    F.pairwise_distance: "pairwise_distance",
    torch.pairwise_distance: "pairwise_distance",
    F.poisson_nll_loss: "poisson_nll_loss",
    F.hinge_embedding_loss: "hinge_embedding_loss",
    torch.dist: "dist",
    torch.native_layer_norm: "native_layer_norm",
    F.max_pool3d: "max_pool3d",
    torch.max_pool3d: "max_pool3d",
    F.max_pool1d_with_indices: "max_pool1d_with_indices",
    F.max_pool2d_with_indices: "max_pool2d_with_indices",
    F.max_pool3d_with_indices: "max_pool3d_with_indices",
    # --- end op catalogue ---
}

# call_method names -> op
METHOD_OPS: dict[str, str] = {
    "view": "reshape",
    "reshape": "reshape",
    "flatten": "flatten",
    "squeeze": "reshape",
    "unsqueeze": "reshape",
    "permute": "permute",
    "transpose": "transpose",
    "contiguous": "identity",
    "relu": "relu",
    "sigmoid": "sigmoid",
    "tanh": "tanh",
    "exp": "exp",
    "softmax": "softmax",
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "matmul": "matmul",
    "mean": "mean",
    "size": "size",
    "dim": "size",
    "chunk": "split",
    "split": "split",
    "neg": "neg",
    "abs": "abs",
    "float": "float",
    "gt": "gt",
    "lt": "lt",
    "ge": "ge",
    "le": "le",
    "eq": "eq",
    "ne": "ne",
    # --- element-wise math, log-softmax and normalization on the CPU (ONNX rules: onnx/rules/elementwise.py,
    # norm.py; issue 13). Not BPU ops: placement sends them to the CPU.
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "log": "log",
    "log1p": "log1p",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "erf": "erf",
    "pow": "pow",
    "reciprocal": "reciprocal",
    "floor": "floor",
    "ceil": "ceil",
    "round": "round",
    "sign": "sign",
    "minimum": "minimum",
    "maximum": "maximum",
    "log_softmax": "log_softmax",
    "asin": "asin",
    "acos": "acos",
    "atan": "atan",
    "sinh": "sinh",
    "cosh": "cosh",
    "asinh": "asinh",
    "acosh": "acosh",
    "atanh": "atanh",
    "log2": "log2",
    "log10": "log10",
    "exp2": "exp2",
    "square": "square",
    "trunc": "trunc",
    "fix": "trunc",
    # --- end of element-wise math block
    # --- shape / reduction / index ops the CPU islands emit (ops-shape branch) ---
    "sum": "sum",
    "prod": "prod",
    "max": "max",
    "min": "min",
    "amax": "amax",
    "amin": "amin",
    "argmax": "argmax",
    "argmin": "argmin",
    "std": "std",
    "var": "var",
    "norm": "norm",
    "cumsum": "cumsum",
    "logsumexp": "logsumexp",
    "all": "all",
    "any": "any",
    "expand": "expand",
    "expand_as": "expand_as",
    "repeat": "repeat",
    "tile": "tile",
    "t": "t",
    "flip": "flip",
    "roll": "roll",
    "unbind": "unbind",
    "narrow": "narrow",
    "movedim": "movedim",
    "moveaxis": "movedim",
    "gather": "gather",
    "index_select": "index_select",
    "masked_fill": "masked_fill",
    "scatter": "scatter",
    "topk": "topk",
    "sort": "sort",
    "argsort": "argsort",
    # --- end ops-shape ---
    # --- ops of torch's OpInfo catalogue the CPU islands emit (benchmarks/op_catalogue.py; issue 13) ---
    "true_divide": "div",
    "mm": "matmul",
    "dot": "dot",
    "mv": "dot",
    "addmm": "addmm",
    "baddbmm": "addmm",
    "addmv": "addmm",
    "addcmul": "addcmul",
    "addcdiv": "addcdiv",
    "clone": "identity",
    "conj": "identity",
    "resolve_conj": "identity",
    "resolve_neg": "identity",
    "logical_not": "logical_not",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "logical_xor": "logical_xor",
    "isnan": "isnan",
    "isinf": "isinf",
    "isfinite": "isfinite",
    "atan2": "atan2",
    "fmod": "fmod",
    "remainder": "remainder",
    "floor_divide": "floor_divide",
    "__rsub__": "rsub",
    "__rdiv__": "rdiv",
    "__rtruediv__": "rdiv",
    "__rpow__": "rpow",
    "__rmatmul__": "rmatmul",
    "__rmod__": "rmod",
    "lerp": "lerp",
    "logit": "logit",
    "nan_to_num": "nan_to_num",
    "broadcast_to": "broadcast_to",
    "reshape_as": "reshape_as",
    "view_as": "reshape_as",
    "split_with_sizes": "split",
    "unsafe_split": "split",
    "unsafe_chunk": "split",
    "select": "select",
    "take": "take",
    "masked_select": "masked_select",
    "new_zeros": "new_zeros",
    "new_ones": "new_ones",
    "new_empty": "new_zeros",  # any values are right for new_empty: zeros are deterministic
    "new_full": "new_full",
    "bool": "cast",
    "byte": "cast",
    "char": "cast",
    "double": "cast",
    "half": "cast",
    "int": "cast",
    "long": "cast",
    "short": "cast",
    "to": "cast",
    "type_as": "cast",
    "vdot": "dot",
    "addbmm": "addbmm",
    "addr": "addr",
    "sgn": "sign",
    "copysign": "copysign",
    "deg2rad": "deg2rad",
    "rad2deg": "rad2deg",
    "fmax": "fmax",
    "fmin": "fmin",
    "frac": "frac",
    "logaddexp": "logaddexp",
    "logaddexp2": "logaddexp2",
    "heaviside": "heaviside",
    "xlogy": "xlogy",
    "ldexp": "ldexp",
    "hypot": "hypot",
    "float_power": "float_power",
    "isclose": "isclose",
    "fliplr": "fliplr",
    "flipud": "flipud",
    "diff": "diff",
    "cross": "cross",
    "aminmax": "aminmax",
    "expm1": "expm1",
    "erfc": "erfc",
    "sinc": "sinc",
    "signbit": "signbit",
    "isposinf": "isposinf",
    "isneginf": "isneginf",
    "isreal": "isreal",
    "nansum": "nansum",
    "nanmean": "nanmean",
    "count_nonzero": "count_nonzero",
    "logcumsumexp": "logcumsumexp",
    "tril": "tril",
    "triu": "triu",
    "trace": "trace",
    "ravel": "ravel",
    "outer": "outer",
    "nonzero": "nonzero",
    "argwhere": "nonzero",
    "unique": "unique",
    "tensor_split": "split",
    "dist": "dist",
    # --- end op catalogue ---
}

# clamp spellings: call_function target / call_method name -> (lower, upper) bound
# parameter names and defaults, in positional order after the input
_CLAMP_FUNCTIONS: dict[object, tuple[tuple[str, object], ...]] = {
    torch.clamp: (("min", None), ("max", None)),
    torch.clip: (("min", None), ("max", None)),
    torch.clamp_min: (("min", None),),
    torch.clamp_max: (("max", None),),
    F.hardtanh: (("min_val", -1.0), ("max_val", 1.0)),
}
_CLAMP_METHODS: dict[str, tuple[tuple[str, object], ...]] = {
    "clamp": (("min", None), ("max", None)),
    "clip": (("min", None), ("max", None)),
    "clamp_min": (("min", None),),
    "clamp_max": (("max", None),),
}


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


def _clamp_bounds(node: fx.Node, params: tuple[tuple[str, object], ...]) -> Optional[tuple[object, object]]:
    if len(node.args) > 1 + len(params) or set(node.kwargs) - {name for name, _ in params} - {"inplace"}:
        return None
    bounds = {name: node.args[1 + i] if 1 + i < len(node.args) else node.kwargs.get(name, default)
              for i, (name, default) in enumerate(params)}
    # a parameter named min* is the lower bound, max* the upper (clamp_max has only the upper)
    lower = next((v for name, v in bounds.items() if name.startswith("min")), None)
    upper = next((v for name, v in bounds.items() if name.startswith("max")), None)
    return lower, upper


def _clamp_node_op(node: fx.Node, params: tuple[tuple[str, object], ...]) -> Optional[str]:
    bounds = _clamp_bounds(node, params)
    return clamp_op(*bounds) if bounds is not None else None


# Ops that move no data and compute nothing: they take their producer's placement.
PASSTHROUGH_OPS = frozenset({"identity", "dropout"})
# Ops that only re-arrange or re-label a tensor: they follow a CPU producer; after a
# BPU producer the march table decides (bayes runs them, bernoulli2 only when they fold).
LAYOUT_OPS = frozenset({"reshape", "flatten", "permute", "transpose"})
# Ops whose result is metadata (sizes), not data.
META_OPS = frozenset({"size"})


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
            clamp = _CLAMP_FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
        return _clamp_node_op(node, clamp) if clamp is not None else op
    if node.op == "call_method":
        clamp = _CLAMP_METHODS.get(node.target)
        return _clamp_node_op(node, clamp) if clamp is not None else METHOD_OPS.get(node.target)
    return None


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
    if node.op == "call_function":
        try:
            params = _CLAMP_FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    else:
        params = _CLAMP_METHODS.get(node.target) if node.op == "call_method" else None
    return _clamp_bounds(node, params) if params is not None else None


def emit_op(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The op a backend computes ``node`` as: its canonical op, or "clamp" for a clamp spelling
    whose bounds are no ReLU's (it has no canonical op: nothing but the CPU runs it)."""
    op = node_op(node, modules)
    if op is None and is_clamp(node, modules):
        return "clamp"
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
