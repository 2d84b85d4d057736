"""masked softmax: ``softmax(masked_fill(x, mask, -inf), dim)`` fused into one op (``passes/masked_softmax.py``)
and, on nash, run on the BPU by ``fixed_point.int_masked_softmax``.

The rewrite alone (float values equal to torch's, a fully masked row 0), the integer definition in
terms of ``int_softmax`` on the kept positions, the mask entering the BPU as exact 0/1 codes (a run-time
bool input and a constant causal mask), module == simulator == onnxruntime bit for bit, SQNR against
float with stated floors, masked probabilities exactly 0, and bayes keeping the op on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.bpu.lower import lower_bpu_partitions
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec
from qcompiler.backends.bpu.program_check import check_program
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REASON, META_REWRITE
from qcompiler.march import March
from qcompiler.nn import quantized as qnn
from qcompiler.nn.functional import masked_softmax
from qcompiler.onnx import inference_session
from qcompiler.passes.base import CompileContext
from qcompiler.passes.masked_softmax import NOTE, fuse_masked_softmax, verify_fused
from qcompiler.passes.place import place
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.quantization.qtensor import QTensor

NEG_INF = float("-inf")


def _mask(shape, seed, p=0.35):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > p


# ------------------------------------------------------------------------------ the float definition


@pytest.mark.parametrize("dim", [-1, 0, 1, 2])
@pytest.mark.parametrize("fill_mask_is_true", [True, False])
def test_the_function_is_torch_s_two_ops_bit_for_bit_and_0_on_a_dead_row(dim, fill_mask_is_true):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 6, generator=g) * 5
    m = torch.rand(3, 4, 6, generator=g) > 0.4
    fill = m if fill_mask_is_true else ~m
    dead = fill.all(dim, keepdim=True)
    ref = torch.softmax(x.masked_fill(fill, NEG_INF), dim)
    where = torch.softmax(torch.where(fill, torch.tensor(NEG_INF), x), dim)  # the fused-where spelling
    y = masked_softmax(x, m, dim, fill_mask_is_true)
    live = ~dead.expand_as(x)
    assert torch.equal(y[live], ref[live]) and torch.equal(y[live], where[live])
    assert torch.isnan(ref[~live]).all() and (y[~live] == 0).all()
    # the 0/1 codes of the quantized mask (floats) read as the bool mask
    assert torch.equal(masked_softmax(x, m.double(), dim, fill_mask_is_true), y)


def test_a_broadcast_mask_and_a_fully_masked_row():
    x = torch.randn(2, 2, 3, 5)
    m = torch.tensor([[True, True, False, True, False]]).reshape(1, 1, 1, 5)  # [B?, H?, L?, L]
    y = masked_softmax(x, m, -1, False)
    assert torch.equal(y, torch.softmax(x.masked_fill(~m, NEG_INF), -1))
    assert (y[..., 2] == 0).all() and (y[..., 4] == 0).all()
    assert (masked_softmax(x, torch.zeros(5, dtype=torch.bool), -1, False) == 0).all()


# ------------------------------------------------------------------------------ the rewrite alone


class Masked(nn.Module):
    """Scores ``x @ x^T`` masked by a run-time bool mask in one of the spellings, then softmax."""

    def __init__(self, spelling, dim=-1):
        super().__init__()
        self.spelling, self.dim = spelling, dim

    def forward(self, x, mask):
        s = x @ x.transpose(-2, -1)
        if self.spelling == "not":
            s = s.masked_fill(torch.logical_not(mask), NEG_INF)
        elif self.spelling == "method_not":
            s = torch.masked_fill(s, mask.logical_not(), float("-inf"))
        elif self.spelling == "tilde":
            s = s.masked_fill(~mask, NEG_INF)
        elif self.spelling == "bitwise_not":
            s = s.masked_fill(mask.bitwise_not(), NEG_INF)
        else:
            s = s.masked_fill(mask, NEG_INF)
        return s.softmax(self.dim) if self.spelling != "plain" else torch.softmax(s, dim=self.dim)


def _fused(model, *inputs, march=March.BAYES):
    gm = trace(model.eval())
    propagate_shapes(gm, inputs)
    ctx = CompileContext(march=march, example_inputs=inputs)
    result = fuse_masked_softmax(gm, ctx)
    verify_fused(result.gm, ctx)
    return result.gm, result.modified, ctx


@pytest.mark.parametrize("spelling, polarity", [("not", False), ("method_not", False), ("tilde", False),
                                                ("bitwise_not", False), ("mask", True), ("plain", True)])
@pytest.mark.parametrize("dim", [-1, 1])
def test_the_rewrite_fuses_every_spelling_and_keeps_the_values(spelling, polarity, dim):
    x, m = torch.randn(2, 6, 4), _mask((2, 6, 6), 5)
    m[0, :, 1] = m[0, 1, :] = polarity  # a row / column filled entirely: torch's NaN, the function's 0
    model = Masked(spelling, dim)
    gm, modified, _ = _fused(model, x, m)
    assert modified
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    (fused,) = [n for n in calls if n.target is masked_softmax]
    assert fused.args[2:] == (dim, polarity) and fused.meta[META_REWRITE] == NOTE
    assert not [n for n in calls if "masked_fill" in str(n.target) or "logical_not" in str(n.target)
                or "softmax" == str(n.target) or "invert" in str(n.target) or "bitwise_not" in str(n.target)]
    with torch.no_grad():
        y, ref = gm(x, m), model(x, m)
    live = ~torch.isnan(ref)
    assert not live.all() and torch.equal(y[live], ref[live]) and (y[~live] == 0).all()


class NotFused(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x, mask):
        if self.case == "finite_fill":
            return x.masked_fill(mask, -1e4).softmax(-1)
        if self.case == "fill_read_twice":
            f = x.masked_fill(mask, NEG_INF)
            return f.softmax(-1), f
        if self.case == "dtype":
            return torch.softmax(x.masked_fill(mask, NEG_INF), -1, dtype=torch.float64)
        return x.masked_fill(mask, NEG_INF).log_softmax(-1)


@pytest.mark.parametrize("case", ["finite_fill", "fill_read_twice", "dtype", "log_softmax"])
def test_what_the_rewrite_leaves_alone(case):
    x, m = torch.randn(2, 5), _mask((2, 5), 1)
    gm, modified, _ = _fused(NotFused(case), x, m)
    assert not modified
    assert not [n for n in gm.graph.nodes if n.target is masked_softmax]


# ------------------------------------------------------------------------------ the integer definition


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_the_kernel_is_int_softmax_over_the_kept_positions(dtype):
    g = torch.Generator().manual_seed(11)
    lo, hi = fp.qrange(dtype)
    q = torch.randint(lo, hi + 1, (6, 9), generator=g)
    keep = torch.rand(6, 9, generator=g) > 0.4
    keep[0] = False  # a row with every position masked
    keep[1] = True
    table, (M, n) = fp.softmax_exp_table(0.05, dtype), fp.softmax_params(1 / 127)
    y = fp.int_masked_softmax(q, keep.to(torch.int8), 1, False, table, M, n, "qint8")
    assert torch.equal(y, fp.int_masked_softmax(q, (~keep).to(torch.int8), 1, True, table, M, n, "qint8"))
    assert (y[0] == 0).all() and (y[~keep] == 0).all()
    for r in range(1, 6):
        k = keep[r]
        if k.any():
            assert torch.equal(y[r, k], fp.int_softmax(q[r, k], 0, table, M, n, "qint8")), r
    # a masked position's value changes nothing (the max is over the kept positions)
    q2 = torch.where(keep, q, torch.full_like(q, hi))
    assert torch.equal(fp.int_masked_softmax(q2, keep.to(torch.int8), 1, False, table, M, n, "qint8"), y)


def test_the_kernel_refuses_a_mask_that_does_not_broadcast():
    table, (M, n) = fp.softmax_exp_table(0.05), fp.softmax_params(1 / 127)
    with pytest.raises(ConfigError, match="does not broadcast"):
        fp.int_masked_softmax(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(3, 1, dtype=torch.int8), -1, True,
                              table, M, n)


def test_the_program_check_wants_the_mask_as_a_second_input():
    table, (M, n) = fp.softmax_exp_table(0.05), fp.softmax_params(1 / 127)
    tensors = {"table": table, "M": torch.tensor(M), "n": torch.tensor(n)}
    attrs = {"dim": 1, "fill_mask_is_true": False, "in_dtype": "qint8", "out_dtype": "qint8",
             "out_scale": 1 / 127, "out_axis": None}
    specs = [ValueSpec("x", "qint8", 0.05), ValueSpec("m", "qint8", 1.0)]
    ok = BpuProgram("p", specs, [ValueSpec("y", "qint8", 1 / 127)],
                    [BpuOp("masked_softmax", ["x", "m"], "y", attrs, tensors)])
    check_program(ok)
    with pytest.raises(ArtifactError, match="reads 1 values, expected 2"):
        check_program(BpuProgram("p", specs[:1], [ValueSpec("y", "qint8", 1 / 127)],
                                 [BpuOp("masked_softmax", ["x"], "y", attrs, tensors)]))


# ------------------------------------------------------------------------------ on nash: the pipeline


class MaskedAttention(nn.Module):
    """Projections, ``q k^T / sqrt(d)`` per head, a bool mask (run-time input, or a constant causal
    buffer), softmax(-1), ``@ v``, the output projection."""

    def __init__(self, d=16, heads=2, length=None):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        if length is not None:
            self.register_buffer("causal", torch.ones(length, length).tril().bool())
        else:
            self.causal = None

    def split(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.h, self.dk).transpose(1, 2)

    def forward(self, x, mask=None):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dk))
        keep = self.causal if mask is None else mask
        p = s.masked_fill(torch.logical_not(keep), float("-inf")).softmax(-1)
        b, n, d = x.shape
        return self.o(torch.matmul(p, v).transpose(1, 2).reshape(b, n, d))


def _sqnr(y, ref) -> float:
    return float(10 * torch.log10((ref ** 2).sum() / ((y - ref) ** 2).sum()))


def _flat(y):
    return [y.dequantize()] if isinstance(y, QTensor) else [y] if isinstance(y, torch.Tensor) else \
        [t for v in y for t in _flat(v)]


def _three_ways(cm, inputs, tmp_path, with_onnx=True):
    """module == simulator == onnxruntime on the integer export (no float Softmax in it). An int16
    matmul / linear exports as float (opset 11 has no int16 integer ops): ``with_onnx=False`` then."""
    made = {op.kind for p in lower_bpu_partitions(cm.converted).values() for op in p.ops}
    assert "masked_softmax" in made and "softmax" not in made
    with torch.no_grad():
        module, sim = _flat(cm.converted(*inputs)), _flat(cm(*inputs))
    assert torch.equal(module[0], sim[0]), "module != simulator"
    if not with_onnx:
        return module[0]
    path = tmp_path / "model.onnx"
    cm.export_onnx(path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert "Softmax" not in {n.op_type for n in model.graph.node}
    s = inference_session(model)
    ort = s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), inputs)})
    assert len(module) == len(sim) == len(ort) == 1
    assert torch.equal(module[0], sim[0]), "module != simulator"
    assert np.array_equal(ort[0], module[0].numpy()), "onnxruntime != module"
    return module[0]


def _qconfig(dtype, model):
    """``dtype`` on every op, the kernels too: a module_type entry for the model's own class, which nash's
    per-op default types (backends/bpu/nash.py ``default_dtypes``) leave alone."""
    qc = get_default_calib_qconfig(dtype, observer="minmax")
    return {"": qc, "module_type": [(type(model), qc)]}


def _probabilities(cm, inputs):
    """The converted masked softmax's output codes (a forward hook on the module)."""
    (m,) = [m for m in cm.converted.modules() if isinstance(m, qnn.QuantizedMaskedSoftmax)]
    seen = []
    h = m.register_forward_hook(lambda mod, i, o: seen.append(o.int_repr()))
    with torch.no_grad():
        cm.converted(*inputs)
    h.remove()
    return m, seen[0]


