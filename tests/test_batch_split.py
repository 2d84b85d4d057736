"""The batch split (qcompiler.parallel) and its proof (qcompiler.ir.batch_dim).

A compiled model whose graph is proven per-sample along dim 0 splits a batch over worker
threads: the result must be ``torch.equal`` to the unsplit run for any batch size and thread
count (batch < threads, batch 1, uneven chunks).  A graph that mixes samples must be refused
(and the negative tests show a forced split would give another answer).  Concurrent callers
of shared models and simulators must not disturb each other.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import qcompiler
import qcompiler.zoo as zoo
from qcompiler.distributed import evaluate
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.ir.batch_dim import split_refusal
from qcompiler.parallel import batch_size, in_worker, run_split, split_args
from qcompiler.runtime import NOT_ANALYSED, Runtime
from artifact_edit import Edit

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None)
SIZE = 32


def _compile(model: nn.Module, example: torch.Tensor, **kw) -> qcompiler.CompiledModel:
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn((4, *example.shape[1:]), generator=g) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcompiler.compile(model, example, calib_data=calib, progress=False, **kw)


_ZOO: dict = {}


def zoo_model(name: str) -> qcompiler.CompiledModel:
    if name not in _ZOO:
        _ZOO[name] = _compile(zoo.get(name), zoo.example_inputs(name, image_size=SIZE)[0])
    return _ZOO[name]


class _CpuIsland(nn.Module):
    """conv -> |x| and a clamp that is no ReLU (CPU: onnxruntime) -> conv (+ a CPU maximum)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        y = self.c1(x)
        y = torch.clamp(torch.abs(y), -1.0, 2.0)
        y = self.act(y)
        z = self.c2(y)
        return torch.maximum(z, y).flatten(1), z.mean((2, 3))


def cpu_island_model() -> qcompiler.CompiledModel:
    if "cpu_island" not in _ZOO:
        _ZOO["cpu_island"] = _compile(_CpuIsland().eval(), torch.randn(1, 3, 8, 8),
                                      hybrid_dict={"module_name": ["act"]})
    return _ZOO["cpu_island"]


def _unsplit(cm, x):
    cm.threads = 1
    return cm(x)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "unet"])
@SETTINGS
@given(batch=st.integers(1, 7), threads=st.integers(2, 4), seed=st.integers(0, 2 ** 16))
def test_split_equals_unsplit_on_zoo_models(name, batch, threads, seed):
    cm = zoo_model(name)
    assert cm.split_refusal is None
    x = torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))
    want = _unsplit(cm, x)
    cm.threads = threads
    got = cm(x)
    assert _equal(got, want)


@SETTINGS
@given(batch=st.integers(1, 9), threads=st.integers(2, 5), seed=st.integers(0, 2 ** 16))
def test_split_equals_unsplit_with_a_cpu_island(batch, threads, seed):
    cm = cpu_island_model()
    assert cm.split_refusal is None
    assert "cpu" in {s.kind for s in cm.runtime.steps}  # an onnxruntime island runs in the split
    x = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) * 3
    want = _unsplit(cm, x)
    cm.threads = threads
    assert _equal(cm(x), want)


class _Decode(nn.Module):
    """Item assignments a detection head's decode makes: slices, an int, a mask and a number, a batched
    value; each writes within its own sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)

    def forward(self, x):
        y = torch.sigmoid(self.conv(x))
        y[:, 0:2] = y[:, 0:2] * 2 - 0.5
        y[..., 1:3] *= 4
        y[:, 5] = 0.25
        y[y > 0.9] = 1.0
        return y


@SETTINGS
@given(batch=st.integers(1, 7), threads=st.integers(2, 4), seed=st.integers(0, 2 ** 16))
def test_item_assignments_within_a_sample_are_split_exactly(batch, threads, seed):
    cm = _compile(_Decode().eval(), torch.randn(2, 3, 6, 6))
    assert cm.split_refusal is None
    x = torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(seed))
    want = _unsplit(cm, x)
    cm.threads = threads
    assert _equal(cm(x), want)


def test_partitioned_runner_splits_too():
    cm = zoo_model("unet")
    x = torch.randn(5, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))
    one = Runtime.simulated(cm.converted, cm.runtime.programs, threads=1)
    two = Runtime.simulated(cm.converted, cm.runtime.programs, threads=2)
    assert two.split_refusal is None
    assert torch.equal(two(x), one(x)) and torch.equal(one(x), cm.converted(x))


# ---------------------------------------------------------------------------- refusals


class _BatchMean(nn.Module):
    """Subtracts the batch mean: every output row depends on every input row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y - y.mean(0, keepdim=True)


