"""Names of the facts passes attach to FX nodes and to the graph, and small typed accessors.

Every fact a pass adds to a node lives in ``node.meta`` under one of these
constants, never in ad-hoc attributes, so a dump or a later pass can find it;
a fact about the whole graph lives in ``gm.meta`` under a ``GM_`` constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

from qcompiler.errors import PassError

# module scope: tuple[ScopeEntry, ...], outermost (the root, path "") first
META_SCOPE = "qc_scope"
# tensor facts from shape propagation: TensorInfo, a (nested) tuple/list of
# them for containers, or None for a non-tensor value (an int from .size())
META_TENSOR = "qc_tensor"
# the storages a node's tensors live in, from shape propagation (frozenset of opaque ints): two nodes
# sharing one are aliases (a view, or an op that returns its input), which an in-place write changes both of
META_STORAGE = "qc_storage"
# set on an in-place op left in place because an alias of the value it writes is read after it
# (passes/out_of_place.py); convert warns when the value reaches the op from another partition
META_ALIASED_WRITE = "qc_aliased_write"
# set on the ``setitem_`` node passes/view_writes.py adds to write an in-place op's result back into the
# tensor it wrote through a view: the name of that op (the write-back is no read the op must precede)
META_WRITE_BACK = "qc_write_back"
# canonical op name ("conv2d", "add", ...) or None for graph plumbing
META_OP = "qc_op"
# placement: "bpu" | "cpu"; and the human-readable reason for it
META_PLACEMENT = "qc_placement"
META_REASON = "qc_reason"
# the note of the rewrite (passes/rewrite.py) that produced the node, shown with its placement reason
META_REWRITE = "qc_rewrite"
# why a module the tracer could not trace runs as a whole (an automatic leaf, qcompiler.ir.auto_leaf):
# placement keeps such a node on the CPU with this reason
META_AUTO_LEAF = "qc_auto_leaf"
# partition name ("bpu0", "cpu1", ...)
META_PARTITION = "qc_partition"
# names of the original nodes a fused node replaced, in pattern order
META_FUSED_FROM = "qc_fused_from"
# after convert: the integer type ("qint8" / "qint16" / "qint32") of a BPU node's quantized output
META_QDTYPE = "qc_qdtype"
# at insert_observers: why a BPU node's output type is the march's per-op default, not its qconfig's
META_DTYPE_REASON = "qc_dtype_reason"
# what a node inserted by the stub pass is: "input_dequant" | "activation_post_process";
# by the observer pass: STUB_OUTPUT_OBSERVER | STUB_CONSTANT_QUANT
META_STUB = "qc_stub"
STUB_OUTPUT_OBSERVER = "output_observer"  # a graph-node observer ``<node>_activation_post_process``
STUB_CONSTANT_QUANT = "constant_quant"  # the quantizer node of a constant operand
# quantizer nodes that only record or fake-quantize a value (convert folds them into the ops):
# not ops of a partition, so no node count includes them
QUANTIZER_STUBS = frozenset({STUB_OUTPUT_OBSERVER, STUB_CONSTANT_QUANT})

BPU = "bpu"
CPU = "cpu"
PLACEMENTS = (BPU, CPU)

# gm.meta: the March the graph was placed for (set by the front end, read by every later stage)
GM_MARCH = "qc_march"
# gm.meta: what the graph is: "calibration" | "qat" (prepare) | "quantized" (convert)
GM_KIND = "qc_kind"
# gm.meta: the HybridConfig the model was placed with
GM_HYBRID = "qc_hybrid"
# gm.meta: the qconfig_dict the model was prepared with, as given (None: the default)
GM_QCONFIG_DICT = "qc_qconfig_dict"
# gm.meta of a calibration model: the record of the last auto_int16 (chosen set, steps, SQNRs)
GM_INT16 = "qc_int16"
# gm.meta: the partitions of a partitioned graph (a list of qcompiler.ir.partitions.Partition)
GM_PARTITIONS = "qc_partitions"
# gm.meta of a prepared model: the input_signature of the example inputs it was prepared with,
# what data given to it later (auto_int16's batches) is checked against
GM_INPUT_SIGNATURE = "qc_input_signature"
# gm.meta: the torch.utils._pytree TreeSpec of the call's (args, kwargs). Where it is set, the graph's
# placeholders are that tree's tensor leaves, in tree_flatten order, and the caller's structured
# inputs (dicts of keyword inputs, nested tuples and lists) are flattened by it before the call
GM_INPUT_SPEC = "qc_input_spec"
# gm.meta: the TreeSpec of the model's output (dicts, ModelOutput dataclasses, namedtuples, nested
# tuples). Where it is set, the graph's output node returns the flat tuple of the leaves and the
# compiled model rebuilds the structure with tree_unflatten
GM_OUTPUT_SPEC = "qc_output_spec"
# on the output node of a traced graph, until qcompiler.ir.structure.flatten_output reads it: the TreeSpec
# of the value the forward returned (torch.fx keeps only plain dicts; this keeps OrderedDict, ModelOutput)
META_TRACED_OUTPUT = "qc_traced_output"


@dataclass(frozen=True)
class ScopeEntry:
    """One enclosing module of a node: its dotted path and its class."""

    path: str
    module_type: type

    @property
    def type_name(self) -> str:
        return self.module_type.__qualname__


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor value seen during shape propagation."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


def scope(node: fx.Node) -> tuple[ScopeEntry, ...]:
    return node.meta.get(META_SCOPE, ())


def tensor_info(node: fx.Node) -> Optional[TensorInfo]:
    """The TensorInfo of a node with one tensor output, else None."""
    info = node.meta.get(META_TENSOR)
    return info if isinstance(info, TensorInfo) else None


def shape(node: Any) -> Optional[tuple[int, ...]]:
    """Shape of a node's single tensor output, or None (not a node / not a tensor)."""
    if not isinstance(node, fx.Node):
        return None
    info = tensor_info(node)
    return info.shape if info is not None else None


def carries_tensor(node: fx.Node) -> bool:
    """True if the node's value is (or contains) a tensor."""
    return _has_tensor(node.meta.get(META_TENSOR))


def _has_tensor(info: Any) -> bool:
    if isinstance(info, TensorInfo):
        return True
    if isinstance(info, (tuple, list)):
        return any(_has_tensor(i) for i in info)
    return False


def placement(node: fx.Node) -> Optional[str]:
    return node.meta.get(META_PLACEMENT)


def set_placement(node: fx.Node, where: str, reason: str) -> None:
    if where not in PLACEMENTS:
        raise PassError(f"node {node.name} placed on {where!r}, not one of {', '.join(PLACEMENTS)}")
    node.meta[META_PLACEMENT] = where
    node.meta[META_REASON] = reason


def format_tensor_info(info: Any) -> str:
    """Short text of a META_TENSOR value for dumps: ``f32[1,3,224,224]``."""
    if info is None:
        return "-"
    if isinstance(info, TensorInfo):
        return str(info)
    if isinstance(info, (tuple, list)):
        return "(" + ", ".join(format_tensor_info(i) for i in info) + ")"
    return type(info).__name__
