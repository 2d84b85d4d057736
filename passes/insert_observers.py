"""Attach observers (calibration) or fake quants (QAT) to the BPU ops, by qconfig.

Where a quantization point goes:

* a BPU conv / conv-transpose / linear / fused layer is swapped for its
  observed class (``qcompiler.nn.qat``) holding ``weight_fake_quant`` and
  ``activation_post_process`` (None for a high-precision output qconfig);
* a BPU QuantStub holds ``activation_post_process`` (torch.ao's stub is
  swapped for ours);
* the boundary observers of ``insert_stubs`` (``<cpu>_activation_post_process``)
  get the activation quantizer of the qconfig at the CPU node's scope (a CPU
  op that feeds the BPU "must have a qconfig", as in the hybrid flow);
* any other BPU op that makes new values (add, cat, matmul, lookup-table ops,
  pooling averages, resize...) gets a graph node ``<node>_activation_post_process``;
* ops that keep the input's scale (relu, max pool, layout ops, identities) get none;
* a constant tensor (a buffer or parameter, ``get_attr``) that a BPU add / sub / mul
  (or a fused conv + add, or a cat) reads gets a quantizer node ``<constant>_constant_fake_quant``
  (per tensor, like a weight: ``qat.constant_quantizer``), so the fake-quant model
  computes with the integers convert bakes into the op; a Python number needs none
  (``c = sign(c) * |c|`` is exact);
* a BPU BatchNorm2d is swapped for ``qat.BatchNorm2d`` and, like a weight layer, told
  its input quantizer (its bias goes on the grid ``s_in * s_w``); a functional BPU prelu
  calls ``qat.prelu`` (its slope follows the input's dtype).

The qconfig of a node comes from ``ctx.options.qconfig_resolver``
(priority global < module_type < module_name < module.qconfig; functional ops
inherit their module's). CPU ops keep no qconfig. With
``ctx.options.optimize_graph`` every BPU ``cat`` shares one quantizer
between its inputs and its output.

Running the pass again (calibration -> QAT hand-over) replaces every
quantizer it placed before, keeping node and module names.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from qcompiler.backends.bpu import op_table
from qcompiler.errors import ConfigError, PassError
from qcompiler.ir.meta import (
    BPU,
    META_DTYPE_REASON,
    META_FUSED_FROM,
    META_OP,
    META_PARTITION,
    META_SCOPE,
    META_STUB,
    META_TENSOR,
    STUB_CONSTANT_QUANT,
    STUB_OUTPUT_OBSERVER,
    ScopeEntry,
    placement,
    scope,
    set_placement,
)
from qcompiler.ir.modules import free_name, set_module
from qcompiler.march import to_march
from qcompiler.nn import qat
from qcompiler.nn.fused import FusedModule
from qcompiler.nn.qat import (
    DTYPE_FOLLOWING,
    follow_input_dtype,
    has_weight_layer,
    needs_input_quantizer,
    observe_layer,
    set_input_quantizer,
)
from qcompiler.passes.base import CompileContext, Fact, Pass, PassResult
from qcompiler.passes.insert_stubs import ACTIVATION_POST_PROCESS
from qcompiler.passes.place import PLACEMENT
from qcompiler.quantization.fake_quantize import FakeQuantize, FakeQuantizeBase
from qcompiler.quantization.observer import MinMaxObserver
from qcompiler.quantization.qconfig import QConfig, with_activation_dtype
from qcompiler.quantization.stubs import DeQuantStub, QuantStub

OUTPUT_OBSERVER = STUB_OUTPUT_OBSERVER  # META_STUB of the graph-node observers this pass adds
CONSTANT_QUANT = STUB_CONSTANT_QUANT  # META_STUB of the quantizer nodes of constant operands
CONSTANT_FAKE_QUANT = "constant_fake_quant"  # name suffix of those nodes
# BPU ops that read a constant tensor operand through a constant quantizer
CONSTANT_OPERAND_OPS = frozenset({"add", "sub", "mul"})

# Ops whose output keeps the input's quantization grid: no observer after them. (relu6 is
# not one: 6.0 is rarely on the input's grid, so it gets its own quantizer.)
SCALE_PRESERVING_OPS = frozenset({
    "relu", "max_pool2d", "identity", "dropout", "reshape", "flatten",
    "permute", "transpose", "getitem", "size", "dequant",
    "amax", "amin",  # nash reductions that select an input integer (convert_rules.reduce)
    "narrow", "slice",  # nash selections with constant indices (convert_rules.select)
})


def _require(qconfig: Optional[QConfig], node: fx.Node, boundary: bool = False) -> QConfig:
    """The node's qconfig, or a ConfigError saying where one is missing and how to set it."""
    if qconfig is not None and (qconfig.activation is not None or (qconfig.out_high_precision and not boundary)):
        return qconfig
    if boundary:
        who = f"model input '{node.name}'" if node.op == "placeholder" else f"CPU op '{node.name}'"
        what = f"{who} feeds the BPU but has no activation qconfig"
    else:
        what = f"BPU op '{node.name}' ({node.meta.get(META_OP)}) has no qconfig"
    raise ConfigError(
        f"{what}: set a global qconfig, e.g. qconfig_dict={{'': get_default_qat_qconfig()}}, "
        f"or run the op on the CPU with hybrid_dict={{'module_name': [...]}}"
    )


