"""LayerNorm on the nash BPU: placement (nash vs bayes / bernoulli2, the constraints' reasons), the integer
kernel (``fixed_point.int_layer_norm``) against an independent pure-Python definition and against float
LayerNorm (SQNR with explicit thresholds), and the converted module == the simulator == the integer ONNX
export in onnxruntime, bit for bit, over random shapes, scales, int8 / int16 inputs and outputs, with and
without the affine parameters; the program's form checks."""

from __future__ import annotations

import math
import random

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_nash_table import placed

import qcompiler
from qcompiler.backends.bpu.program import BpuProgram
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import inference_session
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig

# ----------------------------------------------------------------------------------------------- models


class Norm(nn.Module):
    """nn.LayerNorm over the last ``len(shape)`` dims, with random affine parameters."""

    def __init__(self, shape, affine=True, seed=0, eps=1e-5):
        super().__init__()
        self.ln = nn.LayerNorm(shape, eps=eps, elementwise_affine=affine)
        if affine:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                self.ln.weight.copy_(torch.randn(shape, generator=g) * 0.4 + 1.0)
                self.ln.bias.copy_(torch.randn(shape, generator=g) * 0.3)

    def forward(self, x):
        return self.ln(x)


class Functional(nn.Module):
    """F.layer_norm with a parameter weight and a buffer bias (constants: get_attr operands)."""

    def __init__(self, shape, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.shape = tuple(shape)
        self.w = nn.Parameter(torch.randn(shape, generator=g) * 0.5 + 1.0)
        self.register_buffer("b", torch.randn(shape, generator=g) * 0.2)

    def forward(self, x):
        return F.layer_norm(x, self.shape, self.w, self.b, 1e-5)


class RunTimeWeight(nn.Module):
    """F.layer_norm whose weight is computed from the input (not a constant)."""

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), x.mean(0)[0], None)


class AllDims(nn.Module):
    """F.layer_norm over every dim, the batch included."""

    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x):
        return F.layer_norm(x, self.shape)


def compile_nash(model, x, in_dtype="qint8", out_dtype=None):
    """compile on nash; the input quantizer at ``in_dtype``, the layer norm's output at ``out_dtype``."""
    qc = {"": get_default_calib_qconfig(dtype=in_dtype)}
    if out_dtype is not None:  # named: nash's default would make the output int16 (default_dtypes)
        qc["module_name"] = [("ln", get_default_calib_qconfig(dtype=out_dtype))]
    return qcompiler.compile(model, (x,), march="nash", qconfig_dict=qc, calib_data=[x], progress=False)


def layer_norm_modules(cm):
    return [m for m in cm.converted.modules() if isinstance(m, qnn.QuantizedLayerNorm)]


def onnx_outputs(cm, x, tmp_path):
    path = tmp_path / "ln.onnx"
    cm.export_onnx(path)
    model = onnx.load(str(path))
    s = inference_session(model)
    return model, s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10((ref ** 2).sum() / ((ref - out) ** 2).sum()))


# -------------------------------------------------------------------------------------------- placement


def test_layer_norm_runs_on_nash_and_stays_on_cpu_on_bayes_and_bernoulli2():
    x = torch.randn(2, 8, 16)
    assert placed(Norm((16,)), x, "nash")["ln"] == ("bpu", "layer_norm supported on nash")
    assert placed(Norm((16,)), x, "bayes")["ln"] == ("cpu", "layer_norm is not supported on bayes")
    x4 = torch.randn(1, 4, 8, 8)
    assert placed(Norm((8, 8)), x4, "bernoulli2")["ln"] == ("cpu", "layer_norm is not supported on bernoulli2")
    assert placed(Functional((8, 8)), x4, "nash")["layer_norm"] == ("bpu", "layer_norm supported on nash")


def test_constraints_send_layer_norm_to_cpu_with_the_reason():
    x = torch.randn(2, 4, 8)
    p = placed(RunTimeWeight(), x, "nash")["layer_norm"]
    assert p[0] == "cpu" and p[1].startswith("layer_norm: weight is computed at run time"), p
    p = placed(AllDims(x.shape), x, "nash")["layer_norm"]
    assert p == ("cpu", "layer_norm: normalizing all 3 dims of (2,4,8) normalizes across the batch (dim 0); the BPU "
                 "normalizes the last dims of each batch item on nash"), p
    big = placed(Norm((3, 30000), affine=False), torch.randn(1, 3, 30000), "nash")["ln"]
    assert big == ("cpu", "layer_norm: normalized group of 90000 elements (3,30000) > 65536 on nash"), big
    assert placed(Norm((2, 30000), affine=False), torch.randn(1, 2, 30000), "nash")["ln"][0] == "bpu"


