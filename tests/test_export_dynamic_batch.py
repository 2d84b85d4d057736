"""The ONNX export's batch axis: symbolic where the compiled model takes any batch, fixed (with a warning
naming the node) where the graph fixes it.

A compiled model proven per-sample along dim 0 (qcompiler.ir.batch_dim.batch_refusal) exports with
dim_param "batch" on dim 0 of every input and output; onnxruntime then runs it at batch 1, 3 and 8 and
gives the compiled model's outputs bit for bit (``np.array_equal``, as tests/test_export_exact.py
asserts for a converted model's integer export; the CPU islands' float ops are the same onnxruntime
kernels on both sides). Models: convs, a transformer block, linear layers with view / reshape / flatten
around the batch, and one with a CPU island.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import TensorProto, helper

import qcompiler
import qcompiler.zoo as zoo
from qcompiler.backends.onnx.batch_axis import batch_fixing_node
from qcompiler.errors import QCompilerWarning
from qcompiler.onnx import BATCH_AXIS, export_to_onnx, inference_session

BATCHES = (1, 3, 8)


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3, stride=2)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        return self.fc(torch.relu(self.c2(y)).flatten(1))


class _Tokens(nn.Module):
    """Linear layers around view / transpose / reshape / flatten that keep the batch: ``x.size(0)``, ``-1``.
    ``fixed=True`` reshapes to a fixed (1, 96) instead: the graph then holds the traced batch."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.emb, self.fc = nn.Linear(8, 16), nn.Linear(96, 4)

    def forward(self, x):  # (B, 6, 8)
        h = self.emb(x)
        h = h.view(h.size(0), 6, 2, 8).transpose(1, 2).reshape(h.size(0), 2, 48)
        h = torch.relu(h.reshape(-1, 6, 16))
        return self.fc(h.reshape(1, 96) if self.fixed else h.flatten(1))


