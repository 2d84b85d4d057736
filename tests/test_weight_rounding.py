"""optimize_weight_rounding: GPTQ-style re-rounding of calibrated weights before convert_fx."""

import copy
import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_untouched, snapshot

from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.quantization import (
    CalibFakeQuantize,
    FakeQuantizeBase,
    LayerRounding,
    RoundingReport,
    convert_fx,
    get_default_calib_qconfig,
    optimize_weight_rounding,
    prepare_calibration_fx,
    prepare_qat_fx,
)
from qcompiler.quantization import weight_rounding as wr
from qcompiler.quantization.fixed_point import quantize

# ---------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency (ms per op on a loaded 2-core box)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def args_of(batch):
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def calibrate(model, batches, qconfig=None):
    """A calibration model of a copy of ``model``, run (eval, no_grad) on every batch."""
    cal = prepare_calibration_fx(copy.deepcopy(model), {"": qconfig or get_default_calib_qconfig()},
                                 example_inputs=args_of(batches[0]))
    cal.eval()
    with torch.no_grad():
        for b in batches:
            cal(*args_of(b))
    return cal


def weight_layers(cal):
    """{path: layer} of every layer whose weight a calibration fake quant observes."""
    return {n: m for n, m in cal.named_modules() if isinstance(getattr(m, "weight_fake_quant", None), CalibFakeQuantize)}


def weight_scale(layer):
    return layer.weight_fake_quant.calculate_qparams()[0]


def codes(layer, weight=None):
    """The integer codes convert_fx computes for ``weight`` (default: the layer's own)."""
    w = (layer.weight if weight is None else weight).detach()
    s = weight_scale(layer)
    axis = 1 if isinstance(layer, nn.ConvTranspose2d) else 0
    return quantize(w, s, layer.weight_fake_quant.dtype, axis=axis if s.numel() > 1 else None)


def converted_codes(q, path):
    """q_weight of the converted layer for a calibration-model layer path (fused: 'c1.op' -> 'c1')."""
    return q.get_submodule(path.removesuffix(".op")).q_weight


def rows(report):
    return {r.name: r for r in report}


def sqnr_db(ref, out):
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def smooth(n, seed, channels=3, size=16, low=4):
    """Low-resolution noise upsampled bilinearly: neighbouring pixels strongly correlated."""
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.randn(n, channels, low, low, generator=g), size=(size, size), mode="bilinear",
                         align_corners=False)


def check_rows_sane(report):
    for r in report:
        assert isinstance(r, LayerRounding)
        assert r.method == "gptq" or r.method.startswith("nearest"), r
        if r.method.startswith("nearest: transposed"):
            continue
        assert r.rounded_mse <= r.nearest_mse, r
        if r.method == "gptq":
            assert r.rounded_mse < r.nearest_mse and r.gain_db > 0, r


