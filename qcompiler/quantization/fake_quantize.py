"""Fake quantization for QAT and the calibration-only wrapper.

``FakeQuantize`` simulates the BPU's quantize -> dequantize in float32:
``clamp(round_half_even(x / scale), qmin, qmax) * scale`` -- bit for bit the
value ``fixed_point.dequantize(fixed_point.quantize(x, scale, dtype), scale)``
-- with a clipped straight-through estimator for the gradient (1 inside
``[qmin*scale, qmax*scale]``, 0 outside).  Its observer is the child
``activation_post_process``; the buffers ``fake_quant_enabled`` and
``observer_enabled`` switch the two halves, like torch.ao.

``CalibFakeQuantize`` only observes and returns its input object unchanged,
so a calibration model computes exactly the float outputs.

``set_state(model, "calibration" | "qat" | "validation")`` switches every
fake quant in a model at once.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.quantization.fixed_point import qrange
from qcompiler.quantization.observer import ObserverBase, _fmt_vec, check_dtype, resize_to_saved

__all__ = [
    "FakeQuantizeBase",
    "FakeQuantize",
    "CalibFakeQuantize",
    "fake_quantize",
    "enable_observer",
    "disable_observer",
    "enable_fake_quant",
    "disable_fake_quant",
    "set_state",
    "STATES",
    "assign_qc_names",
]

# state -> (observer on, fake quant on)
STATES = {
    "calibration": (True, False),
    "qat": (True, True),
    "validation": (False, True),
}


class _FakeQuantSTE(torch.autograd.Function):
    """Fake quant forward, clipped straight-through backward."""

    @staticmethod
    def forward(ctx, x, scale, qmin, qmax):
        xf = x.float()
        out = torch.clamp(torch.round(xf / scale), qmin, qmax) * scale + 0.0  # + 0.0: no -0.0
        ctx.save_for_backward((xf >= qmin * scale) & (xf <= qmax * scale))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None


def _exact_fake_quant(x: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Evaluation-mode fake quant that carries the grid value ``q * s`` exactly (float64).

    A float32 input is divided in float32, exactly as the BPU entry quantizes
    (``fixed_point.quantize``); a float64 input (already on the BPU side) in
    float64. The result ``q * s`` is exact in float64, so the evaluated model
    rounds like the integer model except within ~1e-8 LSB of a tie. Layers
    downstream compute in float64 while their input is float64;
    ``DeQuantStub`` returns to float32 at the BPU exit.
    """
    q = torch.round(x / s.double()) if x.dtype == torch.float64 else torch.round(x.float() / s)
    return torch.clamp(q, qmin, qmax).double() * s.double() + 0.0  # + 0.0: no -0.0


def _broadcast_scale(scale: torch.Tensor, x: torch.Tensor, ch_axis: int, who: str) -> torch.Tensor:
    s = scale.detach().float().to(x.device)
    if ch_axis < 0:
        if s.numel() != 1:
            raise ConfigError(f"{who}: per-tensor fake quant has {s.numel()} scales")
        return s.reshape(())
    if x.dim() <= ch_axis:
        raise ConfigError(f"{who}: channel axis {ch_axis} does not exist in an input of shape "
                          f"{tuple(x.shape)}")
    c = x.shape[ch_axis]
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() != c:
        raise ConfigError(f"{who}: {s.numel()} per-channel scales for {c} channels along axis "
                          f"{ch_axis} of an input of shape {tuple(x.shape)}")
    shape = [1] * x.dim()
    shape[ch_axis] = c
    return s.reshape(shape)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, dtype="qint8", ch_axis: int = -1
                  ) -> torch.Tensor:
    """Functional fake quant (symmetric, zero point 0) with a clipped STE gradient."""
    qmin, qmax = qrange(check_dtype(dtype))
    s = _broadcast_scale(torch.as_tensor(scale), x, ch_axis, "fake_quantize")
    return _FakeQuantSTE.apply(x, s, qmin, qmax)


def _fmt_tensor(t: torch.Tensor) -> str:
    """``tensor([...])`` like torch prints it, shortened for many channels."""
    if t.numel() <= 8:
        return repr(t.detach().cpu())
    if t.is_floating_point():
        return f"tensor({_fmt_vec(t)})"
    vals = t.flatten().tolist()
    return f"tensor([{', '.join(map(str, vals[:3]))}, ..., {', '.join(map(str, vals[-3:]))}]) (C={len(vals)})"