def test_a_batch_reducing_model_is_not_split_and_stays_correct():
    cm = _compile(_BatchMean().eval(), torch.randn(1, 3, 6, 6))
    assert cm.split_refusal is not None and "mean" in cm.split_refusal
    x = torch.randn(6, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    want = _unsplit(cm, x)
    cm.threads = 2
    assert torch.equal(cm(x), want)
    # the refusal matters: forcing the split gives another answer
    forced = run_split(cm.runtime._run_checked, (x,), 2)
    assert not torch.equal(forced, want)


class _Mixer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how, self.conv = how, nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        if self.how == "flip":
            return torch.cat([y, y.flip(0)], 1)
        if self.how == "cat0":
            return torch.cat([y, y], 0)
        if self.how == "view_fixed":
            return y.view(1, -1)
        if self.how == "flatten0":
            return y.flatten(0)
        if self.how == "index0":
            return y[0]
        if self.how == "setitem0":  # the batch's first sample written (each chunk's first, split)
            y[0] = 0.0
            return y
        if self.how == "setitem_long":  # an int index picks samples by value (review: taken for a mask)
            y[(y > 0).long()] = 0.0
            return y
        if self.how == "setitem_bound":  # a bound read from the batch size (review: cut per chunk)
            y[:, :y.shape[0]] = 0.0
            return y
        if self.how == "squeeze":
            return y.squeeze()
        if self.how == "softmax0":
            return torch.softmax(y, 0)
        if self.how == "sum_all":
            return y + y.sum()
        if self.how == "T_mean":  # centring over the batch through x.T
            f = y.flatten(1)
            return f - f.T.mean(1)
        if self.how == "mT_matmul":  # a similarity matrix between samples
            f = y.flatten(1)
            return torch.matmul(f, f.mT)
        raise AssertionError(self.how)


@pytest.mark.parametrize("how, reason", [
    ("flip", "flip"), ("cat0", "batch dim"), ("view_fixed", "moves samples"), ("flatten0", "flattens"),
    ("index0", "selects from the batch dim"), ("setitem0", "selects from the batch dim"),
    ("setitem_long", "an index tensor"), ("setitem_bound", "slice bound computed from the batch"), ("squeeze", "squeeze"), ("softmax0", "softmax"), ("sum_all", "sum"),
    ("T_mean", "attribute 'T'"), ("mT_matmul", "attribute 'mT'"),
])
def test_ops_that_mix_samples_are_refused(how, reason):
    cm = _compile(_Mixer(how).eval(), torch.randn(1, 3, 5, 5))
    assert cm.split_refusal is not None and reason in cm.split_refusal, cm.split_refusal
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    want = _unsplit(cm, x)
    cm.threads = 2
    assert _equal(cm(x), want)


class _Reshapes(nn.Module):
    """Reshapes that keep the batch: -1, unsqueeze/squeeze(dim), permute, split, indexing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        a = y.view(-1, 100)
        b = y.reshape(-1, 4, 25).permute(0, 2, 1).unsqueeze(1).squeeze(1)
        c, d = torch.split(y, 2, dim=1)
        e = y.reshape(-1, 4, 25)[..., None, 1:]
        return a, b, c[:, :, 1:3] + d[:, :, :2], y[:, 0], e


def test_batch_preserving_reshapes_are_proven_and_exact():
    cm = _compile(_Reshapes().eval(), torch.randn(1, 3, 5, 5))
    assert cm.split_refusal is None
    x = torch.randn(5, 3, 5, 5, generator=torch.Generator().manual_seed(2))
    want = _unsplit(cm, x)
    cm.threads = 3
    assert _equal(cm(x), want)


class _SizeReshapes(nn.Module):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.bad, self.conv = bad, nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        if self.bad:  # the batch size in arithmetic: folds 2 samples' halves together
            return y.reshape(y.size(0) * 2, -1)
        return y.view(y.size(0), -1), y.view(y.shape[0], 4, -1)[..., None, 1:]


def test_the_batch_size_read_from_a_shape_may_only_be_the_batch_entry():
    # graph level (qcompiler.partition: shapes, ops, placements): x.size(0) in a compiled BPU
    # partition is a lowering error today, independent of the split
    assert split_refusal(qcompiler.partition(_SizeReshapes(False), torch.randn(1, 3, 5, 5))) is None
    why = split_refusal(qcompiler.partition(_SizeReshapes(True), torch.randn(1, 3, 5, 5)))
    assert why is not None and "batch size" in why


def test_float_cpu_ops_that_may_round_by_size_and_rnns_are_refused():
    assert "float on the CPU" in zoo_model_refusal("hybrid")  # selu in onnxruntime
    assert "float on the CPU" in zoo_model_refusal("transformer_block")  # layer_norm
    assert "hidden" in zoo_model_refusal("lstm_seq")  # an (h, c) state input


def zoo_model_refusal(name: str) -> str:
    kw = {} if name in ("lstm_seq", "transformer_block") else {"image_size": 16}
    x = zoo.example_inputs(name, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = qcompiler.compile(zoo.get(name), x, progress=False)
    return cm.split_refusal


@pytest.mark.parametrize("which", ["resnet18", "cpu_island"])
def test_a_loaded_model_keeps_the_batch_split(which, tmp_path, monkeypatch):
    """The manifest carries the proof (``split_refusal``: null), so the loaded model splits batch 3 over
    its threads and gives the original's outputs."""
    cm = cpu_island_model() if which == "cpu_island" else zoo_model(which)
    loaded = qcompiler.load(cm.save(tmp_path / "m.qc"), threads=2)
    assert loaded.split_refusal is None and loaded.threads == 2
    assert Edit(tmp_path / "m.qc").manifest["split_refusal"] is None
    x = torch.randn(3, *cm.example_inputs[0].shape[1:], generator=torch.Generator().manual_seed(4))
    want = _unsplit(cm, x)
    calls = []

    def spy(fn, args, threads):
        calls.append((batch_size(args), threads))
        return run_split(fn, args, threads)

    monkeypatch.setattr("qcompiler.runtime.run_split", spy)
    assert _equal(loaded(x), want)
    assert calls == [(3, 2)]  # split over both threads


def test_a_loaded_model_keeps_the_refusal_and_an_old_file_is_not_split(tmp_path):
    cm = _compile(_BatchMean().eval(), torch.randn(1, 3, 6, 6))
    assert cm.split_refusal is not None and "mean" in cm.split_refusal
    path = cm.save(tmp_path / "m.qc")
    assert qcompiler.load(path, threads=2).split_refusal == cm.split_refusal
    old = Edit(zoo_model("resnet18").save(tmp_path / "r.qc"))
    del old.manifest["split_refusal"]  # a file saved before the manifest kept the proof
    loaded = qcompiler.load(old.write(tmp_path / "old.qc"), threads=2)
    assert loaded.split_refusal == NOT_ANALYSED
    x = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded(x), _unsplit(zoo_model("resnet18"), x))


