"""Compile a ``convert_pt2e`` Q/DQ graph with its own scales.

``convert_pt2e`` leaves a float ATen graph in which each quantized tensor is written
``dequantize_per_tensor(quantize_per_tensor(x, s, 0, qmin, qmax, int8))`` and each weight is an int8
constant read through ``dequantize_per_channel``. qcompiler imports it in three steps:

1. :func:`strip_qdq` checks every Q/DQ against the BPU contract (symmetric, zero point 0, the full
   int8/int16 range; per-channel int8 weights) and removes it: activations pass through, each
   conv2d / linear becomes a call of an ``nn.Conv2d`` / ``nn.Linear`` at its module path with the
   dequantized weight (so placement and the weight quantizers see modules, as after capture of the
   user's model). It records the scale of each quantized tensor and weight.
2. The float graph goes through qcompiler's own prepare (capture by torch.export, placement,
   fusion, observers), and one run on the example inputs.
3. Each quantizer of the prepared model takes the scale of the PT2E tensor it sees: the tensor
   with the same values on the example inputs (the float graph computes exactly what the Q/DQ
   graph's float part computes). Then the normal convert and lowering run, so the BPU programs
   and CPU islands are those of ``qcompiler.compile`` on the same scales.

A quantizer whose tensor has no Q/DQ in the PT2E graph, or whose values match tensors of two
different scales, is a ConfigError naming it; the fix is to quantize with
``qcompiler.pt2e.BPUQuantizer``, which annotates where qcompiler quantizes.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError
from qcompiler.quantization.fake_quantize import FakeQuantizeBase
from qcompiler.quantization.fixed_point import qrange
from qcompiler.quantization.observer import ObserverBase

_NAMESPACES = ("quantized_decomposed", "torchao")
_DTYPES = {torch.int8: "qint8", torch.int16: "qint16"}
_FIX = "quantize with qcompiler.pt2e.BPUQuantizer(march), which annotates symmetric int8/int16 with zero point 0"
_ATEN = torch.ops.aten


def _qd(name: str):
    """``torch.ops.quantized_decomposed.<name>.default`` (registered by torch / torchao), or None."""
    try:
        return getattr(getattr(torch.ops.quantized_decomposed, name), "default")
    except (AttributeError, RuntimeError):
        return None


def _namespace(node: fx.Node) -> Optional[str]:
    target = node.target
    return getattr(target, "namespace", None) if isinstance(target, torch._ops.OpOverload) else None


def is_qdq_graph(model: Any) -> bool:
    """Is ``model`` a GraphModule holding PT2E quantize/dequantize calls (a ``convert_pt2e`` result)?"""
    return isinstance(model, fx.GraphModule) and any(
        n.op == "call_function" and _namespace(n) in _NAMESPACES for n in model.graph.nodes)


class ImportedScaleObserver(ObserverBase):
    """An observer whose scale was decided elsewhere (a PT2E Q/DQ): it records nothing and reports it."""

    def __init__(self, scale: torch.Tensor, dtype: str, ch_axis: int = -1) -> None:
        super().__init__(dtype, ch_axis)
        self.register_buffer("scale", scale.detach().to(torch.float32).reshape(-1).clone())

    @property
    def has_observed(self) -> bool:
        return True

    def _observe(self, x: torch.Tensor) -> None:
        pass

    def calculate_amax(self) -> torch.Tensor:
        return self.scale * qrange(self.dtype)[1]

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale.clone(), torch.zeros(self.scale.shape, dtype=torch.int64)


def _attr(gm: fx.GraphModule, node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return node
    if node.op != "get_attr":
        raise ConfigError(f"PT2E graph: node '{node.name}' is not a constant; the Q/DQ import reads weights and "
                          f"scales from get_attr nodes (run convert_pt2e with fold_quantize=True, the default)")
    obj = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def _check_activation(node: fx.Node, scale: Any, zero_point: Any, qmin: int, qmax: int, dtype: Any) -> str:
    """The contract's dtype name of an activation Q/DQ, or a ConfigError naming the node and the fix."""
    if dtype not in _DTYPES:
        raise ConfigError(f"PT2E node '{node.name}': activations quantized to {dtype} (zero point {zero_point}); "
                          f"the BPU takes symmetric int8/int16 with zero point 0; {_FIX}")
    if int(zero_point) != 0:
        raise ConfigError(f"PT2E node '{node.name}': zero point {int(zero_point)} (asymmetric); the BPU takes "
                          f"zero point 0 only; {_FIX}")
    want = qrange(_DTYPES[dtype])
    if (int(qmin), int(qmax)) != want:
        raise ConfigError(f"PT2E node '{node.name}': range [{qmin}, {qmax}]; BPU {_DTYPES[dtype]} activations use "
                          f"[{want[0]}, {want[1]}]; {_FIX}")
    if not isinstance(scale, (float, int)):
        raise ConfigError(f"PT2E node '{node.name}': its scale is a tensor computed at run time (dynamic "
                          f"quantization); the BPU needs static scales; {_FIX}")
    return _DTYPES[dtype]


