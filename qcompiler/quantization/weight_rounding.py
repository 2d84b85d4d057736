"""Data-aware weight rounding after calibration (GPTQ-style error feedback).

Round-to-nearest treats every weight on its own. A layer's output error is
``dW @ x``, and when the inputs are correlated (neighbouring pixels of an
image, channels of a feature map) the rounding errors of weights that
multiply correlated inputs can cancel. :func:`optimize_weight_rounding`
rounds the weights of each BPU conv / linear one input column at a time and
moves each column's rounding error onto the columns not yet rounded, through
the inverse of the input second-moment matrix ``H = E[x x^T]`` (the GPTQ
algorithm of Frantar et al., 2023, with its lazy block updates and columns
taken in order of decreasing ``H[i, i]``). That greedily minimizes
``E ||dW x||^2`` over the calibration data.

``H`` is collected layer by layer on the inputs the BPU will see: the
activations fake-quantized at their calibrated scales and the weights of the
layers before already re-rounded. Each layer costs one pass over the data
(cut short after the layer).

The quantization scheme does not change: the same per-channel scales (those
of the weight observers), codes within ``[-qmax, qmax]``; only the direction
in which each weight rounds does. The new weights are stored as the grid
values ``q * s``, so ``convert_fx`` reads back exactly the chosen codes. A
layer keeps round-to-nearest (also stored as grid values, so the layers after
it see BPU inputs) when that is no worse on its own objective, when it saw
fewer input vectors than it has columns (``H`` singular: the rounding would
fit those samples, not the data), and for transposed convolutions (their
input patches are not an unfold of the input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantizeBase
from qcompiler.quantization.fixed_point import qrange
from qcompiler.quantization.prepare import GM_KIND

__all__ = ["optimize_weight_rounding", "LayerRounding", "RoundingReport"]


@dataclass(frozen=True)
class LayerRounding:
    """What happened to one layer's weights.

    ``nearest_mse`` / ``rounded_mse``: mean squared output error per output
    element caused by the weight rounding alone (``E[(dW x)^2]`` over the
    calibration inputs), for round-to-nearest and for the rounding kept.
    """

    name: str
    columns: int
    samples: int
    nearest_mse: float
    rounded_mse: float
    method: str  # "gptq", "nearest" (gptq was no better) or "nearest: <why>"

    @property
    def gain_db(self) -> float:
        if self.rounded_mse <= 0 or self.nearest_mse <= 0:
            return 0.0
        return 10.0 * math.log10(self.nearest_mse / self.rounded_mse)


class RoundingReport(list):
    """The :class:`LayerRounding` rows of one call; ``str()`` is a table."""

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [[r.name, r.columns, r.samples, f"{r.nearest_mse:.3e}", f"{r.rounded_mse:.3e}",
                 f"{r.gain_db:+.2f}", r.method] for r in self]
        return tabulate(rows, headers=["layer", "columns", "samples", "nearest mse", "kept mse", "gain dB",
                                       "rounding"], tablefmt="github", disable_numparse=True)


class _Stop(Exception):
    """Ends a forward pass once the layer being rounded has seen its input."""


def _as_args(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _check_model(model: Any) -> None:
    if not isinstance(model, fx.GraphModule) or model.meta.get(GM_KIND) != "calibration":
        kind = model.meta.get(GM_KIND) if isinstance(model, fx.GraphModule) else None
        got = f"a {kind} model" if kind else type(model).__name__
        raise ConfigError(
            "optimize_weight_rounding takes the model returned by prepare_calibration_fx, after its "
            f"calibration batches have run; got {got}. (QAT trains its weights instead.)"
        )


def _weight_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, layer) of every layer whose weight a calibration fake quant observes."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "weight_fake_quant", None), CalibFakeQuantize)
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


# ---------------------------------------------------------------------------
# inputs as columns: x -> (groups, d, n) with W reshaped to (groups, out/groups, d)


def _columns(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().double()
    if isinstance(layer, nn.Linear):
        return x.reshape(-1, x.shape[-1]).T.unsqueeze(0)
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    x = F.pad(x, layer._reversed_padding_repeated_twice, mode=mode)
    u = F.unfold(x, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)  # N, C*kh*kw, P
    n, d, p = u.shape
    g = layer.groups
    return u.reshape(n, g, d // g, p).permute(1, 2, 0, 3).reshape(g, d // g, n * p)


def _skip_reason(layer: nn.Module) -> Optional[str]:
    if isinstance(layer, nn.ConvTranspose2d):
        return "transposed conv"
    if isinstance(layer, (nn.Conv2d, nn.Linear)):
        return None
    return f"{type(layer).__name__} not supported"


# ---------------------------------------------------------------------------
# the rounding itself


def _nearest(w: torch.Tensor, s: torch.Tensor, qmax: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / s), -qmax, qmax)


def _output_mse(dw: torch.Tensor, h: torch.Tensor) -> float:
    """``E[(dW x)^2]`` per output element, from ``H = E[x x^T]``; dw (g, o, d), h (g, d, d)."""
    return float(((dw @ h) * dw).sum() / (dw.shape[0] * dw.shape[1]))


def _inverse_upper_factor(h: torch.Tensor) -> Optional[torch.Tensor]:
    """Upper-triangular ``U`` with ``H^-1 = U^T U`` (batched), or None if ``H`` is not positive definite.

    With ``J`` the reversal permutation and ``J H J = L L^T``, ``R = J L J`` is upper triangular
    with ``H = R R^T``, so ``U = R^-1 = J L^-1 J``: one Cholesky and one triangular inverse.
    """
    flip = (-2, -1)
    chol, info = torch.linalg.cholesky_ex(torch.flip(h, flip))
    if int(info.max()) != 0:
        return None
    eye = torch.eye(h.shape[-1], dtype=h.dtype).expand_as(h)
    return torch.flip(torch.linalg.solve_triangular(chol, eye, upper=False), flip)


def _gptq_codes(w: torch.Tensor, s: torch.Tensor, h: torch.Tensor, qmax: int, damp: float,
                block: int) -> Optional[torch.Tensor]:
    """Integer codes (g, o, d) for weights w (g, o, d), scales s (g, o, 1), H (g, d, d); None if
    H cannot be factored even with more damping."""
    g, _, d = w.shape
    w = w.clone()
    diag = torch.diagonal(h, dim1=1, dim2=2)
    # inputs that are always zero: give them the mean live diagonal (a fixed 1 would set the
    # damping's size against the inputs' scale); with no off-diagonal terms they round to nearest
    dead = diag <= 0
    live = (~dead).to(h.dtype)
    live_mean = (diag * live).sum(1) / live.sum(1).clamp_min(1)
    live_mean = torch.where(live_mean > 0, live_mean, torch.ones_like(live_mean))
    h = h + torch.diag_embed(dead.to(h.dtype) * live_mean.unsqueeze(1))
    perm = torch.argsort(torch.diagonal(h, dim1=1, dim2=2), dim=1, descending=True, stable=True)
    h = torch.gather(torch.gather(h, 1, perm.unsqueeze(2).expand(g, d, d)), 2, perm.unsqueeze(1).expand(g, d, d))
    w = torch.gather(w, 2, perm.unsqueeze(1).expand_as(w))
    eye = torch.eye(d, dtype=h.dtype)
    mean_diag = torch.diagonal(h, dim1=1, dim2=2).mean(1).reshape(g, 1, 1)
    u = None
    for attempt in range(4):
        u = _inverse_upper_factor(h + damp * (10 ** attempt) * mean_diag * eye)
        if u is not None:
            break
    if u is None:
        return None
    q = torch.empty_like(w)
    for i1 in range(0, d, block):
        i2 = min(i1 + block, d)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.empty_like(w1)
        u1 = u[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, :, i]
            qi = _nearest(col, s[:, :, 0], qmax)
            q[:, :, i1 + i] = qi
            err = (col - qi * s[:, :, 0]) / u1[:, i, i].unsqueeze(1)
            w1[:, :, i:] -= err.unsqueeze(2) * u1[:, i, i:].unsqueeze(1)
            err1[:, :, i] = err
        w[:, :, i2:] -= err1 @ u[:, i1:i2, i2:]
    return torch.gather(q, 2, torch.argsort(perm, dim=1).unsqueeze(1).expand_as(q))


# ---------------------------------------------------------------------------
# driving the model


class _QuantizedActivations:
    """Context: every activation fake quant of a calibration model quantizes at its calibrated
    scale (float32 fake quant) and every observer stops recording; restored on exit."""

    def __init__(self, model: nn.Module, weight_fqs: set[int]) -> None:
        self.fqs = [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]
        self.weight_fqs = weight_fqs
        self.handles: list = []
        self.states: list = []

    def __enter__(self) -> "_QuantizedActivations":
        for m in self.fqs:
            self.states.append(m.observer_enabled.clone())
            if id(m) in self.weight_fqs:
                continue
            scale = m.calculate_qparams()[0].reshape(()).float()
            qmin, qmax = qrange(m.activation_post_process.dtype)
            self.handles.append(m.register_forward_hook(_fake_quant_hook(scale, qmin, qmax)))
        for m in self.fqs:
            m.disable_observer()
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        for m, state in zip(self.fqs, self.states):
            m.observer_enabled.copy_(state)


def _fake_quant_hook(scale: torch.Tensor, qmin: int, qmax: int):
    def hook(module, args, out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        return (torch.clamp(torch.round(out.float() / scale), qmin, qmax) * scale).to(out.dtype)
    return hook


def _forward(model: nn.Module, batch: tuple, index: int) -> None:
    try:
        model(*batch)
    except (_Stop, CalibrationError):
        raise
    except Exception as exc:  # a batch the model cannot take: say which, not where in torch
        raise CalibrationError(
            f"optimize_weight_rounding: the model failed on batch {index} ({type(exc).__name__}: {exc}); "
            f"pass batches shaped like the calibration batches"
        ) from exc


def _call_order(model: nn.Module, layers: list[tuple[str, nn.Module]], batch: tuple) -> tuple[list, dict]:
    """Layers in the order forward first calls them, and how often each is called per forward."""
    order, calls = [], {}
    by_id = {id(m): (name, m) for name, m in layers}

    def hook(m, args):
        if id(m) not in calls:
            order.append(by_id[id(m)])
        calls[id(m)] = calls.get(id(m), 0) + 1

    handles = [m.register_forward_pre_hook(hook) for _, m in layers]
    try:
        _forward(model, batch, 0)
    finally:
        for h in handles:
            h.remove()
    return order, calls


def _input_moments(model: nn.Module, layer: nn.Module, batches: list[tuple], stop_early: bool):
    """``(sum x x^T, n)`` of the layer's input columns over all batches: (g, d, d) and the count."""
    acc: dict = {}

    def hook(m, args):
        cols = _columns(layer, args[0])
        h = cols @ cols.transpose(1, 2)
        acc["h"] = acc["h"] + h if "h" in acc else h
        acc["n"] = acc.get("n", 0) + cols.shape[-1]
        if stop_early:
            raise _Stop

    handle = layer.register_forward_pre_hook(hook)
    try:
        for i, batch in enumerate(batches):
            try:
                _forward(model, batch, i)
            except _Stop:
                pass
    finally:
        handle.remove()
    return acc.get("h"), acc.get("n", 0)


