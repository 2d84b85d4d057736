"""CalibFakeQuantize observes a weight again only when it may have changed (fake_quantize.py).

Each calibration batch passes the same weights; a plain running min/max would come out the same, so
the repeat is skipped.  What must hold: the observer state is the one observing every batch gives,
an in-place update (version bump), a new parameter or a reset observer is observed, observers whose
repeat is not a no-op see every batch, and a change through ``.data`` (no version bump) is covered
at convert.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qcompiler.quantization import prepare_calibration_fx
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.observer import (
    MovingAveragePerChannelMinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
)
from qcompiler.quantization.qconfig import get_default_calib_qconfig


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


X = torch.randn(2, 3, 8, 8)


@pytest.fixture(autouse=True)
def observed(monkeypatch):
    """Record every call of an observer's forward, as the observer it was made on, in ``_Calls.seen``."""
    _Calls.seen = []

    def forward(self, x, _real=ObserverBase.forward):
        _Calls.seen.append(self)
        return _real(self, x)

    monkeypatch.setattr(ObserverBase, "forward", forward)


def calibrated(batches: int = 3, between=None):
    cal = prepare_calibration_fx(Net().eval(), {"": get_default_calib_qconfig(observer="minmax")},
                                 example_inputs=(X,))
    obs = cal.fc.weight_fake_quant.activation_post_process
    calls = _Calls(obs)
    with torch.no_grad():
        for i in range(batches):
            cal(X + i)
            if between is not None:
                between(cal, i)
    return cal, obs, calls


class _Calls:
    """The calls of the observer ``obs`` recorded by the fixture (len() reads them now)."""

    seen: list = []

    def __init__(self, obs) -> None:
        self.obs = obs

    def __len__(self) -> int:
        return sum(o is self.obs for o in _Calls.seen)


def per_channel_extremes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = w.detach().reshape(w.shape[0], -1)
    return flat.amin(1), flat.amax(1)


def test_an_unchanged_weight_is_observed_once_with_the_state_every_batch_gives():
    cal, obs, calls = calibrated(4)
    assert len(calls) == 1
    lo, hi = per_channel_extremes(cal.fc.weight)
    assert torch.equal(obs.min_val, lo) and torch.equal(obs.max_val, hi)
    # the activations are observed on every batch: the output range of all four
    net = Net().eval()
    with torch.no_grad():
        outs = torch.cat([net(X + i) for i in range(4)])
    act = cal.fc.activation_post_process.activation_post_process
    assert (float(act.min_val), float(act.max_val)) == (float(outs.min()), float(outs.max()))


def test_an_in_place_update_is_observed():
    def scale_up(cal, i):
        cal.fc.weight.mul_(2.0)  # under no_grad: bumps the version

    cal, obs, calls = calibrated(3, scale_up)
    assert len(calls) == 3  # batch 0, and after each of the first two updates
    lo, hi = per_channel_extremes(cal.fc.weight / 2.0)  # the last weights observed (before the last update)
    assert torch.equal(obs.min_val, lo) and torch.equal(obs.max_val, hi)


def test_a_new_parameter_or_a_reset_observer_is_observed():
    def swap(cal, i):
        if i == 0:
            cal.fc.weight = nn.Parameter(cal.fc.weight.detach() * 3.0)
        if i == 1:
            cal.fc.weight_fake_quant.activation_post_process.reset()

    cal, obs, calls = calibrated(3, swap)
    assert len(calls) == 3
    lo, hi = per_channel_extremes(cal.fc.weight)
    assert torch.equal(obs.min_val, lo) and torch.equal(obs.max_val, hi)


def test_observers_whose_repeat_changes_the_state_see_every_batch():
    cal = prepare_calibration_fx(Net().eval(), {"": get_default_calib_qconfig(observer="minmax")},
                                 example_inputs=(X,))
    fq = cal.fc.weight_fake_quant
    fq.activation_post_process = MovingAveragePerChannelMinMaxObserver()
    calls = _Calls(fq.activation_post_process)
    with torch.no_grad():
        for i in range(3):
            cal(X)
    assert len(calls) == 3
    synced = PerChannelMinMaxObserver()
    synced.sync_each_batch = True
    assert not synced._repeat_is_noop() and PerChannelMinMaxObserver()._repeat_is_noop()


def test_a_change_through_data_is_covered_at_convert():
    def hidden(cal, i):
        if i == 0:
            cal.fc.weight.data.mul_(3.0)  # .data: no version bump, so the next batches skip it

    cal, obs, calls = calibrated(3, hidden)
    assert len(calls) == 1
    w = cal.fc.weight.detach()
    q = convert_fx(cal)
    # the scales cover the final weights (3x the ones observed during calibration): nothing clipped
    want = PerChannelMinMaxObserver()
    want(w)
    assert torch.equal(q.fc.w_scale.reshape(-1), want.calculate_qparams()[0].reshape(-1).to(q.fc.w_scale.dtype))
    first_lo, first_hi = per_channel_extremes(Net().fc.weight)  # what batch 0 saw, before the change
    assert torch.equal(obs.min_val, first_lo) and torch.equal(obs.max_val, first_hi)  # the calibration model's own
    assert len(calls) == 1  # convert observed its own copy, not the calibration model


def test_weights_made_under_inference_mode_are_observed_every_batch():
    """Inference tensors have no version counter: nothing can tell them unchanged, so nothing is skipped."""
    with torch.inference_mode():
        net = Net().eval()
    cal = prepare_calibration_fx(net, {"": get_default_calib_qconfig(observer="minmax")}, example_inputs=(X,))
    calls = _Calls(cal.fc.weight_fake_quant.activation_post_process)
    with torch.inference_mode():
        for i in range(3):
            cal(X + i)
    assert len(calls) == 3


def test_a_range_frozen_by_the_user_is_not_widened_at_convert():
    """Observers switched off, the weight range narrowed by hand: convert keeps it (review of the skip)."""
    for batches in (1, 3):
        cal, obs, calls = calibrated(batches)
        for m in cal.modules():
            if hasattr(m, "observer_enabled"):
                m.observer_enabled.fill_(0)
        obs.min_val, obs.max_val = obs.min_val * 0.5, obs.max_val * 0.5
        want = obs.calculate_qparams()[0].reshape(-1)
        assert torch.equal(convert_fx(cal).fc.w_scale.reshape(-1), want.to(torch.float32))


def test_the_qat_hand_over_sees_a_change_through_data():
    """prepare_qat_fx starts QAT from the calibration ranges: they cover the weights as they are."""
    from qcompiler.quantization.prepare import prepare_qat_fx
    from qcompiler.quantization.qconfig import get_default_qat_qconfig

    def hidden(cal, i):
        if i == 0:
            cal.fc.weight.data.mul_(3.0)

    cal, obs, calls = calibrated(3, hidden)
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig()})
    want = PerChannelMinMaxObserver()
    want(cal.fc.weight.detach())
    got = qat.fc.weight_fake_quant.activation_post_process  # seeded symmetric from the calibrated range
    assert torch.equal(got.max_val, torch.maximum(want.min_val.abs(), want.max_val))
