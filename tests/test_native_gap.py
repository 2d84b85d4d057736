"""The native global average pool (qc_gap_nhwc_* in backends/bpu/native/gap.c): the channels-last sums and their
requantization against the int64 reference (hypothesis, torch.equal), called directly and as plan
steps cut over threads; the simulator's pool kernel (its op-by-op call and its plan step) against
the ``fixed_point`` kernel, a channel-major input left to Python and still exact; and the layout ops
after it kept in a plan as views of its buffer (a copying one is not)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bpu_reference import Tiny

from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.native.kernels import global_avg_pool_nhwc, global_avg_pool_nhwc_step
from qcompiler.backends.bpu.native.plan import NativeSteps
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.bpu.sim.layout import _LAYOUT, _LayoutKernel
from qcompiler.backends.bpu.sim.plan import ProgramPlan
from qcompiler.errors import ConfigError
from qcompiler.native import build
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
needs_native = pytest.mark.skipif(not build.native_enabled(), reason="native kernels are off on this machine")
_T = {"qint8": torch.int8, "qint16": torch.int16}
_FILLS = ("random", "min", "max", "extremes")


def _ints(shape, dtype: torch.dtype, fill: str, g: torch.Generator) -> torch.Tensor:
    """(N, C, H, W) values of ``dtype`` in channels-last memory: random, all the minimum, all the
    maximum, or each the minimum or the maximum (the int32 sums' and the int16 lanes' extremes)."""
    lo, hi = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    N, C, H, W = shape
    nhwc = (N, H, W, C)
    if fill == "random":
        v = torch.randint(lo, hi + 1, nhwc, generator=g)
    elif fill == "extremes":
        v = torch.where(torch.randint(0, 2, nhwc, generator=g).bool(), lo, hi)
    else:
        v = torch.full(nhwc, lo if fill == "min" else hi)
    return v.to(dtype).permute(0, 3, 1, 2)


@st.composite
def gap_cases(draw):
    hw = draw(st.one_of(st.tuples(st.integers(1, 9), st.integers(1, 9)),
                        st.sampled_from([(1, 1), (16, 16), (1, 257), (16, 32), (23, 23), (7, 7)])))
    C = draw(st.one_of(st.integers(1, 70), st.sampled_from([31, 32, 33, 64, 255, 256, 257, 300, 513])))
    in_dtype, out_dtype = draw(st.sampled_from(list(_T.values()))), draw(st.sampled_from(list(_T.values())))
    bound = (1 << (8 * in_dtype.itemsize - 1)) * hw[0] * hw[1]
    m_max = ((1 << 62) - 1) // bound
    M = draw(st.one_of(st.integers(-m_max, m_max), st.sampled_from([m_max, -m_max, 0, 1])))
    info = torch.iinfo(out_dtype)
    lo, hi = sorted(draw(st.tuples(st.integers(info.min, info.max), st.integers(info.min, info.max))))
    if draw(st.booleans()):
        lo, hi = info.min, info.max
    return dict(N=draw(st.integers(1, 3)), C=C, H=hw[0], W=hw[1], in_dtype=in_dtype, out_dtype=out_dtype,
                M=M, n=draw(st.integers(0, 62)), lo=lo, hi=hi, fill=draw(st.sampled_from(_FILLS)),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def _reference(x: torch.Tensor, c: dict) -> torch.Tensor:
    """fixed_point's exact int64 sum and requantization, clamped to [lo, hi] within the output type."""
    out = "qint8" if c["out_dtype"] == torch.int8 else "qint16"
    return fp.requantize(x.to(torch.int64).sum(dim=(-2, -1)), c["M"], c["n"], out).clamp(c["lo"], c["hi"]).to(
        c["out_dtype"])


@needs_native
@SETTINGS
@given(gap_cases())
def test_the_native_pool_equals_the_int64_reference(c):
    """Directly, and as a plan step at 1 and 2 parts with every step cut (min_work 0), run twice on its
    buffers: every value the reference's, nothing written past the output."""
    x = _ints((c["N"], c["C"], c["H"], c["W"]), c["in_dtype"], c["fill"], torch.Generator().manual_seed(c["seed"]))
    want = _reference(x, c)
    args = (c["M"], c["n"], c["lo"], c["hi"])
    got = global_avg_pool_nhwc(x, *args, torch.full((c["N"], c["C"]), 77, dtype=c["out_dtype"]))
    assert torch.equal(got, want)
    for parts in (1, 2):
        big = torch.full((c["N"] + 1, c["C"]), 77, dtype=c["out_dtype"])
        out = big[:c["N"]]
        steps = NativeSteps([global_avg_pool_nhwc_step(x, *args, out)])
        for _ in range(2):
            steps.run(parts, 0)
        assert torch.equal(out, want), parts
        assert bool((big[c["N"]] == 77).all())