def test_a_non_constant_weight_compiles_with_layer_norm_on_cpu():
    x = torch.randn(2, 4, 8)
    cm = compile_nash(RunTimeWeight(), x)
    assert not layer_norm_modules(cm)
    with torch.no_grad():
        assert torch.allclose(cm(x), RunTimeWeight()(x), atol=1e-5)


# ------------------------------------------------------------------------------------- the kernel itself


def _rhe(num: int, den: int) -> int:
    """round_half_even(num / den) of Python ints (den > 0)."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2 == 1):
        q += 1
    return q


def python_layer_norm(q: torch.Tensor, dims: int, E: int, M, n, B, out_dtype) -> torch.Tensor:
    """The kernel of ``fixed_point`` written again with Python ints, one group at a time (the exponent
    from ``int.bit_length``, the table entry from its definition)."""
    lo, hi = fp.qrange(out_dtype)
    T, F_, Z = fp.LN_RSQRT_BITS, fp.LN_RSQRT_FRAC, fp.LN_NORM_FRAC
    shape = q.shape[q.dim() - dims:]
    rows = q.reshape(-1, math.prod(shape)).tolist()
    Ms, ns, Bs = M.reshape(-1).tolist(), n.reshape(-1).tolist(), B.reshape(-1).tolist()
    out = []
    for row in rows:
        N = len(row)
        s1, s2 = sum(row), sum(v * v for v in row)
        W = max(N * s2 - s1 * s1 + E, 1)
        p = (W.bit_length() - 1) // 2
        t = (W << T) >> (2 * p)
        R = round(2 ** F_ / math.sqrt((t + 0.5) / 2 ** T))
        res = []
        for v, Mc, nc, Bc in zip(row, Ms, ns, Bs):
            z = _rhe((N * v - s1) * R, 1 << (p + F_ - Z))
            res.append(min(max(_rhe(z * Mc + Bc, 1 << (nc + Z)), lo), hi))
        out.append(res)
    return torch.tensor(out, dtype=torch.int64).reshape(q.shape)


def kernel_case(seed: int, shape, dims: int, in_dtype: str, out_dtype: str, affine: bool = True, eps=1e-5):
    """Random input codes, affine parameters and scales; the kernel's output and the float LayerNorm of
    the dequantized input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (0.2 + 3 * torch.rand((), generator=g)) + torch.randn((), generator=g)
    s_in = float(x.abs().max()) / fp.qrange(in_dtype)[1]
    q = fp.quantize(x, s_in, in_dtype)
    ns = tuple(shape[len(shape) - dims:])
    w = torch.randn(ns, generator=g) * 0.5 + 1.0 if affine else None
    b = torch.randn(ns, generator=g) * 0.3 if affine else None
    ref = F.layer_norm(fp.dequantize(q, s_in).double(), ns, None if w is None else w.double(),
                       None if b is None else b.double(), eps)
    s_out = (float(ref.abs().max()) or 1.0) / fp.qrange(out_dtype)[1]  # a group of 1 without affine: all 0
    M, n, B = fp.layer_norm_params(w, b, ns, s_out)
    E = fp.layer_norm_eps_units(eps, s_in, math.prod(ns))
    y = fp.int_layer_norm(q, dims, E, M, n, B, out_dtype)
    return q, (dims, E, M, n, B, out_dtype), y, ref, s_out


@pytest.mark.parametrize("seed", range(12))
def test_kernel_equals_its_python_int_definition_on_random_shapes(seed):
    rng = random.Random(seed)
    rank = rng.randint(2, 5)
    dims = rng.randint(1, min(2, rank - 1))
    shape = tuple(rng.randint(1, 9) for _ in range(rank))
    in_dtype, out_dtype = rng.choice(["qint8", "qint16"]), rng.choice(["qint8", "qint16"])
    q, args, y, _, _ = kernel_case(seed, shape, dims, in_dtype, out_dtype, affine=rng.random() < 0.7)
    assert y.dtype == fp.storage_dtype(out_dtype)
    assert torch.equal(y.to(torch.int64), python_layer_norm(q, *args))