class StrippedGraph:
    """:func:`strip_qdq`'s result: the float GraphModule and the scales recorded from the Q/DQ."""

    def __init__(self, gm: fx.GraphModule, activations: list, weights: list) -> None:
        self.gm = gm
        self.activations = activations  # [(node name in gm, scale, dtype)]
        self.weights = weights  # [(float weight, per-channel scale, ch_axis)]


def strip_qdq(model: fx.GraphModule) -> StrippedGraph:
    """A float copy of a ``convert_pt2e`` graph, and its scales (see the module docstring)."""
    with warnings.catch_warnings():
        # torch 2.13's own TreeSpec (the graph's input/output spec) warns about LeafSpec while it is copied;
        # nothing of ours uses LeafSpec
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        gm = copy.deepcopy(model)  # the user's graph is never modified
    _plain_codegen(gm)
    graph = gm.graph
    q_t, dq_t = _qd("quantize_per_tensor"), _qd("dequantize_per_tensor")
    dq_c = _qd("dequantize_per_channel")
    activations, weights, float_weights = [], [], {}
    for node in list(graph.nodes):
        if node.op != "call_function" or _namespace(node) not in _NAMESPACES:
            continue
        if node.target is q_t:
            x, scale, zp, qmin, qmax, dtype = node.args[:6]
            name = _check_activation(node, scale, zp, qmin, qmax, dtype)
            for user in list(node.users):
                if user.target is not dq_t or tuple(user.args[1:6]) != tuple(node.args[1:6]):
                    raise ConfigError(f"PT2E node '{user.name}' reads quantize '{node.name}' but is not its matching "
                                      f"dequantize_per_tensor; the import takes Q/DQ pairs; {_FIX}")
                user.replace_all_uses_with(x)
                graph.erase_node(user)
            graph.erase_node(node)
            activations.append((x, float(scale), name))
        elif node.target is dq_t:
            continue  # a dequantize of a quantize: erased with it above
        elif node.target is dq_c:
            w, scale, zp, axis, qmin, qmax, dtype = node.args[:7]
            qw, s, z = _attr(gm, w), _attr(gm, scale), _attr(gm, zp)
            if dtype != torch.int8 or bool((torch.as_tensor(z) != 0).any()) or int(qmin) < -128 or int(qmax) > 127:
                raise ConfigError(f"PT2E node '{node.name}': weights {dtype} with zero points {z.tolist()[:4]}...; the "
                                  f"BPU takes int8 symmetric per-channel weights (zero point 0); {_FIX}")
            shape = [1] * qw.dim()
            shape[int(axis)] = -1
            value = qw.to(torch.float32) * s.to(torch.float32).reshape(shape)
            float_weights[node] = value
            weights.append((value, s.to(torch.float32), int(axis)))
        else:
            raise ConfigError(f"PT2E node '{node.name}' ({node.target}): the import takes quantize_per_tensor / "
                              f"dequantize_per_tensor pairs and dequantize_per_channel weights only; {_FIX}")
    for node, value in float_weights.items():
        holder = f"qc_pt2e_weight_{len(list(gm.named_buffers()))}"
        gm.register_buffer(holder, value)
        with graph.inserting_before(node):
            node.replace_all_uses_with(graph.get_attr(holder))
        graph.erase_node(node)
    renamed = _as_modules(gm)
    activations = [(renamed.get(x, x).name, scale, name) for x, scale, name in activations]
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return StrippedGraph(gm, activations, weights)


