"""Tracer: module scope, leaves, FloatFunctional, shapes, and errors for untraceable code."""

import pytest
import torch
import torch.ao.quantization as taq
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.nn.quantized import FloatFunctional

import qcompiler.quantization as qq
from qcompiler.errors import ConfigError, TraceError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_SCOPE, META_TENSOR, TensorInfo


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return F.relu(self.conv(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = taq.QuantStub()
        self.block = Inner()
        self.ff = FloatFunctional()
        self.dq = qq.DeQuantStub()

    def forward(self, x):
        x = self.q(x)
        y = self.block(x)
        return self.dq(self.ff.add(x, y))


def scopes(gm):
    return {n.name: [(e.path, e.type_name) for e in n.meta[META_SCOPE]] for n in gm.graph.nodes}


def test_scope_of_modules_and_functionals():
    gm = trace(Outer())
    s = scopes(gm)
    assert s["block_conv"] == [("", "Outer"), ("block", "Inner"), ("block.conv", "Conv2d")]
    assert s["relu"] == [("", "Outer"), ("block", "Inner")]  # functional inherits its module
    assert s["x"] == [("", "Outer")]


def test_stubs_are_leaves_torch_and_ours():
    gm = trace(Outer())
    calls = [(n.op, n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert ("call_module", "q") in calls and ("call_module", "dq") in calls


def test_float_functional_becomes_scoped_torch_add_and_is_restored():
    original = FloatFunctional.add
    gm = trace(Outer())
    add = [n for n in gm.graph.nodes if n.target is torch.add]
    assert len(add) == 1
    assert [(e.path, e.type_name) for e in add[0].meta[META_SCOPE]][-1] == ("ff", "FloatFunctional")
    # no identity observer node from FloatFunctional, and the class is restored
    assert not any(str(n.target).startswith("ff.") for n in gm.graph.nodes)
    assert FloatFunctional.add is original
    x = torch.rand(1, 3, 4, 4)
    m = Outer()
    assert torch.equal(trace(m)(x), m(x))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.conv(x))


def test_control_flow_names_module_line_and_fix():
    with pytest.raises(TraceError) as info:
        trace(WithGate())
    msg = str(info.value)
    assert "module 'gate' (Gate)" in msg
    assert "test_tracer.py" in msg and "if x.sum() > 0:" in msg
    assert "non_traceable_module_name" in msg and "['gate']" in msg
    assert info.value.__cause__ is None  # no chained torch traceback


def test_control_flow_at_top_level_says_move_it_into_a_submodule():
    with pytest.raises(TraceError) as info:
        trace(Gate())
    assert "top-level module (Gate)" in str(info.value)
    assert "submodule" in str(info.value)


class Typo(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return undefined_activation(self.conv(x))  # noqa: F821 (the bug under test)


class TypoInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Typo()

    def forward(self, x):
        return self.block(x)


@pytest.mark.parametrize("model, where", [(Typo(), "the top-level module (Typo)"),
                                          (TypoInside(), "module 'block' (Typo)")])
def test_name_error_in_the_forward_is_called_a_code_error_not_a_tracing_limit(model, where):
    with pytest.raises(TraceError) as info:
        trace(model)
    msg = str(info.value)
    assert msg.startswith(f"cannot trace {where} at {__file__}:")
    assert "NameError: name 'undefined_activation' is not defined" in msg
    assert "an error in the model's code, not a tracing limit" in msg
    assert "leaf" not in msg and "submodule" not in msg  # no advice that would not help
    assert info.value.__cause__ is None


def test_leaf_by_name_and_type_traces():
    gm = trace(WithGate(), leaf_module_names=["gate"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["conv", "gate"]
    gm = trace(WithGate(), leaf_module_types=[Gate])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["conv", "gate"]


def test_leaf_name_not_in_model_suggests_close_names():
    with pytest.raises(ConfigError, match="'gatee' is not in the model.*'gate'"):
        trace(WithGate(), leaf_module_names=["gatee"])


def test_shapes_recorded_including_nested_outputs():
    class Pair(nn.Module):
        def forward(self, x, hidden):
            h, c = hidden
            return x + 1, (h * 2, c.size(0))

    gm = trace(Pair())
    propagate_shapes(gm, (torch.zeros(2, 3), (torch.zeros(1, 3), torch.zeros(4))))
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert out.meta[META_TENSOR] == (TensorInfo((2, 3), "f32"), (TensorInfo((1, 3), "f32"), None))


def test_example_inputs_that_do_not_fit_name_the_node():
    gm = trace(WithGate(), leaf_module_names=["gate"])
    with pytest.raises(ConfigError, match=r"node 'conv' \(module 'conv' \(Conv2d\)\) failed on inputs \(f32\[1,4,8,8\]\)"):
        propagate_shapes(gm, torch.zeros(1, 4, 8, 8))
    with pytest.raises(ConfigError, match=r"forward\(x\) takes 1 inputs, got 2"):
        propagate_shapes(gm, (torch.zeros(1, 3, 8, 8), torch.zeros(1)))


def test_shape_propagation_does_not_update_batchnorm_statistics():
    class BN(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(x)

    m = BN().train()
    gm = trace(m)
    propagate_shapes(gm, torch.rand(2, 3, 4, 4) + 5)
    assert torch.equal(m.bn.running_mean, torch.zeros(3))
    assert m.bn.training  # mode restored


class _StringAnnotated(nn.Module):
    """Annotations as strings, as ``from __future__ import annotations`` makes them; ``y``'s names
    nothing importable."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: "torch.Tensor", y: "NoSuchType") -> "torch.Tensor":  # noqa: F821
        return self.conv(x) + y


def test_string_annotations_resolve_and_the_graph_pickles():
    import io

    gm = trace(_StringAnnotated())
    types = {n.target: n.type for n in gm.graph.nodes if n.op == "placeholder"}
    assert types == {"x": None, "y": None}  # one unresolvable hint: none are guessed
    gm = trace(nn.Sequential(nn.Conv2d(3, 3, 1)))
    buf = io.BytesIO()
    torch.save(gm, buf)  # a str annotation became a global torch.fx could not pickle
    buf.seek(0)
    x = torch.randn(1, 3, 4, 4)
    assert torch.equal(torch.load(buf, weights_only=False)(x), gm(x))


def test_prepared_and_converted_zoo_models_save_and_load():
    """Zoo modules use ``from __future__ import annotations``; their graphs must still pickle."""
    import io

    import qcompiler.zoo as zoo

    model, x = zoo.get("resnet18"), zoo.example_inputs("resnet18", image_size=32)
    cal = qq.prepare_calibration_fx(model, example_inputs=x)
    cal.eval()
    with torch.no_grad():
        cal(*x)
    assert [n.type for n in cal.graph.nodes if n.op == "placeholder"] == [torch.Tensor]
    for gm in (cal, qq.convert_fx(cal)):
        buf = io.BytesIO()
        torch.save(gm, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        with torch.no_grad():
            assert torch.equal(loaded(*x), gm(*x))


class Defaults(nn.Module):
    """forward parameters with defaults: a scale, an optional mask, a keyword-only flag (control flow)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x, mask=None, scale=2.0, *, relu=True):
        y = self.conv(x) * scale
        if mask is not None:
            y = y * mask
        return F.relu(y) if relu else y


def _placeholders(gm):
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def test_defaulted_forward_args_not_in_example_inputs_are_constants():
    m = Defaults()
    x, mask = torch.rand(1, 3, 4, 4), torch.rand(1, 4, 4, 4)
    gm = trace(m, example_inputs=(x,))
    assert _placeholders(gm) == ["x"]
    assert "mask" not in gm.code and "* 2.0" in gm.code and "relu" in gm.code
    assert torch.equal(gm(x), m(x))
    propagate_shapes(gm, x)
    with pytest.raises(TypeError):
        gm(x, mask)  # the graph is specialized: a mask is not silently ignored
    # a defaulted argument given in example_inputs stays an input; the ones after it still do not
    gm = trace(m, example_inputs=(x, mask))
    assert _placeholders(gm) == ["x", "mask"]
    assert torch.equal(gm(x, mask), m(x, mask))
    gm = trace(m, example_inputs=(x, mask, 3.0))
    assert _placeholders(gm) == ["x", "mask", "scale"]
    assert torch.equal(gm(x, mask, 3.0), m(x, mask, 3.0))


def test_without_example_inputs_defaulted_args_are_traced_as_inputs():
    # torch.fx's behaviour: the keyword-only flag is a Proxy in an `if`
    with pytest.raises(TraceError, match="relu") as err:
        trace(Defaults())
    assert "leave it out of example_inputs" not in str(err.value)


class BranchOnFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x, flip=False):
        y = self.conv(x)
        return -y if flip else y


def test_branching_on_a_given_defaulted_arg_says_to_leave_it_out():
    x = torch.rand(1, 3, 4, 4)
    with pytest.raises(TraceError, match=r"branches on 'flip' .* leave it out of example_inputs"):
        trace(BranchOnFlag(), example_inputs=(x, True))
    assert _placeholders(trace(BranchOnFlag(), example_inputs=(x,))) == ["x"]


def test_prepare_and_compile_with_defaulted_args_omitted():
    import qcompiler

    torch.manual_seed(0)
    m = Defaults().eval()
    x = torch.rand(1, 3, 4, 4)
    cal = qq.prepare_calibration_fx(m, example_inputs=(x,))
    assert _placeholders(cal) == ["x"]
    with torch.no_grad():
        assert torch.equal(cal(x), m(x))
    cm = qcompiler.compile(m, (x,), progress=False)
    torch.testing.assert_close(cm(x), m(x), rtol=0, atol=0.05)
