"""The simulator's plans (sim/plan.py, qc_run_plan in bpu/native/plan.c): native layers built once as
C steps on fixed buffers and run back to back, at 2 threads on torch's OpenMP team with their rows cut
into chunks.  Steps cut over threads equal the direct calls bit for bit over random geometries; whole
zoo models run planned equal the op-by-op run and the converted model, on the plan's first call (built
while running) and later ones, at 1 and 2 threads, for two input shapes; outputs do not alias between
calls; a plan whose values change shape is dropped, not trusted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_native_gemm import _OUT, SETTINGS, _gemm_program, conv_case_tensors, conv_cases, needs_gemm
from test_native_kernels import dw_case_tensors, dw_cases

import qcompiler.backends.bpu.native.plan as plan_mod
from qcompiler import zoo
from qcompiler.backends.bpu.native.gemm import Int8Gemm
from qcompiler.backends.bpu.native.kernels import DepthwiseConv, max_pool_nhwc, max_pool_nhwc_step
from qcompiler.backends.bpu.native.plan import ENV_PLAN, MIN_WORK, NativeSteps
from qcompiler.backends.bpu.sim import plan as program_plan
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.errors import ConfigError
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization import prepare_calibration_fx, prepare_qat_fx, set_state
from qcompiler.quantization.convert import convert_fx
from qcompiler.runtime import Runtime


@needs_gemm
@SETTINGS
@given(conv_cases(), dw_cases(), st.integers(1, 3), st.sampled_from([0, 64, MIN_WORK]), st.booleans())
def test_steps_cut_over_threads_equal_the_direct_calls(cc, dc, parts, min_work, omp):
    """A GEMM conv, a depthwise conv and a max pool as the steps of one plan, run at 1-3 parts, every
    step cut (min_work 0) or only the large ones, on torch's team or the native pool: each output is
    the direct call's, bit for bit."""
    k, xl, ol, _ = conv_case_tensors({**cc, "extreme": False})
    x, w, bias, M, n, lo, hi, _ = dw_case_tensors(dc)
    dw = DepthwiseConv(w, bias, dc["stride"], dc["padding"], dc["dilation"], M, n, lo, hi, _OUT[dc["out"]])
    xd = x.permute(0, 2, 3, 1).contiguous()
    geo, (N, Ho, Wo) = k.conv_geometry(tuple(xl.shape), cc["k"], cc["stride"], cc["padding"], cc["dilation"])
    conv_out = torch.full((N, Ho, Wo, k.O), 77, dtype=k.out_dtype)
    want_conv = k.conv(xl, cc["k"], cc["stride"], cc["padding"], cc["dilation"], ol)
    want_dw = dw(xd)
    dw_out = torch.full_like(want_dw, 77)
    xp = x.contiguous(memory_format=torch.channels_last)  # the pool: a 3x3 window, stride 2, padding 1
    pool_hw = (fp.max_pool_out_size(x.shape[2], 3, 2, 1, 1, False), fp.max_pool_out_size(x.shape[3], 3, 2, 1, 1, False))
    want_pool = max_pool_nhwc(xp, (3, 3), (2, 2), (1, 1), (1, 1), pool_hw)
    pool_out = torch.full_like(want_pool, 77)
    specs = [k.step(xl, k.K, geo, conv_out, ol, 0, N * Ho * Wo), max_pool_nhwc_step(xp, (3, 3), (2, 2), (1, 1), (1, 1),
                                                                                 pool_out)]
    spec = dw.step(xd, dw_out)
    if spec is not None:  # (the scalar kernel has no step form: the simulator calls it)
        specs.append(spec)
    steps = NativeSteps(specs)
    if not omp:
        real = plan_mod.parallel_entry
        plan_mod.parallel_entry = lambda: None
    try:
        for _ in range(2):  # a plan runs again on its buffers
            steps.run(parts, min_work)
    finally:
        if not omp:
            plan_mod.parallel_entry = real
    assert torch.equal(conv_out, want_conv)
    assert torch.equal(pool_out, want_pool)
    if spec is not None:
        assert torch.equal(dw_out, want_dw)


def _converted(name: str, size: int):
    x = zoo.example_inputs(name, image_size=size)[0] if name != "unet" else zoo.example_inputs(name)[0]
    cal = prepare_calibration_fx(zoo.get(name), None, example_inputs=(x,), hybrid=True, march="bayes")
    cal.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):
            cal(torch.randn((2, *x.shape[1:]), generator=g))
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    return convert_fx(qat), x


