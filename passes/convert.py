"""Convert a prepared (calibrated or QAT) graph to fixed point.

Each BPU node becomes a module of ``qcompiler.nn.quantized`` working on
QTensors with the scales its observers / fake quants settled on; the
graph-node output observers fold into the op before them; CPU nodes stay
float. QuantStubs and boundary observers quantize, DeQuantStubs dequantize; a
QuantStub (or boundary observer) on a value that is already quantized, directly
or through a DeQuantStub, requantizes it, or disappears when the scale and
dtype are the same.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.errors import CalibrationError, ConfigError, UnsupportedOpError
from qcompiler.ir.meta import BPU, META_OP, META_QDTYPE, META_STUB, placement, shape
from qcompiler.ir.modules import free_name, set_module
from qcompiler.ir.ops import META_OPS, is_number
from qcompiler.nn import fused
from qcompiler.nn import quantized as qnn
from qcompiler.nn.qat import FLOAT_CLASS, bn_affine, bn_weight, has_weight_layer, output_channel_scales
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.insert_observers import (
    CONSTANT_OPERAND_OPS,
    CONSTANT_QUANT,
    OUTPUT_OBSERVER,
    SCALE_PRESERVING_OPS,
)
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize, observe_final_weight
from qcompiler.quantization.observer import ObserverBase

# element-wise functions evaluated through a table; float64 versions for table building
LUT_FUNCTIONS = {
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "silu": F.silu,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "gelu": F.gelu,
    "elu": F.elu,
    "selu": F.selu,
}


class _QParams:
    """Scale and dtype of the integers a node produces (per-tensor)."""

    def __init__(self, scale: float, dtype: str) -> None:
        self.scale, self.dtype = float(scale), dtype


def _qparams_of(quantizer: nn.Module, where: str) -> _QParams:
    if isinstance(quantizer, FakeQuantize):
        if not getattr(quantizer, "_has_qparams", True):
            raise CalibrationError(f"{where}: fake quant has no scale (never ran); calibrate or train first")
        scale = quantizer.scale
    elif isinstance(quantizer, (CalibFakeQuantize, ObserverBase)):
        scale = quantizer.calculate_qparams()[0]
    else:
        raise UnsupportedOpError(f"{where}: cannot read a scale from {type(quantizer).__name__}")
    return _QParams(float(scale.reshape(-1)[0]), quantizer.dtype)


def check_observed(gm: fx.GraphModule) -> None:
    """CalibrationError naming every observer that never saw data (convert needs all of them)."""
    missing = []
    for path, m in gm.named_modules():
        if isinstance(m, FakeQuantize):
            if not m.has_observed and not getattr(m, "_has_qparams", False):
                missing.append(path)
        elif isinstance(m, (CalibFakeQuantize, ObserverBase)) and not m.has_observed:
            if not any(path.startswith(p + ".") for p in missing):
                missing.append(path)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise CalibrationError(
            f"these observers never saw data: {shown}. Run the prepared model on calibration data "
            f"(or train it) before convert_fx; a module never called in forward cannot be converted"
        )


def _install(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    """Make ``node`` a call of ``module`` under a fresh root name (shared float modules stay intact)."""
    name = free_name(gm, node.name, sep="_q")
    gm.add_submodule(name, module)
    node.op, node.target = "call_module", name


def _weight_module(module: nn.Module):
    """(base layer with weight_fake_quant, activation name, with_add) of an observed weight layer."""
    if isinstance(module, fused.FusedModule):
        act = None if module.act is None else ("relu6" if isinstance(module.act, nn.ReLU6) else "relu")
        return module.op, act, module.with_add
    return module, None, False


def _weight_params(base: nn.Module, where: str):
    wfq = getattr(base, "weight_fake_quant", None)
    axis = 1 if isinstance(base, nn.ConvTranspose2d) else 0
    w = base.weight.detach()
    if wfq is None:
        raise CalibrationError(f"{where}: weight has no fake quant; prepare the model first")
    if isinstance(wfq, FakeQuantize):
        scale = wfq.scale.detach().clone()
    else:
        observe_final_weight(wfq, w)
        scale = wfq.calculate_qparams()[0]
    dtype = wfq.dtype
    q = fp.quantize(w, scale, dtype, axis=axis if scale.numel() > 1 else None)
    return q, output_channel_scales(base, scale.reshape(-1)), axis


def _geometry(base: nn.Module, node: fx.Node) -> dict:
    if isinstance(base, nn.Linear):
        return {}
    mode = getattr(base, "padding_mode", "zeros")
    if mode not in fused.ZERO_PADDING_MODES and any(base._reversed_padding_repeated_twice):
        # placement keeps these off the BPU (constraints.zero_padding); a forced one must not zero-pad silently
        raise UnsupportedOpError(f"node '{node.name}': padding_mode='{mode}' has no fixed-point lowering (the BPU "
                                 f"pads with zeros); run this conv on CPU (hybrid_dict)")
    padding = base.padding if isinstance(base, nn.ConvTranspose2d) else tuple(fp.padding_attr(base.padding))
    g = {"stride": base.stride, "padding": padding, "dilation": base.dilation, "groups": base.groups}
    if isinstance(base, nn.ConvTranspose2d):
        g["output_padding"] = base.output_padding
    return g


def convert(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    check_observed(gm)
    modules = dict(gm.named_modules(remove_duplicate=False))  # optimize_graph shares cat quantizers
    qp: dict[fx.Node, _QParams] = {}
    consts: dict[fx.Node, _Constant] = {}
    converted_paths: set[str] = set()

    def install_layer(node: fx.Node, new: nn.Module) -> None:
        """A layer keeps its module path (debug tools match layers by path) unless shared."""
        if node.target in converted_paths:
            _install(gm, node, new)
        else:
            set_module(gm, node.target, new)
            converted_paths.add(node.target)

    def in_q(node: fx.Node, i: int = 0) -> _QParams:
        src = node.args[i]
        if isinstance(src, fx.Node) and src in qp:
            return qp[src]
        raise UnsupportedOpError(f"node '{node.name}': input {i} is not a quantized BPU value")

    for node in list(gm.graph.nodes):
        if not node.op.startswith("call_") or placement(node) != BPU:
            continue
        op = node.meta.get(META_OP)
        stub = node.meta.get(META_STUB)
        module = modules.get(node.target) if node.op == "call_module" else None
        where = f"node '{node.name}'"
        if stub == OUTPUT_OBSERVER:
            continue  # folded into its producer below
        if stub == CONSTANT_QUANT:
            consts[node] = c = _constant(gm, node, module, where)
            if any(u.meta.get(META_OP) not in CONSTANT_OPERAND_OPS for u in node.users):
                # a user reads it as a value (a cat, a layer fused with + constant): a constant BPU value
                node.args = ()
                _install(gm, node, qnn.QuantizedConstant(c.q, c.scale, c.dtype))
                qp[node] = _QParams(c.scale, c.dtype)
            continue  # add / sub / mul fold it into their module; erased once unused
        if op == "quant":
            quantizer = getattr(module, "activation_post_process", None) if not stub else module
            if quantizer is None:
                quantizer = module
            qp[node] = _qparams_of(quantizer, where)
            _convert_quant(gm, node, qp)
            continue
        if op == "dequant":
            src = node.args[0] if node.args else None
            if isinstance(src, fx.Node) and src.meta.get(META_OP) == "dequant":
                node.replace_all_uses_with(src)  # a DeQuantStub of a dequantized value: the identity
                gm.graph.erase_node(node)
                continue
            _install(gm, node, qnn.DeQuantize())
            continue
        if op in META_OPS:
            continue  # x.size() of a QTensor is its shape: nothing to convert
        if op in SCALE_PRESERVING_OPS:
            qp[node] = in_q(node)
            _install(gm, node, _same_scale(node, module, qp[node].dtype))
            continue
        out_obs = next((u for u in node.users if u.meta.get(META_STUB) == OUTPUT_OBSERVER), None)
        out = _qparams_of(modules[out_obs.target], f"node '{out_obs.name}'") if out_obs is not None else None
        if module is not None and has_weight_layer(module):
            new = _convert_weight_layer(node, module, in_q(node), qp, where)
            if new.out_scale is not None:
                qp[node] = _QParams(new.out_scale, new.out_dtype)
            install_layer(node, new)
            continue
        if out is None:
            raise UnsupportedOpError(f"{where} ({op}) has no output quantizer; a high-precision output "
                                     f"is only supported on conv/linear layers")
        if op == "batch_norm":
            install_layer(node, _convert_batch_norm(node, module, in_q(node), out, where))
        else:
            _install(gm, node, _convert_op(node, op, module, qp, consts, out, where))
        qp[node] = out
        out_obs.replace_all_uses_with(node)
        gm.graph.erase_node(out_obs)
    for node, q in qp.items():  # CompiledModel.activation_dtypes reads them
        if node.meta.get(META_STUB) != CONSTANT_QUANT:
            node.meta[META_QDTYPE] = q.dtype
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return PassResult(gm, True)


def _quantized_source(src, qp: dict) -> Optional[fx.Node]:
    """The quantized BPU value behind ``src`` (itself, or the input of a DeQuantStub of one), or None
    when ``src`` is a float."""
    if isinstance(src, fx.Node) and src.meta.get(META_OP) == "dequant" and placement(src) == BPU and src.args:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and src in qp else None


def _convert_quant(gm: fx.GraphModule, node: fx.Node, qp: dict) -> None:
    """A quantizer node: Quantize a float; a QuantStub or quantizer on a value that is already
    quantized (directly, or through a DeQuantStub) is a Requantize from that value's grid, or
    nothing at all when the grids are the same."""
    out = qp[node]
    src = _quantized_source(node.args[0] if node.args else None, qp)
    if src is None:
        _install(gm, node, qnn.Quantize(out.scale, out.dtype))
        return
    if (qp[src].scale, qp[src].dtype) == (out.scale, out.dtype):
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        del qp[node]
        return
    node.args, node.kwargs = (src,), {}
    _install(gm, node, qnn.Requantize(qp[src].scale, qp[src].dtype, out.scale, out.dtype))


def _same_scale(node: fx.Node, module: Optional[nn.Module], dtype: str) -> qnn.QuantizedSameScale:
    """The fixed-point module of a node that keeps its input's grid, saying what it computes."""
    op = node.meta.get(META_OP)
    if op == "relu":
        return qnn.QuantizedSameScale(op, dtype=dtype)
    if node.op == "call_function":
        return qnn.QuantizedSameScale(op, function=node.target, dtype=dtype)
    if node.op == "call_method":
        return qnn.QuantizedSameScale(op, method=node.target, dtype=dtype)
    if op == "max_pool2d":
        m = module
        if m.return_indices:  # a second, index output: not a quantized value
            raise UnsupportedOpError(f"node '{node.name}': max_pool2d with return_indices=True has no "
                                     f"fixed-point lowering; use return_indices=False on the BPU, or "
                                     f"run this module on CPU (hybrid_dict)")
        return qnn.QuantizedSameScale(op, float_module=m, dtype=dtype)
    if op == "flatten":
        return qnn.QuantizedSameScale(op, float_module=module, dtype=dtype)
    return qnn.QuantizedSameScale(op, dtype=dtype)  # identity, dropout (eval)