class SmoothNet(nn.Module):
    """conv+BN+ReLU, grouped conv+ReLU, depthwise conv, global average pool, linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.c1(x)))
        x = self.dw(F.relu(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def smooth_net(seed=1):
    torch.manual_seed(seed)
    m = SmoothNet()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.2, 0.2)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


SMOOTH_DATA = [smooth(8, 100 + i) for i in range(4)]
# int16 activations: the activation rounding noise is ~256x smaller than with int8, so the
# converted model's error is dominated by the (int8) weight rounding this module changes
QC16 = get_default_calib_qconfig(dtype="qint16")


# ---------------------------------------------------------------------------
# 1. smooth inputs: the rounding pays off


def test_smooth_model_rounding_beats_nearest():
    m = smooth_net()
    plain = calibrate(m, SMOOTH_DATA, QC16)
    cal = calibrate(m, SMOOTH_DATA, QC16)
    report = optimize_weight_rounding(cal, SMOOTH_DATA)

    assert isinstance(report, RoundingReport)
    assert [r.name for r in report] == ["c1.op", "c2.op", "dw", "fc"]  # forward order, every weight layer
    check_rows_sane(report)
    by = rows(report)
    # observed: c1.op +6.7 dB, c2.op +9.0, dw +6.2, fc +17.9 (fc: 8 columns, only 32 samples)
    assert by["c1.op"].method == "gptq" and by["c1.op"].gain_db > 3
    assert by["c1.op"].columns == 27 and by["c1.op"].samples == 4 * 8 * 16 * 16
    assert by["c2.op"].columns == 36  # per group: 4 input channels * 3 * 3
    assert by["dw"].columns == 9
    assert by["fc"].columns == 8 and by["fc"].samples == 32

    test = smooth(32, 999)
    with torch.no_grad():
        f = m(test)
        s_nearest = sqnr_db(f, convert_fx(plain)(test))
        s_rounded = sqnr_db(f, convert_fx(cal)(test))
    # observed: nearest 56.9 dB, rounded 67.4 dB
    assert s_rounded > s_nearest + 5, (s_nearest, s_rounded)


# ---------------------------------------------------------------------------
# 2. the weights land exactly on the unchanged grid and convert_fx reads those codes


def test_rounded_weights_are_grid_values_at_unchanged_scales():
    cal = calibrate(smooth_net(), SMOOTH_DATA, QC16)
    layers = weight_layers(cal)
    scales_before = {n: weight_scale(l).clone() for n, l in layers.items()}
    ranges_before = {n: (l.weight_fake_quant.activation_post_process.min_val.clone(),
                         l.weight_fake_quant.activation_post_process.max_val.clone()) for n, l in layers.items()}
    report = optimize_weight_rounding(cal, SMOOTH_DATA)
    assert all(r.method == "gptq" for r in report), str(report)  # so every layer below was rewritten
    q = convert_fx(cal)
    for name, layer in layers.items():
        obs = layer.weight_fake_quant.activation_post_process
        assert torch.equal(obs.min_val, ranges_before[name][0]) and torch.equal(obs.max_val, ranges_before[name][1])
        s = weight_scale(layer)
        assert torch.equal(s, scales_before[name]), name
        w = layer.weight.detach()
        shape = [-1] + [1] * (w.dim() - 1)
        k = torch.round(w / s.reshape(shape))
        assert k.abs().max() <= 127, name
        # stored as the float32 product q * s, so w / s is an integer up to float32 rounding
        # (observed max |w/s - q| = 7.6e-6) ...
        torch.testing.assert_close(w / s.reshape(shape), k, rtol=0, atol=1e-4)
        # ... and w is exactly that product
        assert torch.equal(w, k * s.reshape(shape)), name
        assert torch.equal(converted_codes(q, name).long(), k.long()), name
        assert torch.equal(codes(layer).long(), k.long()), name


# ---------------------------------------------------------------------------
# 3. where the rule must not fire


class Lin(nn.Module):
    def __init__(self, d_in, d_out, bias=True):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x):
        return self.fc(x)


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_diagonal_second_moment_gives_exactly_nearest_codes():
    torch.manual_seed(0)
    model = Lin(8, 6)
    x = 0.75 * hadamard(8)  # rows of a scaled Hadamard matrix: the 8 input columns are orthogonal
    data = [x[:4], x[4:]]
    cal = calibrate(model, data)
    layer = cal.fc
    nearest = codes(layer)
    (r,) = optimize_weight_rounding(cal, data)
    assert r.name == "fc" and r.columns == 8 and r.samples == 8
    # no error feedback between orthogonal inputs: GPTQ reproduces nearest, which is kept
    assert r.method == "nearest", r
    assert r.rounded_mse == r.nearest_mse > 0
    assert torch.equal(codes(layer), nearest)
    assert torch.equal(converted_codes(convert_fx(cal), "fc"), nearest)


def test_fewer_samples_than_columns_keeps_nearest():
    torch.manual_seed(0)
    model = Lin(16, 4)
    data = [torch.randn(3, 16), torch.randn(3, 16)]
    cal = calibrate(model, data)
    nearest = codes(cal.fc)
    (r,) = optimize_weight_rounding(cal, data)
    assert r.method.startswith("nearest:"), r
    assert "6 samples < 16 columns" in r.method
    assert (r.columns, r.samples) == (16, 6)
    assert r.rounded_mse == r.nearest_mse and r.gain_db == 0.0
    assert torch.equal(codes(cal.fc), nearest)
    assert torch.equal(converted_codes(convert_fx(cal), "fc"), nearest)


# ---------------------------------------------------------------------------
# 4. a case to check by hand


def test_hand_checkable_linear_finds_the_brute_force_optimum():
    model = Lin(3, 1, bias=False)
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[0.004, 0.004, 1.27]]))
    # weight scale s = 1.27 / 127 = 0.01, so w / s = (0.4, 0.4, 127). Inputs 1 and 2 move together
    # (x2 ~ x1), input 3 independently. Nearest codes (0, 0, 127) leave the error -(0.4 + 0.4) s x1 on
    # every sample; rounding one of the two 0.4s up to 1 leaves only ~(0.4 - 0.6) s x1.
    x = torch.tensor([[1.00, 0.96, 0.00],
                      [-1.00, -0.98, 0.00],
                      [0.50, 0.52, 1.00],
                      [-0.50, -0.50, -1.00],
                      [0.80, 0.78, -0.50],
                      [-0.30, -0.32, 0.50]])
    data = [x[:3], x[3:]]
    cal = calibrate(model, data)
    s = weight_scale(cal.fc).double()
    torch.testing.assert_close(s, torch.tensor([0.01], dtype=torch.float64), rtol=1e-6, atol=0)
    s_in = cal.x_activation_post_process.calculate_qparams()[0]
    xq = quantize(x, s_in).double() * s_in.double()  # what the layer sees on the BPU
    w = model.fc.weight.detach().double()

    def mse(c):
        return float((((w - c.double() * s) @ xq.T) ** 2).mean())

    ratio = w / s
    options = [sorted({math.floor(v), math.ceil(v)} & set(range(-127, 128))) for v in ratio.flatten().tolist()]
    candidates = [torch.tensor([c], dtype=torch.float64) for c in itertools.product(*options)]
    best = min(candidates, key=mse)
    assert best.tolist() != [[0.0, 0.0, 127.0]]  # nearest is not optimal here

    (r,) = optimize_weight_rounding(cal, data)
    got = converted_codes(convert_fx(cal), "fc")
    # observed: nearest (0, 0, 127) mse 3.39e-5; chosen (0, 1, 127) mse 1.94e-6 = the optimum
    # ((1, 0, 127) gives 2.33e-6)
    assert r.method == "gptq"
    assert mse(got) <= mse(torch.tensor([[0, 0, 127]])) / 10
    assert torch.equal(got.double(), best), (got, best)
    assert r.rounded_mse == pytest.approx(mse(best), rel=1e-9)
    assert r.nearest_mse == pytest.approx(mse(torch.tensor([[0, 0, 127]])), rel=1e-9)


# ---------------------------------------------------------------------------
# the algorithm against a textbook (unblocked) GPTQ, for several block sizes


def reference_gptq(w, s, h, damp=0.01, qmax=127):
    """Column by column GPTQ (columns by decreasing H[i, i]), no lazy blocks. w (o, d), s (o, 1), h (d, d)."""
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    h = h[perm][:, perm]
    w = w[:, perm].clone()
    h = h + damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i in range(w.shape[1]):
        q[:, i] = torch.clamp(torch.round(w[:, i] / s[:, 0]), -qmax, qmax)
        err = (w[:, i] - q[:, i] * s[:, 0]) / u[i, i]
        w[:, i:] -= err[:, None] * u[None, i, i:]
    return q[:, torch.argsort(perm)]


def test_block_sizes_match_unblocked_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 3, generator=g) @ torch.randn(3, 12, generator=g) + 0.2 * torch.randn(96, 12, generator=g)
    x[:, 5] *= 3.0  # unequal diagonal: the column order matters
    data = [x[i:i + 32] for i in range(0, 96, 32)]
    torch.manual_seed(0)
    model = Lin(12, 6)
    results = []
    for block in (1, 5, 128):
        cal = calibrate(model, data)
        s = weight_scale(cal.fc).double().reshape(-1, 1)
        s_in = cal.x_activation_post_process.calculate_qparams()[0]
        xq = quantize(x, s_in).double() * s_in.double()
        ref = reference_gptq(model.fc.weight.detach().double(), s, xq.T @ xq / xq.shape[0])
        (r,) = optimize_weight_rounding(cal, data, block_size=block)
        assert r.method == "gptq", r
        results.append(codes(cal.fc))
        assert torch.equal(results[-1].double(), ref), block
    assert not torch.equal(results[0].double(), torch.round(model.fc.weight.detach().double() / s))


# ---------------------------------------------------------------------------
# 5. transposed convs


class UpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.b = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.b(self.up(x))


def test_transposed_conv_keeps_nearest():
    torch.manual_seed(0)
    model = UpNet().eval()
    data = [smooth(4, 10 + i, channels=4, size=6, low=3) for i in range(3)]
    cal = calibrate(model, data)
    nearest = codes(cal.up)
    report = optimize_weight_rounding(cal, data)
    by = rows(report)
    assert [r.name for r in report] == ["up", "b"]
    assert by["up"].method == "nearest: transposed conv"
    assert torch.equal(codes(cal.up), nearest)
    assert torch.equal(converted_codes(convert_fx(cal), "up"), nearest)
    assert by["b"].method == "gptq"  # the layer after it is still rounded
    check_rows_sane(report)


# ---------------------------------------------------------------------------
# bug: a layer after a layer kept at nearest is rounded for inputs the BPU never sees


def test_layer_after_a_nearest_kept_layer_sees_its_bpu_inputs():
    """The module documents that H is collected on the inputs the BPU will see, with the layers
    before already re-rounded. A layer kept at nearest (here a transposed conv) keeps its float
    weights in the calibration model, and its CalibFakeQuantize returns them unquantized, so the
    next layer's H is collected on outputs of unquantized weights.

    Made visible with a transposed conv whose weights sit badly on their grid (one large weight per
    output channel on a nearly silent input channel sets the scale; the rest round to -1, 0, 1).
    Observed: reported nearest_mse 2.012e-10, on the converted model's inputs 2.237e-10 (-10%);
    with the transposed conv's weights snapped to their nearest grid values (by hand, or by a
    patched module) both agree to 1e-7.
    """
    torch.manual_seed(0)
    model = UpNet().eval()
    with torch.no_grad():
        model.up.weight.uniform_(-0.01, 0.01)
        model.up.weight[0, :, 0, 0] = 1.0
        model.up.bias.zero_()
    gain = torch.tensor([0.001, 1.0, 1.0, 1.0]).reshape(1, 4, 1, 1)
    data = [smooth(4, 20 + i, channels=4, size=6, low=3) * gain for i in range(3)]
    cal = calibrate(model, data, QC16)
    w_b, s_b = cal.b.weight.detach().double().reshape(4, -1), weight_scale(cal.b).double().reshape(-1, 1)
    report = optimize_weight_rounding(cal, data)
    assert rows(report)["up"].method == "nearest: transposed conv"

    q = convert_fx(cal)
    seen = []
    handle = q.b.register_forward_pre_hook(lambda mod, a: seen.append(a[0].int_repr().double() * mod.in_scale))
    with torch.no_grad():
        for d in data:
            q(d)
    handle.remove()
    cols = torch.cat([F.unfold(t, 3, padding=1).permute(1, 0, 2).reshape(36, -1) for t in seen], 1)
    h = cols @ cols.T / cols.shape[1]
    dw = w_b - torch.clamp(torch.round(w_b / s_b), -127, 127) * s_b
    expected = float(((dw @ h) * dw).sum() / dw.shape[0])
    assert rows(report)["b"].nearest_mse == pytest.approx(expected, rel=1e-4)


# ---------------------------------------------------------------------------
# bug: inputs that never vary make the damping depend on the input scale


def test_dead_inputs_do_not_make_rounding_depend_on_input_scale():
    """GPTQ is invariant to scaling the layer's input: H scales, the damping is relative to H's
    mean diagonal, and the error feedback uses ratios of the factor's entries. Scaling every input
    by 2**-10 scales every calibrated activation scale by exactly 2**-10, so the codes must not
    change. Without dead inputs they don't; with two always-zero inputs they do, because
    _gptq_codes sets a dead input's H[i, i] to the absolute value 1, which then dominates the mean
    diagonal (and the damping) when the real inputs are small. Observed with two dead inputs: scale 1
    -> gptq +5.96 dB; scale 2**-10 -> "nearest" +0.00 dB (over-damped); without dead inputs +13.33 dB
    at both scales. A dead ReLU channel (k*k dead columns in the next conv) is common in real nets.
    """
    def run(scale, dead):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 2, generator=g) @ torch.randn(2, 8, generator=g) + 0.1 * torch.randn(256, 8, generator=g)
        x[:, :dead] = 0
        x = x * scale
        data = [x[i:i + 64] for i in range(0, 256, 64)]
        torch.manual_seed(0)
        cal = calibrate(Lin(8, 4, bias=False), data)
        act_scales = [m.calculate_qparams()[0] for n, m in cal.named_modules()
                      if isinstance(m, FakeQuantizeBase) and not n.endswith("weight_fake_quant")]
        (r,) = optimize_weight_rounding(cal, data)
        return r, codes(cal.fc), act_scales

    for dead in (0, 2):
        r1, q1, a1 = run(1.0, dead)
        r2, q2, a2 = run(2.0 ** -10, dead)
        for s1, s2 in zip(a1, a2):  # the premise: the whole quantization scales exactly
            assert torch.equal(s1 * 2.0 ** -10, s2)
        assert r1.method == "gptq" and r1.gain_db > 3, (dead, r1)
        assert r2.method == r1.method, (dead, r1, r2)
        assert r2.gain_db == pytest.approx(r1.gain_db, abs=1e-6), (dead, r1, r2)
        assert torch.equal(q1, q2), dead


# ---------------------------------------------------------------------------
# 6. state restored


class PlainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.c2(F.relu(self.c1(x))).mean((2, 3)))


def test_state_is_restored():
    torch.manual_seed(0)
    model = PlainNet().eval()
    data = [smooth(4, 40 + i) for i in range(3)]
    x = smooth(2, 77)
    cal = calibrate(model, data)
    fqs = {n: m for n, m in cal.named_modules() if isinstance(m, FakeQuantizeBase)}
    off = {"x_activation_post_process", "fc.weight_fake_quant"}
    assert off <= fqs.keys()
    for n in off:
        fqs[n].disable_observer()
    weight_keys = {f"{n}.weight" for n in weight_layers(cal)}

    cal.train()
    with torch.no_grad():
        out_before = cal(x)
    others = {k: v.clone() for k, v in cal.state_dict().items() if k not in weight_keys}
    optimize_weight_rounding(cal, data)
    assert cal.training and all(m.training for m in cal.modules())
    for n, m in fqs.items():
        assert int(m.observer_enabled[0]) == (0 if n in off else 1), n
    now = cal.state_dict()
    for k, v in others.items():  # no observer recorded anything, no buffer changed
        assert torch.equal(now[k], v), k
    for m in cal.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, m

    # the calibration model computes exactly the float model with the new weights again
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for n in ("c1", "c2", "fc"):
            getattr(rounded, n).weight.copy_(cal.get_submodule(n).weight)
        out_after = cal(x)
        assert torch.equal(out_after, rounded(x))
    assert not torch.equal(out_after, out_before)  # the weights did change

    # a second call finds nothing to change
    cal.eval()
    weights = {k: v.clone() for k, v in cal.state_dict().items() if k in weight_keys}
    optimize_weight_rounding(cal, data)
    assert not cal.training and not any(m.training for m in cal.modules())
    for k, v in weights.items():
        assert torch.equal(cal.state_dict()[k], v), k
    with torch.no_grad():
        assert torch.equal(cal(x), out_after)
    for n, m in fqs.items():
        assert int(m.observer_enabled[0]) == (0 if n in off else 1), n


# ---------------------------------------------------------------------------
# 7. errors


def test_wrong_models_are_config_errors_and_untouched():
    torch.manual_seed(0)
    model = PlainNet().eval()
    data = [smooth(2, 50)]
    cal = calibrate(model, data)
    for bad in (model, prepare_qat_fx(calibrate(model, data)), convert_fx(calibrate(model, data))):
        snap = snapshot(bad)
        with pytest.raises(ConfigError, match="prepare_calibration_fx"):
            optimize_weight_rounding(bad, data)
        assert_untouched(bad, snap)

    snap = snapshot(cal)
    for kw in ({"damp": 0}, {"damp": float("nan")}, {"damp": -0.01}, {"block_size": 0}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            optimize_weight_rounding(cal, data, **kw)
        assert_untouched(cal, snap)
    with pytest.raises(ConfigError, match="no batches"):
        optimize_weight_rounding(cal, [])
    assert_untouched(cal, snap)


def test_observers_that_never_ran_are_a_calibration_error():
    torch.manual_seed(0)
    cal = prepare_calibration_fx(PlainNet().eval(), {"": get_default_calib_qconfig()},
                                 example_inputs=(smooth(1, 0),))
    snap = snapshot(cal)
    with pytest.raises(CalibrationError, match=r"never saw data: .*x_activation_post_process"):
        optimize_weight_rounding(cal, [smooth(2, 1)])
    assert_untouched(cal, snap)


def test_a_batch_the_model_cannot_take_is_a_calibration_error_and_restores_weights():
    torch.manual_seed(0)
    batches = [smooth(8, i) for i in range(2)]
    cal = calibrate(PlainNet().eval(), batches)
    snap = snapshot(cal)
    # a batch with 5 channels fails at the first layer, before anything is rounded
    with pytest.raises(CalibrationError, match=r"failed on batch 1 .*shaped like the calibration batches"):
        optimize_weight_rounding(cal, [batches[0], smooth(8, 3, channels=5)])
    assert_untouched(cal, snap)
    # a failure after the first layer was rounded: the second layer raises on its second call
    # (the first is the call-order pass), so the first layer's new weights must be undone
    layers = list(weight_layers(cal).values())
    calls = []

    def boom(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")

    handle = layers[1].register_forward_pre_hook(boom)
    with pytest.raises(CalibrationError, match=r"failed on batch 0 \(RuntimeError: device lost\)"):
        optimize_weight_rounding(cal, batches)
    handle.remove()  # the test's own hook; snapshot compares hooks too
    assert_untouched(cal, snap)


# ---------------------------------------------------------------------------
# 8. models with several inputs


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x, y):
        return self.fc(F.relu(self.a(x) + self.b(y)).mean((2, 3)))


def test_tuple_batches():
    torch.manual_seed(0)
    model = TwoInputs().eval()
    data = [(smooth(4, 60 + i), smooth(4, 70 + i, channels=2)) for i in range(3)]
    cal = calibrate(model, data)
    report = optimize_weight_rounding(cal, data)
    by = rows(report)
    assert set(by) == set(weight_layers(cal))
    check_rows_sane(report)
    cols = {n.split(".")[0]: r.columns for n, r in by.items()}
    assert cols["a"] == 27 and cols["b"] == 18 and cols["fc"] == 4  # b saw y (2 channels), not x
    assert any(r.method == "gptq" for r in report)
    q = convert_fx(cal)
    for name, layer in weight_layers(cal).items():
        assert torch.equal(converted_codes(q, name), codes(layer)), name
    with torch.no_grad():
        f, o = model(*data[0]), q(*data[0])
    assert sqnr_db(f, o) > 20


# ---------------------------------------------------------------------------
# 9. progress bar and the table


def test_progress_and_table(capsys):
    torch.manual_seed(0)
    data = [smooth(4, 80 + i) for i in range(2)]
    cal = calibrate(PlainNet().eval(), data)
    report = optimize_weight_rounding(cal, data, progress=True)
    assert "weight rounding" in capsys.readouterr().err
    table = str(report)
    lines = table.splitlines()
    assert "layer" in lines[0] and "gain dB" in lines[0] and "rounding" in lines[0]
    assert len(lines) == 2 + len(report)
    for r in report:
        line = next(l for l in lines[2:] if l.split("|")[1].strip() == r.name)
        assert r.method in line and f"{r.gain_db:+.2f}" in line
    assert {r.name for r in report} == {"c1.op", "c2", "fc"}


# ---------------------------------------------------------------------------
# 10. speed without changing results: passes resume where the previous layer's stopped


def rounded(cal, data, hook_model=False, **kw):
    """Weights and report rows after optimize_weight_rounding on a copy of ``cal``."""
    c = copy.deepcopy(cal)
    if hook_model:  # the model's call is more than its graph: no resuming
        c.register_forward_pre_hook(lambda m, a: None)
        assert not wr._Passes(c, list(weight_layers(c).items())).resumable
    report = optimize_weight_rounding(c, data, **kw)
    return c, {n: m.weight.detach().clone() for n, m in weight_layers(c).items()}, [
        (r.name, r.columns, r.samples, r.nearest_mse, r.rounded_mse, r.method) for r in report]


def assert_same(a, b):
    (_, wa, ra), (_, wb, rb) = a, b
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert ra == rb


def test_passes_resume_and_give_what_passes_from_the_inputs_give(monkeypatch):
    """Each layer's pass starts at the node calling the layer, from the values kept by the previous
    layer's pass: the first layer's node runs once per batch (plus the call-order pass), not once
    per later layer, and every weight and report number is exactly that of passes run from the
    inputs (no memory budget to keep values: the plain algorithm)."""
    torch.manual_seed(0)
    cal = calibrate(PlainNet().eval(), [smooth(4, 40 + i) for i in range(3)])
    data = [smooth(4, 40 + i) for i in range(3)]

    def run():
        counted = copy.deepcopy(cal)
        runs = []
        counted.c1.register_forward_hook(lambda *a: runs.append(1))
        _, weights, report = rounded(counted, data)
        return (None, weights, report), len(runs)

    resumed, c1_runs = run()
    assert c1_runs == 1 + len(data)
    monkeypatch.setattr(wr, "_RESUME_BUDGET", 0)
    from_inputs, c1_runs = run()
    assert c1_runs == 1 + 2 * len(data)  # for c2 and for fc
    assert_same(resumed, from_inputs)
    assert any(r[5] == "gptq" for r in resumed[2])


class Reuse(nn.Module):
    """c2 is called twice (its passes run to the end, over layers not yet rounded), and an
    in-place op changes a value kept for resuming (the pass then restarts from the inputs)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.c4 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        a = self.c1(x)
        d = self.c2(F.relu(self.c3(self.c2(a))))
        a.mul_(0.5)
        return self.fc((a + self.c4(d)).mean((2, 3)))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_shared_layer_and_in_place_ops_give_what_passes_from_the_inputs_give(monkeypatch):
    torch.manual_seed(0)
    data = [smooth(4, i) for i in range(3)]
    cal = calibrate(Reuse().eval(), data)
    resumed = rounded(cal, data)
    assert [r[0] for r in resumed[2]] == ["c1", "c2", "c3.op", "c4.op", "fc"]
    assert all(r[5] == "gptq" for r in resumed[2])
    assert_same(resumed, rounded(cal, data, hook_model=True))
    monkeypatch.setattr(wr, "_RESUME_BUDGET", 0)
    assert_same(resumed, rounded(cal, data))


