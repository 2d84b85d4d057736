"""The ONNX export of a converted model computes its weight layers on integers: bit for bit the compiled model.

Conv2d / linear layers (grouped, depthwise, fused add, relu / relu6, with and without bias) are
``ConvInteger`` / ``MatMulInteger`` on the int8 codes + an int32 bias + the BPU's requantization
(``backends/onnx/rules/integer_layer.py``). Checked here:

* whole models (torch's ``Conv2dActivation``, which a float32 export got wrong by one LSB on 256
  outputs; zoo resnet18, mobilenet_v2; a linear model): every int8 tensor of the export (each
  DequantizeLinear's input) and every output equal the compiled model's (``np.array_equal``);
* one layer at a time over random shapes, groups, strides, paddings, dilations, biases and scales
  (hypothesis), including scales that need the int64 requantization and power-of-two factors that
  land on rounding ties, against the layer module (the simulator's fixed-point kernel);
* both requantization forms on every layer (the int64 one forced), onnxruntime with every graph
  optimization on and with none, and a conv-transpose that keeps the float form and is listed.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import qcompiler.zoo as zoo
from qcompiler.backends.onnx import emit_graph
from qcompiler.backends.onnx.rules import integer_layer
from qcompiler.compiled import compile as qc_compile
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import export_to_onnx, inference_session
from qcompiler.quantization.qtensor import QTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.model_coverage import all_cases, calibration_batches  # noqa: E402

# ---------------------------------------------------------------------------------------------- helpers


def _int8_tensors(model: onnx.ModelProto, sidecar: dict) -> dict[str, str]:
    """Quantization point (FX node name) -> the int8 tensor its DequantizeLinear reads."""
    producer = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for name, entry in sidecar["activations"].items():
        node = producer.get(name)
        if entry["dtype"] == "qint8" and node is not None and node.op_type == "DequantizeLinear":
            out[name] = node.input[0]
    return out


def _run_with(model: onnx.ModelProto, extra: dict[str, str], feeds: list[np.ndarray], session=inference_session):
    """Run ``model`` with the int8 tensors ``extra`` (label -> tensor) as additional outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    outs = [o.name for o in m.graph.output]
    for t in sorted(set(extra.values())):
        if t not in outs:
            m.graph.output.append(helper.make_tensor_value_info(t, TensorProto.INT8, None))
    s = session(m)
    got = dict(zip([o.name for o in s.get_outputs()], s.run(None, dict(zip([i.name for i in s.get_inputs()], feeds)))))
    return [got[o] for o in outs], {k: got[t] for k, t in extra.items()}


def _compiled_int8(gm: fx.GraphModule, inputs: tuple) -> dict[str, np.ndarray]:
    """The integers of every int8 QTensor value of the converted graph, by node name."""
    vals = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if isinstance(r, QTensor) and r.int_repr().dtype == torch.int8:
                vals[n.name] = r.int_repr().numpy()
            return r

    with torch.no_grad():
        Record(gm).run(*inputs)
    return vals


def _flat(x):
    if isinstance(x, QTensor):
        return [x.dequantize()]
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in _flat(v)]


