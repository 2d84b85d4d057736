"""int8 convs as oneDNN's exact int8 convolution and the channels-last float64 epilogue
(``backends/bpu/onednn_conv.py``), for the layers where both are proven exact."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.native.kernels import abs_sums
from qcompiler.backends.bpu.onednn_conv import NhwcRequant, OnednnConv
from qcompiler.backends.bpu.sim.bounds import AMAX, F32_EXACT, STORAGE
from qcompiler.backends.bpu.sim.epilogue import act_clamp
from qcompiler.backends.bpu.sim.gemm import exact_chunks
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.backends.bpu.sim.reference import fixed_point_weight_layer
from qcompiler.backends.bpu.sim.registry import KernelSpec


def _window_in_padding(L: int, k: int, s: int, p: int, d: int) -> bool:
    """Along one dim of length ``L``: does an output position read only padding (every tap
    ``o*s - p + i*d`` outside ``[0, L)``)?"""
    Lo = (L + 2 * p - d * (k - 1) - 1) // s + 1
    return any(all(not 0 <= o * s - p + i * d < L for i in range(k)) for o in range(max(Lo, 0)))


class _OnednnConvLayer:
    """conv2d of int8 inputs as oneDNN's exact int8 convolution (float32 accumulator with the bias,
    channels-last) and the float64 epilogue :class:`NhwcRequant`; the output stays channels-last.

    Built only when both steps are proven exact for the layer (``build`` returns None otherwise):
    ``128 * max_o sum |w[o]| + max |bias| < 2**24`` over each chunk of input channels (several
    chunks only without groups) and ``NhwcRequant.applies``.
    """

    def __init__(self, conv: OnednnConv, epi: NhwcRequant, ws: Workspace, fallback: Callable) -> None:
        self.conv, self.epi, self.ws, self.fallback = conv, epi, ws, fallback
        self._empty: dict[tuple[int, int], bool] = {}  # (H, W) -> _empty_window

    @staticmethod
    def build(k: KernelSpec) -> Optional["_OnednnConvLayer"]:
        a, T = k.attrs, k.tensors
        w, bias = T["weight"], T.get("bias")
        if k.in_specs[0].dtype != "qint8" or w.dtype != torch.int8:  # int16 weights: the float GEMMs
            return None
        groups = int(a["groups"])
        max_bias = 0 if bias is None else int(bias.to(torch.int64).abs().max())
        # input-channel chunks whose partial sums (+ the bias, added to the first) stay below 2**24
        l1 = abs_sums(w, (2, 3)).numpy()
        chunks = exact_chunks(l1, AMAX["qint8"], F32_EXACT - max_bias)
        if chunks is None or (len(chunks) > 1 and groups != 1):
            return None
        if a["high_precision"]:
            epi = NhwcRequant(None, None, torch.int32)
        else:
            out_dtype = a["out_dtype"]
            add = (int(T["Mb"]), int(T["nb"])) if a["with_add"] else None
            other_amax = AMAX[k.in_specs[1].dtype] if add else 0
            if not NhwcRequant.applies(T["n"], out_dtype, other_amax, add):
                return None
            lo, hi = act_clamp(a)
            epi = NhwcRequant(T["M"], T["n"], STORAGE[out_dtype], lo, hi, add,
                              acc_bound=AMAX["qint8"] * int(l1.sum(axis=1).max(initial=0)) + max_bias,
                              native=k.native)
        conv = OnednnConv(w, bias, a["stride"], a["padding"], a["dilation"], groups, chunks, k.ws)
        return _OnednnConvLayer(conv, epi, k.ws, fixed_point_weight_layer(k.op, k.name))

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 4 or x.dtype != torch.int8 or self._empty_window(x.shape[2], x.shape[3]):
            return self.fallback(x) if other is None else self.fallback(x, other)
        return self.epi(self.conv(x), other, self.ws)

    def _empty_window(self, H: int, W: int) -> bool:
        """True when some output position's window lies wholly in the zero padding (along H or W):
        oneDNN's int8 convolution gets such positions wrong (e.g. a 1x2 kernel of dilation 2
        with padding 1 on a 1-wide input), so the layer runs the exact fallback instead."""
        found = self._empty.get((H, W))
        if found is None:
            c = self.conv
            found = self._empty[(H, W)] = any(_window_in_padding(L, k, s, p, d) for L, k, s, p, d in zip(
                (H, W), c.w.shape[2:], c.stride, c.padding, c.dilation))
        return found
