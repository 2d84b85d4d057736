"""benchmarks/_float_onnx.py: the float model's ONNX that the benchmarks hand onnxruntime's quantizer.

It replaces torch.onnx's TorchScript exporter there, so it must keep what the peers relied on: the float
outputs, an opset the per-channel QDQ quantizer accepts, and one file for every batch size."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from benchmarks._float_onnx import PEER_OPSET, export_float_onnx
from qcompiler.errors import ConfigError


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    with torch.no_grad():  # non-trivial BatchNorm statistics, so its folding into the conv is exercised
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m.eval()


def _run(path: str, name: str, x: torch.Tensor) -> torch.Tensor:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {name: x.numpy()})[0])


def test_float_outputs_at_peer_opset_and_any_batch(tmp_path):
    model = _net()
    path = export_float_onnx(model, torch.randn(1, 3, 16, 16), str(tmp_path / "f.onnx"))
    proto = onnx.load(path)
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [PEER_OPSET] == [13]
    assert proto.graph.input[0].name == "x"
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x = torch.randn(3, 3, 16, 16)  # another batch than the example's
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(_run(path, "x", x), ref, rtol=1e-4, atol=1e-5)


def test_input_name_and_exporter_opset(tmp_path):
    model = _net()
    path = export_float_onnx(model, torch.randn(2, 3, 16, 16), str(tmp_path / "f.onnx"), input_name="pixel_values",
                             opset=11)
    proto = onnx.load(path)
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [11]
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(_run(path, "pixel_values", x), model(x), rtol=1e-4, atol=1e-5)


def test_opset_below_the_exporters_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"opset=10.*opset >= 11"):
        export_float_onnx(_net(), torch.randn(1, 3, 16, 16), str(tmp_path / "f.onnx"), opset=10)
    assert not (tmp_path / "f.onnx").exists()
