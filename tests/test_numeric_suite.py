"""Numeric suite: weights, per-layer outputs, float shadows, loggers and errors on zoo models."""

import math

import pytest
import torch
import train_mode_models as tm
from conftest import assert_untouched, snapshot
from torch import nn

from qcompiler import zoo
from qcompiler.errors import ConfigError
from qcompiler.quantization import (
    QTensor,
    convert_fx,
    prepare_calibration_fx,
    prepare_qat_fx,
    set_state,
)
from qcompiler.tools import numeric_suite as ns

KW = {"resnet18": dict(image_size=32)}


def _inputs(name, shift=0.0):
    x = zoo.example_inputs(name, **KW.get(name, {}))
    if name != "lstm_seq":
        x = (x[0] + shift,)
    return x


def _build(name, qat=False):
    torch.manual_seed(0)
    fm = zoo.get(name).eval()
    cal = prepare_calibration_fx(fm, example_inputs=_inputs(name), hybrid=True, march="bayes")
    cal.eval()
    with torch.no_grad():
        for b in range(2):
            cal(*_inputs(name, 0.1 * b))
    prepared = cal
    if qat:
        prepared = prepare_qat_fx(cal, hybrid=True)
        set_state(prepared, "validation")
        prepared.eval()
    return fm, prepared, convert_fx(prepared)


@pytest.fixture(scope="module")
def models():
    return {name: _build(name) for name in ("resnet18", "hybrid", "lstm_seq")}


def _assert_within_half_step(entry, grid=None):
    """Dequantized weight within half a step of the (folded) float weight, per channel.

    ``grid``: the converted model's QTensor for the same weight (gives the step of a
    prepared model's fake-quantized float weight); weights with no grid are float on both sides.
    """
    q, f = entry["quantized"], entry["float"]
    grid = q if isinstance(q, QTensor) else grid
    if grid is None:
        assert torch.equal(q, f)
        return
    shape = [1] * f.dim()
    shape[grid.q_per_channel_axis()] = -1
    step = grid.q_per_channel_scales().reshape(shape)
    deq = q.dequantize() if isinstance(q, QTensor) else q
    err = (deq - f).abs()
    assert (err <= step / 2 * (1 + 1e-5)).all(), (err / step).max()
    torch.testing.assert_close(deq, grid.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "hybrid", "lstm_seq"])
def test_compare_weights_converted_and_prepared(models, name):
    fm, cal, q = models[name]
    ref = ns.compare_weights(fm, q)
    grids = {k: v["quantized"] for k, v in ref.items() if isinstance(v["quantized"], QTensor)}
    assert grids
    for qm in (q, cal):
        for args in ((fm.state_dict(), qm.state_dict()), (fm, qm)):
            w = ns.compare_weights(*args)
            assert set(w) == set(ref), name
            for key, entry in w.items():
                assert set(entry) == {"float", "quantized"}
                assert entry["float"].shape == entry["quantized"].shape, key
                _assert_within_half_step(entry, grids.get(key))
            if qm is q:
                conv = {"resnet18": "conv1.weight", "hybrid": "conv0.weight", "lstm_seq": "fc.weight"}[name]
                assert isinstance(w[conv]["quantized"], QTensor)
                assert w[conv]["quantized"].q_per_channel_axis() == 0
    if name == "resnet18":
        w = ns.compare_weights(fm.state_dict(), q.state_dict())
        assert "layer2.0.downsample.0.weight" in w and "fc.weight" in w
        # conv1 is fused with bn1: the float side is the folded weight, not the raw one
        assert not torch.allclose(w["conv1.weight"]["float"], fm.conv1.weight)
        assert not any("bn" in k for k in w)
        # prepared model: the float weight through its weight fake quant -> on the quantized grid
        wp = ns.compare_weights(fm, cal)
        step = q.conv1.w_scale.reshape(-1, 1, 1, 1)
        torch.testing.assert_close(wp["conv1.weight"]["quantized"],
                                   w["conv1.weight"]["quantized"].dequantize(), rtol=0, atol=1e-6)
        assert torch.allclose(wp["conv1.weight"]["quantized"] / step, (wp["conv1.weight"]["quantized"] / step).round(),
                              atol=1e-3)
    if name == "lstm_seq":
        w = ns.compare_weights(fm, q)
        assert {"embedding.weight", "lstm.weight_ih_l0", "lstm.weight_hh_l0", "fc.weight"} <= set(w)
        assert torch.equal(w["lstm.weight_ih_l0"]["quantized"], fm.lstm.weight_ih_l0)  # CPU island: float