def _check_int16(qconfig: QConfig, node: fx.Node, march) -> QConfig:
    """A march without int16 (bernoulli2) refuses a qconfig asking for it, naming the node and the march."""
    if march is not None and "qint16" in (qconfig.dtype, qconfig.weight_dtype) and not op_table(march).has_int16:
        raise ConfigError(
            f"node '{node.name}': its qconfig asks for qint16, but march {to_march(march).value!r} has no int16 "
            f"(int8 only); use an int8 qconfig here, or compile for a march with int16 (bayes)")
    return qconfig


def _march_default(qconfig: QConfig, node: fx.Node, module, resolver, march) -> QConfig:
    """The march's default output type of the node's op (``OpTable.default_dtypes``: data, with the
    reason) where the node's qconfig is the global int8 one; a per-module qconfig keeps its own."""
    if march is None or qconfig.dtype != "qint8" or qconfig.activation is None:
        return qconfig
    default = op_table(march).default_dtype(node.meta.get(META_OP))
    if default is None or default.dtype == qconfig.dtype or not resolver.is_global(scope(node), module):
        return qconfig
    retyped = with_activation_dtype(qconfig, default.dtype)
    if retyped is None:  # the user's own activation factory: theirs to type
        return qconfig
    node.meta[META_DTYPE_REASON] = f"{default.dtype}: {to_march(march).value} default for {node.meta.get(META_OP)} " \
                                   f"({default.reason})"
    return retyped


def _boundary_qconfig(resolver, src: fx.Node, observer: fx.Node, modules: dict) -> Optional[QConfig]:
    """The qconfig quantizing a CPU value for the BPU: the producer's; for a producer kept float by a
    module-level qconfig None (torch.ao's "not quantized"), the first BPU consumer's."""
    qc = resolver.for_scope(scope(src))
    if qc is not None and qc.activation is not None:
        return qc
    for user in observer.users:
        if placement(user) == BPU:
            module = modules.get(user.target) if user.op == "call_module" else None
            user_qc = resolver.for_scope(scope(user), module)
            if user_qc is not None and user_qc.activation is not None:
                return user_qc
    return qc


