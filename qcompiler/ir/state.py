"""The parameters and buffers of a model before something runs its Python, and putting them back.

Tracing runs a forward's Python on the real tensors (fx proxies a buffer only once an op mixes it
with a graph value), and shape propagation may run a graph for real: a module that writes its own
state (a running mean, a call counter) would leave it changed.  :class:`ModelState` notes each
tensor's identity and version counter, and restores what moved.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.parameter import UninitializedTensorMixin


def tracked(t: torch.Tensor) -> bool:
    """Tensors whose writes can be seen: not inference tensors (no version counter; nothing writes them
    outside inference mode) nor a lazy module's uninitialized ones."""
    return not isinstance(t, UninitializedTensorMixin) and not t.is_inference()


def tensor_attributes(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` for every parameter, buffer and plain tensor attribute of every module
    of ``root`` (fx's constants among them)."""
    for path, module in root.named_modules():
        prefix = f"{path}." if path else ""
        for name, value in (*vars(module).items(), *module._parameters.items(), *module._buffers.items()):
            if isinstance(value, torch.Tensor):
                yield prefix + name, value


class ModelState:
    """``model``'s parameters and buffers now.  A write may change one in place (``self.mean.mul_(0.5)``)
    or replace it (``self.calls = self.calls + 1``); :meth:`restore` puts them back, from ``pristine``
    (a model ``model`` is a copy of, e.g. the user's) or, without one, from copies of the buffers made
    here."""

    def __init__(self, model: nn.Module, pristine: Optional[nn.Module] = None) -> None:
        self.model = model
        self.params = {name: t for name, t in model.named_parameters() if tracked(t)}
        self.buffers = {name: t for name, t in model.named_buffers() if tracked(t)}
        self.versions = {name: t._version for name, t in (*self.params.items(), *self.buffers.items())}
        if pristine is not None:
            self.sources = {**dict(pristine.named_parameters()), **dict(pristine.named_buffers())}
        else:  # the user's own model: only buffers can be kept (parameters are large)
            self.sources = {name: t.detach().clone() for name, t in self.buffers.items()}

    def restore(self) -> tuple[list[str], list[str]]:
        """``(written, lost)``: names changed or replaced since, and those of them that could not be
        put back (a parameter changed in the user's own model)."""
        written, lost = [], []
        now = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        for name, t in (*self.params.items(), *self.buffers.items()):
            replaced, changed = now.get(name) is not t, t._version != self.versions[name]
            if not (replaced or changed):
                continue
            written.append(name)
            if replaced:
                owner, _, attr = name.rpartition(".")
                module = self.model.get_submodule(owner)
                (module._parameters if name in self.params else module._buffers)[attr] = t
            if changed:
                source = self.sources.get(name)
                if source is None:
                    lost.append(name)
                    continue
                with torch.no_grad():
                    if t.shape != source.shape:
                        t.resize_(source.shape)
                    t.copy_(source)
        return written, lost


__all__ = ["ModelState", "tensor_attributes", "tracked"]
