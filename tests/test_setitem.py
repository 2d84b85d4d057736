"""``x[index] = value`` (qcompiler/ir/setitem.py): traced where torch.fx refuses it, written out of place
(passes/out_of_place.py) unless an alias reads the write, emitted to ONNX (rules/index.py ``setitem``),
compiled end to end instead of the whole model falling back to eager torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from test_onnx_arith import check, emit

import qcompiler
from qcompiler.errors import QCompilerWarning, UnsupportedOpError
from qcompiler.ir import trace
from qcompiler.ir.setitem import setitem, setitem_
from qcompiler.quantization import convert_fx, prepare_calibration_fx


def _targets(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


class Head(nn.Module):
    """A detection head's decode: slices scaled, a channel set, a mask clipped, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)
        self.c1 = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        y = self.c1(torch.relu(self.c0(x))).sigmoid()
        y[:, 0:2] = y[:, 0:2] * 2 - 0.5
        y[:, 2:4] *= 4
        y[:, 5] = 0.25
        y[y > 0.9] = 1.0
        return y


class AliasRead(nn.Module):
    """A view taken before the write and read after it: the write must reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.c0(x)
        v = y[:, :4]
        y[:, 2:6] = 0.0
        return torch.atan(v) + 1


class TransposedWrite(nn.Module):
    """A write through a transpose (no write-back known) with the base read after it."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)
        self.c1 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.c0(x) - 0.5
        v = y.transpose(2, 3)
        v.mul_(2)
        return self.c1(y)


torch.manual_seed(0)
X = torch.rand(2, 3, 8, 8)
DATA = [torch.rand(2, 3, 8, 8) for _ in range(4)]


def test_tracing_records_item_assignment():
    """torch.fx raises "'Proxy' object does not support item assignment"; the statement is a node now,
    ``y[i] *= 2`` being Python's ``y[i] = y[i] * 2``."""
    gm = trace(Head().eval())
    assert _targets(gm) == ["relu", "getitem", "mul", "sub", "setitem_", "getitem", "mul", "setitem_",
                            "setitem_", "gt", "setitem_"]
    torch.manual_seed(1)
    m = Head().eval()
    assert torch.equal(trace(m)(X), m(X))


def test_setitem_functions():
    x = torch.arange(6.0).reshape(2, 3)
    y = setitem(x, (slice(None), 1), 7.0)
    assert torch.equal(y, torch.tensor([[0.0, 7.0, 2.0], [3.0, 7.0, 5.0]]))
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3))  # out of place
    assert setitem_(x, 0, -1.0) is x and torch.equal(x[0], torch.full((3,), -1.0))


def test_writes_go_out_of_place_and_the_calibration_model_is_exact():
    m = Head().eval()
    cal = prepare_calibration_fx(m, example_inputs=(X,), hybrid=True)
    names = _targets(cal)
    assert names.count("setitem") == 4 and "setitem_" not in names, names
    assert torch.equal(cal(X), m(X))


def test_a_view_read_after_the_write_is_made_again_from_it():
    """``v = y[:, :4]`` read after ``y[:, 2:6] = 0`` reads ``v`` made again from the write's result, so
    the write goes out of place and the old view, unread, is gone."""
    m = AliasRead().eval()
    cal = prepare_calibration_fx(m, example_inputs=(X,), hybrid=True)
    assert _targets(cal) == ["setitem", "getitem", "atan", "add"]
    (again,) = [n for n in cal.graph.nodes if getattr(n.target, "__name__", "") == "getitem"]
    assert getattr(again.args[0].target, "__name__", "") == "setitem"
    assert torch.equal(cal(X), m(X))


def test_a_write_through_a_transpose_stays_in_place_and_is_warned():
    """Negative: no write-back is known for a transpose, so the write stays in place (the calibration
    model is eager's), and convert_fx warns that the BPU stub splits it from ``y``."""
    m = TransposedWrite().eval()
    cal = prepare_calibration_fx(m, example_inputs=(X,), hybrid=True)
    assert [n.target for n in cal.graph.nodes if n.op == "call_method"] == ["transpose", "mul_"]
    assert torch.equal(cal(X), m(X))
    for b in DATA:
        cal(b)
    with pytest.warns(QCompilerWarning, match="alias"):
        convert_fx(cal)


def test_compile_runs_the_head_in_onnxruntime_and_saves(tmp_path):
    """The whole model fell back to eager torch before; now BPU convs, the decode in an onnxruntime
    island, within quantization error of float, and the artifact saves."""
    m = Head().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)
        cm = qcompiler.compile(m, (X,), calib_data=DATA, march="bayes", progress=False)
    assert cm.torch_islands() == {}
    kinds = [s.kind for s in cm.runtime.steps]
    assert "bpu" in kinds and "cpu" in kinds
    with torch.no_grad():
        ref = m(X)
    assert (cm(X) - ref).abs().max().item() < 0.03  # 8-bit sigmoid outputs (scale 1/127), scaled by up to 4
    cal = prepare_calibration_fx(m, example_inputs=(X,), hybrid=True)
    for b in DATA:
        cal(b)
    q = convert_fx(cal)
    assert (q(X) - ref).abs().max().item() < 0.03
    cm.save(tmp_path / "head.qc")
    assert (tmp_path / "head.qc").exists()


