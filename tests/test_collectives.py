"""qcompiler.collectives without a process group: the helpers are the single-process identity, and the
wait that keeps gloo's tensors alive until its worker lets go (tests/test_distributed.py runs it on 2 ranks)."""

from __future__ import annotations

import threading
import time

import torch

from qcompiler import collectives


def test_without_a_group_every_helper_returns_its_input():
    t = torch.arange(3.0)
    assert collectives.all_reduce(t, collectives.SUM, "x") is t
    assert collectives.all_gather_object({"a": 1}, "x") == [{"a": 1}]
    collectives.barrier(1.0, "x")
    assert (collectives.rank(), collectives.world_size(), collectives.active()) == (0, 1, False)


def test_the_wait_ends_when_the_other_holder_lets_go():
    t = torch.zeros(4)
    holder = [t.view(2, 2)]  # a second reference to t's TensorImpl, as a gloo work holds one
    assert t._use_count() == 2
    threading.Timer(0.05, holder.clear).start()
    start = time.monotonic()
    collectives._wait_released([t], limit=5.0)
    assert t._use_count() == 1
    assert 0.04 <= time.monotonic() - start < 2.0


def test_the_wait_gives_up_after_its_limit():
    t = torch.zeros(4)
    view = t.view(4)  # never released
    start = time.monotonic()
    collectives._wait_released([t], limit=0.05)
    assert 0.05 <= time.monotonic() - start < 2.0 and t._use_count() == 2
    del view


def test_a_tensor_nobody_else_holds_does_not_wait():
    start = time.monotonic()
    collectives._wait_released([torch.zeros(4), torch.ones(2)], limit=5.0)
    assert time.monotonic() - start < 0.5
