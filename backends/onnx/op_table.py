"""The emit table: which rule turns an FX node into ONNX opset-11 nodes.

Two plain tables, data only:

* ``MODULE_RULES``: module class -> rule, looked up along the module's MRO
  first. It holds what is *not* an op of the model: quantizers, stubs, and the
  fixed-point modules of a converted model.
* ``OP_RULES``: canonical op name (``qcompiler.ir.ops``) -> rule, for everything
  else (float modules, observed / fused layers, functions, methods).

A node whose module and op are in neither table has no rule: the emitter
raises ``UnsupportedOpError`` naming it.
"""

from __future__ import annotations

import builtins
import operator
from typing import Callable, Optional

import torch
import torch.ao.quantization as taq
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.backends.onnx import quant, rules
from qcompiler.nn import quantized as qnn
from qcompiler.quantization.fake_quantize import FakeQuantizeBase
from qcompiler.quantization.observer import ObserverBase
from qcompiler.quantization.stubs import DeQuantStub, QuantStub

Rule = Callable  # (NodeContext) -> value

MODULE_RULES: dict[type, Rule] = {
    # prepared models: quantizers called from the graph, stubs
    FakeQuantizeBase: quant.fake_quant_node,
    ObserverBase: quant.fake_quant_node,
    QuantStub: rules.quant_stub,
    taq.QuantStub: rules.quant_stub,
    DeQuantStub: rules.dequant_stub,
    taq.DeQuantStub: rules.dequant_stub,
    # converted models: fixed-point modules on QTensors
    qnn.Quantize: quant.converted_quantize,
    qnn.DeQuantize: rules.dequant_stub,
    qnn.QuantizedWeightLayer: quant.converted_weight_layer,
    qnn.QuantizedAdd: quant.converted_binary,
    qnn.QuantizedMul: quant.converted_binary,
    qnn.QuantizedMatmul: quant.converted_binary,
    qnn.QuantizedConstantOperand: rules.converted_constant_operand,
    qnn.QuantizedDiv: rules.converted_div,
    qnn.QuantizedConstant: rules.converted_constant,
    qnn.QuantizedCat: quant.converted_cat,
    qnn.QuantizedLookup: quant.converted_lookup,
    qnn.QuantizedAvgPool: quant.converted_avg_pool,
    qnn.QuantizedResize: quant.converted_resize,
    qnn.QuantizedPReLU: quant.converted_prelu,
    qnn.QuantizedSameScale: quant.converted_same_scale,
}

OP_RULES: dict[str, Rule] = {
    # weight layers (float, observed, fused: op + add + relu/relu6 + output quantizer)
    "conv1d": rules.conv2d,
    "conv2d": rules.conv2d,
    "conv3d": rules.conv2d,
    "conv_transpose2d": rules.conv_transpose2d,
    "linear": rules.linear,
    "batch_norm": rules.batch_norm,
    "batch_norm1d": rules.batch_norm,
    # activations
    "relu": rules.relu,
    "relu6": rules.relu6,
    "leaky_relu": rules.leaky_relu,
    "prelu": rules.prelu,
    "selu": rules.selu,
    "elu": rules.elu,
    "gelu": rules.gelu,
    "silu": rules.silu,
    "sigmoid": rules.unary("Sigmoid"),
    "tanh": rules.unary("Tanh"),
    "exp": rules.unary("Exp"),
    "erf": rules.unary("Erf"),
    "hardsigmoid": rules.hardsigmoid,
    "hardswish": rules.hardswish,
    "softmax": rules.softmax,
    "layer_norm": rules.layer_norm,
    # arithmetic
    "add": rules.add,
    "sub": rules.sub,
    "mul": rules.mul,
    "div": rules.div,
    "matmul": rules.matmul,
    "where": rules.where,
    "cat": rules.cat,
    # pooling, resize
    "max_pool2d": rules.max_pool2d,
    "avg_pool2d": rules.avg_pool2d,
    "adaptive_avg_pool2d": rules.adaptive_avg_pool2d,
    "mean": rules.mean,
    "interpolate": rules.interpolate,
    # layout and indexing
    "reshape": rules.reshape,
    "flatten": rules.flatten,
    "permute": rules.permute,
    "transpose": rules.transpose,
    "size": rules.size,
    "getattr": rules.getattr_,
    "getitem": rules.getitem,
    "split": rules.split,
    "pad": rules.pad,
    "neg": rules.unary("Neg"),
    "abs": rules.unary("Abs"),
    "float": rules.to_float,
    "gt": rules.compare("Greater"),
    "lt": rules.compare("Less"),
    "eq": rules.compare("Equal"),
    "ge": rules.compare("Less", negate=True),  # GreaterOrEqual is opset 12
    "le": rules.compare("Greater", negate=True),
    "ne": rules.compare("Equal", negate=True),
    "clamp": rules.clamp,
    "embedding": rules.embedding,
    # recurrent
    "lstm": rules.lstm,
    # no-ops
    "identity": rules.identity,
    "dropout": rules.identity,
    "quant": rules.quant_stub,
    "dequant": rules.dequant_stub,
}


# call_function targets that ``qcompiler.ir.ops`` has no canonical name for, but the emitter can emit
EXTRA_FUNCTION_OPS: dict[object, str] = {
    builtins.getattr: "getattr",
    F.pad: "pad",
    operator.neg: "neg",
    torch.neg: "neg",
    torch.clamp: "clamp",
    torch.clip: "clamp",
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
}
EXTRA_METHOD_OPS: dict[str, str] = {"neg": "neg", "clamp": "clamp", "clip": "clamp", "abs": "abs", "float": "float",
                                    "gt": "gt", "lt": "lt", "ge": "ge", "le": "le", "eq": "eq", "ne": "ne"}


def extra_op(kind: str, target: object) -> Optional[str]:
    """The emitter-only op name of a call the canonical table does not name, or None."""
    try:
        if kind == "call_function":
            return EXTRA_FUNCTION_OPS.get(target)
        if kind == "call_method":
            return EXTRA_METHOD_OPS.get(target)
    except TypeError:  # unhashable target
        return None
    return None


def rule_for(module: Optional[nn.Module], op: Optional[str]) -> Optional[Rule]:
    """The rule for a node calling ``module`` (or None) with canonical op ``op``."""
    if module is not None:
        for cls in type(module).__mro__:
            rule = MODULE_RULES.get(cls)
            if rule is not None:
                return rule
    return OP_RULES.get(op) if op is not None else None


__all__ = ["MODULE_RULES", "OP_RULES", "EXTRA_FUNCTION_OPS", "EXTRA_METHOD_OPS", "extra_op", "rule_for"]