@needs_native
def test_the_largest_proven_int16_sums_are_exact():
    """65535 positions of -32768 sum to -2147450880 (just inside int32), and the multiplier is the
    largest whose products stay below 2**62."""
    x = torch.full((1, 65535, 3), -32768, dtype=torch.int16).reshape(1, 255, 257, 3).permute(0, 3, 1, 2)
    x[0, 1] = 32767
    for M, n in ((((1 << 62) - 1) // (32768 * 65535), 62), (1, 0), (-3, 5)):
        c = dict(M=M, n=n, lo=-32768, hi=32767, out_dtype=torch.int16)
        got = global_avg_pool_nhwc(x, M, n, -32768, 32767, torch.empty((1, 3), dtype=torch.int16))
        assert torch.equal(got, _reference(x, c)), (M, n)


@needs_native
def test_the_native_pool_refuses_what_it_cannot_do_exactly():
    x = torch.zeros((2, 3, 4, 4), dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    out = torch.empty((2, 3), dtype=torch.int8)
    with pytest.raises(ConfigError, match="channels-last"):
        global_avg_pool_nhwc(torch.zeros((2, 3, 4, 4), dtype=torch.int8), 1, 0, -128, 127, out)
    with pytest.raises(ConfigError, match="channels-last"):
        global_avg_pool_nhwc(x.to(torch.int32), 1, 0, -128, 127, out)
    with pytest.raises(ConfigError, match="shape"):
        global_avg_pool_nhwc(x, 1, 0, -128, 127, torch.empty((2, 4), dtype=torch.int8))
    with pytest.raises(ConfigError, match="shift"):
        global_avg_pool_nhwc(x, 1, 63, -128, 127, out)
    with pytest.raises(ConfigError, match="multiplier"):
        global_avg_pool_nhwc(x, (1 << 62) // (128 * 16), 0, -128, 127, out)
    with pytest.raises(ConfigError, match="clamp"):
        global_avg_pool_nhwc(x, 1, 0, -129, 127, out)
    wide = torch.zeros((1, 1, 256, 256), dtype=torch.int16)  # 2**15 * 2**16 = 2**31: past int32
    with pytest.raises(ConfigError, match="int32"):
        global_avg_pool_nhwc(wide, 1, 0, -128, 127, torch.empty((1, 1), dtype=torch.int8))
    global_avg_pool_nhwc(x, (1 << 62) // (128 * 16) - 1, 0, -128, 127, out)  # the bound itself is fine


def _pool_kernels(in_dtype: str, out_dtype: str, keepdim: bool, in_scale: float, out_scale: float):
    """The simulator's global pool kernel (native) and the fixed_point one, for one pool op."""
    t = Tiny(seed=3)
    x = t.rand_input((1, 2, 2, 2), in_scale, in_dtype)
    pool = t.call(qnn.QuantizedAvgPool(in_scale, out_scale, out_dtype, keepdim=keepdim), x, name="gap")
    prog = lower_partition(t.build(pool), "bpu0")

    def kernel(sim):
        (fn,) = [fn for fn, _, out, _ in sim._steps if out == "gap"]
        return fn
    return kernel(BpuSimulator(prog, native=True)), kernel(BpuSimulator(prog, kernels="fixed_point"))


@needs_native
@settings(SETTINGS, max_examples=80)
@given(st.integers(1, 3), st.one_of(st.integers(1, 70), st.sampled_from([257, 1280])), st.integers(1, 8),
       st.integers(1, 8), st.sampled_from(["qint8", "qint16"]), st.sampled_from(["qint8", "qint16"]), st.booleans(),
       st.sampled_from([2.0 ** -4, 0.0173, 1.0]), st.sampled_from([0.03, 2.0 ** -9, 7.5, 1e-5]),
       st.sampled_from(_FILLS), st.integers(0, 2 ** 31 - 1))
def test_the_simulators_pool_and_its_plan_step_equal_the_reference(N, C, H, W, in_dtype, out_dtype, keepdim, s_in,
                                                                   s_out, fill, seed):
    """The op-by-op call and the plan step (at 1 and 2 parts, cut) give the fixed_point kernel's values,
    in the layout today's torch-summed path returns (the same shape and strides); a channel-major
    input has no plan step (where its memory is not also channels-last) and is exact op by op."""
    gap, ref = _pool_kernels(in_dtype, out_dtype, keepdim, s_in, s_out)
    x = _ints((N, C, H, W), _T[in_dtype], fill, torch.Generator().manual_seed(seed))
    want = ref(x)
    got = gap(x)
    torch_summed = gap(x.contiguous())  # channel-major: torch sums in place, Requant requantizes
    assert torch.equal(got, want) and torch.equal(torch_summed, want)
    assert got.stride() == torch_summed.stride()
    made = gap.plan_step(x)
    assert made is not None
    value, spec = made
    for parts in (1, 2):
        value.fill_(77)
        NativeSteps([spec]).run(parts, 0)
        assert torch.equal(value, want) and value.stride() == got.stride(), parts
    if C > 1 and H * W > 1:
        assert gap.plan_step(x.contiguous()) is None


@needs_native
def test_a_pool_the_native_pass_cannot_take_is_not_planned():
    """Past the proven int32 sums (int16 over 256 x 257 positions) or on another storage than the
    declared one, the kernel has no plan step and the call is the exact reference path (which checks
    the sums: an overflow is reported, not wrapped)."""
    gap, ref = _pool_kernels("qint16", "qint16", True, 1.0, 1.0)
    x = torch.full((1, 3, 256, 257), -32768, dtype=torch.int16).contiguous(memory_format=torch.channels_last)
    assert gap.plan_step(x) is None
    with pytest.raises(fp.AccumulatorOverflow):
        gap(x)
    small = _ints((1, 3, 256, 257), torch.int16, "random", torch.Generator().manual_seed(2)) // 4
    assert gap.plan_step(small) is None
    assert torch.equal(gap(small), ref(small))
    y = small[:, :, :2, :2].contiguous(memory_format=torch.channels_last).to(torch.int32)
    assert gap.plan_step(y) is None  # not the declared storage
    assert torch.equal(gap(y), ref(y))


def _plan_case(keepdim: bool, layout_ops) -> tuple:
    """A pool then ``layout_ops`` as a program's steps for ProgramPlan, the fixed_point chain beside them."""
    gap, ref = _pool_kernels("qint8", "qint8", keepdim, 2.0 ** -4, 0.0173)
    steps = [(gap, ("x",), "v0", ())]
    for i, op in enumerate(layout_ops):
        steps.append((op, (f"v{i}",), f"v{i + 1}", (f"v{i}",)))
    last = f"v{len(layout_ops)}"

    def want(x):
        v = ref(x)
        for op in layout_ops:
            v = op(v)
        return v
    return steps, last, want


@needs_native
@pytest.mark.parametrize("channels_last", [True, False])
def test_a_plan_runs_the_pool_natively_only_on_channels_last_memory(channels_last):
    steps, last, want = _plan_case(False, [])
    g = torch.Generator().manual_seed(5)
    xs = [_ints((2, 40, 7, 7), torch.int8, "random", g) for _ in range(3)]
    if not channels_last:
        xs = [x.contiguous() for x in xs]
    plan, env = ProgramPlan.build(steps, (last,), {"x": xs[0]}, 1)
    assert torch.equal(env[last], want(xs[0]))
    if not channels_last:
        assert plan is None  # the only op runs in Python: no plan
        return
    assert plan.native_ops == 1
    first = env[last]
    for x in xs[1:]:
        for parts in (1, 2):
            assert torch.equal(plan.run({"x": x}, parts)[last], want(x))
    assert torch.equal(first, want(xs[0]))  # an output is not the plan's buffer


@needs_native
def test_layout_ops_after_the_pool_stay_in_the_plan_as_views():
    """flatten and identity after a keepdim pool are views of its buffer: one native segment, no Python
    step, the output cloned out of the buffer; a reshape of permuted memory is a copy and stays a Python
    step (a frozen copy would keep the first call's values)."""
    flatten = _LayoutKernel(_LAYOUT["flatten"]({"start_dim": 1, "end_dim": -1}))
    identity = _LayoutKernel(_LAYOUT["identity"]({}))
    permute = _LayoutKernel(_LAYOUT["permute"]({"dims": [1, 0, 2, 3]}))
    reshape = _LayoutKernel(_LAYOUT["reshape"]({"shape": [-1]}))
    g = torch.Generator().manual_seed(9)
    xs = [_ints((3, 20, 5, 5), torch.int8, "random", g) for _ in range(3)]
    for ops, n_views in (([flatten, identity], 2), ([permute, reshape], 1)):
        steps, last, want = _plan_case(True, ops)
        plan, env = ProgramPlan.build(steps, (last,), {"x": xs[0]}, 1)
        assert torch.equal(env[last], want(xs[0]))
        views = [f"v{i + 1}" for i in range(len(ops)) if f"v{i + 1}" in plan.native_values]
        assert len(views) == n_views, ops
        python = [rec[2] for seg in plan.segments if isinstance(seg, list) for rec in seg]
        assert python == [f"v{i + 1}" for i in range(n_views, len(ops))]
        assert isinstance(plan.segments[0], tuple)  # (NativeSteps, names)
        first = env[last]
        for x in xs[1:]:
            got = plan.run({"x": x}, 1)[last]
            assert torch.equal(got, want(x))
            assert got.untyped_storage().data_ptr() not in plan.storages
        assert torch.equal(first, want(xs[0]))
    x = xs[0].contiguous()
    assert reshape.plan_view(x.permute(1, 0, 2, 3)) is None and reshape.plan_view(x) is not None
