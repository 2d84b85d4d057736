"""softmax / log_softmax on the BPU of nash: placement (nash vs bayes / bernoulli2, the negative cases),
the one integer definition (``fixed_point.int_softmax`` / ``int_log_softmax``) computed identically
by the converted module, the simulator and the integer ONNX export in onnxruntime (bit for bit, over
random shapes of 2..5 dims, every axis and its negative spelling, int8 and int16, fixed seeds), its
accuracy against float softmax (stated SQNR and LSB bounds), row sums, and an attention block.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.backends.bpu import constraints as c
from qcompiler.backends.bpu.lower import lower_bpu_partitions
from qcompiler.backends.bpu.op_info import OpInfo
from qcompiler.backends.bpu.program import BpuOp, BpuProgram, ValueSpec
from qcompiler.backends.bpu.program_check import check_program
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import inference_session
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.quantization.qtensor import QTensor
from test_nash_table import placed

# ---------------------------------------------------------------------------------------- placement


class Spellings(nn.Module):
    """Every spelling of softmax and log_softmax, with positive, negative and keyword dims."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.sm, self.lsm = nn.Softmax(dim=-1), nn.LogSoftmax(1)

    def forward(self, x):
        y = self.lin(x)
        return (F.softmax(y, dim=-1), torch.softmax(y, 1), y.softmax(-2), self.sm(y),
                F.log_softmax(y, -1), torch.log_softmax(y, dim=0), y.log_softmax(2), self.lsm(y))


SPELLED = ("softmax", "softmax_1", "softmax_2", "sm", "log_softmax", "log_softmax_1", "log_softmax_2", "lsm")


def test_every_spelling_runs_on_nash():
    p = placed(Spellings(), torch.rand(2, 3, 8), "nash")
    for name in SPELLED:
        op = "log_softmax" if "l" in name.replace("softmax", "") or name.startswith("log") else "softmax"
        assert p[name] == ("bpu", f"{op} supported on nash"), name


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_older_marches_keep_softmax_on_the_cpu(march):
    p = placed(Spellings(), torch.rand(2, 3, 8), march)
    for name in SPELLED:
        assert p[name][0] == "cpu" and p[name][1].endswith(f"is not supported on {march}"), (name, p[name])