def _plain_codegen(gm: fx.GraphModule) -> None:
    """Positional tensors in, one tensor out: drop the export's pytree codegen (its TreeSpec is what torch
    warns about on every copy); the forward computes the same, called the same way."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.out_spec is None or not info.out_spec.is_leaf():
        return
    if info.in_spec is None or info.in_spec.num_children != 2:
        return
    args_spec, kwargs_spec = _children(info.in_spec)
    if kwargs_spec.num_children or any(not c.is_leaf() for c in _children(args_spec)):
        return
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = output.args[0]
    gm.graph.set_codegen(fx.graph.CodeGen())
    output.args = (leaves[0] if isinstance(leaves, (list, tuple)) else leaves,)
    for attr in ("_in_spec", "_out_spec"):  # the specs the pytree forward checked its call against
        gm.__dict__.pop(attr, None)
    gm.recompile()


def _children(spec) -> list:
    """A TreeSpec's child specs (``children()`` on torch >= 2.13, ``children_specs`` before)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _module_path(node: fx.Node, taken: set) -> str:
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    base = stack[-1][0] if stack and stack[-1][0] else node.name
    path, i = base, 1
    while path in taken:
        path, i = f"{base}_{i}", i + 1
    taken.add(path)
    return path


def compile_ready(model: Any, mode: str, weight_rounding: bool, int16_budget: Optional[float],
                  custom: Optional[dict] = None) -> Optional[tuple[StrippedGraph, dict]]:
    """For ``qcompiler.compile``: the stripped graph of a ``convert_pt2e`` result and the
    ``prepare_custom_config_dict`` to prepare it with (capture by torch.export), else None."""
    if not is_qdq_graph(model):
        return None
    if mode != "ptq" or weight_rounding or int16_budget is not None:
        raise ConfigError("compile: a convert_pt2e graph brings its own scales; compile it with mode='ptq' and "
                          "without weight_rounding / int16_budget (choose int16 in BPUQuantizer's config)")
    custom = dict(custom or {})
    if custom.get("capture", "export") != "export":
        raise ConfigError(f"compile: a convert_pt2e graph is ATen ops, captured with torch.export; "
                          f"prepare_custom_config_dict['capture']={custom['capture']!r} cannot take it (leave it out)")
    custom["capture"] = "export"
    return strip_qdq(model), custom


