"""Place every node on the BPU or the CPU, with the reason, from the march table and hybrid_dict.

Order of decisions for a call node:

1. ``hybrid_dict`` forces it to the CPU (the user's word wins over support), and so
   does a float region: a node on a path from a DeQuantStub to a QuantStub (the user
   said the values in between are float, as in eager-mode PyTorch quantization), and a
   module the tracer could not trace (``META_AUTO_LEAF``: its Python runs as a whole);
2. a node whose value holds no tensor (``x.dim()``, ``x.size()``, ``x.shape``, ``x.ndim``,
   ``x.numel()``: a host-side int) is on the CPU: the BPU computes tensors only;
3. stubs, identities and container ``getitem`` compute nothing:
   they follow their producer (a QuantStub or a follower of a graph input
   follows its consumers instead, decided in a backward sweep);
4. layout ops (reshape, permute, ...) follow a CPU producer; after a BPU
   producer the march table decides;
5. anything else is looked up in the march's op-support table, whose
   constraint predicates give the reason when an op does not fit.

Last, a connected BPU region that does no BPU work (no op of ``WORK_OPS``: no
multiply-accumulate, no pooling) and whose inputs and outputs are all CPU ops is moved to
the CPU: on the BPU it would only add a quantize and a dequantize (an r3d residual ``add``
between CPU conv3d / relu).  A region that reads a graph input or feeds the model output
directly, or holds a user's QuantStub / DeQuantStub (the user's word that it is quantized),
is kept.  ``hybrid_dict`` only ever forces nodes to the CPU, so no user setting asks for
the BPU that this rule overrides.

Placeholders and the output node are not placed: graph inputs and outputs are
float, like CPU values.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu import op_table
from qcompiler.backends.bpu.op_info import op_info
from qcompiler.backends.bpu.support import WORK_OPS
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
    carries_tensor,
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


_FLOAT_DTYPES = frozenset({"f32", "f64", "f16", "bf16"})


def _decide_compute(node: fx.Node, op: Optional[str], table, modules) -> tuple[str, str]:
    info = node.meta.get(META_TENSOR)
    if isinstance(info, TensorInfo) and info.dtype not in _FLOAT_DTYPES:
        # token ids, positions, masks: the BPU computes on quantized real values, not on integers
        return CPU, f"its output is an integer tensor ({info}): the BPU computes on quantized floats"
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


def _host_value(node: fx.Node) -> bool:
    """A call whose value holds no tensor but that reads one: a size read (``x.dim()``, ``x.shape``,
    ``x.size(1)``, ``x.numel()``) or a comparison of one, a host-side int the BPU never computes."""
    return (node.op != "get_attr" and not carries_tensor(node)
            and any(carries_tensor(i) for i in node.all_input_nodes))


def _spelled(node: fx.Node) -> str:
    """``x.dim()``, ``x.shape``, ``numel(x)``: how a host-side read is written, for its reason."""
    if node.op == "call_method":
        return f"{node.args[0]}.{node.target}()" if node.args else f".{node.target}()"
    if node.target is getattr and len(node.args) == 2:
        return f"{node.args[0]}.{node.args[1]}"
    return f"{getattr(node.target, '__name__', node.target)}({', '.join(map(str, node.args))})"


def _bpu_regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The connected components of BPU nodes (joined by edges between two BPU nodes), in graph order."""
    seen: set[fx.Node] = set()
    regions = []
    for start in gm.graph.nodes:
        if start in seen or placement(start) != BPU:
            continue
        seen.add(start)
        region, todo = [], [start]
        while todo:
            n = todo.pop()
            region.append(n)
            for m in (*n.all_input_nodes, *n.users):
                if m not in seen and placement(m) == BPU:
                    seen.add(m)
                    todo.append(m)
        regions.append(region)
    return regions


def idle_regions(gm: fx.GraphModule, ops: dict[fx.Node, Optional[str]]) -> list[tuple[list[fx.Node], str]]:
    """The BPU regions that do no BPU work between CPU ops, each with the reason it moves to the CPU.

    A region moves when no node of it is a ``WORK_OPS`` op (multiply-accumulate or pooling) or a
    user's stub, and every value it reads and every node reading it is a CPU op (not a graph input,
    not the model output)."""
    out = []
    for region in _bpu_regions(gm):
        members = set(region)
        if any(ops.get(n) in WORK_OPS or ops.get(n) in ("quant", "dequant") for n in region):
            continue
        reads = [p for n in region for p in n.all_input_nodes if p not in members]
        readers = [u for n in region for u in n.users if u not in members]
        if not reads or not readers or any(p.op == "placeholder" or placement(p) != CPU for p in reads) \
                or any(u.op == "output" or placement(u) != CPU for u in readers):
            continue
        names = ", ".join(n.name for n in region[:4]) + (", ..." if len(region) > 4 else "")
        out.append((region, f"on the CPU: its BPU region ({names}) does no multiply-accumulate or pooling and "
                            f"sits between CPU ops, so the BPU would only add a quantize and a dequantize"))
    return out


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
        elif _host_value(node):
            assign(node, CPU, f"{_spelled(node)} is a host-side value, not a tensor: on the CPU")
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

    for region, why in idle_regions(gm, ops):
        for node in region:
            assign(node, CPU, f"{node.meta[META_REASON]}, but {why}")
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
