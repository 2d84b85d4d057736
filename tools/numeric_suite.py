"""Numeric suite: compare a float model with its quantized version, layer by layer.

The API follows the PyTorch Numeric Suite (``compare_weights``,
``compare_model_outputs``, ``compare_model_stub``, the loggers ...) on
qcompiler's own models.  The *float model* is the user's ``nn.Module``; the
*quantized model* is a prepared (calibration / QAT) ``GraphModule``, a
converted ``GraphModule`` (BPU values are :class:`QTensor`) or a
:class:`~qcompiler.compiled.CompiledModel` (its ``.converted`` graph is used
for all per-layer work, because the runtime's BPU programs have no layers to
hook; after :func:`prepare_model_outputs` / :func:`prepare_model_with_stubs`
run ``cm.converted(...)``, not ``cm(...)``).

Matching rule (which float value corresponds to which quantized layer)
-----------------------------------------------------------------------
Only ``call_module`` nodes of the quantized graph are layers (a plain
``nn.Module`` quantized model: its leaf modules).  For a node named ``N``
calling the module at path ``T``:

* the layer's **name** (the key of every result dict) is ``T`` when the float
  model has a module at path ``T`` and ``N`` is ``T`` with dots replaced by
  underscores (the node is the first call of that module); otherwise it is
  ``N`` (converted functional ops become root modules such as ``maxpool_q1``
  for node ``maxpool``; a second call of a module is node ``identity_1``);
* its **float counterpart** is found from the node name: ``N`` (or, for a
  fused node, the last op of ``node.meta[META_FUSED_FROM]``, e.g. the ReLU of
  conv+bn+relu) is the float module path with dots as underscores, optionally
  followed by ``_k``: the ``k``-th call (0-based) of that float module in one
  forward.  Values are recorded on exactly that call.
* Nodes without a float counterpart (quantizers, dequantizers, functional ops
  the float model has no module for, a fused add without a following ReLU)
  are not compared.

Fused layers (conv+bn[+add][+relu]) are compared with the float value after
the last fused op, so the quantized and float values mean the same thing.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

from qcompiler.compiled import CompiledModel
from qcompiler.errors import ConfigError
from qcompiler.ir.meta import META_FUSED_FROM
from qcompiler.nn.fused import fold_bn
from qcompiler.quantization.fake_quantize import FakeQuantizeBase, fake_quantize
from qcompiler.quantization.fixed_point import symmetric_scale
from qcompiler.quantization.qtensor import QTensor
from qcompiler.tools._eval_mode import run_inspected

__all__ = [
    "Logger",
    "OutputLogger",
    "ShadowLogger",
    "compare_model_outputs",
    "compare_model_stub",
    "compare_weights",
    "compute_error",
    "get_logger_dict",
    "get_matching_activations",
    "prepare_model_outputs",
    "prepare_model_with_stubs",
    "remove_loggers",
]

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d)
_WEIGHT_LEAF = re.compile(r"^weight(_.*)?$")


# ---------------------------------------------------------------------------
# value helpers


def _to_float(x: Any) -> Any:
    """Detached float copies: QTensors dequantized, recursively in tuples/lists/dicts."""
    if isinstance(x, QTensor):
        return x.dequantize().detach().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_to_float(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to_float(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_float(v) for k, v in x.items()}
    return x


def _dequant(x: Any) -> Any:
    """Like :func:`_to_float` without copying (inputs of a float shadow)."""
    if isinstance(x, QTensor):
        return x.dequantize()
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_dequant(v) for v in x)
    return x


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, QTensor):
        return [x.dequantize()]
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    raise ConfigError(f"compute_error: expected tensors, QTensors or tuples of them, got {type(x).__name__}")


def compute_error(x: Any, y: Any) -> torch.Tensor:
    """SQNR of ``y`` against the reference ``x`` in dB: ``20*log10(||x|| / ||x - y||)``.

    QTensors are dequantized; tuples/lists are compared element by element as one
    flattened vector.  ``inf`` when equal, ``-inf`` when ``x`` is all zeros and ``y`` not.
    Returns a 0-dim float64 tensor.
    """
    xs, ys = _flat(x), _flat(y)
    if len(xs) != len(ys) or any(a.shape != b.shape for a, b in zip(xs, ys)):
        raise ConfigError(f"compute_error: shapes differ: {[tuple(a.shape) for a in xs]} vs "
                          f"{[tuple(b.shape) for b in ys]}")
    a = torch.cat([t.detach().double().reshape(-1) for t in xs]) if xs else torch.zeros(0, dtype=torch.float64)
    b = torch.cat([t.detach().double().reshape(-1) for t in ys]) if ys else torch.zeros(0, dtype=torch.float64)
    noise = torch.linalg.vector_norm(a - b)
    signal = torch.linalg.vector_norm(a)
    if noise == 0:
        return torch.tensor(math.inf, dtype=torch.float64)
    return 20 * torch.log10(signal / noise)


# ---------------------------------------------------------------------------
# loggers


class Logger(nn.Module):
    """Base class of the loggers: ``stats`` is a dict the logger fills in ``forward``.

    Loggers are called from forward hooks; what ``forward`` returns is ignored,
    so a logger cannot change the model's outputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict = {}


