"""The bilinear resize, nearest resize and cat as plan steps (``qc_resize_nhwc_*_step``,
``qc_nearest_nhwc_*_step``, ``qc_cat_*_step`` in kernels.c; ``plan_step`` of the simulator's kernels):
run through ``NativeSteps`` with every step cut into chunks (min_work 0) at 1 and 2 parts, each equals
the op-by-op call and the fixed_point reference kernel, torch.equal, over random shapes, sizes, scales,
dtypes and layouts; where the op-by-op call is not that native pass (inexact bilinear taps, a layout the
step does not read) there is no step, and a program with such an op still runs exactly, op by op for it.
zoo unet's plan is one native segment between its quantize and dequantize."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bpu_reference import Tiny, geometry, weight_layer
from test_native_plan import _converted
from test_native_resize import _input, _spec, cases

import qcompiler.backends.bpu.native.plan as plan_mod
from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.native.gemm import gemm_available
from qcompiler.backends.bpu.native.kernels import BilinearResize, nearest_nhwc_step, nearest_taps, requant_columns_step
from qcompiler.backends.bpu.native.plan import NativeSteps
from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.backends.bpu.sim.registry import FAST, REFERENCE, KernelSpec
from qcompiler.errors import ConfigError
from qcompiler.native import build
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp
from qcompiler.runtime import Runtime

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
needs_native = pytest.mark.skipif(not build.native_enabled(), reason="native kernels are off on this machine")
_ST = {"qint8": torch.int8, "qint16": torch.int16}


def _run_cut(spec, parts: int, omp: bool) -> None:
    """The step alone in a plan, every step cut into chunks (min_work 0), run twice (a plan reruns on
    its buffers), on torch's team or (omp False) the native pool."""
    steps = NativeSteps([spec])
    real = plan_mod.parallel_entry
    if not omp:
        plan_mod.parallel_entry = lambda: None
    try:
        for _ in range(2):
            steps.run(parts, 0)
    finally:
        plan_mod.parallel_entry = real


def _check_step(made, want: torch.Tensor, call: torch.Tensor, parts: int, omp: bool) -> None:
    """``made`` (a plan_step's result buffer and step), cut and run: the reference's values, in the
    op-by-op call's layout (what the next op's step reads)."""
    out, spec = made
    out.fill_(77)
    _run_cut(spec, parts, omp)
    assert torch.equal(out, want) and out.stride() == call.stride()


@needs_native
@SETTINGS
@given(cases(), st.integers(1, 3), st.booleans())
def test_bilinear_step_equals_the_call_and_the_reference(c, parts, omp):
    args = (c["size"], c["align"], c["in_dtype"], c["out_dtype"], c["in_scale"], c["out_scale"])
    x = _input(c)
    fast = FAST["resize_bilinear"](_spec(*args))
    want = REFERENCE["resize_bilinear"](_spec(*args))(x)
    call = fast(x)
    assert torch.equal(call, want)
    made = fast.plan_step(x)
    # a step exactly where the call is one qc_resize_nhwc_* pass: exact taps, channels-last memory
    assert (made is not None) == (fast.kernel.exact_for(x) and BilinearResize._layout(x) == "nhwc")
    if made is not None:
        _check_step(made, want, call, parts, omp)


