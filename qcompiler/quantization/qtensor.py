"""QTensor: qcompiler's own quantized tensor.

A ``QTensor`` is a plain integer tensor plus quantization parameters
(per-tensor ``scale``/``zero_point`` or per-channel ``scales``/``zero_points``
along an ``axis``).  It deliberately does not use torch's deprecated quantized
dtypes (``torch.qint8`` ...): the integers live in an ordinary int8/uint8/
int16/int32 tensor, so every torch op on them is well defined and they
serialize like any other tensor.

Arithmetic contract (shared with the rest of the compiler)::

    q = clamp(torch.round(float32(x) / float32(scale)) + zero_point, qmin, qmax)
    x' = float32(q - zero_point) * float32(scale)

``torch.round`` rounds half to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2).

``torch.save(qt)`` pickles only tensors, ints, floats, strings and the
rebuild function :func:`_rebuild_qtensor`, which is allow-listed for
``torch.load(..., weights_only=True)`` when this module is imported.
"""

from __future__ import annotations

import enum
import operator
from typing import Any

import torch

from qcompiler.errors import ArtifactError, ConfigError, InternalError


class QDType(enum.StrEnum):
    """Quantized integer dtypes; each maps to the plain integer dtype that stores it."""

    qint8 = "qint8"
    quint8 = "quint8"
    qint16 = "qint16"
    qint32 = "qint32"

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE[self]

    @property
    def quant_min(self) -> int:
        return torch.iinfo(_STORAGE[self]).min

    @property
    def quant_max(self) -> int:
        return torch.iinfo(_STORAGE[self]).max


qint8 = QDType.qint8
quint8 = QDType.quint8
qint16 = QDType.qint16
qint32 = QDType.qint32

_STORAGE: dict[QDType, torch.dtype] = {
    QDType.qint8: torch.int8,
    QDType.quint8: torch.uint8,
    QDType.qint16: torch.int16,
    QDType.qint32: torch.int32,
}
_FROM_STORAGE = {v: k for k, v in _STORAGE.items()}
# zero point that makes the integer grid symmetric around 0 (torch's convention)
_SYMMETRIC_ZP = {QDType.qint8: 0, QDType.quint8: 128, QDType.qint16: 0, QDType.qint32: 0}
_ALLOWED = ", ".join(d.value for d in QDType)

# bump when the pickled layout of a QTensor changes; loaders reject newer versions
_FORMAT_VERSION = 1


# --------------------------------------------------------------------------- validation


def _qdtype(dtype: Any, where: str) -> QDType:
    if isinstance(dtype, str):
        try:
            return QDType(dtype)
        except ValueError:
            pass
    raise ConfigError(f"{where}: unknown dtype {dtype!r}; allowed: {_ALLOWED}")


def _scale_value(scale: Any, where: str, name: str) -> float:
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.is_complex():
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ConfigError(f"{where}: {name} must be a number, got {type(scale).__name__}")
    scale = float(scale)
    _check_scales(torch.tensor([scale], dtype=torch.float64), where, name)
    return scale


def _check_scales(scales: torch.Tensor, where: str, name: str) -> None:
    """Scales must be finite and > 0, also once rounded to float32 (the compute dtype)."""
    s32 = scales.to(torch.float32)
    bad = ~(torch.isfinite(scales) & (scales > 0) & torch.isfinite(s32) & (s32 > 0))
    if bool(bad.any()):
        value = scales[bad][0].item()
        raise ConfigError(
            f"{where}: {name} must be finite and > 0 (also as float32), got {value!r}"
        )


def _zero_point_value(zero_point: Any, qdtype: QDType, where: str, name: str) -> int:
    if isinstance(zero_point, torch.Tensor) and zero_point.numel() == 1:
        if zero_point.is_floating_point() or zero_point.is_complex():
            raise ConfigError(f"{where}: {name} must be an integer, got {zero_point!r}")
        zero_point = zero_point.item()
    if isinstance(zero_point, bool):
        raise ConfigError(f"{where}: {name} must be an integer, got {zero_point!r}")
    try:
        zp = operator.index(zero_point)
    except TypeError:
        raise ConfigError(f"{where}: {name} must be an integer, got {zero_point!r}") from None
    _check_zero_points(torch.tensor([zp], dtype=torch.int64), qdtype, where, name)
    return zp


