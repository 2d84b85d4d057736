"""Quantization in the ONNX export: Q/DQ pairs, integer weight layers, the sidecar table.

What opset 11 can say and what it cannot, and how the export bridges it:

* **Per-tensor int8 activations** (every activation quantizer of our BPU
  numerics: symmetric, zero point 0) become ``QuantizeLinear`` +
  ``DequantizeLinear`` (opset 10+) with the quantizer's scale and an int8 zero
  point 0. onnxruntime rounds half to even, as the fake-quant model does.
* **Converted weight layers are integer-exact.** A converted model's conv2d
  (grouped, depthwise) / linear with an int8 input and an int8 output (fused add,
  relu, relu6 included) is ``ConvInteger`` / ``MatMulInteger`` on the int8 input
  codes (the int8 tensor before the input's DequantizeLinear) and **int8 weight
  codes** (initializer ``<path>.weight``, dtype int8), an int32 bias ``Add``, and the
  BPU's requantization ``clamp(round_half_even(acc * M / 2**n [+ other * Mb / 2**nb]))``
  (in float64 where provably exact, else in int64), then ``DequantizeLinear(codes,
  s_out, 0)``: bit for bit the compiled model (``rules/integer_layer.py`` says how and
  why; a float32 Conv over dequantized values rounds near-ties the other way). A
  high-precision output is ``float32(acc) * acc_scale``, as ``QTensor.dequantize``.
* **Layers left in float form**: a converted transposed conv (opset 11 has no
  ConvTransposeInteger), int16 inputs / outputs / add operands (ConvInteger and
  QuantizeLinear-10 hold 8-bit integers only), and every weight layer of a *prepared*
  (calibration / QAT) model, whose fake quants compute in float anyway. They are a
  float Conv / ConvTranspose / Gemm on the dequantized input with float weights
  ``q_w * s_w`` (per-channel weights cannot be Q/DQ in opset 11: per-axis QuantizeLinear
  arrived in opset 13): an approximation of the BPU (one LSB at near-ties). Converted
  ones are listed under ``float_layers`` with the reason.
* **Weight scales** are listed one per output channel (or one per tensor), with
  ``axis`` the weight dim of the output channel: 0 for conv / linear
  ``(out, in/groups, ...)``, 1 for a transposed conv ``(in, out/groups, ...)``.
  A grouped transposed conv also records ``"groups"``: its output channel
  ``o = g * (out/groups) + j`` is column ``j`` of the rows of group ``g``
  (rows ``g * (in/groups)`` to ``(g + 1) * (in/groups) - 1``), so scale ``o``
  applies there (see :func:`weight_scale_grid`).
* **Bias** is on the int32 grid ``s_in * s_w`` the BPU adds it on (as
  ``qcompiler.nn.qat._Observed._qbias`` does in eval mode): an int32 initializer of
  the codes (shape ``(1, out, 1, 1)`` for a conv: ``axis`` 1) in an integer layer,
  else stored float ``b_int * s_in * s_w``; its grid goes to the sidecar as a ``qint32`` entry.
* **int16 activations** cannot be expressed: opset-11 QuantizeLinear produces
  int8/uint8 only. They stay float in the graph (no Q/DQ) and are recorded in
  the sidecar with dtype ``qint16``; a mapper that reads the sidecar can apply them.
* **High-precision outputs** (a BPU layer emitting its int32 accumulator) are
  float in the graph and listed under ``high_precision_outputs``.
* **Rescaling ops on int8 values are integer-exact too**: cat, requantize, add / sub / mul /
  matmul / div of feature maps (or with an int8 constant), average pools, prelu, lookup tables and
  nearest resize compute the simulator's integers from the input codes (``rules/quantized.py``;
  docs/onnx_export.md), as a float op between Q/DQ pairs rounds near-ties the other way
  (issue 37). The rest (int16 values, bilinear resize, wider constants) are the float op
  between Q/DQ pairs, which rounds once where the BPU requantizes: equal to the compiled model
  on every model of ``benchmarks/model_coverage.py``, not proven equal in general.

The sidecar (``QuantState.sidecar``) keys every scale by ONNX tensor name::

    {"activations": {tensor: {"scale": s, "dtype": "qint8", "zero_point": 0}},
     "weights": {initializer: {"scales": [...], "axis": 0, "dtype": "qint8"}},
     "high_precision_outputs": [tensor, ...],
     "integer_layers": {tensor: {"kind": "conv2d", "input": int8 tensor, "weight": int8 initializer,
                                 "bias": int32 initializer or null, "accumulator": int32 tensor,
                                 "multiplier": [M...], "shift": [n...], "axis": 1,
                                 "other": int8 tensor or null, "add": {"multiplier": Mb, "shift": nb} or null,
                                 "clamp": [lo, hi], "rounding": "half_to_even",
                                 "evaluated_in": "float64" | "int64", "output": int8 tensor}},
     "float_layers": {onnx node: reason},
     "partitions": {"bpu0": {"placement": "bpu", "nodes": [...], "inputs": [...], "outputs": [...]}}}

``integer_layers`` is keyed by the layer's dequantized output (also in ``activations``);
``multiplier`` / ``shift`` are per output channel along ``axis`` of the accumulator
(1 for a conv, -1 for a linear).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from onnx import TensorProto

from qcompiler.backends.onnx.context import NodeContext, Tensor, to_numpy
from qcompiler.errors import CalibrationError, UnsupportedOpError
from qcompiler.nn.qat import output_channel_scales
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fake_quantize import FakeQuantize, FakeQuantizeBase
from qcompiler.quantization.observer import ObserverBase

# activation dtypes QuantizeLinear-10 can hold (symmetric, zero point 0)
Q_DTYPES = {"qint8": (TensorProto.INT8, np.int8)}


def _f32(v: float) -> float:
    """The float32 value of ``v`` as a python float (stable repr in JSON)."""
    return float(np.float32(v))


class QuantState:
    """Decides and records the quantization of one export.

    ``quantize=False``: a float view (quantizers and stubs are Identities, float
    weights; a converted model gets its dequantized weights but no Q/DQ).
    """

    def __init__(self, quantize: bool) -> None:
        self.quantize = quantize
        self.activations: dict[str, dict] = {}
        self.weights: dict[str, dict] = {}
        self.high_precision: list[str] = []
        self.grid: dict[str, tuple[float, str]] = {}  # tensor -> (scale, dtype) it is quantized at
        self.codes: dict[str, Tensor] = {}  # dequantized int8 tensor -> the int8 tensor it came from
        self.integer_layers: dict[str, dict] = {}  # output tensor -> the layer's integer parameters
        self.float_layers: dict[str, str] = {}  # ONNX node of a weight layer left float -> why

    def renamed(self, old: str, new: str) -> None:
        for table in (self.grid, self.codes, self.integer_layers):
            if old in table:
                table[new] = table.pop(old)

    # -- reading quantizers
    def qparams(self, quantizer: nn.Module, where: str) -> Optional[tuple[float, str]]:
        """(scale, dtype) of a per-tensor activation quantizer, or None for a float export /
        a bare observer that has not observed (a boundary marker of ``qcompiler.partition``)."""
        if not self.quantize:
            return None
        if isinstance(quantizer, FakeQuantize):
            if not getattr(quantizer, "_has_qparams", False):
                raise CalibrationError(f"{where}: the fake quant has no scale yet; calibrate or train "
                                       f"the model before exporting it")
            scale = quantizer.scale
        elif isinstance(quantizer, FakeQuantizeBase):
            if not quantizer.has_observed:
                raise CalibrationError(f"{where}: the calibration quantizer never saw data; run the "
                                       f"calibration model on data before exporting it")
            scale = quantizer.calculate_qparams()[0]
        elif isinstance(quantizer, ObserverBase):
            if not quantizer.has_observed:
                return None
            scale = quantizer.calculate_qparams()[0]
        else:
            raise UnsupportedOpError(f"{where}: cannot read a scale from {type(quantizer).__name__}")
        scale = scale.detach().reshape(-1)
        if scale.numel() != 1:
            raise UnsupportedOpError(f"{where}: a per-channel activation quantizer cannot be expressed in "
                                     f"ONNX opset 11 (QuantizeLinear-10 is per tensor)")
        return float(scale[0]), quantizer.dtype

    # -- activation quantization points
    def activation_point(self, ctx: NodeContext, x: str, quantizer: Optional[nn.Module], path: str, *,
                         always_node: bool = False) -> Tensor:
        """The value of ``x`` after ``quantizer`` (Q/DQ, or ``x`` / an Identity when not quantizing)."""
        qp = self.qparams(quantizer, path) if quantizer is not None else None
        if qp is None:
            return ctx.identity(x) if always_node else x
        return self.quantize_point(ctx, x, qp[0], qp[1], path, always_node=always_node)

    def quantize_point(self, ctx: NodeContext, x: str, scale: float, dtype: str, path: str, *,
                       always_node: bool = False) -> Tensor:
        if not self.quantize:
            return ctx.identity(x) if always_node else x
        if dtype not in Q_DTYPES:  # int16: opset-11 QuantizeLinear has no int16; float, scale in the sidecar
            y = ctx.identity(x) if always_node else x
            self._record(y, scale, dtype)
            return y
        s, z = self._qparam_initializers(ctx, scale, dtype, path)
        q = ctx.make("QuantizeLinear", [x, s, z], tag="quantize", dtype=Q_DTYPES[dtype][0])
        return self.dequantize_codes(ctx, q, scale, dtype, path)

    def dequantize_codes(self, ctx: NodeContext, q: str, scale: float, dtype: str, path: str) -> Tensor:
        """``DequantizeLinear(q, scale, 0)`` of the int8 tensor ``q``: a quantization point (its scale
        in the sidecar) whose integers later integer layers read from ``q`` (:meth:`codes_of`)."""
        s, z = self._qparam_initializers(ctx, scale, dtype, path)
        y = ctx.make("DequantizeLinear", [q, s, z], tag="dequantize", dtype=TensorProto.FLOAT)
        self._record(y, scale, dtype)
        self.codes[y] = Tensor(q)
        return y

    def _qparam_initializers(self, ctx: NodeContext, scale: float, dtype: str, path: str) -> tuple[Tensor, Tensor]:
        return (ctx.initializer(f"{path}.scale", np.array(scale, np.float32)),
                ctx.initializer(f"{path}.zero_point", np.array(0, Q_DTYPES[dtype][1])))

    def _record(self, y: str, scale: float, dtype: str) -> None:
        self.activations[y] = {"scale": _f32(scale), "dtype": dtype, "zero_point": 0}
        self.grid[y] = (float(scale), dtype)

    def codes_of(self, ctx: NodeContext, x: str, path: str) -> Optional[Tensor]:
        """The int8 tensor holding the integers of the quantized value ``x``, or None (not int8).

        A DequantizeLinear output gives its input. A value the graph computed from one with a
        float op that keeps the grid (max pool, reshape, relu of a dequantized tensor: every element
        is some ``float32(q * s)``) is quantized again at that scale: ``float32(q * s) / s`` is
        within ``|q| * 2**-23`` of ``q``, so QuantizeLinear gives back exactly ``q``."""
        if x in self.codes:
            return self.codes[x]
        scale, dtype = self.grid.get(x, (None, None))
        if dtype not in Q_DTYPES:
            return None
        s, z = self._qparam_initializers(ctx, scale, dtype, path)
        q = ctx.make("QuantizeLinear", [x, s, z], tag="codes", dtype=Q_DTYPES[dtype][0])
        self.codes[x] = q
        return q

    def high_precision_output(self, ctx: NodeContext, y: str) -> None:
        if self.quantize:
            self.high_precision.append(y)

    # -- weights
    def layer_params(self, ctx: NodeContext, layer: nn.Module, path: str) -> tuple[Tensor, Optional[Tensor]]:
        """Weight and bias initializers of a conv / conv-transpose / linear layer:
        float, or (quantizing a prepared layer) dequantized int8 and a bias on ``s_in * s_w``."""
        wfq = getattr(layer, "weight_fake_quant", None)
        if not self.quantize or wfq is None:
            w = ctx.param(layer, "weight", path)
            b = ctx.param(layer, "bias", path) if getattr(layer, "bias", None) is not None else None
            return w, b
        where = f"{path}.weight_fake_quant"
        if isinstance(wfq, FakeQuantize):
            if not getattr(wfq, "_has_qparams", False):
                raise CalibrationError(f"{where}: the weight fake quant has no scale yet; calibrate or "
                                       f"train first")
            w_scale = wfq.scale.detach().clone().reshape(-1)
        elif isinstance(wfq, FakeQuantizeBase):
            w_scale = wfq.calculate_qparams()[0].reshape(-1)
        else:
            raise UnsupportedOpError(f"{where}: cannot read a scale from {type(wfq).__name__}")
        axis = 1 if isinstance(layer, nn.ConvTranspose2d) else 0
        weight = layer.weight.detach()
        q = fp.quantize(weight, w_scale, wfq.dtype, axis=axis if w_scale.numel() > 1 else None)
        scales = output_channel_scales(layer, w_scale)  # a grouped transposed conv: repeated per group
        groups = getattr(layer, "groups", 1)
        w_name = self._store_weight(ctx, path, q, scales, axis, groups, wfq.dtype)
        bias = getattr(layer, "bias", None)
        if bias is None:
            return w_name, None
        src = layer.__dict__.get("_qc_input_quantizer")
        qin = self.qparams(src, f"{path} input quantizer") if src is not None else None
        if qin is None:  # the input's scale is unknown: the bias stays float
            return w_name, ctx.param(layer, "bias", path)
        acc = torch.tensor(qin[0], dtype=torch.float64) * scales.double()
        b_int = fp.bias_codes(bias.detach().double(), acc)
        return w_name, self._store_bias(ctx, path, b_int, acc)

    def _store_weight(self, ctx, path, q: torch.Tensor, scales: torch.Tensor, axis: int, groups: int,
                      dtype: str) -> Tensor:
        """The dequantized weight ``q * scale`` as an initializer; its scales (one per output
        channel, or one) go to the sidecar when quantizing."""
        grid = weight_scale_grid(tuple(q.shape), scales, axis, groups, path)
        w_name = ctx.initializer(f"{path}.weight", to_numpy((q.double() * grid).float()))
        if self.quantize:
            entry = {"scales": [_f32(s) for s in scales.reshape(-1).tolist()], "axis": axis, "dtype": dtype}
            if axis == 1 and groups > 1 and scales.numel() > 1:
                entry["groups"] = groups
            self.weights[w_name] = entry
        return w_name

    def _store_bias(self, ctx, path, b_int: torch.Tensor, acc: torch.Tensor) -> Tensor:
        """The bias ``b_int * acc`` (acc: one scale per output channel, or one) as an initializer."""
        acc = acc.reshape(-1)
        if acc.numel() not in (1, b_int.numel()):
            raise UnsupportedOpError(f"{path}: {acc.numel()} accumulator scales for a bias of "
                                     f"{b_int.numel()} channels")
        b_name = ctx.initializer(f"{path}.bias", to_numpy((b_int * acc).float()))
        if self.quantize:
            self.weights[b_name] = {"scales": [float(s) for s in acc.tolist()], "axis": 0, "dtype": "qint32"}
        return b_name

    # -- the table
    def sidecar(self, emitter, partitions=()) -> dict:
        def fin(name: str) -> str:
            return str.__str__(emitter.builder.final_name(name))  # a plain str, not our Tensor
        parts = {}
        final_values = emitter._final_values()
        for p in partitions:
            parts[p.name] = {
                "placement": p.placement,
                "nodes": [n for fx_name in p.nodes for n in emitter.onnx_nodes.get(fx_name, [])],
                "inputs": _flat_names(final_values.get(n) for n in p.inputs),
                "outputs": _flat_names(final_values.get(n) for n in p.outputs),
            }
        return {
            "activations": {fin(k): v for k, v in self.activations.items()},
            "weights": {fin(k): v for k, v in self.weights.items()},
            "high_precision_outputs": [fin(k) for k in self.high_precision],
            "integer_layers": {fin(k): {f: fin(v) if f in _TENSOR_FIELDS and v is not None else v
                                        for f, v in entry.items()}
                               for k, entry in self.integer_layers.items()},
            "float_layers": dict(self.float_layers),
            "partitions": parts,
        }


# fields of an integer_layers entry that name tensors (final names in the sidecar)
_TENSOR_FIELDS = ("input", "other", "weight", "bias", "accumulator", "output")


def _flat_names(values) -> list[str]:
    out = []
    for v in values:
        if isinstance(v, (tuple, list)):
            out.extend(_flat_names(v))
        elif isinstance(v, str):
            out.append(str.__str__(v))
    return out


def weight_scale_grid(shape: tuple, scales: torch.Tensor, axis: int, groups: int, where: str) -> torch.Tensor:
    """``scales`` (one, or one per output channel) laid out to broadcast over a weight of ``shape``.

    Conv / linear weights hold output channel ``o`` at index ``o`` of ``axis`` 0, an ungrouped
    transposed conv at index ``o`` of axis 1. A grouped transposed conv's weight is
    ``(in, out/groups, kh, kw)``: channel ``o = g * (out/groups) + j`` is column ``j`` of the
    ``in/groups`` rows of group ``g``, so its scales form an ``(in, out/groups)`` grid.
    """
    s = scales.detach().double().reshape(-1)
    ones = [1] * len(shape)
    if s.numel() == 1:
        return s.reshape(ones)
    if axis == 1 and groups > 1:
        rows, per = shape[0], shape[1]
        if s.numel() != per * groups or rows % groups:
            raise UnsupportedOpError(f"{where}: {s.numel()} weight scales for a transposed conv with "
                                     f"groups={groups} and weight shape {tuple(shape)} (expected {per * groups})")
        grid = s.reshape(groups, 1, per).expand(groups, rows // groups, per).reshape(rows, per)
        return grid.reshape([rows, per] + ones[2:])
    if s.numel() != shape[axis]:
        raise UnsupportedOpError(f"{where}: {s.numel()} weight scales for weight shape {tuple(shape)} "
                                 f"(expected {shape[axis]} along axis {axis})")
    ones[axis] = -1
    return s.reshape(ones)


# ---------------------------------------------------------------------------
# module rules: quantizers and stubs of prepared models


# ---------------------------------------------------------------------------
# module rules: converted (fixed-point) modules