class OutputLogger(Logger):
    """Records each output it sees in ``stats["tensor_val"]`` (detached float; QTensors dequantized)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats["tensor_val"] = []

    def forward(self, x: Any) -> Any:
        self.stats["tensor_val"].append(_to_float(x))
        return x


class ShadowLogger(Logger):
    """Records a quantized layer's output ``x`` and its float shadow's output ``y`` (torch's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats["float"] = []
        self.stats["quantized"] = []

    def forward(self, x: Any, y: Any) -> Any:
        self.stats["quantized"].append(_to_float(x))
        self.stats["float"].append(_to_float(y))
        return x


# ---------------------------------------------------------------------------
# model handling and matching


def _graph_of(model: Any, what: str) -> nn.Module:
    """The module to hook: a CompiledModel's converted graph, any other nn.Module itself."""
    if isinstance(model, CompiledModel):
        return model._need_graph(what)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{what}: expected an nn.Module, GraphModule or CompiledModel, got {type(model).__name__}")
    return model


def _cls(model: Any) -> str:
    return type(model).__name__


def _mangle(path: str) -> str:
    return path.replace(".", "_")


class _FloatIndex:
    """Float module paths by their node-name spelling (dots as underscores)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        self.by_name: dict[str, str] = {}
        for path in self.modules:
            if path:
                self.by_name.setdefault(_mangle(path), path)

    def resolve(self, name: str) -> tuple[str, int] | None:
        """``(path, call_index)`` for a node name, or None."""
        if name in self.by_name:
            return self.by_name[name], 0
        m = re.fullmatch(r"(.+)_(\d+)", name)
        if m and m.group(1) in self.by_name:
            return self.by_name[m.group(1)], int(m.group(2))
        return None


class _Layer:
    """One matched layer: quantized module + call index, float module path + call index, fused chain."""

    def __init__(self, name, q_module, q_index, f_path, f_index, chain, base_path):
        self.name, self.q_module, self.q_index = name, q_module, q_index
        self.f_path, self.f_index = f_path, f_index
        self.chain = chain  # float paths / "add" of the fused pattern, for shadows; None if not shadowable
        self.base_path = base_path  # float path of the layer's first op (its type is the layer's type)


def _q_nodes(q: nn.Module) -> list[tuple[str, str, tuple]]:
    """``(node_name, module_path, fused_from)`` of the quantized model's layers in execution order."""
    if isinstance(q, fx.GraphModule):
        return [(n.name, str(n.target), tuple(n.meta.get(META_FUSED_FROM) or ()))
                for n in q.graph.nodes if n.op == "call_module"]
    return [(_mangle(p), p, ()) for p, m in q.named_modules() if p and not list(m.children())]


def _match(float_model: nn.Module, q: nn.Module, what: str) -> list[_Layer]:
    index = _FloatIndex(float_model)
    q_modules = dict(q.named_modules())
    calls: dict[str, int] = {}
    layers = []
    for node_name, target, fused in _q_nodes(q):
        q_index = calls.get(target, 0)
        calls[target] = q_index + 1
        base = index.resolve(node_name)
        if base is None:
            continue
        chain: list[str] | None = [base[0]]
        out = base
        if len(fused) > 1:
            chain = [base[0]]
            for op in fused[1:]:
                r = index.resolve(op)
                if r is not None:
                    chain.append(r[0])
                    out = r
                elif op.startswith("add"):
                    chain.append("add")
                    out = None
                else:
                    chain, out = None, None
                    break
            if out is None:  # the fused output is a functional op's value: not observable in the float model
                continue
        name = target if (target in index.modules and node_name == _mangle(target)) else node_name
        layers.append(_Layer(name, q_modules[target], q_index, out[0], out[1], chain, base[0]))
    if not layers:
        raise ConfigError(
            f"{what}: no layer of the quantized model {_cls(q)} corresponds to a layer of the float model "
            f"{_cls(float_model)} (layers match by module path / node name); are these the same network?")
    return layers


# ---------------------------------------------------------------------------
# hook registry: one forward hook per hooked module, call-counted per top-level forward


class _Registry:
    ATTR = "_qc_numeric_suite"

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.counts: dict[int, int] = {}
        self.taps: dict[int, dict] = {}
        self.loggers: dict[str, dict[str, Logger]] = {"output": {}, "shadow": {}}
        self.root_handle = root.register_forward_pre_hook(lambda m, a: self.counts.clear())

    @classmethod
    def of(cls, root: nn.Module, create: bool = True) -> _Registry | None:
        reg = root.__dict__.get(cls.ATTR)
        if reg is None and create:
            reg = cls(root)
            root.__dict__[cls.ATTR] = reg
        return reg

    def add(self, kind: str, module: nn.Module, index: int, fn: Callable) -> None:
        key = id(module)
        if key not in self.taps:
            def hook(mod, args, kwargs, output, key=key):
                n = self.counts.get(key, 0)
                self.counts[key] = n + 1
                for _, i, f in list(self.taps[key]["callbacks"]):
                    if i == n:
                        f(args, kwargs, output)

            self.taps[key] = {"handle": module.register_forward_hook(hook, with_kwargs=True), "callbacks": []}
        self.taps[key]["callbacks"].append((kind, index, fn))

    def remove(self, kind: str | None = None) -> None:
        for key in list(self.taps):
            tap = self.taps[key]
            tap["callbacks"] = [c for c in tap["callbacks"] if kind is not None and c[0] != kind]
            if not tap["callbacks"]:
                tap["handle"].remove()
                del self.taps[key]
        for k in self.loggers:
            if kind is None or k == kind:
                self.loggers[k] = {}
        if not self.taps:
            self.root_handle.remove()
            self.root.__dict__.pop(self.ATTR, None)


def remove_loggers(model: Any) -> None:
    """Remove every logger / shadow the numeric suite attached to ``model`` (no-op if none)."""
    root = _graph_of(model, "remove_loggers")
    reg = _Registry.of(root, create=False)
    if reg is not None:
        reg.remove()


def _make_logger(logger_cls: Any, what: str) -> Logger:
    if not (isinstance(logger_cls, type) and issubclass(logger_cls, nn.Module)):
        raise ConfigError(f"{what}: logger_cls must be an ns.Logger subclass, got {logger_cls!r}")
    return logger_cls()


# ---------------------------------------------------------------------------
# compare_model_outputs


def prepare_model_outputs(float_model: nn.Module, q_model: Any, logger_cls: type = OutputLogger) -> None:
    """Attach a ``logger_cls`` to every corresponding layer of both models (forward hooks).

    Replaces output loggers attached before.  Run both models on the same inputs
    (a CompiledModel: run ``q_model.converted``), then call
    :func:`get_matching_activations`; :func:`remove_loggers` detaches them.
    """
    what = "prepare_model_outputs"
    f_root, q_root = _graph_of(float_model, what), _graph_of(q_model, what)
    layers = _match(f_root, q_root, what)
    _make_logger(logger_cls, what)
    f_modules = dict(f_root.named_modules())
    for root in (f_root, q_root):
        reg = _Registry.of(root, create=False)
        if reg is not None:
            reg.remove("output")
    f_reg, q_reg = _Registry.of(f_root), _Registry.of(q_root)
    for layer in layers:
        fl, ql = logger_cls(), logger_cls()
        f_reg.loggers["output"][layer.name] = fl
        q_reg.loggers["output"][layer.name] = ql
        f_reg.add("output", f_modules[layer.f_path], layer.f_index, lambda a, k, out, lg=fl: lg(out))
        q_reg.add("output", layer.q_module, layer.q_index, lambda a, k, out, lg=ql: lg(out))


def _values(logger: Logger) -> list:
    if "tensor_val" in logger.stats:
        return logger.stats["tensor_val"]
    return logger.stats


def get_matching_activations(float_model: nn.Module, q_model: Any) -> dict[str, dict[str, list]]:
    """``{layer: {"float": [one value per run], "quantized": [...]}}`` from the output loggers.

    With a logger that has no ``stats["tensor_val"]``, each side is that logger's ``stats`` dict.
    """
    what = "get_matching_activations"
    f_reg = _Registry.of(_graph_of(float_model, what), create=False)
    q_reg = _Registry.of(_graph_of(q_model, what), create=False)
    if f_reg is None or q_reg is None or not q_reg.loggers["output"]:
        raise ConfigError(f"{what}: no output loggers attached; call prepare_model_outputs(float_model, q_model) "
                          "and run both models first")
    out = {}
    for name, ql in q_reg.loggers["output"].items():
        fl = f_reg.loggers["output"].get(name)
        if fl is not None:
            out[name] = {"float": _values(fl), "quantized": _values(ql)}
    return out


def compare_model_outputs(float_model: nn.Module, q_model: Any, *inputs: Any,
                          logger_cls: type = OutputLogger) -> dict[str, dict[str, list]]:
    """Run both models once on ``inputs``; ``{layer: {"float": [v], "quantized": [v]}}`` for every
    corresponding layer (see the module docstring for the matching rule). Loggers are removed after.

    Both models run in eval mode with observers off and no grad, and are left as they were
    (training flags, BN statistics, observer state)."""
    what = "compare_model_outputs"
    f_root, q_root = _graph_of(float_model, what), _graph_of(q_model, what)
    prepare_model_outputs(f_root, q_root, logger_cls)
    try:
        run_inspected(f_root, "float", inputs)
        run_inspected(q_root, "quantized", inputs)
        return get_matching_activations(f_root, q_root)
    finally:
        remove_loggers(f_root)
        remove_loggers(q_root)


# ---------------------------------------------------------------------------
# compare_model_stub (float shadows on the quantized layers' inputs)


def _detached_copy(module: nn.Module) -> nn.Module:
    """A hook-free copy in eval mode: a shadow of a float layer in train mode must not use batch statistics."""
    m = copy.deepcopy(module).eval()
    for sub in m.modules():
        sub._forward_hooks.clear()
        sub._forward_pre_hooks.clear()
        if hasattr(sub, "_forward_hooks_with_kwargs"):
            sub._forward_hooks_with_kwargs.clear()
        if hasattr(sub, "_forward_pre_hooks_with_kwargs"):
            sub._forward_pre_hooks_with_kwargs.clear()
    return m


def _shadow_fn(chain: list, f_modules: dict[str, nn.Module]) -> Callable:
    """The float computation of a (fused) layer: first module on all inputs, then BN / add / ReLU."""
    mods = [None if p == "add" else _detached_copy(f_modules[p]) for p in chain]
    param = next(iter(mods[0].parameters()), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else None

    def cast(v):
        # a fake-quant model may carry float64 values; the float layer gets its own dtype
        if dtype is not None and isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(cast(t) for t in v)
        return v

    def run(args, kwargs):
        args = cast(_dequant(tuple(args)))
        kwargs = {k: cast(_dequant(v)) for k, v in kwargs.items()}
        if len(mods) == 1:
            return mods[0](*args, **kwargs)
        y = mods[0](args[0])
        for m in mods[1:]:
            y = y + args[1] if m is None else m(y)
        return y

    return run


def _check_swap_list(module_swap_list: Any, what: str) -> tuple:
    if isinstance(module_swap_list, type) or not isinstance(module_swap_list, Iterable):
        module_swap_list = [module_swap_list]
    types = tuple(module_swap_list)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise ConfigError(f"{what}: module_swap_list entries must be nn.Module types (e.g. nn.Conv2d), "
                              f"got {t!r}")
    return types


def prepare_model_with_stubs(float_model: nn.Module, q_model: Any, module_swap_list: Any,
                             logger_cls: type = ShadowLogger) -> None:
    """Shadow each quantized layer whose float counterpart's type is in ``module_swap_list``.

    On each call of such a layer, an eval-mode copy of the float layer (for a fused layer: the
    float conv, BN, add and ReLU in order) runs on the same inputs (QTensors
    dequantized) and ``logger(quantized_out, float_out)`` records both.  The
    quantized model's outputs are unchanged.  Read with :func:`get_logger_dict`.
    """
    what = "prepare_model_with_stubs"
    types = _check_swap_list(module_swap_list, what)
    f_root, q_root = _graph_of(float_model, what), _graph_of(q_model, what)
    layers = _match(f_root, q_root, what)
    _make_logger(logger_cls, what)
    f_modules = dict(f_root.named_modules())
    reg = _Registry.of(q_root, create=False)
    if reg is not None:
        reg.remove("shadow")
    reg = _Registry.of(q_root)
    for layer in layers:
        if layer.chain is None or not isinstance(f_modules[layer.base_path], types):
            continue
        logger = logger_cls()
        reg.loggers["shadow"][layer.name] = logger
        shadow = _shadow_fn(layer.chain, f_modules)

        def cb(args, kwargs, out, lg=logger, shadow=shadow):
            with torch.no_grad():
                lg(out, shadow(args, kwargs))

        reg.add("shadow", layer.q_module, layer.q_index, cb)
    if not reg.taps:
        reg.remove()


def get_logger_dict(q_model: Any) -> dict[str, dict]:
    """``{layer: logger.stats}`` of the shadow loggers; with ShadowLogger ``{"float": [...], "quantized": [...]}``."""
    reg = _Registry.of(_graph_of(q_model, "get_logger_dict"), create=False)
    if reg is None:
        return {}
    return {name: lg.stats for name, lg in reg.loggers["shadow"].items()}


def compare_model_stub(float_model: nn.Module, q_model: Any, module_swap_list: Any, *inputs: Any,
                       logger_cls: type = ShadowLogger) -> dict[str, dict]:
    """Run the quantized model once with float shadows (see :func:`prepare_model_with_stubs`),
    in eval mode with observers off; neither model is changed."""
    what = "compare_model_stub"
    f_root, q_root = _graph_of(float_model, what), _graph_of(q_model, what)
    prepare_model_with_stubs(f_root, q_root, module_swap_list, logger_cls)
    try:
        run_inspected(q_root, "quantized", inputs)
        return get_logger_dict(q_root)
    finally:
        remove_loggers(q_root)


# ---------------------------------------------------------------------------
# compare_weights


def _is_weight_key(key: str) -> bool:
    return bool(_WEIGHT_LEAF.match(key.rpartition(".")[2]))


def _state(x: Any) -> tuple[dict, nn.Module | None]:
    if isinstance(x, CompiledModel):
        x = x._need_graph("compare_weights")
    if isinstance(x, nn.Module):
        return x.state_dict(), x
    if isinstance(x, dict):
        return x, None
    raise ConfigError(f"compare_weights: expected a state dict or a model, got {type(x).__name__}")


def _channel_axis(n: int, shape: torch.Size) -> int:
    if shape[0] == n:
        return 0
    if len(shape) > 1 and shape[1] == n:
        return 1
    raise ConfigError(f"compare_weights: {n} weight scales fit no axis of a weight of shape {tuple(shape)}")


def _fake_quant_from_state(sd: dict, prefix: str, w: torch.Tensor) -> torch.Tensor:
    """``w`` through the fake quant stored under ``prefix`` (``...weight_fake_quant.``), from its state."""
    if prefix + "scale" in sd:
        scale = sd[prefix + "scale"].float().reshape(-1)
    else:
        lo = sd[prefix + "activation_post_process.min_val"]
        hi = sd[prefix + "activation_post_process.max_val"]
        scale = symmetric_scale(torch.maximum(lo.abs(), hi.abs()), "qint8").reshape(-1)
    axis = -1 if scale.numel() == 1 else _channel_axis(scale.numel(), w.shape)
    return fake_quantize(w.detach(), scale, "qint8", axis).detach()


def _fake_quant_from_module(fq: FakeQuantizeBase, w: torch.Tensor) -> torch.Tensor:
    scale, _ = fq.calculate_qparams()
    return fake_quantize(w.detach(), scale, fq.dtype, fq.ch_axis).detach()


def _fused_bns(q_module: nn.Module | None, float_index: _FloatIndex | None) -> dict[str, str | None]:
    """Quantized layer path -> float path of the BN folded into it (from the graph's fused_from)."""
    out: dict[str, str | None] = {}
    if not isinstance(q_module, fx.GraphModule) or float_index is None:
        return out
    for n in q_module.graph.nodes:
        fused = n.meta.get(META_FUSED_FROM) if n.op == "call_module" else None
        if not fused:
            continue
        bn = None
        for op in fused[1:]:
            r = float_index.resolve(op)
            if r is not None and isinstance(float_index.modules[r[0]], _BN_TYPES):
                bn = r[0]
        out[str(n.target)] = bn
    return out


def _bn_by_name(path: str, fsd: dict) -> str | None:
    """State-dict-only pairing of a layer with its BN: ``convX`` -> ``bnX``, ``fc`` -> ``bn``, ``k`` -> ``k+1``."""
    parent, _, leaf = path.rpartition(".")
    cands = [leaf.replace("conv", "bn"), leaf.replace("linear", "bn"), leaf.replace("fc", "bn")]
    if leaf.isdigit():
        cands.insert(0, str(int(leaf) + 1))
    for c in cands:
        p = f"{parent}.{c}" if parent else c
        if c != leaf and p + ".running_mean" in fsd and p + ".running_var" in fsd:
            return p
    return None


def _fold(w: torch.Tensor, b: torch.Tensor | None, bn_path: str, fsd: dict,
          f_module: nn.Module | None) -> torch.Tensor:
    if f_module is not None and isinstance(f_module.get_submodule(bn_path), _BN_TYPES):
        bn = f_module.get_submodule(bn_path)
    else:
        c = fsd[bn_path + ".running_mean"].numel()
        bn = (nn.BatchNorm2d if w.dim() == 4 else nn.BatchNorm1d)(c)
        bn.load_state_dict({k: fsd[f"{bn_path}.{k}"] for k in bn.state_dict() if f"{bn_path}.{k}" in fsd},
                           strict=False)
    # no weight init: the layer only carries the float weight and bias into fold_bn
    if w.dim() == 4:
        base = nn.utils.skip_init(nn.Conv2d, w.shape[1], w.shape[0], tuple(w.shape[2:]), bias=b is not None)
    else:
        base = nn.utils.skip_init(nn.Linear, w.shape[1], w.shape[0], bias=b is not None)
    base.weight = nn.Parameter(w.detach().clone(), requires_grad=False)
    if b is not None:
        base.bias = nn.Parameter(b.detach().clone(), requires_grad=False)
    if bn.num_features != w.shape[0]:
        return w.detach()
    return fold_bn(base, bn).weight.detach()


def compare_weights(float_state_dict: Any, quantized_state_dict: Any) -> dict[str, dict[str, Any]]:
    """``{key: {"float": tensor, "quantized": tensor or QTensor}}`` for each weight present in both.

    Keys are the float model's (``<path>.weight``, ``lstm.weight_ih_l0`` ...).  Either
    argument may be a state dict or the model itself (a CompiledModel: its converted graph).

    * converted model: ``<path>.q_weight`` + ``<path>.w_scale`` -> a per-channel QTensor;
    * prepared model: the weight run through its ``weight_fake_quant`` with the scale it
      has now (calibration models: the scale convert would use), a float tensor;
    * CPU layers / unquantized weights: the float tensor as it is.

    When the quantized layer is fused with a BatchNorm, ``"float"`` is the float weight
    with that BN folded in by :func:`qcompiler.nn.fused.fold_bn` (the value the quantized
    weight approximates).  Which BN: with the quantized *model* given, the graph's
    ``qc_fused_from``; with state dicts only, by naming convention (``convX``/``bnX``,
    ``k``/``k+1`` in a Sequential) when the quantized side is fused (``.op.`` in a
    prepared model's key) or converted.
    """
    fsd, f_module = _state(float_state_dict)
    qsd, q_module = _state(quantized_state_dict)
    f_index = _FloatIndex(f_module) if f_module is not None else None
    bns = _fused_bns(q_module, f_index)
    q_modules = dict(q_module.named_modules()) if q_module is not None else {}
    result: dict[str, dict[str, Any]] = {}
    for qkey, qval in qsd.items():
        if not isinstance(qval, torch.Tensor):
            continue
        path, _, leaf = qkey.rpartition(".")
        quantized: Any
        fused_path = None
        if leaf == "q_weight" and path + ".w_scale" in qsd:
            layer_path, fkey = path, (f"{path}.weight" if path else "weight")
            scale = qsd[path + ".w_scale"].float().reshape(-1)
            qm = q_modules.get(path)
            axis = 1 if getattr(qm, "kind", None) == "conv_transpose2d" else _channel_axis(scale.numel(), qval.shape)
            quantized = QTensor(qval, scale, torch.zeros(scale.shape, dtype=torch.int64), axis=axis)
            fused_path = layer_path
        elif _is_weight_key(qkey) and ".weight_fake_quant." not in qkey:
            layer_path = path
            if path.endswith(".op") or path == "op":
                layer_path = path[:-3].rstrip(".")
                fused_path = layer_path
            fkey = f"{layer_path}.{leaf}" if layer_path else leaf
            fq_prefix = f"{path}.{leaf}_fake_quant." if path else f"{leaf}_fake_quant."
            fq = q_modules.get(fq_prefix[:-1])
            if isinstance(fq, FakeQuantizeBase):
                quantized = _fake_quant_from_module(fq, qval)
            elif any(k.startswith(fq_prefix) for k in qsd):
                quantized = _fake_quant_from_state(qsd, fq_prefix, qval)
            else:
                quantized = qval.detach()
        else:
            continue
        if fkey not in fsd:
            continue
        fw = fsd[fkey].detach()
        if fused_path is not None and isinstance(quantized, (QTensor, torch.Tensor)) and leaf != "bias":
            if q_module is not None and isinstance(q_module, fx.GraphModule) and f_index is not None:
                bn = bns.get(fused_path)
            else:
                bn = _bn_by_name(fused_path, fsd)
            if bn is not None:
                fw = _fold(fw, fsd.get(fused_path + ".bias"), bn, fsd, f_module)
        result[fkey] = {"float": fw, "quantized": quantized}
    return result
