"""Recurrent rules: LSTM (ONNX gate order iofc, one layer per node, time-major)."""

from __future__ import annotations

import numpy as np
import torch.nn as nn

from qcompiler.backends.onnx.context import (
    NodeContext,
    to_numpy,
)
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import I64

_IFGO_TO_IOFC = (0, 3, 1, 2)  # torch chunks (i, f, g, o) -> ONNX (i, o, f, c)


def _reorder_gates(a: np.ndarray, hidden: int) -> np.ndarray:
    chunks = [a[k * hidden:(k + 1) * hidden] for k in range(4)]
    return np.concatenate([chunks[k] for k in _IFGO_TO_IOFC], axis=0)


def _lstm_weights(ctx: NodeContext, m: nn.LSTM, layer: int, nd: int) -> tuple[str, str, str]:
    """Layer ``layer``'s W, R, B initializers (gates reordered to iofc, B = [Wb, Rb]) for ``nd`` directions."""
    H, path = m.hidden_size, ctx.path
    sfx = [f"_l{layer}", f"_l{layer}_reverse"][:nd]
    W = np.stack([_reorder_gates(to_numpy(getattr(m, f"weight_ih{s}")), H) for s in sfx])
    R = np.stack([_reorder_gates(to_numpy(getattr(m, f"weight_hh{s}")), H) for s in sfx])
    if m.bias:
        B = np.stack([np.concatenate([_reorder_gates(to_numpy(getattr(m, f"bias_ih{s}")), H),
                                      _reorder_gates(to_numpy(getattr(m, f"bias_hh{s}")), H)]) for s in sfx])
    else:
        B = np.zeros((nd, 8 * H), np.float32)
    return (ctx.initializer(f"{path}.W_l{layer}", W), ctx.initializer(f"{path}.R_l{layer}", R),
            ctx.initializer(f"{path}.B_l{layer}", B))


def _initial_state(ctx: NodeContext, hx, layer: int, layers: int, nd: int) -> tuple[str, str]:
    """Layer ``layer``'s (h0, c0): torch stacks all layers' states on dim 0; "" when not given."""
    if hx is None:
        return "", ""
    h_all, c_all = hx
    if layers == 1:
        return h_all, c_all
    starts = ctx.const("layer_start", [layer * nd], I64)
    ends = ctx.const("layer_end", [(layer + 1) * nd], I64)
    ax = ctx.const("axis0", [0], I64)
    return (ctx.make("Slice", [h_all, starts, ends, ax], tag=f"h0_l{layer}"),
            ctx.make("Slice", [c_all, starts, ends, ax], tag=f"c0_l{layer}"))


def _merge_directions(ctx: NodeContext, y: str, layer: int, nd: int) -> str:
    """ONNX Y ``[seq, num_directions, batch, hidden]`` -> torch's ``[seq, batch, num_directions * hidden]``."""
    if nd == 1:
        return ctx.make("Squeeze", [y], tag=f"y_l{layer}", axes=[1])
    t = ctx.make("Transpose", [y], tag=f"y_t_l{layer}", perm=[0, 2, 1, 3])
    return ctx.make("Reshape", [t, ctx.const("merge_dirs", [0, 0, -1], I64)], tag=f"y_l{layer}")


@emits("lstm")
def lstm(ctx: NodeContext):
    """nn.LSTM -> one ONNX LSTM per layer, time-major (batch_first is transposed), initial
    (h, c) sliced per layer; returns ``(output, (h_n, c_n))`` like torch."""
    m = ctx.module
    if not isinstance(m, nn.LSTM):
        raise ctx.unsupported("only nn.LSTM modules")
    if getattr(m, "proj_size", 0):
        raise ctx.unsupported("LSTM with proj_size")
    shape = ctx.shape()
    if shape is None or len(shape) != 3:
        raise ctx.unsupported("LSTM needs a batched 3-D input")
    x = ctx.x()
    hx = ctx.value(ctx.arg(1, "hx", None))
    L, nd = m.num_layers, 2 if m.bidirectional else 1
    if m.batch_first:
        x = ctx.make("Transpose", [x], tag="time_major", perm=[1, 0, 2])
    hs, cs = [], []
    for layer in range(L):
        w, r, b = _lstm_weights(ctx, m, layer, nd)
        h0, c0 = _initial_state(ctx, hx, layer, L, nd)
        ins = [x, w, r, b, "", h0, c0]
        while ins[-1] == "":
            ins.pop()
        y, yh, yc = ctx.make("LSTM", ins, outputs=3, tag=None if layer == 0 else f"lstm_l{layer}",
                             hidden_size=m.hidden_size, direction="bidirectional" if nd == 2 else "forward")
        x = _merge_directions(ctx, y, layer, nd)
        hs.append(yh)
        cs.append(yc)
    out = ctx.make("Transpose", [x], tag="batch_major", perm=[1, 0, 2]) if m.batch_first else x
    h_n = hs[0] if L == 1 else ctx.make("Concat", hs, tag="h_n", axis=0)
    c_n = cs[0] if L == 1 else ctx.make("Concat", cs, tag="c_n", axis=0)
    return (out, (h_n, c_n))