def test_softmax_without_dim_or_with_a_dtype_stays_on_the_cpu():
    class NoDim(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.sm = nn.Linear(8, 8), nn.Softmax()

        def forward(self, x):
            y = self.lin(x)
            return self.sm(y), F.log_softmax(y, -1, dtype=torch.float64), F.softmax(y, -1)

    with pytest.warns(UserWarning):
        p = placed(NoDim(), torch.rand(2, 8), "nash")
    assert p["sm"] == ("cpu", "softmax: softmax without dim (torch's implicit dim is deprecated); give dim=... on nash")
    assert p["log_softmax"] == ("cpu", "log_softmax: log_softmax with dtype=torch.float64 (the BPU computes on the "
                                       "quantized input) on nash")
    assert p["softmax"][0] == "bpu"


def _info(shape, dim, op="softmax", dtype=None):
    return OpInfo(None, op, None, [shape], [shape], {"dim": dim, "dtype": dtype})


def test_the_softmax_constraint_as_data():
    rule = c.softmax_call(fp.SOFTMAX_MAX_LEN)
    assert rule(_info((2, 65536), -1)) is None
    assert rule(_info((2, 65537), 1)) == "softmax axis of 65537 elements > 65536"
    assert rule(_info((2, 8), 2)) == "softmax dim 2 out of range for (2,8)"
    assert rule(_info((2, 8), 1.0)) == "softmax dim 1.0 is not a constant int"
    assert rule(_info((2, 8), None, "log_softmax")).startswith("log_softmax without dim")
    assert "axis <= 65536" in rule.describe


# ------------------------------------------------------------------------- the integer definition


def _kernel(op, q, dim, s_in, s_out, dtype, out_dtype=None):
    out_dtype = out_dtype or dtype
    table = fp.softmax_exp_table(s_in, dtype)
    if op == "softmax":
        M, n = fp.softmax_params(s_out)
        return fp.int_softmax(q, dim, table, M, n, out_dtype)
    M, n, lk, lf = fp.log_softmax_params(s_in, s_out)
    return fp.int_log_softmax(q, dim, table, M, n, lk, lf, out_dtype)


def test_softmax_matches_its_definition_in_python_integers():
    """A row computed with Python ints from the stated formula equals the kernel."""
    s_in, s_out = 0.07, 1 / 127
    q = torch.tensor([[-128, -3, 0, 5, 127, 126, -100, 64]], dtype=torch.int8)
    table = fp.softmax_exp_table(s_in, "qint8")
    M, n = fp.softmax_params(s_out)
    row = q[0].tolist()
    E = [int(table[min(max(row) - v, len(table) - 1)]) for v in row]
    S = sum(E)
    want = [min(127, (e * M + (S << n) // 2) // (S << n)) for e in E]
    assert fp.int_softmax(q, -1, table, M, n, "qint8")[0].tolist() == want
    assert int(table[0]) == 1 << fp.SOFTMAX_EXP_BITS
    assert int(table[-1]) == 0 and int(table[-2]) > 0  # cut after its first zero


def test_log_softmax_matches_its_definition_in_python_integers():
    s_in, s_out = 0.05, 0.04
    q = torch.tensor([[-128, -3, 0, 5, 127, 126, -100, 64, 7]], dtype=torch.int8)
    table = fp.softmax_exp_table(s_in, "qint8")
    M, n, lk, lf = fp.log_softmax_params(s_in, s_out)
    row = q[0].tolist()
    d = [max(row) - v for v in row]
    S = sum(int(table[min(x, len(table) - 1)]) for x in d)
    k = S.bit_length() - 1
    r = ((S + (1 << (k - 16))) >> (k - 15)) - (1 << 15)
    want = [max(-128, -((int(lk[k - 16]) + int(lf[r]) + x * M + (1 << (n - 1))) >> n)) for x in d]
    assert fp.int_log_softmax(q, -1, table, M, n, lk, lf, "qint8")[0].tolist() == want


def _sqnr(y, ref) -> float:
    return float(10 * torch.log10((ref ** 2).sum() / ((y - ref) ** 2).sum()))


# (dtype, axis length, s_in, SQNR floor in dB for softmax at s_out = 1/qmax, for log_softmax at
# s_out = -min / 2**(bits-1)); measured: int8 46.3 / 46.6 dB, int16 85.9 / 96.2 dB (seed 0)
SQNR_CASES = [("qint8", 8, 0.1, 46.0, 46.0), ("qint16", 64, 1e-3, 85.0, 95.0)]


@pytest.mark.parametrize("dtype,length,s_in,sm_floor,lsm_floor", SQNR_CASES)
def test_accuracy_against_float(dtype, length, s_in, sm_floor, lsm_floor):
    """Each output is within 0.5 LSB (int8) / 1.5 LSB (int16: the 16-bit exponential table; measured
    <= 1.28 LSB over axes of 8..4096 and s_in 1e-4..3e-3) of the exact value, and the SQNR is within 0.5 dB (int8) / 2 dB (int16) of rounding the exact value."""
    lo, hi = fp.qrange(dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(lo, hi + 1, (64, length), generator=g).to(fp.storage_dtype(dtype))
    x = q.double() * s_in
    lsb = 0.5 + 1e-6 if dtype == "qint8" else 1.5
    slack = 0.5 if dtype == "qint8" else 2.0
    for op, ref, s_out, floor in (
        ("softmax", torch.softmax(x, -1), 1 / hi, sm_floor),
        ("log_softmax", torch.log_softmax(x, -1), None, lsm_floor),
    ):
        s_out = s_out or float(-ref.min()) / -lo
        y = _kernel(op, q, -1, s_in, s_out, dtype).double() * s_out
        ideal = (ref / s_out).round().clamp(lo, hi) * s_out
        assert float((y - ref).abs().max()) / s_out <= lsb, op
        assert _sqnr(y, ref) >= floor, (op, _sqnr(y, ref))
        assert _sqnr(y, ref) >= _sqnr(ideal, ref) - slack, op


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("length", [2, 17, 300])
def test_rows_sum_to_one_within_half_an_lsb_per_element(dtype, length):
    """sum(E / S) is exactly 1, so a row of codes sums to 1 within length * s_out / 2 (plus the 2**-24
    relative error of M / 2**n); checked at the fixed grid 1 / qmax."""
    lo, hi = fp.qrange(dtype)
    g = torch.Generator().manual_seed(length)
    q = torch.randint(lo, hi + 1, (32, length), generator=g).to(fp.storage_dtype(dtype))
    s_out = 1 / hi
    for s_in in (0.003, 0.03, 0.3):
        p = _kernel("softmax", q, 1, s_in * (128 / (hi + 1)), s_out, dtype).double() * s_out
        err = (p.sum(1) - 1).abs().max()
        assert float(err) <= length * s_out / 2 + 2 ** -20
        assert float(p.min()) >= 0 and float(p.max()) <= 1


def test_the_kernel_refuses_what_its_bounds_do_not_cover():
    table = fp.softmax_exp_table(0.1, "qint8")
    M, n = fp.softmax_params(1 / 127)
    with pytest.raises(ConfigError, match="65537 elements > 65536"):
        fp.int_softmax(torch.zeros(1, 65537, dtype=torch.int8), 1, table, M, n)
    with pytest.raises(ConfigError, match="dim 2 is out of range"):
        fp.int_softmax(torch.zeros(2, 3, dtype=torch.int8), 2, table, M, n)
    with pytest.raises(ConfigError, match="softmax_params"):
        fp.int_softmax(torch.zeros(2, 3, dtype=torch.int8), 1, table, 0, n)
    with pytest.raises(ConfigError, match="qint8 or qint16"):
        fp.softmax_exp_table(0.1, "qint32")


def test_program_check_refuses_a_softmax_op_outside_the_bounds():
    def program(M):
        op = BpuOp("softmax", ["x"], "y", {"dim": 1, "in_dtype": "qint8", "out_dtype": "qint8",
                                           "out_scale": 1 / 127, "out_axis": None},
                   {"table": fp.softmax_exp_table(0.1, "qint8"), "M": torch.tensor(M), "n": torch.tensor(17)})
        return BpuProgram("p", [ValueSpec("x", "qint8", 0.1)], [ValueSpec("y", "qint8", 1 / 127)], [op])

    check_program(program(fp.softmax_params(1 / 127)[0]))
    with pytest.raises(ArtifactError, match="tensor 'M' holds values"):
        check_program(program(1 << 24))


# ----------------------------------------------------- module == simulator == onnxruntime, bit for bit


_SPELL = [
    lambda x, d: F.softmax(x, d), lambda x, d: torch.softmax(x, dim=d), lambda x, d: x.softmax(d),
    lambda x, d: F.log_softmax(x, dim=d), lambda x, d: torch.log_softmax(x, d), lambda x, d: x.log_softmax(d),
]


class EveryAxis(nn.Module):
    """softmax and log_softmax along every axis of a rank-``rank`` input, each axis by its positive and
    its negative number, spellings taken in turn."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.sm = nn.ModuleList([nn.Softmax(d) for d in range(rank)])

    def forward(self, x):
        outs, k = [], 0
        for d in range(-self.rank, self.rank):
            outs.append(_SPELL[k % 3](x, d))
            outs.append(_SPELL[3 + k % 3](x, d))
            k += 1
        return tuple(outs) + tuple(m(x) for m in self.sm)


def _compile(model, example, calib, dtype):
    qc = get_default_calib_qconfig(dtype, observer="minmax")
    qconfig = {"": qc, "module_type": [(type(model), qc)]}  # dtype on the kernels too, not nash's default
    return qcompiler.compile(model.eval(), (example,), march="nash", calib_data=[(b,) for b in calib],
                             qconfig_dict=qconfig, progress=False)


def _flat(y):
    if isinstance(y, QTensor):
        return [y.dequantize()]
    if isinstance(y, torch.Tensor):
        return [y]
    return [t for v in y for t in _flat(v)]


def assert_three_ways_equal(cm, x, tmp_path, kinds=("softmax", "log_softmax")) -> list[torch.Tensor]:
    """The converted module, the simulator (``cm``) and onnxruntime on the export give the same floats
    (the same codes on the same grids), through the integer kernels: the programs hold the softmax
    kinds and the export no float Softmax / LogSoftmax."""
    programs = lower_bpu_partitions(cm.converted)
    made = {op.kind for p in programs.values() for op in p.ops}
    assert set(kinds) <= made
    with torch.no_grad():
        module = _flat(cm.converted(x))
        sim = _flat(cm(x))
    path = tmp_path / "model.onnx"
    cm.export_onnx(path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert not {n.op_type for n in model.graph.node} & {"Softmax", "LogSoftmax"}
    s = inference_session(model)
    ort = s.run(None, {s.get_inputs()[0].name: x.numpy()})
    assert len(module) == len(sim) == len(ort)
    for i, (a, b, o) in enumerate(zip(module, sim, ort)):
        assert torch.equal(a, b), f"output {i}: module != simulator"
        assert o.shape == tuple(a.shape) and np.array_equal(o, a.numpy()), \
            f"output {i}: onnxruntime != module ({int(np.sum(o != a.numpy()))}/{o.size} differ)"
    return module


def _random_case(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed)
    shape = [int(torch.randint(1, 3, (), generator=g))] + [int(torch.randint(2, 7, (), generator=g))
                                                          for _ in range(rank - 1)]
    gain = 10 ** float(torch.empty(()).uniform_(-1.0, 1.3, generator=g))
    calib = [torch.randn(shape, generator=g) * gain for _ in range(2)]
    # beyond the calibrated range too: clamped inputs and probabilities above the observed max
    x = torch.randn(shape, generator=g) * gain * 1.3
    return calib, x


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_axis_of_random_shapes_bit_exact(seed, rank, dtype, tmp_path):
    calib, x = _random_case(100 * seed + rank, rank)
    cm = _compile(EveryAxis(rank), x, calib, dtype)
    assert cm.summary().splitlines()[0].endswith("1 bpu, 0 cpu partitions; BPU<->CPU boundary edges: 0")
    outs = assert_three_ways_equal(cm, x, tmp_path)
    # and it is softmax: each output within the kernel's LSB bound of the float op on the quantized input
    gm = cm.converted
    (entry,) = [gm.get_submodule(n.target) for n in gm.graph.nodes
                if n.op == "call_module" and isinstance(gm.get_submodule(n.target), qnn.Quantize)]
    mods = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), (qnn.QuantizedSoftmax, qnn.QuantizedLogSoftmax))]
    xq = fp.dequantize(fp.quantize(x, entry.scale, dtype), entry.scale).double()
    # 0.5 LSB of rounding plus the 16-bit exponential table's (and 15-bit log mantissa's) error
    lsb = 0.55 if dtype == "qint8" else 1.5
    lo, hi = fp.qrange(dtype)
    assert len(mods) == len(outs)
    for i, (y, r, m) in enumerate(zip(outs, EveryAxis(rank)(xq), mods)):
        r = r.clamp(lo * m.out_scale, hi * m.out_scale)  # beyond the calibrated range the grid saturates
        assert float((y.double() - r).abs().max()) <= lsb * m.out_scale + 1e-6, (i, type(m).__name__)


class Attention(nn.Module):
    """Scores ``q k^T / sqrt(d)`` of shape [B, H, L, L] (a matmul of two feature maps), softmax(-1), ``@ v``."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def split(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.h, self.dk).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dk))
        return torch.matmul(scores.softmax(-1), v)


def test_attention_scores_softmax_runs_on_nash_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = Attention().eval()
    calib = [torch.randn(2, 12, 16) for _ in range(3)]
    x = torch.randn(2, 12, 16)
    assert placed(model, x, "nash")["softmax"] == ("bpu", "softmax supported on nash")
    assert placed(model, x, "bayes")["softmax"] == ("cpu", "softmax is not supported on bayes")
    cm = _compile(model, x, calib, "qint8")
    assert cm.summary().splitlines()[0].endswith("1 bpu, 0 cpu partitions; BPU<->CPU boundary edges: 0")
    (y,) = assert_three_ways_equal(cm, x, tmp_path, kinds=("softmax", "matmul"))
    with torch.no_grad():
        ref = model(x)
    assert _sqnr(y.double(), ref.double()) >= 30.0  # measured 36.0 dB: the whole int8 block against float


def test_the_softmax_module_reads_its_grid_from_the_output_observer():
    calib, x = _random_case(7, 3)
    cm = _compile(EveryAxis(3), x, calib, "qint8")
    mods = [m for m in cm.converted.modules() if isinstance(m, (qnn.QuantizedSoftmax, qnn.QuantizedLogSoftmax))]
    assert len(mods) == 2 * 6 + 3 and all(0 <= m.dim < 3 for m in mods)
    for m in mods:
        if isinstance(m, qnn.QuantizedSoftmax):  # min/max observer on [0, 1]: max(p) / 127 <= 1 / 127
            assert 0 < m.out_scale <= 1 / 127 + 1e-12
        else:
            assert m.out_scale > 0
