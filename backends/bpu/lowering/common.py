"""What several lowering families and the value specs share: integer type names, a
scalar requantization, the relu6 clamp."""

from __future__ import annotations

from typing import Any

import torch

from qcompiler.errors import ConfigError
from qcompiler.quantization import fixed_point as fp

_DTYPE_NAMES = {torch.int8: "qint8", torch.qint8: "qint8", torch.int16: "qint16", torch.int32: "qint32",
                torch.qint32: "qint32"}


def dtype_name(d: Any) -> str:
    """The BPU name ("qint8", "qint16", "qint32") of an integer type given as a name or a torch dtype."""
    if isinstance(d, str) and d in ("qint8", "qint16", "qint32"):
        return str(d)
    name = _DTYPE_NAMES.get(d) if isinstance(d, torch.dtype) else None
    if name is None:
        raise ConfigError(f"unsupported BPU integer type {d!r}; expected qint8, qint16 or qint32")
    return name


def scalar_requant(m: Any) -> dict:
    """A module's one requantization multiplier ``M`` and shift ``n``, as scalar tensors."""
    return {"M": m.M.reshape(()), "n": m.n.reshape(())}


def relu6_top(scale: float, dtype: str) -> int:
    """The upper clamp fixed_point.relu6 uses for ``scale`` (computed by fixed_point itself)."""
    _, qmax = fp.qrange(dtype)
    return int(fp.relu6(torch.tensor([qmax], dtype=torch.int64), scale, dtype)[0])