# SQNR floors of the whole block vs the float model (int8 weights either way; measured run-time mask /
# causal mask: int8 30.9 / 33.5 dB, int16 activations 32.6 / 37.4 dB)
_FLOOR = {"qint8": 27.0, "qint16": 29.0}


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_a_run_time_bool_mask_runs_on_the_bpu_bit_exact(dtype, tmp_path):
    torch.manual_seed(0)
    model = MaskedAttention().eval()

    def mask(seed):
        m = _mask((2, 1, 10, 10), seed)
        m[..., 0] = True
        return m
    x, m = torch.randn(2, 10, 16), mask(9)
    m[1, 0, 3] = False  # one row with every position masked: 0 on the BPU (torch: NaN)
    calib = [(torch.randn(2, 10, 16), mask(s)) for s in range(3)]
    cm = qcompiler.compile(model, (x, m), march="nash", calib_data=calib, qconfig_dict=_qconfig(dtype, model),
                           progress=False)
    assert cm.summary().splitlines()[0].endswith("1 bpu, 0 cpu partitions; BPU<->CPU boundary edges: 0")
    # the mask enters at the exact 0/1 grid
    (entry,) = [mod for n, mod in cm.converted.named_modules() if isinstance(mod, qnn.Quantize)
                and n.startswith("mask")]
    assert (entry.scale, entry.dtype) == (1.0, "qint8")
    y = _three_ways(cm, (x, m), tmp_path, with_onnx=dtype == "qint8")
    mod, codes = _probabilities(cm, (x, m))
    assert not mod.fill_mask_is_true
    assert (codes[~m.expand_as(codes)] == 0).all()  # masked probabilities exactly 0
    assert (codes[1, :, 3] == 0).all() and (codes[0].sum(-1) > 0).all()
    live = torch.ones(2, 10, dtype=torch.bool)
    live[1, 3] = False  # the dead row is NaN in float
    with torch.no_grad():
        ref = model(x, m)
    assert _sqnr(y[live].double(), ref[live].double()) >= _FLOOR[dtype]


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_a_constant_causal_mask_runs_on_the_bpu_bit_exact(dtype, tmp_path):
    torch.manual_seed(1)
    model = MaskedAttention(length=12).eval()
    x = torch.randn(2, 12, 16)
    cm = qcompiler.compile(model, (x,), march="nash", calib_data=[(torch.randn(2, 12, 16),) for _ in range(3)],
                           qconfig_dict=_qconfig(dtype, model), progress=False)
    assert cm.summary().splitlines()[0].endswith("1 bpu, 0 cpu partitions; BPU<->CPU boundary edges: 0")
    y = _three_ways(cm, (x,), tmp_path, with_onnx=dtype == "qint8")
    mod, codes = _probabilities(cm, (x,))
    upper = ~torch.ones(12, 12).tril().bool()
    assert (codes[..., upper] == 0).all() and (codes[..., ~upper] >= 0).all()
    # row 0 keeps position 0 only: probability 1, the code of a one-element softmax
    one = fp.int_softmax(torch.zeros(1, dtype=torch.int64), 0, mod.table, mod.M, mod.n, dtype)
    assert int(one) > 0 and (codes[..., 0, 0] == int(one)).all()
    with torch.no_grad():
        ref = model(x)
    assert _sqnr(y.double(), ref.double()) >= _FLOOR[dtype]


