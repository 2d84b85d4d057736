"""Observers and fake quant: math by hand, pass-through, STE, states, repr."""

import copy

import pytest
import torch
import torch.nn as nn

from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.quantization import (
    OBSERVERS,
    CalibFakeQuantize,
    FakeQuantize,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PercentileObserver,
    PerChannelMinMaxObserver,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
    fake_quantize,
    make_observer,
    set_state,
)
from qcompiler.quantization import fixed_point as fp

EPS = torch.finfo(torch.float32).eps


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def all_observers():
    return [
        MinMaxObserver(),
        MovingAverageMinMaxObserver(),
        PerChannelMinMaxObserver(),
        MovingAveragePerChannelMinMaxObserver(),
        HistogramObserver(method="mse"),
        HistogramObserver(method="kl"),
        PercentileObserver(),
    ]


# ---------------------------------------------------------------------------
# min/max family


def test_minmax_scale_by_hand_and_legacy_interface():
    o = MinMaxObserver()
    assert (o.qc_leaf, o.qc_op, o.dtype, o.quant_min, o.quant_max, o.ch_axis) == (True, "quant", "qint8", -128, 127, -1)
    assert not o.has_observed
    o(torch.tensor([-0.3, 0.1]))
    o(torch.tensor([0.5, -0.2]))
    assert o.has_observed
    scale, zp = o.calculate_qparams()
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert zp.dtype == torch.int64 and torch.equal(zp, torch.zeros(1, dtype=torch.int64))
    assert scale.item() == pytest.approx(0.5 / 127)
    assert torch.equal(o.calculate_scale(), scale.reshape(()))
    assert o.min_val.item() == pytest.approx(-0.3) and o.max_val.item() == pytest.approx(0.5)


def test_qint16_and_all_zero_data():
    o = MinMaxObserver(dtype="qint16")
    assert (o.quant_min, o.quant_max) == (-32768, 32767)
    o(torch.tensor([-2.0, 1.0]))
    assert o.calculate_qparams()[0].item() == pytest.approx(2.0 / 32767)
    z = MinMaxObserver()
    z(torch.zeros(4))
    assert z.calculate_qparams()[0].item() == EPS  # floored, never 0
    with pytest.raises(ConfigError, match="qint8"):
        MinMaxObserver(dtype="qint4")


def test_per_channel_by_hand():
    o = PerChannelMinMaxObserver(ch_axis=0)
    w = torch.tensor([[-1.0, 0.5], [0.2, 0.25], [-0.1, -0.4]]).reshape(3, 2, 1, 1)
    o(w)
    scale, zp = o.calculate_qparams()
    assert scale.shape == (3,) and zp.shape == (3,)
    assert torch.allclose(scale, torch.tensor([1.0, 0.25, 0.4]) / 127)
    assert o.qscheme == torch.per_channel_symmetric
    # ConvTranspose weights: output channels on axis 1
    t = PerChannelMinMaxObserver(ch_axis=1)
    t(w.transpose(0, 1))
    assert torch.equal(t.calculate_qparams()[0], scale)
    with pytest.raises(CalibrationError, match="channels"):
        o(torch.rand(4, 2, 1, 1))