@pytest.mark.parametrize("name,layers", [("resnet18", ["conv1", "layer1.0.conv1", "layer1.0.conv2", "fc"]),
                                         ("hybrid", ["conv0", "conv1.conv", "conv4", "identity", "identity_1"]),
                                         ("lstm_seq", ["embedding", "lstm", "fc"])])
def test_compare_model_outputs_sqnr(models, name, layers):
    fm, cal, q = models[name]
    x = _inputs(name)
    with torch.no_grad():
        ref_f, ref_q = fm(*x), q(*x)
    act = ns.compare_model_outputs(fm, q, *x)
    assert set(layers) <= set(act), sorted(act)
    for key, entry in act.items():
        assert len(entry["float"]) == len(entry["quantized"]) == 1, key
        sqnr = float(ns.compute_error(entry["float"][0], entry["quantized"][0]))
        assert not math.isnan(sqnr) and sqnr > 10, (key, sqnr)
    for key in layers:
        sqnr = ns.compute_error(act[key]["float"][0], act[key]["quantized"][0])
        if key not in ("embedding", "lstm"):  # float on both sides (CPU island): SQNR inf
            assert torch.isfinite(sqnr), key
    if name == "lstm_seq":
        out, (h, c) = act["lstm"]["float"][0]  # tuple output kept as a tuple
        assert out.shape[-1] == h.shape[-1]
    # loggers removed, outputs unchanged
    with torch.no_grad():
        assert torch.equal(fm(*x)[0] if name == "lstm_seq" else fm(*x), ref_f[0] if name == "lstm_seq" else ref_f)
        assert torch.equal(q(*x)[0] if name == "lstm_seq" else q(*x), ref_q[0] if name == "lstm_seq" else ref_q)
    assert not any(m._forward_hooks for m in q.modules()) and not any(m._forward_hooks for m in fm.modules())


def test_prepare_model_outputs_three_runs_and_outputs_unchanged(models):
    fm, cal, q = models["resnet18"]
    xs = [_inputs("resnet18", 0.05 * i) for i in range(3)]
    with torch.no_grad():
        before = [(fm(*x), q(*x)) for x in xs]
    ns.prepare_model_outputs(fm, q)
    try:
        with torch.no_grad():
            after = [(fm(*x), q(*x)) for x in xs]
        act = ns.get_matching_activations(fm, q)
    finally:
        ns.remove_loggers(fm)
        ns.remove_loggers(q)
    for (bf, bq), (af, aq) in zip(before, after):
        assert torch.equal(bf, af) and torch.equal(bq, aq)
    assert {"conv1", "layer1.0.conv1", "fc"} <= set(act)
    for key, entry in act.items():
        assert len(entry["float"]) == len(entry["quantized"]) == 3, key
    # each run was recorded, in order
    assert not torch.equal(act["fc"]["float"][0], act["fc"]["float"][2])
    with pytest.raises(ConfigError, match="no output loggers"):
        ns.get_matching_activations(fm, q)


def test_qat_prepared_model_and_multi_input_lstm():
    fm, qat, q = _build("lstm_seq", qat=True)
    x = _inputs("lstm_seq")
    for model in (qat, q):
        act = ns.compare_model_outputs(fm, model, *x)
        assert {"embedding", "lstm", "fc"} <= set(act)
        assert float(ns.compute_error(act["fc"]["float"][0], act["fc"]["quantized"][0])) > 10
        stub = ns.compare_model_stub(fm, model, [nn.Linear, nn.LSTM], *x)
        assert set(stub) == {"lstm", "fc"}
        for entry in stub.values():
            assert len(entry["float"]) == len(entry["quantized"]) == 1
        # the LSTM runs in float on both sides with the same input: identical
        assert torch.equal(stub["lstm"]["float"][0][0], stub["lstm"]["quantized"][0][0])
        assert float(ns.compute_error(stub["fc"]["float"][0], stub["fc"]["quantized"][0])) > 20