def _convert_weight_layer(node, module, qin: _QParams, qp, where) -> qnn.QuantizedWeightLayer:
    base, act, with_add = _weight_module(module)
    base_float = FLOAT_CLASS.get(type(base), type(base))
    kind = {nn.Conv2d: "conv2d", nn.ConvTranspose2d: "conv_transpose2d", nn.Linear: "linear"}[base_float]
    q_w, w_scale, _ = _weight_params(base, where)
    apq = getattr(module, "activation_post_process", None)
    out = None if apq is None else _qparams_of(apq, f"{where} output")
    other_scale = None
    if with_add:
        other = node.args[1]
        if not (isinstance(other, fx.Node) and other in qp):
            raise UnsupportedOpError(f"{where}: the add operand is not a quantized BPU value")
        other_scale = qp[other].scale
    bias = base.bias.detach() if base.bias is not None else None
    return qnn.QuantizedWeightLayer(
        kind, q_w, w_scale, bias, qin.scale, None if out is None else out.scale,
        "qint8" if out is None else out.dtype, _geometry(base, node), act, other_scale, name=node.name,
    )


class _Constant:
    """A constant operand on its quantization grid: integers, per-tensor scale, dtype."""

    def __init__(self, q: torch.Tensor, scale: float, dtype: str) -> None:
        self.q, self.scale, self.dtype = q, float(scale), dtype