def test_moving_average_by_hand():
    o = MovingAverageMinMaxObserver(averaging_constant=0.5)
    o(torch.tensor([-1.0, 2.0]))  # first batch initialises
    assert (o.min_val.item(), o.max_val.item()) == (-1.0, 2.0)
    o(torch.tensor([-3.0, 4.0]))
    assert (o.min_val.item(), o.max_val.item()) == (-2.0, 3.0)
    o(torch.tensor([0.0, 1.0]))
    assert (o.min_val.item(), o.max_val.item()) == (-1.0, 2.0)
    assert o.calculate_qparams()[0].item() == pytest.approx(2.0 / 127)

    p = MovingAveragePerChannelMinMaxObserver(averaging_constant=0.25)
    p(torch.tensor([[-1.0, 1.0], [0.0, 4.0]]))
    p(torch.tensor([[-5.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(p.min_val, torch.tensor([-2.0, 0.0]))
    assert torch.equal(p.max_val, torch.tensor([1.0, 3.0]))


def test_observers_return_input_unchanged():
    x = torch.randn(2, 3, 4, 4, generator=gen())
    ref = x.clone()
    for o in all_observers():
        y = o(x)
        assert y is x and torch.equal(y, ref), type(o).__name__
        assert o.has_observed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_raise_calibration_error_naming_qc_name(bad):
    for o in all_observers():
        o.qc_name = "conv0.activation_post_process"
        x = torch.ones(2, 3)
        x[1, 2] = bad
        with pytest.raises(CalibrationError, match=r"observer 'conv0\.activation_post_process' saw NaN/Inf"):
            o(x)
        assert not o.has_observed  # nothing recorded
    with pytest.raises(CalibrationError, match="'MinMaxObserver'"):
        MinMaxObserver()(torch.tensor([float("nan")]))


def test_unobserved_qparams_raise():
    for o in all_observers():
        o.qc_name = "conv3_activation_post_process"
        with pytest.raises(CalibrationError, match="conv3_activation_post_process.*not seen any data"):
            o.calculate_qparams()


# ---------------------------------------------------------------------------
# histogram family


def test_histogram_rebinning_keeps_counts_and_total():
    o = HistogramObserver(bins=4)  # 8 bins over [0, 2**E), 2**E the power of two above max |x|
    o(torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9, 1.0]))  # max 1.0 -> range [0, 2): width 1/4
    assert o.hist_max.item() == 2.0
    before = o.histogram.clone()
    assert torch.equal(before, torch.tensor([1.0, 1, 2, 1, 1, 0, 0, 0], dtype=torch.float64))
    o(torch.tensor([7.0]))  # range grows x4 -> [0, 8) (width 1); 4 old bins merge into one new bin
    assert o.hist_max.item() == 8.0
    expect = torch.tensor([before[:4].sum(), before[4:].sum(), 0, 0, 0, 0, 0, 1], dtype=torch.float64)
    assert torch.equal(o.histogram, expect)
    assert o.histogram.sum().item() == 7
    o(torch.tensor([1000.0]))  # grows past 8 x the width: all old mass in bin 0
    assert o.histogram[0].item() == 7 and o.histogram.sum().item() == 8
    assert o.hist_max.item() == 1024.0


def test_histogram_memory_fixed_over_growing_range():
    o = HistogramObserver(method="mse", bins=256)
    sizes = {k: v.shape for k, v in o.state_dict().items()}
    ptr = o.histogram.data_ptr()
    total = 0
    for i in range(100):
        x = torch.randn(64, generator=gen(i)) * (1.1 ** i)
        o(x)
        total += x.numel()
    assert {k: v.shape for k, v in o.state_dict().items()} == sizes
    assert o.histogram.data_ptr() == ptr and o.histogram.numel() == 512
    assert o.histogram.sum().item() == total
    assert o.max_abs < o.hist_max.item() <= 2 * o.max_abs


@pytest.mark.parametrize("name", ["percentile", "histogram-mse", "kl"])
def test_histogram_state_does_not_depend_on_batch_order_or_split(name):
    # growing ranges (x 1.5 per batch), zeros, and a batch that only holds zeros
    batches = [torch.randn(300, generator=gen(i)) * (1.5 ** i) for i in range(8)]
    batches[2][:50] = 0.0
    batches.insert(3, torch.zeros(10))
    whole = make_observer(name)
    whole(torch.cat(batches))
    for order in (range(len(batches)), reversed(range(len(batches))), [4, 0, 8, 3, 1, 7, 2, 6, 5]):
        o = make_observer(name)
        for i in order:
            o(batches[i])
        assert torch.equal(o.histogram, whole.histogram) and torch.equal(o.hist_max, whole.hist_max)
        assert torch.equal(o.calculate_amax(), whole.calculate_amax())


def test_histogram_sync_without_a_process_group_is_a_no_op():
    o = make_observer("kl")
    o(torch.randn(1000, generator=gen(4)))
    state = {k: v.clone() for k, v in o.state_dict().items()}
    o.sync_ranks()
    o.sync_ranks()
    assert all(torch.equal(v, state[k]) for k, v in o.state_dict().items())


def test_percentile_threshold_on_uniform_data():
    x = torch.linspace(-1.0, 1.0, 20001)
    o = PercentileObserver(percentile=90.0)
    o(x)
    assert o.calculate_amax().item() == pytest.approx(0.9, abs=1.5 / 2048)
    full = PercentileObserver(percentile=100.0)
    full(x)
    assert full.calculate_amax().item() == pytest.approx(1.0)


def _quant_mse(x, scale):
    return ((fake_quantize(x, scale) - x) ** 2).mean().item()


def test_mse_clips_a_rare_outlier_and_beats_minmax():
    x = torch.randn(200_000, generator=gen(1))
    x[123] = 20.0
    mse = HistogramObserver(method="mse")
    mm = MinMaxObserver()
    mse(x)
    mm(x)
    t = mse.calculate_amax().item()
    assert 4.0 < t < 15.0  # well below max |x| = 20
    s_mse, s_mm = mse.calculate_qparams()[0], mm.calculate_qparams()[0]
    assert s_mse.item() == pytest.approx(t / 127)
    assert _quant_mse(x, s_mse) < 0.7 * _quant_mse(x, s_mm)


def test_mse_keeps_the_range_of_plain_data():
    x = torch.rand(50_000, generator=gen(2))  # uniform: clipping never pays
    o = HistogramObserver(method="mse")
    o(x)
    assert o.calculate_amax().item() > 0.97 * x.abs().max().item()


def test_kl_threshold_in_range_and_deterministic():
    x = torch.randn(100_000, generator=gen(3))
    x[7] = 30.0
    a, b = HistogramObserver(method="kl"), make_observer("kl")
    for o in (a, b):
        o(x[:50_000])
        o(x[50_000:])
    t = a.calculate_amax().item()
    assert 0.0 < t <= 30.0
    assert t < 15.0  # the outlier is clipped
    assert a.calculate_amax().item() == t  # recomputed, same answer
    assert b.calculate_amax().item() == t
    # qint16: the histogram is coarser than the integer grid -> keep the max
    c = HistogramObserver(method="kl", dtype="qint16")
    c(x)
    assert c.calculate_amax().item() == pytest.approx(30.0)


def test_histogram_recomputes_after_more_data():
    o = PercentileObserver(percentile=100.0)
    o(torch.tensor([1.0]))
    assert o.calculate_amax().item() == pytest.approx(1.0)
    o(torch.tensor([3.0]))
    assert o.calculate_amax().item() == pytest.approx(3.0)


def test_observer_table_and_factory():
    assert set(OBSERVERS) == {"minmax", "percentile", "histogram-mse", "kl"}
    assert type(make_observer("minmax")) is MinMaxObserver
    assert make_observer("histogram-mse").method == "mse"
    assert make_observer("kl", "qint16").dtype == "qint16"
    assert isinstance(make_observer("percentile"), PercentileObserver)
    with pytest.raises(ConfigError, match="allowed: 'minmax', 'percentile', 'histogram-mse', 'kl'"):
        make_observer("entropy")
    with pytest.raises(ConfigError, match="'mse', 'kl', 'percentile'"):
        HistogramObserver(method="l2")


def test_state_dict_round_trip_of_per_channel_stats():
    o = PerChannelMinMaxObserver()
    o(torch.randn(5, 2, generator=gen()))
    fresh = PerChannelMinMaxObserver()
    fresh.load_state_dict(o.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], o.calculate_qparams()[0])


# ---------------------------------------------------------------------------
# fake quant


def test_fake_quant_is_bit_exact_with_fixed_point():
    x = torch.randn(4096, generator=gen(4)) * 3
    x[:5] = torch.tensor([-0.0, 0.0, -1e-9, 1e9, -1e9])
    for dtype in ("qint8", "qint16"):
        fq = FakeQuantize(MovingAverageMinMaxObserver(dtype=dtype), dtype)
        fq.set_qparams(torch.tensor([0.013]))
        y = fq(x)
        ref = fp.dequantize(fp.quantize(x, fq.scale, dtype), fq.scale)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), dtype  # bits, incl. no -0.0
    # per channel, with the scale the observer derived
    w = torch.randn(6, 3, 3, 3, generator=gen(5))
    fq = FakeQuantize(MovingAveragePerChannelMinMaxObserver(ch_axis=0), "qint8", ch_axis=0)
    y = fq(w)
    ref = fp.dequantize(fp.quantize(w, fq.scale, "qint8", axis=0), fq.scale, axis=0)
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    assert torch.allclose(fq.scale, w.abs().amax(dim=(1, 2, 3)) / 127)


