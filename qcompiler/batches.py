"""One convention for calibration and analysis data: a batch is the model's positional
arguments as a tuple or list, or a single tensor for a one-input model.

Inputs are checked against the example inputs a model was compiled with, in one place
(:func:`check_inputs`), for calibration data and for calls of a compiled model alike, so a
mistake is reported before any work and the same way whichever backend runs first:

- the same number of inputs, and the same nesting for tuple inputs;
- dense tensors (``torch.from_numpy`` converts numpy arrays, ``.to_dense()`` sparse ones) of
  the example's dtype, except that a floating tensor of another precision (float64, numpy's
  default; float16) is cast to the example's floating dtype: the model computes in it anyway;
- the same number of dims and the same sizes, except the batch size: the batch is dim 0 of
  the first input; each input may differ from the example in one dim, one that has the
  example's batch size there (dim 0, or e.g. dim 1 of an LSTM state ``(layers, batch, hidden)``),
  and only to this batch size.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from qcompiler.errors import ConfigError


def as_args(batch: Any) -> tuple:
    """The positional arguments a batch stands for."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def fresh_args(args: Sequence[Any]) -> tuple:
    """``args`` with every tensor (inside tuples, lists and dicts too) copied, for one run of a model over
    inputs that are run again: a model may change its input in place (``x.sub_(mean).div_(std)``), and
    the next run over the same stored batch would then see the changed one."""
    return tuple(_fresh(a) for a in args)


def _fresh(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        items = [_fresh(x) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    if isinstance(v, dict):
        return {k: _fresh(x) for k, x in v.items()}
    return v


def input_signature(example_inputs: Sequence[Any]) -> list:
    """JSON-able description of example inputs, what :func:`check_inputs` compares with.

    Per input ``{"dtype": "float32", "shape": [1, 3, 8, 8]}``, a list of those for a tuple
    input, None for a non-tensor (not checked).
    """
    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
        if isinstance(v, (tuple, list)):
            return [describe(x) for x in v]
        return None
    return [describe(v) for v in example_inputs]


def check_inputs(args: Sequence[Any], signature: Sequence[Any], *, where: str,
                 names: Optional[Sequence[str]] = None) -> tuple:
    """``args`` checked against ``signature`` (the rules above); returns them with floats cast.

    ConfigError, prefixed with ``where`` (e.g. "calib_data batch 3"), names the input
    (position, and name when ``names`` are given) and says what was expected.
    """
    args = tuple(args)
    labels = [f"input {i}" + (f" ({names[i]!r})" if names and i < len(names) else "") for i in range(len(signature))]
    if len(args) != len(signature):
        listed = f" ({', '.join(names)})" if names else ""
        raise ConfigError(f"{where}: the model takes {len(signature)} inputs{listed}, got {len(args)}")
    leaves: list[tuple[str, dict, torch.Tensor]] = []
    out = tuple(_check_value(a, s, label, where, leaves) for a, s, label in zip(args, signature, labels))
    _check_sizes(leaves, where)
    return out


def _check_value(v: Any, spec: Any, label: str, where: str, leaves: list) -> Any:
    """Nesting, type, dtype and rank of one input; collects tensors for the size check."""
    if isinstance(spec, list):
        if not isinstance(v, (tuple, list)) or len(v) != len(spec):
            raise ConfigError(f"{where}: {label} must be a tuple of {len(spec)} values like the example input's, "
                              f"got {_describe(v)}")
        return type(v)(_check_value(x, s, f"{label}[{i}]", where, leaves) for i, (x, s) in enumerate(zip(v, spec)))
    if spec is None:
        return v
    want = getattr(torch, spec["dtype"], None)
    if not isinstance(want, torch.dtype):
        raise ConfigError(f"{where}: {label}: the model's input signature names an unknown dtype {spec['dtype']!r}")
    if not isinstance(v, torch.Tensor):
        hint = " (torch.from_numpy converts it)" if type(v).__module__ == "numpy" else ""
        raise ConfigError(f"{where}: {label} must be a {spec['dtype']} tensor, got {_describe(v)}{hint}")
    _check_dense(v, label, where)
    if v.is_meta:
        raise ConfigError(f"{where}: {label} is a meta tensor (a shape without data); pass a tensor with data "
                          "(on the CPU)")
    if v.dtype != want:
        if not (v.is_floating_point() and want.is_floating_point):
            raise ConfigError(f"{where}: {label} must be a {spec['dtype']} tensor like the example input's, "
                              f"got {str(v.dtype).replace('torch.', '')}")
        v = v.to(want)
    if v.dim() != len(spec["shape"]):
        raise ConfigError(f"{where}: {label} has shape {tuple(v.shape)} ({v.dim()} dims); the example input "
                          f"has {tuple(spec['shape'])} ({len(spec['shape'])} dims)")
    leaves.append((label, spec, v))
    return v


def _check_dense(v: torch.Tensor, label: str, where: str) -> None:
    """ConfigError naming ``label`` when ``v`` is not a dense (strided) tensor: sparse, mkldnn... tensors
    have no strides, and the model's first op fails on them deep inside torch."""
    if v.layout != torch.strided:
        raise ConfigError(f"{where}: {label} is a {v.layout} tensor; qcompiler runs dense (strided) tensors only: "
                          "pass x.to_dense()")


def require_dense(args: Sequence[Any], *, where: str) -> None:
    """:func:`check_dense` for every tensor in ``args`` (example inputs, where no signature checks them)."""
    for i, a in enumerate(args):
        for t in tensors_in(a):
            _check_dense(t, f"input {i}", where)


def _check_sizes(leaves: list[tuple[str, dict, torch.Tensor]], where: str) -> None:
    """Every size as in the example, except one batch dim per input (see the module docstring)."""
    first = next(((label, s["shape"][0], v.shape[0]) for label, s, v in leaves if s["shape"]), None)
    if first is None:
        return
    batch_of, b0, b = first
    for label, spec, v in leaves:
        want, got = spec["shape"], tuple(v.shape)
        differ = [d for d, (w, g) in enumerate(zip(want, got)) if w != g]
        if 0 in got and 0 not in want:
            raise ConfigError(f"{where}: {label} is empty (shape {got}); give at least one sample")
        if len(differ) > 1 or any(want[d] != b0 or got[d] != b for d in differ):
            raise ConfigError(
                f"{where}: {label} has shape {got}; the example input has {tuple(want)}, and only the batch size "
                f"may differ (here {b}, dim 0 of {batch_of}), in one dim where the example has its batch size {b0}")


def require_samples(args: Sequence[Any], *, where: str) -> None:
    """ConfigError (prefixed with ``where``) if the batch has no samples: a batch size of 0
    (dim 0 of the first input), which runs the model but shows an observer nothing."""
    first = next(((i, t) for i, a in enumerate(args) for t in _tensors(a) if t.dim() > 0), None)
    if first is not None and first[1].shape[0] == 0:
        raise ConfigError(f"{where}: input {first[0]} has batch size 0 (shape {tuple(first[1].shape)}); "
                          "calibration needs at least one sample in every batch")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a value: a tensor, or tuples / lists / dicts of them (a node's output, a batch)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    return []


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')} tensor of shape {tuple(v.shape)}"
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__} of {len(v)}"
    return type(v).__name__