def test_inference_mode_data_and_calls_run_from_the_inputs(monkeypatch):
    """Inference tensors have no version counters to check kept values against: batches made under
    torch.inference_mode(), or a call inside it, run every pass from the inputs, with the same result."""
    torch.manual_seed(0)
    data = [smooth(4, 50 + i) for i in range(3)]
    cal = calibrate(PlainNet().eval(), data)
    expected = rounded(cal, data)
    with torch.inference_mode():
        frozen = [d.clone() for d in data]
    assert_same(expected, rounded(cal, frozen))
    with torch.inference_mode():
        assert_same(expected, rounded(cal, data))


class TwiceThenInPlace(nn.Module):
    """fc1 is called twice (its passes run on), then an in-place ReLU changes fc1's first input."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = self.fc0(x)
        y = self.fc1(self.fc1(x))
        x = F.relu(x, inplace=True)
        return self.fc2(x + y)


@pytest.mark.filterwarnings("ignore::UserWarning")  # model check: fc1 shared on purpose
def test_kept_columns_are_copies_even_for_float64_inputs():
    """A layer with fewer than d columns so far keeps them; for a float64 input they must not be a
    view of the activation, which the in-place ReLU later changes."""
    torch.manual_seed(0)
    model = TwiceThenInPlace().double().eval()
    data = [torch.randn(3, 16, dtype=torch.float64) for _ in range(4)]  # 6 columns of fc1 per batch < 16
    cal = calibrate(model, data)
    got = rounded(cal, data)
    original = wr._columns
    try:  # the reference: every column a fresh copy
        wr._columns = lambda layer, x: original(layer, x).clone()
        assert_same(got, rounded(cal, data))
    finally:
        wr._columns = original
    cols = wr._columns(model.fc1, data[0])
    assert cols.untyped_storage().data_ptr() != data[0].untyped_storage().data_ptr()


@pytest.mark.parametrize("k,stride,padding,dilation,groups,mode", [
    (1, 1, 0, 1, 1, "zeros"), (1, 2, 0, 1, 2, "zeros"), (3, 1, 1, 1, 1, "zeros"), (3, 2, 1, 2, 2, "zeros"),
    ((1, 3), 1, "same", 1, 1, "zeros"), (2, 1, "same", 1, 1, "zeros"), (3, 1, (0, 2), 1, 1, "reflect"),
    (3, 2, 1, 1, 1, "replicate"),
])
def test_column_shortcuts_match_pad_and_unfold(k, stride, padding, dilation, groups, mode):
    """_columns skips F.pad (zero padding the same on both sides) and unfold (1x1 convs): the same
    float64 columns, contiguous."""
    conv = nn.Conv2d(4, 6, k, stride=stride, padding=padding, dilation=dilation, groups=groups, padding_mode=mode)
    for x in (torch.randn(3, 4, 9, 8), torch.randn(1, 4, 7, 10).to(memory_format=torch.channels_last)):
        cols = wr._columns(conv, x)
        xp = F.pad(x.double(), conv._reversed_padding_repeated_twice,
                   mode="constant" if mode == "zeros" else mode)
        u = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
        n, d, p = u.shape
        ref = u.reshape(n, groups, d // groups, p).permute(1, 2, 0, 3).reshape(groups, d // groups, n * p)
        assert torch.equal(cols, ref) and cols.is_contiguous()