class MaskedOnly(nn.Module):
    def __init__(self, dim, negate):
        super().__init__()
        self.dim, self.negate = dim, negate

    def forward(self, x, mask):
        fill = torch.logical_not(mask) if self.negate else mask
        return torch.softmax(x.masked_fill(fill, float("-inf")), self.dim)


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("dim, negate, mask_shape", [(-1, True, (3, 1, 7)), (1, False, (3, 5, 7)),
                                                     (0, True, (5, 1))])
def test_the_kernel_alone_is_bit_exact_three_ways_on_every_grid(dtype, dim, negate, mask_shape, tmp_path):
    g = torch.Generator().manual_seed(21)
    calib = [(torch.randn(3, 5, 7, generator=g) * 4, torch.rand(mask_shape, generator=g) > 0.3) for _ in range(2)]
    x, m = torch.randn(3, 5, 7, generator=g) * 5, torch.rand(mask_shape, generator=g) > 0.3
    only = MaskedOnly(dim, negate).eval()
    cm = qcompiler.compile(only, (x, m), march="nash", calib_data=calib,
                           qconfig_dict=_qconfig(dtype, only), progress=False)
    assert cm.summary().splitlines()[0].endswith("1 bpu, 0 cpu partitions; BPU<->CPU boundary edges: 0")
    y = _three_ways(cm, (x, m), tmp_path)
    (mod,) = [mod for mod in cm.converted.modules() if isinstance(mod, qnn.QuantizedMaskedSoftmax)]
    fill = (~m if negate else m).expand_as(x)
    assert (y[fill] == 0).all()
    # within the kernel's bound of the float function on the quantized input, softmax's: 0.5 LSB of rounding
    # plus the 16-bit exponential table's error (0.55 LSB on an int8 grid, 1.5 on an int16 one)
    (entry,) = [q for n, q in cm.converted.named_modules() if isinstance(q, qnn.Quantize) and n.startswith("x")]
    xq = fp.dequantize(fp.quantize(x, entry.scale, dtype), entry.scale).double()
    ref = masked_softmax(xq, m, dim, not negate).clamp(max=fp.qrange(dtype)[1] * mod.out_scale)
    lsb = 0.55 if dtype == "qint8" else 1.5
    assert float((y.double() - ref).abs().max()) <= lsb * mod.out_scale + 1e-6


