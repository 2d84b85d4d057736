"""Op-support table types: which ops a march runs on the BPU, under which constraints (rows of :mod:`.bernoulli2`, :mod:`.bayes` and :mod:`.nash`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from qcompiler.backends.bpu.constraints import Constraint
from qcompiler.backends.bpu.op_info import OpInfo
from qcompiler.errors import InternalError
from qcompiler.ir.ops.names import (
    ADAPTIVE_AVG_POOL2D,
    AVG_POOL2D,
    CONV2D,
    CONV_TRANSPOSE2D,
    LINEAR,
    MATMUL,
    MAX_POOL2D,
    MEAN,
)
from qcompiler.march import March

# The BPU ops whose work pays for a trip to the BPU: multiply-accumulates (conv, linear, matmul) and
# pooling windows.  A connected BPU region with none of them between CPU ops (an r3d residual add
# between CPU conv3d / relu) only adds a quantize and a dequantize: passes/place.py moves it to the CPU.
WORK_OPS = frozenset({CONV2D, CONV_TRANSPOSE2D, LINEAR, MATMUL, MAX_POOL2D, AVG_POOL2D, ADAPTIVE_AVG_POOL2D, MEAN})


@dataclass(frozen=True)
class OpRule:
    """One row: an op the BPU runs, the constraints it must meet, whether int16 is allowed."""

    op: str
    constraints: tuple[Constraint, ...] = ()
    int16: bool = False
    # march-wide limits that do not apply to this op (e.g. ranks for 2..5-D element-wise ops)
    skip_general: bool = False


@dataclass(frozen=True)
class DefaultDtype:
    """A march's default activation type for one op's output, and why (the measurement behind it).

    It applies where the op's qconfig is the global one (the default, ``qconfig_dict[""]`` or a root
    ``qconfig`` attribute) and that qconfig asks for int8; a ``module_type`` / ``module_name`` entry or
    a module's ``qconfig`` attribute, as well as ``int16_budget`` / ``auto_int16``, still decide.
    """

    dtype: str
    reason: str


@dataclass(frozen=True)
class OpTable:
    march: March
    general: tuple[Constraint, ...]
    rules: dict[str, OpRule] = field(default_factory=dict)
    # op -> the march's default output type where the qconfig is the global int8 one (empty: int8 everywhere)
    default_dtypes: dict[str, DefaultDtype] = field(default_factory=dict)

    def check(self, info: OpInfo) -> tuple[bool, str]:
        """``(True, why)`` if the op runs on the BPU, else ``(False, reason it does not)``."""
        rule = self.rules.get(info.op)
        if rule is None:
            return False, f"{info.op} is not supported on {self.march.value}"
        for c in (() if rule.skip_general else self.general) + rule.constraints:
            reason = c(info)
            if reason is not None:
                return False, f"{info.op}: {reason} on {self.march.value}"
        return True, f"{info.op} supported on {self.march.value}"

    @property
    def has_int16(self) -> bool:
        """Does this march run any op on int16 activations? (bayes: yes; bernoulli2: int8 only)."""
        return any(rule.int16 for rule in self.rules.values())

    def default_dtype(self, op: str) -> Optional[DefaultDtype]:
        """The march's default output type of ``op`` under the global int8 qconfig, if it has one."""
        return self.default_dtypes.get(op)

    def supports(self, op: str) -> bool:
        return op in self.rules

    def rule(self, op: str) -> Optional[OpRule]:
        return self.rules.get(op)


def rules(*rows: OpRule) -> dict[str, OpRule]:
    table: dict[str, OpRule] = {}
    for row in rows:
        if row.op in table:
            raise InternalError(f"duplicate op-table row {row.op!r}: two OpRule rows for it in one table; keep one")
        table[row.op] = row
    return table
