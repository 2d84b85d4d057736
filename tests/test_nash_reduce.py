"""nash reductions over any dims (sum, mean, amax, amin): placement beside bayes, the fixed-point
kernel, and the converted module == BPU simulator (fast and fixed-point kernels) == integer ONNX
export in onnxruntime, bit for bit, over seeded random shapes, dims, keepdim and scales.

int16: module == simulator bit for bit; the ONNX export of an int16 graph is its float form (opset 11
has no int16 codes in this exporter, the input QuantizeLinear included), so it is not compared."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.bpu.program_check import check_program
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.quantization.qtensor import QTensor

sys.path.insert(0, str(Path(__file__).parent))
from test_export_exact import assert_export_is_compiled  # noqa: E402
from test_nash_table import placed  # noqa: E402


class Reduce(nn.Module):
    """A linear, then ``mode`` over ``dim`` (None: the no-dim call) as a torch function or a method."""

    def __init__(self, mode, dim, keepdim=False, method=False, features=8, **kw):
        super().__init__()
        self.lin = nn.Linear(features, features)
        self.mode, self.dim, self.keepdim, self.method, self.kw = mode, dim, keepdim, method, kw

    def forward(self, x):
        y = self.lin(x)
        if self.dim is None:
            return getattr(y, self.mode)(**self.kw)
        if self.method:
            return getattr(y, self.mode)(self.dim, keepdim=self.keepdim, **self.kw)
        return getattr(torch, self.mode)(y, dim=self.dim, keepdim=self.keepdim, **self.kw)


X = torch.randn(2, 3, 4, 8)


def where(model, x, march):
    """(placement, reason) of the model's one reduction node (named sum_1, amax, ... by the tracer)."""
    (row,) = [v for k, v in placed(model, x, march).items() if k.startswith(model.mode)]
    return row


# ----------------------------------------------------------------------------------------- placement


