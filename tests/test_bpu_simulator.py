"""BPU lowering + simulator on zoo models: bit-exact with the converted model, serialisable."""

from __future__ import annotations

import functools
import json

import int_reference as ref
import numpy as np
import pytest
import torch
import torch.nn as nn
from simulator_configs import CONFIGS
from test_bpu_reference import Tiny, rand_scales

import qcompiler.zoo as zoo
from qcompiler.backends.bpu.lower import bpu_partition_names, lower_bpu_partitions, lower_partition
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.bpu.sim.gemm import exact_chunks
from qcompiler.errors import ArtifactError, ConfigError, UnsupportedOpError
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.qtensor import QTensor
from qcompiler.runtime import Runtime

SMALL = {"resnet18": dict(image_size=32), "mobilenet_v2": dict(image_size=32)}
MODELS = ["resnet18", "mobilenet_v2", "unet", "transformer_block", "lstm_seq", "hybrid"]
SLOW = {"resnet18", "mobilenet_v2"}  # a few seconds each to calibrate and convert


@functools.cache
def converted(name: str, march: str):
    """convert_fx(qat model in validation state) and its example inputs (one calibration batch)."""
    kw = SMALL.get(name, {})
    cal = prepare_calibration_fx(zoo.get(name), None, example_inputs=zoo.example_inputs(name, **kw),
                                 hybrid=True, march=march)
    cal.eval()
    with torch.no_grad():
        cal(*zoo.example_inputs(name, batch=2, **kw))
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return convert_fx(qat), zoo.example_inputs(name, batch=2, **kw)


def flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in flat(v)]


def model_params():
    return [pytest.param(n, m, marks=[pytest.mark.slow] if n in SLOW else [], id=f"{n}-{m}")
            for n in MODELS for m in ("bayes", "bernoulli2")]


@pytest.mark.parametrize("name,march", model_params())
def test_partitioned_simulation_equals_converted_model(name, march):
    q, x = converted(name, march)
    programs = lower_bpu_partitions(q)
    assert list(programs) == bpu_partition_names(q)
    with torch.no_grad():
        expected = flat(q(*x))
    for cfg in CONFIGS:
        got = flat(Runtime.simulated(q, programs, **cfg)(*x))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and torch.equal(g, e), f"{name}/{march}/{cfg}: output differs"


def _round_trip(program: BpuProgram) -> BpuProgram:
    tensors, meta = program.to_state()
    meta = json.loads(json.dumps(meta))
    return BpuProgram.from_state({k: v.clone() for k, v in tensors.items()}, meta)


@pytest.mark.parametrize("name,march", [("hybrid", "bayes"), ("transformer_block", "bayes"), ("unet", "bernoulli2")])
def test_program_state_round_trip(name, march):
    q, x = converted(name, march)
    programs = lower_bpu_partitions(q)
    loaded = {k: _round_trip(p) for k, p in programs.items()}
    for k in programs:
        assert loaded[k].summary() == programs[k].summary()
        t1, m1 = programs[k].to_state()
        t2, m2 = loaded[k].to_state()
        assert m1 == m2 and t1.keys() == t2.keys() and all(torch.equal(t1[i], t2[i]) for i in t1)
    with torch.no_grad():
        a, b = flat(Runtime.simulated(q, programs)(*x)), flat(Runtime.simulated(q, loaded)(*x))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_program_state_rejects_bad_state():
    q, _ = converted("hybrid", "bayes")
    tensors, meta = lower_partition(q, "bpu1").to_state()
    with pytest.raises(ArtifactError, match="not a BPU program"):
        BpuProgram.from_state(tensors, {"format": "something else"})
    with pytest.raises(ArtifactError, match="newer"):
        BpuProgram.from_state(tensors, {**meta, "version": 99})
    with pytest.raises(ArtifactError, match="tensor '1.weight' is missing"):
        BpuProgram.from_state({k: v for k, v in tensors.items() if k != "1.weight"}, meta)


