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
layers before already re-rounded. Each layer needs a pass over the data up to
the layer; the passes resume where the previous layer's stopped (see
:class:`_Passes`), so together they cost about one forward per batch.

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

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.batches import as_args, fresh_args
from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.ir.meta import GM_KIND
from qcompiler.passes.convert import check_observed
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantizeBase, observe_final_weight
from qcompiler.quantization.fixed_point import qrange

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
    # a copy even when x is float64 already: _Moments keeps columns while the forward goes on
    x = x.detach().to(torch.float64, copy=True)
    if isinstance(layer, nn.Linear):
        return x.reshape(-1, x.shape[-1]).T.unsqueeze(0)
    pad = tuple(layer._reversed_padding_repeated_twice)  # (left, right, top, bottom)
    if layer.kernel_size == (1, 1) and layer.stride == (1, 1) and not any(pad):
        u = x.reshape(x.shape[0], x.shape[1], -1).contiguous()  # what unfold gives, without its copy
    elif layer.padding_mode == "zeros" and pad[0] == pad[1] and pad[2] == pad[3]:
        u = F.unfold(x, layer.kernel_size, dilation=layer.dilation, padding=(pad[2], pad[0]), stride=layer.stride)
    else:
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        x = F.pad(x, pad, mode=mode)
        u = F.unfold(x, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)  # N, C*kh*kw, P
    n, d, p = u.shape
    g = layer.groups
    return u.reshape(n, g, d // g, p).permute(1, 2, 0, 3).reshape(g, d // g, n * p)


def _check_input(layer: nn.Module, x: torch.Tensor) -> None:
    if isinstance(layer, nn.Linear):
        ok, got = x.dim() >= 1 and x.shape[-1] == layer.in_features, f"last dim {tuple(x.shape)[-1:]}"
        want = f"{layer.in_features} features"
    else:
        ok, got = x.dim() == 4 and x.shape[1] == layer.in_channels, f"shape {tuple(x.shape)}"
        want = f"(N, {layer.in_channels}, H, W)"
    if not ok:
        raise ValueError(f"{type(layer).__name__} input has {got}, the layer takes {want}")


class _Moments:
    """A layer's input columns, taken in as the passes reach the layer.

    The columns are kept as they come until there are ``d`` of them (``d`` values each: no more
    memory than ``H``); from then on they are folded into ``H = sum x x^T``, in call order. A layer
    that never gets ``d`` columns keeps nearest rounding whatever ``H`` is, so it never builds one
    (``d^2 n`` flops for the widest layers): its error is computed from the columns directly.
    """

    def __init__(self, layer: nn.Module, d: int) -> None:
        self.layer, self.d = layer, d
        self.h: Optional[torch.Tensor] = None
        self.pending: list[torch.Tensor] = []
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        cols = _columns(self.layer, x)
        self.n += cols.shape[-1]
        if self.h is not None:
            self._fold(cols)
            return
        self.pending.append(cols)
        if self.n >= self.d:
            for c in self.pending:
                self._fold(c)
            self.pending = []

    def _fold(self, cols: torch.Tensor) -> None:
        part = cols @ cols.transpose(1, 2)
        if self.h is None:
            self.h = part
        else:
            self.h += part

    def direct_mse(self, dw: torch.Tensor) -> float:
        """``E[(dW x)^2]`` per output element over the kept columns; dw (g, o, d)."""
        total = 0.0
        for cols in self.pending:
            e = dw @ cols
            total += float((e * e).sum())
        return total / (self.n * dw.shape[0] * dw.shape[1]) if self.n else float("nan")


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
    # The column loop is Python, one iteration per column, so its cost is the number of torch calls
    # per column: the weights are kept transposed, (g, d, o), so that a column is a contiguous row,
    # each column's codes and error are written in place into preallocated rows, and the per-block
    # views are taken once per block. Every element sees the same float64 operations in the same
    # order as the plain formulation (see tests/test_weight_rounding.py: reference_gptq).
    s0 = s[:, :, 0]
    wt = w.transpose(1, 2).contiguous()
    qt = torch.empty_like(wt)
    u_diag = torch.diagonal(u, dim1=1, dim2=2).unsqueeze(2).unbind(1)  # d tensors (g, 1)
    for i1 in range(0, d, block):
        i2 = min(i1 + block, d)
        w1 = wt[:, i1:i2]  # updated in place: only the columns after it are read again
        err1 = torch.empty_like(w1)
        u1 = u[:, i1:i2, i1:i2].unsqueeze(3)  # (g, b, b, 1): row i times an error row is the update
        rows, codes, errs = w1.unbind(1), qt[:, i1:i2].unbind(1), err1.unbind(1)
        err_rows = err1.unsqueeze(2).unbind(1)  # (g, 1, o)
        for i in range(i2 - i1):
            col, qi, err = rows[i], codes[i], errs[i]
            torch.div(col, s0, out=qi).round_().clamp_(-qmax, qmax)  # _nearest
            torch.sub(col, torch.mul(qi, s0, out=err), out=err).div_(u_diag[i1 + i])
            if i + 1 < i2 - i1:
                w1[:, i + 1:].sub_(u1[:, i, i + 1:] * err_rows[i])
        # lazy update of the columns after the block: the same product as in (g, o, d) layout
        wt[:, i2:] -= (err1.transpose(1, 2).contiguous() @ u[:, i1:i2, i2:]).transpose(1, 2)
    return torch.gather(qt.transpose(1, 2), 2, torch.argsort(perm, dim=1).unsqueeze(1).expand(g, w.shape[1], d))


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
        q = out.float() / scale  # a new tensor: round, clamp and scale it in place (same values, fewer buffers)
        return q.round_().clamp_(qmin, qmax).mul_(scale).to(out.dtype)
    return hook


def _forward(run: Callable[[], Any], index: int) -> None:
    """``run()`` one pass of batch ``index``; what the model raises becomes a CalibrationError naming the batch."""
    try:
        run()
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
        _forward(lambda: model(*fresh_args(batch)), 0)
    finally:
        for h in handles:
            h.remove()
    return order, calls


# bytes of node values the passes keep to resume from, over all batches; batches beyond it run from the inputs
_RESUME_BUDGET = 1 << 30


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


@dataclass
class _Resume:
    """Where a batch's next pass starts: the first node not yet run, the values of the nodes before
    it that later nodes use, and the version counters of their tensors when they were computed."""

    pos: int
    env: dict
    versions: dict
    nbytes: int = 0

    def intact(self) -> bool:
        """False if an in-place op changed a kept tensor since it was computed (then rerun from the inputs)."""
        return all(t._version == v for pairs in self.versions.values() for t, v in pairs)


def _nbytes(env: dict) -> int:
    storages = {}
    for value in env.values():
        for t in _tensors(value):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


class _Passes:
    """The passes over the data, run node by node so that each batch's pass resumes where its
    previous one stopped instead of starting at the inputs.

    Layers are rounded in the order forward first calls them. A node run before the first call of
    layer k only involves layers first called before it, which are rounded already and do not change
    again, so its value is the same in every later pass. The pre-hook of the layer being rounded
    calls :meth:`mark`: the node running then (the one calling the layer) is where the batch's next
    pass starts, with the values computed before it. The passes then cost about one forward per batch
    in all, not one per layer; the results are the same values as a forward from the inputs
    (a graph that draws random numbers reuses its earlier draws).

    Kept values take memory (about one activation map per batch); past ``_RESUME_BUDGET`` bytes the
    later batches run from the inputs. A batch also runs from the inputs when an in-place op changed a kept
    tensor since it was computed, and every pass does when the model's call is more than its graph
    (hooks on the model itself, pytree argument handling) or a layer's weight is used elsewhere too.
    """

    def __init__(self, model: fx.GraphModule, layers: list[tuple[str, nn.Module]]):
        self.model = model
        self.nodes = list(model.graph.nodes)
        self.budget = _RESUME_BUDGET
        self.saved: dict[int, _Resume] = {}
        self.used = 0
        self.resumable = self._resumable(model, layers)
        if self.resumable:
            self.signature = inspect.signature(model.forward)
            self.interp = fx.Interpreter(model, garbage_collect_values=False)
            last = {}
            for i, node in enumerate(self.nodes):
                for arg in node.all_input_nodes:
                    last[arg] = i
            self.free_after: list[list[fx.Node]] = [[] for _ in self.nodes]
            for i, node in enumerate(self.nodes):
                self.free_after[last.get(node, i)].append(node)
        self._env: Optional[dict] = None
        self._versions: dict = {}
        self._pos = 0
        self._mark: Optional[_Resume] = None

    def _resumable(self, model: fx.GraphModule, layers: list[tuple[str, nn.Module]]) -> bool:
        if model._forward_hooks or model._forward_pre_hooks or type(model.graph._codegen) is not fx.graph.CodeGen:
            return False
        if any(n.op == "placeholder" and str(n.target).startswith("*") for n in self.nodes):
            return False
        weights = {id(m.weight) for _, m in layers}
        uses = sum(id(p) in weights for _, p in model.named_parameters(remove_duplicate=False))
        fetched = any(n.op == "get_attr" and id(_fetch(model, n.target)) in weights for n in self.nodes)
        return uses == len(weights) == len(layers) and not fetched

    def mark(self) -> None:
        """Called when the layer being rounded is first reached: the next pass of this batch starts here."""
        if self._mark is None and self._env is not None:
            env = dict(self._env)
            self._mark = _Resume(self._pos, env, dict(self._versions), _nbytes(env))

    def run(self, index: int, batch: tuple) -> None:
        """One pass of batch ``index``; ends at the end of the graph or at a :class:`_Stop`."""
        if not self.resumable or _inference(batch):
            try:
                _forward(lambda: self.model(*fresh_args(batch)), index)
            except _Stop:
                pass
            return
        start = self.saved.pop(index, None)
        if start is not None:
            self.used -= start.nbytes
            if not start.intact():
                start = None
        self._mark = None
        try:
            _forward(lambda: self._run_nodes(batch, start), index)
        except _Stop:
            pass
        finally:
            self._env, self._versions = None, {}
        keep = self._mark if self._mark is not None else start
        self._mark = None
        if keep is not None and self.used + keep.nbytes <= self.budget:
            self.saved[index] = keep
            self.used += keep.nbytes

    def _run_nodes(self, batch: tuple, start: Optional[_Resume]) -> None:
        if start is None:
            self.signature.bind(*batch)  # the TypeError calling the model would raise
            env, versions, pos = {}, {}, 0
            self.interp.args_iter = iter(batch)
        else:
            env, versions, pos = dict(start.env), dict(start.versions), start.pos
        self.interp.env = env
        self._env, self._versions = env, versions
        for i in range(pos, len(self.nodes)):
            node = self.nodes[i]
            if node.op == "output":
                break
            self._pos = i
            value = self.interp.run_node(node)
            env[node] = value
            versions[node] = [(t, t._version) for t in _tensors(value)]
            for done in self.free_after[i]:
                env.pop(done, None)
                versions.pop(done, None)


def _inference(batch: tuple) -> bool:
    """Inference-mode tensors (or inference mode itself) have no version counters to check kept values
    against: such passes run from the inputs."""
    return torch.is_inference_mode_enabled() or any(t.is_inference() for t in _tensors(batch))


def _fetch(model: nn.Module, target: str) -> Any:
    obj = model
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _layer_moments(passes: _Passes, layer: nn.Module, batches: list[tuple], stop_early: bool,
                   d: int) -> _Moments:
    """The layer's input columns over all batches (every call of the layer), as :class:`_Moments`."""
    moments = _Moments(layer, d)

    def hook(m, args):
        passes.mark()
        x = args[0].detach()
        _check_input(layer, x)  # here, so that the error names the batch
        moments.add(x)
        if stop_early:
            raise _Stop

    handle = layer.register_forward_pre_hook(hook)
    try:
        for i, batch in enumerate(batches):
            passes.run(i, batch)
    finally:
        handle.remove()
    return moments


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

    Cost: about one forward per batch for all the layers' inputs together (each
    layer's pass resumes where the previous one stopped), a ``d x d`` second
    moment per layer with ``d`` its input columns, and the rounding itself. The
    batches, and up to 1 GiB of activations to resume from, are held in memory.
    """
    _check_model(model)
    if not (isinstance(damp, (int, float)) and math.isfinite(damp) and damp > 0):
        raise ConfigError(f"damp must be a finite number > 0 (e.g. 0.01), got {damp!r}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    batches = [as_args(b) for b in data]
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
            passes = _Passes(model, layers)
            steps = order
            if progress:
                from tqdm import tqdm

                steps = tqdm(order, desc="weight rounding", unit="layer")
            for name, layer in steps:
                report.append(_round_layer(passes, name, layer, batches, calls[id(layer)] == 1, damp, block_size))
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


def _round_layer(passes: _Passes, name: str, layer: nn.Module, batches, stop_early: bool, damp: float,
                 block: int) -> LayerRounding:
    """Round one layer's weights: GPTQ or nearest, whichever has the smaller output error on the data.

    A layer that saw fewer input vectors than it has columns keeps nearest whatever ``H`` is, so its
    error is computed from the columns directly (see :class:`_Moments`).

    (Also moving the mean error ``-dW mu`` into the bias was tried: it lowers this objective but
    did not help the models' outputs in benchmarks/accuracy.py, so it is not done.)"""
    fq = layer.weight_fake_quant
    observe_final_weight(fq, layer.weight)  # the weight as it is, if calibration skipped it as unchanged
    qmax = qrange(fq.activation_post_process.dtype)[1]
    scale = fq.calculate_qparams()[0].double().reshape(-1)
    reason = _skip_reason(layer)
    if reason is not None:
        _store_nearest(layer, scale, qmax)
        return LayerRounding(name, 0, 0, float("nan"), float("nan"), f"nearest: {reason}")
    w = layer.weight.detach().double()
    out = w.shape[0]
    g = layer.groups if isinstance(layer, nn.Conv2d) else 1
    d = w[0].numel() if isinstance(layer, nn.Conv2d) else w.shape[1]
    moments = _layer_moments(passes, layer, batches, stop_early, d)
    n = moments.n
    if n == 0:  # cannot happen after check_observed, but say so rather than fail later
        _store_nearest(layer, scale, qmax)
        return LayerRounding(name, 0, 0, float("nan"), float("nan"), "nearest: never called")
    wg = w.reshape(g, out // g, d)
    s = scale.expand(out).reshape(g, out // g, 1)
    codes = _nearest(wg, s, qmax)
    if moments.h is None:  # H would be singular: a rounding fitted to it would fit these samples, not the data
        nearest_mse = moments.direct_mse(wg - codes * s)
        method, kept_mse = f"nearest: {n} samples < {d} columns (more calibration data)", nearest_mse
    else:
        h = moments.h / n
        nearest_mse = _output_mse(wg - codes * s, h)
        method, kept_mse = "nearest", nearest_mse
        fitted = _gptq_codes(wg, s, h, qmax, damp, block)
        if fitted is None:
            method = "nearest: H not positive definite"
        else:
            fitted_mse = _output_mse(wg - fitted * s, h)
            if fitted_mse < nearest_mse:
                codes, method, kept_mse = fitted, "gptq", fitted_mse
    s32 = scale.float().expand(out).reshape(g, out // g, 1)
    layer.weight.copy_((codes.float() * s32).reshape(layer.weight.shape).to(layer.weight.dtype))
    return LayerRounding(name, d, n, nearest_mse, kept_mse, method)
