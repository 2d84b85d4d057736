"""3-D conv and pooling on the CPU (issue 33, r3d_18): every op has an ONNX opset-11 rule, so a
video model compiles with no eager-torch island and its export runs in onnxruntime like the
compiled model."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.onnx import registry
from qcompiler.ir.ops import node_op

X = torch.randn(2, 3, 4, 8, 8)


def _run_export(cm, path, x):
    cm.export_onnx(path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return model, session.run(None, {name: x.numpy()})[0]


LAYERS = {
    "conv3d": (nn.Conv3d(3, 4, (3, 3, 3), stride=(1, 2, 2), padding=1), {"Conv"}),
    "conv_transpose3d": (nn.ConvTranspose3d(3, 4, 2, stride=2), {"ConvTranspose"}),
    "batch_norm3d": (nn.BatchNorm3d(3), {"BatchNormalization"}),
    "max_pool3d": (nn.MaxPool3d((1, 2, 2), stride=(1, 2, 2)), {"MaxPool"}),
    "avg_pool3d": (nn.AvgPool3d(2, stride=2), {"AveragePool"}),
    "adaptive_avg_pool3d_1": (nn.AdaptiveAvgPool3d(1), {"GlobalAveragePool"}),
    "adaptive_avg_pool3d_divisible": (nn.AdaptiveAvgPool3d((2, 4, 2)), {"AveragePool"}),
    "adaptive_avg_pool3d_windows": (nn.AdaptiveAvgPool3d((3, 3, 5)), {"ReduceMean"}),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_3d_layer_runs_on_the_cpu_in_onnx_and_exports_exactly(name, tmp_path):
    torch.manual_seed(0)
    layer, expected_ops = LAYERS[name]
    m = nn.Sequential(layer).eval()
    if isinstance(layer, nn.BatchNorm3d):
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    with pytest.warns(qcompiler.errors.QCompilerWarning, match="no op of"):  # all float: nothing on the BPU
        cm = qcompiler.compile(m, X, march="bayes", progress=False)
    assert cm.torch_islands() == {}
    ref = m(X)
    got = cm(X)
    assert torch.allclose(got, ref, rtol=0, atol=1e-5)  # a float CPU island: onnxruntime's float32
    model, out = _run_export(cm, tmp_path / "m.onnx", X)
    assert expected_ops <= {n.op_type for n in model.graph.node}
    np.testing.assert_allclose(out, got.detach().numpy(), rtol=0, atol=1e-5)


def test_the_3d_modules_are_spelled_as_their_ops():
    gm = qcompiler.partition(nn.Sequential(nn.MaxPool3d(2), nn.AvgPool3d(1), nn.AdaptiveAvgPool3d(1),
                                           nn.ConvTranspose3d(3, 3, 1)).eval(), torch.randn(1, 3, 4, 4, 4),
                             march="bayes")
    modules = dict(gm.named_modules())
    ops = [node_op(n, modules) for n in gm.graph.nodes if n.op == "call_module"]
    assert ops == ["max_pool3d", "avg_pool3d", "adaptive_avg_pool3d", "conv_transpose3d"]
    assert all(registry.op_rule(op) is not None for op in ops)


def test_an_adaptive_max_pool3d_has_no_rule_and_stays_an_island():
    """Negative: only the ops opset 11 was given rules for leave eager torch (no AdaptiveMaxPool3d op)."""
    m = nn.Sequential(nn.Conv3d(3, 3, 1), nn.AdaptiveMaxPool3d(1)).eval()
    with pytest.warns(qcompiler.errors.QCompilerWarning):
        cm = qcompiler.compile(m, X, march="bayes", progress=False)
    assert list(cm.torch_islands().values()) and "AdaptiveMaxPool3d" in next(iter(cm.torch_islands().values()))


class Block3d(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv3d(c, c, 3, padding=1, bias=False), nn.BatchNorm3d(c)
        self.conv2, self.bn2 = nn.Conv3d(c, c, 3, padding=1, bias=False), nn.BatchNorm3d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)


class R3dLike(nn.Module):
    """torchvision's r3d_18, small: stem, residual blocks, AdaptiveAvgPool3d(1), flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 8, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Block3d(8), Block3d(8))
        self.avgpool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.avgpool(self.layer1(self.stem(x)))
        return self.fc(x.flatten(1))


def test_an_r3d_like_model_compiles_without_islands_and_exports_what_it_computes(tmp_path):
    torch.manual_seed(0)
    m = R3dLike().eval()
    x = torch.randn(1, 3, 4, 16, 16)
    cm = qcompiler.compile(m, x, march="bayes", calib_data=[torch.randn(1, 3, 4, 16, 16) for _ in range(3)],
                           progress=False)
    assert cm.torch_islands() == {}
    assert [p["placement"] for p in cm.partitions] == ["cpu", "bpu"]  # 3-D body on the CPU, linear on the BPU
    got = cm(x)
    ref = m(x)
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    model, out = _run_export(cm, tmp_path / "r3d.onnx", x)
    assert "GlobalAveragePool" in {n.op_type for n in model.graph.node}
    # the BPU linear is integer-exact in both; the float CPU part differs by float32 summation order, which
    # can move a requantized value by one step: at most one output LSB (its scale) apart
    scale = float(np.abs(got.detach().numpy()).max()) / 127
    np.testing.assert_allclose(out, got.detach().numpy(), rtol=0, atol=1.01 * scale)