def _check_zero_points(zps: torch.Tensor, qdtype: QDType, where: str, name: str) -> None:
    bad = (zps < qdtype.quant_min) | (zps > qdtype.quant_max)
    if bool(bad.any()):
        raise ConfigError(
            f"{where}: {name} {zps[bad][0].item()} is outside the {qdtype.value} range "
            f"[{qdtype.quant_min}, {qdtype.quant_max}]"
        )


def _per_channel_params(
    scales: Any, zero_points: Any, axis: Any, shape: torch.Size, qdtype: QDType,
    where: str, names: tuple[str, str],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate per-channel qparams against ``shape``; returns (float64 scales, int64 zps, axis)."""
    s_name, z_name = names
    ndim = len(shape)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ConfigError(f"{where}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ConfigError(
            f"{where}: axis {axis} is out of range for a tensor with {ndim} dims "
            f"(valid: {-ndim}..{ndim - 1})"
        )
    axis %= ndim
    channels = shape[axis]

    try:
        # Python floats are doubles: keep them exact instead of rounding via float32
        s = scales.detach() if isinstance(scales, torch.Tensor) else torch.as_tensor(scales, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"{where}: {s_name} must be a 1-D tensor or sequence of numbers") from None
    if s.dim() != 1 or s.is_complex() or s.dtype == torch.bool:
        raise ConfigError(
            f"{where}: {s_name} must be a 1-D tensor or sequence of numbers, got shape {tuple(s.shape)}"
        )
    if s.numel() != channels:
        raise ConfigError(
            f"{where}: {s_name} has {s.numel()} entries but the tensor has {channels} "
            f"channels along axis {axis}"
        )
    s = s.to(device="cpu", dtype=torch.float64)
    _check_scales(s, where, s_name)

    try:
        z = torch.as_tensor(zero_points).detach()
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"{where}: {z_name} must be a 1-D tensor or sequence of integers") from None
    if z.dim() != 1 or z.is_floating_point() or z.is_complex() or z.dtype == torch.bool:
        raise ConfigError(
            f"{where}: {z_name} must be a 1-D integer tensor or sequence of ints, "
            f"got dtype {z.dtype} shape {tuple(z.shape)}"
        )
    if z.numel() != channels:
        raise ConfigError(
            f"{where}: {z_name} has {z.numel()} entries but the tensor has {channels} "
            f"channels along axis {axis}"
        )
    z = z.to(device="cpu", dtype=torch.int64)
    _check_zero_points(z, qdtype, where, z_name)
    return s, z, axis


def _as_float32(x: Any, where: str, name: str) -> torch.Tensor:
    """The float32 values to quantize; NaN has no integer and is rejected."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, (bool, int, float)):
            x = torch.tensor(float(x))
        else:
            raise ConfigError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise ConfigError(f"{where}: {name} must be real, got dtype {x.dtype}")
    x = x.detach().to(torch.float32)
    if bool(torch.isnan(x).any()):
        raise ConfigError(f"{where}: {name} contains NaN, which cannot be quantized")
    return x


def _quantize(x32: torch.Tensor, scale: Any, zero_point: Any, qdtype: QDType) -> torch.Tensor:
    """The contract: clamp(round_half_even(x / scale) + zp, qmin, qmax), division in float32.

    ``scale``/``zero_point`` are float32/int64 tensors (broadcastable) or numbers.
    The sum and clamp run in float64 so qint32 bounds are exact.
    """
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale, dtype=torch.float32)
    q = torch.round(x32 / scale.to(x32.device)).to(torch.float64)
    if isinstance(zero_point, torch.Tensor):
        zero_point = zero_point.to(x32.device)
    q = torch.clamp(q + zero_point, qdtype.quant_min, qdtype.quant_max)
    return q.to(qdtype.storage_dtype)


def _channel_shape(ndim: int, axis: int) -> list[int]:
    shape = [1] * ndim
    shape[axis] = -1
    return shape