def _attr_value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The tensor a ``get_attr`` node reads."""
    obj = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj.detach() if isinstance(obj, torch.Tensor) else torch.as_tensor(obj)


def _constant(gm: fx.GraphModule, node: fx.Node, quantizer: nn.Module, where: str) -> _Constant:
    """Quantize the constant a constant-quantizer node reads, with that quantizer's scale
    (the integers the fake-quant model computes with)."""
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "get_attr"):
        raise UnsupportedOpError(f"{where}: a constant quantizer must read a buffer or parameter (get_attr)")
    qparams = _qparams_of(quantizer, where)
    value = _attr_value(gm, src)
    return _Constant(fp.quantize(value, qparams.scale, qparams.dtype), qparams.scale, qparams.dtype)


def _number(c) -> _Constant:
    """A Python number as an exact constant: ``sign(c)`` at scale ``|c|`` (1.0 for 0)."""
    c = float(c)
    sign = (c > 0) - (c < 0)
    return _Constant(torch.tensor(sign, dtype=torch.int8), abs(c) if c else 1.0, "qint8")


def _split_constant(a, b, qp, consts):
    """(feature-map operand, constant, position of the constant) of a binary op whose operands
    are ``a, b``, or None when no operand is a quantized BPU value beside a constant."""
    for x, c, index in ((a, b, 1), (b, a, 0)):
        if isinstance(x, fx.Node) and x in qp:
            if isinstance(c, fx.Node) and c in consts:
                return x, consts[c], index
            if is_number(c):
                return x, _number(c), index
    return None


def _convert_batch_norm(node, module, qin: _QParams, out: _QParams, where) -> qnn.QuantizedWeightLayer:
    """A standalone BatchNorm2d as a depthwise 1x1 conv: per-channel int8 weights ``+-127`` at
    scale ``|a_c| / 127`` (``qat.bn_weight``) and an int32 bias, like the fake-quant model."""
    if not isinstance(module, nn.BatchNorm2d) or module.running_mean is None:
        raise UnsupportedOpError(f"{where}: only an nn.BatchNorm2d with running statistics has a fixed-point "
                                 f"lowering (a per-channel affine); run this one on CPU (hybrid_dict)")
    a, b = bn_affine(module)
    q, scale = bn_weight(a)
    c = q.numel()
    geometry = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": c}
    return qnn.QuantizedWeightLayer("conv2d", q.reshape(c, 1, 1, 1), scale, b, qin.scale, out.scale, out.dtype,
                                    geometry, name=node.name)


def _convert_op(node, op, module, qp, consts, out: _QParams, where) -> nn.Module:
    def scale_of(arg) -> Optional[float]:
        return qp[arg].scale if isinstance(arg, fx.Node) and arg in qp else None

    args = node.args
    if op in ("add", "sub", "mul"):
        alpha = node.kwargs.get("alpha", 1) if op != "mul" else 1
        if not is_number(alpha) or alpha == 0 or not math.isfinite(alpha):
            raise UnsupportedOpError(
                f"{where}: {op} with alpha={alpha!r}: the BPU folds a finite, non-zero number into the "
                f"second operand's multiplier; compute the scaled operand separately (e.g. with a mul)"
            )
        a, b = args[0], args[1] if len(args) > 1 else node.kwargs.get("other")
        sa, sb = scale_of(a), scale_of(b)
        number = b if sa is not None else a
        if op == "mul" and is_number(number) and (sa, sb) != (None, None):  # x * number: its own path
            return qnn.QuantizedMul(sa if sa is not None else sb, None, out.scale, out.dtype, constant=float(number))
        split = _split_constant(a, b, qp, consts)
        if split is not None:
            x, const, index = split
            new = qnn.QuantizedConstantOperand(op, qp[x].scale, const.q, const.scale, index, out.scale, out.dtype,
                                               alpha=float(alpha))
            node.args, node.kwargs = (x,), {}  # the constant lives in the module now
            return new
        if sa is not None and sb is not None:
            if op == "mul":
                return qnn.QuantizedMul(sa, sb, out.scale, out.dtype)
            return qnn.QuantizedAdd(sa, sb, out.scale, out.dtype, sub=(op == "sub"), alpha=float(alpha))
        raise UnsupportedOpError(
            f"{where}: {op} needs a quantized BPU operand and the other a BPU value, a number or a "
            f"buffer/parameter (with its constant quantizer from prepare); prepare the model again, or "
            f"run this op on CPU (hybrid_dict)")
    if op == "div":
        sa, sb = scale_of(args[0]), scale_of(args[1])
        if sa is None or sb is None:
            raise UnsupportedOpError(f"{where}: div needs two quantized BPU operands (the BPU divides feature "
                                     f"maps); run this op on CPU (hybrid_dict)")
        try:
            return qnn.QuantizedDiv(sa, sb, qp[args[1]].dtype, out.scale, out.dtype)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    if op == "cat":
        tensors = args[0]
        scales = [scale_of(t) for t in tensors]
        if any(s is None for s in scales):
            raise UnsupportedOpError(f"{where}: cat of a non-quantized input")
        return qnn.QuantizedCat(scales, out.scale, out.dtype)
    if op == "matmul":
        return qnn.QuantizedMatmul(scale_of(args[0]), scale_of(args[1]), out.scale, out.dtype)
    if op in LUT_FUNCTIONS:
        src = qp[args[0]]
        return qnn.QuantizedLookup(op, LUT_FUNCTIONS[op], src.scale, src.dtype, out.scale, out.dtype)
    if op in ("adaptive_avg_pool2d", "mean"):
        keepdim = True
        if op == "mean":
            keepdim = bool(node.kwargs.get("keepdim", args[2] if len(args) > 2 else False))
        return qnn.QuantizedAvgPool(qp[args[0]].scale, out.scale, out.dtype, keepdim=keepdim)
    if op == "avg_pool2d":
        if module is not None:
            k, s, p = module.kernel_size, module.stride, module.padding
        else:
            kw = node.normalized_arguments(node.graph.owning_module, normalize_to_only_use_kwargs=True).kwargs
            k, s, p = kw["kernel_size"], kw.get("stride"), kw.get("padding", 0)
        return qnn.QuantizedAvgPool(qp[args[0]].scale, out.scale, out.dtype, kernel=k, stride=s or k, padding=p)
    if op == "interpolate":
        mode = getattr(module, "mode", None) if module is not None else node.kwargs.get("mode", "nearest")
        align = getattr(module, "align_corners", None) if module is not None else node.kwargs.get("align_corners")
        return qnn.QuantizedResize(mode or "nearest", qp[args[0]].scale, out.scale, out.dtype,
                                   shape(node)[2:], align)
    if op == "relu6":
        return qnn.QuantizedPReLU(op, torch.zeros(1), qp[args[0]].scale, out.scale, out.dtype, top=6.0)
    if op in ("prelu", "leaky_relu"):
        if module is not None:
            slope = module.weight if op == "prelu" else torch.tensor([module.negative_slope])
        else:
            if op == "leaky_relu":
                kw = node.normalized_arguments(node.graph.owning_module, normalize_to_only_use_kwargs=True).kwargs
                slope = torch.tensor([kw.get("negative_slope", 0.01)])
            else:
                weight = args[1] if len(args) > 1 else node.kwargs.get("weight")
                if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
                    raise UnsupportedOpError(f"{where}: functional prelu whose slope is computed at run time; the "
                                             f"BPU takes a parameter or buffer as the slope, or run it on CPU")
                slope = _attr_value(node.graph.owning_module, weight)
                node.args, node.kwargs = (args[0],), {}  # the slope lives in the module now
        return qnn.QuantizedPReLU(op, slope, qp[args[0]].scale, out.scale, out.dtype)
    raise UnsupportedOpError(f"{where}: no fixed-point lowering for BPU op '{op}' yet")


CONVERT = Pass("convert", convert)