HYBRID_BPU0 = """\
BpuProgram bpu0: 1 inputs, 1 outputs, 4 ops
inputs:
  input_1: f32
outputs:
  prelu_input_dequant_0: f32
ops:
    0 quantize   quant <- input_1
      -> qint8 scale=0.00784324
    1 conv2d     conv0 <- quant
      -> qint8 scale=0.00864149 stride=[1, 1] padding=[0, 0] dilation=[1, 1] groups=1 in_scale=0.00784324 weight:int8[3,3,1,1] bias:int32[3] M:int64[3] n:int64[3]
    2 identity   identity <- conv0
      -> qint8 scale=0.00864149
    3 dequantize prelu_input_dequant_0 <- identity"""


def test_summary_golden_hybrid():
    q, _ = converted("hybrid", "bayes")
    programs = lower_bpu_partitions(q)
    assert list(programs) == ["bpu0", "bpu1", "bpu2"]
    assert programs["bpu0"].summary() == HYBRID_BPU0


def test_bpu_to_bpu_edges_pass_qtensors():
    """transformer_block on bayes: values flow between BPU partitions as QTensors."""
    q, x = converted("transformer_block", "bayes")
    programs = lower_bpu_partitions(q)
    quantized_inputs = [v for p in programs.values() for v in p.inputs if not v.is_float]
    assert quantized_inputs and all(v.dtype == "qint8" for v in quantized_inputs)
    runner = Runtime.simulated(q, programs)
    with torch.no_grad():
        assert torch.equal(runner(*x), q(*x))
        assert torch.equal(runner(*x), q(*x))  # a runner is reusable


def test_simulator_input_checks():
    q, _ = converted("transformer_block", "bayes")
    programs = lower_bpu_partitions(q)
    prog = next(p for p in programs.values() if any(not v.is_float for v in p.inputs))
    sim = BpuSimulator(prog)
    with pytest.raises(ConfigError, match="missing input"):
        sim.run({})
    spec = next(v for v in prog.inputs if not v.is_float)
    ints = torch.zeros(2, 4, 16, 16, dtype=torch.int8)
    bad = {v.name: (QTensor(ints, spec.scale * 2, 0) if v is spec else torch.zeros(2, 16, 64)) for v in prog.inputs}
    with pytest.raises(ConfigError, match="quantization parameters differ"):
        sim.run(bad)
    bad[spec.name] = torch.zeros(2, 4, 16, 16)
    with pytest.raises(ConfigError, match="must be a QTensor"):
        sim.run(bad)
    with pytest.raises(ConfigError, match="kernels must be one of"):
        BpuSimulator(prog, kernels="gpu")


class _Mystery(nn.Module):
    def forward(self, x):
        return x


def test_unsupported_node_is_named():
    q, _ = converted("hybrid", "bayes")
    node = next(n for n in q.graph.nodes if n.name == "identity_1")
    q.add_submodule("mystery", _Mystery())
    old = node.target
    node.target = "mystery"
    try:
        with pytest.raises(UnsupportedOpError, match=r"node 'identity_1' \(op 'identity', _Mystery\) in BPU "
                                                     r"partition bpu2"):
            lower_partition(q, "bpu2")
        lower_partition(q, "bpu0")  # other partitions still lower
    finally:
        node.target = old
    with pytest.raises(ConfigError, match="no BPU partition named 'cpu0'"):
        lower_partition(q, "cpu0")


def test_program_validation():
    with pytest.raises(ConfigError, match="unknown BPU op kind 'no_such_kind'"):
        BpuOp("no_such_kind", ["x"], "y", {})
    with pytest.raises(ConfigError, match="reads 'z' before it is defined"):
        BpuProgram("p", [ValueSpec("x", "f32")], [], [BpuOp("relu", ["z"], "y", {"out_dtype": "qint8",
                                                                                    "out_scale": 1.0})])
    with pytest.raises(ConfigError, match="not JSON-able"):
        BpuOp("relu", ["x"], "y", {"f": object()})


