"""Thin wrappers over ``torch.distributed`` collectives used by observers and the scale-out helpers.

Nothing here starts a process group: qcompiler joins the default group the
user (or ``torchrun`` plus ``init_process_group``) created.  Without one, or
with a single rank, every helper is a no-op and returns its input, so the
single-process code path is the same code.

Tensors travel on the backend's device (CPU for gloo, the current CUDA device
for NCCL) and come back on the caller's device.  A failed collective (a rank
died, a timeout) becomes a :class:`CalibrationError` that says what was being
reduced and which rank saw the failure, never a raw backend traceback.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from qcompiler.errors import CalibrationError

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


def all_reduce(t: torch.Tensor, op: str, what: str) -> torch.Tensor:
    """``t`` reduced over all ranks (``op`` in max/min/sum); a new tensor on ``t``'s device."""
    if not active():
        return t
    buf = t.detach().to(_comm_device(), copy=True)
    try:
        dist.all_reduce(buf, op=getattr(dist.ReduceOp, _OPS[op]))
    except (RuntimeError, dist.DistError) as err:
        raise _failed(what, err) from err
    return buf.to(t.device)


def all_gather_object(obj, what: str) -> list:
    """One picklable object from every rank, in rank order (``[obj]`` without a group)."""
    if not active():
        return [obj]
    out = [None] * world_size()
    try:
        dist.all_gather_object(out, obj)
    except (RuntimeError, dist.DistError) as err:
        raise _failed(what, err) from err
    return out


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


def broadcast_object(obj, src: int, what: str):
    """``obj`` from rank ``src`` on every rank (``obj`` itself without a group)."""
    if not active():
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src)
    except (RuntimeError, dist.DistError) as err:
        raise _failed(what, err) from err
    return box[0]