@pytest.mark.parametrize("mode", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("dim", [-1, 1, (1, 2), (-1, -3), (3, -2, 1)])
def test_reductions_over_any_dims_run_on_nash(mode, dim):
    assert where(Reduce(mode, dim), X, "nash") == ("bpu", f"{mode} supported on nash")


@pytest.mark.parametrize("mode", ["sum", "amax", "amin"])
def test_bayes_has_no_reduction_rows(mode):
    assert where(Reduce(mode, -1), X, "bayes") == ("cpu", f"{mode} is not supported on bayes")


def test_bayes_keeps_its_global_pool_constraint_on_mean():
    assert where(Reduce("mean", -1), X, "bayes") == (
        "cpu", "mean: mean over dims -1 (only the global mean over H, W runs on the BPU) on bayes")
    assert where(Reduce("mean", (2, 3)), X, "bayes")[0] == "bpu"


def test_what_nash_leaves_on_cpu_and_why():
    at, why = where(Reduce("sum", -1, dtype=torch.float64), X, "nash")
    assert at == "cpu" and "sum with dtype=torch.float64 (the BPU reduces the integers" in why
    at, why = where(Reduce("sum", None), X, "nash")  # a 0-D result (the march-wide limits come first)
    assert at == "cpu" and "is 0-D, not 1..5-D" in why
    for dim in (0, (0, 2), -4):
        at, why = where(Reduce("amax", dim, keepdim=True), X, "nash")
        assert (at, why) == ("cpu", f"amax: amax over dims {dim!r} reduces across the batch (dim 0); the BPU "
                                    f"reduces within each batch item on nash")
    big = torch.randn(1, 300, 300, 8)
    at, why = where(Reduce("mean", (1, 2)), big, "nash")
    assert at == "cpu" and "mean of 90000 elements into one output > 65536 (int32 accumulator)" in why
    # a selection sums nothing: no element limit
    assert where(Reduce("amax", (1, 2)), big, "nash")[0] == "bpu"


# ------------------------------------------------------------------------------------- the kernel


def test_reduce_dims_normalizes_and_refuses():
    assert fp.reduce_dims(-1, 4) == (3,)
    assert fp.reduce_dims((2, -4), 4) == (0, 2)
    assert fp.reduce_dims(None, 3) == fp.reduce_dims((), 3) == (0, 1, 2)
    with pytest.raises(ConfigError, match="out of range"):
        fp.reduce_dims(4, 4)
    with pytest.raises(ConfigError, match="twice"):
        fp.reduce_dims((1, -3), 4)


@pytest.mark.parametrize("seed", range(20))
def test_int_reduce_against_exact_arithmetic(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dtype = rng.choice(["qint8", "qint16"])
    lo, hi = fp.qrange(dtype)
    rank = rng.randint(1, 5)
    shape = tuple(rng.randint(1, 6) for _ in range(rank))
    q = torch.randint(lo, hi + 1, shape, generator=g).to(fp.storage_dtype(dtype))
    dims = tuple(rng.sample(range(rank), rng.randint(1, rank)))
    keep = rng.random() < 0.5
    want_max, want_min = q.amax(dims, keepdim=keep), q.amin(dims, keepdim=keep)
    assert torch.equal(fp.int_reduce(q, "amax", dims, keep), want_max)
    assert torch.equal(fp.int_reduce(q, "amin", dims, keep), want_min)
    assert fp.int_reduce(q, "amax", dims, keep).dtype == q.dtype
    s = q.to(torch.int64).sum(dims, keepdim=keep)
    # a power-of-two factor is exact in (M, n): the rounding is half to even of the exact quotient
    k = rng.randint(0, 4)
    M, n = fp.reduce_params("sum", 1, 1.0, 2.0 ** k, mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    want = torch.round(s.double() / 2 ** k).clamp(lo, hi).to(torch.int64)
    assert torch.equal(fp.int_reduce(q, "sum", dims, keep, M, n, dtype).to(torch.int64), want)
    # a mean's M holds 1 / count: mean over count == sum requantized by s_in / (count * s_out)
    count = 1
    for d in dims:
        count *= shape[d]
    # scales are float32 numbers (fixed_point reads them so)
    s_in, s_out = (float(torch.tensor(rng.uniform(0.01, 1.0), dtype=torch.float32)) for _ in range(2))
    Mm, nm = fp.reduce_params("mean", count, s_in, s_out, mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    Ms, ns = fp.requant_params(s_in / (count * s_out), mult_bits=qnn.MULT_BITS, max_shift=qnn.MAX_SHIFT)
    assert (Mm, nm) == (int(Ms), int(ns))
    got = fp.int_reduce(q, "mean", dims, keep, Mm, nm, dtype).double()
    exact = (s.double() * s_in / (count * s_out)).clamp(lo, hi)
    assert (got - exact).abs().max() <= 0.5 + 1e-6  # one rounding


def test_the_sum_is_checked_against_the_int32_accumulator():
    q = torch.full((1, 70000), 32767, dtype=torch.int16)
    with pytest.raises(fp.AccumulatorOverflow, match="int32 accumulator"):
        fp.int_reduce(q, "sum", -1, False, 1, 0, "qint16")


# --------------------------------------------------------------- module == simulator == onnxruntime


def _deq(v):
    return v.dequantize() if isinstance(v, QTensor) else v


def _case(seed: int):
    """A seeded random model: rank 2..5, dims (not the batch's) an int or a tuple, negative or not, keepdim,
    the spelling."""
    rng = random.Random(seed)
    rank = rng.randint(2, 5)
    shape = tuple(rng.randint(1, 5) for _ in range(rank - 1)) + (8,)
    k = rng.randint(1, rank - 1)  # never dim 0, the batch (test above)
    dims = [d - rank if rng.random() < 0.5 else d for d in rng.sample(range(1, rank), k)]
    dim = dims[0] if k == 1 and rng.random() < 0.5 else tuple(dims)
    mode = ["sum", "mean", "amax", "amin"][seed % 4]
    keep = rng.random() < 0.5
    return Reduce(mode, dim, keep, method=rng.random() < 0.5), shape, rng.uniform(0.2, 5.0)


def _compile(model, x, dtype):
    torch.manual_seed(0)
    calib = [(x,), (x * 0.5,)]
    return qcompiler.compile(model.eval(), (x,), march="nash", calib_data=calib, progress=False,
                             qconfig_dict={"": get_default_calib_qconfig(dtype=dtype)})


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("seed", range(12))
def test_module_simulator_and_onnx_agree_bit_for_bit(seed, dtype, tmp_path):
    model, shape, spread = _case(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * spread
    cm = _compile(model, x, dtype)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    (program,) = cm.runtime.programs.values()
    kinds = [op.kind for op in program.ops]
    red = [op for op in program.ops if op.kind in ("reduce", "global_avg_pool")]
    assert len(red) == 1, kinds
    if red[0].kind == "reduce":
        assert red[0].attrs["mode"] == model.mode and red[0].attrs["keepdim"] == model.keepdim
        assert red[0].attrs["out_dtype"] == dtype
    y = cm(x)
    with torch.no_grad():
        ref = model(x)
    assert y.shape == ref.shape
    sim_in = {program.inputs[0].name: x}
    for kernels in ("fast", "fixed_point"):
        (out,) = BpuSimulator(program, kernels=kernels).run(sim_in).values()
        assert torch.equal(_deq(out), _deq(y)), kernels
    if dtype == "qint8":
        assert_export_is_compiled(cm, (x,), tmp_path, min_points=2)
    # and the reduction computes its float op on the integers it reads: the dequantized linear output
    # reduced in float64, within one output rounding (a selection: exactly), clamped to the output range
    lin = cm.converted.get_submodule("lin")
    h = lin(cm.converted.get_submodule(next(n.target for n in cm.converted.graph.nodes if n.op == "call_module")
                                       )(x)).dequantize().double()
    a = {"dim": model.dim, "keepdim": model.keepdim}
    lo, hi = fp.qrange(dtype)
    s_out = red[0].attrs["out_scale"]
    want = getattr(torch, model.mode)(h, **a).clamp(lo * s_out, hi * s_out)  # the observer may clip
    # (plus float32 rounding of the dequantized values: 1e-6 of a code)
    tol = (0.0 if model.mode in ("amax", "amin") else 0.5) * s_out + 1e-6 * s_out * (1 + abs(hi))
    if red[0].kind == "reduce":
        assert (_deq(y).double() - want).abs().max() <= tol


@pytest.mark.parametrize("mode", ["amax", "amin"])
def test_a_selection_keeps_its_input_grid(mode):
    x = torch.randn(2, 3, 8)
    cm = _compile(Reduce(mode, -2), x, "qint8")
    (program,) = cm.runtime.programs.values()
    lin, red = [op for op in program.ops if op.kind in ("linear", "reduce")]
    assert red.attrs["out_scale"] == lin.attrs["out_scale"] and red.tensors == {}


def test_the_program_check_refuses_a_malformed_reduce():
    x = torch.randn(2, 3, 8)
    cm = _compile(Reduce("sum", (1, 2), keepdim=True), x, "qint8")
    (program,) = cm.runtime.programs.values()
    check_program(program)
    (red,) = [op for op in program.ops if op.kind == "reduce"]
    assert red.attrs["dims"] == [1, 2] and set(red.tensors) == {"M", "n"}
    red.attrs["dims"] = [2, 1]
    with pytest.raises(ArtifactError, match="attr 'dims'"):
        check_program(program)
    red.attrs["dims"], red.attrs["mode"] = [1, 2], "prod"
    with pytest.raises(ArtifactError, match="attr 'mode'"):
        check_program(program)
    red.attrs["mode"] = "sum"
    del red.tensors["M"]
    with pytest.raises(ArtifactError, match="'M' is missing"):
        check_program(program)


# ----------------------------------------------- max / min along a dim: the values, as amax / amin


class MaxValues(nn.Module):
    """The values of max / min along a dim, spelled four ways; ``indices`` also returns max's indices."""

    def __init__(self, indices=False):
        super().__init__()
        self.lin, self.indices = nn.Linear(8, 8), indices

    def forward(self, x):
        y = self.lin(x)
        v, i = torch.max(y, 1)
        if self.indices:
            return v, i
        return v + y.min(dim=-2, keepdim=True)[0].sum(1) + y.max(1).values + torch.min(y, -2)[0]


def _rewrite(model, x, march):
    from qcompiler.ir import propagate_shapes, trace
    from qcompiler.march import March
    from qcompiler.passes import rewrite as rw
    from qcompiler.passes.base import CompileContext

    gm = trace(model)
    propagate_shapes(gm, (x,))
    result = rw.rewrite(gm, CompileContext(march=March(march), example_inputs=(x,)))
    return gm, result


def test_max_values_become_amax_on_nash_bit_for_bit():
    x = torch.randn(2, 3, 8)
    model = MaxValues().eval()
    gm, result = _rewrite(model, x, "nash")
    assert result.modified
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.amax) == 2 and ops.count(torch.amin) == 2
    assert not any(n.target in (torch.max, torch.min, "max", "min") for n in gm.graph.nodes)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))  # the same values, not approximately


def test_max_with_its_indices_or_on_bayes_is_left_alone():
    x = torch.randn(2, 3, 8)
    _, result = _rewrite(MaxValues(indices=True), x, "nash")  # the indices are read
    assert not result.modified
    _, result = _rewrite(MaxValues(), x, "bayes")  # bayes has no amax
    assert not result.modified

    class Binary(nn.Module):
        def forward(self, x):
            return torch.max(x, x * 2)  # the element-wise form: no dim

    _, result = _rewrite(Binary(), x, "nash")
    assert not result.modified


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_max_values_compile_on_nash_and_agree_everywhere(dtype, tmp_path):
    x = torch.randn(2, 3, 8)
    cm = _compile(MaxValues(), x, dtype)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    (program,) = cm.runtime.programs.values()
    assert sorted(op.attrs["mode"] for op in program.ops if op.kind == "reduce") == ["amax", "amax", "amin",
                                                                                     "amin", "sum"]
    y = cm(x)
    for kernels in ("fast", "fixed_point"):
        (out,) = BpuSimulator(program, kernels=kernels).run({program.inputs[0].name: x}).values()
        assert torch.equal(_deq(out), _deq(y)), kernels
    if dtype == "qint8":
        assert_export_is_compiled(cm, (x,), tmp_path, min_points=2)
