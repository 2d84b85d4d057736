"""The facts op-support constraints look at, extracted once per node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.ir.meta import META_TENSOR, TensorInfo
from qcompiler.ir.ops import bind, is_number
from qcompiler.nn.fused import ZERO_PADDING_MODES
from qcompiler.quantization.fixed_point import padding_attr


@dataclass
class OpInfo:
    """A node as op-support rules see it: canonical op, tensor shapes, op attributes."""

    node: fx.Node
    op: str
    module: Optional[nn.Module]
    in_shapes: list[Optional[tuple[int, ...]]]  # per positional tensor-or-constant operand
    out_shapes: list[tuple[int, ...]]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_shapes(self) -> list[tuple[int, ...]]:
        """Every input and output tensor shape (the march-wide limits apply to all)."""
        return [s for s in self.in_shapes if s is not None] + self.out_shapes


def _pair(v) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        return (int(v[0]), int(v[-1]))
    return (int(v), int(v))


def _padding(v) -> tuple[int, ...]:
    """``(h, w)``, or ``(t, l, b, r)`` for a four-sided padding whose sides differ (fixed_point.pads4)."""
    return tuple(padding_attr(v)) if isinstance(v, (tuple, list)) and len(v) == 4 else _pair(v)


def _flat_infos(info) -> list[TensorInfo]:
    if isinstance(info, TensorInfo):
        return [info]
    if isinstance(info, (tuple, list)):
        return [t for i in info for t in _flat_infos(i)]
    return []


def _base_module(module: Optional[nn.Module]) -> Optional[nn.Module]:
    """The conv/linear inside a fused module (``.op``), or the module itself."""
    inner = getattr(module, "op", None)
    return inner if isinstance(inner, nn.Module) else module


Modules = dict[str, nn.Module]


def _conv_attrs(module: Optional[nn.Module], node: fx.Node, modules: Modules, transposed: bool) -> dict:
    conv = _base_module(module)
    if isinstance(conv, (nn.Conv2d, nn.ConvTranspose2d)):
        return {
            "in_channels": conv.in_channels,
            "out_channels": conv.out_channels,
            "kernel": _pair(conv.kernel_size),
            "stride": _pair(conv.stride),
            "padding": _padding(conv.padding) if not isinstance(conv.padding, str) else (0, 0),
            "dilation": _pair(conv.dilation),
            "groups": conv.groups,
            "padding_mode": "zeros" if conv.padding_mode in ZERO_PADDING_MODES else conv.padding_mode,
            "padded": any(conv._reversed_padding_repeated_twice),  # also for padding="same"
        }
    kw = bind(node, modules)
    weight = kw["weight"]
    wshape = weight.meta[META_TENSOR].shape if isinstance(weight, fx.Node) and isinstance(
        weight.meta.get(META_TENSOR), TensorInfo
    ) else None
    groups = int(kw["groups"] or 1)
    attrs = {
        "stride": _pair(kw["stride"]),
        "padding": _pair(kw["padding"]) if not isinstance(kw["padding"], str) else (0, 0),
        "dilation": _pair(kw["dilation"]),
        "groups": groups,
    }
    if wshape is not None:
        if transposed:
            attrs.update(in_channels=wshape[0], out_channels=wshape[1] * groups)
        else:
            attrs.update(out_channels=wshape[0], in_channels=wshape[1] * groups)
        attrs["kernel"] = (wshape[2], wshape[3])
    return attrs


_POOL_OPTIONS = {"dilation": 1, "ceil_mode": False, "return_indices": False, "count_include_pad": True,
                 "divisor_override": None}


def _pool_attrs(module: Optional[nn.Module], node: fx.Node, modules: Modules) -> dict:
    if module is not None and hasattr(module, "kernel_size"):
        kernel, stride, padding = module.kernel_size, module.stride, module.padding
        options = {k: getattr(module, k, v) for k, v in _POOL_OPTIONS.items()}
    else:
        kw = bind(node, modules)
        kernel, stride, padding = kw["kernel_size"], kw["stride"], kw["padding"]
        options = {k: kw.get(k, v) for k, v in _POOL_OPTIONS.items()}
    kernel = _pair(kernel)
    stride = _pair(stride) if stride not in (None, [], ()) else kernel
    options["dilation"] = _pair(options["dilation"])
    return {"kernel": kernel, "stride": stride, "padding": _padding(padding), **options}


def _interp_attrs(module: Optional[nn.Module], node: fx.Node, modules: Modules) -> dict:
    mode = getattr(module, "mode", None) if module is not None else bind(node, modules)["mode"]
    return {"mode": mode or "nearest"}


def _dim_attr(node: fx.Node, modules: Modules) -> dict:
    """The ``dim`` of cat / mean / softmax, given by position or keyword (or its default)."""
    return {"dim": bind(node, modules)["dim"]}


def _softmax_attrs(node: fx.Node, modules: Modules) -> dict:
    """softmax / log_softmax: ``dim`` (None when not given) and ``dtype`` as the call gives them."""
    kw = bind(node, modules)
    return {"dim": kw["dim"], "dtype": kw.get("dtype")} if kw is not None else {"dim": None, "dtype": None}


def _adaptive_attrs(module: Optional[nn.Module], node: fx.Node, modules: Modules) -> dict:
    """``output_size`` as (h, w); a None entry keeps the input's size along that dim (torch's meaning)."""
    size = module.output_size if module is not None else bind(node, modules)["output_size"]
    if size is None:
        return {"output_size": None}
    h, w = (size[0], size[-1]) if isinstance(size, (tuple, list)) else (size, size)
    src = node.args[0].meta.get(META_TENSOR) if node.args and isinstance(node.args[0], fx.Node) else None
    in_hw = tuple(src.shape[-2:]) if isinstance(src, TensorInfo) and len(src.shape) >= 2 else (None, None)
    return {"output_size": (in_hw[0] if h is None else int(h), in_hw[1] if w is None else int(w))}


# functional ops whose argument at this index is a parameter (a weight), not an operand: it is
# not one of the tensors the march-wide limits look at, and must be a constant
_PARAMETER_ARGS = {"prelu": 1}


def op_info(node: fx.Node, op: str, modules: dict[str, nn.Module]) -> OpInfo:
    """Build the OpInfo of a call node whose canonical op is ``op``.

    ``attrs["constant_operands"]`` counts Python numbers and constant tensors (``get_attr``:
    buffers, parameters) among the positional operands, ``attrs["feature_map_operands"]``
    the other tensors (values computed at run time).
    """
    module = modules.get(node.target) if node.op == "call_module" else None
    in_shapes: list[Optional[tuple[int, ...]]] = []
    constants = feature_maps = 0
    attrs: dict[str, Any] = {}
    param_index = _PARAMETER_ARGS.get(op) if node.op == "call_function" else None
    if param_index is not None and "weight" in node.kwargs:
        w = node.kwargs["weight"]
        attrs["weight_constant"] = isinstance(w, fx.Node) and w.op == "get_attr"
    for i, a in enumerate(node.args):
        if i == param_index:
            attrs["weight_constant"] = isinstance(a, fx.Node) and a.op == "get_attr"
            in_shapes.append(None)
            continue
        if isinstance(a, fx.Node):
            info = a.meta.get(META_TENSOR)
            in_shapes.append(info.shape if isinstance(info, TensorInfo) else None)
            if a.op == "get_attr":
                constants += 1
            elif isinstance(info, TensorInfo):
                feature_maps += 1
        elif isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
            in_shapes.extend(x.meta[META_TENSOR].shape if isinstance(x.meta.get(META_TENSOR), TensorInfo) else None for x in a)
            constants += sum(1 for x in a if x.op == "get_attr")
            feature_maps += sum(1 for x in a if x.op != "get_attr" and isinstance(x.meta.get(META_TENSOR), TensorInfo))
        else:
            in_shapes.append(None)
            constants += is_number(a)
    out_shapes = [t.shape for t in _flat_infos(node.meta.get(META_TENSOR))]
    if op in ("conv2d", "conv_transpose2d"):
        attrs.update(_conv_attrs(module, node, modules, transposed=(op == "conv_transpose2d")))
    elif op in ("max_pool2d", "avg_pool2d"):
        attrs.update(_pool_attrs(module, node, modules))
    elif op == "interpolate":
        attrs.update(_interp_attrs(module, node, modules))
    elif op in ("cat", "mean", "softmax"):
        attrs.update(_dim_attr(node, modules))
    if op in ("sum", "mean", "amax", "amin"):  # nash reductions: dims, keepdim, a dtype (constraints.reduction)
        kw = bind(node, modules)
        attrs.update(dim=kw["dim"], keepdim=kw["keepdim"], dtype=kw.get("dtype"))
    elif op == "adaptive_avg_pool2d":
        attrs.update(_adaptive_attrs(module, node, modules))
    elif op == "div":
        attrs["rounding_mode"] = node.kwargs.get("rounding_mode")
    elif op == "pow":  # the table of x ** c needs a tensor base and a Python-number exponent
        kw = bind(node, modules)
        attrs["exponent"] = kw["exponent"] if is_number(kw["exponent"]) else None
        attrs["tensor_base"] = isinstance(kw["input"], fx.Node)
    if op in ("softmax", "log_softmax", "masked_softmax"):  # softmax kernels (nash)
        attrs.update(_softmax_attrs(node, modules))
    attrs["constant_operands"] = constants
    attrs["feature_map_operands"] = feature_maps
    return OpInfo(node, op, module, in_shapes, out_shapes, attrs)
