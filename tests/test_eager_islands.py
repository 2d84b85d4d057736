"""CPU islands in eager torch: what ONNX opset 11 cannot express compiles and runs, is named
in summaries and dumps, and is refused by save (no pickled code) and export (no ONNX form)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.eager import TORCH
from qcompiler.backends.onnx import registry
from qcompiler.backends.onnx.rules import NOT_EMITTED
from qcompiler.errors import ArtifactError, ConfigError, UnsupportedOpError
from qcompiler.quantization import convert_fx, get_default_calib_qconfig, prepare_calibration_fx
from qcompiler.runtime import Runtime, Step

MARCHES = ("bayes", "bernoulli2")


class Gate(nn.Module):
    """Data-dependent Python: cannot be traced, and no ONNX form exists for the module."""

    def forward(self, x):
        if float(x.mean()) > 0:
            return x * 2.0
        return x - 1.0


class WithLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gate = Gate()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.gate(torch.relu(self.conv1(x))))


class WithGroupNorm(nn.Module):
    """GroupNorm on the CPU; the test takes its ONNX rule away to stand for an op without one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)))


LEAF = {"non_traceable_module_name": ["gate"]}
X = torch.rand(2, 3, 8, 8)


def _compile(model, march, **kw):
    torch.manual_seed(0)
    calib = [torch.rand(2, 3, 8, 8) for _ in range(3)]
    return qcompiler.compile(model.eval(), (X,), march=march, calib_data=calib, progress=False, **kw)


@pytest.mark.parametrize("march", MARCHES)
def test_a_leaf_module_runs_in_a_torch_island_bit_exact(march):
    torch.manual_seed(0)
    cm = _compile(WithLeaf(), march, prepare_custom_config_dict=LEAF)
    assert [s.kind for s in cm.runtime.steps].count(TORCH) == 1
    (name, reason), = cm.torch_islands().items()
    assert "cannot emit node 'gate' (Gate" in reason
    for x in (X, -X):  # both branches of the data-dependent Python
        assert torch.equal(cm(x), cm.converted(x))
    summary = cm.summary()
    assert f"{name} runs in eager torch (placement 'torch'): cannot emit node 'gate'" in summary
    assert any(p["placement"] == TORCH for p in cm.partitions)
    assert cm.boundary_edges() == 2  # BPU -> torch island -> BPU


def test_an_op_without_an_onnx_rule_runs_in_torch(monkeypatch):
    """An op with no rule (GroupNorm stands for whichever op is in rules.NOT_EMITTED: its rule is
    taken out of the registry for this test) runs its CPU island in torch, with the reason."""
    monkeypatch.setattr(registry, "_OP_RULES", {op: v for op, v in registry._OP_RULES.items() if op != "group_norm"})
    monkeypatch.setitem(NOT_EMITTED, "group_norm", "GroupNorm is not emitted yet (a reason)")
    torch.manual_seed(0)
    cm = _compile(WithGroupNorm(), "bayes")
    (reason,) = cm.torch_islands().values()
    assert "GroupNorm is not emitted yet" in reason
    assert torch.equal(cm(X), cm.converted(X))


def test_islands_onnx_can_express_stay_in_onnxruntime():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SELU(), nn.Conv2d(4, 4, 1)).eval()
    cm = qcompiler.compile(model, (X,), march="bayes", progress=False)
    assert cm.torch_islands() == {}
    assert "cpu" in [s.kind for s in cm.runtime.steps]


def test_save_refuses_a_torch_island_and_writes_nothing(tmp_path):
    torch.manual_seed(0)
    cm = _compile(WithLeaf(), "bayes", prepare_custom_config_dict=LEAF)
    target = tmp_path / "m.qc"
    with pytest.raises(ArtifactError, match=r"save: 1 CPU island\(s\) run in eager torch.*nodes gate\): "
                                            r"cannot emit node 'gate'"):
        cm.save(target)
    assert list(tmp_path.iterdir()) == []