@pytest.mark.parametrize("bad", [True, 0, ["no"], {"why": "x"}])
def test_a_split_refusal_of_another_type_is_an_artifact_error(bad, tmp_path):
    edit = Edit(zoo_model("unet").save(tmp_path / "m.qc"))
    edit.manifest["split_refusal"] = bad
    with pytest.raises(ArtifactError, match=r"manifest.json: 'split_refusal' is .*expected null"):
        qcompiler.load(edit.write(tmp_path / "bad.qc"))


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_bad_thread_counts_are_config_errors(bad):
    cm = zoo_model("unet")
    with pytest.raises(ConfigError, match="threads"):
        cm.threads = bad
    with pytest.raises(ConfigError, match="threads"):
        qcompiler.compile(_BatchMean().eval(), torch.randn(1, 3, 6, 6), threads=bad, progress=False)


# ---------------------------------------------------------------------------- the pool


def test_split_args_cuts_contiguous_uneven_chunks():
    x, y = torch.arange(7), torch.arange(14).view(7, 2)
    chunks = split_args((x, (y, "k")), 3)
    assert [c[0].tolist() for c in chunks] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [c[1][0].shape[0] for c in chunks] == [3, 2, 2] and all(c[1][1] == "k" for c in chunks)
    assert batch_size((x, y)) == 7 and batch_size((x, y[:3])) is None and batch_size((torch.tensor(1.0),)) is None


