"""The inplace_reads pass (passes/inplace_reads.py): reads of a value after an in-place op on it go
through the op's result.  Golden code before/after, bit-equal outputs of the rewired graph, the cases it
must leave alone, and the pipeline: a converted model that reads a value after ``a.mul_(2.0)``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.errors import PassError
from qcompiler.ir import trace
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.inplace_reads import INPLACE_READS, inplace_reads, verify_inplace_reads
from qcompiler.quantization import convert_fx, prepare_calibration_fx

X = torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(0))


def _run(model: nn.Module):
    gm = trace(copy.deepcopy(model).eval())
    ctx = CompileContext(march=March.BAYES, example_inputs=(X,))
    return gm, ctx, inplace_reads(gm, ctx)


def _body(gm) -> list[str]:
    return [line.strip() for line in gm.code.strip().splitlines()[1:] if line.strip()]


class MulThenRead(nn.Module):
    """``a`` feeds c0, is doubled in place, then read again by atan (the in-place result itself unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 1)
        self.c1 = nn.Conv2d(3, 8, 1)

    def forward(self, x):
        a = x * 1.0
        p = self.c0(a)
        a.mul_(2.0)
        d = torch.atan(a)
        return self.c1(d) + p


class Unchanged(nn.Module):
    """In-place ops whose input nobody reads afterwards, and no in-place op at all."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.act(self.conv(x))
        z = F.relu(y + 1.0)
        return z.add_(1.0)


class ChainAndModules(nn.Module):
    """Two in-place ops on one value and an ``inplace=True`` module between its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        a = x - 0.5
        b = a * 3.0
        a.mul_(2.0)
        a.add_(1.0)
        c = a * 5.0
        self.act(a)
        return b + c + a


def test_reads_after_an_in_place_op_go_through_its_result():
    gm, ctx, res = _run(MulThenRead())
    assert res.modified
    assert _body(gm) == [
        "mul = x * 1.0;  x = None",
        "c0 = self.c0(mul)",
        "mul_ = mul.mul_(2.0);  mul = None",
        "atan = torch.atan(mul_);  mul_ = None",
        "c1 = self.c1(atan);  atan = None",
        "add = c1 + c0;  c1 = c0 = None",
        "return add",
    ]
    verify_inplace_reads(gm, ctx)
    with torch.no_grad():
        assert torch.equal(gm(X), MulThenRead.__call__(_same(gm, MulThenRead()), X))


def _same(gm: torch.fx.GraphModule, fresh: nn.Module) -> nn.Module:
    """``fresh`` with the traced module's parameters (the graph copied them)."""
    fresh.load_state_dict(gm.state_dict())
    return fresh.eval()


def test_chains_and_inplace_modules_rewire_each_later_read_to_the_last_change():
    model = ChainAndModules()
    gm, ctx, res = _run(model)
    assert res.modified
    assert _body(gm) == [
        "sub = x - 0.5;  x = None",
        "mul = sub * 3.0",
        "mul_ = sub.mul_(2.0);  sub = None",
        "add_ = mul_.add_(1.0);  mul_ = None",
        "mul_1 = add_ * 5.0",
        "act = self.act(add_);  add_ = None",
        "add = mul + mul_1;  mul = mul_1 = None",
        "add_1 = add + act;  add = act = None",
        "return add_1",
    ]
    verify_inplace_reads(gm, ctx)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gm(x), model(x))


def test_a_graph_without_reads_after_an_in_place_op_is_left_as_it_is():
    gm0, _, _ = _run(Unchanged())
    before = gm0.code
    gm, ctx, res = _run(Unchanged())
    assert not res.modified and gm.code == before
    verify_inplace_reads(gm, ctx)


def test_the_verifier_names_a_read_after_an_in_place_op():
    gm = trace(MulThenRead().eval())
    ctx = CompileContext(march=March.BAYES, example_inputs=(X,))
    try:
        verify_inplace_reads(gm, ctx)
    except PassError as exc:
        assert "atan" in str(exc) and "mul_" in str(exc)
    else:
        raise AssertionError("the verifier accepted atan reading mul after mul_ changed it")
    assert INPLACE_READS.verify is verify_inplace_reads


