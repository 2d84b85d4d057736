"""Canonical op names for FX nodes.

Passes, the op-support tables and the emitters speak of ops by one canonical
name ("conv2d", "add", "reshape"...) whatever spelling the model used: an
``nn.Conv2d`` module, ``F.conv2d``, ``x + y``, ``torch.add`` or ``x.add``.
The tables below are the single place where spellings are mapped.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.ao.quantization as taq
import torch.nn as nn
import torch.nn.functional as F
import torch.fx as fx

# nn.Module classes -> op. Subclasses match too (checked along the MRO).
MODULE_OPS: dict[type, str] = {
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.Linear: "linear",
    nn.BatchNorm1d: "batch_norm1d",
    nn.BatchNorm2d: "batch_norm",
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
    nn.Embedding: "embedding",
    nn.MultiheadAttention: "multihead_attention",
    nn.Flatten: "flatten",
    nn.Identity: "identity",
    nn.Dropout: "dropout",
    nn.Dropout2d: "dropout",
    taq.QuantStub: "quant",
    taq.DeQuantStub: "dequant",
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
    operator.getitem: "getitem",
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
}

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
    return None


def node_op(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The canonical op of a node, or None for placeholders, outputs, get_attr and unknown calls.

    ``modules`` is ``dict(gm.named_modules())``.
    """
    if node.op == "call_module":
        return module_op(modules[node.target])
    if node.op == "call_function":
        try:
            return FUNCTION_OPS.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return METHOD_OPS.get(node.target)
    return None


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