def test_ste_gradient_per_tensor():
    fq = FakeQuantize(MovingAverageMinMaxObserver()).set_qparams(0.1)  # range [-12.8, 12.7]
    x = torch.tensor([-20.0, -12.8, -3.0, 0.0, 5.0, 12.7, 12.8, 30.0], requires_grad=True)
    fq(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1, 1, 1, 1, 1, 0, 0]))


def test_ste_gradient_per_channel():
    fq = FakeQuantize(MovingAveragePerChannelMinMaxObserver(ch_axis=1), ch_axis=1)
    fq.set_qparams(torch.tensor([0.01, 1.0]))  # ranges +-1.27 and +-127
    x = torch.tensor([[0.5, 0.5], [2.0, 2.0], [-5.0, -200.0]], requires_grad=True)
    fq(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))


def test_enable_disable_and_states():
    x = torch.randn(100, generator=gen(6))
    fq = FakeQuantize(MovingAverageMinMaxObserver())
    assert fq.fake_quant_enabled.item() == 1 and fq.observer_enabled.item() == 1
    fq.disable_fake_quant()
    assert fq(x) is x  # observing only
    assert fq.scale.item() == pytest.approx(x.abs().max().item() / 127)
    fq.enable_fake_quant().disable_observer()
    before = fq.activation_post_process.max_val.clone()
    y = fq(x * 10)
    assert torch.equal(fq.activation_post_process.max_val, before)  # observer off: stats frozen
    assert y.abs().max().item() <= 128 * fq.scale.item()

    model = nn.Sequential(nn.Linear(3, 3), CalibFakeQuantize(MinMaxObserver()))
    model[0].weight_fake_quant = FakeQuantize(MovingAveragePerChannelMinMaxObserver(), ch_axis=0)
    model[0].activation_post_process = FakeQuantize(MovingAverageMinMaxObserver())
    fqs = [model[0].weight_fake_quant, model[0].activation_post_process]
    disable_observer(model)
    assert all(m.observer_enabled.item() == 0 for m in fqs + [model[1]])
    enable_observer(model)
    disable_fake_quant(model)
    assert all(m.fake_quant_enabled.item() == 0 for m in fqs)
    enable_fake_quant(model)
    for state, (obs, fake) in {"calibration": (1, 0), "qat": (1, 1), "validation": (0, 1)}.items():
        assert set_state(model, state) is model
        assert [(m.observer_enabled.item(), m.fake_quant_enabled.item()) for m in fqs] == [(obs, fake)] * 2
        assert model[1].observer_enabled.item() == obs
    with pytest.raises(ConfigError, match="'calibration', 'qat', 'validation'"):
        set_state(model, "train")


