"""Shared fixtures: the heterogeneous-QAT guide's HybridModel and its hybrid_dict; shared test helpers."""

import contextlib
import os
import threading

import pytest
import torch

from qcompiler.zoo.hybrid import HybridModel, _SeluModule


@pytest.fixture
def hybrid_model():
    torch.manual_seed(0)
    return HybridModel().eval()


@pytest.fixture
def guide_hybrid_dict():
    return {"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]}


_PLAIN = (bool, int, float, str, type(None))


def _plain_attrs(m: torch.nn.Module) -> dict:
    """A module's plain Python attributes (training, ``_has_qparams``, observer settings...)."""
    return {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN)}


def _tree(model: torch.nn.Module) -> list:
    return [(name, type(m), m.training, _plain_attrs(m), len(m._forward_hooks), len(m._forward_pre_hooks))
            for name, m in model.named_modules(remove_duplicate=False)]


def snapshot(model: torch.nn.Module):
    """What must be unchanged after a failed/successful call: every parameter and buffer (also
    non-persistent ones: observer and fake-quant switches included), requires_grad and grads,
    and the module tree with each module's training flag, plain attributes and hooks."""
    tensors = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    grads = {k: (p.requires_grad, None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    return tensors, grads, _tree(model)


def assert_untouched(model, snap):
    tensors, grads, tree = snap
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == tensors.keys()
    for k in tensors:
        assert now[k].dtype == tensors[k].dtype and torch.equal(now[k], tensors[k]), k
    for k, p in model.named_parameters():
        requires_grad, grad = grads[k]
        assert p.requires_grad == requires_grad, k
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(p.grad, grad)), k
    assert _tree(model) == tree


FIFO_RELEASE_S = 15  # seconds before a reader blocked on a FIFO is released (its write end opened and closed)


@contextlib.contextmanager
def fifo_watch(fifo):
    """Inside the block, a reader that blocks on ``fifo`` is released after FIFO_RELEASE_S s, so a call
    that blocks ends and the test fails (the caller asserts the yielded event is not set) instead of
    hanging the run."""
    released = threading.Event()

    def release():
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO when nobody reads: nothing blocked
        except OSError:
            return
        released.set()
        os.close(fd)

    timer = threading.Timer(FIFO_RELEASE_S, release)
    timer.start()
    try:
        yield released
    finally:
        timer.cancel()
