"""Recurrent rules: nn.LSTM / nn.GRU / nn.RNN and their cells, one parameterised rule ``_rnn(kind)``.

Every kind becomes one ONNX node of its type per layer (time-major ``[seq, batch, input]``,
states ``[directions, batch, hidden]``): a sequence module's input is transposed when
``batch_first`` and lifted to a batch of one when unbatched; a cell is a sequence of one
step. The weights are reordered to ONNX's gate order (:data:`KINDS`), biases stacked as
``B = [Wb, Rb]`` (zeros without bias). torch's GRU applies the reset gate after the
recurrent matmul, which is ONNX's ``linear_before_reset=1``. Outputs have torch's
structure: ``(output, h_n)``, ``(output, (h_n, c_n))``, ``h'`` or ``(h', c')``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch.nn as nn

from qcompiler.backends.onnx.context import (
    NodeContext,
    Tensor,
    is_tensor,
    to_numpy,
)
from qcompiler.backends.onnx.registry import register
from qcompiler.backends.onnx.rules.common import I64


@dataclass(frozen=True)
class RnnKind:
    """One recurrent module class as ONNX sees it."""

    module: type  # the torch class the rule emits
    onnx_op: str  # "LSTM" | "GRU" | "RNN"
    gate_order: tuple[int, ...]  # ONNX gate k is torch's chunk gate_order[k]
    states: int  # 2 for LSTM's (h, c), else 1
    cell: bool  # one step, weights without a layer suffix


# ONNX gate k is torch's chunk gate_order[k]: LSTM (i, f, g, o) -> (i, o, f, c); GRU (r, z, n) -> (z, r, h)
KINDS: dict[str, RnnKind] = {
    "lstm": RnnKind(nn.LSTM, "LSTM", (0, 3, 1, 2), states=2, cell=False),
    "gru": RnnKind(nn.GRU, "GRU", (1, 0, 2), states=1, cell=False),
    "rnn": RnnKind(nn.RNN, "RNN", (0,), states=1, cell=False),
    "lstm_cell": RnnKind(nn.LSTMCell, "LSTM", (0, 3, 1, 2), states=2, cell=True),
    "gru_cell": RnnKind(nn.GRUCell, "GRU", (1, 0, 2), states=1, cell=True),
    "rnn_cell": RnnKind(nn.RNNCell, "RNN", (0,), states=1, cell=True),
}
_ACTIVATION = {"tanh": "Tanh", "relu": "Relu"}  # nn.RNN / nn.RNNCell nonlinearity -> ONNX activation


def _reorder_gates(a: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    chunks = np.split(a, len(order), axis=0)
    return np.concatenate([chunks[k] for k in order], axis=0)


def _weights(ctx: NodeContext, kind: RnnKind, m: nn.Module, layer: int, nd: int) -> list[Tensor]:
    """Layer ``layer``'s W, R, B initializers for ``nd`` directions (gates in ONNX order, B = [Wb, Rb])."""
    base = "" if kind.cell else f"_l{layer}"
    sfx = [base, f"{base}_reverse"][:nd]

    def stack(attr: str) -> np.ndarray:
        return np.stack([_reorder_gates(to_numpy(getattr(m, f"{attr}{s}")), kind.gate_order) for s in sfx])

    W, R = stack("weight_ih"), stack("weight_hh")
    B = np.concatenate([stack("bias_ih"), stack("bias_hh")], axis=1) if m.bias \
        else np.zeros((nd, 2 * W.shape[1]), W.dtype)
    tag = "" if kind.cell else f"_l{layer}"
    return [ctx.initializer(f"{ctx.path}.{n}{tag}", a) for n, a in (("W", W), ("R", R), ("B", B))]


# attributes beyond hidden_size and direction, per ONNX op: (module, directions) -> attrs
_EXTRA_ATTRS: dict[str, Callable[[nn.Module, int], dict[str, Any]]] = {
    "GRU": lambda m, nd: {"linear_before_reset": 1},  # torch resets after the recurrent matmul
    "RNN": lambda m, nd: {"activations": [_ACTIVATION[m.nonlinearity]] * nd},
}


def _attrs(kind: RnnKind, m: nn.Module, nd: int) -> dict[str, Any]:
    extra = _EXTRA_ATTRS.get(kind.onnx_op)
    return {"hidden_size": m.hidden_size, "direction": "bidirectional" if nd == 2 else "forward",
            **(extra(m, nd) if extra else {})}


def _lift_axes(kind: RnnKind, batched: bool) -> tuple[list[int], list[int]]:
    """The axes that lift torch's input and states to ONNX's ``[seq, batch, input]`` and
    ``[dirs, batch, hidden]``: a cell adds the step (and batch) axis, an unbatched sequence the batch."""
    if kind.cell:
        return ([0], [0]) if batched else ([0, 1], [0, 1])
    return ([], []) if batched else ([1], [1])


def _reshape_axes(ctx: NodeContext, op: str, t: str, axes: list[int], tag: str) -> str:
    return ctx.make(op, [t], tag=tag, axes=axes) if axes else t