@needs_gemm
@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18", "unet"])
def test_zoo_models_run_planned_equal_the_op_by_op_run(name, monkeypatch):
    conv, x = _converted(name, 48)
    g = torch.Generator().manual_seed(1)
    # (round, batch): each round new values of the same shapes, so a buffer left stale shows
    xs = {(r, b): x if (r, b) == (0, 1) else torch.randn((b, *x.shape[1:]), generator=g) for r in (0, 1) for b in (1, 2)}
    with torch.no_grad():
        want = {k: conv(v) for k, v in xs.items()}
    monkeypatch.setenv(ENV_PLAN, "0")
    flat = Runtime.simulated(conv, threads=1)
    assert not any(s._planned for s in flat.simulators.values())
    for k, v in xs.items():
        assert torch.equal(flat(v), want[k])
    monkeypatch.delenv(ENV_PLAN)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            runner = Runtime.simulated(conv, threads=t)
            assert all(s._planned for s in runner.simulators.values())
            first = runner(xs[0, 1])
            kept = first.clone()
            for k, v in xs.items():  # built while running, then run: batch 1, batch 2, and back, new values
                assert torch.equal(runner(v), want[k]), (t, k)
            assert torch.equal(first, kept)  # a later call did not write into an earlier output
            sim = next(iter(runner.simulators.values()))
            plans = [p for p in sim._plans.by_shape.values() if p is not None]
            assert plans and all(p.native_ops >= 5 for p in plans)
            # dead values' memory is reused: far less than one buffer per layer (unet's skip connections
            # keep four encoder values alive to the end)
            share = 0.8 if name == "unet" else 0.5
            for p in plans:
                every = sum(v.numel() * v.element_size() for v in p.native_values.values())
                assert p.buffer_bytes < every * share, (p.buffer_bytes, every)
            if name != "unet" and t == 1:  # the tail (pool, flatten, dropout's identity, linear) stays in C
                tail = [op.output for op in sim.program.ops if op.kind in ("global_avg_pool", "flatten", "identity",
                                                                           "linear")]
                for p in plans:
                    assert len(tail) >= 3 and all(o in p.native_values for o in tail), name
                    assert sum(isinstance(s, tuple) for s in p.segments) == 1, p.segments  # (NativeSteps, names)
    finally:
        torch.set_num_threads(threads)


@needs_gemm
def test_a_plan_whose_value_changes_shape_is_dropped():
    """A plan copies a Python op's value into the buffer a native step reads; a value of another shape
    (which copy_ would broadcast) stops the plan, and the call runs op by op, with a new plan after."""
    prog, inputs = _gemm_program("conv2d", True, "relu", 1, "qint8", 3)
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    sim = BpuSimulator(prog, native=True, plan=True)
    sim.run(inputs)
    (old,) = sim._plans.by_shape.values()
    assert old is not None
    # the quantize ops run in Python; the conv reads their values from buffers they are copied into
    records = [r for seg in old.segments if isinstance(seg, list) for r in seg if r[4] is not None]
    assert [r[2] for r in records] == [op.output for op in prog.ops if op.kind == "quantize"]
    records[0][4] = torch.empty((1,) * records[0][4].dim(), dtype=records[0][4].dtype)  # as if built for another shape
    checked = {spec.name: check(inputs[spec.name]) for spec, check in sim._in_checks}
    with pytest.raises(program_plan.StalePlan):
        old.run(dict(checked), 1)
    got = sim.run(inputs)
    (new,) = sim._plans.by_shape.values()
    assert new is not old and new is not None
    for k in ref:
        assert torch.equal(got[k].int_repr(), ref[k])


def test_plans_follow_the_environment_and_the_argument(monkeypatch):
    prog, _ = _gemm_program("linear", False, "relu", 1, "qint8", 1)
    monkeypatch.setenv(ENV_PLAN, "0")
    assert not BpuSimulator(prog)._planned
    monkeypatch.delenv(ENV_PLAN)
    assert not BpuSimulator(prog, plan=False)._planned
    assert not BpuSimulator(prog, kernels="fixed_point")._planned  # the reference kernels are never planned