def test_a_converted_model_reads_the_value_the_in_place_op_made():
    """Before the pass the converted model computed atan of the undoubled ``a`` (the ``mul_`` was dead code
    there, and the stubs gave atan its own copy): 0.45 off the float model, as far off as the model without
    the ``mul_`` is; now it is within the quantization error of the float model."""
    torch.manual_seed(0)
    model = MulThenRead().eval()
    cal = prepare_calibration_fx(model, example_inputs=(X,), hybrid=True)
    with torch.no_grad():
        assert torch.equal(cal(X), model(X))
        for _ in range(3):
            cal(torch.randn(1, 3, 4, 4))
        cal(X)
        q = convert_fx(cal)
        want = model(X)
        without = model.c1(torch.atan(X)) + model.c0(X)
        err = float((q(X) - want).abs().max())
        assert err < 0.05, err
        assert float((without - want).abs().max()) > 0.3


class FlagOnly(nn.Module):
    """Keeps an ``inplace`` flag it does not act on (as timm's GELU does); untraceable, so a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.inplace = True

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: traced as a whole
            return x
        return F.gelu(x)


class ReadsAroundAFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c0, self.act, self.c1 = nn.Conv2d(3, 4, 1), FlagOnly(), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a = self.c0(x)
        g = self.act(a)
        return self.c1(a) + g  # c1 reads a, not gelu(a)


def test_a_module_of_another_class_with_an_inplace_flag_is_not_taken_for_an_in_place_op():
    """Only torch.nn's own activation and dropout classes write into their input with ``inplace=True``: reading
    ``a`` through the GELU-like leaf computed ``c1(gelu(a))``, 0.88 off the float model, in the calibration model."""
    model = ReadsAroundAFlag().eval()
    cal = prepare_calibration_fx(model, example_inputs=(X,), hybrid=True)
    with torch.no_grad():
        assert torch.equal(cal(X), model(X))


class InPlaceSpellings(nn.Module):
    """In-place methods whose out-of-place twins the BPU and onnxruntime run (qcompiler.ir.ops)."""

    def __init__(self):
        super().__init__()
        self.c0, self.c1 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.c2, self.c3 = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.c0(x)
        y.relu_()
        z = y.mul_(0.5).add_(self.c1(x))
        z.clamp_(0, 6)
        w = torch.atan(z)
        w.atan_()
        return self.c2(z) + self.c3(w)


def test_in_place_spellings_compile_without_a_torch_island_and_save_and_export(tmp_path):
    """They ran as eager-torch islands (no op without the twin), which save and export_onnx refuse."""
    import qcompiler  # the facade: not imported by this module's pass-level tests
    torch.manual_seed(0)
    model = InPlaceSpellings().eval()
    calib = [torch.rand(2, 3, 8, 8) for _ in range(3)]
    x = torch.rand(2, 3, 8, 8)
    ref = model(x.clone())
    cm = qcompiler.compile(model, (x,), march="bayes", calib_data=calib, progress=False)
    assert cm.torch_islands() == {}
    where = {node: step.kind for step in cm.runtime.steps for node in step.nodes}
    assert [where.get(n) for n in ("mul_", "clamp_", "atan", "atan_")] == ["bpu", "bpu", "cpu", "cpu"]
    assert "relu_" not in where and "add_" not in where  # fused: c0 + relu_, c1 + add_
    out = cm(x)
    assert torch.equal(out, cm.converted(x))
    assert (out - ref).abs().max() < 0.05
    cm.save(tmp_path / "m.qc")
    assert torch.equal(qcompiler.load(tmp_path / "m.qc")(x), out)
    cm.export_onnx(tmp_path / "m.onnx")


class FunctionalInPlace(nn.Module):
    """``F.leaky_relu_`` / ``F.elu_`` / ``F.hardtanh_`` live in ``torch._C._nn``, not ``torch``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        a = torch.atan(x)
        b = torch.sin(a)
        self.fn(a)
        return b + torch.cos(a)


@pytest.mark.parametrize("fn", [lambda a: F.leaky_relu_(a, 0.1), F.elu_, lambda a: F.hardtanh_(a, -0.5, 0.5),
                                torch.relu_, F.rrelu_], ids=["leaky_relu_", "elu_", "hardtanh_", "relu_", "rrelu_"])
def test_torch_nn_functional_in_place_functions_are_in_place_ops(fn):
    gm, ctx, res = _run(FunctionalInPlace(fn))
    assert res.modified
    (changed,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target not in (torch.atan, torch.sin,
                                                                                              torch.cos)][:1]
    assert [n.name for n in gm.graph.nodes if n.target is torch.cos][0] in [u.name for u in changed.users]
    verify_inplace_reads(gm, ctx)
    torch.manual_seed(0)
    assert torch.equal(gm(X.clone()), FunctionalInPlace(fn)(X.clone()))
