"""Inter-op parallelism for a compiled model: a batch split into chunks, one per worker thread.

On small CPUs torch's intra-op (OpenMP) threads often do not scale: on the 2-core machine of
docs/performance.md, 2 torch threads made the simulator slower than 1.  Two independent
1-thread computations do run at full speed each, so a batch of ``B >= 2`` samples is split
along dim 0 into ``min(threads, B)`` contiguous chunks (sizes differ by at most one), each run
on its own worker thread, and the outputs are concatenated along dim 0.  torch ops and
onnxruntime release the GIL, so the chunks compute at the same time.

The workers are a process-wide pool of daemon threads, each with **one** torch intra-op
thread (``torch.set_num_threads(1)`` in the worker; OpenMP's thread count is per thread),
so N workers use N cores and never oversubscribe them.  A batch of one sample (nothing to
split) runs on one worker too: at 1 intra-op thread, which on such machines is never slower
than several.  A call made from inside a worker runs where it is (no nesting, no deadlock).

When the batch has fewer samples than ``threads`` (batch 1 at 2 threads), the idle workers are
lent to the chunks: a chunk runs with a budget of ``threads // chunks`` workers (the first
``threads % chunks`` one more), and a heavy op inside it may cut its own work into that many
independent parts (:func:`run_parts`; the convolutions' output-row split,
``qcompiler.backends.bpu.sim.row_split``).  The part computed in the calling worker goes first; a
part no idle worker has started yet when the caller is done is taken back and run in the
caller, so a part never waits behind other work in the queue (no deadlock with concurrent calls).

Whether a model may be split is decided elsewhere, per graph (:mod:`qcompiler.ir.batch_dim`):
this module only splits, runs and concatenates.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch

from qcompiler.errors import ConfigError
from qcompiler.quantization.qtensor import QTensor

__all__ = ["one_torch_thread", "resolve_threads", "batch_size", "split_args", "concat_outputs", "run_split",
           "in_worker", "part_budget", "run_parts"]

_MAX_THREADS = 256


def resolve_threads(threads: Optional[int], where: str) -> int:
    """``threads`` checked (a positive int), or ``torch.get_num_threads()`` for None."""
    if threads is None:
        return max(1, torch.get_num_threads())
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= _MAX_THREADS:
        raise ConfigError(f"{where}: threads must be None (torch.get_num_threads()) or an int from 1 to "
                          f"{_MAX_THREADS}, got {threads!r}")
    return threads


def _leaves(x: Any) -> list:
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


def batch_size(args: Sequence[Any]) -> Optional[int]:
    """The common dim-0 size of every tensor in ``args`` (nested tuples too), or None when a
    tensor is 0-d, the sizes differ, or there is no tensor: such a call is not split."""
    sizes = {t.shape[0] if t.dim() else None for t in _leaves(args) if isinstance(t, torch.Tensor)}
    if len(sizes) != 1:
        return None
    return sizes.pop()


def _split(x: Any, n: int) -> list:
    if isinstance(x, torch.Tensor):
        return list(torch.tensor_split(x, n, dim=0))
    if isinstance(x, (tuple, list)):
        cols = [_split(v, n) for v in x]
        return [type(x)(c[i] for c in cols) for i in range(n)]
    return [x] * n  # not batched: every chunk gets it


def split_args(args: Sequence[Any], n: int) -> list[tuple]:
    """``n`` argument tuples: every tensor cut into ``n`` contiguous dim-0 chunks (``torch.tensor_split``:
    the first ``B % n`` chunks have one sample more), everything else passed to each chunk."""
    return [tuple(c) for c in _split(tuple(args), n)]


def concat_outputs(parts: list) -> Any:
    """The chunks' outputs joined along dim 0: tensors by ``torch.cat``, QTensors by their integers
    (same quantization), tuples / lists / dicts element by element; anything else must be the
    same constant from every chunk (else a ConfigError: never a silently partial output)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, QTensor):
        if first.qscheme().startswith("per_channel"):
            if first.q_per_channel_axis() == 0:
                raise ConfigError("a batch-split output is quantized per channel along dim 0; it cannot be joined")
            return QTensor(torch.cat([p.int_repr() for p in parts]), first.q_per_channel_scales(),
                           first.q_per_channel_zero_points(), axis=first.q_per_channel_axis())
        return QTensor(torch.cat([p.int_repr() for p in parts]), first.q_scale(), first.q_zero_point())
    if isinstance(first, (tuple, list)):
        return type(first)(concat_outputs([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: concat_outputs([p[k] for p in parts]) for k in first}
    if all(type(p) is type(first) and p == first for p in parts[1:]):
        return first  # a constant (None, a number, a string): the same from every chunk
    raise ConfigError(f"a batch-split output of type {type(first).__name__} differs between the chunks and "
                      f"cannot be joined; call the model with threads=1")


# ---------------------------------------------------------------------------- the worker pool

_local = threading.local()


def in_worker() -> bool:
    """True inside one of the pool's worker threads."""
    return getattr(_local, "worker", False)


def part_budget() -> int:
    """How many workers the running call may cut one op into (:func:`run_parts`): 1 (no cut)
    except inside a batch-split chunk that was lent idle workers, and never inside a part."""
    return getattr(_local, "budget", 1)


def _with_budget(budget: int, fn: Callable, args: tuple) -> Any:
    saved = part_budget()
    _local.budget = budget
    try:
        return fn(*args)
    finally:
        _local.budget = saved


def one_torch_thread() -> None:
    """The calling thread runs torch ops on one intra-op thread (its count is per thread).  torch sets a
    thread's count lazily, from the process-wide one, on its first parallel call: that is done first here,
    or a later change of the process-wide count would replace this thread's 1.  ``set_num_threads`` also
    sets the count threads started later take: a caller that starts such a thread puts its own back."""
    torch.get_num_threads()
    torch.set_num_threads(1)


class _Pool:
    """Daemon threads with one torch intra-op thread each, fed from one queue; grown on demand."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._tasks: "queue.SimpleQueue[tuple[Future, Callable, tuple]]" = queue.SimpleQueue()
        self._size = 0

    def ensure(self, n: int) -> None:
        if self._pid != os.getpid():  # a forked child inherits the pool's state but none of its threads
            self._reset()
        with self._lock:
            if self._size >= n:
                return
            caller = torch.get_num_threads()
            ready = [threading.Event() for _ in range(n - self._size)]
            for i, event in enumerate(ready):
                threading.Thread(target=self._work, args=(event,), daemon=True,
                                 name=f"qcompiler-split-{self._size + i}").start()
            for event in ready:
                event.wait()
            # torch.set_num_threads in a worker also sets the count that threads started later take
            # (torch's lazy per-thread init); put back the caller's, so only the workers have one
            torch.set_num_threads(caller)
            self._size = n

    def _work(self, ready: threading.Event) -> None:
        _local.worker = True
        one_torch_thread()
        ready.set()
        while True:
            future, fn, args = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with torch.no_grad():
                    result = fn(*args)
            except BaseException as exc:  # handed to the caller, raised there
                future.set_exception(exc)
            else:
                future.set_result(result)

    def submit(self, fn: Callable, args: tuple) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future


_POOL = _Pool()


def run_split(fn: Callable[..., Any], args: Sequence[Any], threads: int) -> Any:
    """``fn(*args)`` computed as ``min(threads, B)`` dim-0 chunks on the worker pool, outputs
    concatenated; the caller must know that ``fn`` is per-sample along dim 0 (its output
    for a chunk is the chunk's rows of the whole output, bit for bit).

    ``threads <= 1``, a call from inside a worker, or inputs without one common batch size:
    ``fn(*args)`` in the calling thread, as without this module. A batch of one when the caller's
    torch thread count is ``threads``: ``fn(*args)`` in the calling thread with a budget of
    ``threads`` (:func:`part_budget`), so its native plans cut their layers over torch's own OpenMP
    team, the one the caller's torch ops use (with another count, one worker with that budget).
    An exception raised by a chunk is raised here (the first chunk's that failed, in batch order).
    """
    args = tuple(args)
    n_batch = batch_size(args) if threads > 1 and not in_worker() else None
    if n_batch is None or n_batch < 1:
        return fn(*args)
    n = min(threads, n_batch)
    if n == 1 and torch.get_num_threads() == threads:
        # one sample: no chunks to hand out; the caller computes it with its torch threads, its native plans
        # cutting each layer over the same OpenMP team (another thread count: a worker, as below)
        return _with_budget(threads, fn, args)
    _POOL.ensure(threads)
    budgets = [threads // n + (i < threads % n) for i in range(n)]  # the idle workers, lent to the chunks
    futures = [_POOL.submit(_with_budget, (budget, fn, chunk))
               for budget, chunk in zip(budgets, split_args(args, n))]
    errors = [f.exception() for f in futures]  # waits for every chunk: no work outlives the call
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise failed
    return concat_outputs([f.result() for f in futures])


def run_parts(fn: Callable[[int], Any], n: int) -> list:
    """``[fn(0), ..., fn(n - 1)]``, the parts computed at the same time: part 0 in the calling
    thread, the others on the pool's idle workers, each at one torch thread and with a budget
    of 1 (a part is not cut again).  The caller must know the parts are independent.

    After its own part the caller takes back every part no worker has started (``Future.cancel``)
    and runs it itself, so it only ever waits for parts already running: no deadlock, however
    busy the pool.  An exception raised by a part is raised here (the first in part order),
    after every part has finished.
    """
    if n <= 1:
        return [_with_budget(1, fn, (0,))] if n == 1 else []
    _POOL.ensure(n)
    futures = [_POOL.submit(fn, (i,)) for i in range(1, n)]
    results: list = [None] * n
    errors: list = [None] * n
    try:
        results[0] = _with_budget(1, fn, (0,))
    except BaseException as exc:  # still wait for the other parts: no work outlives the call
        errors[0] = exc
    for i, future in enumerate(futures, start=1):
        if future.cancel():  # not started: run it here
            try:
                results[i] = _with_budget(1, fn, (i,))
            except BaseException as exc:
                errors[i] = exc
        else:
            errors[i] = future.exception()
            if errors[i] is None:
                results[i] = future.result()
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise failed
    return results