@needs_gemm
def test_a_layer_is_a_plan_step_only_on_the_layout_its_kernel_reads():
    """The conv's step reads NHWC memory as it lies: given NCHW memory (which the op-by-op call would
    copy first) it is no step, and the plan copies the value into a channels-last buffer instead."""
    prog, inputs = _gemm_program("conv2d", False, None, 1, "qint8", 3)
    sim = BpuSimulator(prog, native=True, plan=True)
    (conv,) = [fn for fn, _, _, _ in sim._steps if hasattr(fn, "plan_step")]
    x = torch.randint(-128, 128, (2, 40, 7, 9), dtype=torch.int8)
    assert conv.plan_step(x) is None  # NCHW: a copy first, not one kernel call
    made = conv.plan_step(x.contiguous(memory_format=torch.channels_last))
    assert made is not None and made[0].shape == (2, 33, 7, 9)
    assert made[0].is_contiguous(memory_format=torch.channels_last)
    assert conv.plan_step(x.to(torch.int16)) is None  # not the int8 kernel's input: the reference runs it


@needs_gemm
@pytest.mark.parametrize("planned", [True, False])
def test_step_times_name_every_op_and_keep_the_result(planned):
    """The profile (``step_times``): every op's seconds by the value it makes, planned (native steps
    timed in C) or op by op, and the outputs unchanged."""
    prog, inputs = _gemm_program("conv2d", True, "relu", 1, "qint8", 3)
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    sim = BpuSimulator(prog, native=True, plan=planned)
    sim.run(inputs)  # (a plan is built on the first call)
    times: dict = {}
    sim.step_times = times
    got = sim.run(inputs)
    assert set(times) == {op.output for op in prog.ops} and all(t > 0 for t in times.values())
    for k in ref:
        assert torch.equal(got[k].int_repr(), ref[k])


class _TokenMixing(torch.nn.Module):
    """A linear over the transposed sequence axis (MLP-Mixer's token mixing): its input is a view whose
    rows are not contiguous, so a reshape would copy it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(24, 24)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).transpose(1, 2))


@needs_gemm
def test_a_linear_over_a_transposed_view_reads_each_calls_values():
    """A step must read its input's own memory on every call: never a copy made when the plan was
    built (which would repeat the first call's answer)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    cal = prepare_calibration_fx(_TokenMixing().eval(), None, example_inputs=(torch.randn(1, 24, 16),), hybrid=True,
                                 march="bayes")
    cal.eval()
    with torch.no_grad():
        for _ in range(3):
            cal(torch.randn((2, 24, 16), generator=g))
    qat = prepare_qat_fx(cal, hybrid=True)
    set_state(qat, "validation")
    qat.eval()
    conv = convert_fx(qat)
    runner = Runtime.simulated(conv, threads=1)
    assert all(s._planned for s in runner.simulators.values())
    for _ in range(3):  # built while running, then run twice on new values
        x = torch.randn((2, 24, 16), generator=g)
        with torch.no_grad():
            assert torch.equal(runner(x), conv(x))


@needs_gemm
def test_step_builders_refuse_what_the_kernels_cannot_read():
    """A step keeps raw pointers: a wrong layout, dtype or size is a ConfigError naming it, never a step."""
    x = torch.zeros(1, 8, 6, 6, dtype=torch.int8)
    out = torch.empty(1, 3, 3, 8, dtype=torch.int8).permute(0, 3, 1, 2)
    with pytest.raises(ConfigError, match="x must be .*channels-last"):
        max_pool_nhwc_step(x, (2, 2), (2, 2), (0, 0), (1, 1), out)  # NCHW memory
    xl = x.contiguous(memory_format=torch.channels_last)
    with pytest.raises(ConfigError, match="out must be"):
        max_pool_nhwc_step(xl, (2, 2), (2, 2), (0, 0), (1, 1), out.to(torch.int16))
    w = torch.ones(8, 1, 3, 3, dtype=torch.int8)
    dw = DepthwiseConv(w, None, (1, 1), (1, 1), (1, 1), torch.ones(8, dtype=torch.int64),
                       torch.full((8,), 4, dtype=torch.int64), -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="DepthwiseConv: out"):
        dw.step(xl.permute(0, 2, 3, 1), torch.empty(1, 5, 5, 8, dtype=torch.int8))  # the output is 6x6
    k = Int8Gemm(torch.ones(4, 8, dtype=torch.int8), None, torch.ones(4, dtype=torch.int64),
                 torch.full((4,), 4, dtype=torch.int64), -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="do not fit out"):
        k.step(torch.zeros(10, 8, dtype=torch.int8), 8, None, torch.empty(9, 4, dtype=torch.int8), None, 0, 10)
