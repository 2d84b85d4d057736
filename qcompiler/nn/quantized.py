"""Fixed-point modules of a converted model: BPU ops on integers, values as QTensors.

Every module takes and returns :class:`~qcompiler.quantization.qtensor.QTensor`
(symmetric, zero point 0) and computes with ``qcompiler.quantization.fixed_point``,
the one module of BPU integer math that the simulator shares. Scales are
fixed at convert time; rounding is the fixed-point module's (half to even,
like the fake-quant model).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qtensor import QTensor

# Requantization multipliers of 31 bits: M/2**n is within 2**-32 of the real factor, far
# below the float64 error of the fake-quant model's evaluation, so the two round the same
# way except on values within ~1e-8 LSB of a tie; an int32 accumulator times M < 2**62.
MULT_BITS = 31
MAX_SHIFT = 61


def _params(real) -> tuple[torch.Tensor, torch.Tensor]:
    return fp.requant_params(real, mult_bits=MULT_BITS, max_shift=MAX_SHIFT)


def _q(values: torch.Tensor, scale: float) -> QTensor:
    return QTensor(values, float(scale), 0)


def _ints(x: Any) -> Any:
    """The integers of a QTensor (recursively in lists/tuples); other values unchanged."""
    if isinstance(x, QTensor):
        return x.int_repr()
    if isinstance(x, (list, tuple)):
        return type(x)(_ints(v) for v in x)
    return x


class QuantizedModule(nn.Module):
    """Base: a leaf for the tracer, with the op name for dumps."""

    qc_leaf = True
    qc_op = ""


class Quantize(QuantizedModule):
    """Float -> QTensor at the BPU entry: ``clamp(round_half_even(x / s))``."""

    qc_op = "quant"

    def __init__(self, scale: float, dtype: str = "qint8") -> None:
        super().__init__()
        self.scale, self.dtype = float(scale), dtype

    def forward(self, x: torch.Tensor) -> QTensor:
        return _q(fp.quantize(x, self.scale, self.dtype), self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}, dtype={self.dtype}"


class DeQuantize(QuantizedModule):
    """QTensor -> float at the BPU exit (a float passes through)."""

    qc_op = "dequant"

    def forward(self, x: Any) -> Any:
        return x.dequantize() if isinstance(x, QTensor) else x


class Requantize(QuantizedModule):
    """QTensor -> QTensor on another grid: ``clamp(round_half_even(q * M / 2**n))`` with
    ``M / 2**n ~= s_in / s_out``. A QuantStub (or a quantizer after a DeQuantStub) applied to a
    value that is already quantized; the integers of the BPU's ``requantize`` op."""

    qc_op = "requantize"

    def __init__(self, in_scale: float, in_dtype: str, out_scale: float, out_dtype: str) -> None:
        super().__init__()
        self.in_scale, self.in_dtype = float(in_scale), in_dtype
        self.out_scale, self.out_dtype = float(out_scale), out_dtype
        self.M, self.n = _params(self.in_scale / self.out_scale)

    def forward(self, x: QTensor) -> QTensor:
        return _q(fp.requantize(x.int_repr(), self.M, self.n, self.out_dtype, op="requantize"), self.out_scale)

    def extra_repr(self) -> str:
        return (f"in_scale={self.in_scale:.6g} ({self.in_dtype}), out_scale={self.out_scale:.6g}, "
                f"dtype={self.out_dtype}")


