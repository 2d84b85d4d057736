"""The ONNX vocabulary of qcompiler's emitter: the op types, and the attributes of each, it writes.

A saved artifact's CPU islands are ONNX models that onnxruntime runs, and a hostile file could
name any op onnxruntime has -- a ``Loop`` of 2^62 iterations loads in a second and then never
returns (no signal stops onnxruntime). ``load`` therefore accepts only what this emitter writes
(``backends/ort/island.py`` checks it before any session is made): opset :data:`OPSET` of the
default ONNX domain, the op types of :data:`ALLOWED` with only the attributes listed for each
(typed as the opset-11 schema types them), no subgraph, no local function. The emitter writes
no ``Loop``, ``If`` or ``Scan``, so no island may hold one and there is no trip count to bound:
every allowed op does work bounded by the sizes of its tensors.

The families the rules register from tables (``rules/elementwise.py``, ``rules/arith.py``,
``rules/loss.py``) are read from those tables; the rest is listed here.
``tests/test_onnx_allowlist.py`` checks that the list covers every op type named in the rules and
everything emitted for the zoo and a battery of modules, and that it lists nothing the rules never
name: a rule that writes a new op or attribute fails that test until the op is listed here.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from qcompiler.backends.onnx.context import OPSET_VERSION
from qcompiler.backends.onnx.rules import arith, elementwise, loss

DOMAIN = ""  # the default ONNX domain (ai.onnx), the only one the emitter imports
OPSET = OPSET_VERSION

_POOL = ("kernel_shape", "strides", "pads", "ceil_mode")
_CONV = ("kernel_shape", "strides", "pads", "dilations", "group")
_REDUCE = ("axes", "keepdims")
_RNN = ("hidden_size", "direction")

# op type -> the attributes the rules write on it (a table family's ops are added below)
_LISTED: dict[str, tuple[str, ...]] = {
    # layout, indexing, shapes
    "Identity": (), "Reshape": (), "Shape": (), "Size": (), "Expand": (), "Tile": (), "Slice": (), "Where": (),
    "Compress": (), "NonZero": (), "Range": (),
    "Transpose": ("perm",), "Squeeze": ("axes",), "Unsqueeze": ("axes",), "Flatten": ("axis",),
    "Concat": ("axis",), "Split": ("axis", "split"), "Gather": ("axis",), "GatherElements": ("axis",),
    "ScatterElements": ("axis",), "DepthToSpace": ("blocksize", "mode"), "Pad": ("mode",),
    "TopK": ("axis", "largest", "sorted"), "Unique": ("sorted",), "Cast": ("to",), "ConstantOfShape": ("value",),
    "RandomNormalLike": (), "RandomUniformLike": (),
    # arithmetic and activations outside the table families
    "Pow": (), "MatMul": (), "Clip": (), "Round": (), "IsNaN": (), "PRelu": (), "Relu": (), "Softplus": (),
    "Softsign": (), "CumSum": (), "Mod": ("fmod",), "IsInf": ("detect_negative", "detect_positive"),
    "Elu": ("alpha",), "LeakyRelu": ("alpha",), "Selu": ("alpha", "gamma"), "HardSigmoid": ("alpha", "beta"),
    # weight layers, normalization, pooling, resizing
    "Conv": _CONV, "ConvTranspose": (*_CONV, "output_padding"), "Gemm": ("transB",),
    "BatchNormalization": ("epsilon",), "InstanceNormalization": ("epsilon",),
    "LRN": ("alpha", "beta", "bias", "size"),
    "MaxPool": (*_POOL, "dilations"), "AveragePool": (*_POOL, "count_include_pad"),
    "GlobalAveragePool": (), "GlobalMaxPool": (),
    "Resize": ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a"),
    # reductions
    "ReduceSum": _REDUCE, "ReduceMean": _REDUCE, "ReduceMax": _REDUCE, "ReduceMin": _REDUCE,
    "ReduceProd": _REDUCE, "ReduceL1": _REDUCE, "ReduceL2": _REDUCE, "ReduceSumSquare": _REDUCE,
    "ArgMax": ("axis", "keepdims"), "ArgMin": ("axis", "keepdims"),
    # recurrent layers (rules/rnn.py: hidden_size and direction, plus _EXTRA_ATTRS per op)
    "LSTM": _RNN, "GRU": (*_RNN, "linear_before_reset"), "RNN": (*_RNN, "activations"),
    # quantization (quant.py) and the integer layers of a converted model (rules/integer_layer.py)
    "QuantizeLinear": (), "DequantizeLinear": (), "MatMulInteger": (), "ConvInteger": _CONV,
}


def _families() -> dict[str, tuple[str, ...]]:
    """The ops the rules register from tables, with the attributes those rules write."""
    out: dict[str, tuple[str, ...]] = {}
    for table in (elementwise.UNARY, elementwise.FLOAT_UNARY, elementwise.ROUNDING, arith.LOGICAL, loss.REDUCE):
        out.update(dict.fromkeys(table.values(), ()))
    for ops in elementwise.EXTREMUM.values():  # (op on floats, comparison on integers)
        out.update(dict.fromkeys(ops, ()))
    for table in (elementwise.BINARY, elementwise.COMPARE):  # (op type, python operator / negate)
        out.update(dict.fromkeys((op for op, _ in table.values()), ()))
    out.update(dict.fromkeys((op for op, _ in elementwise.SOFTMAX.values()), ("axis",)))
    return out


def _merge() -> Mapping[str, frozenset[str]]:
    table = {op: frozenset(attrs) for op, attrs in _families().items()}
    for op, attrs in _LISTED.items():
        table[op] = table.get(op, frozenset()) | frozenset(attrs)
    return MappingProxyType(dict(sorted(table.items())))


ALLOWED: Mapping[str, frozenset[str]] = _merge()
"""op type (of :data:`DOMAIN`) -> the attribute names the emitter writes on it."""

__all__ = ["ALLOWED", "DOMAIN", "OPSET"]