@torch.no_grad()
def optimize_weight_rounding(
    model: fx.GraphModule,
    data: Iterable[Any],
    *,
    damp: float = 0.01,
    block_size: int = 128,
    progress: bool = False,
) -> RoundingReport:
    """Re-round the weights of a calibrated model to minimize each layer's output error on ``data``.

    ``model`` is the model returned by ``prepare_calibration_fx`` after its
    calibration batches ran (the weight scales and activation scales come from
    its observers); ``data`` yields batches like those (a tensor or a tuple of
    model arguments), typically the calibration data again. The weights of
    every BPU conv and linear layer are changed in place to grid values
    ``q * s``; ``convert_fx`` afterwards gives the fixed-point model. ``damp``
    is the fraction of the mean diagonal of ``H`` added to its diagonal.
    Returns one :class:`LayerRounding` per layer (``print`` it for a table).

    Cost: one pass over ``data`` per layer (cut short after the layer), and the
    batches are held in memory for those passes.
    """
    from qcompiler.passes.convert import check_observed

    _check_model(model)
    if not (isinstance(damp, (int, float)) and math.isfinite(damp) and damp > 0):
        raise ConfigError(f"damp must be a finite number > 0 (e.g. 0.01), got {damp!r}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    batches = [_as_args(b) for b in data]
    if not batches:
        raise ConfigError("optimize_weight_rounding: data yielded no batches; pass the calibration batches")
    check_observed(model)
    layers = _weight_layers(model)
    weight_fqs = {id(m.weight_fake_quant) for _, m in layers}

    training = [(m, m.training) for m in model.modules()]
    saved = {id(m): m.weight.detach().clone() for _, m in layers}
    model.eval()
    report = RoundingReport()
    done = False
    try:
        with _QuantizedActivations(model, weight_fqs):
            order, calls = _call_order(model, layers, batches[0])
            steps = order
            if progress:
                from tqdm import tqdm

                steps = tqdm(order, desc="weight rounding", unit="layer")
            for name, layer in steps:
                report.append(_round_layer(model, name, layer, batches, calls[id(layer)] == 1, damp, block_size))
        done = True
    finally:
        for m, flag in training:
            m.training = flag
        if not done:  # a failure half-way leaves the weights as they were
            for _, m in layers:
                m.weight.copy_(saved[id(m)])
    return report


def _store_nearest(layer: nn.Module, scale: torch.Tensor, qmax: int) -> None:
    """Round-to-nearest grid values into a layer the rounding leaves alone, so the layers after it
    see the inputs the BPU computes (the calibration model's weight fake quants pass weights through)."""
    w = layer.weight
    axis = layer.weight_fake_quant.activation_post_process.ch_axis
    shape = [1] * w.dim()
    shape[axis] = -1
    s = scale.float().reshape(shape)
    layer.weight.copy_((torch.clamp(torch.round(w.float() / s), -qmax, qmax) * s).to(w.dtype))


def _round_layer(model, name: str, layer: nn.Module, batches, stop_early: bool, damp: float,
                 block: int) -> LayerRounding:
    """Round one layer's weights: GPTQ or nearest, whichever has the smaller output error on the data.

    (Also moving the mean error ``-dW mu`` into the bias was tried: it lowers this objective but
    did not help the models' outputs in benchmarks/accuracy.py, so it is not done.)"""
    fq = layer.weight_fake_quant
    qmax = qrange(fq.activation_post_process.dtype)[1]
    scale = fq.calculate_qparams()[0].double().reshape(-1)
    reason = _skip_reason(layer)
    if reason is not None:
        _store_nearest(layer, scale, qmax)
        return LayerRounding(name, 0, 0, float("nan"), float("nan"), f"nearest: {reason}")
    w = layer.weight.detach().double()
    out = w.shape[0]
    second, n = _input_moments(model, layer, batches, stop_early)
    if second is None:  # cannot happen after check_observed, but say so rather than fail later
        _store_nearest(layer, scale, qmax)
        return LayerRounding(name, 0, 0, float("nan"), float("nan"), "nearest: never called")
    h = second / n
    g, d = h.shape[0], h.shape[1]
    wg = w.reshape(g, out // g, d)
    s = scale.expand(out).reshape(g, out // g, 1)
    codes = _nearest(wg, s, qmax)
    nearest_mse = _output_mse(wg - codes * s, h)
    method = "nearest"
    if n < d:  # H is singular: a rounding fitted to it would fit these samples, not the data
        method = f"nearest: {n} samples < {d} columns (more calibration data)"
    else:
        fitted = _gptq_codes(wg, s, h, qmax, damp, block)
        if fitted is None:
            method = "nearest: H not positive definite"
        elif _output_mse(wg - fitted * s, h) < nearest_mse:
            codes, method = fitted, "gptq"
    s32 = scale.float().expand(out).reshape(g, out // g, 1)
    layer.weight.copy_((codes.float() * s32).reshape(layer.weight.shape).to(layer.weight.dtype))
    return LayerRounding(name, d, n, nearest_mse, _output_mse(wg - codes * s, h), method)