def test_shadow_stubs_on_hybrid_use_the_same_input(models):
    fm, cal, q = models["hybrid"]
    x = _inputs("hybrid")
    seen = {}
    q.conv2.register_forward_hook(lambda m, i, o: seen.update(inp=i[0].dequantize(), out=o.dequantize()))
    try:
        with torch.no_grad():
            ref = q(*x)
        ns.prepare_model_with_stubs(fm, q, [nn.Conv2d], ns.ShadowLogger)
        with torch.no_grad():
            assert torch.equal(q(*x), ref)
            q(*x)
        ob = ns.get_logger_dict(q)
    finally:
        ns.remove_loggers(q)
        q.conv2._forward_hooks.clear()
    assert set(ob) == {"conv0", "conv1.conv", "conv2", "conv3", "conv4"}
    for entry in ob.values():
        assert len(entry["float"]) == len(entry["quantized"]) == 2
    # float shadow computed on the quantized layer's own (dequantized) input
    with torch.no_grad():
        expected = fm.conv2(seen["inp"])
    torch.testing.assert_close(ob["conv2"]["float"][0], expected)
    torch.testing.assert_close(ob["conv2"]["quantized"][0], seen["out"])
    assert float(ns.compute_error(ob["conv2"]["float"][0], ob["conv2"]["quantized"][0])) > 20
    assert ns.get_logger_dict(q) == {}


def test_shadow_stubs_fold_fused_layers(models):
    fm, cal, q = models["resnet18"]
    ob = ns.compare_model_stub(fm, q, [nn.Conv2d, nn.Linear], *_inputs("resnet18"))
    assert {"conv1", "layer1.0.conv1", "layer1.0.conv2", "fc"} <= set(ob)
    for key, entry in ob.items():
        assert float(ns.compute_error(entry["float"][0], entry["quantized"][0])) > 20, key


def test_custom_logger_subclass(models):
    fm, cal, q = models["hybrid"]

    class MaxLogger(ns.Logger):
        def __init__(self):
            super().__init__()
            self.stats["max"] = []

        def forward(self, x):
            self.stats["max"].append(float(x.dequantize().max() if isinstance(x, QTensor) else x.max()))
            # ignored: loggers cannot change outputs

    class MyShadow(ns.Logger):
        def forward(self, x, y):
            self.stats.setdefault("n", 0)
            self.stats["n"] += 1

    x = _inputs("hybrid")
    with torch.no_grad():
        ref = q(*x)
    act = ns.compare_model_outputs(fm, q, *x, logger_cls=MaxLogger)
    assert len(act["conv0"]["float"]["max"]) == 1 and len(act["conv0"]["quantized"]["max"]) == 1
    assert abs(act["conv0"]["float"]["max"][0] - act["conv0"]["quantized"]["max"][0]) < 0.1
    ob = ns.compare_model_stub(fm, q, [nn.Conv2d], *x, logger_cls=MyShadow)
    assert ob["conv0"] == {"n": 1}
    with torch.no_grad():
        assert torch.equal(q(*x), ref)


def test_compiled_model():
    import qcompiler

    torch.manual_seed(0)
    fm = zoo.get("hybrid").eval()
    cm = qcompiler.compile(fm, _inputs("hybrid"), march="bayes", progress=False)
    act = ns.compare_model_outputs(fm, cm, *_inputs("hybrid"))
    assert "conv0" in act and float(ns.compute_error(act["conv0"]["float"][0], act["conv0"]["quantized"][0])) > 10
    w = ns.compare_weights(fm, cm)
    _assert_within_half_step(w["conv0.weight"])
    assert "conv2" in ns.compare_model_stub(fm, cm, [nn.Conv2d], *_inputs("hybrid"))