def _scaled(a):
    a = a * 1.0
    a[:, 0:2] = a[:, 0:2] * 2 - 0.5
    return a


def _int_index(a):
    a = a * 1.0
    a[:, 5] = 0.25
    return a


def _mask(a):
    a = a * 1.0
    a[a > 0.9] = 1.0
    return a


def _strided(a):
    a = a * 1.0
    a[..., 1:4:2, -1] = a[0, 0, 0, :2].sum()
    return a


def _broadcast_row(a):
    a = a * 1.0
    a[:, 1:3] = a[0, 0, 0]
    return a


def _index_tensor(a):
    a = a * 1.0
    a[:, torch.tensor([4, 0])] = -a[:, 1:3]
    return a


@pytest.mark.parametrize("fn", [_scaled, _int_index, _mask, _strided, _broadcast_row, _index_tensor])
def test_onnx_setitem_matches_torch(fn):
    check(fn, torch.randn(2, 6, 4, 5), atol=0, rtol=0)


def _mask_many(a):
    a = a * 1.0
    a[a > 0.5] = a[0, 0, 0, :2] * 2  # one value per True
    return a


def test_onnx_refuses_a_masked_assignment_of_many_values():
    """One value per True of the mask is no Where: refused (the island then runs in torch)."""
    x = torch.zeros(2, 6, 4, 5)
    x[1, 2, 3, 4] = x[0, 1, 0, 0] = 1.0
    with pytest.raises(UnsupportedOpError, match="more than one element"):
        emit(_mask_many, x)


def test_onnx_refuses_a_boolean_mask_getitem():
    """Negative: ``x[mask]`` was emitted as a Gather of the mask cast to int64 (rows 0 and 1)."""
    with pytest.raises(UnsupportedOpError, match="boolean mask index"):
        emit(lambda a: a[a > 0.5] * 2, torch.randn(2, 6, 4, 5))


def test_compile_of_a_write_an_alias_reads_is_right():
    """The write that stays in place runs in an eager island on a clone; the alias's read is inside
    the island, so it sees the write: within quantization error of float, no warning of a split alias."""
    m = AliasRead().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = qcompiler.compile(m, (X,), calib_data=DATA, march="bayes", progress=False)
    assert not [w for w in caught if "alias" in str(w.message)]
    with torch.no_grad():
        assert (cm(X) - m(X)).abs().max().item() < 0.03


class _DictLeaf(nn.Module):
    def forward(self, y):
        return {"a": y[:, :4], "b": y[:, 4:]}


class DictWrite(nn.Module):
    """``feats["b"] = ...`` on a leaf's dict: recorded, but no tensor write (review: ``dict.clone``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.leaf = nn.Conv2d(3, 8, 3, padding=1), _DictLeaf()

    def forward(self, x):
        feats = self.leaf(self.c(x))
        feats["b"] = feats["b"] * 2
        return torch.cat([feats["a"], feats["b"]], 1)


def test_an_assignment_into_a_dict_stays_as_it_is():
    m = DictWrite().eval()
    cal = prepare_calibration_fx(m, example_inputs=(X,), hybrid=True,
                                 prepare_custom_config_dict={"non_traceable_module_name": ["leaf"]})
    assert "setitem_" in _targets(cal) and "setitem" not in _targets(cal)
    assert torch.equal(cal(X), m(X))


def _uint8_minus_one(a):
    b = (a > 0).to(torch.uint8)
    b[:, 0] = -1  # torch wraps it to 255
    return b


def test_onnx_refuses_a_number_its_integer_dtype_cannot_hold():
    """Negative: numpy refuses -1 as uint8 (an OverflowError from deep inside); a clear refusal instead."""
    with pytest.raises(UnsupportedOpError, match="does not fit uint8"):
        emit(_uint8_minus_one, torch.randn(2, 6, 4, 5))


class _ListLeaf(nn.Module):
    def forward(self, y):
        return [y[:, :4], y[:, 4:]]


class ListWrite(nn.Module):
    """Third review: ``a = feats[0]`` was taken for a view of the list and re-made after the
    assignment (5.0 off eager): a list's element is no view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.leaf = nn.Conv2d(3, 8, 3, padding=1), _ListLeaf()

    def forward(self, x):
        feats = self.leaf(self.c(x))
        a = feats[0]
        feats[0] = feats[1] * 2
        return a + feats[0]


def test_an_element_read_before_an_assignment_into_a_list_keeps_its_value():
    m = ListWrite().eval()
    cal = prepare_calibration_fx(m, example_inputs=(X,), hybrid=True,
                                 prepare_custom_config_dict={"non_traceable_module_name": ["leaf"]})
    assert torch.equal(cal(X), m(X))
