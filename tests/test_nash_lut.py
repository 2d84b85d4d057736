"""Table kernels on nash: erf, log, sqrt, rsqrt, reciprocal, mish and pow with a Python-number exponent.

Each function is one :class:`QuantizedLookup` (``passes/convert_rules/lut.py``), lowered to the ``lut``
kind. Checked here:

* placement: on the BPU on nash, on the CPU on bayes and bernoulli2 (no row); pow only with a
  tensor base and a number exponent (a tensor exponent, or a number to a tensor power, stays on CPU);
* the domain choices (docs/marches.md, "Table kernels"): the table entry off the function's domain;
* bit for bit: the converted module == the BPU simulator == onnxruntime on the integer export, over
  random shapes, scales and inputs that include the domain edges (negatives, 0, saturation), int8
  and int16; and hand-built tables of every in / out dtype pair against the simulator and the export;
* accuracy: the table's SQNR against the float op on in-domain inputs, above explicit thresholds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from test_bpu_reference import Tiny, check_all

import qcompiler
from qcompiler.backends.onnx import emit_graph
from qcompiler.errors import ConfigError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REASON, META_TENSOR, TensorInfo
from qcompiler.march import March
from qcompiler.nn import quantized as qnn
from qcompiler.onnx import inference_session
from qcompiler.passes.base import CompileContext
from qcompiler.passes.convert_rules.lut import LUT_FUNCTIONS, table_function
from qcompiler.passes.place import place
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.quantization.qtensor import QTensor

# name -> (the float call as a model writes it, the canonical op, an in-domain range for accuracy)
FUNCTIONS = {
    "erf": (torch.erf, "erf", (-3.0, 3.0)),
    "log": (torch.log, "log", (0.05, 4.0)),
    "sqrt": (lambda x: x.sqrt(), "sqrt", (0.0, 4.0)),
    "rsqrt": (torch.rsqrt, "rsqrt", (0.25, 4.0)),
    "reciprocal": (lambda x: x.reciprocal(), "reciprocal", (0.25, 4.0)),
    "mish": (F.mish, "mish", (-4.0, 4.0)),
    "square": (lambda x: x ** 2, "pow", (-2.0, 2.0)),
    "cube": (lambda x: torch.pow(x, 3), "pow", (-2.0, 2.0)),
    "pow_half": (lambda x: x.pow(0.5), "pow", (0.0, 4.0)),
    "pow_neg": (lambda x: torch.pow(x, exponent=-1.5), "pow", (0.25, 4.0)),
}

# SQNR (dB) of the compiled model against the float function on in-domain inputs (min/max calibration on
# the same data, seed 0; tests/test_nash_lut.py::test_sqnr_against_the_float_function). Measured values at
# the commit named in docs/marches.md; thresholds a few dB below them
SQNR_MIN = {  # thresholds: the measured value minus 3 dB, rounded down
    "qint8": {"cube": 37, "erf": 43, "log": 30, "mish": 40, "pow_half": 40, "pow_neg": 24, "reciprocal": 29,
              "rsqrt": 37, "sqrt": 40, "square": 39},
    "qint16": {"cube": 85, "erf": 91, "log": 78, "mish": 88, "pow_half": 87, "pow_neg": 72, "reciprocal": 77,
               "rsqrt": 85, "sqrt": 87, "square": 87},
}


class Fn(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return FUNCTIONS[self.name][0](x)


def _compile(name: str, calib: torch.Tensor, dtype: str):
    qconfig = {"": get_default_calib_qconfig(dtype=dtype, observer="minmax")}
    return qcompiler.compile(Fn(name).eval(), (calib[:3],), calib_data=[(calib,)], march="nash",
                             qconfig_dict=qconfig, progress=False)


def _lookups(cm) -> list[qnn.QuantizedLookup]:
    return [m for m in cm.converted.modules() if isinstance(m, qnn.QuantizedLookup)]


def _onnx(cm) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as d:
        cm.export_onnx(Path(d) / "m.onnx")
        model = onnx.load(str(Path(d) / "m.onnx"))
    onnx.checker.check_model(model, full_check=True)
    return model


def _run_onnx(model: onnx.ModelProto, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(inference_session(model).run(None, {model.graph.input[0].name: x.numpy()})[0])


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10((ref ** 2).sum() / ((ref - got) ** 2).sum()))


# ---------------------------------------------------------------------------------------------- placement


def _placed(model: nn.Module, inputs: tuple, march: str) -> dict[str, tuple[str, str]]:
    """Node name -> (placement, reason) of the op nodes, on ``march``."""
    gm = trace(model)
    propagate_shapes(gm, inputs)
    place(gm, CompileContext(march=March(march), example_inputs=inputs))
    return {n.name: (n.meta[META_PLACEMENT], n.meta[META_REASON]) for n in gm.graph.nodes if META_PLACEMENT in n.meta}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_tables_run_on_nash_and_on_the_cpu_elsewhere(name):
    x = torch.rand(2, 16) + 0.5
    op = FUNCTIONS[name][1]
    for march, want in (("nash", ("bpu", f"{op} supported on nash")),
                        ("bayes", ("cpu", f"{op} is not supported on bayes")),
                        ("bernoulli2", ("cpu", f"{op} is not supported on bernoulli2"))):
        (got,) = [v for k, v in _placed(Fn(name), (x,), march).items() if k.startswith(op)]
        assert got == want, march


def test_pow_with_a_tensor_exponent_or_a_number_base_stays_on_the_cpu():
    class Pows(nn.Module):
        def forward(self, x, y):
            return torch.pow(x, y), 2 ** x, x.pow(y.abs()), x ** 2.5

    x = torch.rand(2, 16) + 0.5
    got = _placed(Pows(), (x, x), "nash")  # fx names them pow_1 .. pow_4 in call order
    tensor_exponent = ("cpu", "pow: the exponent is a tensor; a table needs a Python-number exponent on nash")
    assert got["pow_1"] == tensor_exponent and got["pow_3"] == tensor_exponent
    assert got["pow_2"] == ("cpu", "pow: the base is not a tensor (a number raised to a tensor has no table "
                                   "of x ** c) on nash")
    assert got["pow_4"] == ("bpu", "pow supported on nash")


def test_a_tensor_exponent_compiles_with_pow_on_the_cpu():
    class TensorPow(nn.Module):
        def forward(self, x):
            return torch.pow(x, x.abs() + 1).sigmoid()

    x = torch.rand(4, 16) + 0.5
    cm = qcompiler.compile(TensorPow().eval(), (x[:1],), calib_data=[(x,)], march="nash", progress=False)
    assert _lookups(cm) and all(m.qc_op != "pow" for m in _lookups(cm))
    assert "cpu" in [p["placement"] for p in cm.partitions]


# ---------------------------------------------------------------------------------------------- domain choices


def test_build_lut_refuses_the_raw_functions_off_their_domain():
    """Why the table functions are defined on the whole grid: torch's own give NaN below 0."""
    for raw in (torch.log, torch.sqrt, torch.rsqrt, lambda x: torch.pow(x, 0.5)):
        with pytest.raises(ConfigError, match="NaN"):
            fp.build_lut(raw, 0.05, 0.05, "qint8", "qint8")