def test_compute_error():
    x = torch.randn(100)
    assert math.isinf(float(ns.compute_error(x, x)))
    assert float(ns.compute_error(x, x + 0.1 * x)) == pytest.approx(20.0, abs=1e-4)
    from qcompiler.quantization import quantize_per_tensor

    qx = quantize_per_tensor(x, 0.05, 0, "qint8")
    assert torch.isfinite(ns.compute_error(x, qx)) and ns.compute_error(x, qx) > 20
    assert ns.compute_error((x, x), (x, x + 0.1 * x)) > 20


def test_errors(models):
    fm, cal, q = models["resnet18"]
    other = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(ConfigError, match=r"ResNet.*Sequential|Sequential.*ResNet"):
        ns.compare_model_outputs(other, q, torch.randn(1, 3))
    with pytest.raises(ConfigError, match=r"float model \(ResNet\) failed on the given inputs.*RuntimeError"):
        ns.compare_model_outputs(fm, q, torch.randn(1, 5, 32, 32))
    hf, _, hq = models["hybrid"]
    with pytest.raises(ConfigError, match=r"float model \(HybridModel\) failed"):
        ns.compare_model_outputs(hf, hq, *_inputs("lstm_seq"))
    with pytest.raises(ConfigError, match="module_swap_list entries must be nn.Module types"):
        ns.compare_model_stub(fm, q, ["Conv2d"], *_inputs("resnet18"))
    with pytest.raises(ConfigError, match="module_swap_list"):
        ns.prepare_model_with_stubs(fm, q, [nn.Conv2d, 3])
    # failures leave no hooks behind
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in q.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in fm.modules())



# ---------------------------------------------------------------------------- models in train mode


@pytest.fixture(scope="module")
def bn_models():
    return tm.build()


def _values(result):
    return {k: (v["float"][0], v["quantized"][0]) for k, v in result.items()}


def test_models_in_train_mode_are_evaluated_and_left_untouched(bn_models):
    """A float model in train mode and a QAT model training (observers on) run in eval mode without
    observing: the same values as in eval mode, and neither model changes (BN statistics, scales, flags)."""
    fm, qat, q = bn_models
    x = (torch.rand(2, 3, 8, 8) * 3,)  # outside the calibrated range: observers would move
    runs = ((ns.compare_model_outputs, x), (ns.compare_model_stub, ([nn.Conv2d, nn.Linear], *x)))
    ref = {(name, fn): _values(fn(fm, model, *args)) for name, model in (("qat", qat), ("q", q)) for fn, args in runs}
    f_train, qat_train = tm.training(fm, qat)
    snaps = [snapshot(f_train), snapshot(qat_train)]
    for name, model in (("qat", qat_train), ("q", q)):
        for fn, args in runs:
            got = _values(fn(f_train, model, *args))
            assert got.keys() == ref[name, fn].keys() and {"conv", "fc"} <= got.keys()
            for k, (f, qv) in got.items():
                assert torch.equal(f, ref[name, fn][k][0]), (name, fn.__name__, k)
                assert torch.equal(qv, ref[name, fn][k][1]), (name, fn.__name__, k)
            assert_untouched(f_train, snaps[0])
            assert_untouched(qat_train, snaps[1])
    assert f_train.bn.training and qat_train.conv.training
    assert int(qat_train.conv.activation_post_process.observer_enabled[0]) == 1  # switches restored


def test_train_mode_restored_when_the_run_fails(bn_models):
    fm, qat, q = bn_models
    f_train, qat_train = tm.training(fm, qat)
    snaps = [snapshot(f_train), snapshot(qat_train)]
    with pytest.raises(ConfigError, match=r"float model \(BNNet\) failed on the given inputs"):
        ns.compare_model_outputs(f_train, qat_train, torch.rand(2, 5, 8, 8))
    with pytest.raises(ConfigError, match="quantized model .* failed on the given inputs"):
        ns.compare_model_stub(f_train, qat_train, [nn.Conv2d], torch.rand(2, 5, 8, 8))
    assert_untouched(f_train, snaps[0])
    assert_untouched(qat_train, snaps[1])
