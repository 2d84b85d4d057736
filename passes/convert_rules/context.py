"""What a convert rule reads: the node with its op and module, the grids settled so far, its output grid.

The convert pass (``passes/convert.py``) walks the graph and, for each BPU node, hands the rule of
its op one :class:`ConvertContext`. Rules read the node's arguments by name through ``args``, the one
:func:`qcompiler.ir.ops.bind` of the node (so a ``dim`` or ``keepdim`` given by position or by keyword
reads the same, whatever torch's schema matching makes of the call), and the quantized operands
through ``input``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import CalibrationError, UnsupportedOpError
from qcompiler.ir.ops import Binding, bind
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qcompiler.quantization.observer import ObserverBase


class QParams:
    """Scale and dtype of the integers a node produces (per-tensor)."""

    def __init__(self, scale: float, dtype: str) -> None:
        self.scale, self.dtype = float(scale), dtype


class Constant:
    """A constant operand on its quantization grid: integers, per-tensor scale, dtype."""

    def __init__(self, q: torch.Tensor, scale: float, dtype: str) -> None:
        self.q, self.scale, self.dtype = q, float(scale), dtype


def qparams_of(quantizer: nn.Module, where: str) -> QParams:
    """The grid a fake quant or observer settled on; CalibrationError if a fake quant never ran."""
    if isinstance(quantizer, FakeQuantize):
        if not getattr(quantizer, "_has_qparams", True):
            raise CalibrationError(f"{where}: fake quant has no scale (never ran); calibrate or train first")
        scale = quantizer.scale
    elif isinstance(quantizer, (CalibFakeQuantize, ObserverBase)):
        scale = quantizer.calculate_qparams()[0]
    else:
        raise UnsupportedOpError(f"{where}: cannot read a scale from {type(quantizer).__name__}")
    return QParams(float(scale.reshape(-1)[0]), quantizer.dtype)


def attr_value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The tensor a ``get_attr`` node reads."""
    obj = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj.detach() if isinstance(obj, torch.Tensor) else torch.as_tensor(obj)


@dataclass(frozen=True)
class ConvertContext:
    """One BPU node to convert.

    ``module`` is the module a ``call_module`` node calls (else None); ``qparams`` the grid of every
    quantized value converted so far and ``constants`` the quantized constant operands (both by
    node); ``out`` the node's output grid: its folded output observer's, its input's for an op that
    keeps the input's grid, None for a weight layer (which carries its own quantizer).
    """

    node: fx.Node
    op: str
    module: Optional[nn.Module]
    qparams: dict[fx.Node, QParams]
    constants: dict[fx.Node, Constant]
    out: Optional[QParams]

    @property
    def where(self) -> str:
        """How error messages name the node."""
        return f"node '{self.node.name}'"

    @cached_property
    def args(self) -> Binding:
        """The node's arguments by name (:func:`qcompiler.ir.ops.bind`, read once when a rule asks;
        a prepared model's stand-in such as ``qat.prelu`` binds as the op it was placed as)."""
        node = self.node
        binding = bind(node, {node.target: self.module} if self.module is not None else {})
        if binding is None:
            raise UnsupportedOpError(f"{self.where}: op '{self.op}' is no op of qcompiler.ir.ops; its arguments "
                                     f"cannot be read by name")
        return binding

    def operand(self, i: int = 0) -> Any:
        """Positional operand ``i``: the tensors a module's ``forward`` takes (a fused layer's add
        operand is its second), which every spelling the BPU admits passes first."""
        return self.node.args[i]

    def input(self, i: int = 0) -> QParams:
        """The grid of positional input ``i``; UnsupportedOpError when it is no quantized BPU value."""
        src = self.operand(i)
        if isinstance(src, fx.Node) and src in self.qparams:
            return self.qparams[src]
        raise UnsupportedOpError(f"{self.where}: input {i} is not a quantized BPU value")

    def scale_of(self, a: Any) -> Optional[float]:
        """The scale of ``a`` when it is a quantized BPU value, else None."""
        return self.qparams[a].scale if isinstance(a, fx.Node) and a in self.qparams else None
