"""Tests of qcompiler.zoo: shapes, determinism, fx-traceability, structure, errors."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from qcompiler import zoo
from qcompiler.errors import ConfigError

ALL = ["hybrid", "lstm_seq", "mobilenet_v2", "resnet18", "resnet50", "transformer_block", "unet"]

# Output shapes at the default example inputs (batch 1), written out literally.
EXPECTED_SHAPES = {
    "resnet18": (1, 1000),
    "resnet50": (1, 1000),
    "mobilenet_v2": (1, 1000),
    "unet": (1, 2, 64, 64),
    "transformer_block": (1, 16, 64),
    "hybrid": (1, 3, 224, 224),
}

# Smaller spatial sizes for tests that only need structure (the CNNs pool adaptively).
SMALL_INPUT = {"resnet18": 64, "resnet50": 64, "mobilenet_v2": 64, "hybrid": 32}


def _small_inputs(name: str, batch: int = 1) -> tuple:
    if name in SMALL_INPUT:
        return zoo.example_inputs(name, batch=batch, image_size=SMALL_INPUT[name])
    return zoo.example_inputs(name, batch=batch)


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flatten(o)]


def test_names_sorted_and_complete():
    assert zoo.names() == ALL
    assert set(zoo.MODELS) == set(ALL)


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPES))
def test_forward_default_inputs_shape(name):
    model = zoo.get(name)
    inputs = zoo.example_inputs(name)
    assert tuple(inputs[0].shape) == tuple(zoo.spec(name).input_shape)
    with torch.no_grad():
        out = model(*inputs)
    assert tuple(out.shape) == EXPECTED_SHAPES[name]
    assert torch.isfinite(out).all()


def test_lstm_nested_outputs():
    model = zoo.get("lstm_seq")
    tokens, (h0, c0) = zoo.example_inputs("lstm_seq", batch=2)
    assert tokens.dtype == torch.long and tuple(tokens.shape) == (2, 12)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 100
    assert tuple(h0.shape) == (1, 2, 64) and tuple(c0.shape) == (1, 2, 64)
    assert not h0.any() and not c0.any()
    with torch.no_grad():
        logits, (h_n, c_n) = model(tokens, (h0, c0))
    assert tuple(logits.shape) == (2, 12, 10)
    assert tuple(h_n.shape) == (1, 2, 64)
    assert tuple(c_n.shape) == (1, 2, 64)


def test_batch_argument():
    model = zoo.get("transformer_block")
    (x,) = zoo.example_inputs("transformer_block", batch=3)
    assert tuple(x.shape) == (3, 16, 64)
    assert tuple(model(x).shape) == (3, 16, 64)
    (img,) = zoo.example_inputs("unet", batch=2)
    assert tuple(img.shape) == (2, 3, 64, 64)


@pytest.mark.parametrize("name", ALL)
def test_get_is_deterministic_eval_and_rng_neutral(name):
    rng_before = torch.random.get_rng_state()
    a = zoo.get(name)
    b = zoo.get(name)
    inputs_a = zoo.example_inputs(name)
    inputs_b = zoo.example_inputs(name)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert not any(m.training for m in a.modules())
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for x, y in zip(_flatten(inputs_a), _flatten(inputs_b)):
        assert torch.equal(x, y)
    assert a is not b


@pytest.mark.parametrize("name", ALL)
def test_fx_symbolic_trace_matches_eager(name):
    model = zoo.get(name)
    gm = torch.fx.symbolic_trace(model)
    inputs = _small_inputs(name)
    with torch.no_grad():
        eager = _flatten(model(*inputs))
        traced = _flatten(gm(*inputs))
    assert len(eager) == len(traced)
    for e, t in zip(eager, traced):
        assert torch.equal(e, t)


@pytest.mark.parametrize("name,count", [
    ("resnet18", 11_689_512),
    ("resnet50", 25_557_032),
    ("mobilenet_v2", 3_504_872),
])
def test_torchvision_parameter_counts(name, count):
    assert sum(p.numel() for p in zoo.get(name).parameters()) == count


def test_resnet_module_names():
    mods = dict(zoo.get("resnet18").named_modules())
    for key in ["conv1", "bn1", "relu", "maxpool", "layer1.0.conv1", "layer1.0.bn2",
                "layer2.0.downsample.0", "layer2.0.downsample.1", "layer4.1.conv2", "avgpool", "fc"]:
        assert key in mods, key
    assert "layer1.0.downsample" not in mods or mods["layer1.0.downsample"] is None
    assert isinstance(mods["avgpool"], nn.AdaptiveAvgPool2d)
    assert isinstance(mods["layer2.0.downsample"], nn.Sequential)
    mods50 = dict(zoo.get("resnet50").named_modules())
    for key in ["layer1.0.conv3", "layer1.0.bn3", "layer1.0.downsample.0", "layer3.5.conv2", "fc"]:
        assert key in mods50, key
    assert mods50["fc"].in_features == 2048
    assert mods50["layer2.0.conv2"].stride == (2, 2)  # v1.5: stride on the 3x3


def test_mobilenet_module_names():
    mods = dict(zoo.get("mobilenet_v2").named_modules())
    assert isinstance(mods["features.0.0"], nn.Conv2d)
    assert isinstance(mods["features.0.1"], nn.BatchNorm2d)
    assert isinstance(mods["features.0.2"], nn.ReLU6)
    # Block 1 (t=1): depthwise ConvBNReLU, then linear 1x1 conv + BN.
    assert mods["features.1.conv.0.0"].groups == 32
    assert isinstance(mods["features.1.conv.1"], nn.Conv2d)
    assert isinstance(mods["features.1.conv.2"], nn.BatchNorm2d)
    # Block 2 (t=6): expand 1x1, depthwise, project, BN.
    assert mods["features.2.conv.0.0"].kernel_size == (1, 1)
    assert mods["features.2.conv.1.0"].groups == 96
    assert isinstance(mods["features.2.conv.3"], nn.BatchNorm2d)
    assert mods["features.3"].use_res_connect and not mods["features.2"].use_res_connect
    assert isinstance(mods["features.18.0"], nn.Conv2d) and mods["features.18.0"].out_channels == 1280
    assert "features.19" not in mods
    assert isinstance(mods["classifier.0"], nn.Dropout) and mods["classifier.0"].p == 0.2
    assert isinstance(mods["classifier.1"], nn.Linear)


def test_unet_transformer_lstm_module_names():
    unet = dict(zoo.get("unet").named_modules())
    for key in ["enc1.conv1", "enc1.bn2", "pool1", "enc2", "pool2", "bottleneck", "dec2", "up1", "dec1", "head"]:
        assert key in unet, key
    assert isinstance(unet["up1"], nn.Upsample) and unet["up1"].mode == "nearest"
    assert unet["head"].out_channels == 2
    tb = dict(zoo.get("transformer_block").named_modules())
    for key in ["ln1", "q_proj", "k_proj", "v_proj", "out_proj", "ln2", "fc1", "fc2"]:
        assert key in tb, key
    assert tb["fc1"].out_features == 128
    lstm = dict(zoo.get("lstm_seq").named_modules())
    assert isinstance(lstm["embedding"], nn.Embedding) and lstm["embedding"].num_embeddings == 100
    assert isinstance(lstm["lstm"], nn.LSTM) and lstm["lstm"].batch_first
    assert isinstance(lstm["fc"], nn.Linear)


def test_transformer_graph_uses_explicit_ops():
    gm = torch.fx.symbolic_trace(zoo.get("transformer_block"))
    targets = {n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert torch.matmul in targets
    assert torch.softmax in targets
    assert nn.functional.gelu in targets
    assert "reshape" in targets and "transpose" in targets


def test_unet_graph_uses_both_upsamplings():
    gm = torch.fx.symbolic_trace(zoo.get("unet"))
    fn_targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert nn.functional.interpolate in fn_targets
    assert torch.cat in fn_targets
    assert "up1" in {n.target for n in gm.graph.nodes if n.op == "call_module"}


def test_hybrid_exact_structure():
    model = zoo.get("hybrid")
    assert [n for n, _ in model.named_children()] == [
        "quant", "conv0", "prelu", "conv1", "conv2", "conv3", "conv4", "selu", "dequant", "identity"]
    assert [n for n, _ in model.conv1.named_children()] == ["conv", "prelu"]
    assert type(model.conv1).__name__ == "_ConvBlock"
    assert type(model.selu).__name__ == "_SeluModule"
    assert type(model).__name__ == "HybridModel"
    assert isinstance(model.quant, torch.ao.quantization.QuantStub)
    assert isinstance(model.dequant, torch.ao.quantization.DeQuantStub)
    (x,) = zoo.example_inputs("hybrid")
    assert 0.0 <= float(x.min()) and float(x.max()) < 1.0
    gm = torch.fx.symbolic_trace(model)
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert called.count("identity") == 2
    wide = zoo.get("hybrid", channels=5)
    (xw,) = zoo.example_inputs("hybrid", channels=5, image_size=8)
    assert tuple(wide(xw).shape) == (1, 5, 8, 8)


def test_bn_is_perturbed():
    bn = zoo.get("resnet18").bn1
    assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    assert not torch.equal(bn.running_var, torch.ones_like(bn.running_var))
    assert not torch.equal(bn.weight.detach(), torch.ones_like(bn.weight))
    assert not torch.equal(bn.bias.detach(), torch.zeros_like(bn.bias))
    assert (bn.running_var > 0).all()
    mbn = zoo.get("mobilenet_v2").features[0][1]
    assert not torch.equal(mbn.running_mean, torch.zeros_like(mbn.running_mean))


def test_factory_kwargs():
    assert zoo.get("resnet18", num_classes=10).fc.out_features == 10
    assert zoo.get("mobilenet_v2", num_classes=7).classifier[1].out_features == 7
    assert zoo.get("unet", num_classes=5).head.out_channels == 5
    with pytest.raises(ConfigError, match="num_classes"):
        zoo.get("resnet18", num_clases=10)
    with pytest.raises(ConfigError, match="bogus"):
        zoo.example_inputs("unet", bogus=1)
    with pytest.raises(ConfigError, match="batch"):
        zoo.example_inputs("unet", batch=0)


def test_unknown_name_suggests_close_match():
    with pytest.raises(ConfigError) as exc:
        zoo.get("resnet19")
    msg = str(exc.value)
    assert "resnet18" in msg
    assert "mobilenet_v2" in msg  # full list of known names
    with pytest.raises(ConfigError, match="mobilenet_v2"):
        zoo.example_inputs("mobilenetv2")
    with pytest.raises(ConfigError, match="transformer_block"):
        zoo.describe("transformer")
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("name", ALL)
def test_describe(name):
    text = zoo.describe(name)
    assert text.startswith(name + ":")
    assert str(tuple(zoo.spec(name).input_shape)) in text