def test_workers_compute_at_one_torch_thread_and_leave_the_callers_count():
    before = torch.get_num_threads()
    seen = run_split(lambda x: torch.full((x.shape[0],), torch.get_num_threads() * 10 + int(in_worker())),
                     (torch.zeros(4),), 2)
    assert seen.tolist() == [11, 11, 11, 11]
    assert torch.get_num_threads() == before
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [before]  # threads started later still get the process's count


def test_a_chunk_error_is_raised_in_the_caller_and_nested_calls_run_inline():
    def fn(x):
        if x[0] >= 2:
            raise ConfigError(f"chunk from {int(x[0])}")
        return x

    with pytest.raises(ConfigError, match="chunk from 2"):
        run_split(fn, (torch.arange(4),), 2)
    nested = run_split(lambda x: run_split(lambda y: y * 0 + int(in_worker()), (x,), 2), (torch.arange(4),), 2)
    assert nested.tolist() == [1, 1, 1, 1]  # the inner call ran in its worker, unsplit


def test_concurrent_callers_of_shared_models_get_exact_results():
    """Two compiled models, each called from two user threads at once, each call split over 2
    workers (the simulators' scratch buffers and prepacked-weight caches are shared)."""
    models = [zoo_model("resnet18"), zoo_model("unet")]
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(b, 3, SIZE, SIZE, generator=g) for b in (2, 3, 4, 5)]
    want = {(m, i): _unsplit(cm, x) for m, cm in enumerate(models) for i, x in enumerate(inputs)}
    for cm in models:
        cm.threads = 2
    errors: list = []

    def caller(m: int, order: list[int]) -> None:
        try:
            for _ in range(3):
                for i in order:
                    if not torch.equal(models[m](inputs[i]), want[(m, i)]):
                        errors.append((m, i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(m, order))
               for m in range(2) for order in ([0, 1, 2, 3], [3, 2, 1, 0])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_evaluate_over_a_dataloader_splits_each_batch_exactly():
    cm = cpu_island_model()
    g = torch.Generator().manual_seed(6)
    data = TensorDataset(torch.randn(11, 3, 8, 8, generator=g), torch.arange(11))
    collect = lambda out, y: (out, y)  # noqa: E731 - the metric returns everything it saw
    cm.threads = 1
    (want_a, want_b), want_y = evaluate(cm, DataLoader(data, batch_size=4), collect, progress=False)
    cm.threads = 3
    (got_a, got_b), got_y = evaluate(cm, DataLoader(data, batch_size=4), collect, progress=False)
    assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b) and torch.equal(got_y, want_y)


def test_dict_outputs_are_joined_key_by_key_and_differing_constants_refused():
    from qcompiler.parallel import concat_outputs

    parts = [{"feat": torch.full((2, 3), float(i)), "n": 7} for i in range(3)]
    joined = concat_outputs(parts)
    assert torch.equal(joined["feat"], torch.cat([p["feat"] for p in parts])) and joined["n"] == 7
    with pytest.raises(ConfigError, match="differs between the chunks"):
        concat_outputs([{"n": 1}, {"n": 2}])


def test_a_forked_child_rebuilds_the_worker_pool(tmp_path):
    """The child of a fork inherits the pool's state but none of its threads: it must start its own
    (before the fix it waited forever on a queue nobody read)."""
    import os
    import signal

    run_split(lambda x: x + 1, (torch.zeros(4),), 2)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the split runs and is right
        signal.alarm(30)
        try:
            out = run_split(lambda x: x + int(in_worker()), (torch.zeros(6),), 2)
            os._exit(0 if out.tolist() == [1.0] * 6 else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