def _previous_output_observers(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Output-observer nodes of an earlier run, by the node they observe (reused, keeping names)."""
    return {n.args[0]: n for n in gm.graph.nodes if n.meta.get(META_STUB) == OUTPUT_OBSERVER}


def _drop_output_observer(gm: fx.GraphModule, obs: fx.Node) -> None:
    obs.replace_all_uses_with(obs.args[0])
    gm.graph.erase_node(obs)
    if hasattr(gm, obs.target):
        delattr(gm, obs.target)


def _add_output_observer(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> fx.Node:
    name = free_name(gm, f"{node.name}_{ACTIVATION_POST_PROCESS}")
    gm.add_submodule(name, module)
    users = list(node.users)
    with gm.graph.inserting_after(node):
        obs = gm.graph.create_node("call_module", name, (node,), {}, name=name)
    for user in users:
        user.replace_input_with(node, obs)
    obs.meta.update({
        META_SCOPE: scope(node)[:1] + (ScopeEntry(name, type(module)),),
        META_TENSOR: node.meta.get(META_TENSOR),
        META_OP: "quant",
        META_STUB: OUTPUT_OBSERVER,
    })
    if META_PARTITION in node.meta:
        obs.meta[META_PARTITION] = node.meta[META_PARTITION]
    set_placement(obs, BPU, f"quantizes the output of BPU op '{node.name}'")
    return obs


def insert_observers(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    resolver = ctx.options.qconfig_resolver
    previous = _previous_output_observers(gm)
    modules = dict(gm.named_modules())
    constants: dict[fx.Node, fx.Node] = {}  # get_attr / previous quantizer node -> its quantizer (this run)
    for node in list(gm.graph.nodes):
        if not node.op.startswith("call_"):
            continue
        if node.meta.get(META_STUB) == OUTPUT_OBSERVER:
            continue
        module = modules.get(node.target) if node.op == "call_module" else None
        if node.meta.get(META_STUB) == ACTIVATION_POST_PROCESS:
            src = node.args[0]
            if _is_bool(src):  # masked_softmax's mask: its 0/1 codes, exact (no observer, no qconfig)
                set_module(gm, node.target, bool_quantizer())
                continue
            qc = _check_int16(_require(_boundary_qconfig(resolver, src, node, modules), src, boundary=True), src,
                              ctx.march)
            set_module(gm, node.target, qc.activation())
            continue
        if placement(node) != BPU or node.meta.get(META_STUB):
            continue
        op = node.meta.get(META_OP)
        if op == "dequant" and module is not None and type(module) is not DeQuantStub:
            set_module(gm, node.target, DeQuantStub())  # ours returns float32 at the BPU exit
        if op in SCALE_PRESERVING_OPS:
            continue
        qc = _check_int16(_march_default(_require(resolver.for_scope(scope(node), module), node), node, module,
                                         resolver, ctx.march), node, ctx.march)
        if module is not None and type(module) in DTYPE_FOLLOWING:
            module = follow_input_dtype(module)
            set_module(gm, node.target, module)
        if op == "prelu" and node.target is F.prelu:
            node.target = qat.prelu
        if op in CONSTANT_OPERAND_OPS:
            _quantize_constants(gm, node, qc, constants, node.args)
        elif isinstance(module, FusedModule) and module.with_add and len(node.args) > 1:
            _quantize_constants(gm, node, qc, constants, node.args[1:2])  # conv + constant, fused
        elif op == "masked_softmax" and len(node.args) > 1:
            _quantize_bool_constant(gm, node, node.args[1], constants)
        elif op == "cat" and node.args and isinstance(node.args[0], (list, tuple)):
            _quantize_constants(gm, node, qc, constants, node.args[0])
        if op == "quant":
            stub = module if type(module) is QuantStub else QuantStub()
            stub.activation_post_process = qc.activation()
            set_module(gm, node.target, stub)
        elif module is not None and has_weight_layer(module):
            wfq = qc.weight() if qc.weight is not None else None
            if wfq is not None and op == "conv_transpose2d":
                wfq.ch_axis = 1  # weight layout (in, out/groups, kh, kw)
            if qc.out_high_precision:
                _check_high_precision_layer(node, module)
            apq = None if qc.out_high_precision else qc.activation()
            set_module(gm, node.target, observe_layer(module, wfq, apq))
        elif not qc.out_high_precision:
            if node in previous:
                set_module(gm, previous.pop(node).target, qc.activation())
            else:
                _add_output_observer(gm, node, qc.activation())
    for obs in previous.values():  # observers a new qconfig no longer asks for
        _drop_output_observer(gm, obs)
    if ctx.options.optimize_graph:
        _share_cat_quantizers(gm)
    _link_input_quantizers(gm)
    gm.recompile()
    return PassResult(gm, True)


def _quantize_constants(gm: fx.GraphModule, node: fx.Node, qc: QConfig, done: dict[fx.Node, fx.Node],
                        operands) -> None:
    """Put a constant quantizer between each constant tensor among ``operands`` of ``node`` and ``node``.

    One quantizer per constant (shared by its BPU users); a quantizer placed by an earlier run
    gets the new qconfig's module under its name (calibration -> QAT keeps the path)."""
    for arg in list(operands):
        if not isinstance(arg, fx.Node):
            continue
        if arg.meta.get(META_STUB) == CONSTANT_QUANT:
            if arg not in done:
                set_module(gm, arg.target, qat.constant_quantizer(qc.kind, qc.weight_dtype))
                done[arg] = arg
            continue
        if arg.op != "get_attr":
            continue
        if arg not in done:
            done[arg] = _add_constant_quantizer(gm, arg, qc)
        node.replace_input_with(arg, done[arg])


def _add_constant_quantizer(gm: fx.GraphModule, const: fx.Node, qc: QConfig) -> fx.Node:
    module = qat.constant_quantizer(qc.kind, qc.weight_dtype)
    name = free_name(gm, f"{const.name}_{CONSTANT_FAKE_QUANT}")
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(const):
        q = gm.graph.create_node("call_module", name, (const,), {}, name=name)
    q.meta.update({
        META_SCOPE: scope(const)[:1] + (ScopeEntry(name, type(module)),),
        META_TENSOR: const.meta.get(META_TENSOR),
        META_OP: "quant",
        META_STUB: CONSTANT_QUANT,
    })
    set_placement(q, BPU, f"quantizes the constant '{const.name}' (per tensor, like a weight) for the BPU")
    return q


# --- bool values entering the BPU (masked_softmax's mask)


def _is_bool(node) -> bool:
    info = node.meta.get(META_TENSOR) if isinstance(node, fx.Node) else None
    return getattr(info, "dtype", None) == "bool"


def bool_quantizer() -> nn.Module:
    """The quantizer of a bool tensor entering the BPU: int8 at scale 1.0, frozen (no observer), so the
    codes are exactly 0 / 1 (``fixed_point.quantize`` casts the bool to float first)."""
    return FakeQuantize(MinMaxObserver(dtype="qint8")).set_qparams(1.0)


def _quantize_bool_constant(gm: fx.GraphModule, node: fx.Node, mask, done: dict) -> None:
    """A constant bool mask (a buffer, e.g. a causal mask) read by ``node``: a constant-quantizer node
    holding :func:`bool_quantizer` (convert then makes it a constant BPU value of 0/1 codes)."""
    if not (isinstance(mask, fx.Node) and mask.op == "get_attr" and _is_bool(mask)):
        if isinstance(mask, fx.Node) and mask.meta.get(META_STUB) == CONSTANT_QUANT:
            set_module(gm, mask.target, bool_quantizer())  # a second run keeps the node, renews the module
        return
    if mask not in done:
        name = free_name(gm, f"{mask.name}_{CONSTANT_FAKE_QUANT}")
        module = bool_quantizer()
        gm.add_submodule(name, module)
        with gm.graph.inserting_after(mask):
            q = gm.graph.create_node("call_module", name, (mask,), {}, name=name)
        q.meta.update({META_SCOPE: scope(mask)[:1] + (ScopeEntry(name, type(module)),),
                       META_TENSOR: mask.meta.get(META_TENSOR), META_OP: "quant", META_STUB: CONSTANT_QUANT})
        set_placement(q, BPU, f"quantizes the constant mask '{mask.name}' as 0/1 codes for the BPU")
        done[mask] = q
    node.replace_input_with(mask, done[mask])


def _check_high_precision_layer(node: fx.Node, module: nn.Module) -> None:
    """A high-precision output is the layer's int32 accumulator: nothing can follow it inside the
    layer, and no BPU op can read it (they take int8/int16): it must leave the BPU."""
    after = [p for p in getattr(module, "fused_from", ()) if p in ("add", "relu", "relu6")]
    if after:
        names = node.meta.get(META_FUSED_FROM) or ()
        raise ConfigError(
            f"node '{node.name}': a high-precision (int32) output qconfig on a layer fused with "
            f"{' and '.join(after)} ({' + '.join(names) or '+'.join(module.fused_from)}): the int32 result is "
            f"the accumulator before the {'/'.join(after)}, so the layer cannot emit it. Give the "
            f"high-precision qconfig to a layer whose output is not added to or activated (typically the "
            f"model's last conv / linear), or use the default qconfig here.")
    bpu_users = [u.name for u in node.users if placement(u) == BPU and u.meta.get(META_OP) != "dequant"]
    if bpu_users:
        raise ConfigError(
            f"node '{node.name}': a high-precision (int32) output qconfig, but its output feeds BPU op(s) "
            f"{', '.join(bpu_users)}, which take int8/int16 inputs. Give the high-precision qconfig only to a "
            f"layer whose output leaves the BPU (a model output, or an op on CPU), or use the default "
            f"qconfig here.")


def _quantizer_of(gm: fx.GraphModule, node: fx.Node):
    """(owner, attribute) holding the quantizer that gives ``node`` its output grid, or None."""
    while node.meta.get(META_OP) in SCALE_PRESERVING_OPS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    if node.meta.get(META_STUB) in (OUTPUT_OBSERVER, ACTIVATION_POST_PROCESS, CONSTANT_QUANT):
        parent, _, name = node.target.rpartition(".")
        return (gm.get_submodule(parent) if parent else gm), name
    if getattr(module, "activation_post_process", None) is not None:
        return module, "activation_post_process"
    return None


def _link_input_quantizers(gm: fx.GraphModule) -> None:
    """Give each BPU weight layer (and BatchNorm2d) the quantizer of its input: its bias is
    quantized at s_in * s_w."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or placement(node) != BPU or not node.args:
            continue
        module = gm.get_submodule(node.target)
        if not needs_input_quantizer(module) or not isinstance(node.args[0], fx.Node):
            continue
        holder = _quantizer_of(gm, node.args[0])
        set_input_quantizer(module, getattr(holder[0], holder[1]) if holder is not None else None)


def _share_cat_quantizers(gm: fx.GraphModule) -> None:
    """optimize_graph: the inputs and the output of every BPU cat use one quantizer (one scale)."""
    for node in gm.graph.nodes:
        if node.meta.get(META_OP) != "cat" or placement(node) != BPU:
            continue
        out = next((u for u in node.users if u.meta.get(META_STUB) == OUTPUT_OBSERVER), None)
        if out is None:
            continue
        shared = gm.get_submodule(out.target)
        tensors = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else []
        for src in tensors:
            if isinstance(src, fx.Node) and placement(src) == BPU:
                holder = _quantizer_of(gm, src)
                if holder is not None:
                    setattr(holder[0], holder[1], shared)


def verify_observed(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        if placement(node) != BPU and node.op == "call_module" and not node.meta.get(META_STUB):
            module = gm.get_submodule(node.target)
            if getattr(module, "activation_post_process", None) is not None and node.meta.get(META_OP) != "quant":
                raise PassError(f"CPU module {node.target} (node {node.name}) carries a quantizer")


def _unobserved(gm: fx.GraphModule) -> Optional[str]:
    """The first BPU entry (a QuantStub, a boundary observer of insert_stubs) without a qconfig's quantizer."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and placement(node) == BPU and node.meta.get(META_OP) == "quant":
            module = gm.get_submodule(node.target)
            if not isinstance(module, FakeQuantizeBase) \
                    and not isinstance(getattr(module, "activation_post_process", None), FakeQuantizeBase):
                return f"BPU input {node.name} has no quantizer"
    return None


INSERT_OBSERVERS = Pass("insert_observers", insert_observers, verify_observed, requires=(PLACEMENT,))
# a quantizer from the node's qconfig on every value entering the BPU (and on the BPU ops' outputs)
OBSERVERS = Fact("observers", INSERT_OBSERVERS, _unobserved)
