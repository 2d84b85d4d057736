"""export_to_onnx: every zoo model on both marches, calibrated -> QAT -> exported, vs the fake-quant model.

How the outputs are compared, and why this way:

* The exported graph computes in float32, the evaluated fake-quant model in
  float64 (it carries BPU values exactly). A value within ~1e-5 LSB of a
  rounding tie can therefore round the other way in one of them: one LSB at
  that quantization point, which later layers spread (a conv mixes it into its
  neighbourhood). That is inherent to a float32 graph, not an export error.
* The integer weight layers of a converted model's export (ConvInteger / MatMulInteger and the
  BPU's requantization; tests/test_export_exact.py) have no such ties: given identical inputs
  they must agree exactly.
* So the strict check is *teacher-forced*: every quantization point of the
  graph (every DequantizeLinear output, found through the sidecar) is exposed as
  an output; the fake-quant model is run with the value of each such point
  replaced by the ONNX one once compared. Each point then sees identical inputs
  and must agree within one LSB of its own scale; model outputs must agree within
  one LSB of the last quantizer (quantized outputs) or within float32 tolerance
  (1e-5 abs + rel) when CPU ops follow the last quantizer (both sides then run the
  same float ops on the same values).
* End to end (no forcing), on the zoo's deterministic inputs, at least 99% of the
  output elements must be within that tolerance (in practice all of them are). For resnet50, where
  one flipped tie is amplified through 50 layers (see E2E_TIE_HORIZON), every quantization point is
  compared instead, up to the first one that differs, which may differ only at rounding ties.
"""

from __future__ import annotations

import functools
import io
import json
import os

import numpy as np
import onnx
import pytest
import torch
import torch.fx as fx
from onnx import helper

import qcompiler.zoo as zoo
from qcompiler.errors import CalibrationError, ConfigError
from qcompiler.ir.meta import META_FUSED_FROM
from qcompiler.onnx import SIDECAR_SUFFIX, export_to_onnx, inference_session
from qcompiler.quantization import (
    FakeQuantize,
    QTensor,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_calibration_fx,
    prepare_qat_fx,
    set_state,
)
from qcompiler.zoo.hybrid import _SeluModule

SIZES = {name: dict(image_size=32) for name in ("resnet18", "resnet50", "mobilenet_v2", "unet", "hybrid")}
MARCHES = ["bayes", "bernoulli2"]
SLOW = {"resnet50", "mobilenet_v2"}
GUIDE_HYBRID_DICT = {"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]}


def flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, QTensor):
        return [x.dequantize()]
    return [t for v in x for t in flat(v)]


def calibrated(name, march, qconfig=None, hybrid_dict=None, batches=3):
    """Calibrated on one thread: torch's float convs sum in a thread-dependent order, so the scales
    differ in their last bits between thread counts, and the end-to-end checks of the deepest
    models (resnet50: how many outputs land on requantization ties that onnxruntime breaks
    differently from the BPU) must not depend on the machine's core count."""
    kw = SIZES.get(name, {})
    cal = prepare_calibration_fx(zoo.get(name), qconfig, example_inputs=zoo.example_inputs(name, **kw),
                                 hybrid=True, hybrid_dict=hybrid_dict, march=march)
    cal.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _calibrate(cal, name, kw, batches)
    finally:
        torch.set_num_threads(threads)
    return cal


def _calibrate(cal, name, kw, batches):
    with torch.no_grad():
        for b in range(batches):
            inputs = zoo.example_inputs(name, batch=2, **kw)
            if name not in ("lstm_seq", "transformer_block"):
                inputs = (inputs[0] + 0.1 * b,)
            cal(*inputs)


def qat_model(name, march, **kw):
    qat = prepare_qat_fx(calibrated(name, march, **{k: v for k, v in kw.items() if k == "hybrid_dict"}),
                         kw.get("qat_qconfig"), hybrid=True, hybrid_dict=kw.get("hybrid_dict"))
    set_state(qat, "validation")
    qat.eval()
    return qat


@functools.lru_cache(maxsize=None)
def calibrated_cached(name, march):
    return calibrated(name, march)