# measured (seeds 0..5, these four shapes, int8 or int16 in): int16 out 75.6..90.4 dB, int8 out 37.5..45.6 dB;
# the bound is the rsqrt bucket (relative error < 2**-12) for int16 output, the output rounding for int8
SQNR_MIN = {"qint16": 70.0, "qint8": 35.0}


@pytest.mark.parametrize("in_dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("out_dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("shape,dims", [((4, 64), 1), ((2, 3, 8, 8), 2), ((3, 768), 1), ((2, 5, 7), 2)])
def test_kernel_sqnr_against_float_layer_norm(in_dtype, out_dtype, shape, dims):
    for seed in range(3):
        _, _, y, ref, s_out = kernel_case(seed, shape, dims, in_dtype, out_dtype)
        got = sqnr(ref, y.double() * s_out)
        assert got >= SQNR_MIN[out_dtype], (seed, got)


def test_the_overflow_bounds_hold_at_the_largest_group_and_extreme_codes():
    N = fp.LN_MAX_GROUP
    q = torch.full((1, N), 32767, dtype=torch.int16)
    q[0, ::2] = -32768  # max |d| and max variance: V = N**2 * var is ~2**62
    q[0, 1] = -32768
    M, n, B = fp.layer_norm_params(None, None, (N,), 8.0 / 32767)
    y = fp.int_layer_norm(q, 1, 0, M, n, B, "qint16")
    assert torch.equal(y.to(torch.int64), python_layer_norm(q, 1, 0, M, n, B, "qint16"))
    ref = F.layer_norm(q.double(), (N,), eps=0.0)
    assert sqnr(ref, y.double() * (8.0 / 32767)) > 70.0
    with pytest.raises(ConfigError, match="the normalized group has 65537 elements"):
        M1, n1, B1 = fp.layer_norm_params(None, None, (N + 1,), 0.01)
        fp.int_layer_norm(torch.zeros(1, N + 1, dtype=torch.int16), 1, 0, M1, n1, B1)


def test_constant_groups_give_beta_and_eps_units_saturate():
    q = torch.full((3, 8), 17, dtype=torch.int8)
    beta = torch.linspace(-1, 1, 8)
    M, n, B = fp.layer_norm_params(torch.ones(8), beta, (8,), 1 / 100)
    for E in (0, 5, fp.LN_MAX_EPS_UNITS):
        y = fp.int_layer_norm(q, 1, E, M, n, B, "qint8")
        assert torch.equal(y[0].to(torch.int64), torch.round(beta * 100).to(torch.int64))
    assert fp.layer_norm_eps_units(1e-5, 1e-12, 4096) == fp.LN_MAX_EPS_UNITS
    assert fp.layer_norm_eps_units(1e-5, 0.5, 16) == round(1e-5 / 0.25 * 256)
    with pytest.raises(ConfigError, match="eps must be >= 0"):
        fp.layer_norm_eps_units(-1.0, 0.5, 16)


# ------------------------------------------------------------- module == simulator == onnxruntime, bit-exact

CASES = [  # (model input shape, normalized dims, input dtype, output dtype, affine)
    ((2, 8, 16), 1, "qint8", "qint8", True),
    ((16, 32), 1, "qint16", "qint16", True),
    ((2, 3, 4, 6), 2, "qint16", "qint8", False),
    ((1, 2, 3, 4, 5), 2, "qint8", "qint16", True),
    ((3, 1, 7), 1, "qint8", "qint8", False),
    ((2, 4, 5, 6, 3), 1, "qint16", "qint16", False),
]


@pytest.mark.parametrize("shape,dims,in_dtype,out_dtype,affine", CASES)
def test_module_simulator_and_onnx_agree_bit_for_bit(shape, dims, in_dtype, out_dtype, affine, tmp_path):
    seed = sum(shape) * 7 + dims
    g = torch.Generator().manual_seed(seed)
    model = Norm(shape[len(shape) - dims:], affine=affine, seed=seed).eval()
    calib = torch.randn(shape, generator=g) * 2.0 + 0.5
    cm = compile_nash(model, calib, in_dtype, out_dtype)
    (ln,) = layer_norm_modules(cm)
    assert (ln.in_dtype, ln.out_dtype, ln.dims) == (in_dtype, out_dtype, dims)
    kinds = [op.kind for p in cm.runtime.programs.values() for op in p.ops]
    assert "layer_norm" in kinds
    x = torch.randn(shape, generator=g) * 2.0 + 0.5
    with torch.no_grad():
        sim, conv = cm(x), cm.converted(x)
    assert torch.equal(sim, conv)
    model_proto, ort = onnx_outputs(cm, x, tmp_path)
    assert np.array_equal(ort, sim.numpy()), np.abs(ort - sim.numpy()).max()
    ops = {node.op_type for node in model_proto.graph.node}
    assert {"Sqrt", "ReduceMean"}.isdisjoint(ops) and {"Gather", "ReduceSum", "Mod"} <= ops
    # and close to the float model on the calibrated range: the input and output quantization bound the
    # end-to-end SQNR (measured: 39..45 dB with an int8 side, 80 dB int16 -> int16)
    with torch.no_grad():
        got = sqnr(model(calib), cm(calib))
    assert got >= (33.0 if "qint8" in (in_dtype, out_dtype) else 65.0), got


def test_functional_layer_norm_with_constant_affine_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(5)
    model = Functional((4, 6)).eval()
    x = torch.randn(2, 3, 4, 6, generator=g)
    cm = compile_nash(model, x)
    (ln,) = layer_norm_modules(cm)
    assert torch.equal(ln.weight, model.w.detach()) and torch.equal(ln.bias, model.b)
    with torch.no_grad():
        sim, conv = cm(x), cm.converted(x)
    assert torch.equal(sim, conv)
    _, ort = onnx_outputs(cm, x, tmp_path)
    assert np.array_equal(ort, sim.numpy())


@pytest.mark.parametrize("seed", range(4))
def test_property_random_shapes_and_scales_are_bit_exact_everywhere(seed, tmp_path):
    rng = random.Random(100 + seed)
    rank = rng.randint(2, 5)
    dims = rng.randint(1, min(2, rank - 1))
    shape = tuple(rng.randint(1, 6) for _ in range(rank))
    in_dtype, out_dtype = rng.choice(["qint8", "qint16"]), rng.choice(["qint8", "qint16"])
    g = torch.Generator().manual_seed(seed)
    model = Norm(shape[rank - dims:], affine=rng.random() < 0.5, seed=seed, eps=rng.choice([1e-5, 1e-3, 0.1])).eval()
    spread = 10 ** rng.uniform(-2, 2)
    calib = torch.randn(shape, generator=g) * spread
    cm = compile_nash(model, calib, in_dtype, out_dtype)
    assert layer_norm_modules(cm)
    x = torch.randn(shape, generator=g) * spread
    with torch.no_grad():
        sim, conv = cm(x), cm.converted(x)
    assert torch.equal(sim, conv)
    _, ort = onnx_outputs(cm, x, tmp_path)
    assert np.array_equal(ort, sim.numpy()), (shape, dims, in_dtype, out_dtype)


# ------------------------------------------------------------------------------------ the program's form


def _program(cm):
    (program,) = cm.runtime.programs.values()
    return program


def test_the_program_round_trips_and_its_checks_refuse_a_bad_layer_norm():
    x = torch.randn(2, 4, 8)
    cm = compile_nash(Norm((8,)), x)
    program = _program(cm)
    tensors, meta = program.to_state()
    again = BpuProgram.from_state(tensors, meta)
    (op,) = [o for o in again.ops if o.kind == "layer_norm"]
    assert op.attrs["dims"] == 1 and set(op.tensors) == {"M", "n", "B", "eps"}
    i = [o.kind for o in again.ops].index("layer_norm")
    bad = dict(tensors)
    bad[f"{i}.n"] = torch.full_like(tensors[f"{i}.n"], fp.LN_MAX_SHIFT + 1)
    with pytest.raises(ArtifactError, match=r"tensor 'n' holds values in \[29, 29\], expected \[0, 28\]"):
        BpuProgram.from_state(bad, meta)
    bad = dict(tensors)
    bad[f"{i}.B"] = tensors[f"{i}.B"][:4].clone()
    meta_bad = {**meta, "ops": [dict(o) for o in meta["ops"]]}
    meta_bad["ops"][i]["tensors"] = [dict(t, shape=[4]) if t["name"] == "B" else t for t in meta["ops"][i]["tensors"]]
    with pytest.raises(ArtifactError, match=r"tensor 'B' has shape \[4\], expected \[8\]"):
        BpuProgram.from_state(bad, meta_bad)
