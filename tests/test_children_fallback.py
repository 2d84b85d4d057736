"""The children fallback (qcompiler.ir.glue): an untraceable statement of the top-level forward runs as
an eager-torch island, and the submodules called around it are traced into the one graph (on the BPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import QCompilerWarning, TraceError
from qcompiler.ir.auto_leaf import WHOLE_MODEL, trace_or_fallback
from qcompiler.ir.meta import META_AUTO_LEAF, placement

X = torch.rand(2, 3, 8, 8)
CALIB = [X, -X] + [torch.rand(2, 3, 8, 8) * 2 - 1 for _ in range(4)]


def stack():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1))


class Branches(nn.Module):
    """Data-dependent Python between two conv stacks."""

    def __init__(self):
        super().__init__()
        self.a, self.b = stack(), stack()

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:
            y = y * 2
        else:
            y = -y
        return self.b(y)


class ReturnsInside(nn.Module):
    """A return inside the untraceable statement: the island takes the rest of forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = stack(), stack()

    def forward(self, x):
        y = self.a(x)
        if y.mean() > 0:
            return self.b(y)
        return -self.b(y)


class TwoCuts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = stack(), stack(), stack()

    def forward(self, x):
        y = self.a(x)
        scale = float(y.abs().max())
        y = self.b(y / scale)
        n = int(y.numel() > 10)
        return self.c(y) + n


def _placements(model):
    gm = qcompiler.partition(model.eval(), (X,), march="bayes")
    return {n.name: placement(n) for n in gm.graph.nodes if n.op in ("call_module", "call_function")}, gm


def test_convs_around_a_data_dependent_branch_run_on_the_bpu():
    torch.manual_seed(0)
    model = Branches().eval()
    with pytest.warns(QCompilerWarning, match=r"Done instead: lines \d+-\d+ of its forward \(reading y; writing y\) "
                                               r"run as one eager-torch island on the CPU; the rest of forward"):
        where, gm = _placements(model)
    convs = {"a_0", "a_2", "b_0", "b_2"}
    assert {name: where[name] for name in convs} == dict.fromkeys(convs, "bpu")
    (glue,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_qc_glue_0"]
    assert placement(glue) == "cpu"
    assert "of Branches.forward cannot be traced (symbolically traced variables cannot be used as inputs " \
           "to control flow): they run in eager torch on the CPU" in glue.meta[META_AUTO_LEAF]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cm = qcompiler.compile(model, (X,), march="bayes", calib_data=CALIB, progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu", "torch", "bpu"]
    for x in (X, -X):  # both branches, taken at run time
        assert torch.equal(cm(x), cm.converted(x))
        with torch.no_grad():
            ref = model(x)
        assert (cm(x) - ref).abs().max() <= 0.05 * ref.abs().max()  # int8, two conv stacks


def test_a_return_inside_the_statement_takes_the_rest_of_forward():
    model = ReturnsInside().eval()
    with pytest.warns(QCompilerWarning, match="the rest of forward, which returns from inside it"):
        gm = trace_or_fallback(model, example_inputs=(X,))
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["a.0", "a.1", "a.2", "_qc_glue_0"]  # b runs inside the island
    for x in (X, -X):
        assert torch.equal(gm(x), model(x))


def test_each_untraceable_statement_is_its_own_island():
    model = TwoCuts().eval()
    with pytest.warns(QCompilerWarning):
        gm = trace_or_fallback(model, example_inputs=(X,))
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["a.0", "a.1", "a.2", "_qc_glue_0", "b.0", "b.1", "b.2", "_qc_glue_1", "c.0", "c.1", "c.2"]
    assert torch.equal(gm(X), model(X))


def test_closures_and_super_in_the_forward_still_work():
    offset = 0.25

    class Base(nn.Module):
        def shift(self, y):
            return y + offset

    class Child(Base):
        def __init__(self):
            super().__init__()
            self.a = stack()

        def shift(self, y):
            return super().shift(y) * 2

        def forward(self, x):
            y = self.a(x)
            if y.sum() > 0:
                y = super().shift(y)
            return self.shift(y) + offset

    model = Child().eval()
    with pytest.warns(QCompilerWarning, match="island"):
        gm = trace_or_fallback(model, example_inputs=(X,))
    assert "a.0" in [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert torch.equal(gm(X), model(X))


def test_strict_tracing_raises_instead():
    """Negative: with strict_tracing the statement is not cut."""
    with pytest.raises(TraceError, match=r"top-level module \(Branches\)"):
        trace_or_fallback(Branches().eval(), example_inputs=(X,), strict=True)


def test_a_forward_without_source_runs_whole():
    """Negative: no source to rewrite (code made by exec): the whole model is one island, as before."""
    ns: dict = {}
    exec("def forward(self, x):\n    y = self.a(x)\n    if y.sum() > 0:\n        y = -y\n    return self.b(y)\n", ns)
    Nosource = type("Nosource", (Branches,), {"forward": ns["forward"]})
    with pytest.warns(QCompilerWarning, match="the whole model runs as one eager-torch island"):
        gm = trace_or_fallback(Nosource().eval(), example_inputs=(X,))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [WHOLE_MODEL]


def test_the_users_model_is_not_rewritten():
    """compile traces a copy: the user's model keeps its forward and gains no island."""
    model = Branches().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        qcompiler.partition(model, (X,), march="bayes")
    assert "forward" not in vars(model) and not hasattr(model, "_qc_glue_0")


class TorchvisionShaped(nn.Module):
    """torchvision's detectors' forward, in small: a local bound on one path only (``boxes`` when
    targets are given) and a list the traced code makes and the untraceable loop fills."""

    def __init__(self):
        super().__init__()
        self.a, self.b = stack(), stack()

    def forward(self, x, targets=None):
        if targets is not None:
            boxes = targets
        sizes = []
        for image in x:  # a Proxy cannot be iterated: this statement is cut
            sizes.append(image.shape[-1])
            if targets is not None:
                sizes.append(boxes)
        y = self.b(self.a(x))
        return y * len(sizes)  # len() of what the island returns: this statement is cut too


def test_a_local_bound_on_one_path_and_a_list_filled_by_the_island():
    model = TorchvisionShaped().eval()
    with pytest.warns(QCompilerWarning, match="island"):
        gm = trace_or_fallback(copy.deepcopy(model), example_inputs=(X,))
    for _ in range(2):  # each call fills a list of its own (fx would hand every call the one list)
        assert torch.equal(gm(X), model(X))
    assert torch.equal(gm(X[:1]), model(X[:1]))  # the list's length is the call's, not the trace's
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["_qc_glue_0", "a.0", "a.1", "a.2", "b.0", "b.1", "b.2", "_qc_glue_1"]
    assert gm._qc_glue_0.writes == ("sizes",)  # filled there, read by the return's island