def _as_modules(gm: fx.GraphModule) -> dict:
    """Each aten conv2d / linear on constant weights becomes a call of an nn module at its module path.

    Returns the replaced nodes: old -> the call_module node computing the same value."""
    taken: set = set()
    made: list = []
    replaced: dict = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (_ATEN.conv2d.default, _ATEN.linear.default):
            continue
        args = list(node.args)
        if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in args[1:3] if a is not None) \
                or any(isinstance(a, fx.Node) for a in args[3:]):
            continue
        weight = _attr(gm, args[1])
        bias = _attr(gm, args[2]) if len(args) > 2 and args[2] is not None else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != (2 if node.target is _ATEN.linear.default else 4):
            continue
        if node.target is _ATEN.linear.default:
            module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        else:
            stride, padding, dilation, groups = (args + [None, None, None, [1, 1], [0, 0], [1, 1], 1][len(args):])[3:7]
            if isinstance(padding, str):
                continue  # "same" / "valid": left functional (the CPU runs it)
            module = nn.Conv2d(weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]), stride=stride,
                               padding=padding, dilation=dilation, groups=groups, bias=bias is not None)
        module.weight = nn.Parameter(weight.detach().clone())
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone())
        temp = f"qc_pt2e_module_{len(made)}"
        gm.add_submodule(temp, module)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(temp, (args[0],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        made.append((call, _module_path(node, taken), module))
        replaced[node] = call
    gm.graph.eliminate_dead_code()  # the get_attrs of the old weights, then the modules holding them
    gm.delete_all_unused_submodules()
    for call, path, module in made:  # at the user's module path where nothing else lives there any more
        if _free(gm, path):
            gm.add_submodule(path, module)
            gm.delete_submodule(call.target)
            call.target = path
    return {old: call for old, call in replaced.items()}


def _free(gm: fx.GraphModule, path: str) -> bool:
    obj = gm
    for part in path.split("."):
        if not hasattr(obj, part):
            return True
        obj = getattr(obj, part)
        if not isinstance(obj, nn.Module) or (type(obj) is not nn.Module and part == path.split(".")[-1]):
            return False
    return type(obj) is nn.Module and not list(obj.children()) and not list(obj.parameters()) \
        and not list(obj.buffers())


def _quantizers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The prepared model's quantizers: fake quants, and observers not inside one."""
    found, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantizeBase):
            found.append((name, module))
            inside.add(id(module.activation_post_process))
        elif isinstance(module, ObserverBase) and id(module) not in inside:
            found.append((name, module))
    return found


def _seen(model: nn.Module, quantizers: list, inputs: tuple) -> dict:
    """What each quantizer sees on ``inputs``: its name -> the tensor."""
    seen: dict = {}
    hooks = [m.register_forward_pre_hook(lambda _m, args, _n=name: seen.setdefault(_n, args[0].detach().clone()))
             for name, m in quantizers]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _values(stripped: StrippedGraph, inputs: tuple) -> list:
    """``[(value, scale, dtype)]`` of each PT2E-quantized activation on ``inputs``."""
    wanted = {name for name, _, _ in stripped.activations}
    env: dict = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name in wanted:
                env[n.name] = out.detach().clone()
            return out

    with torch.no_grad():
        _Recorder(stripped.gm).run(*inputs)
    return [(env[name], scale, dtype) for name, scale, dtype in stripped.activations if name in env]


def _match(name: str, seen: torch.Tensor, candidates: Iterable, what: str) -> tuple:
    hits = {}
    for value, scale, extra in candidates:
        if value.shape == seen.shape and value.dtype == seen.dtype and torch.equal(value, seen):
            key = tuple(torch.as_tensor(scale).reshape(-1).tolist())
            hits[key] = (scale, extra)
    if not hits:
        raise ConfigError(f"quantizer '{name}': the PT2E graph has no Q/DQ on the {what} it quantizes, so there is no "
                          f"scale to import for it; {_FIX}")
    if len(hits) > 1:
        raise ConfigError(f"quantizer '{name}': its {what} matches PT2E tensors of {len(hits)} different scales on the "
                          f"example inputs; give example inputs that tell them apart (random data, not zeros)")
    return next(iter(hits.values()))


def import_scales(prepared: nn.Module, stripped: StrippedGraph, inputs: tuple) -> int:
    """Give each quantizer of ``prepared`` (prepared from ``stripped.gm``) its PT2E scale; returns how many."""
    quantizers = _quantizers(prepared)
    seen = _seen(prepared, quantizers, inputs)
    activations = _values(stripped, inputs)
    weights = [(w, s, axis) for w, s, axis in stripped.weights]
    done = 0
    for name, q in quantizers:
        if name not in seen:
            continue  # not on the path the example inputs take (nothing quantized there)
        is_weight = isinstance(q, FakeQuantizeBase) and q.ch_axis >= 0
        if is_weight:
            scale, axis = _match(name, seen[name], weights, "weight")
            observer = ImportedScaleObserver(torch.as_tensor(scale), q.dtype, q.ch_axis)
        else:
            scale, dtype = _match(name, seen[name], activations, "tensor")
            observer = ImportedScaleObserver(torch.tensor([scale]), dtype)
        observer.qc_name = q.qc_name
        if isinstance(q, FakeQuantizeBase):
            q.activation_post_process = observer
        else:
            _replace(prepared, name, observer)
        done += 1
    return done


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)