class _CpuIsland(nn.Module):
    """conv -> |x| and a clamp -> ReLU kept on the CPU (hybrid_dict) -> conv, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        y = self.act(torch.clamp(torch.abs(self.c1(x)), -1.0, 2.0))
        z = self.c2(y)
        return torch.maximum(z, y).flatten(1), z.mean((2, 3))


def _compile(model: nn.Module, example: torch.Tensor, calib_batch: int = 4, **kw) -> qcompiler.CompiledModel:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn((calib_batch, *example.shape[1:]), generator=g) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcompiler.compile(model.eval(), (example,), calib_data=calib, progress=False, **kw)


def _cases():
    torch.manual_seed(0)
    return {
        "convs": lambda: (_compile(_Convs(), torch.randn(1, 3, 8, 8)), (3, 8, 8)),
        "transformer_block": lambda: (_compile(zoo.get("transformer_block"),
                                               zoo.example_inputs("transformer_block")[0]), (16, 64)),
        "tokens": lambda: (_compile(_Tokens(), torch.randn(1, 6, 8)), (6, 8)),
        "cpu_island": lambda: (_compile(_CpuIsland(), torch.randn(1, 3, 8, 8), hybrid_dict={"module_name": ["act"]}),
                               (3, 8, 8)),
    }


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _outputs(cm, x: torch.Tensor) -> list[np.ndarray]:
    with torch.no_grad():
        out = cm(x)
    return [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]


def _export(cm, tmp_path, **kw) -> onnx.ModelProto:
    path = tmp_path / "m.onnx"
    cm.export_onnx(path, **kw)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("name", list(_cases()))
def test_per_sample_model_exports_a_symbolic_batch_that_runs_at_any_size(name, tmp_path):
    cm, sample = _cases()[name]()
    if name == "cpu_island":
        assert "cpu" in {s.kind for s in cm.runtime.steps}
    with warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)  # nothing fixes the batch: no warning
        model = _export(cm, tmp_path)
    assert [_dims(i) for i in model.graph.input] == [[BATCH_AXIS, *sample]]
    assert model.graph.output and all(_dims(o)[0] == BATCH_AXIS for o in model.graph.output)
    session = inference_session(model)
    g = torch.Generator().manual_seed(2)
    for batch in BATCHES:
        x = torch.randn((batch, *sample), generator=g) * 2
        got = session.run(None, {model.graph.input[0].name: x.numpy()})
        want = _outputs(cm, x)
        assert len(got) == len(want)
        for i, (o, r) in enumerate(zip(got, want)):
            assert o.shape == r.shape and o.shape[0] == batch
            assert np.array_equal(o, r), f"batch {batch}, output {i}: {int(np.sum(o != r))}/{o.size} differ"


def test_args_of_another_batch_export_the_same_file(tmp_path):
    cm, _ = _cases()["convs"]()
    buf1, buf3 = io.BytesIO(), io.BytesIO()
    export_to_onnx(cm.converted, (torch.randn(1, 3, 8, 8),), buf1)
    export_to_onnx(cm.converted, (torch.randn(3, 3, 8, 8),), buf3)
    assert buf1.getvalue() == buf3.getvalue()


def _fixed() -> qcompiler.CompiledModel:
    return _compile(_Tokens(fixed=True), torch.randn(1, 6, 8), calib_batch=1)


def test_a_graph_that_fixes_the_batch_keeps_it_and_warns_naming_the_node(tmp_path):
    cm = _fixed()
    assert "it reshapes to a fixed shape" in cm.split_refusal
    with pytest.warns(QCompilerWarning, match=r"batch is fixed at 1 .*node 'reshape_2': it reshapes to a fixed "
                                              r"shape .*dynamic_batch=False"):
        model = _export(cm, tmp_path)
    assert _dims(model.graph.input[0]) == [1, 6, 8] and _dims(model.graph.output[0]) == [1, 4]
    session = inference_session(model)
    x = torch.randn(1, 6, 8)
    assert np.array_equal(session.run(None, {"x": x.numpy()})[0], _outputs(cm, x)[0])
    with pytest.raises(Exception, match=r"Got: 3 Expected: 1"):
        session.run(None, {"x": torch.randn(3, 6, 8).numpy()})


def test_dynamic_batch_false_fixes_the_batch_without_a_warning(tmp_path):
    cm, _ = _cases()["convs"]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)
        model = _export(cm, tmp_path, dynamic_batch=False)
        export_to_onnx(_fixed().converted, (torch.randn(1, 6, 8),),
                       io.BytesIO(), dynamic_batch=False)
    assert _dims(model.graph.input[0]) == [1, 3, 8, 8] and _dims(model.graph.output[0]) == [1, 5]


def test_explicit_dynamic_axes_win_over_the_default_batch():
    cm, _ = _cases()["convs"]()
    buf = io.BytesIO()
    export_to_onnx(cm.converted, cm.example_inputs, buf, dynamic_axes={"x": {0: "N"}})
    model = onnx.load_from_string(buf.getvalue())
    assert _dims(model.graph.input[0]) == ["N", 3, 8, 8] and _dims(model.graph.output[0]) == ["N", 5]
    buf = io.BytesIO()
    export_to_onnx(cm.converted, cm.example_inputs, buf, dynamic_axes={})  # given and empty: all fixed
    assert _dims(onnx.load_from_string(buf.getvalue()).graph.output[0]) == [1, 5]


def _reshape_model(target: list[int]) -> onnx.ModelProto:
    """x [batch, 4] -> Relu -> Reshape(target) -> y."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Reshape", ["r", "shape"], ["y"], name="cpu0/view")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [len(target)], target)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def test_batch_fixing_node_names_a_constant_that_holds_the_batch():
    assert batch_fixing_node(_reshape_model([1, 4])) == "cpu0/view"  # the traced batch in a constant
    assert batch_fixing_node(_reshape_model([0, 4])) is None  # 0: copy the batch
    assert batch_fixing_node(_reshape_model([-1, 4])) is None