@functools.lru_cache(maxsize=None)
def prepared(name, march):
    """(QAT model in validation/eval, example inputs); cached: exporting never modifies the model
    (nor does prepare_qat_fx / convert_fx modify the calibration model they start from)."""
    qat = prepare_qat_fx(calibrated_cached(name, march), hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return qat, zoo.example_inputs(name, **SIZES.get(name, {}))


def params(names=None):
    names = names or zoo.names()
    return [pytest.param(n, m, marks=[pytest.mark.slow] if n in SLOW else [], id=f"{n}-{m}")
            for n in names for m in MARCHES]


def activation_quantizers(model) -> int:
    """Activation quantizers of a prepared model (weight fake quants excluded)."""
    return sum(1 for path, m in model.named_modules()
               if isinstance(m, FakeQuantize) and not path.endswith("weight_fake_quant"))


# ---------------------------------------------------------------------------
# comparison helpers


def _quantized_output_scales(gm: fx.GraphModule, sidecar: dict) -> list:
    """Per model output: the scale of the quantizer that produced it, or None when CPU ops follow."""
    acts = sidecar["activations"]
    passthrough = {"dequant", "identity", "dropout", "reshape", "flatten", "permute", "transpose", "relu", "getitem"}

    def scale_of(node):
        while isinstance(node, fx.Node):
            if node.name in acts and acts[node.name]["dtype"] == "qint8":
                return acts[node.name]["scale"]
            if node.meta.get("qc_op") not in passthrough or not node.all_input_nodes:
                return None
            node = node.all_input_nodes[0]
        return None

    out = next(n for n in gm.graph.nodes if n.op == "output")

    def leaves(a):
        if isinstance(a, (tuple, list)):
            return [x for v in a for x in leaves(v)]
        return [a]

    return [scale_of(a) for a in leaves(out.args[0])]


def _tolerance(scale):
    return (scale * (1 + 1e-5) + 1e-7) if scale is not None else None


def _close(o, r, scale):
    """Elementwise: within one LSB (quantized output) or float32 tolerance (CPU ops after)."""
    if scale is not None:
        return np.abs(o - r) <= _tolerance(scale)
    return np.abs(o - r) <= 1e-5 + 1e-5 * np.abs(r)


def _with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    for n in names:
        if n not in existing:
            m.graph.output.append(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    return m


def teacher_forced_check(gm: fx.GraphModule, model: onnx.ModelProto, sidecar: dict, inputs) -> int:
    """Every quantization point within one LSB given identical inputs; every output within tolerance.

    Returns the number of points checked.
    """
    node_names = {n.name for n in gm.graph.nodes}
    points = {k: v["scale"] for k, v in sidecar["activations"].items() if k in node_names and v["dtype"] == "qint8"}
    probe = _with_outputs(model, sorted(points))
    s = inference_session(probe)
    feeds = {i.name: t.numpy() for i, t in zip(s.get_inputs(), flat(inputs))}
    got = dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))
    checked = []

    class Forced(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if n.name not in points:
                return r
            scale = points[n.name]
            o = torch.from_numpy(got[n.name]).double()
            q = torch.round(o / scale)
            if isinstance(r, QTensor):
                ref = r.dequantize().double()
                forced = QTensor(q.to(r.int_repr().dtype), scale, 0)
            else:
                ref = r.double()
                forced = (q * torch.tensor(scale, dtype=torch.float64)).to(r.dtype)
            err = float((ref - o).abs().max()) if ref.numel() else 0.0
            assert err <= _tolerance(scale), f"quantization point '{n.name}': {err / scale:.3f} LSB"
            if n.name in sidecar.get("integer_layers", {}):  # computed on integers: exactly the BPU's
                assert err == 0.0, f"integer layer '{n.name}': {err / scale:.3f} LSB off"
            checked.append(n.name)
            return forced

    with torch.no_grad():
        ref_outs = flat(Forced(gm).run(*inputs))
    outs = [got[o.name] for o in model.graph.output]
    for i, (o, r, scale) in enumerate(zip(outs, ref_outs, _quantized_output_scales(gm, sidecar))):
        ok = _close(o, r.numpy(), scale)
        assert ok.all(), f"output {i}: {np.mean(~ok):.2%} of elements off (scale {scale})"
    return len(checked)


# hybrid's conv1 PReLU (slope 0.25) keeps its input's max, so its output can get its input's
# scale: then q * 0.25 lands exactly on a rounding tie for every q = 2 mod 4, and torch and
# onnxruntime break such ties by their last float bit (~3% of the output flips by one LSB)
E2E_MIN_FRACTION = {"hybrid": 0.97}


# resnet50 (53 convs, random weights, BN re-estimated) amplifies a single one-LSB flip until the end-to-end
# output fraction says nothing about the export. Measured on an AVX2 EPYC (no AVX-512; onnxruntime's MLAS
# AVX2 float32 convs vs the float64 fake-quant model), identical for bayes and bernoulli2: given identical
# inputs (teacher-forced), 1 of the 232936 quantized elements differs, in layer3.0.conv1 (the 26th of 56
# points): onnxruntime's float32 pre-rounding value is 41.500000 LSB (half to even -> 42), torch's
# 41.499981 (-> 41). Over all points the forced pre-rounding values differ by <= 4.7e-5 LSB (float32
# summation order), and 6 elements lie within 1e-4 LSB of a tie. Unforced, the 25 points before it are
# bit-identical and the flips then grow 1 -> 6 -> 57 (layer3.0.conv3) -> 502 (layer3.1.conv3) -> 1810
# (layer3.4.conv3, of 4096) -> 974 of 2048 at layer4.2.conv3 (up to 6 LSB): 26% of fc's 1000 outputs are
# 1-4 LSB off (74% within one LSB). On the AVX-512 machines of earlier sessions it passed (>= 99%; not remeasured).
# A fraction derived from that would depend on where the first tie falls, so for these models the
# end-to-end check compares every quantization point up to the first that differs, which must differ only
# by one LSB at rounding ties (onnxruntime's pre-rounding value within TIE_LSB of a half); past it the
# teacher-forced check (every point, every element) is the check. Without a flip, the outputs as usual.
E2E_TIE_HORIZON = {"resnet50"}
TIE_LSB = 1e-4  # ~2x the largest float32-vs-float64 pre-rounding difference measured above (4.7e-5 LSB)


def _first_divergence_is_a_tie(gm, model, sidecar, inputs, min_fraction) -> bool:
    """Unforced, point by point in graph order: True when some quantization point differs, after checking
    that the first one differs only by one-LSB flips of rounding ties; False when none differs."""
    node_names = {n.name for n in gm.graph.nodes}
    points = {k: v["scale"] for k, v in sidecar["activations"].items() if k in node_names and v["dtype"] == "qint8"}
    producer = {o: n for n in model.graph.node for o in n.output}
    pre = {}  # point -> the input of its QuantizeLinear: onnxruntime's value before rounding
    for k in points:
        dq = producer.get(k)
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            pre[k] = q.input[0]
    probe = _with_outputs(model, sorted(points) + sorted(set(pre.values())))
    s = inference_session(probe)
    got = dict(zip([o.name for o in s.get_outputs()],
                   s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), flat(inputs))})))
    ref = {}

    class Recording(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if n.name in points:
                ref[n.name] = (r.dequantize() if isinstance(r, QTensor) else r).double().numpy()
            return r

    with torch.no_grad():
        Recording(gm).run(*inputs)
    for k in (n.name for n in gm.graph.nodes if n.name in points):
        scale = points[k]
        diff = np.abs(got[k].astype(np.float64) - ref[k])
        off = diff > scale * 1e-3
        if not off.any():
            continue
        assert (diff <= _tolerance(scale)).all(), f"'{k}' (first point that differs): {diff.max() / scale:.3f} LSB"
        assert k in pre, f"'{k}' (first point that differs) has no QuantizeLinear to tell a tie by"
        r = got[pre[k]][off].astype(np.float64) / scale
        dist = np.abs(r - np.floor(r) - 0.5)
        assert (dist <= TIE_LSB).all(), f"'{k}' (first point that differs): {dist.max():.3g} LSB from a tie"
        assert np.mean(off) <= 1 - min_fraction, f"'{k}' (first point that differs): {np.mean(off):.2%} flipped"
        return True
    return False


def end_to_end_check(gm, model, sidecar, inputs, min_fraction=0.99, tie_horizon=False):
    if tie_horizon and _first_divergence_is_a_tie(gm, model, sidecar, inputs, min_fraction):
        return
    outs = inference_session(model).run(None, {i.name: t.numpy() for i, t in zip(model.graph.input,
                                                                                 flat(inputs))})
    with torch.no_grad():
        ref = flat(gm(*inputs))
    assert len(outs) == len(ref)
    for i, (o, r, scale) in enumerate(zip(outs, ref, _quantized_output_scales(gm, sidecar))):
        assert o.shape == tuple(r.shape)
        frac = float(np.mean(_close(o, r.numpy(), scale)))
        assert frac >= min_fraction, f"output {i}: only {frac:.2%} within tolerance (scale {scale})"


# ---------------------------------------------------------------------------
# every zoo model on both marches


@pytest.mark.parametrize("name,march", params())
def test_export_matches_fake_quant_model(name, march, tmp_path):
    qat, x = prepared(name, march)
    path = tmp_path / f"{name}.onnx"
    sidecar = export_to_onnx(qat, x, str(path))
    again = io.BytesIO()
    assert export_to_onnx(qat, x, again) == sidecar and again.getvalue() == path.read_bytes()  # deterministic
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 11 and model.producer_name == "qcompiler"
    # the sidecar next to the file is the returned dict; every activation quantizer has its entry
    assert json.loads((tmp_path / f"{name}.onnx{SIDECAR_SUFFIX}").read_text()) == sidecar
    assert len(sidecar["activations"]) == activation_quantizers(qat)
    assert all(v["dtype"] == "qint8" and v["zero_point"] == 0 for v in sidecar["activations"].values())
    q_nodes = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_nodes) == len(sidecar["activations"])
    inits = {i.name for i in model.graph.initializer}
    assert set(sidecar["weights"]) <= inits
    for entry in sidecar["weights"].values():
        assert entry["dtype"] in ("qint8", "qint32") and entry["scales"]
    # partitions: every ONNX node belongs to exactly one partition, named by it
    parts = sidecar["partitions"]
    owned = [n for p in parts.values() for n in p["nodes"]]
    assert sorted(owned) == sorted(n.name for n in model.graph.node if n.name.split("/")[0] in parts)
    for pname, p in parts.items():
        assert all(n.split("/")[0] == pname for n in p["nodes"])
    teacher_forced_check(qat, model, sidecar, x)
    end_to_end_check(qat, model, sidecar, x, E2E_MIN_FRACTION.get(name, 0.99), tie_horizon=name in E2E_TIE_HORIZON)


