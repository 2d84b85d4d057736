"""Canonical ops: one definition per op, the spellings that map to it, and one argument reader.

Passes, the op-support tables and the emitters speak of ops by one canonical name
("conv2d", "add", "reshape"...) whatever spelling the model used: an ``nn.Conv2d`` module,
``F.conv2d``, ``x + y``, ``torch.add`` or ``x.add``. Each op is one row of
:mod:`.catalogue` (name, :class:`Tag` groups, :class:`Signature`, spellings); the
spelling tables and tag sets of :mod:`.registry` are derived from it; :func:`bind` reads
any node's arguments by name (:mod:`.bind`); :mod:`.canonical` names a node's op;
:mod:`.names` holds the constants of the ops the BPU side speaks of.
"""

from qcompiler.ir.ops import names
from qcompiler.ir.ops.bind import Binding, Callee, bind, callee, read_arguments
from qcompiler.ir.ops.canonical import (
    clamp_bounds, clamp_op, describe_target, emit_op, is_clamp, is_number, module_op, node_op,
)
from qcompiler.ir.ops.opdef import REQUIRED, OpDef, Signature, Tag, sig
from qcompiler.ir.ops.registry import (
    FUNCTION_OPS, LAYOUT_OPS, META_OPS, METHOD_OPS, MODULE_OPS, OPS, PASSTHROUGH_OPS, definition, tagged,
)

__all__ = [
    "names", "Binding", "Callee", "bind", "callee", "read_arguments",
    "clamp_bounds", "clamp_op", "describe_target", "emit_op", "is_clamp", "is_number", "module_op", "node_op",
    "REQUIRED", "OpDef", "Signature", "Tag", "sig",
    "FUNCTION_OPS", "LAYOUT_OPS", "META_OPS", "METHOD_OPS", "MODULE_OPS", "OPS", "PASSTHROUGH_OPS", "definition",
    "tagged",
]