@pytest.mark.parametrize("out_dtype", ["qint8", "qint16"])
def test_table_entries_off_the_domain(out_dtype):
    lo, hi = fp.qrange(out_dtype)
    s_in = 0.03125  # inputs -4 .. 3.97; grid 0 is code 0 (index 128)
    s_out = 0.05 if out_dtype == "qint8" else 0.05 / 256  # log and rsqrt of the positive codes in range
    codes = torch.arange(-128, 128)

    def table(op, exponent=None):
        return fp.build_lut(table_function(op, exponent), s_in, s_out, "qint8", out_dtype).to(torch.int64)

    neg, zero, pos = codes < 0, codes == 0, codes > 0
    assert (table("log")[neg | zero] == lo).all() and (table("log")[pos] > lo).all()
    assert (table("rsqrt")[neg | zero] == hi).all() and (table("rsqrt")[pos] < hi).all()
    assert (table("sqrt")[neg | zero] == 0).all() and (table("sqrt")[pos] > 0).all()
    r = table("reciprocal")
    assert int(r[zero]) == hi and (r[neg] < 0).all() and (r[pos] > 0).all()
    assert (table("pow", 0.5)[neg | zero] == 0).all()
    assert (table("pow", -1.5)[neg | zero] == hi).all()
    odd = table("pow", 3)  # an integer exponent: x ** 3 everywhere (odd: negative below 0)
    assert (odd[neg] <= 0).all() and (odd[codes < -10] < 0).all() and int(odd[zero]) == 0
    assert (table("pow", -1)[zero] == hi).all() and (table("pow", -1)[neg] < 0).all()
    # in the domain the entry is the rounded function
    x = codes[pos].double() * s_in
    want = fp._clamp_to(torch.round(torch.log(x) / s_out), out_dtype).to(torch.int64)
    assert torch.equal(table("log")[pos], want)


