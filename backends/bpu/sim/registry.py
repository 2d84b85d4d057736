"""The kernel tables: ``REFERENCE`` (exact by construction) and the ``FAST`` overlay, filled by
``@reference_kernel(kind)`` / ``@fast_kernel(kind)`` in each family's module; a second kernel for
one kind raises at import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.errors import InternalError


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel builder gets: the op, its inputs' specs, a name for errors, the scratch
    buffers and whether the exact int8 GEMM / oneDNN int8 convolution may be used."""

    op: BpuOp
    in_specs: list[ValueSpec]
    name: str
    ws: Workspace
    int8_gemm: bool
    onednn: bool = False
    native: bool = False

    @property
    def attrs(self) -> dict:
        return self.op.attrs

    @property
    def tensors(self) -> dict:
        return self.op.tensors

    @property
    def out_dtype(self) -> Optional[str]:
        return self.op.attrs.get("out_dtype")


KernelBuilder = Callable[[KernelSpec], Callable]

# op kind -> builder of its exact kernel (``qcompiler.quantization.fixed_point`` semantics): the reference
REFERENCE: dict[str, KernelBuilder] = {}
# op kind -> builder of a faster kernel, bit-exact with the reference (tests/test_bpu_simulator.py)
FAST: dict[str, KernelBuilder] = {}


def _register(table: dict[str, KernelBuilder], kinds: tuple[str, ...]) -> Callable[[KernelBuilder], KernelBuilder]:
    """A decorator that enters its builder in ``table`` under each of ``kinds`` (each at most once)."""
    def deco(build: KernelBuilder) -> KernelBuilder:
        for kind in kinds:
            if kind in table:
                raise InternalError(f"two simulator kernels for op kind {kind!r}")
            table[kind] = build
        return build
    return deco


def reference_kernel(*kinds: str) -> Callable[[KernelBuilder], KernelBuilder]:
    """Registers the decorated builder as the ``REFERENCE`` kernel of op ``kinds``."""
    return _register(REFERENCE, kinds)


def fast_kernel(*kinds: str) -> Callable[[KernelBuilder], KernelBuilder]:
    """Registers the decorated builder as the ``FAST`` kernel of op ``kinds``."""
    return _register(FAST, kinds)