# --------------------------------------------------------------------------- public API


def quantize_per_tensor(x: torch.Tensor, scale: float, zero_point: int, dtype: QDType | str) -> QTensor:
    """Quantize ``x`` with one scale and zero point: clamp(round(x / scale) + zero_point)."""
    where = "quantize_per_tensor"
    qdtype = _qdtype(dtype, where)
    s = _scale_value(scale, where, "scale")
    zp = _zero_point_value(zero_point, qdtype, where, "zero_point")
    x32 = _as_float32(x, where, "x")
    q = _quantize(x32, torch.tensor(s, dtype=torch.float32), zp, qdtype)
    return QTensor._make(q, qdtype, s, zp, None, None, None)


def quantize_per_channel(
    x: torch.Tensor, scales: Any, zero_points: Any, axis: int, dtype: QDType | str
) -> QTensor:
    """Quantize ``x`` with one scale/zero point per index along ``axis``."""
    where = "quantize_per_channel"
    qdtype = _qdtype(dtype, where)
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    s, z, axis = _per_channel_params(
        scales, zero_points, axis, x.shape, qdtype, where, ("scales", "zero_points")
    )
    x32 = _as_float32(x, where, "x")
    bshape = _channel_shape(x32.dim(), axis)
    q = _quantize(x32, s.to(torch.float32).view(bshape), z.view(bshape), qdtype)
    return QTensor._make(q, qdtype, None, None, s, z, axis)