def test_validation_without_scale_is_an_error():
    fq = FakeQuantize(MovingAverageMinMaxObserver())
    fq.qc_name = "conv2.activation_post_process"
    set_state(fq, "validation")
    with pytest.raises(CalibrationError, match="conv2.activation_post_process.*no scale"):
        fq(torch.ones(3))


def test_set_qparams_freezes_and_seeds_the_observer():
    fq = FakeQuantize(MovingAverageMinMaxObserver())
    fq.set_qparams(torch.tensor([0.02]))
    assert fq.observer_enabled.item() == 0
    fq(torch.full((4,), 100.0))
    assert fq.scale.item() == pytest.approx(0.02)
    assert torch.equal(fq.calculate_qparams()[0], fq.scale)
    assert fq.activation_post_process.max_val.item() == pytest.approx(0.02 * 127)
    with pytest.raises(ConfigError):
        fq.set_qparams(torch.tensor([0.0]))
    # hand-over survives a state_dict round trip
    other = FakeQuantize(MovingAverageMinMaxObserver())
    other.load_state_dict(copy.deepcopy(fq.state_dict()))
    set_state(other, "validation")
    assert torch.equal(other(torch.ones(2)), fq(torch.ones(2)))


def test_fake_quant_config_errors():
    with pytest.raises(ConfigError, match="differs"):
        FakeQuantize(MovingAverageMinMaxObserver(dtype="qint8"), "qint16")
    with pytest.raises(ConfigError, match="per-channel observer"):
        FakeQuantize(MovingAverageMinMaxObserver(), ch_axis=0)
    fq = FakeQuantize(MovingAveragePerChannelMinMaxObserver(ch_axis=0), ch_axis=1)
    assert fq.ch_axis == 1 and fq.activation_post_process.ch_axis == 1
    with pytest.raises(ConfigError):
        FakeQuantize(nn.Identity())


