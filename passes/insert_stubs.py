"""Insert the stubs at every BPU/CPU boundary, as the hybrid (BPU + CPU) flow does.

* On each BPU -> CPU edge: a ``DeQuantStub`` module ``<cpu_node>_input_dequant``
  called just before the CPU node (one call per BPU producer, nodes
  ``<cpu_node>_input_dequant_<k>``). BPU values that reach the model output
  are dequantized the same way by ``output_input_dequant``.
* After a float source feeding BPU nodes (a CPU node, a graph input not
  behind a QuantStub, or a DeQuantStub whose value a BPU op reads): an
  activation observer ``<node>_activation_post_process``;
  only the BPU-bound users are rewired to it. A CPU identity/dropout whose
  users are all BPU-bound is looked through: it is rewired too and then
  follows the observer onto the BPU side.

The observer class comes from ``ctx.options.activation_observer`` (a
zero-argument factory); by default a ``MinMaxObserver``.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError, PassError
from qcompiler.ir.meta import (
    BPU,
    CPU,
    META_OP,
    META_SCOPE,
    META_STUB,
    META_TENSOR,
    ScopeEntry,
    carries_tensor,
    placement,
    set_placement,
)
from qcompiler.ir.modules import free_name
from qcompiler.ir.ops import PASSTHROUGH_OPS
from qcompiler.passes.base import CompileContext, Pass, PassResult
from qcompiler.passes.place import PLACEMENT
from qcompiler.passes.shape_prop import TENSOR_META
from qcompiler.quantization.stubs import DeQuantStub

INPUT_DEQUANT = "input_dequant"
ACTIVATION_POST_PROCESS = "activation_post_process"


def _is_float_source(node: fx.Node) -> bool:
    """A value that is float where BPU ops read it: a graph input, a CPU value, a dequantized BPU value.

    A BPU op that reads a DeQuantStub (e.g. a layer after a ``QuantWrapper``) gets a quantizer like
    any float source; convert then reads the DeQuantStub's input and requantizes (or drops both
    when the scales agree), so no float value is computed inside a BPU partition (but after a
    high-precision int32 output, which has no grid to requantize from)."""
    if node.op == "placeholder":
        return True
    return node.op != "get_attr" and (placement(node) == CPU or node.meta.get(META_OP) == "dequant")


def _bpu_bound(user: fx.Node) -> bool:
    """True if a float value flowing into ``user`` ends up only on the BPU."""
    if placement(user) == BPU:
        # a QuantStub quantizes by itself; a DeQuantStub after a DeQuantStub passes a float on
        return user.meta.get(META_OP) not in ("quant", "dequant")
    if placement(user) == CPU and user.meta.get(META_OP) in PASSTHROUGH_OPS and user.users:
        return all(_bpu_bound(u) for u in user.users)
    return False


def _root_scope(gm: fx.GraphModule, name: str, module: nn.Module) -> tuple[ScopeEntry, ...]:
    """Scope of an inserted stub: the model's root (as the tracer recorded it), then the stub."""
    first = next(iter(gm.graph.nodes), None)
    root = first.meta[META_SCOPE][0] if first is not None and first.meta.get(META_SCOPE) else ScopeEntry("", type(gm))
    return (root, ScopeEntry(name, type(module)))


def _insert_dequants(gm: fx.GraphModule) -> bool:
    changed = False
    for consumer in list(gm.graph.nodes):
        if consumer.op == "output":
            sinks = consumer.all_input_nodes
            prefix = "output"
        elif placement(consumer) == CPU and consumer.op != "get_attr":
            sinks = consumer.all_input_nodes
            prefix = consumer.name
        else:
            continue
        producers = [p for p in sinks if placement(p) == BPU and carries_tensor(p) and p.meta.get(META_OP) != "dequant"]
        if not producers:
            continue
        module = DeQuantStub()
        mod_name = free_name(gm, f"{prefix}_{INPUT_DEQUANT}")
        gm.add_submodule(mod_name, module)
        replaced = {}
        for k, producer in enumerate(producers):
            with gm.graph.inserting_before(consumer):
                dq = gm.graph.create_node("call_module", mod_name, (producer,), {}, name=f"{mod_name}_{k}")
            dq.meta.update({
                META_SCOPE: _root_scope(gm, mod_name, module),
                META_TENSOR: producer.meta.get(META_TENSOR),
                META_OP: "dequant",
                META_STUB: INPUT_DEQUANT,
            })
            set_placement(dq, BPU, f"dequantizes BPU output '{producer.name}' for CPU op '{consumer.name}'"
                          if consumer.op != "output" else f"dequantizes BPU output '{producer.name}' for the model output")
            replaced[producer] = dq
        _replace_inputs(consumer, replaced)
        changed = True
    return changed


