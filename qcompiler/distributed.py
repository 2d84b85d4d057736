"""qcompiler on ``torch.distributed``: calibration, QAT, evaluation and analysis across processes.

Launch with ``torchrun`` and call ``torch.distributed.init_process_group``
(gloo on CPU, NCCL on GPU); qcompiler joins the default group and never
starts one.  Without a group, or with one rank, everything here is the
single-process code path.  docs/distributed.md has the whole story.

* :func:`sync_observers` reduces every observer over the ranks, exactly; the
  result equals one process calibrating on the union of the shards, so it
  cannot depend on the number of ranks.  ``convert_fx``, ``prepare_qat_fx``
  (from a calibration model) and ``compile`` call it for you.
* :func:`shard` gives this rank its share of a list (calibration batches).
* :func:`evaluate` runs a model over a DataLoader's dataset split by a
  ``DistributedSampler`` and computes the metric on rank 0 over all samples,
  in dataset order: the value one process would compute.
"""

from __future__ import annotations

import datetime
import numbers
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from qcompiler import collectives
from qcompiler.errors import ConfigError
from qcompiler.parallel import one_torch_thread
from qcompiler.quantization.sync import DEFAULT_TIMEOUT, check_same_model, require_batches, sync_observers

__all__ = ["sync_observers", "check_same_model", "require_batches", "shard", "evaluate", "is_main_process",
           "join_torchrun", "DEFAULT_TIMEOUT"]


_FIX = "launch with torchrun (it sets the torch.distributed variables), or unset WORLD_SIZE for a single process"


def _env_int(name: str, meaning: str, default: Optional[int] = None, *, low: int = 0,
             high: Optional[int] = None) -> Optional[int]:
    """The whole number in environment variable ``name`` (``default`` if unset), checked to be in
    ``[low, high)``; a ConfigError naming the variable and its ``meaning`` otherwise (``int()``
    would raise a bare ValueError, and an out-of-range rank would fail deep inside torch)."""
    text = os.environ.get(name)
    if text is None:
        return default
    bound = f"from {low} to {high - 1}" if high is not None else f"at least {low}"
    value = int(text) if re.fullmatch(r"[0-9]+", text.strip()) else None
    if value is None or value < low or (high is not None and value >= high):
        raise ConfigError(f"{name}={text!r}: it must be a whole number {bound} ({meaning}); {_FIX}")
    return value


def join_torchrun(timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Join the process group ``torchrun`` describes (WORLD_SIZE > 1 in the environment); True if it did.

    gloo on CPU, NCCL when CUDA is present. Already initialized, or a single
    process: nothing to do (False). The CLI calls it; scripts usually call
    ``init_process_group`` themselves. WORLD_SIZE, RANK, LOCAL_RANK and MASTER_PORT
    are checked first: a ConfigError naming the variable, not a ValueError from torch.
    """
    if dist.is_initialized():
        return False
    world = _env_int("WORLD_SIZE", "the number of processes", 1, low=1)
    if world <= 1:
        return False
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: launch with "
                          f"torchrun, or set the torch.distributed environment variables")
    _env_int("RANK", f"this process's rank of WORLD_SIZE={world}", high=world)
    local_rank = _env_int("LOCAL_RANK", f"this process's rank on its machine, of WORLD_SIZE={world}", 0, high=world)
    _env_int("MASTER_PORT", "the TCP port of rank 0", low=1, high=65536)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return True


def is_main_process() -> bool:
    """Rank 0 (or no process group): the process that writes files and reports."""
    return collectives.rank() == 0


def _whole(value: Any) -> bool:
    """An int (or a numpy integer) and not a bool: ``True`` is an int to Python, never a rank."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def shard(items, rank: Optional[int] = None, world: Optional[int] = None) -> list:
    """This rank's share of ``items``: every ``world``-th item from ``rank`` on (all of them without a group).

    ``world`` must be a positive int and ``0 <= rank < world``: slicing would take any
    int, and ``rank=-1`` or ``rank=world`` give a share that duplicates another rank's."""
    rank = collectives.rank() if rank is None else rank
    world = collectives.world_size() if world is None else world
    if not _whole(world) or world < 1:
        raise ConfigError(f"shard: world must be a positive int (the number of ranks), got {world!r}")
    if not _whole(rank) or not 0 <= rank < world:
        raise ConfigError(f"shard: rank must be an int from 0 to {world - 1} (world={world}), got {rank!r}")
    try:
        items = list(items)
    except TypeError:
        raise ConfigError(f"shard: items must be iterable (a list of batches), got {type(items).__name__}") from None
    return items[rank::world]


def _model_device(model: Any) -> Optional[torch.device]:
    if isinstance(model, nn.Module):
        for t in model.parameters():
            return t.device
        for t in model.buffers():
            return t.device
    return None


def _to(x: Any, device: Optional[torch.device]) -> Any:
    if device is None or device.type == "cpu":
        return x
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _as_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_as_cpu(v) for v in x)
    return x


def _rows(x: Any, n: int) -> list:
    """Split a batched output (a tensor, or a tuple of tensors) into ``n`` per-sample rows."""
    if isinstance(x, torch.Tensor):
        return list(x.unbind(0)) if x.dim() else [x] * n
    if isinstance(x, (tuple, list)):
        cols = [_rows(v, n) for v in x]
        return [type(x)(c[i] for c in cols) for i in range(n)]
    raise ConfigError(f"evaluate: model outputs must be tensors or tuples of tensors, got {type(x).__name__}")


