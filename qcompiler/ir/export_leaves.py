"""Leaf modules under torch.export: called as a whole, as the fx tracer leaves them.

torch.export records the ATen ops inside every module; a QuantStub, a DeQuantStub or an
``nn.Identity`` computes nothing in float and so leaves no trace at all, and a module the user
marked a leaf (``non_traceable_module_name`` / ``_class``, qcompiler's ``qc_leaf`` modules) would be
traced into. While exporting, each such module's forward is one call of the custom op
``qcompiler::leaf(inputs, path)`` (:func:`leaves_as_calls`), which the capture turns back into a
``call_module`` of ``path`` (qcompiler.ir.export_capture). A leaf takes tensors and returns one tensor;
one that does not is traced into as any module is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from qcompiler.compat.torch_private import unset_fake_temporarily
from qcompiler.ir.tracer import is_stub

_MODULES: dict[str, nn.Module] = {}  # path -> the leaf module, while an export runs


@torch.library.custom_op("qcompiler::leaf", mutates_args=())
def leaf(inputs: list[torch.Tensor], path: str) -> torch.Tensor:
    """The leaf module at ``path`` called on ``inputs`` (a copy where it returns an input: no aliasing)."""
    module = _MODULES[path]
    out = type(module).forward(module, *inputs)  # the class's forward: the instance's is this op's call
    return out.clone() if any(out is x for x in inputs) else out


@leaf.register_fake
def _(inputs: list[torch.Tensor], path: str) -> torch.Tensor:
    module = _MODULES[path]
    if is_stub(module) or isinstance(module, nn.Identity):
        return torch.empty_like(inputs[0])
    with unset_fake_temporarily(), torch.no_grad():  # the output's shape, from a real call on zeros
        real = type(module).forward(module, *(torch.zeros(x.shape, dtype=x.dtype) for x in inputs))
    return torch.empty(real.shape, dtype=real.dtype)


LEAF_OP = torch.ops.qcompiler.leaf.default


def is_export_leaf(module: nn.Module, path: str, names: Sequence[str], types: tuple) -> bool:
    """Whether torch.export calls ``module`` as a whole: stubs, nn.Identity, qcompiler's leaves, the user's."""
    return bool(path) and (is_stub(module) or isinstance(module, nn.Identity) or getattr(type(module), "qc_leaf", False)
                           or path in names or (bool(types) and isinstance(module, types)))


@contextlib.contextmanager
def leaves_as_calls(model: nn.Module, names: Sequence[str] = (), types: tuple = ()) -> Iterator[None]:
    """While the block runs, each leaf's forward is one ``qcompiler::leaf`` call (restored after)."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for path, module in model.named_modules():
            if not is_export_leaf(module, path, names, types):
                continue
            _MODULES[path] = module
            patched.append((module, module.__dict__.get("forward")))
            module.forward = _calling(path)
        yield
    finally:
        for module, saved in patched:
            if saved is None:
                del module.forward
            else:
                module.forward = saved
        _MODULES.clear()


def _calling(path: str) -> Callable[..., Any]:
    def forward(*args: Any) -> Any:
        if not args or not all(isinstance(a, torch.Tensor) for a in args):
            return type(_MODULES[path]).forward(_MODULES[path], *args)
        return leaf(list(args), path)

    return forward


__all__ = ["LEAF_OP", "is_export_leaf", "leaves_as_calls", "leaf"]
