"""Thin wrappers over ``torch.distributed`` collectives used by observers and the scale-out helpers.

Nothing here starts a process group: qcompiler joins the default group the
user (or ``torchrun`` plus ``init_process_group``) created.  Without one, or
with a single rank, every helper is a no-op and returns its input, so the
single-process code path is the same code.

Tensors travel on the backend's device (CPU for gloo, the current CUDA device
for NCCL) and come back on the caller's device.  A failed collective (a rank
died, a timeout) becomes a :class:`CalibrationError` that says what was being
reduced and which rank saw the failure, never a raw backend traceback.

gloo wakes the caller when a collective completes, before its worker thread
drops the work that holds the tensors.  If the caller drops its references
first, torch hands each tensor's Python object to the tensor, and the worker's
late release has to take the GIL; during interpreter exit that aborts the
process ("terminate called without an active exception").  The group's
destructor would join the workers first, but a DistributedDataParallel model
keeps the group alive past ``destroy_process_group`` (torch 2.13), and many
scripts never call it.  So every helper here keeps the tensors it handed to
gloo until the worker has let go of them (:func:`_wait_released`), and gathers
objects with its own tensors instead of ``dist.all_gather_object``'s hidden
ones.
"""

from __future__ import annotations

import datetime
import pickle
import time

import torch
import torch.distributed as dist

from qcompiler.errors import CalibrationError, ConfigError

__all__ = ["active", "rank", "world_size", "all_reduce", "all_gather_object", "broadcast_object", "barrier",
           "CollectiveError"]

MAX, MIN, SUM = "max", "min", "sum"
_OPS = {MAX: "MAX", MIN: "MIN", SUM: "SUM"}


class CollectiveError(CalibrationError):
    """A collective failed: a rank died, did not arrive in time, or the group is broken."""


def active() -> bool:
    """Is there an initialized default process group with more than one rank?"""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _failed(what: str, err: BaseException) -> CollectiveError:
    return CollectiveError(
        f"rank {rank()} of {world_size()}: the collective for {what} failed ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else 'no message'}). Another rank died, raised, or did "
        f"not reach the same step in time; every rank must run the same calls on the same model"
    )


def _wait_released(tensors: list[torch.Tensor], limit: float = 5.0) -> None:
    """Return once no other thread holds ``tensors`` (fresh tensors only Python refers to), or after ``limit`` s.

    A gloo worker that has completed the work only has to be scheduled to let
    go, which takes microseconds on an idle machine and a few milliseconds on a
    loaded one; the limit only bounds a wait nothing should need.
    """
    deadline = time.monotonic() + limit
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(1e-4)


def _collective(what: str, call, tensors: list[torch.Tensor]) -> None:
    """Run ``call()`` (a blocking collective on ``tensors``); a failure becomes a :class:`CollectiveError`."""
    try:
        call()
    except (RuntimeError, dist.DistError) as err:
        raise _failed(what, err) from err
    if "gloo" in str(dist.get_backend()):  # "gloo", or a device map such as "cpu:gloo,cuda:nccl"
        _wait_released(tensors)


def all_reduce(t: torch.Tensor, op: str, what: str) -> torch.Tensor:
    """``t`` reduced over all ranks (``op`` in max/min/sum); a new tensor on ``t``'s device.

    ``op`` is checked first, with or without a group: a wrong op must not pass every
    single-process test and fail only under torchrun."""
    if not isinstance(op, str) or op not in _OPS:
        raise ConfigError(f"all_reduce for {what}: unknown op {op!r}; allowed: {', '.join(map(repr, _OPS))}")
    if not active():
        return t
    buf = t.detach().to(_comm_device(), copy=True)
    _collective(what, lambda: dist.all_reduce(buf, op=getattr(dist.ReduceOp, _OPS[op])), [buf])
    return buf.to(t.device)


def _pickled(obj) -> torch.Tensor:
    """``obj`` pickled into a fresh uint8 tensor (CPU) that only Python refers to."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(t: torch.Tensor):
    """The object :func:`_pickled` put in ``t`` (any device)."""
    return pickle.loads(t.cpu().numpy().tobytes())


def all_gather_object(obj, what: str) -> list:
    """One picklable object from every rank, in rank order (``[obj]`` without a group)."""
    if not active():
        return [obj]
    device, world = _comm_device(), world_size()
    mine = _pickled(obj)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    _collective(f"{what} (sizes)", lambda: dist.all_gather(sizes, size), [size, *sizes])
    counts = [int(n) for n in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    _collective(what, lambda: dist.all_gather(parts, padded), [padded, *parts])
    return [_unpickled(part[:n]) for part, n in zip(parts, counts)]


def broadcast_object(obj, src: int, what: str):
    """``obj`` from rank ``src`` on every rank (``obj`` itself without a group)."""
    if not active():
        return obj
    device = _comm_device()
    mine = _pickled(obj) if rank() == src else None
    size = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.int64, device=device)
    _collective(f"{what} (size)", lambda: dist.broadcast(size, src=src), [size])
    data = mine.to(device, copy=True) if mine is not None else torch.empty(int(size), dtype=torch.uint8,
                                                                              device=device)
    _collective(what, lambda: dist.broadcast(data, src=src), [data])
    return _unpickled(data)


def barrier(timeout: float, what: str) -> None:
    """Wait for every rank for at most ``timeout`` seconds; names the ranks that did not arrive.

    gloo has a monitored barrier (rank 0 reports the missing ranks, the others
    time out waiting for rank 0); other backends use the plain barrier, bounded
    by the group's own timeout.
    """
    if not active():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            dist.barrier()
    except (RuntimeError, dist.DistError) as err:
        raise _failed(f"{what} (waited up to {timeout:g} s for every rank)", err) from err