@st.composite
def cat_cases(draw):
    layout = draw(st.sampled_from(["nhwc", "nhwc", "nchw", "mixed"]))
    k = draw(st.integers(1 if layout != "mixed" else 2, 4))
    dim = 1 if layout != "nchw" else draw(st.sampled_from([1, 2, 3, -1]))
    N, H, W = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    along = [draw(st.sampled_from([1, 3, 8, 16, 17, 32, 64])) for _ in range(k)]
    in_dtypes = [draw(st.sampled_from(["qint8", "qint8", "qint16"])) for _ in range(k)]
    # scales: in / out ratios of any significand, a tie-making 1/2, a copy (1), or far out of range
    kinds = [draw(st.sampled_from(["any", "half", "one", "big"])) for _ in range(k)]
    return dict(layout=layout, dim=dim, N=N, H=H, W=W, along=along, in_dtypes=in_dtypes, kinds=kinds,
                out_dtype=draw(st.sampled_from(["qint8", "qint8", "qint16"])), out_scale=draw(st.floats(1e-3, 1.0)),
                any=[draw(st.floats(1e-4, 1.0)) for _ in range(k)], extremes=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def _cat_kernel_spec(c) -> tuple:
    out_scale = c["out_scale"]
    scales = [{"any": a, "half": out_scale / 2, "one": out_scale, "big": out_scale * 300}[kind]
              for a, kind in zip(c["any"], c["kinds"])]
    Ms, ns = zip(*(fp.requant_params(torch.tensor(s / out_scale, dtype=torch.float64), mult_bits=31, max_shift=62)
                   for s in scales))
    names = [f"x{i}" for i in range(len(scales))]
    op = BpuOp("cat", names, "y", {"dim": c["dim"], "out_dtype": c["out_dtype"], "out_scale": out_scale,
                                   "out_axis": None},
               {"M": torch.tensor([int(m) for m in Ms]), "n": torch.tensor([int(n) for n in ns])})
    specs = [ValueSpec(nm, d, s) for nm, d, s in zip(names, c["in_dtypes"], scales)]
    return KernelSpec(op, specs, "prog/y", Workspace(), False, native=True)


def _cat_inputs(c) -> list:
    g = torch.Generator().manual_seed(c["seed"])
    xs = []
    for i, (n, dt) in enumerate(zip(c["along"], c["in_dtypes"])):
        shape = [c["N"], 3, c["H"], c["W"]]
        shape[c["dim"] % 4] = n
        info = torch.iinfo(_ST[dt])
        if c["extremes"]:
            x = torch.where(torch.rand(shape, generator=g) < 0.5, info.min, info.max)
        else:
            x = torch.randint(info.min, info.max + 1, shape, generator=g)
        x = x.to(_ST[dt])
        nhwc = c["layout"] == "nhwc" or (c["layout"] == "mixed" and i % 2 == 0)
        xs.append(x.contiguous(memory_format=torch.channels_last) if nhwc else x.contiguous())
    return xs


@needs_native
@SETTINGS
@given(cat_cases(), st.integers(1, 3), st.booleans())
def test_cat_step_equals_the_call_and_the_reference(c, parts, omp):
    k = _cat_kernel_spec(c)
    xs = _cat_inputs(c)
    fast = FAST["cat"](k)
    want = REFERENCE["cat"](k)(*xs)
    call = fast(*xs)
    assert torch.equal(call, want)
    made = fast.plan_step(*xs)
    channels_last = all(x.is_contiguous(memory_format=torch.channels_last) for x in xs)
    contiguous = all(x.is_contiguous() for x in xs)
    # a step exactly where the call is the native passes on the inputs as they lie
    assert (made is not None) == (channels_last or contiguous), c["layout"]
    if made is not None:
        _check_step(made, want, call, parts, omp)


@st.composite
def nearest_cases(draw):
    kind = draw(st.sampled_from(["one", "any", "half", "big"]))
    in_dtype = draw(st.sampled_from(["qint8", "qint8", "qint16"]))
    in_scale = {"any": draw(st.floats(1e-4, 1.0)), "half": 0.5, "big": 300.0, "one": 0.25}[kind]
    out_scale = {"any": draw(st.floats(1e-4, 1.0)), "half": 1.0, "big": 0.01, "one": 0.25}[kind]
    return dict(N=draw(st.integers(1, 2)), C=draw(st.sampled_from([2, 3, 8, 16, 64])), H=draw(st.integers(1, 12)),
                W=draw(st.integers(1, 12)), size=(draw(st.integers(1, 30)), draw(st.integers(1, 30))),
                in_dtype=in_dtype, in_scale=in_scale, out_scale=out_scale,
                layout=draw(st.sampled_from(["nhwc", "nhwc", "nchw"])), extremes=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def _nearest_spec(c) -> KernelSpec:
    op = BpuOp("resize_nearest", ["x"], "y", {"size": list(c["size"]), "in_scale": c["in_scale"],
                                              "out_dtype": "qint8", "out_scale": c["out_scale"], "out_axis": None})
    return KernelSpec(op, [ValueSpec("x", c["in_dtype"], c["in_scale"])], "prog/y", None, False, native=True)


@needs_native
@SETTINGS
@given(nearest_cases(), st.integers(1, 3), st.booleans())
def test_nearest_step_equals_the_call_and_the_reference(c, parts, omp):
    x = _input({**c, "out_dtype": "qint8"})
    fast = FAST["resize_nearest"](_nearest_spec(c))
    want = REFERENCE["resize_nearest"](_nearest_spec(c))(x)
    call = fast(x)
    assert torch.equal(call, want)
    made = fast.plan_step(x)
    Ho, Wo = c["size"]
    assert (made is not None) == (c["layout"] == "nhwc" and c["H"] * c["W"] > 1 and Ho * Wo > 1)
    if made is not None:
        _check_step(made, want, call, parts, omp)


@pytest.mark.parametrize("n_in,n_out", [(4, 8), (8, 4), (5, 7), (7, 5), (3, 11), (13, 3), (1, 5), (6, 6)])
def test_nearest_taps_are_torch_indices(n_in, n_out):
    """The source index per output of the 2-d nearest resize, read off by resizing the identity."""
    eye = torch.eye(n_in, dtype=torch.float64).reshape(1, n_in, n_in, 1)
    picked = torch.nn.functional.interpolate(eye, size=(n_out, 1), mode="nearest")[0, :, :, 0]  # (n_in, n_out)
    assert torch.equal(picked.argmax(0).to(torch.int32), nearest_taps(n_in, n_out))


def _unet_like(size_up: tuple):
    """conv -> bilinear resize to ``size_up`` and nearest resize to it -> cat of the two -> conv, on
    channels-last values between native convs (the unet decoder's pattern)."""
    t = Tiny(seed=41)
    x = t.rand_input((2, 16, 6, 5), 0.05)
    g = t.gen
    c1 = t.call(weight_layer("conv2d", torch.randint(-127, 128, (24, 16, 3, 3), generator=g),
                             torch.rand(24, generator=g) * 0.02 + 0.001, torch.randn(24, generator=g), 0.05, 0.1,
                             geometry=geometry(1, 1), act="relu", name="c1"), x, name="c1")
    up = t.call(qnn.QuantizedResize("bilinear", 0.1, 0.08, "qint8", size_up, False), c1, name="up")
    near = t.call(qnn.QuantizedResize("nearest", 0.1, 0.07, "qint8", size_up, None), c1, name="near")
    cat = t.call(qnn.QuantizedCat([0.08, 0.07], 0.09, "qint8"), [up, near], dim=1, name="cat")
    c2 = t.call(weight_layer("conv2d", torch.randint(-127, 128, (8, 48, 3, 3), generator=g),
                             torch.rand(8, generator=g) * 0.02 + 0.001, torch.randn(8, generator=g), 0.09, 0.2,
                             geometry=geometry(1, 1), name="c2"), cat, name="c2")
    prog = lower_partition(t.build(c2), "bpu0")
    return prog, {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)}


needs_gemm = pytest.mark.skipif(not gemm_available(), reason="no native int8 GEMM on this machine")


@needs_gemm
@pytest.mark.parametrize("size_up,python", [((12, 10), set()), ((9, 7), {"up"})])
def test_resizes_and_cat_join_the_native_segment(size_up, python):
    """With exact bilinear taps (factor 2) the convs, both resizes and the cat are one native segment;
    with taps that are not exact (6 -> 9) the bilinear resize runs op by op (its reference) between two
    native segments.  Either way every run equals the fixed_point kernels, at 1 and 2 parts."""
    prog, inputs = _unet_like(size_up)
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    sim = BpuSimulator(prog, native=True, plan=True)
    for _ in range(2):  # built while running, then run
        got = sim.run(inputs)
        assert got.keys() == ref.keys() and all(torch.equal(got[k].int_repr(), ref[k]) for k in ref)
    (plan,) = sim._plans.by_shape.values()
    in_python = {r[2] for seg in plan.segments if isinstance(seg, list) for r in seg}
    quantize = {op.output for op in prog.ops if op.kind == "quantize"}
    assert in_python - quantize == python
    assert sum(isinstance(seg, tuple) for seg in plan.segments) == 1 + len(python)  # (NativeSteps, names)
    assert plan.native_ops == len(prog.ops) - len(quantize) - len(python)


@needs_gemm
def test_unet_runs_as_one_native_segment():
    conv, x = _converted("unet", 48)
    runner = Runtime.simulated(conv, threads=1)
    with torch.no_grad():
        assert torch.equal(runner(x), conv(x))
    (sim,) = runner.simulators.values()
    (plan,) = sim._plans.by_shape.values()
    kinds = {op.output: op.kind for op in sim.program.ops}
    shape = [[kinds[r[2]] for r in seg] if isinstance(seg, list) else "native" for seg in plan.segments]
    assert shape == [["quantize"], "native", ["dequantize"]]
    assert plan.native_ops == len(sim.program.ops) - 2


@needs_native
def test_step_builders_refuse_misuse():
    x = torch.zeros(1, 4, 3, 3, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
    out = torch.empty(1, 6, 6, 4, dtype=torch.int8).permute(0, 3, 1, 2)
    hs, ws = nearest_taps(3, 6), nearest_taps(3, 6)
    with pytest.raises(ConfigError, match="channels-last"):
        nearest_nhwc_step(x.contiguous(), hs, ws, None, -128, 127, out)
    with pytest.raises(ConfigError, match="outside"):
        nearest_nhwc_step(x, hs + 1, ws, None, -128, 127, out)
    with pytest.raises(ConfigError, match="one dtype"):
        nearest_nhwc_step(x.to(torch.int16), hs, ws, None, -128, 127, out)
    src, dst = torch.zeros(4, 3, dtype=torch.int16), torch.zeros(4, 5, dtype=torch.int8)
    with pytest.raises(ConfigError, match="do not fit int32"):
        requant_columns_step([src, src[:, :2].contiguous()], dst, [(1 << 20, 0, True), (1, 0, None)], -128, 127)
    with pytest.raises(ConfigError, match="do not fill"):
        requant_columns_step([src], dst, [(1, 0, None)], -128, 127)
    resize = BilinearResize((6, 6), False, 1.0, -128, 127, torch.int8)
    with pytest.raises(ConfigError, match="channels-last"):
        resize.step(x, out.contiguous())
    assert resize.step(x.contiguous(), out) is None  # NCHW memory: the planes kernel, op by op
    overflow = {"N": 1, "C": 4, "H": 3, "W": 3, "size": (6, 6), "in_dtype": "qint8", "in_scale": 1e300,
                "out_scale": 1e-300}  # a ratio that overflows to inf (0 * inf is NaN): torch's resize, op by op
    assert FAST["resize_nearest"](_nearest_spec(overflow)).plan_step(x) is None
