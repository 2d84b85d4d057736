"""Place every node on the BPU or the CPU, with the reason, from the march table and hybrid_dict.

Order of decisions for a call node:

1. ``hybrid_dict`` forces it to the CPU (the user's word wins over support), and so
   does a float region: a node on a path from a DeQuantStub to a QuantStub (the user
   said the values in between are float, as in eager-mode PyTorch quantization), and a
   module the tracer could not trace (``META_AUTO_LEAF``: its Python runs as a whole);
2. stubs, identities, container ``getitem`` and size queries compute nothing:
   they follow their producer (a QuantStub or a follower of a graph input
   follows its consumers instead, decided in a backward sweep);
3. layout ops (reshape, permute, ...) follow a CPU producer; after a BPU
   producer the march table decides;
4. anything else is looked up in the march's op-support table, whose
   constraint predicates give the reason when an op does not fit.

Placeholders and the output node are not placed: graph inputs and outputs are
float, like CPU values.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu import op_table
from qcompiler.backends.bpu.op_info import op_info
from qcompiler.errors import PassError
from qcompiler.hybrid import HybridConfig
from qcompiler.ir.meta import (
    BPU,
    CPU,
    META_AUTO_LEAF,
    META_OP,
    META_PLACEMENT,
    META_REASON,
    META_REWRITE,
    META_TENSOR,
    PLACEMENTS,
    TensorInfo,
    placement,
    scope,
    set_placement,
)
from qcompiler.ir.ops import LAYOUT_OPS, META_OPS, PASSTHROUGH_OPS, is_clamp, node_op
from qcompiler.passes.base import CompileContext, Fact, Pass, PassResult
from qcompiler.passes.shape_prop import TENSOR_META


def _producer(node: fx.Node) -> Optional[fx.Node]:
    """The node whose value a follower passes on: its first node input."""
    inputs = node.all_input_nodes
    return inputs[0] if inputs else None


def _is_follower(node: fx.Node, op: Optional[str]) -> bool:
    if op in PASSTHROUGH_OPS or op in META_OPS or op == "dequant":
        return True
    if op == "getitem":
        src = _producer(node)
        # indexing a container (LSTM's (out, (h, c))) moves nothing; slicing a tensor is compute
        return src is not None and not isinstance(src.meta.get(META_TENSOR), TensorInfo)
    return False


_CLAMP_HINT = "; a clamp runs on the BPU only as a ReLU (bounds 0, none) or a ReLU6 (bounds 0, 6)"


def _decide_compute(node: fx.Node, op: Optional[str], table, modules) -> tuple[str, str]:
    if op is None:
        hint = _CLAMP_HINT if is_clamp(node, modules) else ""
        if node.op == "call_module":
            mod = modules[node.target]
            return CPU, f"module '{node.target}' ({type(mod).__name__}) has no BPU implementation{hint}"
        return CPU, f"{node.op} {getattr(node.target, '__name__', node.target)} has no BPU implementation{hint}"
    container = next((i for i in node.all_input_nodes if isinstance(i.meta.get(META_TENSOR), (tuple, list))), None)
    if container is not None:  # e.g. torch.cat(x.chunk(2)[::-1]): a BPU value is one tensor with one scale
        return CPU, (f"input '{container.name}' is a tuple of tensors, not one tensor (a BPU op takes "
                     f"tensors: index it element by element, e.g. torch.cat([b, a]))")
    ok, reason = table.check(op_info(node, op, modules))
    return (BPU if ok else CPU), reason


def _reached(order, neighbours, opens: str, stops: str, ops: dict) -> dict[fx.Node, fx.Node]:
    """node -> the ``opens`` stub it is reached from through ``neighbours`` (inputs, or users walking
    backwards), without passing a ``stops`` stub; ``order`` visits neighbours first."""
    found: dict[fx.Node, fx.Node] = {}
    for node in order:
        if ops.get(node) in (opens, stops):
            continue
        for other in neighbours(node):
            start = other if ops.get(other) == opens else found.get(other)
            if start is not None:
                found.setdefault(node, start)
                break
    return found


def _float_regions(gm: fx.GraphModule, ops: dict[fx.Node, Optional[str]]) -> dict[fx.Node, str]:
    """Nodes between a DeQuantStub and a QuantStub, each with its CPU reason.

    A node is in a float region when it is reached from a DeQuantStub without passing a QuantStub
    and reaches a QuantStub without passing a DeQuantStub. A DeQuantStub whose value reaches the
    model output (or nothing) without a QuantStub opens no region: ops after it are placed as
    usual, and a BPU op among them reads its value through a quantizer (``insert_stubs``).
    """
    opened = _reached(gm.graph.nodes, lambda n: n.all_input_nodes, "dequant", "quant", ops)
    closed = _reached(reversed(gm.graph.nodes), lambda n: n.users, "quant", "dequant", ops)
    return {n: (f"between DeQuantStub '{opened[n].name}' and QuantStub '{closed[n].name}': a float region, "
                f"on the CPU") for n in opened if n in closed and n.op != "placeholder"}


def place(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    table = op_table(ctx.march)
    hybrid: HybridConfig = ctx.hybrid_dict or HybridConfig()
    modules: dict[str, nn.Module] = dict(gm.named_modules())
    pending: list[fx.Node] = []
    changed = False

    def assign(n: fx.Node, where: str, reason: str) -> None:
        nonlocal changed
        if n.meta.get(META_REWRITE):
            reason = f"{reason} ({n.meta[META_REWRITE]})"
        changed |= n.meta.get(META_PLACEMENT) != where or n.meta.get(META_REASON) != reason
        set_placement(n, where, reason)

    resolver = ctx.options.qconfig_resolver  # prepare's: a module-level qconfig None keeps an op float
    ops = {n: node_op(n, modules) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    regions = _float_regions(gm, ops)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        op = ops[node]
        node.meta[META_OP] = op
        forced = None
        if node.op != "get_attr":
            forced = hybrid.match(node) or node.meta.get(META_AUTO_LEAF) or regions.get(node)
            if forced is None and resolver is not None and op not in ("quant", "dequant"):
                forced = resolver.float_reason(scope(node), modules.get(node.target) if node.op == "call_module"
                                               else None)
        if forced is not None:
            assign(node, CPU, forced)
        elif node.op == "get_attr" or op == "quant":
            pending.append(node)
        elif op in PASSTHROUGH_OPS and getattr(_producer(node), "op", None) == "get_attr":
            # a constant reaches the BPU only as an op's operand (a quantized constant), not passed on
            assign(node, CPU, f"{op} of the constant '{_producer(node).name}': a constant reaches the BPU "
                              f"only as an operand")
        elif _is_follower(node, op):
            src = _producer(node)
            where = placement(src) if src is not None else None
            if where is None:
                pending.append(node)
            elif op == "dequant":
                assign(node, where, "dequantizes the BPU output" if where == BPU else f"DeQuantStub after CPU op '{src.name}' is a no-op")
            else:
                assign(node, where, f"follows its producer '{src.name}'")
        elif op in LAYOUT_OPS and placement(_producer(node)) == CPU:
            assign(node, CPU, f"{op} follows its CPU producer '{_producer(node).name}'")
        else:
            assign(node, *_decide_compute(node, op, table, modules))

    # Backward sweep: constants, QuantStubs and followers of graph inputs take their users' side.
    for node in reversed(pending):
        users = [u for u in node.users if u.op != "output"]
        sides = {placement(u) for u in users}
        if node.meta[META_OP] == "quant":
            if BPU in sides:
                assign(node, BPU, "quantizes the input of the BPU")
            else:
                assign(node, CPU, "QuantStub before CPU ops only is a no-op")
        elif users and sides == {BPU}:
            assign(node, BPU, f"follows its consumer '{users[0].name}'")
        else:
            assign(node, CPU, f"follows its consumer '{users[0].name}'" if users else "feeds the model output")
    return PassResult(gm, changed)


def _unplaced(gm: fx.GraphModule) -> Optional[str]:
    node = next((n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and placement(n) not in PLACEMENTS),
                None)
    return None if node is None else f"node '{node.name}' has no placement"


def verify_placed(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """Every node is on the BPU or the CPU, with a reason (a PassError, not an assert: ``-O`` keeps it)."""
    why = _unplaced(gm)
    if why is not None:
        raise PassError(f"place: {why}")
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output") and not node.meta.get(META_REASON):
            raise PassError(f"place: node '{node.name}' is placed without a reason")


PLACE = Pass("place", place, verify_placed, requires=(TENSOR_META,))
# every node but the inputs and the output on the BPU or the CPU (META_PLACEMENT), with a reason
PLACEMENT = Fact("placement", PLACE, _unplaced)