class QuantizedWeightLayer(QuantizedModule):
    """conv2d / conv_transpose2d / linear (+add) (+relu|relu6) with int8 weights and int32 bias.

    acc = sum(q_in * q_w) + bias (exact, int64, checked against int32); then
    either the high-precision output (acc itself, per-channel scale s_in*s_w)
    or ``requantize(acc)`` [+ the add operand at its own multiplier] and the
    activation as an integer clamp.
    """

    def __init__(self, kind: str, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                 in_scale: float, out_scale: Optional[float], out_dtype: str, geometry: dict,
                 act: Optional[str] = None, other_scale: Optional[float] = None, name: str = "") -> None:
        super().__init__()
        self.kind, self.qc_op, self.name = kind, kind, name
        self.geometry = dict(geometry)
        self.in_scale, self.out_scale, self.out_dtype, self.act = float(in_scale), out_scale, out_dtype, act
        self.register_buffer("q_weight", q_weight)
        self.register_buffer("w_scale", w_scale.float())
        # the accumulator's scale s_in * s_w: the exact product of two float32 values (float64),
        # as the fake-quant model evaluates it; the bias is rounded onto that grid
        acc_scale = self.in_scale * self.w_scale.double()
        self.register_buffer("acc_scale", acc_scale)
        self.register_buffer("bias", None if bias is None else
                             fp.bias_codes(bias.double(), acc_scale).to(torch.int32))
        self.with_add = other_scale is not None
        if out_scale is not None:
            M, n = _params(acc_scale / out_scale)
            self.register_buffer("M", M)
            self.register_buffer("n", n)
            if self.with_add:
                Mb, nb = _params(float(other_scale) / out_scale)
                self.register_buffer("Mb", Mb)
                self.register_buffer("nb", nb)

    @property
    def channel_axis(self) -> int:
        return 1 if self.kind != "linear" else -1

    def output_clamp(self) -> tuple[int, int]:
        """The integer range ``[lo, hi]`` of the output: the out dtype's, narrowed by the fused
        relu (``lo = 0``) or relu6 (``hi`` = fixed_point.relu6's top), as ``forward`` clamps."""
        lo, hi = fp.qrange(self.out_dtype)
        if self.act == "relu":
            return int(fp.relu(torch.tensor(lo))), hi
        if self.act == "relu6":
            top = fp.relu6(torch.tensor([hi], dtype=torch.int64), self.out_scale, self.out_dtype)
            return int(fp.relu(torch.tensor(lo))), int(top[0])
        return lo, hi

    def _accumulate(self, q: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        if self.kind == "conv2d":
            return fp.int_conv2d(q, self.q_weight, self.bias, g["stride"], g["padding"], g["dilation"],
                                 g["groups"], op=self.name)
        if self.kind == "linear":
            return fp.int_linear(q, self.q_weight, self.bias, op=self.name)
        return _int_conv_transpose2d(q, self.q_weight, self.bias, g, self.name)

    def forward(self, x: QTensor, other: Optional[QTensor] = None) -> QTensor:
        acc = fp.check_accumulator(self._accumulate(x.int_repr()), 32, op=self.name)
        if self.out_scale is None:  # high-precision output: the int32 accumulator with its scale
            scales = self.acc_scale.float()
            return QTensor(acc.to(torch.int32), scales, torch.zeros_like(scales, dtype=torch.int64),
                           axis=self.channel_axis % acc.dim())
        if self.with_add:
            y = _add_per_channel(acc, self.M, self.n, other.int_repr(), self.Mb, self.nb, self.out_dtype,
                                 self.channel_axis, self.name)
        else:
            y = fp.requantize(acc, self.M, self.n, self.out_dtype, axis=self.channel_axis, op=self.name)
        if self.act == "relu":
            y = fp.relu(y)
        elif self.act == "relu6":
            y = fp.relu6(y, self.out_scale, self.out_dtype)
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        out = "int32 (high precision)" if self.out_scale is None else f"out_scale={self.out_scale:.6g}"
        extra = "".join(f", {k}" for k in (["add"] if self.with_add else []) + ([self.act] if self.act else []))
        return f"{self.kind}{extra}, weight={tuple(self.q_weight.shape)} int8, in_scale={self.in_scale:.6g}, {out}"


def _add_per_channel(acc, M, n, qb, Mb, nb, out_dtype, axis, op):
    """round_half_even(acc * M[c] / 2**n[c] + qb * Mb / 2**nb), exactly: one rounding."""
    acc = acc.to(torch.int64)
    shape = [1] * acc.dim()
    shape[axis] = -1
    M, n = M.reshape(shape).to(torch.int64), n.reshape(shape).to(torch.int64)
    y = fp.round_scaled_sum(acc * M, n, qb.to(torch.int64) * int(Mb), int(nb))
    lo, hi = fp.qrange(out_dtype)
    return y.clamp(lo, hi).to(fp.storage_dtype(out_dtype))


def _int_conv_transpose2d(q, w, bias, g, op):
    """Exact transposed conv: float64 is exact while every partial sum stays below 2**53."""
    k = w.shape[0] // g["groups"] * w.shape[2] * w.shape[3]
    bound = k * max(1, int(q.abs().max()) if q.numel() else 1) * max(1, int(w.abs().max()))
    if bound >= 2 ** 53:
        raise fp.AccumulatorOverflow(op, bound, 2 ** 53, what="transposed-conv partial sum")
    out = F.conv_transpose2d(q.double(), w.double(), None, g["stride"], g["padding"], g["output_padding"],
                             g["groups"], g["dilation"]).to(torch.int64)
    return out + bias.to(torch.int64).reshape(1, -1, 1, 1) if bias is not None else out


class QuantizedAdd(QuantizedModule):
    """a + alpha*b (or a - alpha*b) of two feature maps brought to the output scale with their own
    multipliers. ``alpha`` (torch.add/sub's keyword) is folded into b's multiplier; a negative
    alpha turns an add into a sub and back, so ``sub`` and ``qc_op`` say what the BPU computes."""

    def __init__(self, sa: float, sb: float, out_scale: float, out_dtype: str, sub: bool = False,
                 alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = float(alpha)
        self.sub = bool(sub) != (self.alpha < 0)
        self.qc_op = "sub" if self.sub else "add"
        self.out_scale, self.out_dtype = float(out_scale), out_dtype
        self.params = fp.add_params(sa, sb * abs(self.alpha), out_scale, mult_bits=MULT_BITS, max_shift=MAX_SHIFT)

    def forward(self, a: QTensor, b: QTensor, *rest, alpha: Any = None) -> QTensor:
        # ``alpha`` is the traced call's keyword, already folded into the multipliers
        fn = fp.int_sub if self.sub else fp.int_add
        return _q(fn(a.int_repr(), *self.params[:2], b.int_repr(), *self.params[2:], self.out_dtype, op=self.qc_op),
                  self.out_scale)


class QuantizedMul(QuantizedModule):
    """a * b of two feature maps, or a * constant: one requantization of the exact product."""

    qc_op = "mul"

    def __init__(self, sa: float, sb: Optional[float], out_scale: float, out_dtype: str,
                 constant: Optional[float] = None) -> None:
        super().__init__()
        self.out_scale, self.out_dtype, self.constant = float(out_scale), out_dtype, constant
        factor = sa * (sb if sb is not None else 1.0) / out_scale
        if constant is not None:
            factor *= abs(constant)
        self.M, self.n = _params(factor)
        self.sign = -1 if constant is not None and constant < 0 else 1

    def forward(self, a: Any, b: Any) -> QTensor:
        if isinstance(a, QTensor) and isinstance(b, QTensor):
            return _q(fp.int_mul(a.int_repr(), b.int_repr(), self.M, self.n, self.out_dtype), self.out_scale)
        q = a if isinstance(a, QTensor) else b
        y = fp.requantize(self.sign * q.int_repr().to(torch.int64), self.M, self.n, self.out_dtype, op="mul")
        return _q(y, self.out_scale)


class QuantizedConstantOperand(QuantizedModule):
    """add / sub / mul of a feature map and a constant the module holds as integers.

    The constant (a buffer or parameter quantized per tensor like a weight, or a Python number
    added / subtracted, as ``sign(c)`` at scale ``|c|``, exact; ``x * number`` is a
    :class:`QuantizedMul`) sits at operand position ``const_index`` of the
    traced call; the call's other operand is the feature map. add/sub: one rounding of
    ``q0*M0/2**n0 +- q1*M1/2**n1`` (``alpha`` folded into operand 1's multiplier, its sign
    into add/sub, as :class:`QuantizedAdd`); mul: ``requantize(qx * qc)``. The factors are
    taken in float64 from the scales, so a number's scale ``|c|`` is not rounded to float32.
    """

    def __init__(self, op: str, x_scale: float, constant: torch.Tensor, const_scale: float, const_index: int,
                 out_scale: float, out_dtype: str, alpha: float = 1.0) -> None:
        super().__init__()
        if op not in ("add", "sub", "mul") or const_index not in (0, 1):
            raise ValueError(f"QuantizedConstantOperand: op {op!r} at index {const_index!r}")
        self.alpha = float(alpha)
        self.qc_op = op if op == "mul" else ("sub" if (op == "sub") != (self.alpha < 0) else "add")
        self.const_index, self.const_scale = int(const_index), float(const_scale)
        self.x_scale, self.out_scale, self.out_dtype = float(x_scale), float(out_scale), out_dtype
        self.register_buffer("constant", constant)
        so = self.out_scale
        if op == "mul":
            self.M, self.n = (int(v) for v in _params(self.x_scale * self.const_scale / so))
        else:
            scales = [self.x_scale, self.const_scale] if self.const_index == 1 else [self.const_scale, self.x_scale]
            scales[1] *= abs(self.alpha)
            (M0, n0), (M1, n1) = (_params(v / so) for v in scales)
            self.params = (int(M0), int(n0), int(M1), int(n1))

    def operands(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The integer operands in the traced call's order."""
        return (q, self.constant) if self.const_index == 1 else (self.constant, q)

    def forward(self, x: QTensor, *rest, **kwargs) -> QTensor:
        a, b = self.operands(x.int_repr())
        if self.qc_op == "mul":
            return _q(fp.int_mul(a, b, self.M, self.n, self.out_dtype, op="mul"), self.out_scale)
        fn = fp.int_sub if self.qc_op == "sub" else fp.int_add
        return _q(fn(a, *self.params[:2], b, *self.params[2:], self.out_dtype, op=self.qc_op), self.out_scale)

    def extra_repr(self) -> str:
        side = "x, const" if self.const_index == 1 else "const, x"
        return (f"{self.qc_op}({side}), constant={tuple(self.constant.shape)} at scale {self.const_scale:.6g}, "
                f"out_scale={self.out_scale:.6g}")


class QuantizedConstant(QuantizedModule):
    """A constant as a BPU value (its integers and per-tensor scale), for ops that read their
    operands as values: a cat, a layer fused with ``+ buffer``."""

    qc_op = "constant"

    def __init__(self, q: torch.Tensor, scale: float, dtype: str) -> None:
        super().__init__()
        self.out_scale, self.out_dtype = float(scale), dtype
        self.register_buffer("value", q)

    def forward(self, *args, **kwargs) -> QTensor:
        return _q(self.value, self.out_scale)

    def extra_repr(self) -> str:
        return f"{tuple(self.value.shape)} {self.out_dtype}, scale={self.out_scale:.6g}"


class QuantizedDiv(QuantizedModule):
    """a / b of two feature maps: ``qa`` times a reciprocal-table entry of ``qb`` (one integer
    multiplier and shift per divisor code, ``s_a / (s_b * s_out * qb)``), rounded once.
    A divisor code 0 saturates (``fixed_point.int_div``)."""

    qc_op = "div"

    def __init__(self, sa: float, sb: float, b_dtype: str, out_scale: float, out_dtype: str) -> None:
        super().__init__()
        self.sa, self.sb, self.b_dtype = float(sa), float(sb), b_dtype
        self.out_scale, self.out_dtype = float(out_scale), out_dtype
        M, n = fp.div_params(sa, sb, out_scale, b_dtype, mult_bits=MULT_BITS, max_shift=MAX_SHIFT)
        self.register_buffer("M", M)
        self.register_buffer("n", n)

    def forward(self, a: QTensor, b: QTensor, *rest, **kwargs) -> QTensor:
        y = fp.int_div(a.int_repr(), b.int_repr(), self.M, self.n, self.b_dtype, self.out_dtype, op="div")
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        return f"table={self.M.numel()} entries ({self.b_dtype} divisor), out_scale={self.out_scale:.6g}"


class QuantizedCat(QuantizedModule):
    qc_op = "cat"

    def __init__(self, in_scales: Sequence[float], out_scale: float, out_dtype: str) -> None:
        super().__init__()
        self.in_scales, self.out_scale, self.out_dtype = [float(s) for s in in_scales], float(out_scale), out_dtype

    def forward(self, tensors: Sequence[QTensor], dim: int = 0) -> QTensor:
        ints = [t.int_repr() for t in tensors]
        return _q(fp.int_cat(ints, self.in_scales, self.out_scale, self.out_dtype, dim=dim, mult_bits=MULT_BITS,
                             max_shift=MAX_SHIFT),
                  self.out_scale)


class QuantizedMatmul(QuantizedModule):
    qc_op = "matmul"

    def __init__(self, sa: float, sb: float, out_scale: float, out_dtype: str) -> None:
        super().__init__()
        self.out_scale, self.out_dtype = float(out_scale), out_dtype
        self.M, self.n = _params(sa * sb / out_scale)

    def forward(self, a: QTensor, b: QTensor) -> QTensor:
        acc = fp.check_accumulator(fp.int_matmul(a.int_repr(), b.int_repr()), 32, op="matmul")
        return _q(fp.requantize(acc, self.M, self.n, self.out_dtype, op="matmul"), self.out_scale)


class QuantizedLookup(QuantizedModule):
    """Element-wise non-linearity as a table built at convert time.

    ``exponent``: pow's constant exponent ``c`` (the table samples ``x ** c``), kept so that every
    reader of the module (lowering, ONNX export) knows which function the table is of; ``arguments``:
    the call's other arguments the table was built with (gelu's ``approximate``, elu's ``alpha``), for
    the export's float form."""

    def __init__(self, op: str, fn: Callable, in_scale: float, in_dtype: str, out_scale: float, out_dtype: str,
                 exponent: Optional[float] = None, arguments: Optional[dict] = None):
        super().__init__()
        self.qc_op, self.in_dtype, self.out_scale = op, in_dtype, float(out_scale)
        self.in_scale, self.exponent = float(in_scale), (None if exponent is None else float(exponent))
        self.arguments = dict(arguments or {})
        self.register_buffer("table", fp.build_lut(fn, in_scale, out_scale, in_dtype, out_dtype))

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        return _q(fp.apply_lut(x.int_repr(), self.table, self.in_dtype), self.out_scale)


class QuantizedAvgPool(QuantizedModule):
    """Average pooling: exact integer window sum, requantized by s_in / (k*s_out). Global when kernel is None."""

    def __init__(self, in_scale: float, out_scale: float, out_dtype: str, kernel=None, stride=None, padding=0,
                 keepdim: bool = True) -> None:
        super().__init__()
        self.qc_op = "avg_pool2d" if kernel is not None else "global_avg_pool"
        self.in_scale, self.out_scale, self.out_dtype = float(in_scale), float(out_scale), out_dtype
        self.kernel, self.stride, self.padding, self.keepdim = kernel, stride, padding, keepdim

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        q = x.int_repr()
        if self.kernel is None:
            y = fp.int_global_avg_pool(q, self.in_scale, self.out_scale, self.out_dtype, mult_bits=MULT_BITS,
                                       max_shift=MAX_SHIFT)
            if not self.keepdim:
                y = y.reshape(y.shape[:-2])
        else:
            y = fp.int_avg_pool2d(q, self.kernel, self.stride, self.padding, in_scale=self.in_scale,
                                  out_scale=self.out_scale, out_dtype=self.out_dtype, mult_bits=MULT_BITS,
                                  max_shift=MAX_SHIFT)
        return _q(y, self.out_scale)


class QuantizedResize(QuantizedModule):
    """interpolate: nearest copies integers (scale kept); bilinear is evaluated in float64 on
    the integers and rounded half to even at the output scale (deterministic, not yet a
    fixed-point kernel)."""

    qc_op = "interpolate"

    def __init__(self, mode: str, in_scale: float, out_scale: float, out_dtype: str, size, align_corners) -> None:
        super().__init__()
        self.mode, self.in_scale, self.out_scale, self.out_dtype = mode, float(in_scale), float(out_scale), out_dtype
        self.size, self.align_corners = tuple(size), align_corners

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        q = x.int_repr().double()
        if self.mode == "nearest":
            y = F.interpolate(q, size=self.size, mode="nearest")
            v = y * (self.in_scale / self.out_scale)
        else:
            y = F.interpolate(q, size=self.size, mode="bilinear", align_corners=bool(self.align_corners))
            v = y * (self.in_scale / self.out_scale)
        lo, hi = fp.qrange(self.out_dtype)
        return _q(torch.round(v).clamp(lo, hi).to(fp.storage_dtype(self.out_dtype)), self.out_scale)


class QuantizedPReLU(QuantizedModule):
    """prelu / leaky_relu: ``q >= 0`` requantized by s_in/s_out, negatives by slope*s_in/s_out.

    The slope is per channel (dim 1) for a PReLU with several parameters, else one value.
    """

    def __init__(self, op: str, slope: torch.Tensor, in_scale: float, out_scale: float, out_dtype: str,
                 top: Optional[float] = None) -> None:
        super().__init__()
        self.qc_op, self.out_scale, self.out_dtype = op, float(out_scale), out_dtype
        slope = slope.detach().double().reshape(-1)
        self.register_buffer("slope", slope.float())
        # relu6: an upper clamp at round(6 / s_out), as the fake-quant model rounds min(x, 6)
        self.top = None if top is None else min(
            int(torch.round(torch.tensor(top, dtype=torch.float64) / out_scale)), fp.qrange(out_dtype)[1])
        self.Mp, self.np_ = _params(in_scale / out_scale)
        self.register_buffer("Mn", _params(slope * in_scale / out_scale)[0])
        self.register_buffer("nn_", _params(slope * in_scale / out_scale)[1])

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        q = x.int_repr()
        axis = 1 if self.Mn.numel() > 1 else None
        pos = fp.requantize(q, self.Mp, self.np_, self.out_dtype, op=self.qc_op)
        neg = fp.requantize(q, self.Mn, self.nn_, self.out_dtype, axis=axis, op=self.qc_op)
        y = torch.where(q >= 0, pos, neg)
        if self.top is not None:
            y = torch.minimum(y, torch.tensor(self.top, dtype=y.dtype))
        return _q(y, self.out_scale)


class QuantizedSameScale(QuantizedModule):
    """Ops that keep the input's grid: relu, max pool, layout ops, identities.

    What it computes is stored explicitly (so lowering, export and pickling can
    read it): a torch ``function`` or a tensor ``method`` name applied to the
    integers with the node's other arguments, or the ``float_module`` it
    replaces (max pool, flatten); with none of them it is the identity.
    """

    def __init__(self, op: str, *, function: Optional[Callable] = None, method: Optional[str] = None,
                 float_module: Optional[nn.Module] = None, dtype: str = "qint8") -> None:
        super().__init__()
        self.qc_op, self.function, self.method, self.dtype = op, function, method, dtype
        self.float_module = float_module

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        q = x.int_repr()
        if self.qc_op == "relu":
            y = fp.relu(q)
        elif self.qc_op == "relu6":
            y = fp.relu6(q, x.q_scale(), self.dtype)
        elif self.function is not None:
            y = self.function(q, *_ints(args), **_ints(kwargs))
        elif self.method is not None:
            y = getattr(q, self.method)(*_ints(args), **_ints(kwargs))
        elif isinstance(self.float_module, nn.MaxPool2d):
            m = self.float_module
            y = fp.int_max_pool2d(q, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
        elif isinstance(self.float_module, nn.Flatten):
            y = torch.flatten(q, self.float_module.start_dim, self.float_module.end_dim)
        else:
            y = q  # identity, dropout in eval
        return QTensor(y, x.q_scale(), 0)

    def extra_repr(self) -> str:
        return self.qc_op


class QuantizedLayerNorm(QuantizedModule):
    """layer_norm over the last ``len(normalized_shape)`` dims on integers
    (``fixed_point.int_layer_norm``): exact group sums, a fixed-point rsqrt from a table, and
    gamma / beta folded into per-element multipliers and bias codes on the output grid. The float
    affine parameters are kept (``weight`` / ``bias``, None when absent) for the float export."""

    qc_op = "layer_norm"

    def __init__(self, normalized_shape: Sequence[int], weight: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], eps: float, in_scale: float, in_dtype: str, out_scale: float,
                 out_dtype: str) -> None:
        super().__init__()
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        self.dims = len(self.normalized_shape)
        self.eps, self.in_scale, self.in_dtype = float(eps), float(in_scale), in_dtype
        self.out_scale, self.out_dtype = float(out_scale), out_dtype
        group = 1
        for s in self.normalized_shape:
            group *= s
        self.eps_units = fp.layer_norm_eps_units(self.eps, self.in_scale, group)
        self.register_buffer("weight", None if weight is None else weight.detach().float().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        M, n, B = fp.layer_norm_params(weight, bias, self.normalized_shape, self.out_scale)
        self.register_buffer("M", M)
        self.register_buffer("n", n)
        self.register_buffer("B", B)

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        y = fp.int_layer_norm(x.int_repr(), self.dims, self.eps_units, self.M, self.n, self.B, self.out_dtype,
                              op="layer_norm")
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        affine = "affine" if self.weight is not None or self.bias is not None else "no affine"
        return (f"{self.normalized_shape}, {affine}, eps={self.eps:g}, in {self.in_dtype}, "
                f"out_scale={self.out_scale:.6g} ({self.out_dtype})")


class QuantizedSoftmax(QuantizedModule):
    """softmax along ``dim`` (nash): the exponential table, int64 sum and one integer division of
    ``fixed_point.int_softmax``; table and ``(M, n)`` are built here once, at convert time."""

    qc_op = "softmax"

    def __init__(self, dim: int, in_scale: float, in_dtype: str, out_scale: float, out_dtype: str) -> None:
        super().__init__()
        self.dim, self.in_dtype, self.out_dtype = int(dim), in_dtype, out_dtype
        self.in_scale, self.out_scale = float(in_scale), float(out_scale)
        self.register_buffer("table", fp.softmax_exp_table(self.in_scale, in_dtype))
        self.M, self.n = fp.softmax_params(self.out_scale)

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        y = fp.int_softmax(x.int_repr(), self.dim, self.table, self.M, self.n, self.out_dtype, op=self.qc_op)
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, {self.in_dtype} -> {self.out_dtype}"


class QuantizedLogSoftmax(QuantizedModule):
    """log_softmax along ``dim`` (nash): ``fixed_point.int_log_softmax`` (softmax's exponential table and
    sum, ``ln(S)`` from a 17-entry exponent table and a 32769-entry mantissa table), built at convert time."""

    qc_op = "log_softmax"

    def __init__(self, dim: int, in_scale: float, in_dtype: str, out_scale: float, out_dtype: str) -> None:
        super().__init__()
        self.dim, self.in_dtype, self.out_dtype = int(dim), in_dtype, out_dtype
        self.in_scale, self.out_scale = float(in_scale), float(out_scale)
        self.register_buffer("table", fp.softmax_exp_table(self.in_scale, in_dtype))
        self.M, self.n, log_k, log_f = fp.log_softmax_params(self.in_scale, self.out_scale)
        self.register_buffer("log_k", log_k)
        self.register_buffer("log_f", log_f)

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        y = fp.int_log_softmax(x.int_repr(), self.dim, self.table, self.M, self.n, self.log_k, self.log_f,
                               self.out_dtype, op=self.qc_op)
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, {self.in_dtype} -> {self.out_dtype}"


# ---- reductions over any dims (nash) ---------------------------------------------------------


class QuantizedReduce(QuantizedModule):
    """sum / mean / amax / amin over ``dims`` (sorted, non-negative) of a ``rank``-D input.

    sum and mean: the exact integer sum requantized once by ``(M, n)``
    (:func:`~qcompiler.quantization.fixed_point.reduce_params`; a mean folds ``1 / count`` into the
    multiplier). amax / amin: the selected integer on the input's grid (``out_scale == in_scale``).
    The node's own ``dim`` / ``keepdim`` arguments are read at convert time and ignored here.
    """

    def __init__(self, mode: str, dims, keepdim: bool, in_shape, in_scale: float, out_scale: float,
                 out_dtype: str) -> None:
        super().__init__()
        rank = len(in_shape)
        self.qc_op, self.keepdim, self.rank = mode, bool(keepdim), rank
        self.dims = fp.reduce_dims(dims, rank, mode)
        self.count = 1
        for d in self.dims:
            self.count *= int(in_shape[d])
        self.in_scale, self.out_scale, self.out_dtype = float(in_scale), float(out_scale), out_dtype
        self.M, self.n = fp.reduce_params(mode, self.count, in_scale, out_scale, mult_bits=MULT_BITS,
                                          max_shift=MAX_SHIFT)

    def forward(self, x: QTensor, *args, **kwargs) -> QTensor:
        y = fp.int_reduce(x.int_repr(), self.qc_op, self.dims, self.keepdim, self.M, self.n, self.out_dtype,
                          op=self.qc_op)
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        return f"{self.qc_op}, dims={self.dims}, keepdim={self.keepdim}"


class QuantizedMaskedSoftmax(QuantizedModule):
    """``masked_softmax`` along ``dim`` (nash): ``fixed_point.int_masked_softmax`` on the scores' codes
    and the mask's 0/1 codes (a second input quantized at scale 1.0, int8: exact); softmax's exponential
    table and ``(M, n)``, built here once."""

    qc_op = "masked_softmax"

    def __init__(self, dim: int, fill_mask_is_true: bool, in_scale: float, in_dtype: str, out_scale: float,
                 out_dtype: str) -> None:
        super().__init__()
        self.dim, self.fill_mask_is_true = int(dim), bool(fill_mask_is_true)
        self.in_dtype, self.out_dtype = in_dtype, out_dtype
        self.in_scale, self.out_scale = float(in_scale), float(out_scale)
        self.register_buffer("table", fp.softmax_exp_table(self.in_scale, in_dtype))
        self.M, self.n = fp.softmax_params(self.out_scale)

    def forward(self, x: QTensor, mask: QTensor, *args, **kwargs) -> QTensor:
        y = fp.int_masked_softmax(x.int_repr(), mask.int_repr(), self.dim, self.fill_mask_is_true, self.table,
                                  self.M, self.n, self.out_dtype, op=self.qc_op)
        return _q(y, self.out_scale)

    def extra_repr(self) -> str:
        fill = "mask" if self.fill_mask_is_true else "not mask"
        return f"dim={self.dim}, fill where {fill}, {self.in_dtype} -> {self.out_dtype}"