def _placed(model, inputs, march):
    gm = trace(model.eval())
    propagate_shapes(gm, inputs)
    ctx = CompileContext(march=March(march), example_inputs=inputs)
    gm = fuse_masked_softmax(gm, ctx).gm
    place(gm, ctx)
    return {n.name: (n.meta[META_PLACEMENT], n.meta[META_REASON]) for n in gm.graph.nodes if META_PLACEMENT in n.meta}


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_other_marches_run_the_fused_op_on_the_cpu_in_float(march, tmp_path):
    torch.manual_seed(2)
    model = MaskedAttention().eval()
    x, m = torch.randn(2, 10, 16), _mask((2, 1, 10, 10), 4)
    m[..., 0] = True
    p = _placed(model, (x, m), march)
    assert p["masked_softmax"] == ("cpu", f"masked_softmax is not supported on {march} ({NOTE})")
    assert _placed(model, (x, m), "nash")["masked_softmax"] == ("bpu", f"masked_softmax supported on nash ({NOTE})")
    cm = qcompiler.compile(model, (x, m), march=march, calib_data=[(x, m)], progress=False)
    assert not [mod for mod in cm.converted.modules() if isinstance(mod, qnn.QuantizedMaskedSoftmax)]
    path = tmp_path / "model.onnx"
    cm.export_onnx(path)
    s = inference_session(onnx.load(str(path)))
    (o,) = s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), (x, m))})
    with torch.no_grad():
        assert np.array_equal(o, cm(x, m).numpy())


def test_the_float_onnx_rule_equals_the_function(tmp_path):
    """The float export (Where + Softmax) of the fused graph: the function's values, a dead row 0."""
    model = Masked("not", dim=1)
    x, m = torch.randn(2, 6, 4), _mask((2, 6, 6), 8)
    m[0, :, 2] = False  # column 2 of batch 0 all filled along dim 1
    gm = qcompiler.partition(model.eval(), (x, m), march="bayes")
    assert [n for n in gm.graph.nodes if n.target is masked_softmax]
    path = tmp_path / "f.onnx"
    qcompiler.onnx.export_to_onnx(gm, (x, m), str(path))
    s = inference_session(onnx.load(str(path)))
    (o,) = s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), (x, m))})
    with torch.no_grad():
        ref = gm(x, m)
    assert (ref[0, :, 2] == 0).all()
    np.testing.assert_allclose(o, ref.numpy(), rtol=0, atol=1e-6)  # ORT's Softmax vs torch's: float32 rounding
