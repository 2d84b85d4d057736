"""The layout kernels (reshape, flatten, permute, ...): no arithmetic, so one kernel serves every
kernel set; in a plan, a view of its input's buffer costs nothing."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from qcompiler.backends.bpu.program import decode_index
from qcompiler.backends.bpu.sim.registry import reference_kernel


# layout kinds: op kind -> kernel builder from the op's attrs (no arithmetic, exact on any kernel set)
_LAYOUT: dict[str, Callable[[dict], Callable]] = {
    "identity": lambda a: (lambda x: x),
    "reshape": lambda a: (lambda x, shp=tuple(a["shape"]): x.reshape(shp)),
    "flatten": lambda a: (lambda x, s=int(a["start_dim"]), e=int(a["end_dim"]): torch.flatten(x, s, e)),
    "squeeze": lambda a: ((lambda x: x.squeeze()) if a["dim"] is None else (lambda x, d=int(a["dim"]): x.squeeze(d))),
    "unsqueeze": lambda a: (lambda x, d=int(a["dim"]): x.unsqueeze(d)),
    "permute": lambda a: (lambda x, dims=tuple(a["dims"]): x.permute(dims)),
    "transpose": lambda a: (lambda x, d0=int(a["dim0"]), d1=int(a["dim1"]): x.transpose(d0, d1)),
    "getitem": lambda a: (lambda x, idx=decode_index(a["index"]): x[idx]),
}


class _LayoutKernel:
    """A layout op's kernel (``fn``, no arithmetic), and its ``plan_view``: in a plan whose buffer
    holds the input, the op's value where it is a view of that buffer (then it stays one as the
    buffer is rewritten: the op needs no step, and its readers no copy; backends/bpu/sim/plan.py)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, x: Any) -> Any:
        return self.fn(x)

    def plan_view(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        v = self.fn(x)
        shares = isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return v if shares else None  # (a copy, e.g. a reshape of strided memory, would go stale)


for _kind, _make in _LAYOUT.items():
    reference_kernel(_kind)(lambda k, make=_make: _LayoutKernel(make(k.attrs)))