class QTensor:
    """An integer tensor plus its quantization parameters.

    ``QTensor(int_repr, scale, zero_point)`` wraps existing integers (per-tensor);
    ``QTensor(int_repr, scales, zero_points, axis=k)`` per-channel.  The dtype
    follows from ``int_repr.dtype`` (int8 -> qint8, uint8 -> quint8, int16 ->
    qint16, int32 -> qint32).  ``int_repr`` is used as-is, not copied.

    Indexing and the layout methods return views that share the integers,
    as torch tensors do; ``clone()`` copies.
    """

    __slots__ = ("_int", "_dtype", "_scale", "_zero_point", "_scales", "_zero_points", "_axis")
    is_quantized = True

    def __init__(self, int_repr: torch.Tensor, scale: Any, zero_point: Any, axis: int | None = None):
        where = "QTensor"
        if not isinstance(int_repr, torch.Tensor) or int_repr.dtype not in _FROM_STORAGE:
            got = int_repr.dtype if isinstance(int_repr, torch.Tensor) else type(int_repr).__name__
            raise ConfigError(
                f"{where}: int_repr must be an int8, uint8, int16 or int32 tensor, got {got}"
            )
        qdtype = _FROM_STORAGE[int_repr.dtype]
        self._int = int_repr
        self._dtype = qdtype
        if axis is None:
            self._scale = _scale_value(scale, where, "scale")
            self._zero_point = _zero_point_value(zero_point, qdtype, where, "zero_point")
            self._scales = self._zero_points = self._axis = None
        else:
            self._scales, self._zero_points, self._axis = _per_channel_params(
                scale, zero_point, axis, int_repr.shape, qdtype, where, ("scale", "zero_point")
            )
            self._scale = self._zero_point = None

    @classmethod
    def _make(cls, q, qdtype, scale, zero_point, scales, zero_points, axis) -> QTensor:
        """Internal constructor for already-validated parameters."""
        self = cls.__new__(cls)
        self._int, self._dtype = q, qdtype
        self._scale, self._zero_point = scale, zero_point
        self._scales, self._zero_points, self._axis = scales, zero_points, axis
        return self

    def _like(self, q: torch.Tensor, axis: int | None = None) -> QTensor:
        """Same qparams on new integers (per-channel: at ``axis``)."""
        return QTensor._make(
            q, self._dtype, self._scale, self._zero_point, self._scales, self._zero_points,
            axis if self._axis is not None else None,
        )

    @property
    def _per_channel(self) -> bool:
        return self._axis is not None

    # ----------------------------------------------------------------- accessors

    @property
    def dtype(self) -> QDType:
        return self._dtype

    @property
    def shape(self) -> torch.Size:
        return self._int.shape

    def size(self, dim: int | None = None):
        return self._int.size() if dim is None else self._int.size(dim)

    def dim(self) -> int:
        return self._int.dim()

    def numel(self) -> int:
        return self._int.numel()

    def int_repr(self) -> torch.Tensor:
        """The stored integers (shares memory; ``clone()`` it to detach)."""
        return self._int

    def qscheme(self) -> str:
        """``per_{tensor,channel}_{symmetric,affine}``; symmetric when every zero point is
        the dtype's centre (0 for signed dtypes, 128 for quint8)."""
        centre = _SYMMETRIC_ZP[self._dtype]
        if self._per_channel:
            sym = bool((self._zero_points == centre).all())
            return "per_channel_symmetric" if sym else "per_channel_affine"
        return "per_tensor_symmetric" if self._zero_point == centre else "per_tensor_affine"

    def q_scale(self) -> float:
        if self._per_channel:
            raise ConfigError(
                "q_scale: this QTensor is quantized per channel; use q_per_channel_scales()"
            )
        return self._scale

    def q_zero_point(self) -> int:
        if self._per_channel:
            raise ConfigError(
                "q_zero_point: this QTensor is quantized per channel; "
                "use q_per_channel_zero_points()"
            )
        return self._zero_point

    def _need_per_channel(self, name: str, instead: str) -> None:
        if not self._per_channel:
            raise ConfigError(f"{name}: this QTensor is quantized per tensor; use {instead}()")

    def q_per_channel_scales(self) -> torch.Tensor:
        """Float64 scales, one per channel (a copy)."""
        self._need_per_channel("q_per_channel_scales", "q_scale")
        return self._scales.clone()

    def q_per_channel_zero_points(self) -> torch.Tensor:
        """Int64 zero points, one per channel (a copy)."""
        self._need_per_channel("q_per_channel_zero_points", "q_zero_point")
        return self._zero_points.clone()

    def q_per_channel_axis(self) -> int:
        self._need_per_channel("q_per_channel_axis", "q_scale")
        return self._axis

    # ----------------------------------------------------------------- values

    def _qparams_f32(self) -> tuple[Any, Any]:
        """(float32 scale, zero point), per-channel shaped to broadcast against the ints."""
        if not self._per_channel:
            return torch.tensor(self._scale, dtype=torch.float32), self._zero_point
        bshape = _channel_shape(self._int.dim(), self._axis)
        return self._scales.to(torch.float32).view(bshape), self._zero_points.view(bshape)

    def dequantize(self) -> torch.Tensor:
        """float32((q - zero_point)) * float32(scale)."""
        scale, zp = self._qparams_f32()
        if isinstance(zp, torch.Tensor):
            zp = zp.to(self._int.device)
        return (self._int.to(torch.int64) - zp).to(torch.float32) * scale.to(self._int.device)

    def item(self) -> float:
        """The dequantized value of a one-element QTensor."""
        return self.dequantize().item()

    def equal(self, other: Any) -> bool:
        """True iff ``other`` is a QTensor with the same dtype, qparams, shape and integers."""
        if not isinstance(other, QTensor) or other._dtype is not self._dtype:
            return False
        if self._per_channel != other._per_channel:
            return False
        if self._per_channel:
            same = (
                self._axis == other._axis
                and torch.equal(self._scales, other._scales)
                and torch.equal(self._zero_points, other._zero_points)
            )
        else:
            same = self._scale == other._scale and self._zero_point == other._zero_point
        return same and self._int.shape == other._int.shape and torch.equal(self._int, other._int)

    # ----------------------------------------------------------------- layout

    def clone(self) -> QTensor:
        out = self._like(self._int.clone(), self._axis)
        if self._per_channel:
            out._scales, out._zero_points = self._scales.clone(), self._zero_points.clone()
        return out

    def contiguous(self) -> QTensor:
        return self._like(self._int.contiguous(), self._axis)

    def transpose(self, dim0: int, dim1: int) -> QTensor:
        q = self._int.transpose(dim0, dim1)
        if not self._per_channel:
            return self._like(q)
        a, b = dim0 % q.dim(), dim1 % q.dim()
        axis = b if self._axis == a else a if self._axis == b else self._axis
        return self._like(q, axis)

    def permute(self, *dims) -> QTensor:
        if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)):
            dims = tuple(dims[0])
        q = self._int.permute(*dims)
        if not self._per_channel:
            return self._like(q)
        order = [d % q.dim() for d in dims]
        return self._like(q, order.index(self._axis))

    def _no_per_channel_reshape(self, name: str) -> None:
        if self._per_channel:
            raise ConfigError(
                f"{name}: not allowed on a per-channel QTensor (axis={self._axis}), it would "
                "scramble which scale belongs to which value; use transpose/permute/indexing, "
                "or dequantize first"
            )

    def reshape(self, *shape) -> QTensor:
        self._no_per_channel_reshape("reshape")
        return self._like(self._int.reshape(*shape))

    def view(self, *shape) -> QTensor:
        self._no_per_channel_reshape("view")
        return self._like(self._int.view(*shape))

    # ----------------------------------------------------------------- indexing

    def __getitem__(self, idx: Any) -> QTensor:
        q = self._int[idx]  # torch validates the index and raises its usual errors
        if not self._per_channel:
            return self._like(q)
        plan = _channel_after_index(idx, self._int.dim(), self._axis)
        if plan[0] == "drop":
            c = plan[1]
            return QTensor._make(
                q, self._dtype, float(self._scales[c]), int(self._zero_points[c]), None, None, None
            )
        _, axis, sel = plan
        if not 0 <= axis < q.dim():
            raise InternalError(f"indexing with {idx!r} put the channel axis at {axis}, outside {tuple(q.shape)}")
        return QTensor._make(
            q, self._dtype, None, None, self._scales[sel], self._zero_points[sel], axis
        )

    def __setitem__(self, idx: Any, value: Any) -> None:
        """Store ``value`` (real numbers or a QTensor) requantized with this QTensor's qparams."""
        if isinstance(value, QTensor):
            if (
                not value._per_channel
                and not self._per_channel
                and value._dtype is self._dtype
                and value._scale == self._scale
                and value._zero_point == self._zero_point
            ):
                self._int[idx] = value._int.to(self._int.device)
                return
            value = value.dequantize()
        v = _as_float32(value, "QTensor.__setitem__", "value").to(self._int.device)
        scale, zp = self._qparams_f32()
        if self._per_channel:
            shape = self._int.shape
            scale, zp = scale.expand(shape)[idx], zp.expand(shape)[idx]
        self._int[idx] = _quantize(v, scale, zp, self._dtype)

    # ----------------------------------------------------------------- printing / pickling

    def __repr__(self) -> str:
        prefix = "QTensor("
        indent = " " * len(prefix)
        if self.numel() == 0:
            body = "[]"
        else:
            values = self.dequantize().cpu().to(torch.get_default_dtype())
            body = repr(values)[len("tensor("):-1].replace("\n" + " " * len("tensor("), "\n" + indent)
        if self._per_channel:
            qparams = (
                f"quantization_scheme={self.qscheme()},\n{indent}scale={self._scales!r},\n"
                f"{indent}zero_point={self._zero_points!r}, axis={self._axis}"
            )
        else:
            qparams = (
                f"quantization_scheme={self.qscheme()}, scale={self._scale!r}, "
                f"zero_point={self._zero_point}"
            )
        return (
            f"{prefix}{body}, size={tuple(self.shape)}, dtype={self._dtype.value},\n"
            f"{indent}{qparams})"
        )

    def __reduce_ex__(self, protocol):
        # Only tensors, ints, floats, strings and None, so weights_only loading can accept it.
        if self._per_channel:
            args = (self._scales, self._zero_points, self._axis)
        else:
            args = (self._scale, self._zero_point, None)
        return (_rebuild_qtensor, (_FORMAT_VERSION, self._int, self._dtype.name, *args))

    def __reduce__(self):
        return self.__reduce_ex__(2)