def test_every_lut_function_is_defined_on_every_code_of_a_wide_grid():
    """No NaN anywhere on a symmetric int16 grid, whatever the sign (what build_lut requires)."""
    for op in LUT_FUNCTIONS:
        for exponent in ((2, 3, 0.5, -1, -1.5, 0) if op == "pow" else (None,)):
            t = fp.build_lut(table_function(op, exponent), 1e-3, 1e-2, "qint16", "qint16")
            assert t.numel() == 65536 and t.dtype == torch.int16


# ---------------------------------------------------------------------------------------------- bit-exact


def _edge_inputs(g: torch.Generator, shape, calib: torch.Tensor) -> torch.Tensor:
    """Random values over twice the calibrated range (saturation both ways) with zeros and negatives."""
    amax = float(calib.abs().max())
    x = (torch.rand(shape, generator=g) * 4 - 2) * amax
    flat = x.flatten()
    k = min(4, flat.numel())
    flat[:k] = torch.tensor([0.0, -amax, amax, -1e-6])[:k]
    return flat.reshape(shape)


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_module_simulator_and_onnx_agree_bit_for_bit(name, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rank = int(torch.randint(1, 6, (1,), generator=g))
    shape = tuple(int(d) for d in torch.randint(1, 6, (rank,), generator=g))
    lo, hi = FUNCTIONS[name][2]
    span = float(torch.empty(()).uniform_(0.5, 2.0, generator=g))  # the calibrated range varies with the seed
    calib = lo * span + torch.rand((4,) + shape[1:], generator=g) * (hi - lo) * span
    cm = _compile(name, calib, dtype)
    (m,) = _lookups(cm)
    assert m.qc_op == FUNCTIONS[name][1] and m.in_dtype == dtype and m.table.dtype == fp.storage_dtype(dtype)
    assert [p["placement"] for p in cm.partitions] == ["bpu"]
    x = _edge_inputs(g, (3,) + shape[1:], calib)
    with torch.no_grad():
        converted = cm.converted(x)
    assert isinstance(converted, torch.Tensor)
    simulated = cm(x)
    model = _onnx(cm)
    kinds = [n.op_type for n in model.graph.node]
    assert "Gather" in kinds and not {"Erf", "Log", "Sqrt", "Reciprocal", "Pow", "Softplus", "Tanh"} & set(kinds)
    exported = _run_onnx(model, x)
    assert torch.equal(simulated, converted), f"simulator != module: {int((simulated != converted).sum())}"
    assert torch.equal(exported, simulated), f"onnx != simulator: {int((exported != simulated).sum())}"


def _lookup_graph(op: str, exponent, in_scale: float, in_dtype: str, out_scale: float, out_dtype: str, ints):
    t = Tiny()
    x = t.input(ints, in_scale, in_dtype)
    m = qnn.QuantizedLookup(op, table_function(op, exponent), in_scale, in_dtype, out_scale, out_dtype,
                            exponent=exponent)
    return t, t.build(t.call(m, x)), m


def _emit(gm: fx.GraphModule, x: torch.Tensor, in_dtype: str, out_dtype: str) -> onnx.ModelProto:
    """The integer export of a hand-built graph (shape propagation does not type QTensor values: the
    quantized nodes are given theirs, as convert's would be)."""
    propagate_shapes(gm, (x,))
    for n in gm.graph.nodes:
        if n.op == "call_module":
            dtype = in_dtype if isinstance(gm.get_submodule(n.target), qnn.Quantize) else out_dtype
            n.meta[META_TENSOR] = TensorInfo(tuple(x.shape), "i8" if dtype == "qint8" else "i16")
        elif n.op == "output":
            n.meta[META_TENSOR] = TensorInfo(tuple(x.shape), "f32")
    model = emit_graph(gm, quantize=True)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("in_dtype,out_dtype", [("qint8", "qint8"), ("qint8", "qint16"), ("qint16", "qint16"),
                                                ("qint16", "qint8")])
@pytest.mark.parametrize("op,exponent", [("erf", None), ("log", None), ("rsqrt", None), ("pow", -1.5), ("pow", 3)])
def test_every_table_dtype_pair_exports_as_the_simulator(op, exponent, in_dtype, out_dtype):
    """A table of each in / out type: module == simulator == integer reference (check_all) ==
    onnxruntime on the export, on every input code; the table initializer has the output's type."""
    qlo, qhi = fp.qrange(in_dtype)
    ints = torch.arange(qlo, qhi + 1).reshape(1, -1)
    in_scale = 4.0 / qhi
    out_scale = 2.0 / fp.qrange(out_dtype)[1]
    t, gm, m = _lookup_graph(op, exponent, in_scale, in_dtype, out_scale, out_dtype, ints)
    check_all(gm, t)
    x = t.inputs[0]
    model = _emit(gm, x, in_dtype, out_dtype)
    onnx.checker.check_model(model, full_check=True)
    (table,) = [i for i in model.graph.initializer if i.name.endswith(".table")]
    assert onnx.numpy_helper.to_array(table).dtype == (np.int8 if out_dtype == "qint8" else np.int16)
    assert np.array_equal(onnx.numpy_helper.to_array(table), m.table.numpy())
    with torch.no_grad():
        want = gm(x)
    assert isinstance(want, QTensor)
    got = _run_onnx(model, x)
    assert torch.equal(got, want.dequantize()), f"{int((got != want.dequantize()).sum())} of {got.numel()} differ"


def test_int16_input_between_codes_rounds_as_the_entry_quantizer():
    """int16 input is float in opset 11: the export quantizes it as the simulator's entry does
    (float32 division, round half to even), ties included."""
    in_scale = 0.25
    ints = torch.arange(-40, 40).reshape(1, -1)
    t, gm, _ = _lookup_graph("sqrt", None, in_scale, "qint16", 1e-3, "qint16", ints)
    x = torch.cat([t.inputs[0], t.inputs[0] + 0.125, t.inputs[0] - 0.125, t.inputs[0] + 0.1]).reshape(1, -1)
    model = _emit(gm, x, "qint16", "qint16")
    with torch.no_grad():
        want = gm(x).dequantize()
    assert torch.equal(_run_onnx(model, x), want)


def test_pow_keeps_its_exponent_for_the_float_view():
    """The float export (not quantizing) calls the function with the module's exponent."""
    ints = torch.arange(0, 100).reshape(1, -1)
    t, gm, m = _lookup_graph("pow", 3.0, 0.02, "qint8", 0.1, "qint8", ints)
    assert m.exponent == 3.0
    x = t.inputs[0]
    propagate_shapes(gm, (x,))
    model = emit_graph(gm, quantize=False)
    got = _run_onnx(model, x)
    assert torch.allclose(got, x ** 3, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_sqnr_against_the_float_function(name, dtype):
    g = torch.Generator().manual_seed(0)
    lo, hi = FUNCTIONS[name][2]
    x = lo + torch.rand(8, 256, generator=g) * (hi - lo)
    cm = _compile(name, x, dtype)
    sqnr = _sqnr(FUNCTIONS[name][0](x.double()), cm(x))
    assert sqnr >= SQNR_MIN[dtype][name], f"{name} {dtype}: SQNR {sqnr:.1f} dB < {SQNR_MIN[dtype][name]}"
