"""One image's convolution cut into bands of output rows, computed on idle worker threads at once.

A batch of one sample cannot be split over the worker threads of :mod:`qcompiler.parallel`,
so at 2 threads one worker would compute the whole model while the other waits.  A worker
that was lent idle workers (:func:`~qcompiler.parallel.part_budget` > 1) cuts each large
convolution into that many bands of output rows instead (:func:`~qcompiler.parallel.run_parts`):

* output rows ``r0:r1`` read the padded input rows ``r0*sh .. (r1-1)*sh + dh*(kh-1)`` (the halo
  rows are read by two bands; nothing is computed twice);
* each band runs the same kind of layer, built once (lazily) for the op with **no** vertical
  padding and the smaller horizontal one; the band's input is a view of the input's rows,
  with explicit zero rows only where the band reaches the true top or bottom border (and the
  horizontal excess of an asymmetric ``(t, l, b, r)`` padding), so each band computes exactly
  the accumulators of its rows in the unsplit layer;
* a fused add reads the same rows of its other operand; the bands' outputs are joined along
  the rows.

Every value is an exact integer computed by the same formula as in the unsplit layer (which
exact kernel computes it does not change it), so the result is identical, bit for bit
(tests/test_row_split.py checks it against the unsplit layer over random geometries).  The
split is off by default (:data:`ENABLED`: not yet measured faster end to end).  Only layers with at least :data:`MIN_WORK` units of work (:meth:`RowSplitConv.work`) are cut: handing
a band to another thread, the second kernel call and the join cost tens of microseconds, more
than a small layer's half saves (docs/performance.md).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.program import BpuOp
from qcompiler.parallel import part_budget, run_parts
from qcompiler.quantization import fixed_point as fp

__all__ = ["RowSplitConv", "MIN_WORK", "OUTPUT_COST", "ENABLED", "band_rows"]

# A layer's work: its multiply-adds (N*Ho*Wo*O*C/groups*kh*kw) plus OUTPUT_COST per output
# element (the epilogue and memory traffic: a depthwise conv has few multiply-adds per output
# but takes as long as a dense 3x3 of the same size).  A layer is cut from MIN_WORK; both
# measured with benchmarks/row_split.py on the 2-core machine of docs/performance.md.
OUTPUT_COST = 256
MIN_WORK = 60_000_000
# Off by default: on the shared 2-core machine of docs/performance.md ("Batch 1 at 2 threads:
# the row split") whole models were 0-30% slower at batch 1 with the split on, in every
# end-to-end comparison made (under load); a gain on an idle machine is not measured yet.
# Each layer copies this at construction (``RowSplitConv.enabled``).
ENABLED = False


def band_rows(Ho: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous bands of ``Ho`` output rows, sizes differing by at most one (none empty)."""
    n = max(1, min(n, Ho))
    return [(i * Ho // n, (i + 1) * Ho // n) for i in range(n)]


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.stride(1) == 1 and x.shape[1] > 1


def _band_input(x: torch.Tensor, s: int, e: int, left: int, right: int) -> torch.Tensor:
    """Padded-input rows ``s:e`` of ``x`` (rows outside ``[0, H)`` are zeros) with ``left`` /
    ``right`` zero columns: a view when nothing is padded, else a zero-filled copy in ``x``'s layout."""
    N, C, H, W = x.shape
    top, bottom = min(max(-s, 0), e - s), min(max(e - H, 0), e - s)
    lo, hi = max(s, 0), min(e, H)
    if top == bottom == left == right == 0:
        return x[:, :, lo:hi]
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    band = torch.empty((N, C, e - s, W + left + right), dtype=x.dtype, memory_format=fmt).zero_()
    if hi > lo:
        band[:, :, top:top + hi - lo, left:left + W].copy_(x[:, :, lo:hi])
    return band


class RowSplitConv:
    """A conv2d kernel (``whole``) that, given idle workers, computes its output in row bands.

    ``build_band(op)`` builds the same kind of kernel for ``op`` (called once, for the op with
    vertical padding 0).  A call with ``enabled`` False (:data:`ENABLED`), without idle workers,
    with less than ``min_work`` (:data:`MIN_WORK`), fewer than 2 output rows or a non-4-d input
    runs ``whole``.
    """

    def __init__(self, op: BpuOp, whole: Callable, build_band: Callable[[BpuOp], Callable],
                 min_work: int = MIN_WORK) -> None:
        a = op.attrs
        self.op, self.whole, self._build_band, self.min_work = op, whole, build_band, min_work
        self.enabled = ENABLED
        O, Cg, kh, kw = op.tensors["weight"].shape
        self.O, self.kh, self.kw = int(O), int(kh), int(kw)
        self.work_per_position = int(O) * (int(Cg) * int(kh) * int(kw) + OUTPUT_COST)  # per output (row, column)
        self.sh, self.sw = fp._pair(a["stride"])
        self.dh, self.dw = fp._pair(a["dilation"])
        self.t, self.l, self.b, self.r = fp.pads4(a["padding"])
        pw = min(self.l, self.r)
        self.left, self.right = self.l - pw, self.r - pw  # the horizontal excess, padded per band
        self._band_op = replace(op, attrs={**a, "padding": [0, pw]})
        self._band: Optional[Callable] = None
        self._lock = threading.Lock()

    def out_rows(self, H: int) -> int:
        return (H + self.t + self.b - self.dh * (self.kh - 1) - 1) // self.sh + 1

    def out_cols(self, W: int) -> int:
        return (W + self.l + self.r - self.dw * (self.kw - 1) - 1) // self.sw + 1

    def work(self, x_shape) -> int:
        """Multiply-adds plus ``OUTPUT_COST`` per output element, for an input of ``x_shape``."""
        N, _, H, W = x_shape
        return N * self.out_rows(H) * self.out_cols(W) * self.work_per_position

    def _band_kernel(self) -> Callable:
        if self._band is None:
            with self._lock:
                if self._band is None:
                    self._band = self._build_band(self._band_op)
        return self._band

    def plan_step(self, x: torch.Tensor, other: Optional[torch.Tensor] = None, **kw) -> Optional[tuple]:
        """The whole layer's plan step, if it has one (a plan cuts its steps' rows itself); none while
        this split is ``enabled`` (it then runs as asked, op by op)."""
        step = getattr(self.whole, "plan_step", None)
        if step is None or self.enabled:
            return None
        return step(x, **kw) if other is None else step(x, other, **kw)

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = part_budget() if self.enabled else 1
        if n < 2 or x.dim() != 4:
            return self.whole(x) if other is None else self.whole(x, other)
        Ho, Wo = self.out_rows(x.shape[2]), self.out_cols(x.shape[3])
        if (Ho < 2 or Wo < 1 or self.work(x.shape) < self.min_work
                or (other is not None and (other.dim() != 4 or other.shape[2] != Ho))):  # (a broadcast operand)
            return self.whole(x) if other is None else self.whole(x, other)
        bands = band_rows(Ho, n)
        kernel = self._band_kernel()
        span = self.dh * (self.kh - 1) + 1

        def part(i: int) -> torch.Tensor:
            r0, r1 = bands[i]
            s = r0 * self.sh - self.t
            xb = _band_input(x, s, s + (r1 - r0 - 1) * self.sh + span, self.left, self.right)
            return kernel(xb) if other is None else kernel(xb, other[:, :, r0:r1])

        return torch.cat(run_parts(part, len(bands)), dim=2)