def _states(ctx: NodeContext, kind: RnnKind, hx: Any, axes: list[int]) -> list[Optional[str]]:
    """The initial states as ``[h0]`` / ``[h0, c0]`` lifted to ONNX's rank, ``None`` each when not given."""
    if hx is None:
        return [None] * kind.states
    hx = list(hx) if isinstance(hx, (tuple, list)) else [hx]
    if len(hx) != kind.states or not all(is_tensor(h) for h in hx):
        raise ctx.unsupported(f"the initial state must be {kind.states} tensor(s)")
    return [_reshape_axes(ctx, "Unsqueeze", h, axes, f"state{i}") for i, h in enumerate(hx)]


def _layer_state(ctx: NodeContext, state: Optional[str], layer: int, layers: int, nd: int, i: int) -> str:
    """Layer ``layer``'s slice of a state torch stacks over layers on dim 0; "" when not given."""
    if state is None:
        return ""
    if layers == 1:
        return state
    starts, ends = ctx.const(f"l{layer}_start", [layer * nd], I64), ctx.const(f"l{layer}_end", [(layer + 1) * nd], I64)
    return ctx.make("Slice", [state, starts, ends, ctx.const("axis0", [0], I64)], tag=f"state{i}_l{layer}")


def _merge_directions(ctx: NodeContext, y: str, layer: int, nd: int) -> str:
    """ONNX Y ``[seq, num_directions, batch, hidden]`` -> torch's ``[seq, batch, num_directions * hidden]``."""
    if nd == 1:
        return ctx.make("Squeeze", [y], tag=f"y_l{layer}", axes=[1])
    t = ctx.make("Transpose", [y], tag=f"y_t_l{layer}", perm=[0, 2, 1, 3])
    return ctx.make("Reshape", [t, ctx.const("merge_dirs", [0, 0, -1], I64)], tag=f"y_l{layer}")


def _layers(ctx: NodeContext, kind: RnnKind, m: nn.Module, x: str, states: list) -> tuple[str, list[str]]:
    """One ONNX node per layer, each layer's output feeding the next; returns the last Y
    (torch layout) and the final states stacked over layers like torch's."""
    layers = 1 if kind.cell else m.num_layers
    nd = 2 if getattr(m, "bidirectional", False) else 1
    finals: list[list[str]] = [[] for _ in range(kind.states)]
    for layer in range(layers):
        ins = [x, *_weights(ctx, kind, m, layer, nd), ""]
        ins += [_layer_state(ctx, s, layer, layers, nd, i) for i, s in enumerate(states)]
        while ins[-1] == "":
            ins.pop()
        outs = ctx.make(kind.onnx_op, ins, outputs=1 + kind.states, tag=None if layer == 0 else f"layer{layer}",
                        **_attrs(kind, m, nd))
        x = _merge_directions(ctx, outs[0], layer, nd)
        for i in range(kind.states):
            finals[i].append(outs[1 + i])
    return x, [f[0] if layers == 1 else ctx.make("Concat", f, tag=f"state{i}_n", axis=0) for i, f in enumerate(finals)]


def _check(ctx: NodeContext, kind: RnnKind) -> tuple[nn.Module, bool]:
    """The module (of ``kind``'s class, no projection) and whether the input is batched."""
    m = ctx.module
    if not isinstance(m, kind.module):
        raise ctx.unsupported(f"only nn.{kind.module.__name__} modules")
    if getattr(m, "proj_size", 0):
        raise ctx.unsupported(f"LSTM with proj_size={m.proj_size} (ONNX LSTM has no output projection); "
                              f"use proj_size=0 and an nn.Linear after the LSTM")
    rank, batched_rank = ctx.rank(), 2 if kind.cell else 3
    if rank not in (batched_rank - 1, batched_rank):
        raise ctx.unsupported(f"the input must be {batched_rank - 1}-D or {batched_rank}-D, got {rank}-D")
    return m, rank == batched_rank


def _rnn(kind_name: str):
    """The rule for one recurrent kind (a row of :data:`KINDS`)."""
    kind = KINDS[kind_name]

    def rule(ctx: NodeContext):
        m, batched = _check(ctx, kind)
        x_axes, state_axes = _lift_axes(kind, batched)
        batch_first = batched and not kind.cell and m.batch_first
        x = ctx.make("Transpose", [ctx.x()], tag="time_major", perm=[1, 0, 2]) if batch_first else ctx.x()
        x = _reshape_axes(ctx, "Unsqueeze", x, x_axes, "lift_input")
        y, finals = _layers(ctx, kind, m, x, _states(ctx, kind, ctx.value(ctx.arg(1, "hx", None)), state_axes))
        finals = [_reshape_axes(ctx, "Squeeze", s, state_axes, f"state{i}_out") for i, s in enumerate(finals)]
        state = finals[0] if kind.states == 1 else tuple(finals)
        if kind.cell:
            return state
        y = ctx.make("Transpose", [y], tag="batch_major", perm=[1, 0, 2]) if batch_first else y
        return _reshape_axes(ctx, "Squeeze", y, x_axes, "unlift_output"), state

    rule.__name__ = rule.__qualname__ = kind_name
    rule.__doc__ = f"nn.{kind.module.__name__} -> ONNX {kind.onnx_op} (see the module docstring)."
    return rule


for _name in KINDS:
    register(_name, _rnn(_name))
