"""convert_fx: fixed-point model vs the fake-quant model it came from, and its errors."""

import warnings

import pytest
import torch

import qcompiler.zoo as zoo
from qcompiler.errors import CalibrationError, ConfigError, QCompilerWarning
from qcompiler.nn.quantized import QuantizedWeightLayer
from qcompiler.quantization import (
    FakeQuantize,
    QTensor,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_calibration_fx,
    prepare_qat_fx,
    set_state,
)
from qcompiler.quantization.convert import convert_fx

SMALL = {"resnet18": dict(image_size=32), "resnet50": dict(image_size=32), "mobilenet_v2": dict(image_size=32)}


def flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in flat(v)]


def calibrated(name, march, qconfig=None, batches=3):
    kw = SMALL.get(name, {})
    cal = prepare_calibration_fx(zoo.get(name), qconfig, example_inputs=zoo.example_inputs(name, **kw),
                                 hybrid=True, march=march)
    cal.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for b in range(batches):
            inputs = zoo.example_inputs(name, batch=2, **kw)
            if name in ("hybrid", "unet") or name in SMALL:
                inputs = (inputs[0] + 0.1 * b,)
            cal(*inputs)
    return cal, zoo.example_inputs(name, **kw)


def fake_quant_and_converted(name, march):
    cal, x = calibrated(name, march)
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return qat, convert_fx(qat), x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "unet", "transformer_block", "lstm_seq", "hybrid"])
def test_converted_matches_fake_quant(name, march):
    qat, q, x = fake_quant_and_converted(name, march)
    with torch.no_grad():
        outs_f, outs_q = flat(qat(*x)), flat(q(*x))
    assert len(outs_f) == len(outs_q)
    for f, o in zip(outs_f, outs_q):
        same = (f == o).float().mean().item()
        assert same >= 0.999, f"{name}/{march}: only {same:.4%} of output elements identical"


def test_converted_model_computes_on_integers():
    qat, q, x = fake_quant_and_converted("resnet18", "bayes")
    conv = q.get_submodule("conv1")
    assert isinstance(conv, QuantizedWeightLayer)
    assert conv.q_weight.dtype == torch.int8 and conv.bias.dtype == torch.int32
    assert conv.q_weight.abs().max() <= 127
    # the prepared model is not modified by convert_fx
    assert isinstance(qat.conv1.op.weight_fake_quant, FakeQuantize)  # conv1 is fused with bn1 + relu


def test_guide_flow_with_high_precision_output(hybrid_model, guide_hybrid_dict):
    x = torch.rand(1, 3, 16, 16)
    cal = prepare_calibration_fx(hybrid_model, {"": get_default_calib_qconfig()}, hybrid=True,
                                 hybrid_dict=guide_hybrid_dict, example_inputs=x, march="bayes")
    cal.eval()
    with torch.no_grad():
        for _ in range(5):
            cal(torch.rand(1, 3, 16, 16))
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig(), "module_name": [("conv4", get_default_qat_out_qconfig())]},
                         hybrid=True, hybrid_dict=guide_hybrid_dict)
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    qat(x).pow(2).mean().backward()
    opt.step()
    set_state(qat, "validation")
    qat.eval()
    q = convert_fx(qat)
    # conv4 emits its int32 accumulator (scale s_in * s_w per channel) to the CPU selu
    captured = {}
    dequant = next(n for n in q.graph.nodes if n.name == "selu_2_input_dequant_0")
    q.get_submodule(dequant.target).register_forward_hook(lambda m, i, o: captured.update(acc=i[0]))
    with torch.no_grad():
        out_q, out_f = q(x), qat(x)
    acc = captured["acc"]
    assert isinstance(acc, QTensor) and acc.dtype == "qint32" and acc.q_per_channel_axis() == 1
    torch.testing.assert_close(out_q, out_f, rtol=0, atol=1e-5)


def test_int16_activations_convert_and_match():
    cal, x = calibrated("hybrid", "bayes", {"": get_default_calib_qconfig(dtype="qint16")})
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig(dtype="qint16")}, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    q = convert_fx(qat)
    assert q.get_submodule("conv0").out_dtype == "qint16"
    with torch.no_grad():
        assert (q(*x) == qat(*x)).float().mean() >= 0.999


def test_ptq_straight_from_calibration_is_close_to_float():
    cal, x = calibrated("resnet18", "bayes", batches=4)
    q = convert_fx(cal)
    with torch.no_grad():
        f, o = zoo.get("resnet18")(*x), q(*x)
    sqnr = 20 * torch.log10(f.norm() / (f - o).norm())
    assert sqnr > 15, f"output SQNR {sqnr:.1f} dB"