def assert_export_is_compiled(cm, inputs: tuple, tmp_path, *, min_points: int = 1) -> dict:
    """Every int8 tensor and output of ``cm.export_onnx`` equals the compiled model's, bit for bit."""
    path = tmp_path / "model.onnx"
    sidecar = cm.export_onnx(path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    points = _int8_tensors(model, sidecar)
    feeds = [t.numpy() for t in _flat(inputs)]
    outs, codes = _run_with(model, points, feeds)
    with torch.no_grad():
        ref_outs = [t.numpy() for t in _flat(cm(*inputs))]
    ref_codes = _compiled_int8(cm.converted, inputs)
    assert len(outs) == len(ref_outs)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.shape == r.shape and np.array_equal(o, r), \
            f"output {i}: {int(np.sum(o != r))}/{o.size} differ (max {np.abs(o - r).max()})"
    compared = 0
    for name, got in codes.items():
        if name in ref_codes:
            ref = ref_codes[name]
            assert got.shape == ref.shape and np.array_equal(got, ref), \
                f"int8 tensor '{name}': {int(np.sum(got != ref))}/{got.size} differ"
            compared += 1
    assert compared >= min_points, f"only {compared} int8 tensors compared"
    return sidecar


def _compile(model, inputs, march="bayes", calib=None):
    torch.manual_seed(0)
    return qc_compile(model.eval(), inputs, march=march, calib_data=calib or [inputs], progress=False)


# ---------------------------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_conv2d_activation_export_equals_compiled_bit_for_bit(march, tmp_path):
    """torch's common_pruning Conv2dActivation: a float32 conv export flipped a near-tie of conv 32->64
    (exact -6.5000042 codes: the BPU gives -7, a float32 accumulation -6) and spread it to 256 outputs."""
    (case,) = [c for c in all_cases() if c.name == "Conv2dActivation"]
    model, inputs = case.build()
    cm = _compile(model, inputs, march, calibration_batches(inputs))  # as the coverage benchmark
    sidecar = assert_export_is_compiled(cm, inputs, tmp_path, min_points=6)
    assert sidecar["float_layers"] == {}
    assert sorted(sidecar["integer_layers"]) == ["conv2d1", "conv2d2", "seq_0", "seq_2", "seq_4"]
    layer = sidecar["integer_layers"]["seq_2"]
    q = cm.converted.get_submodule("seq.2")
    assert layer["multiplier"] == q.M.tolist() and layer["shift"] == q.n.tolist()
    assert layer["evaluated_in"] == "float64" and layer["clamp"] == [-128, 127] and layer["add"] is None
    model_proto = onnx.load(str(tmp_path / "model.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model_proto.graph.initializer}
    assert inits[layer["weight"]].dtype == np.int8 and np.array_equal(inits[layer["weight"]], q.q_weight.numpy())
    assert sidecar["weights"][layer["weight"]]["dtype"] == "qint8"
    ops = [n.op_type for n in model_proto.graph.node]
    assert ops.count("ConvInteger") == 5 and "Conv" not in ops


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_zoo_cnn_export_equals_compiled_bit_for_bit(name, tmp_path):
    """resnet18 (fused residual adds + relu) and mobilenet_v2 (depthwise convs, relu6) at 32x32."""
    x = zoo.example_inputs(name, image_size=32)
    calib = [zoo.example_inputs(name, batch=2, image_size=32)[0] + 0.1 * b for b in range(2)]
    cm = _compile(zoo.get(name), x, calib=calib)
    sidecar = assert_export_is_compiled(cm, x, tmp_path, min_points=20)
    layers = sidecar["integer_layers"].values()
    assert sidecar["float_layers"] == {} and len(layers) >= 20
    if name == "resnet18":
        assert sum(entry["add"] is not None for entry in layers) == 8  # the fused residual adds
    else:
        depthwise = [n for n in cm.converted.graph.nodes if n.op == "call_module"
                     and isinstance(cm.converted.get_submodule(n.target), qnn.QuantizedWeightLayer)
                     and cm.converted.get_submodule(n.target).geometry.get("groups", 1) > 1]
        assert len(depthwise) >= 10 and all(n.name in sidecar["integer_layers"] for n in depthwise)
        assert sum(entry["clamp"] == [0, 127] for entry in layers) >= 30  # relu6 (its top at qmax here)


@pytest.mark.slow
def test_resnet18_at_224_export_equals_compiled_bit_for_bit(tmp_path):
    """At full size a float32 conv export flipped enough near-ties to change 349 of the 1000 logits
    (by up to 0.086) on the reference machine; the integer export changes none."""
    x = zoo.example_inputs("resnet18")
    cm = _compile(zoo.get("resnet18"), x)
    assert assert_export_is_compiled(cm, x, tmp_path, min_points=20)["float_layers"] == {}


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(20, 64), nn.Linear(64, 32, bias=False), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_linear_model_export_equals_compiled_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    x = (torch.randn(8, 20),)
    cm = _compile(_Mlp(), x, calib=[torch.randn(8, 20) for _ in range(3)])
    sidecar = assert_export_is_compiled(cm, x, tmp_path, min_points=3)
    assert sorted(sidecar["integer_layers"]) == ["fc1", "fc2", "fc3"]
    assert sidecar["integer_layers"]["fc2"]["bias"] is None
    ops = [n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node]
    assert ops.count("MatMulInteger") == 3 and "Gemm" not in ops and "MatMul" not in ops


def test_every_onnxruntime_optimization_level_gives_the_same_integers(tmp_path):
    """The integer pattern survives every onnxruntime rewrite: all optimizations on (none disabled),
    and none at all, give the compiled model's outputs."""
    (case,) = [c for c in all_cases() if c.name == "Conv2dActivation"]
    model, inputs = case.build()
    cm = _compile(model, inputs, calib=calibration_batches(inputs))
    path = tmp_path / "m.onnx"
    cm.export_onnx(path)
    with torch.no_grad():
        ref = cm(*inputs).numpy()
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        assert np.array_equal(s.run(None, {s.get_inputs()[0].name: inputs[0].numpy()})[0], ref), level
    # MatMulInteger -> Add -> Cast: not onnxruntime's MatMulIntegerToFloat pattern, left alone
    x = (torch.randn(8, 20),)
    cm = _compile(_Mlp(), x, calib=[torch.randn(8, 20) for _ in range(3)])
    cm.export_onnx(path)
    s = _plain_session(onnx.load(str(path)))
    with torch.no_grad():
        assert np.array_equal(s.run(None, {s.get_inputs()[0].name: x[0].numpy()})[0], cm(*x).numpy())


# ---------------------------------------------------------------------------------------------- one layer


class _Leaves(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, qnn.QuantizedModule) or super().is_leaf_module(m, qualname)


class _OneLayer(nn.Module):
    def __init__(self, layer: qnn.QuantizedWeightLayer, in_scale: float, other_scale=None):
        super().__init__()
        self.q, self.layer, self.dq = qnn.Quantize(in_scale), layer, qnn.DeQuantize()
        self.qo = None if other_scale is None else qnn.Quantize(other_scale)

    def forward(self, x, other):
        if self.qo is None:
            return self.dq(self.layer(self.q(x)))
        return self.dq(self.layer(self.q(x), self.qo(other)))


def _export_layer(layer, in_scale, other_scale, x: torch.Tensor, other: torch.Tensor):
    root = _OneLayer(layer, in_scale, other_scale)
    gm = fx.GraphModule(root, _Leaves().trace(root))
    propagate_shapes(gm, (x, other))  # typed, shaped graph inputs (onnx.checker's full check)
    return emit_graph(gm, quantize=True)


def _layer_codes(model: onnx.ModelProto, x: np.ndarray, other: np.ndarray, session=inference_session):
    """(input codes, output) of a one-layer export: the output's int8 codes, or its float for a
    high-precision layer."""
    names = [i.name for i in model.graph.input]
    feeds = {names[0]: x, **({names[1]: other} if len(names) > 1 else {})}
    producer = {o: n for n in model.graph.node for o in n.output}
    out = model.graph.output[0].name
    node = producer[out]
    while node.op_type == "Identity":
        node = producer[node.input[0]]
    q_in = next(n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear")
    extra = {"in": q_in}
    if node.op_type == "DequantizeLinear":
        extra["out"] = node.input[0]
    outs, codes = _run_with(model, extra, [feeds[k] for k in names], session)
    return codes["in"], codes.get("out", outs[0])


def _pow2_or_not(draw, lo, hi):
    e = draw(st.integers(lo, hi))
    return 2.0 ** e if draw(st.booleans()) else 2.0 ** e * draw(st.floats(1.0, 1.999))


@st.composite
def layer_cases(draw):
    kind = draw(st.sampled_from(["conv2d", "conv2d", "linear"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    batch = draw(st.integers(1, 2))
    if kind == "conv2d":
        groups = draw(st.sampled_from([1, 1, 2, 3]))
        depthwise = draw(st.booleans())
        cin = groups * draw(st.integers(1, 3)) if not depthwise else draw(st.integers(1, 6))
        groups = cin if depthwise else groups
        cout = groups * draw(st.integers(1, 3))
        kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        h, w = draw(st.integers(kh, 7)), draw(st.integers(kw, 7))
        geometry = {"stride": (draw(st.integers(1, 2)), draw(st.integers(1, 2))),
                    "padding": (draw(st.integers(0, 1)), draw(st.integers(0, 1))),
                    "dilation": (draw(st.integers(1, 2)), 1), "groups": groups}
        if (h + 2 * geometry["padding"][0] - geometry["dilation"][0] * (kh - 1)) < 1:
            geometry["dilation"] = (1, 1)
        w_shape = (cout, cin // groups, kh, kw)
        x_shape = (batch, cin, h, w)
    else:
        k, cout = draw(st.integers(1, 40)), draw(st.integers(1, 8))
        geometry = {}
        w_shape = (cout, k)
        x_shape = (batch, draw(st.integers(1, 3)), k) if draw(st.booleans()) else (batch, k)
    q_w = torch.randint(-127, 128, w_shape, generator=g, dtype=torch.int8)
    if draw(st.booleans()):  # extreme weights: partial sums at their largest
        q_w = torch.where(q_w >= 0, 127, -127).to(torch.int8)
    high_precision = draw(st.integers(0, 9)) == 0
    per_channel = high_precision or draw(st.booleans())  # (a high-precision QTensor is per channel)
    w_scale = torch.tensor([_pow2_or_not(draw, -9, -4) for _ in range(cout if per_channel else 1)])
    in_scale = _pow2_or_not(draw, -7, -2)
    # out_scale: ordinary, or so small a factor that the shift exceeds the float64 bound (int64 form)
    tiny = draw(st.booleans())
    out_scale = None if high_precision else _pow2_or_not(draw, 2, 6) if tiny else _pow2_or_not(draw, -9, -3)
    bias = torch.randn(cout, generator=g) * 0.3 if draw(st.booleans()) else None
    act = None if high_precision else draw(st.sampled_from([None, "relu", "relu6"]))
    other_scale = None if high_precision or not draw(st.booleans()) else _pow2_or_not(draw, -8, 0)
    layer = qnn.QuantizedWeightLayer(kind, q_w, w_scale, bias, in_scale, out_scale, "qint8", geometry, act=act,
                                     other_scale=other_scale, name="layer")
    q_x = torch.randint(-128, 128, x_shape, generator=g, dtype=torch.int8)
    if draw(st.booleans()):
        q_x = torch.where(torch.rand(x_shape, generator=g) < 0.5, -128, 127).to(torch.int8)
    q_o = None
    if other_scale is not None:
        acc_shape = layer._accumulate(q_x).shape
        q_o = torch.randint(-128, 128, acc_shape, generator=g, dtype=torch.int8)
    return layer, in_scale, other_scale, q_x, q_o


def _float_inputs(q: torch.Tensor, scale: float) -> np.ndarray:
    """float32 values that quantize back to ``q`` at ``scale``: float32(q * s)."""
    return (q.to(torch.float32) * torch.tensor(scale, dtype=torch.float32)).numpy()


def _check_layer(layer, in_scale, other_scale, q_x, q_o, session=inference_session):
    with torch.no_grad():
        ref = layer(QTensor(q_x, in_scale, 0), None if q_o is None else QTensor(q_o, other_scale, 0))
    x = _float_inputs(q_x, in_scale)
    o = np.zeros(1, np.float32) if q_o is None else _float_inputs(q_o, other_scale)
    model = _export_layer(layer, in_scale, other_scale, torch.from_numpy(x), torch.from_numpy(o))
    onnx.checker.check_model(model, full_check=True)
    codes_in, got = _layer_codes(model, x, o, session)
    assert np.array_equal(codes_in, q_x.numpy())
    if layer.out_scale is None:
        want = ref.dequantize().numpy()
    else:
        want = ref.int_repr().numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want), f"{int(np.sum(got != want))}/{got.size} differ"
    return model


def _plain_session(model: onnx.ModelProto):
    """onnxruntime with every graph optimization on, none disabled (unlike ``inference_session``)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_cases())
def test_onnx_layer_equals_the_simulator_layer(case):
    layer, in_scale, other_scale, q_x, q_o = case
    model = _check_layer(layer, in_scale, other_scale, q_x, q_o)
    _check_layer(layer, in_scale, other_scale, q_x, q_o, session=_plain_session)  # every ORT rewrite on
    form = "int64" if any(n.op_type == "Mod" for n in model.graph.node) else "f64"
    event(f"{layer.kind}, {form}, groups={layer.geometry.get('groups', 1)}, add={layer.with_add}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_cases())
def test_int64_requantization_equals_the_simulator_layer(case):
    """The int64 form, forced on every layer (it is the fallback where float64 is not exact)."""
    layer, in_scale, other_scale, q_x, q_o = case
    integer_layer.FORCE_FORM = "int64"
    try:
        model = _check_layer(layer, in_scale, other_scale, q_x, q_o)
    finally:
        integer_layer.FORCE_FORM = None
    if layer.out_scale is not None:
        assert any(n.op_type == "Mod" for n in model.graph.node)


def test_a_near_tie_that_a_float32_conv_rounds_the_wrong_way():
    """A 64->64 3x3 conv on 2x16x16 int8 inputs with ordinary scales: the float32 Conv export got 1 of
    the 32768 outputs one LSB off on the reference machine (its accumulation error crossed a rounding
    boundary); the integer export is exact whatever the machine sums in which order."""
    g = torch.Generator().manual_seed(0)
    q_w = torch.randint(-127, 128, (64, 64, 3, 3), generator=g, dtype=torch.int8)
    w_scale = torch.rand(64, generator=g) * 0.01 + 0.001
    bias = torch.randn(64, generator=g) * 0.5
    layer = qnn.QuantizedWeightLayer("conv2d", q_w, w_scale, bias, 0.0371, 0.913, "qint8",
                                     {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}, name="c")
    q_x = torch.randint(-128, 128, (2, 64, 16, 16), generator=g, dtype=torch.int8)
    _check_layer(layer, 0.0371, None, q_x, None)


def test_both_requantization_forms_are_used_and_recorded():
    """An ordinary factor is evaluated in float64; a factor of 2**-17 (shift 47, over the float64 bound
    of 46 for int8 outputs) in int64; the sidecar says which."""
    q_w = torch.full((2, 4, 1, 1), 127, dtype=torch.int8)
    geometry = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}
    q_x = torch.arange(-128, 128, dtype=torch.int8).reshape(2, 4, 4, 8)
    for out_scale, form, shift in ((2.0 ** -3, "float64", 29), (2.0 ** 15, "int64", 47)):
        layer = qnn.QuantizedWeightLayer("conv2d", q_w, torch.tensor([2.0 ** -2]), None, 1.0, out_scale, "qint8",
                                         geometry, name="c")
        assert int(layer.n.max()) == shift
        model = _check_layer(layer, 1.0, None, q_x, None)
        assert any(n.op_type == "Mod" for n in model.graph.node) == (form == "int64")


def test_tie_rounding_is_half_to_even():
    """acc * 2**-1 for odd acc is a tie: the BPU (and the export) round it to the even neighbour."""
    q_w = torch.ones(1, 1, 1, 1, dtype=torch.int8)
    geometry = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}
    layer = qnn.QuantizedWeightLayer("conv2d", q_w, torch.tensor([0.5]), None, 1.0, 1.0, "qint8", geometry,
                                     name="c")
    q_x = torch.tensor([-5, -3, -1, 1, 3, 5, 127, -128], dtype=torch.int8).reshape(1, 1, 1, 8)
    for form in (None, "int64"):
        integer_layer.FORCE_FORM = form
        try:
            x = _float_inputs(q_x, 1.0)
            model = _export_layer(layer, 1.0, None, torch.from_numpy(x), torch.zeros(1))
            _, got = _layer_codes(model, x, np.zeros(1, np.float32))
        finally:
            integer_layer.FORCE_FORM = None
        assert got.reshape(-1).tolist() == [-2, -2, 0, 0, 2, 2, 64, -64], form


@pytest.mark.parametrize("kind", ["conv2d", "linear"])
@pytest.mark.parametrize("xv,wv", [(127, 127), (127, -127), (-128, 127), (-128, -127), (-128, -128)])
def test_onnxruntime_int8_kernels_are_exact_at_the_extremes(kind, xv, wv):
    """ConvInteger / MatMulInteger sum exactly in int32 where 16-bit pair sums would saturate (x86
    u8s8 kernels without VNNI do): every input and weight at an extreme, K = 576, read back as the
    high-precision float32(acc) (acc < 2**24, scale 1: exact)."""
    if kind == "conv2d":
        q_w = torch.full((8, 64, 3, 3), wv, dtype=torch.int8)
        q_x = torch.full((1, 64, 5, 5), xv, dtype=torch.int8)
        geometry = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    else:
        q_w, q_x, geometry = torch.full((8, 576), wv, dtype=torch.int8), torch.full((4, 576), xv, dtype=torch.int8), {}
    layer = qnn.QuantizedWeightLayer(kind, q_w, torch.ones(8), None, 1.0, None, "qint8", geometry, name="k")
    _check_layer(layer, 1.0, None, q_x, None)


def test_high_precision_output_is_the_dequantized_accumulator():
    q_w = torch.randint(-127, 128, (3, 2, 3, 3), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    geometry = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    layer = qnn.QuantizedWeightLayer("conv2d", q_w, torch.tensor([0.01, 0.02, 0.003]), torch.tensor([0.5, -1.0, 2.0]),
                                     0.05, None, "qint8", geometry, name="c")
    q_x = torch.randint(-128, 128, (1, 2, 5, 5), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    model = _check_layer(layer, 0.05, None, q_x, None)
    assert [n.op_type for n in model.graph.node].count("ConvInteger") == 1


# ---------------------------------------------------------------------------------------------- float form


class _Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.t, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.c2(self.t(self.c(x)))


def test_conv_transpose_keeps_the_float_form_and_is_listed(tmp_path):
    """No ConvTransposeInteger in opset 11: the transposed conv stays a float ConvTranspose over the
    dequantized input (listed under float_layers, with why); the convs around it are integer."""
    torch.manual_seed(0)
    x = (torch.randn(1, 3, 8, 8),)
    cm = _compile(_Up(), x, calib=[torch.randn(1, 3, 8, 8) for _ in range(3)])
    buf = io.BytesIO()
    sidecar = export_to_onnx(cm.converted, x, buf)
    model = onnx.load_from_string(buf.getvalue())
    onnx.checker.check_model(model, full_check=True)
    (node, why), = sidecar["float_layers"].items()
    assert node.endswith("/t") and "ConvTransposeInteger" in why
    assert sorted(sidecar["integer_layers"]) == ["c", "c2"]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ConvTranspose") == 1 and ops.count("ConvInteger") == 2
    assert sidecar["weights"]["t.weight"]["dtype"] == "qint8"  # the float weight q_w * s_w, scales listed
    out = inference_session(model).run(None, {"x": x[0].numpy()})[0]
    with torch.no_grad():
        ref = cm(*x).numpy()
    scale = sidecar["activations"]["c2"]["scale"]
    assert np.abs(out - ref).max() <= scale * 1.0001  # an approximation of the BPU: within one LSB


def test_prepared_model_export_keeps_float_q_dq():
    """Only the converted export changes: a calibration model still exports float Conv + Q/DQ."""
    from qcompiler.quantization import prepare_calibration_fx

    torch.manual_seed(0)
    x = (torch.randn(1, 3, 8, 8),)
    cal = prepare_calibration_fx(_Up().eval(), example_inputs=x, march="bayes")
    with torch.no_grad():
        cal(*x)
    cal.eval()
    buf = io.BytesIO()
    sidecar = export_to_onnx(cal, x, buf)
    ops = [n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node]
    assert "ConvInteger" not in ops and ops.count("Conv") == 2
    assert sidecar["integer_layers"] == {} and sidecar["float_layers"] == {}


class _Int16WeightNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.c2(torch.relu(self.c1(x))), 1))


def test_int16_weights_keep_the_float_form_and_name_why(tmp_path):
    """int16 weights (``weight_dtype="qint16"``) under int8 activations: ConvInteger / MatMulInteger read
    8-bit integers, and the int8 initializer the integer form wrote wrapped every int16 weight (outputs
    0.3 off with no error). Such layers keep the float form, listed with why, their weights in the sidecar
    as qint16; the conv whose int8 input stays inside the graph still has its integer twin in the
    simulator, so the outputs are compared within one output step (the float form may flip a tie)."""
    from qcompiler.quantization.qconfig import get_default_calib_qconfig

    calib = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cm = qc_compile(_Int16WeightNet().eval(), calib[0], march="bayes", calib_data=calib, progress=False,
                    qconfig_dict={"": get_default_calib_qconfig(weight_dtype="qint16")})
    path = tmp_path / "m.onnx"
    sidecar = cm.export_onnx(path)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert not sidecar["integer_layers"]
    floats = {k.split("/")[-1]: why for k, why in sidecar["float_layers"].items()}
    assert set(floats) == {"c1", "c2", "fc"} and all(why.startswith("int16 weights") for why in floats.values())
    w16 = [v for k, v in sidecar["weights"].items() if k.endswith(".weight")]
    assert len(w16) == 3 and all(v["dtype"] == "qint16" for v in w16)
    fc = next(m for m in cm.converted.modules() if isinstance(m, qnn.QuantizedWeightLayer) and m.name == "fc")
    s = inference_session(onnx.load(str(path)))
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(9))
    got = torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = cm(x)
    assert (got - want).abs().max() <= fc.out_scale * 1.0001
