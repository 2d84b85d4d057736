"""Forward signatures the tracer reads right: ``**kwargs`` is no input, ``*args`` takes the example
inputs left over, a ``functools.wraps`` wrapper taking ``(self, *args, **kwargs)`` (transformers 5's
decorators) traces the forward it wraps, and a list of tensors is one input per tensor."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import TraceError
from qcompiler.ir import trace
from qcompiler.ir.meta import GM_INPUT_SPEC, placement
from qcompiler.ir.tracer import forward_signature

X = torch.rand(2, 3, 8, 8)


def passes_on(fn):
    """transformers 5's shape: a wrapper of (self, *args, **kwargs) that reads its kwargs."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("return_dict") is not None:
            raise AssertionError("not passed")
        return fn(self, *args, **kwargs)

    return wrapper


def adds_scale(fn):
    """A decorator that changes the signature on purpose: the wrapper takes ``scale`` too."""

    @functools.wraps(fn)
    def wrapper(self, x, scale):
        return fn(self, x) * scale

    return wrapper


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)


class Decorated(Conv):
    @passes_on
    def forward(self, x, mask=None, return_dict=None):
        y = torch.relu(self.conv(x))
        return y if mask is None else y * mask


class KwargsForward(Conv):
    def forward(self, x, **kwargs):
        return torch.relu(self.conv(x))


class StarArgs(Conv):
    def forward(self, *xs):
        return self.conv(xs[0]) + self.conv(xs[1])


class Rescaled(Conv):
    @adds_scale
    def forward(self, x):
        return self.conv(x)


class Images(Conv):
    def forward(self, images):
        return torch.cat([self.conv(image[None]) for image in images])


def _placeholders(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def _bpu_ops(model, inputs):
    gm = qcompiler.partition(model.eval(), inputs, march="bayes")
    return {n.name for n in gm.graph.nodes if placement(n) == "bpu"}


@pytest.mark.parametrize("model, inputs, names", [
    (Decorated(), (X,), ["x"]),
    (KwargsForward(), (X,), ["x"]),
    (StarArgs(), (X, X + 1), ["xs_0", "xs_1"]),
    (Rescaled(), (X, 3.0), ["x", "scale"]),
])
def test_the_graph_takes_what_the_example_inputs_supply(model, inputs, names):
    gm = trace(model.eval(), example_inputs=inputs)
    assert _placeholders(gm) == names
    assert torch.equal(gm(*inputs), model(*inputs))
    assert GM_INPUT_SPEC not in gm.meta  # flat tensor inputs need no tree


@pytest.mark.parametrize("model", [Decorated(), KwargsForward()])
def test_decorated_and_kwargs_forwards_compile_onto_the_bpu(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: it traces
        assert "conv" in _bpu_ops(model, (X,))  # (the relu is fused into it)
    cm = qcompiler.compile(model.eval(), (X,), march="bayes", calib_data=[X], progress=False)
    assert torch.equal(cm(X), cm.converted(X))


def test_the_wrappers_signature_rules_where_it_has_parameters_of_its_own():
    """Negative: ``wraps`` says the wrapped forward takes (x), but the wrapper takes (x, scale) on
    purpose; following ``__wrapped__`` there would drop ``scale``."""
    assert list(forward_signature(Rescaled().forward).parameters) == ["x", "scale"]
    assert list(forward_signature(Decorated().forward).parameters) == ["x", "mask", "return_dict"]
    assert list(forward_signature(KwargsForward().forward).parameters) == ["x", "kwargs"]


def test_too_many_inputs_for_a_forward_without_star_args_is_a_trace_error():
    """Negative: leftover example inputs go to ``*args`` only where there is one."""
    with pytest.raises(TraceError, match="forward takes 1 positional inputs, example_inputs give 2"):
        trace(KwargsForward().eval(), example_inputs=(X, X))


class Flat(tuple):
    """Flat example inputs as qcompiler.ir.shape_prop.KeywordInputs gives them: the tensor leaves of
    (args, kwargs), with the call they come from."""

    def __new__(cls, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((tuple(args), kwargs))
        self = super().__new__(cls, [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)])
        self.args, self.kwargs = tuple(args), kwargs
        return self


def test_flat_inputs_make_one_placeholder_per_tensor_with_the_tree():
    images = [torch.rand(3, 8, 8), torch.rand(3, 6, 10)]
    model = Images().eval()
    gm = trace(model, example_inputs=Flat((images,)))
    assert _placeholders(gm) == ["images_0", "images_1"]
    assert gm.meta[GM_INPUT_SPEC] == torch.utils._pytree.tree_structure(((images,), {}))
    other = [torch.rand(3, 8, 8), torch.rand(3, 8, 8)]
    assert torch.equal(gm(*other), model(other))


def test_keyword_inputs_are_passed_by_name():
    mask = torch.rand(2, 4, 8, 8) > 0.5
    model = Decorated().eval()
    gm = trace(model, example_inputs=Flat(kwargs={"mask": mask, "x": X}))
    assert _placeholders(gm) == ["mask", "x"]  # the order of the keywords, as pytree flattens them
    assert torch.equal(gm(mask, X), model(X, mask=mask))


def test_a_list_given_positionally_stays_one_input():
    """Negative: plain positional inputs are not flattened (the pipeline calls the graph with them as
    given): the list is one placeholder, which fx cannot iterate (the fallback cuts that statement)."""
    images = [torch.rand(3, 8, 8), torch.rand(3, 8, 8)]
    with pytest.raises(TraceError, match="Proxy object cannot be iterated"):
        trace(Images().eval(), example_inputs=(images,))