def test_observers_that_never_ran_are_named():
    cal = prepare_calibration_fx(zoo.get("hybrid"), example_inputs=zoo.example_inputs("hybrid"), hybrid=True)
    with pytest.raises(CalibrationError, match=r"never saw data: quant.activation_post_process, conv0"):
        convert_fx(cal)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="takes the model returned by prepare_calibration_fx"):
        convert_fx(zoo.get("hybrid"))
    cal, _ = calibrated("hybrid", "bayes", batches=1)
    with pytest.raises(ConfigError, match="unknown key 'remove_qconfig'"):
        convert_fx(cal, {"remove_qconfig": True})


class _Edges(torch.nn.Module):
    """Grouped transposed conv, unfused ReLU6, mean without keepdim and view(size(0), -1) on the BPU."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(4, 4, 1)
        self.t = torch.nn.ConvTranspose2d(4, 4, 2, stride=2, groups=2)
        self.r6 = torch.nn.ReLU6()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.r6(self.t(self.a(x)) * 3)
        return self.fc(torch.mean(y, (2, 3))), y.view(y.size(0), -1)


def test_edge_ops_convert_and_match():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    cal = prepare_calibration_fx(_Edges(), example_inputs=x)
    cal.eval()
    with torch.no_grad():
        for _ in range(3):
            cal(torch.randn(2, 4, 8, 8))
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    qat.eval()
    q = convert_fx(qat)
    with torch.no_grad():
        for f, o in zip(qat(x), q(x)):
            assert torch.equal(f, o)



class _AddAlpha(torch.nn.Module):
    """Two convs combined by torch.add / torch.sub with an ``alpha`` keyword (not fusable)."""

    def __init__(self, op, alpha):
        super().__init__()
        self.op, self.alpha = op, alpha
        self.a = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.b = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.op(self.a(x), self.b(x), alpha=self.alpha)


def _alpha_models(op, alpha):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = _AddAlpha(op, alpha).eval()
    with warnings.catch_warnings():  # model check: an add with alpha leaves its convs unfused
        warnings.simplefilter("ignore", QCompilerWarning)
        cal = prepare_calibration_fx(model, example_inputs=x)
    cal.eval()
    with torch.no_grad():
        for batch in (x, torch.randn(2, 3, 8, 8)):  # x too: no clipping on the checked input
            cal(batch)
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    qat.eval()
    return model, qat, x


@pytest.mark.parametrize("op", [torch.add, torch.sub])
@pytest.mark.parametrize("alpha", [1.0, 2.0, -0.5])
def test_add_and_sub_with_alpha_match_fake_quant_simulator_and_onnx(op, alpha, tmp_path):
    from qcompiler.compiled import lower
    from qcompiler.onnx import export_to_onnx, inference_session

    model, qat, x = _alpha_models(op, alpha)
    q = convert_fx(qat)
    with torch.no_grad():
        f, ref, out = model(x), qat(x), q(x)
    assert torch.equal(ref, out)  # alpha folded into b's multiplier, bit for bit
    # and it is the float op's value up to quantization (a dropped alpha would be off by |b|)
    err = float((ref.float() - f).abs().max())
    assert err < 0.03 * float(f.abs().max()), err
    assert torch.equal(lower(q)(x), out)  # the BPU simulator computes the same integers
    path = tmp_path / "m.onnx"
    export_to_onnx(q, (x,), path)
    onnx_out = torch.from_numpy(inference_session(str(path)).run(None, {"x": x.numpy()})[0])
    # ONNX: the float op on dequantized operands, quantized at the output scale: within 1 LSB
    lsb = float(q.get_submodule(next(n.target for n in q.graph.nodes if n.op == "call_module"
                                     and type(q.get_submodule(n.target)).__name__ == "QuantizedAdd")).out_scale)
    torch.testing.assert_close(onnx_out, out, rtol=0, atol=1.01 * lsb)


def test_add_with_alpha_zero_is_refused_naming_the_node():
    from qcompiler.errors import UnsupportedOpError

    _, qat, _ = _alpha_models(torch.add, 0.0)
    with pytest.raises(UnsupportedOpError, match=r"add with alpha=0\.0"):
        convert_fx(qat)


class _Pools(torch.nn.Module):
    """conv -> the max pool under test -> conv -> a functional max pool with ceil_mode and dilation
    (which keeps the size)."""

    def __init__(self, pool):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.p1 = pool
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.c2(self.p1(self.c1(x)))
        return torch.nn.functional.max_pool2d(y, 2, 1, 1, dilation=2, ceil_mode=True)


@pytest.mark.parametrize("pool, size, out", [
    (torch.nn.MaxPool2d(3, 2, ceil_mode=True), 10, 5),  # 10 -> 5 (4 without ceil_mode)
    (torch.nn.MaxPool2d(3, 2, padding=1, dilation=2, ceil_mode=True), 12, 6),  # 12 -> 6 (5 without)
    # torch drops the last ceil-mode window (it would start in the right padding): 9 -> 5, not 6
    (torch.nn.MaxPool2d(2, 2, padding=1, ceil_mode=True), 9, 5),
], ids=["ceil", "ceil_dilation", "ceil_last_window_dropped"])
def test_max_pool_with_ceil_mode_and_dilation_matches_fake_quant_simulator_and_onnx(pool, size, out, tmp_path):
    from qcompiler.compiled import lower
    from qcompiler.onnx import export_to_onnx, inference_session

    torch.manual_seed(0)
    x = torch.randn(2, 3, size, size)
    cal = prepare_calibration_fx(_Pools(pool).eval(), example_inputs=x)
    cal.eval()
    with torch.no_grad():
        for batch in (x, torch.randn(2, 3, size, size)):
            cal(batch)
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    qat.eval()
    q = convert_fx(qat)
    with torch.no_grad():
        ref, y = qat(x), q(x)
    assert tuple(y.shape) == (2, 4, out, out)
    assert torch.equal(ref, y)  # max pool is exact on the integer grid
    assert torch.equal(lower(q)(x), y)
    path = tmp_path / "m.onnx"
    export_to_onnx(q, (x,), path)
    onnx_out = torch.from_numpy(inference_session(str(path)).run(None, {"x": x.numpy()})[0])
    torch.testing.assert_close(onnx_out, y, rtol=0, atol=0)


def test_max_pool_with_return_indices_runs_on_cpu():
    """The indices are not a quantized value: the pool is placed on CPU and both outputs come back."""
    from qcompiler.ir.meta import META_PLACEMENT

    class _Indices(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.p = torch.nn.MaxPool2d(2, return_indices=True)

        def forward(self, x):
            y, idx = self.p(self.c(x))
            return y, idx

    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cal = prepare_calibration_fx(_Indices().eval(), example_inputs=x)
    assert {n.name: n.meta.get(META_PLACEMENT) for n in cal.graph.nodes}["p"] == "cpu"
    with torch.no_grad():
        cal(x)
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    qat.eval()
    with torch.no_grad():
        (ref_y, ref_i), (y, i) = qat(x), convert_fx(qat)(x)
    assert torch.equal(ref_y, y) and torch.equal(ref_i, i) and i.dtype == torch.int64


@pytest.mark.parametrize("pool", [
    torch.nn.AvgPool2d(3, 2, 1, count_include_pad=False),
    torch.nn.AvgPool2d(3, 2, ceil_mode=True),  # 10x10: the last window is partial
    torch.nn.AvgPool2d(3, 2, 1, divisor_override=4),
], ids=["count_include_pad_false", "ceil_partial_window", "divisor_override"])
def test_avg_pool_options_the_bpu_cannot_compute_run_on_cpu_and_match(pool):
    """These change a window's divisor; the BPU divides by kh*kw, so they are placed on CPU (once
    they ran on the BPU and convert silently ignored the option)."""
    from qcompiler.ir.meta import META_PLACEMENT

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), pool, torch.nn.Conv2d(4, 4, 1)).eval()
    x = torch.randn(1, 3, 10, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cal = prepare_calibration_fx(model, example_inputs=x)
    assert {n.name: n.meta.get(META_PLACEMENT) for n in cal.graph.nodes}["_1"] == "cpu"
    cal.eval()
    with torch.no_grad():
        cal(x)
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    qat.eval()
    with torch.no_grad():
        ref, out = qat(x), convert_fx(qat)(x)
    assert torch.equal(ref, out)


def test_convert_refuses_a_non_zero_padding_mode_it_would_zero_pad():
    """Placement keeps such convs on CPU; convert must still not lower one with zero padding."""
    import torch.fx as fx

    from qcompiler.errors import UnsupportedOpError
    from qcompiler.passes.convert_rules.weight_layers import _geometry

    node = fx.Graph().placeholder("conv")
    with pytest.raises(UnsupportedOpError, match=r"node 'conv': padding_mode='reflect' has no fixed-point lowering"):
        _geometry(torch.nn.Conv2d(3, 3, 3, padding="same", padding_mode="reflect"), node)
    assert _geometry(torch.nn.Conv2d(3, 3, 3, padding_mode="reflect"), node)["padding"] == (0, 0)  # no padding