def _rebuild_qtensor(version, int_repr, dtype_name, scale, zero_point, axis) -> QTensor:
    """Unpickle a QTensor (allow-listed for ``torch.load(weights_only=True)``)."""
    if not isinstance(version, int) or version > _FORMAT_VERSION or version < 1:
        raise ArtifactError(
            f"QTensor pickle format version {version!r} is not supported (this qcompiler "
            f"reads up to {_FORMAT_VERSION}); upgrade qcompiler"
        )
    try:
        qt = QTensor(int_repr, scale, zero_point, axis)
    except ConfigError as e:
        raise ArtifactError(f"corrupted QTensor in checkpoint: {e}") from None
    if qt.dtype.name != dtype_name:
        raise ArtifactError(
            f"corrupted QTensor in checkpoint: dtype {dtype_name!r} does not match "
            f"its {int_repr.dtype} integers"
        )
    return qt


torch.serialization.add_safe_globals([_rebuild_qtensor])


# --------------------------------------------------------------------------- index analysis


def _is_int_index(it: Any) -> bool:
    if isinstance(it, bool):
        return False
    if isinstance(it, torch.Tensor):
        return it.dim() == 0 and not it.is_floating_point() and it.dtype != torch.bool
    if isinstance(it, (list, tuple, slice)) or it is None or it is Ellipsis:
        return False
    return hasattr(it, "__index__") and getattr(it, "ndim", 0) == 0


