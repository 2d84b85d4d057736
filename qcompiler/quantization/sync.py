"""Observer state across ``torch.distributed`` ranks: check the ranks agree, reduce exactly.

The public face is :mod:`qcompiler.distributed`; this module sits beside the
quantization primitives so that ``convert_fx`` and ``prepare_qat_fx`` can call
it.  qcompiler never starts processes or a process group: launch with
``torchrun`` and call ``torch.distributed.init_process_group`` (gloo on CPU,
NCCL on GPU).  With no group, or one rank, every function here is a no-op.

What is reduced, and when (docs/distributed.md):

* ``sync_observers(model)`` -- called by ``convert_fx``, by the calibration ->
  QAT hand-over in ``prepare_qat_fx`` and by ``compile`` (through
  ``convert_fx``) -- first checks that every rank holds the same graph,
  observers and weights, then reduces every observer exactly (min/max with
  MIN/MAX, histograms as integer counts on a shared power-of-two grid with
  SUM), with three all-reduces for all observers together
  (:func:`~qcompiler.quantization.observer.reduce_observers`).  The result is
  bit for bit what one process calibrating on the union of the shards holds,
  whatever the number of ranks or the split.
* QAT fake quants reduce each batch's min/max before their moving average
  (``sync_each_batch``), so scales stay identical on every rank at every step.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from typing import Iterable, Mapping

import torch.nn as nn

from qcompiler import collectives
from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.quantization.fake_quantize import FakeQuantize, observe_final_weights
from qcompiler.quantization.observer import ObserverBase, reduce_observers

__all__ = ["sync_observers", "check_same_model", "require_batches", "DEFAULT_TIMEOUT", "timeout_from_env"]

TIMEOUT_ENV = "QCOMPILER_DIST_TIMEOUT"
BUILT_IN_TIMEOUT = 300.0  # seconds, when TIMEOUT_ENV is unset or unusable


def timeout_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """The seconds ``TIMEOUT_ENV`` sets (a positive finite number), else BUILT_IN_TIMEOUT.

    A bad value is a QCompilerWarning and the built-in default, not an error: it is read when
    qcompiler is imported (the functions' defaults are bound then), and an error there would break
    ``import qcompiler`` in every process, most of which never sync; raising later, at the first
    sync point, would come only after the calibration it was to guard.
    """
    raw = environ.get(TIMEOUT_ENV)
    if raw is None:
        return BUILT_IN_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if math.isfinite(seconds) and seconds > 0:
        return seconds
    warnings.warn(f"{TIMEOUT_ENV}={raw!r} is not a positive finite number of seconds (e.g. 600); using the "
                  f"default {BUILT_IN_TIMEOUT:g} s", QCompilerWarning, stacklevel=2)
    return BUILT_IN_TIMEOUT


def _check_timeout(timeout: object, what: str) -> None:
    """ConfigError unless ``timeout`` is a positive finite number of seconds (a bad one would fail the
    wait at once and blame the other ranks)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"{what}: timeout must be a positive finite number of seconds, got {timeout!r}")


# seconds every rank waits for the others at a sync point before reporting the missing ones
# (QCOMPILER_DIST_TIMEOUT in the environment overrides it for every sync point, e.g. in compile)
DEFAULT_TIMEOUT = timeout_from_env()


def _observers(model: nn.Module) -> list[tuple[str, ObserverBase]]:
    """Every observer once, in module order (a shared one under its first name)."""
    seen, out = set(), []
    for path, m in model.named_modules():
        if isinstance(m, ObserverBase) and id(m) not in seen:
            seen.add(id(m))
            out.append((path, m))
    return out


def _digest(parts: Iterable) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _fingerprint(model: nn.Module, observers: list[tuple[str, ObserverBase]]) -> dict[str, str]:
    """Short hashes of what every rank must share: graph, observer configs, weights."""
    code = getattr(model, "code", None) or type(model).__qualname__
    obs = [f"{p}:{type(o).__name__}:{o.dtype}:{o.ch_axis}:{getattr(o, 'method', '')}:"
           f"{getattr(o, 'bins', '')}:{getattr(o, 'percentile', '')}" for p, o in observers]
    weights = (memoryview(p.detach().cpu().contiguous().numpy()).cast("B") for _, p in model.named_parameters())
    return {"graph": _digest([code.encode()]), "observers": _digest(s.encode() for s in obs),
            "weights": _digest(weights)}


def check_same_model(model: nn.Module, what: str = "sync_observers") -> None:
    """ConfigError on every rank unless all ranks hold the same graph, observers and weights."""
    if not collectives.active():
        return
    mine = _fingerprint(model, _observers(model))
    everyone = collectives.all_gather_object(mine, f"{what}: comparing the models of the ranks")
    diffs = [f"rank {r} has other {', '.join(k for k in mine if fp[k] != everyone[0][k])}"
             for r, fp in enumerate(everyone) if fp != everyone[0]]
    if diffs:
        raise ConfigError(
            f"{what}: the ranks do not hold the same model ({'; '.join(diffs)} than rank 0). Every rank "
            f"must prepare the same float model with the same qconfig_dict, hybrid_dict and march"
        )


def sync_observers(model: nn.Module, *, timeout: float = DEFAULT_TIMEOUT) -> nn.Module:
    """Reduce every observer of ``model`` over all ranks, in place; returns ``model``.

    Call it on every rank after calibrating this rank's shard (``convert_fx``
    and ``prepare_qat_fx`` call it for you). Each rank then holds exactly the
    observer state of one process calibrating on all shards. Idempotent.
    Ranks that do not arrive within ``timeout`` seconds, or hold another model,
    give an error on every rank.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"sync_observers takes a torch.nn.Module, got {type(model).__name__}")
    _check_timeout(timeout, "sync_observers")
    observe_final_weights(model)  # weights calibration skipped as unchanged, as they are now (every rank)
    if not collectives.active():
        return model
    collectives.barrier(timeout, "sync_observers")
    check_same_model(model)
    reduce_observers([obs for _, obs in _observers(model)])
    for m in model.modules():  # QAT fake quants refresh their scale from the reduced observer
        if isinstance(m, FakeQuantize) and m.observer_enabled[0] == 1 and m.has_observed:
            m._store(m.activation_post_process.calculate_qparams()[0])
    return model


def require_batches(n: int, what: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """ConfigError on every rank if any rank has no batch of ``what`` (an empty shard)."""
    _check_timeout(timeout, what)
    if not collectives.active():
        return
    collectives.barrier(timeout, what)
    counts = collectives.all_gather_object(int(n), f"{what}: counting the batches of every rank")
    empty = [r for r, c in enumerate(counts) if c == 0]
    if empty:
        raise ConfigError(
            f"{what}: rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of "
            f"{len(counts)} got no batch (batches per rank: {counts}); give every rank at least one "
            f"batch, e.g. use fewer ranks than batches"
        )

