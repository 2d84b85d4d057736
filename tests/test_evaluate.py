"""``qcompiler.distributed.evaluate`` in one process: the metric of a plain loop, a reader thread, a progress bar."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import qcompiler
from qcompiler.distributed import evaluate
from qcompiler.errors import ConfigError


def _data(n: int = 45) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4)).eval()


def test_compiled_model_metric_equals_a_plain_loop():
    data = _data()
    cm = qcompiler.compile(_net(), (data.tensors[0][:1],), calib_data=[data.tensors[0][:16]], progress=False)
    loader = DataLoader(data, batch_size=16)  # 45 samples: the last batch is short
    logits = evaluate(cm, loader, lambda o, t: o, progress=False)
    expected = torch.cat([cm(x) for x, _ in loader])
    assert torch.equal(logits, expected)
    acc = evaluate(cm, loader, lambda o, t: (o.argmax(1) == t).sum().item(), progress=False)
    assert acc == int((expected.argmax(1) == data.tensors[1]).sum())


class _Recording(Dataset):
    """Records the thread that reads each item; item ``bad`` raises."""

    def __init__(self, n: int, bad: int = -1) -> None:
        self.n, self.bad, self.threads = n, bad, set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.threads.add(threading.current_thread().name)
        if i == self.bad:
            raise KeyError(f"item {i} is corrupt")
        return torch.full((2,), float(i)), i


def test_batches_are_read_in_a_background_thread_in_order():
    ds = _Recording(10)
    model_threads = set()

    def model(x):
        model_threads.add(threading.current_thread().name)
        return x * 2

    out = evaluate(model, DataLoader(ds, batch_size=3), lambda o, t: (o, t), progress=False)
    assert torch.equal(out[0], torch.arange(10.0).repeat_interleave(2).reshape(10, 2) * 2)
    assert out[1].tolist() == list(range(10))
    assert all(name.startswith("qcompiler-evaluate") for name in ds.threads), ds.threads
    assert model_threads == {threading.current_thread().name}


def test_the_reader_collates_on_one_torch_thread_and_the_callers_count_stays():
    """The reader thread runs at one torch thread (a second OpenMP team of its own would contend with the
    model's, which use every core); the caller's count, and the one threads started later take, stay."""
    class Counting(_Recording):
        counts: set = set()

        def __getitem__(self, i):
            self.counts.add(torch.get_num_threads())
            return super().__getitem__(i)

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ds, seen = Counting(10), []
        evaluate(lambda x: (seen.append(torch.get_num_threads()), x)[1], DataLoader(ds, batch_size=3),
                 lambda o, t: o, progress=False)
        assert ds.counts == {1}, ds.counts
        assert seen == [2] * 4 and torch.get_num_threads() == 2
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]
    finally:
        torch.set_num_threads(saved)


def test_a_failing_item_raises_its_own_error():
    with pytest.raises(KeyError, match="item 7 is corrupt"):
        evaluate(lambda x: x, DataLoader(_Recording(10, bad=7), batch_size=3), lambda o, t: o, progress=False)
    with pytest.raises(ConfigError, match=r"\(input, target\) pairs"):
        evaluate(lambda x: x, DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2), lambda o, t: o,
                 progress=False)


def test_progress_bar_on_request_only(capsys):
    loader = DataLoader(_data(8), batch_size=4)
    evaluate(_net(), loader, lambda o, t: o, progress=False)
    assert "evaluating" not in capsys.readouterr().err
    evaluate(_net(), loader, lambda o, t: o, progress=True)
    assert "evaluating" in capsys.readouterr().err
