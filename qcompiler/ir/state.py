"""The parameters, buffers and plain attributes of a model before something runs its Python, and
putting them back.

Tracing runs a forward's Python on the real tensors (fx proxies a buffer only once an op mixes it
with a graph value), and shape propagation runs a graph on meta tensors, or for real: a module that
writes its own state (a running mean, a call counter) would leave it changed, and one that rebinds a
plain attribute (torchvision's AnchorGenerator: ``self.cell_anchors = [a.to(dtype, device) for a in
self.cell_anchors]``) would keep the meta tensors or fx proxies it was run on.  :class:`ModelState`
notes each tensor's identity and version counter, and restores what moved; :class:`ModuleAttributes`
does the same for every module's plain attributes (its ``__dict__`` but nn.Module's own entries),
lists, tuples and dicts of tensors among them.
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


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, the hooks, training
_MISSING = object()


def _contents(value: object) -> Optional[list]:
    """The items of a list or a dict (a shallow copy, to compare by identity and put back), else None."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return list(value.items())
    return None


def _same_contents(value: object, contents: list) -> bool:
    now = _contents(value)
    if now is None or len(now) != len(contents):
        return False
    if isinstance(value, dict):
        return all((k is j or k == j) and v is w for (k, v), (j, w) in zip(now, contents))
    return all(a is b for a, b in zip(now, contents))


def _refill(value: object, contents: list) -> None:
    if isinstance(value, list):
        value[:] = contents
    else:
        value.clear()
        value.update(contents)


class ModuleAttributes:
    """Every module's plain attributes now (the entries of its ``__dict__`` that nn.Module does not own;
    a list's or a dict's items too).  :meth:`restore` rebinds what was rebound, refills a list or dict
    whose items changed, and deletes what was added (a cache the forward made on a meta run), so that
    running a model's Python leaves it as it was.  A write into a tensor held there is not seen (only
    parameters' and buffers' writes are: :class:`ModelState`)."""

    def __init__(self, root: nn.Module) -> None:
        self.entries = [(path, module, {k: (v, _contents(v)) for k, v in vars(module).items()
                                        if k not in _MODULE_INTERNALS})
                        for path, module in root.named_modules()]

    def restore(self) -> list[str]:
        """The qualified names put back (rebound, refilled or deleted)."""
        changed = []
        for path, module, saved in self.entries:
            attrs, prefix = vars(module), f"{path}." if path else ""
            for name in [k for k in attrs if k not in _MODULE_INTERNALS and k not in saved]:
                del attrs[name]
                changed.append(prefix + name)
            for name, (value, contents) in saved.items():
                moved = False
                if attrs.get(name, _MISSING) is not value:
                    attrs[name] = value
                    moved = True
                if contents is not None and not _same_contents(value, contents):
                    _refill(value, contents)
                    moved = True
                if moved:
                    changed.append(prefix + name)
        return changed


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
        self.attributes = ModuleAttributes(model)
        if pristine is not None:
            self.sources = {**dict(pristine.named_parameters()), **dict(pristine.named_buffers())}
        else:  # the user's own model: only buffers can be kept (parameters are large)
            self.sources = {name: t.detach().clone() for name, t in self.buffers.items()}

    def restore(self) -> tuple[list[str], list[str]]:
        """``(written, lost)``: names of parameters and buffers changed or replaced since, and those of
        them that could not be put back (a parameter changed in the user's own model).  Plain attributes
        rebound or added since are put back too (:class:`ModuleAttributes`; not reported: they are
        not state a graph reads)."""
        self.attributes.restore()
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


__all__ = ["ModelState", "ModuleAttributes", "tensor_attributes", "tracked"]
