"""``detach`` is an identity of values: it stays inside the BPU partition and exports, while a QAT
model keeps torch's own detach (the gradient it cuts stays cut)."""

from __future__ import annotations

import onnx
import torch
import torch.nn as nn
from test_nash_table import placed

import qcompiler
from qcompiler.onnx import inference_session


class Detached(nn.Module):
    def __init__(self, spelling: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.spelling = spelling

    def forward(self, x):
        y = torch.relu(self.conv(x))
        y = y.detach() if self.spelling == "method" else torch.detach(y)
        return self.head(y)


def test_detach_is_placed_on_the_bpu_between_two_convs():
    x = torch.randn(1, 3, 8, 8)
    for spelling in ("method", "function"):
        found = {k: v for k, v in placed(Detached(spelling), x, "bayes").items() if k.startswith("detach")}
        assert list(found.values()) == [("bpu", "follows its producer 'relu'")], (spelling, found)


def test_a_model_with_detach_compiles_to_one_bpu_partition_and_exports_bit_exact(tmp_path):
    """Before detach was an identity of the catalogue it split the model into two BPU partitions around
    a CPU island, and ``export_to_onnx`` of the float partition refused ``aten.detach``."""
    calib = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = Detached("method").eval()
    cm = qcompiler.compile(model, calib[0], march="bayes", calib_data=calib, progress=False)
    assert [p["placement"] for p in cm.partitions] == ["bpu"], cm.partitions
    cm.export_onnx(tmp_path / "m.onnx")
    s = inference_session(onnx.load(str(tmp_path / "m.onnx")))
    x = calib[1]
    got = torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        assert torch.equal(got, cm(x))


def test_qat_keeps_the_gradient_cut_by_detach():
    """The QAT model still calls torch's detach: the first conv gets no gradient, the head does."""
    from qcompiler.quantization import prepare_qat_fx
    from qcompiler.quantization.qconfig import get_default_qat_qconfig

    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(Detached("function").train(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    qat(x).sum().backward()
    grads = {n: p.grad for n, p in qat.named_parameters() if n.endswith("weight")}
    conv = [g for n, g in grads.items() if "head" not in n]
    head = [g for n, g in grads.items() if "head" in n]
    assert conv and all(g is None or not g.any() for g in conv), list(grads)
    assert head and all(g is not None and g.any() for g in head), list(grads)