def _replace_inputs(node: fx.Node, replaced: dict[fx.Node, fx.Node]) -> None:
    """``node.replace_input_with(old, new)`` for every pair of ``replaced`` in one rewrite of its
    arguments: one call per pair scans all arguments each time, quadratic for an output node
    with thousands of values."""
    node.args = fx.map_arg(node.args, lambda n: replaced.get(n, n))
    node.kwargs = fx.map_arg(node.kwargs, lambda n: replaced.get(n, n))


def _insert_observers(gm: fx.GraphModule, ctx: CompileContext) -> bool:
    factory = ctx.options.activation_observer
    changed = False
    for source in list(gm.graph.nodes):
        if not _is_float_source(source) or not carries_tensor(source):
            continue
        bound = [u for u in source.users if _bpu_bound(u)]
        if not bound:
            continue
        if source.op == "placeholder" and isinstance(source.meta.get(META_TENSOR), (list, tuple)):
            raise _structured_input(source, bound[0])
        module = factory()
        mod_name = free_name(gm, f"{source.name}_{ACTIVATION_POST_PROCESS}")
        gm.add_submodule(mod_name, module)
        # placeholders must stay first: an observer of an input goes after the last one
        anchor = _last_placeholder(gm) if source.op == "placeholder" else source
        with gm.graph.inserting_after(anchor):
            obs = gm.graph.create_node("call_module", mod_name, (source,), {}, name=mod_name)
        obs.meta.update({
            META_SCOPE: _root_scope(gm, mod_name, module),
            META_TENSOR: source.meta.get(META_TENSOR),
            META_OP: "quant",
            META_STUB: ACTIVATION_POST_PROCESS,
        })
        what = ("model input" if source.op == "placeholder" else "dequantized value"
                if source.meta.get(META_OP) == "dequant" and placement(source) == BPU else "float output of")
        set_placement(obs, BPU, f"quantizes {what} '{source.name}' for the BPU")
        for user in bound:
            user.replace_input_with(source, obs)
            _follow_onto_bpu(user, obs)
        changed = True
    return changed


def _structured_input(source: fx.Node, user: fx.Node) -> ConfigError:
    """A positional input that is a list / tuple of tensors feeding the BPU: its quantizer would take the whole
    structure. As keyword inputs each tensor is one graph input (qcompiler.ir.shape_prop.KeywordInputs)."""
    name = source.name
    return ConfigError(
        f"model input '{name}' is a list / tuple of tensors that feeds BPU op '{user.name}', and the BPU takes "
        f"tensors one by one: give the example inputs as a dict of keyword inputs, e.g. "
        f"qcompiler.compile(model, {{'{name}': [...]}}), which makes each tensor of '{name}' one input (the "
        f"compiled model still takes '{name}' as it is; a prepared model takes {name}_0, {name}_1, ...)")


def _last_placeholder(gm: fx.GraphModule) -> fx.Node:
    last = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            last = n
    return last


def _follow_onto_bpu(node: fx.Node, producer: fx.Node) -> None:
    """A looked-through CPU identity now sits after the observer: it follows it onto the BPU."""
    if placement(node) == CPU and node.meta.get(META_OP) in PASSTHROUGH_OPS:
        set_placement(node, BPU, f"follows its producer '{producer.name}'")
        for user in node.users:
            _follow_onto_bpu(user, node)


def insert_stubs(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    changed = _insert_dequants(gm)
    changed |= _insert_observers(gm, ctx)
    if changed:
        gm.recompile()
    return PassResult(gm, changed)


def verify_boundaries(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """No tensor edge may cross BPU -> CPU or float -> BPU without its stub."""
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            if not carries_tensor(src):
                continue
            if placement(src) == BPU and (placement(node) == CPU or node.op == "output"):
                if src.meta.get(META_OP) != "dequant":
                    raise PassError(f"insert_stubs: BPU->CPU edge {src.name}->{node.name} without DeQuantStub")
            if _is_float_source(src) and placement(node) == BPU:
                if node.meta.get(META_OP) not in ("quant", "dequant"):
                    raise PassError(f"insert_stubs: float->BPU edge {src.name}->{node.name} without observer")


INSERT_STUBS = Pass("insert_stubs", insert_stubs, verify_boundaries, requires=(TENSOR_META, PLACEMENT))