def test_calib_fake_quantize_returns_input_exactly():
    c = CalibFakeQuantize(HistogramObserver())
    x = torch.randn(3, 5, generator=gen(7))
    ref = x.clone()
    assert c(x) is x and torch.equal(x, ref)
    s, zp = c.calculate_qparams()
    assert torch.equal(s, c.activation_post_process.calculate_qparams()[0])
    c.qc_name = "quant"
    assert c.activation_post_process.qc_name == "quant"


def test_repr_matches_the_guide():
    w = FakeQuantize(MovingAveragePerChannelMinMaxObserver(ch_axis=0), "qint8", ch_axis=0)
    w(torch.tensor([[0.254], [0.508], [0.127]]))
    text = repr(w)
    assert ("fake_quant_enabled=tensor([1], dtype=torch.uint8), observer_enabled=tensor([1], dtype=torch.uint8), "
            "quant_min=-128, quant_max=127, dtype=qint8, qscheme=torch.per_channel_symmetric, ch_axis=0, "
            "scale=tensor([0.0020, 0.0040, 0.0010]), zero_point=tensor([0, 0, 0])") in text
    assert "(activation_post_process): MovingAveragePerChannelMinMaxObserver(" in text
    a = FakeQuantize(MovingAverageMinMaxObserver())
    assert "qscheme=torch.per_tensor_symmetric, ch_axis=-1, scale=tensor([1.]), zero_point=tensor([0])" in repr(a)
    c = repr(CalibFakeQuantize(MinMaxObserver()))
    assert c.startswith("CalibFakeQuantize(\n  (activation_post_process): MinMaxObserver(")
    assert repr(MinMaxObserver()) == "MinMaxObserver(min_val=inf, max_val=-inf)"
    h = HistogramObserver(method="percentile", percentile=99.9, dtype="qint16")
    assert repr(h) == "HistogramObserver(method=percentile, bins=2048, percentile=99.9, empty, dtype=qint16)"
    many = PerChannelMinMaxObserver()
    many(torch.arange(64.0).reshape(64, 1))
    assert len(repr(many)) < 200 and "(C=64)" in repr(many)


def test_kl_is_not_pulled_down_by_the_zeros_after_relu():
    from qcompiler.quantization import make_observer

    torch.manual_seed(0)
    x = torch.relu(torch.randn(100000))
    ob = make_observer("kl", "qint8")
    ob(x)
    # without discounting bin 0 the search picked ~2.0 (half the range of a ReLU'd normal)
    assert 3.0 < ob.calculate_amax().item() < x.max().item()
