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

from dataclasses import replace
from typing import Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import CalibrationError, UnsupportedOpError
from qcompiler.ir.meta import BPU, META_OP, META_QDTYPE, META_STUB, placement
from qcompiler.ir.modules import free_name, set_module
from qcompiler.ir.ops import META_OPS
from qcompiler.nn import quantized as qnn
from qcompiler.nn.qat import has_weight_layer
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.convert_rules.context import Constant, ConvertContext, QParams, attr_value, qparams_of
from qcompiler.passes.convert_rules.registry import rule_for
from qcompiler.passes.insert_observers import (
    CONSTANT_OPERAND_OPS,
    CONSTANT_QUANT,
    OBSERVERS,
    OUTPUT_OBSERVER,
    SCALE_PRESERVING_OPS,
)
from qcompiler.passes.place import PLACEMENT
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize
from qcompiler.quantization.observer import ObserverBase


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


def convert(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Replace every BPU node by its fixed-point module (the rule of its op, ``convert_rules``), the
    stubs and boundary quantizers by Quantize / Requantize / DeQuantize, and fold the output observers."""
    check_observed(gm)
    modules = dict(gm.named_modules(remove_duplicate=False))  # optimize_graph shares cat quantizers
    qp: dict[fx.Node, QParams] = {}
    consts: dict[fx.Node, Constant] = {}
    converted_paths: set[str] = set()

    def install(node: fx.Node, new: nn.Module) -> None:
        """A layer keeps its module path (debug tools match layers by path) unless shared; any other
        module gets a fresh name."""
        if isinstance(new, qnn.QuantizedWeightLayer) and node.target not in converted_paths:
            set_module(gm, node.target, new)
            converted_paths.add(node.target)
        else:
            _install(gm, node, new)

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
                qp[node] = QParams(c.scale, c.dtype)
            continue  # add / sub / mul fold it into their module; erased once unused
        if op == "quant":
            quantizer = getattr(module, "activation_post_process", None) if not stub else module
            if quantizer is None:
                quantizer = module
            qp[node] = qparams_of(quantizer, where)
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
        rule_ctx = ConvertContext(node, op, module, qp, consts, out=None)
        if op in SCALE_PRESERVING_OPS:
            qp[node] = rule_ctx.input()
            install(node, _apply(replace(rule_ctx, out=qp[node])))
            continue
        out_obs = next((u for u in node.users if u.meta.get(META_STUB) == OUTPUT_OBSERVER), None)
        out = qparams_of(modules[out_obs.target], f"node '{out_obs.name}'") if out_obs is not None else None
        if module is not None and has_weight_layer(module):
            new = _apply(rule_ctx)  # the layer's own output quantizer, or a high-precision output
            if new.out_scale is not None:
                qp[node] = QParams(new.out_scale, new.out_dtype)
            install(node, new)
            continue
        if out is None:
            raise UnsupportedOpError(f"{where} ({op}) has no output quantizer; a high-precision output "
                                     f"is only supported on conv/linear layers")
        install(node, _apply(replace(rule_ctx, out=out)))
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


def _apply(ctx: ConvertContext) -> nn.Module:
    """The fixed-point module the rule of ``ctx.op`` builds."""
    return rule_for(ctx)(ctx)


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


def _constant(gm: fx.GraphModule, node: fx.Node, quantizer: nn.Module, where: str) -> Constant:
    """Quantize the constant a constant-quantizer node reads, with that quantizer's scale
    (the integers the fake-quant model computes with)."""
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "get_attr"):
        raise UnsupportedOpError(f"{where}: a constant quantizer must read a buffer or parameter (get_attr)")
    qparams = qparams_of(quantizer, where)
    value = attr_value(gm, src)
    return Constant(fp.quantize(value, qparams.scale, qparams.dtype), qparams.scale, qparams.dtype)


CONVERT = Pass("convert", convert, requires=(PLACEMENT, OBSERVERS))