def test_input_channel_chunks_sum_in_int64_whatever_the_weight_sums_are_stored_in():
    """The linear layer keeps its |w| per input channel as int16 (2 bytes a weight instead of int64's
    8): the chunks' running sums must still be int64, or a chunk started from an int16 column wraps
    past 32767 and is taken as within the float32-exact limit (wrong GEMM results, no error)."""
    l1 = np.full((2, 900), 128, dtype=np.int16)  # 312 columns of 128 stay below 40000
    assert exact_chunks(l1, 1, 40000) == [(0, 312), (312, 624), (624, 900)]
    assert exact_chunks(l1.astype(np.int64), 1, 40000) == exact_chunks(l1, 1, 40000)


def test_an_int16_weight_is_left_as_it_is_by_the_simulator_it_builds():
    """A linear layer with int16 weights (``weight_dtype="qint16"``) and a qint16 input runs in the float-GEMM
    layer, which keeps ``|w|`` per input channel: computed from a copy (``w.to(torch.int16)`` is ``w`` itself,
    and an ``abs_`` on it turned the program's weights, shared with the converted model, into ``|w|``), in a
    type that holds ``|-32768|``.  The outputs equal the int64 reference."""
    t = Tiny(seed=0)
    x = t.input(torch.randint(-1000, 1001, (3, 8), generator=t.gen), 0.05, "qint16")
    w16 = torch.randint(-120, 121, (5, 8), generator=t.gen).to(torch.int16)
    w16[0, 0] = -(1 << 15)
    layer = qnn.QuantizedWeightLayer("linear", w16, rand_scales(t.gen, 5), None, 0.05, 0.5, "qint16", {}, None, None,
                                     name="fc")
    prog = lower_partition(t.build(t.call(layer, x, name="fc")), "bpu0")
    weight = next(o for o in prog.ops if o.kind == "linear").tensors["weight"]
    before = weight.clone()
    inputs = dict(zip([v.name for v in prog.inputs], t.inputs))
    want = ref.run_program(prog, {k: v.numpy() for k, v in inputs.items()})
    out = BpuSimulator(prog).run(inputs)
    assert weight.dtype == torch.int16 and torch.equal(weight, before)
    for spec in prog.outputs:
        got = out[spec.name].int_repr() if isinstance(out[spec.name], QTensor) else out[spec.name]
        assert np.array_equal(got.numpy().astype(np.int64), want[spec.name])


class _ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.c2(torch.relu(self.c1(x))), 1))


@pytest.mark.parametrize("march", ["bayes", "nash"])
def test_int16_weights_under_int8_activations_run_on_the_float_gemms(march):
    """``weight_dtype="qint16"`` with int8 activations: the fast conv / linear must not hand the int16
    weights to the int8 GEMMs (``torch._int_mm`` refused them with a RuntimeError from inside torch when the
    model ran; oneDNN's int8 conv took them wrapped to int8 and answered wrong without an error); every kernel
    configuration gives the converted model's integers exactly, at batch 1 and 3."""
    import qcompiler
    from qcompiler.quantization.qconfig import get_default_calib_qconfig

    model = _ConvLinear().eval()
    calib = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cm = qcompiler.compile(model, calib[0], march=march, calib_data=calib, progress=False,
                           qconfig_dict={"": get_default_calib_qconfig(weight_dtype="qint16")})
    weights = [m.q_weight for m in cm.converted.modules() if isinstance(m, qnn.QuantizedWeightLayer)]
    assert len(weights) == 3 and all(w.dtype == torch.int16 for w in weights)
    programs = lower_bpu_partitions(cm.converted)
    for batch in (1, 3):
        x = torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(10 + batch))
        with torch.no_grad():
            want = cm.converted(x)
            assert torch.equal(cm(x), want)
            for cfg in CONFIGS:  # oneDNN's int8 conv wrapped the int16 weights to int8: a wrong answer
                assert torch.equal(Runtime.simulated(cm.converted, programs, **cfg)(x), want), cfg