@pytest.mark.parametrize("name,march", params(["resnet18", "unet", "transformer_block", "lstm_seq", "hybrid"]))
def test_export_of_converted_model_matches_it(name, march):
    qat, x = prepared(name, march)
    q = convert_fx(qat)
    buf = io.BytesIO()
    sidecar = export_to_onnx(q, x, buf)
    model = onnx.load_from_string(buf.getvalue())
    assert len(sidecar["activations"]) == activation_quantizers(qat)  # one Q/DQ per quantization point
    teacher_forced_check(q, model, sidecar, x)
    end_to_end_check(q, model, sidecar, x, E2E_MIN_FRACTION.get(name, 0.99))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_export_of_converted_deep_models(name):
    qat, x = prepared(name, "bayes")
    q = convert_fx(qat)
    buf = io.BytesIO()
    sidecar = export_to_onnx(q, x, buf)
    model = onnx.load_from_string(buf.getvalue())
    teacher_forced_check(q, model, sidecar, x)
    end_to_end_check(q, model, sidecar, x)


# ---------------------------------------------------------------------------
# determinism, files, errors


def test_export_is_deterministic_also_after_recreating_the_model(tmp_path):
    qat, x = prepared("transformer_block", "bayes")
    export_to_onnx(qat, x, str(tmp_path / "a.onnx"))
    export_to_onnx(qat, x, str(tmp_path / "b.onnx"))
    fresh = qat_model("transformer_block", "bayes")  # rebuilt from scratch: new objects, same numbers
    export_to_onnx(fresh, x, str(tmp_path / "c.onnx"))
    files = [(tmp_path / f"{k}.onnx").read_bytes() for k in "abc"]
    sidecars = [(tmp_path / f"{k}.onnx{SIDECAR_SUFFIX}").read_bytes() for k in "abc"]
    assert files[0] == files[1] == files[2]
    assert sidecars[0] == sidecars[1] == sidecars[2]
    text = sidecars[0].decode()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_hybrid_guide_flow_with_high_precision_output(tmp_path):
    """The guide's example: hybrid_dict, conv4 a high-precision output feeding the CPU selu."""
    qat = qat_model("hybrid", "bayes", hybrid_dict=GUIDE_HYBRID_DICT,
                    qat_qconfig={"": get_default_qat_qconfig(),
                                 "module_name": [("conv4", get_default_qat_out_qconfig())]})
    x = zoo.example_inputs("hybrid", image_size=32)
    path = tmp_path / "qat.onnx"
    sidecar = export_to_onnx(qat, x, path, input_names=["input"], output_names=["output"],
                             dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    model = onnx.load(str(path))
    assert sidecar["high_precision_outputs"] == ["conv4"]
    assert "conv4" not in sidecar["activations"] and len(sidecar["activations"]) == activation_quantizers(qat)
    assert [p for p in sidecar["partitions"]] == ["bpu0", "cpu0", "bpu1", "cpu1", "bpu2", "cpu2"]
    assert sidecar["partitions"]["cpu2"]["inputs"] == ["selu_2_input_dequant_0"]
    assert {"bpu0/conv0", "cpu0/prelu", "cpu1/conv3", "bpu2/conv4", "cpu2/selu_2"} <= {n.name for n in model.graph.node}
    teacher_forced_check(qat, model, sidecar, x)
    end_to_end_check(qat, model, sidecar, x)
    # the converted model: conv4 emits its int32 accumulator, float in the graph, listed too ...
    q = convert_fx(qat)
    buf = io.BytesIO()
    q_sidecar = export_to_onnx(q, x, buf)
    assert q_sidecar["high_precision_outputs"] == ["conv4"]
    assert q_sidecar["weights"]["conv4.bias"]["dtype"] == "qint32"
    # ... computed on integers (ConvInteger + int32 bias), dequantized as QTensor.dequantize
    assert q_sidecar["integer_layers"]["conv4"]["evaluated_in"] is None
    assert q_sidecar["integer_layers"]["conv4"]["accumulator"] == "conv4/bias"
    teacher_forced_check(q, onnx.load_from_string(buf.getvalue()), q_sidecar, x)
    # dynamic batch: another batch size runs and matches
    xb = (torch.rand(3, 3, 32, 32),)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    out = inference_session(path).run(None, {"input": xb[0].numpy()})[0]
    with torch.no_grad():
        ref = qat(*xb).numpy()
    # selu after conv4: |selu'| <= scale*alpha = 1.758, times conv4's accumulator LSB; float32 otherwise
    assert np.mean(np.abs(out - ref) <= 1e-5 + 1e-5 * np.abs(ref)) >= 0.99


def test_calibration_model_exports_ptq_scales():
    """A calibration model exports with the observers' scales: it matches convert_fx of it."""
    cal = calibrated_cached("resnet18", "bayes")
    x = zoo.example_inputs("resnet18", image_size=32)
    buf = io.BytesIO()
    sidecar = export_to_onnx(cal, x, buf)
    model = onnx.load_from_string(buf.getvalue())
    n_quant = sum(1 for p, m in cal.named_modules() if type(m).__name__ == "CalibFakeQuantize"
                  and not p.endswith("weight_fake_quant"))
    assert len(sidecar["activations"]) == n_quant
    q = convert_fx(cal)
    teacher_forced_check(q, model, sidecar, x)
    end_to_end_check(q, model, sidecar, x)


def test_float_partition_output_exports_without_quantization(tmp_path):
    import qcompiler

    x = zoo.example_inputs("unet", image_size=32)
    gm = qcompiler.partition(zoo.get("unet"), x, march="bayes")
    sidecar = export_to_onnx(gm, x, tmp_path / "unet.onnx")
    model = onnx.load(str(tmp_path / "unet.onnx"))
    assert sidecar["activations"] == {} and sidecar["weights"] == {}
    assert not any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    out = inference_session(model).run(None, {"x": x[0].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(out, gm(*x).numpy(), atol=1e-4, rtol=1e-4)


def test_int16_activations_stay_float_and_are_recorded():
    cal = calibrated("hybrid", "bayes", qconfig={"": get_default_calib_qconfig(dtype="qint16")})
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig(dtype="qint16")}, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    x = zoo.example_inputs("hybrid", image_size=32)
    buf = io.BytesIO()
    sidecar = export_to_onnx(qat, x, buf)
    model = onnx.load_from_string(buf.getvalue())
    assert not any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    assert len(sidecar["activations"]) == activation_quantizers(qat)
    assert {v["dtype"] for v in sidecar["activations"].values()} == {"qint16"}
    # float where the model has int16: within half an int16 step of each quantizer, i.e. close
    out = inference_session(model).run(None, {model.graph.input[0].name: x[0].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(out, qat(*x).numpy(), atol=2e-3)


def test_file_object_and_names():
    qat, x = prepared("lstm_seq", "bayes")
    buf = io.BytesIO()
    sidecar = export_to_onnx(qat, x, buf, input_names=["tokens", "h0", "c0"], output_names=["logits", "h_n", "c_n"])
    model = onnx.load_from_string(buf.getvalue())
    assert [i.name for i in model.graph.input] == ["tokens", "h0", "c0"]
    assert [o.name for o in model.graph.output] == ["logits", "h_n", "c_n"]
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert "fc" in sidecar["activations"]
    with pytest.raises(ConfigError, match="input_names"):
        export_to_onnx(qat, x, io.BytesIO(), input_names=["tokens"])


def test_opset_other_than_11_is_refused_and_writes_nothing(tmp_path):
    qat, x = prepared("hybrid", "bayes")
    path = tmp_path / "m.onnx"
    with pytest.raises(ConfigError, match="only opset 11"):
        export_to_onnx(qat, x, str(path), opset_version=13)
    assert os.listdir(tmp_path) == []


def test_failures_leave_no_file_behind(tmp_path):
    path = tmp_path / "m.onnx"
    # a plain float model: prepare it first
    with pytest.raises(ConfigError, match="prepare"):
        export_to_onnx(zoo.get("hybrid"), zoo.example_inputs("hybrid", image_size=32), str(path))
    # a calibration model that never saw data
    cal = prepare_calibration_fx(zoo.get("hybrid"), example_inputs=zoo.example_inputs("hybrid", image_size=32),
                                 hybrid=True, march="bayes")
    with pytest.raises(CalibrationError, match="never saw data"):
        export_to_onnx(cal, zoo.example_inputs("hybrid", image_size=32), str(path))
    # bad arguments
    qat, x = prepared("hybrid", "bayes")
    with pytest.raises(ConfigError, match="input tensor"):
        export_to_onnx(qat, (x[0], x[0]), str(path))
    with pytest.raises(ConfigError, match="dynamic_axes"):
        export_to_onnx(qat, x, str(path), dynamic_axes={"nope": {0: "batch"}})
    assert os.listdir(tmp_path) == []
    # an existing file is replaced only by a complete export
    path.write_bytes(b"old")
    with pytest.raises(ConfigError):
        export_to_onnx(qat, x, str(path), opset_version=12)
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["m.onnx"]
    export_to_onnx(qat, x, str(path))
    assert onnx.load(str(path)).graph.node and (tmp_path / f"m.onnx{SIDECAR_SUFFIX}").exists()
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", f"m.onnx{SIDECAR_SUFFIX}"]


class _Clamps(torch.nn.Module):
    """ReLU / ReLU6 spelled as clamps, and a relu6 with its own output scale (after an add)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Conv2d(3, 8, 3, padding=1) for _ in range(4))
        self.h = torch.nn.Hardtanh(0.0, 6.0)

    def forward(self, x):
        y = torch.nn.functional.relu6(self.a(x) + self.b(x))  # not fused: the add row takes relu only
        z = torch.clamp(self.c(x), min=0)  # fuses as conv+relu
        w = self.h(self.d(x))  # fuses as conv+relu6
        return torch.nn.functional.hardtanh(y + z, 0.0, 6.0) + w.clamp(0, 6)


def test_clamp_spellings_and_requantizing_relu6_run_on_the_bpu_and_export():
    import qcompiler

    torch.manual_seed(0)
    model = _Clamps().eval()
    x = (torch.randn(2, 3, 8, 8) * 2,)
    cm = qcompiler.compile(model, x, march="bayes", calib_data=[x[0]], progress=False)
    assert [p["placement"] for p in cm.partitions] == ["bpu"]  # every clamp is a ReLU / ReLU6: no CPU island
    fused = {n.name: n.meta[META_FUSED_FROM] for n in cm.converted.graph.nodes if META_FUSED_FROM in n.meta}
    assert fused == {"a": ("a", "add"), "c": ("c", "clamp"), "d": ("d", "h")}
    with torch.no_grad():
        assert torch.equal(cm(*x), cm.converted(*x))  # the simulator (relu6 requantizes, then clamps)
    buf = io.BytesIO()
    sidecar = export_to_onnx(cm.converted, x, buf)
    onnx_model = onnx.load_from_string(buf.getvalue())
    teacher_forced_check(cm.converted, onnx_model, sidecar, x)
    end_to_end_check(cm.converted, onnx_model, sidecar, x)


class _CeilPool(torch.nn.Module):
    """A ceil-mode average pool with a partial last window runs on CPU between two BPU convs."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.c2(torch.nn.functional.avg_pool2d(self.c(x), 3, 2, ceil_mode=True))


def test_inference_session_keeps_onnxruntime_from_fusing_qdq_into_integer_kernels():
    """onnxruntime's QDQ fusion turns DQ -> AveragePool -> Q into QLinearAveragePool, which treats the
    ceil-mode edge windows differently (21% of the outputs were off); inference_session disables it."""
    import qcompiler

    torch.manual_seed(0)
    x = (torch.randn(1, 3, 16, 16),)
    cm = qcompiler.compile(_CeilPool().eval(), x, march="bayes", calib_data=[x[0]], progress=False)
    assert [p["placement"] for p in cm.partitions] == ["bpu", "cpu", "bpu"]
    buf = io.BytesIO()
    sidecar = export_to_onnx(cm.converted, x, buf)
    onnx_model = onnx.load_from_string(buf.getvalue())
    teacher_forced_check(cm.converted, onnx_model, sidecar, x)
    out = inference_session(onnx_model).run(None, {"x": x[0].numpy()})[0]
    with torch.no_grad():
        assert np.array_equal(out, cm(*x).numpy())


# ---------------------------------------------------------------------------
# grouped transposed convs: weight (in, out/groups, kh, kw)


class _GroupedUp(torch.nn.Module):
    """A BPU conv feeding a grouped transposed conv (optionally fused with a ReLU)."""

    def __init__(self, cin: int, cout: int, groups: int, relu: bool) -> None:
        super().__init__()
        self.c = torch.nn.Conv2d(3, cin, 3, padding=1)
        self.t = torch.nn.ConvTranspose2d(cin, cout, 2, stride=2, groups=groups)
        self.relu = relu

    def forward(self, x):
        y = self.t(self.c(x))
        return torch.relu(y) if self.relu else y


def _sidecar_scale_grid(shape, entry):
    """The weight's scales laid out as the sidecar documents it, written out independently: output
    channel o = g * (out/groups) + j is column j of the in/groups rows of group g."""
    scales, groups = entry["scales"], entry.get("groups", 1)
    grid = np.empty(shape[:2])
    if len(scales) == 1:
        grid[:] = scales[0]
        return grid[:, :, None, None]
    rows_per_group = shape[0] // groups
    for i in range(shape[0]):
        for j in range(shape[1]):
            grid[i, j] = scales[(i // rows_per_group) * shape[1] + j]
    return grid[:, :, None, None]


@pytest.mark.parametrize("cin,cout,groups,relu", [(4, 8, 2, False), (6, 4, 2, True), (4, 8, 4, False),
                                                  (6, 6, 6, False)],
                         ids=["groups2", "groups2_relu", "groups4", "depthwise"])
def test_grouped_conv_transpose_exports_at_every_stage(cin, cout, groups, relu):
    """Converted (crashed before), calibration and QAT models with a grouped transposed conv export,
    run in onnxruntime and match; the sidecar's per-output-channel scales describe the weight."""
    from qcompiler.backends.onnx import emit_graph
    from qcompiler.nn.quantized import QuantizedWeightLayer

    torch.manual_seed(0)
    model = _GroupedUp(cin, cout, groups, relu).eval()
    x = (torch.randn(2, 3, 8, 8),)
    cal = prepare_calibration_fx(model, {"": get_default_calib_qconfig()}, example_inputs=x, march="bayes")
    with torch.no_grad():
        for _ in range(3):
            cal(torch.randn(2, 3, 8, 8))
    cal.eval()
    q = convert_fx(cal)
    assert isinstance(q.get_submodule("t"), QuantizedWeightLayer)  # the BPU layer, not a CPU float one
    qat = prepare_qat_fx(cal)
    set_state(qat, "validation")
    qat.eval()
    weights = {}
    for stage, exported, reference in (("converted", q, q), ("calibration", cal, q), ("qat", qat, qat)):
        buf = io.BytesIO()
        sidecar = export_to_onnx(exported, x, buf)
        onnx_model = onnx.load_from_string(buf.getvalue())
        teacher_forced_check(reference, onnx_model, sidecar, x)
        end_to_end_check(reference, onnx_model, sidecar, x)
        w_name = "t.op.weight" if relu and stage != "converted" else "t.weight"
        entry = sidecar["weights"][w_name]
        per_channel = q.t.w_scale.numel() > 1
        assert entry["axis"] == 1 and len(entry["scales"]) == (cout if per_channel else 1)
        assert entry.get("groups") == (groups if per_channel else None)
        assert len(sidecar["weights"][w_name.replace("weight", "bias")]["scales"]) == (cout if per_channel else 1)
        init = next(i for i in onnx_model.graph.initializer if i.name == w_name)
        w = onnx.numpy_helper.to_array(init).astype(np.float64)
        codes = w / _sidecar_scale_grid(w.shape, entry)
        np.testing.assert_array_equal(np.round(codes), q.t.q_weight.numpy())  # initializer = q_w * s_w
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
        weights[stage] = (entry, w)
    assert weights["converted"][0] == weights["calibration"][0] == weights["qat"][0]
    # the float view of the converted model (no Q/DQ) holds the same dequantized weight
    float_view = emit_graph(q)
    init = next(i for i in float_view.graph.initializer if i.name == "t.weight")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), weights["converted"][1].astype(np.float32))
    out = inference_session(float_view).run(None, {"x": x[0].numpy()})[0]
    assert out.shape == (2, cout, 16, 16)


def test_grouped_conv_transpose_float_partition_exports():
    import qcompiler

    torch.manual_seed(0)
    model = _GroupedUp(4, 8, 2, True).eval()
    x = (torch.randn(2, 3, 8, 8),)
    gm = qcompiler.partition(model, x, march="bayes")
    buf = io.BytesIO()
    assert export_to_onnx(gm, x, buf)["weights"] == {}
    out = inference_session(buf.getvalue()).run(None, {"x": x[0].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(out, model(*x).numpy(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# args are checked against the traced inputs


def _bad_args_cases(x):
    return [
        # a batch that is not the traced one: only with the batch fixed (the default keeps it symbolic)
        ((torch.randn(2, 3, 32, 32),), {"dynamic_batch": False},
         r"input 'x' has shape \(2, 3, 32, 32\), the model was traced with "
                                           r"shape \(1, 3, 32, 32\).*dynamic_axes\['x'\]"),
        # only a batch size gets the dynamic_axes hint: the spatial sizes are baked into the graph
        ((torch.randn(1, 3, 16, 16),), {}, r"input 'x' has shape \(1, 3, 16, 16\).*traced with shape "
                                           r"\(1, 3, 32, 32\); pass an input of the traced shape$"),
        ((torch.randn(3, 32, 32),), {}, r"input 'x' has shape \(3, 32, 32\).*traced with shape \(1, 3, 32, 32\)"),
        ((x[0].double(),), {}, r"input 'x' has dtype f64, the model was traced with f32"),
        ((x[0], x[0]), {}, r"takes 1 input tensor\(s\) \(x\), got 2"),
        ((torch.randn(2, 3, 32, 32),), {"input_names": ["image"], "dynamic_batch": False},
         r"input 'image' has shape \(2, 3, 32, 32\)"),
        # a dynamic batch does not excuse another size elsewhere
        ((torch.randn(2, 3, 16, 32),), {"dynamic_axes": {"x": {0: "batch"}}},
         r"input 'x' has shape \(2, 3, 16, 32\).*pass an input of the traced shape$"),
        (x, {"dynamic_axes": {"x": {4: "batch"}}}, r"dynamic_axes\['x'\]: axis 4 does not exist in 'x'.*rank 4"),
        (x, {"dynamic_axes": {"output": {2: "n"}}}, r"dynamic_axes\['output'\]: axis 2 does not exist"),
        (x, {"dynamic_axes": {"x": {"0": "batch"}}}, r"dynamic_axes\['x'\] must be"),
    ]


def test_args_that_do_not_match_the_traced_inputs_are_refused_and_write_nothing(tmp_path):
    torch.manual_seed(0)
    model = _DynBatch().eval()
    x = (torch.randn(1, 3, 32, 32),)
    cal = prepare_calibration_fx(model, example_inputs=x, march="bayes")
    cal(x[0])
    q = convert_fx(cal)
    path = tmp_path / "m.onnx"
    for args, kw, message in _bad_args_cases(x):
        for exported in (cal, q):
            with pytest.raises(ConfigError, match=message):
                export_to_onnx(exported, args, str(path), **kw)
    assert os.listdir(tmp_path) == []


def test_tuple_inputs_are_checked_by_their_leaf_names():
    qat, x = prepared("lstm_seq", "bayes")
    tokens, (h0, c0) = x
    with pytest.raises(ConfigError, match=r"input 'hidden.1' has shape \(1, 2, 64\).*\(1, 1, 64\)"):
        export_to_onnx(qat, (tokens, (h0, torch.zeros(1, 2, 64))), io.BytesIO())
    with pytest.raises(ConfigError, match=r"input 'c0' has shape \(1, 2, 64\)"):
        export_to_onnx(qat, (tokens, (h0, torch.zeros(1, 2, 64))), io.BytesIO(), input_names=["t", "h0", "c0"])
    with pytest.raises(ConfigError, match=r"input 'tokens' has dtype f32, the model was traced with i64"):
        export_to_onnx(qat, (tokens.float(), (h0, c0)), io.BytesIO(), input_names=["tokens", "h0", "c0"])


# ---------------------------------------------------------------------------
# dynamic axes


class _DynBatch(torch.nn.Module):
    """conv -> flatten -> linear: valid for any batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Conv2d(3, 4, 3, stride=4, padding=1)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.c(x)), 1))


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_dynamic_input_axis_makes_the_outputs_batch_symbolic_and_runs_at_other_sizes(tmp_path):
    torch.manual_seed(0)
    x = (torch.randn(1, 3, 32, 32),)
    cal = prepare_calibration_fx(_DynBatch().eval(), example_inputs=x, march="bayes")
    with torch.no_grad():
        for _ in range(3):
            cal(torch.randn(4, 3, 32, 32))
    q = convert_fx(cal)
    path = tmp_path / "m.onnx"
    sidecar = export_to_onnx(q, x, str(path), dynamic_axes={"x": {0: "batch"}})
    model = onnx.load(str(path))
    assert _dims(model.graph.input[0]) == ["batch", 3, 32, 32]
    assert _dims(model.graph.output[0]) == ["batch", 5]  # was [1, 5]: onnxruntime warned, consumers believed it
    for batch in (1, 3, 5):
        xb = (torch.randn(batch, 3, 32, 32),)
        end_to_end_check(q, model, sidecar, xb, min_fraction=1.0)
    # args of another batch are fine on a dynamic axis: the same file
    export_to_onnx(q, (torch.randn(3, 3, 32, 32),), str(tmp_path / "b.onnx"), dynamic_axes={"x": {0: "batch"}})
    assert (tmp_path / "b.onnx").read_bytes() == path.read_bytes()
    # a label the caller gives an output wins; the list form names axes like torch.onnx.export
    buf = io.BytesIO()
    export_to_onnx(q, x, buf, dynamic_axes={"x": [0], "output": {0: "N"}})
    model = onnx.load_from_string(buf.getvalue())
    assert _dims(model.graph.input[0]) == ["x_dynamic_axes_1", 3, 32, 32]
    assert _dims(model.graph.output[0]) == ["N", 5]
    # without dynamic axes the batch is symbolic (the graph is per-sample); dynamic_batch=False fixes it
    buf = io.BytesIO()
    export_to_onnx(q, x, buf)
    assert _dims(onnx.load_from_string(buf.getvalue()).graph.output[0]) == ["batch", 5]
    buf = io.BytesIO()
    export_to_onnx(q, x, buf, dynamic_batch=False)
    assert _dims(onnx.load_from_string(buf.getvalue()).graph.output[0]) == [1, 5]


def test_dynamic_batch_of_a_model_with_tuple_inputs_and_outputs():
    """lstm_seq: the batch is dim 0 of the tokens and dim 1 of the LSTM state, in and out."""
    qat, x = prepared("lstm_seq", "bayes")
    names = ["tokens", "h0", "c0"]
    buf = io.BytesIO()
    sidecar = export_to_onnx(qat, x, buf, input_names=names, output_names=["logits", "h_n", "c_n"],
                             dynamic_axes={"tokens": {0: "batch"}, "h0": {1: "batch"}, "c0": {1: "batch"}})
    model = onnx.load_from_string(buf.getvalue())
    assert [_dims(o) for o in model.graph.output] == [["batch", 12, 10], [1, "batch", 64], [1, "batch", 64]]
    tokens = torch.randint(0, 10, (3, 12))
    xb = (tokens, (torch.randn(1, 3, 64), torch.randn(1, 3, 64)))
    end_to_end_check(qat, model, sidecar, xb)


def test_unknown_dynamic_axes_names_list_the_allowed_ones(tmp_path):
    qat, x = prepared("hybrid", "bayes")
    path = tmp_path / "m.onnx"
    with pytest.raises(ConfigError, match=r"dynamic_axes names 'nope'.*input \(input\).*output \(output\)"):
        export_to_onnx(qat, x, str(path), dynamic_axes={"nope": {0: "batch"}})
    with pytest.raises(ConfigError, match=r"'output'.*input \(image\).*output \(logits\)"):
        export_to_onnx(qat, x, str(path), input_names=["image"], output_names=["logits"],
                       dynamic_axes={"image": {0: "batch"}, "output": {0: "batch"}})
    assert os.listdir(tmp_path) == []