class FakeQuantizeBase(nn.Module):
    """What the state helpers switch: an observer child and on/off flags."""

    qc_leaf = True
    qc_op = "quant"

    def __init__(self, observer: nn.Module) -> None:
        super().__init__()
        if not isinstance(observer, ObserverBase):
            raise ConfigError(f"{type(self).__name__} needs a qcompiler observer, got "
                              f"{type(observer).__name__}")
        self.activation_post_process = observer
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.uint8))

    # name used in error messages; shared with the observer
    @property
    def qc_name(self) -> str:
        return self.activation_post_process.qc_name

    @qc_name.setter
    def qc_name(self, name: str) -> None:
        self.activation_post_process.qc_name = str(name)

    @property
    def dtype(self) -> str:
        return self.activation_post_process.dtype

    @property
    def quant_min(self) -> int:
        return self.activation_post_process.quant_min

    @property
    def quant_max(self) -> int:
        return self.activation_post_process.quant_max

    @property
    def ch_axis(self) -> int:
        return self.activation_post_process.ch_axis

    @ch_axis.setter
    def ch_axis(self, axis: int) -> None:
        """Passed on to a per-channel observer (e.g. 1 for a ConvTranspose weight)."""
        self.activation_post_process.ch_axis = axis

    @property
    def qscheme(self) -> torch.qscheme:
        return torch.per_tensor_symmetric if self.ch_axis < 0 else torch.per_channel_symmetric

    @property
    def has_observed(self) -> bool:
        return self.activation_post_process.has_observed

    def enable_observer(self, enabled: bool = True) -> "FakeQuantizeBase":
        self.observer_enabled[0] = 1 if enabled else 0
        return self

    def disable_observer(self) -> "FakeQuantizeBase":
        return self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> "FakeQuantizeBase":
        return self

    def disable_fake_quant(self) -> "FakeQuantizeBase":
        return self.enable_fake_quant(False)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.activation_post_process.calculate_qparams()


