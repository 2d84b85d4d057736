"""torch's private names qcompiler needs, each imported here and nowhere else.

Each has no public equivalent in the supported torch releases (docs/compatibility.md says why
each one is kept); tests/test_compat.py checks that each still exists and behaves as used here,
so a torch release that moves one fails there, naming it.

* ``pytree`` (``torch.utils._pytree``), ``TreeSpec``: how FX and ``torch.export`` flatten nested
  inputs and outputs; the graphs' input / output structure must match theirs leaf for leaf.
* ``OpOverload``, ``HigherOrderOperator`` (``torch._ops``): the types of an exported graph's
  call targets (aten overloads, ``cond`` / ``while_loop`` ...).
* ``unset_fake_temporarily`` (``torch._subclasses.fake_tensor``): a real call inside an export's
  fake-tensor tracing (a leaf module's output shape).
* ``int_mm`` (``torch._int_mm``): the exact int8 x int8 -> int32 GEMM of the simulator's kernels.
* ``as_qint8`` (``torch._make_per_tensor_quantized_tensor``): int8 values viewed as a qint8
  tensor without a copy, for torch's vectorized quantized max pool.
* ``global_forward_hooks`` / ``global_forward_pre_hooks`` (``torch.nn.modules.module``): whether
  a global hook is set, which a fused module's fast path must not skip.
* ``is_functorch_wrapped_tensor`` (``torch._C._functorch``): a vmap / grad wrapper, which the
  fused fast path must not see through.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.modules.module import _global_forward_hooks as global_forward_hooks
from torch.nn.modules.module import _global_forward_pre_hooks as global_forward_pre_hooks
from torch.utils._pytree import TreeSpec

__all__ = ["pytree", "TreeSpec", "OpOverload", "HigherOrderOperator", "unset_fake_temporarily", "int_mm",
           "as_qint8", "global_forward_hooks", "global_forward_pre_hooks", "is_functorch_wrapped_tensor"]


def int_mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 matrices into the int32 ``out`` (``torch._int_mm``)."""
    return torch._int_mm(a, b, out=out)


def int_mm_exists() -> bool:
    return hasattr(torch, "_int_mm")


def as_qint8(x: torch.Tensor) -> torch.Tensor:
    """The int8 tensor ``x`` viewed as a qint8 tensor of scale 1, zero point 0 (no copy)."""
    return torch._make_per_tensor_quantized_tensor(x, 1.0, 0)


def is_functorch_wrapped_tensor(t: torch.Tensor) -> bool:
    """True for a functorch (vmap / grad) wrapper tensor."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)