def _stack(rows: list) -> Any:
    first = rows[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(rows)
    return type(first)(_stack([r[i] for r in rows]) for i in range(len(first)))


def _dataset_len(loader: DataLoader) -> int:
    """The number of samples of ``loader.dataset``, checked to be something evaluate can split.

    evaluate hands each rank its indices (a DistributedSampler) and collates them in batches of
    ``batch_size``, so it needs a non-empty map-style dataset (``len`` and ``dataset[i]``) and
    automatic batching on; an iterator or an IterableDataset cannot be split over the ranks in
    dataset order."""
    dataset = loader.dataset
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"evaluate: loader.dataset must be a map-style dataset with len() and dataset[i] "
                          f"(e.g. a TensorDataset or a list of (input, target) pairs), got {type(dataset).__name__}; "
                          f"evaluate splits it over the ranks by index, so put the samples in a list first")
    if loader.batch_size is None:
        raise ConfigError("evaluate: the DataLoader has batch_size=None (automatic batching off); evaluate collates "
                          "the samples itself: give it a batch_size, e.g. DataLoader(dataset, batch_size=32)")
    n = len(dataset)
    if n == 0:
        raise ConfigError("evaluate: loader.dataset is empty; the metric needs at least one (input, target) sample")
    return n


def evaluate(model: Callable, loader: DataLoader, metric: Callable[[Any, Any], Any], *,
             timeout: float = DEFAULT_TIMEOUT, progress: bool = True) -> Any:
    """``metric(outputs, targets)`` over every sample of ``loader.dataset``; the value on rank 0, None elsewhere.

    ``model``: a float, fake-quant, converted (``convert_fx``) or compiled
    (``qcompiler.compile``) model. ``loader``: a DataLoader over a map-style
    dataset of ``(input, target)`` items; its ``batch_size`` and
    ``collate_fn`` are kept, its sampler is replaced by a
    ``DistributedSampler`` (no shuffle) so each rank runs its share. Rank 0
    gathers the per-sample outputs and targets, puts them back in dataset
    order (the sampler's padding dropped) and computes the metric once: the
    value one process computes. Inputs go to the model's device; outputs come
    back to the CPU.

    Throughput: a background thread reads and collates the next batch while the model
    runs the current one (the model's torch ops release the GIL). A compiled model splits
    each batch over its worker threads (``CompiledModel.threads``, by default
    ``torch.get_num_threads()``: all cores) when its graph is proven per-sample
    (:mod:`qcompiler.parallel`), so it evaluates at about its single-call speed per sample
    and uses every core (benchmarks/throughput.py). ``progress``: a tqdm bar on rank 0.
    """
    if not callable(model):
        raise ConfigError(f"evaluate: model must be callable (a float, fake-quant, converted or compiled model), "
                          f"got {type(model).__name__}")
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"evaluate: loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if not callable(metric):
        raise ConfigError("evaluate: metric must be a callable metric(outputs, targets)")
    dataset, n = loader.dataset, _dataset_len(loader)
    world, rank = collectives.world_size(), collectives.rank()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False, drop_last=False)
    mine = [i for k, i in enumerate(sampler) if rank + k * world < n]  # drop the sampler's padding
    require_batches(len(mine), "evaluate", timeout=timeout)
    device = _model_device(model)
    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
    bs = loader.batch_size
    chunks = [mine[start:start + bs] for start in range(0, len(mine), bs)]
    outs, targets = [], []

    def load(indices: list[int]) -> tuple[Any, Any]:  # runs in the reader thread (no_grad is per thread)
        with torch.no_grad():
            batch = loader.collate_fn([dataset[i] for i in indices])
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError("evaluate: dataset items must be (input, target) pairs")
        return batch[0], batch[1]

    bar = tqdm(total=len(mine), desc="evaluating", unit="sample", disable=not progress or rank != 0, leave=False)
    caller_threads = torch.get_num_threads()
    try:
        # the reader collates on one torch thread: the model's calls use every core, and a second OpenMP
        # team of the reader's own would only contend with them (torch's thread count is per thread)
        with torch.no_grad(), ThreadPoolExecutor(1, thread_name_prefix="qcompiler-evaluate",
                                                 initializer=one_torch_thread) as reader:
            upcoming = reader.submit(load, chunks[0]) if chunks else None
            for k, indices in enumerate(chunks):
                x, y = upcoming.result()  # the reader's exception, if any, is raised here
                if k == 0:  # (the reader's set_num_threads also set the count later threads start with)
                    torch.set_num_threads(caller_threads)
                upcoming = reader.submit(load, chunks[k + 1]) if k + 1 < len(chunks) else None
                out = model(*_to(x, device)) if isinstance(x, (tuple, list)) else model(_to(x, device))
                outs += _rows(_as_cpu(out), len(indices))
                targets += _rows(_as_cpu(y), len(indices))
                bar.update(len(indices))
    finally:
        bar.close()
        if isinstance(model, nn.Module):
            model.train(was_training)
    gathered = collectives.all_gather_object((mine, outs, targets), "evaluate: gathering the outputs")
    if rank != 0:
        return None
    by_index: dict[int, tuple] = {}
    for idx, o_list, t_list in gathered:
        for i, o, t in zip(idx, o_list, t_list):
            by_index[i] = (o, t)
    keys = sorted(by_index)
    return metric(_stack([by_index[i][0] for i in keys]), _stack([by_index[i][1] for i in keys]))