class FakeQuantize(FakeQuantizeBase):
    """Observe (optionally) and fake-quantize, symmetric with zero point 0.

    ``FakeQuantize(observer, dtype=None, ch_axis=None)``: ``dtype`` and
    ``ch_axis`` default to the observer's; a ``dtype`` that differs from the
    observer's is a ConfigError; a ``ch_axis`` given for a per-channel
    observer is passed on to it (e.g. ``ch_axis=1`` for a ConvTranspose
    weight).  ``ch_axis == -1`` means per tensor.

    Forward: if ``observer_enabled``, the observer sees ``x.detach()`` and
    ``scale``/``zero_point`` are refreshed from it; if ``fake_quant_enabled``,
    returns the fake-quantized ``x`` (clipped STE gradient), else ``x``.
    Fake-quantizing without any scale (never observed data and
    :meth:`set_qparams` never called) raises :class:`CalibrationError`.
    """

    _resizable_buffers = ("scale", "zero_point")

    def __init__(self, observer: nn.Module, dtype=None, ch_axis: int | None = None) -> None:
        super().__init__(observer)
        dtype = None if dtype is None else check_dtype(dtype)
        if dtype is not None and dtype != observer.dtype:
            raise ConfigError(f"FakeQuantize dtype {dtype!r} differs from its observer's "
                              f"{observer.dtype!r}; build the observer with dtype={dtype!r}")
        if ch_axis is not None:
            self.ch_axis = ch_axis
        # under torch.distributed (QAT with DDP) each batch's range is reduced over the ranks,
        # so the scales stay identical on every rank; every rank must run the same steps
        observer.sync_each_batch = True
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("scale", torch.tensor([1.0], dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor([0], dtype=torch.int64))
        self._has_qparams = False

    @property
    def ch_axis(self) -> int:
        return self.activation_post_process.ch_axis

    @ch_axis.setter
    def ch_axis(self, axis: int) -> None:
        obs = self.activation_post_process
        if axis == obs.ch_axis:
            return
        if obs.ch_axis < 0 or axis is None or axis < 0:
            raise ConfigError(
                f"FakeQuantize ch_axis={axis!r} does not fit its observer {type(obs).__name__} "
                f"(ch_axis={obs.ch_axis}); use a per-channel observer for per-channel fake quant "
                f"and a per-tensor one for ch_axis=-1"
            )
        obs.ch_axis = axis  # per-channel observers reset their statistics

    def enable_fake_quant(self, enabled: bool = True) -> "FakeQuantize":
        self.fake_quant_enabled[0] = 1 if enabled else 0
        return self

    def _who(self) -> str:
        return f"fake quant {self.qc_name or type(self).__name__!r}"

    def _store(self, scale: torch.Tensor) -> None:
        s = scale.detach().float().reshape(-1).to(self.scale.device)
        if self.scale.shape != s.shape:
            self.scale.resize_(s.shape)
            self.zero_point.resize_(s.shape)
        self.scale.copy_(s)
        self.zero_point.zero_()
        self._has_qparams = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        if self.observer_enabled[0] == 1:
            self.activation_post_process(x.detach())
            if self.activation_post_process.has_observed:
                self._store(self.activation_post_process.calculate_qparams()[0])
        if self.fake_quant_enabled[0] != 1:
            return x
        if not self._has_qparams:
            raise CalibrationError(
                f"{self._who()} has no scale: its observer never saw data and set_qparams() was "
                f"not called; calibrate (observer on) before validating"
            )
        s = _broadcast_scale(self.scale, x, self.ch_axis, self._who())
        if not self.training:
            return _exact_fake_quant(x, s, self.quant_min, self.quant_max)
        return _FakeQuantSTE.apply(x, s, self.quant_min, self.quant_max)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The qparams in use (refreshed by the observer, or frozen by :meth:`set_qparams`)."""
        if self._has_qparams:
            return self.scale.detach().clone(), self.zero_point.detach().clone()
        return self.activation_post_process.calculate_qparams()

    def set_qparams(self, scale) -> "FakeQuantize":
        """Freeze the scale (zero point 0) and turn the observer off.

        E.g. the hand-over from calibration: ``fq.set_qparams(calib.calculate_qparams()[0])``.
        A min/max observer is seeded with the matching range ``scale * qmax``,
        so re-enabling it (QAT) continues from the calibrated range.
        """
        s = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(-1)
        if s.numel() == 0 or not bool(torch.all(torch.isfinite(s) & (s > 0))):
            raise ConfigError(f"{self._who()}: scale must be finite and > 0, got {scale!r}")
        if self.ch_axis < 0 and s.numel() != 1:
            raise ConfigError(f"{self._who()}: per-tensor fake quant takes one scale, got {s.numel()}")
        self._store(s)
        seed = getattr(self.activation_post_process, "_seed_amax", None)
        if seed is not None:
            seed(s * self.quant_max)
        return self.disable_observer()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        resize_to_saved(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if prefix + "scale" in state_dict:
            self._has_qparams = True

    def extra_repr(self) -> str:
        return (
            f"fake_quant_enabled={_fmt_tensor(self.fake_quant_enabled)}, "
            f"observer_enabled={_fmt_tensor(self.observer_enabled)}, "
            f"quant_min={self.quant_min}, quant_max={self.quant_max}, dtype={self.dtype}, "
            f"qscheme={self.qscheme}, ch_axis={self.ch_axis}, "
            f"scale={_fmt_tensor(self.scale)}, zero_point={_fmt_tensor(self.zero_point)}"
        )


class CalibFakeQuantize(FakeQuantizeBase):
    """Calibration only: the observer records, the input comes back exactly (same object).

    ``calculate_qparams()`` delegates to the observer.  There is no fake
    quant to switch; ``observer_enabled`` stops the recording.

    A weight (an ``nn.Parameter``) is observed again only when it may have
    changed: not when it is the same parameter, at the same version (in-place
    updates bump it) and address, and the observer's state is the one this
    quantizer left, for an observer whose repeat is a no-op (a plain running
    min/max).  Each batch of a calibration saw the same weights again: 3 ms a
    batch on mobilenet_v2.  Some writes bump no version: through ``.data``,
    numpy or ctypes, a ``torch.distributed`` collective into the parameter, a
    fused optimizer step.  So where calibration ends (``sync_observers``, which
    ``convert_fx``, ``prepare_qat_fx`` and ``compile`` call; weight rounding;
    convert itself) every weight whose repeats were skipped is observed once
    more (:func:`observe_final_weights`): the ranges read from then on cover
    the weights as they are.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer_enabled.tolist()[0] == 1:  # (tolist: ~25x cheaper than a tensor compare)
            weight = type(x) is nn.Parameter
            if weight and _seen_unchanged(self, x):
                self._skipped_repeat = True
                return x
            self.activation_post_process(x.detach())
            if weight:
                self._skipped_repeat = False
                _remember(self, x)
        return x


# A CalibFakeQuantize -> (the weight it last observed, its address and shape, the observer's min_val and
# max_val, the versions of those three).  Outside the module: a weak reference cannot be pickled.
_SEEN_WEIGHTS: "weakref.WeakKeyDictionary[CalibFakeQuantize, tuple]" = weakref.WeakKeyDictionary()


def _remember(fq: CalibFakeQuantize, w: torch.Tensor) -> None:
    obs = fq.activation_post_process
    versions = _versions(w, getattr(obs, "min_val", None), getattr(obs, "max_val", None))
    if versions is None or not (isinstance(obs, ObserverBase) and obs._repeat_is_noop()):
        _SEEN_WEIGHTS.pop(fq, None)
        return
    _SEEN_WEIGHTS[fq] = (weakref.ref(w), w.data_ptr(), w.shape, obs.min_val, obs.max_val, versions)


def _versions(*tensors) -> tuple | None:
    """The version counters of ``tensors``; None if one has none (not a tensor, an inference tensor)."""
    try:
        return tuple(t._version for t in tensors)
    except (AttributeError, RuntimeError):
        return None


def _seen_unchanged(fq: CalibFakeQuantize, w: torch.Tensor) -> bool:
    seen = _SEEN_WEIGHTS.get(fq)
    if seen is None:
        return False
    ref, ptr, shape, lo, hi, versions = seen
    obs = fq.activation_post_process
    return (ref() is w and w.data_ptr() == ptr and w.shape == shape and getattr(obs, "min_val", None) is lo
            and getattr(obs, "max_val", None) is hi and _versions(w, lo, hi) == versions and obs._repeat_is_noop())


def observe_final_weight(fq: nn.Module, w: torch.Tensor) -> None:
    """Observe ``w`` once more if ``fq`` (a :class:`CalibFakeQuantize`, observer on) skipped a repeat of it since
    it last observed it.

    A no-op for the observers that skip (a repeat of a tensor seen leaves a running min/max as it
    is), unless the weight changed without a version bump after it was last observed: then its
    range grows to cover it instead of clipping it.  Nothing when the observer is off: a range the
    user froze or set stays as it is.
    """
    if not getattr(fq, "_skipped_repeat", False) or fq.observer_enabled.tolist()[0] != 1:
        return
    obs = fq.activation_post_process
    if isinstance(obs, ObserverBase) and obs._repeat_is_noop():
        obs(w.detach())
    fq._skipped_repeat = False


def observe_final_weights(model: nn.Module) -> None:
    """:func:`observe_final_weight` for every weight layer of ``model`` (``weight_fake_quant`` and ``weight``)."""
    for m in model.modules():
        fq, w = getattr(m, "weight_fake_quant", None), getattr(m, "weight", None)
        if isinstance(fq, CalibFakeQuantize) and isinstance(w, torch.Tensor):
            observe_final_weight(fq, w)


# ---------------------------------------------------------------------------
# model-wide switches (torch.ao-style names)


def _fake_quants(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]


def enable_observer(model: nn.Module) -> nn.Module:
    """Turn on the observer of every fake quant in ``model`` (``model`` may be one)."""
    for m in _fake_quants(model):
        m.enable_observer()
    return model


def disable_observer(model: nn.Module) -> nn.Module:
    for m in _fake_quants(model):
        m.disable_observer()
    return model


def enable_fake_quant(model: nn.Module) -> nn.Module:
    for m in _fake_quants(model):
        m.enable_fake_quant()
    return model


def disable_fake_quant(model: nn.Module) -> nn.Module:
    for m in _fake_quants(model):
        m.disable_fake_quant()
    return model


def set_state(model: nn.Module, state: str) -> nn.Module:
    """Switch every fake quant: ``calibration`` (observe, no fake quant), ``qat``
    (both), ``validation`` (fake quant with frozen scales, no observing)."""
    if state not in STATES:
        raise ConfigError(f"unknown fake-quant state {state!r}; allowed: "
                          + ", ".join(repr(s) for s in STATES))
    observe, fake = STATES[state]
    for m in _fake_quants(model):
        m.enable_observer(observe)
        m.enable_fake_quant(fake)
    return model


def assign_qc_names(model: nn.Module, overwrite: bool = False) -> nn.Module:
    """Set each fake quant's / bare observer's ``qc_name`` to its path in ``model``
    (for error messages); names already set are kept unless ``overwrite``."""
    inside = set()
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        if isinstance(m, FakeQuantizeBase):
            inside.add(id(m.activation_post_process))
        if isinstance(m, (FakeQuantizeBase, ObserverBase)) and (overwrite or not m.qc_name):
            m.qc_name = name
    return model