def _channel_after_index(idx: Any, ndim: int, axis: int):
    """Where the channel ``axis`` of an ``ndim``-dim tensor goes under ``t[idx]``.

    Returns ``("drop", channel)`` when an integer removes the axis, else
    ``("keep", new_axis, selector)`` with the selector (slice or 1-D index
    tensor) to apply to the per-channel scales.  Integers are removed and a
    single advanced index stays in place (torch's rule); layouts that mix the
    channel axis into advanced indexing cannot stay per-channel and raise.
    """
    items = idx if isinstance(idx, tuple) else (idx,)
    parsed = []  # (kind, item, dims consumed, dims produced)
    for it in items:
        if it is None:
            parsed.append(("new", it, 0, 1))
        elif it is Ellipsis:
            parsed.append(("ellipsis", it, 0, 0))
        elif isinstance(it, slice):
            parsed.append(("slice", it, 1, 1))
        elif _is_int_index(it):
            parsed.append(("int", operator.index(it), 1, 0))
        elif isinstance(it, bool) or (isinstance(it, torch.Tensor) and it.dim() == 0):
            parsed.append(("adv", it, 0, 1))  # scalar bool mask: adds a dim
        else:
            t = torch.as_tensor(it)
            if t.dtype == torch.bool:
                parsed.append(("adv", t, t.dim(), 1))
            else:
                parsed.append(("adv", t, 1, t.dim()))
    n_adv = sum(p[0] == "adv" for p in parsed)
    consumed = sum(p[2] for p in parsed)
    expanded = []
    for p in parsed:
        if p[0] == "ellipsis":
            expanded.extend([("slice", slice(None), 1, 1)] * (ndim - consumed))
        else:
            expanded.append(p)

    def unsupported(why: str) -> ConfigError:
        return ConfigError(
            f"indexing a per-channel QTensor (axis={axis}) with {idx!r}: {why}; index in "
            "simpler steps, or dequantize first"
        )

    d = o = 0
    result = None
    for kind, it, n_in, n_out in expanded:
        hits = d <= axis < d + n_in
        if kind == "int" and hits:
            return ("drop", it)
        if kind == "slice" and hits:
            result = ("keep", o, it)
        elif kind == "adv" and hits:
            if n_adv > 1 or n_in != 1 or it.dim() != 1:
                raise unsupported("the channel axis would be mixed with other dims")
            result = ("keep", o, it.to("cpu"))
        d += n_in
        o += n_out
    if n_adv > 1:
        raise unsupported("several advanced indices move the channel axis unpredictably")
    if result is None:
        result = ("keep", o + (axis - d), slice(None))
    return result


__all__ = [
    "QDType",
    "QTensor",
    "qint8",
    "quint8",
    "qint16",
    "qint32",
    "quantize_per_tensor",
    "quantize_per_channel",
]