def test_an_int16_input_takes_one_float64_gemm_not_hundreds_of_float32_chunks():
    """float32 is exact below 2**24: an int16 input (|x| <= 32768) leaves each chunk a few input channels
    of an int8 weight, so a 768-wide linear became ~200 GEMMs; one float64 GEMM is exact and faster. An
    int8 input keeps float32 in at most two chunks, and no exact float form means no plan at all."""
    from qcompiler.backends.bpu.sim.gemm import MAX_F32_CHUNKS, float_plan

    w = torch.randint(-127, 128, (64, 768), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    l1 = w.to(torch.int64).abs().numpy()
    row = int(l1.sum(axis=1).max())
    assert float_plan(l1, row, 1 << 15, "f32") == (torch.float64, ((0, 768),))
    dtype, chunks = float_plan(l1, row, 1 << 7, "f32")
    assert dtype == torch.float32 and len(chunks) <= MAX_F32_CHUNKS
    assert float_plan(l1, row, 1 << 7, "f64") == (torch.float64, ((0, 768),))
    assert float_plan(l1, row, 1 << 45, "f32") is None


@pytest.mark.skipif(not __import__("qcompiler.backends.bpu.sim.gemm", fromlist=["x"]).int8_gemm_available(),
                    reason="torch._int_mm is not exact here: the int16 x int8 split has no int8 GEMM to run on")
@pytest.mark.parametrize("seed", range(8))
def test_an_int16_input_on_int8_weights_splits_into_two_exact_int8_gemms(seed):
    """nash's LayerNorm outputs are int16 and feed int8-weight linears: the fast layer splits each input into
    its high and low bytes, two int8 GEMMs (``_FastLinear._split16``), instead of one float64 GEMM. Bit for bit
    the int64 reference, over random shapes, the int16 extremes (-32768, 32767, around the byte edges) and
    weights of -128 and 127, with and without bias."""
    from qcompiler.backends.bpu.sim.fast_linear import _FastLinear

    t = Tiny(seed=seed)
    g = t.gen
    B, K, O = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (6, 300, 40))
    ints = torch.randint(-(1 << 15), 1 << 15, (B, K), generator=g)
    edges = torch.tensor([-(1 << 15), (1 << 15) - 1, -1, 0, 255, 256, -256, -257, 127, -128])
    flat_ints = ints.view(-1)
    flat_ints[:min(len(edges), flat_ints.numel())] = edges[:flat_ints.numel()]
    x = t.input(ints, 0.01, "qint16")
    w = torch.randint(-128, 128, (O, K), generator=g).to(torch.int8)
    w[0, :min(K, 4)] = torch.tensor([-128, 127, -128, 127])[:min(K, 4)]
    bias = torch.randint(-1000, 1000, (O,), generator=g).float() * 0.01 if seed % 2 else None
    layer = qnn.QuantizedWeightLayer("linear", w, rand_scales(g, O), bias, 0.01, 0.5, "qint16", {}, None, None,
                                     name="fc")
    prog = lower_partition(t.build(t.call(layer, x, name="fc")), "bpu0")
    inputs = dict(zip([v.name for v in prog.inputs], t.inputs))
    want = ref.run_program(prog, {k: v.numpy() for k, v in inputs.items()})
    sim = BpuSimulator(prog, int8_gemm=True, native=False)
    kernels = [fn for fn, *_ in sim._steps if isinstance(fn, _FastLinear)]
    assert len(kernels) == 1 and kernels[0].split16  # the split path ran, not the float64 GEMM
    out = sim.run(inputs)
    for spec in prog.outputs:
        got = out[spec.name].int_repr() if isinstance(out[spec.name], QTensor) else out[spec.name]
        assert np.array_equal(got.numpy().astype(np.int64), want[spec.name])