def test_export_names_each_torch_island(tmp_path):
    torch.manual_seed(0)
    cm = _compile(WithLeaf(), "bayes", prepare_custom_config_dict=LEAF)
    with pytest.raises(UnsupportedOpError, match=r"export_onnx: 1 CPU island\(s\) run in eager torch, which ONNX opset 11 "
                                                  r"cannot express: cpu\d \(nodes gate\): cannot emit node 'gate' \(Gate\)"):
        cm.export_onnx(tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_dump_writes_the_islands_code(tmp_path):
    torch.manual_seed(0)
    cm = _compile(WithLeaf(), "bayes", prepare_custom_config_dict=LEAF)
    files = cm.dump(tmp_path)
    (code,) = [p for p in files if p.name.endswith(".torch.py.txt")]
    text = code.read_text()
    assert text.startswith(f"# torch island {code.name.split('.')[0]}: cannot emit node 'gate'")
    assert "self.gate(" in text


def test_staged_api_runs_the_leaf_too():
    torch.manual_seed(0)
    model = WithLeaf().eval()
    cal = prepare_calibration_fx(model, {"": get_default_calib_qconfig()}, LEAF, hybrid=True, example_inputs=(X,))
    cal(X)
    q = convert_fx(cal)
    y = q(X)
    assert y.shape == (2, 4, 8, 8) and torch.isfinite(y).all()


def test_an_unknown_step_kind_has_no_executor():
    step = Step("gpu", "gpu0", ["x"], ["y"])
    with pytest.raises(ConfigError, match=r"step 'gpu0' has kind 'gpu', which no executor runs; known kinds: "
                                          r"bpu, cpu, torch"):
        Runtime([step], ["x"], {"value": "y"}, {}, {})


@pytest.mark.parametrize("fn", [torch.add, torch.mul, torch.sub, torch.div, torch.gt, torch.matmul,
                                lambda a, b: torch.relu(a) + b], ids=["add", "mul", "sub", "div", "gt", "matmul",
                                                                       "relu"])
def test_a_0d_result_of_a_cpu_island_stays_0d(fn):
    """onnxruntime hands back 0-d results; the runtime keeps them 0-d (np.ascontiguousarray made them (1,))."""

    class M(nn.Module):
        def forward(self, a, b):
            return fn(a, b)

    a, b = torch.tensor(1.5), torch.tensor(2.0)
    if fn is torch.matmul:  # a dot product of two vectors is 0-d
        a, b = torch.tensor([1.5, -2.0, 0.25]), torch.tensor([2.0, 1.0, 4.0])
    cm = qcompiler.compile(M(), (a, b), progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["cpu"]
    out = cm(a, b)
    assert out.shape == () and torch.equal(out, fn(a, b))


class DoubledAfterARead(nn.Module):
    """``a`` leaves the torch island for c0 on the BPU, then is changed in place in the island; the
    partitioner runs the whole island (gate, gt_, atan) before c0.  ``gt_`` has no out-of-place twin
    (in place it writes 0 / 1 as floats), so it stays an in-place op."""

    def __init__(self, shared=True):
        super().__init__()
        self.shared = shared
        self.c0, self.c1, self.gate = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), Gate()

    def forward(self, x):
        a = self.gate(torch.atan(x))
        p = self.c0(a) if self.shared else self.c0(x)
        a.gt_(0.7)
        return p + self.c1(torch.atan(a))


def test_an_in_place_op_on_a_value_another_step_reads_changes_a_clone():
    """Done in place, the island's ``gt_`` changed the tensor c0 later read: 0.32 off float, where the
    converted model is 0.015 off."""
    torch.manual_seed(0)
    model = DoubledAfterARead().eval()
    x = torch.rand(2, 3, 8, 8)
    ref = model(x.clone())
    cm = _compile(model, "bayes", prepare_custom_config_dict=LEAF)
    (name,) = cm.torch_islands()
    step = next(s for s in cm.runtime.steps if s.name == name)
    assert {"gate", "gt_"} <= set(step.nodes) and "gate" in step.outputs
    assert cm.runtime.steps.index(step) == 0  # before c0's step: the order that went wrong
    code = cm.runtime.eager[name].code()
    assert "clone = gate.clone()" in code and "clone.gt_(0.7)" in code
    assert torch.equal(cm(x), cm.converted(x))
    assert (cm(x) - ref).abs().max() < 0.05


def test_an_in_place_op_on_a_value_the_island_keeps_runs_in_place():
    torch.manual_seed(0)
    cm = _compile(DoubledAfterARead(shared=False).eval(), "bayes", prepare_custom_config_dict=LEAF)
    (name,) = cm.torch_islands()
    code = cm.runtime.eager[name].code()
    assert "clone" not in code and "gate.gt_(0.7)" in code
    assert torch.equal(cm(X), cm.converted(X))


def test_an_in_place_op_on_the_models_input_leaves_the_callers_tensors_alone():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.conv = Gate(), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            x.gt_(0.5)
            return self.conv(self.gate(x))

    torch.manual_seed(0)
    example, x = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8)
    kept = example.clone(), x.clone()
    cm = qcompiler.compile(Scale().eval(), (example,), march="bayes", calib_data=[example], progress=False,
                           prepare_custom_config_dict=LEAF)
    cm(x)
    # compile ran the model on copies of the example (shape propagation runs Gate's Python for real), and
    # the island changes a copy of the caller's input
    assert torch.equal(example, kept[0]) and torch.equal(x, kept[1])
