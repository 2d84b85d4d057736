"""Automatic mixed precision: which BPU activation tensors become int16, chosen by measured gain.

``auto_int16(calib_model, batches, budget=None, target_sqnr=None)`` takes a calibrated
``prepare_calibration_fx`` model, measures what moving each activation quantizer to int16 gains
in output SQNR (the calibration model's own outputs are the float reference), picks a set, re-types
the chosen observers to qint16 in place (their statistics do not depend on the dtype, so no
re-calibration is needed: ``convert_fx(calib_model)`` gives the mixed model) and returns the
``qconfig_dict`` that reproduces the choice from the float model.

The search is greedy with re-measurement (docs/accuracy.md, "Mixed precision"): step 0 measures
every quantizer alone; each later step re-measures, on top of the set chosen so far, the
``candidates_per_step`` quantizers with the largest last measured gain and keeps the best. Errors of
different tensors add up roughly as independent noise, so the singles rank well, and the
re-measurement catches the interactions (a tensor whose int16 helps little once its neighbour is
int16). A budget-bounded greedy path is nested: the set for a smaller budget is a prefix of the set
for a larger one.

What is counted: the BPU activation tensors are the values of the BPU nodes that carry a scale (the
keys of ``CompiledModel.activation_dtypes``); a quantizer sets the dtype of its own tensor and of
every scale-preserving op after it (relu, max pool, flatten...), and all of them count against the
budget. Quantizers whose qconfig comes from the same module scope (e.g. two functional ops in one
module) can only switch together, so they form one candidate.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from tqdm import tqdm

from qcompiler import collectives
from qcompiler.backends.bpu import op_table
from qcompiler.batches import as_args, check_inputs, fresh_args, tensors_in
from qcompiler.errors import ConfigError, InternalError
from qcompiler.ir.meta import (
    BPU,
    GM_HYBRID,
    GM_INPUT_SIGNATURE,
    GM_INT16,
    GM_KIND,
    GM_MARCH,
    GM_QCONFIG_DICT,
    META_OP,
    META_SCOPE,
    META_STUB,
    placement,
)
from qcompiler.ir.ops import META_OPS
from qcompiler.march import to_march
from qcompiler.passes.insert_observers import CONSTANT_QUANT, OUTPUT_OBSERVER, SCALE_PRESERVING_OPS
from qcompiler.passes.insert_stubs import ACTIVATION_POST_PROCESS
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize, _versions, set_state
from qcompiler.quantization.observer import observer_name
from qcompiler.quantization.prepare import prepare_qat_fx
from qcompiler.quantization.qconfig import (
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)

__all__ = ["auto_int16", "activation_quantizers", "fake_quant_twin", "quantizer_scopes"]


@dataclass
class _Group:
    """Quantizers that switch together (one qconfig scope), the tensors they set, their gain."""

    key: str                      # module path the qconfig is resolved at ("" = the root / global)
    quantizers: list[str] = field(default_factory=list)
    tensors: list[str] = field(default_factory=list)
    gain: float = 0.0


def _innermost_path(node: fx.Node, paths: set[str]) -> str:
    for entry in reversed(node.meta.get(META_SCOPE) or ()):
        p = getattr(entry, "path", "")
        if p in paths:
            return p
    return ""


def activation_quantizers(gm: fx.GraphModule) -> dict[str, str]:
    """``{BPU activation tensor (node name): path of the quantizer that sets its scale}`` of a prepared model,
    in graph order. Scale-preserving ops take their input's quantizer; constants and dequant are left out."""
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if not node.op.startswith("call_") or placement(node) != BPU:
            continue
        stub, op = node.meta.get(META_STUB), node.meta.get(META_OP)
        if stub in (OUTPUT_OBSERVER, CONSTANT_QUANT) or op in ("dequant", *META_OPS):
            continue
        if stub == ACTIVATION_POST_PROCESS:
            out[node.name] = str(node.target)
            continue
        if op in SCALE_PRESERVING_OPS:
            src = node.args[0] if node.args else None
            if isinstance(src, fx.Node) and src.meta.get(META_STUB) == OUTPUT_OBSERVER:
                src = src.args[0]  # an output observer node stands for its producer's value
            if isinstance(src, fx.Node) and src.name in out:
                out[node.name] = out[src.name]
            continue
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if module is not None and getattr(module, "activation_post_process", None) is not None:
            out[node.name] = f"{node.target}.activation_post_process"
            continue
        obs = next((u for u in node.users if u.meta.get(META_STUB) == OUTPUT_OBSERVER), None)
        if obs is not None:
            out[node.name] = str(obs.target)
    return out


def quantizer_owners(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """``{activation quantizer path: the node whose module scope decides its qconfig}`` of a prepared
    model: the layer holding it, or for a graph-node observer the producer of the value it observes."""
    owner: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        stub = node.meta.get(META_STUB)
        if stub in (OUTPUT_OBSERVER, ACTIVATION_POST_PROCESS) and isinstance(node.args[0], fx.Node):
            owner[str(node.target)] = node.args[0]
        elif placement(node) == BPU and not stub:
            owner[f"{node.target}.activation_post_process"] = node
    return owner


def quantizer_scopes(gm: fx.GraphModule) -> dict[str, str]:
    """``{activation quantizer path: module path its qconfig is resolved at}`` ("" = the root, i.e. the
    global qconfig): the key a qconfig_dict ``module_name`` entry (or a hybrid_dict one) needs."""
    paths = {p for p, _ in gm.named_modules() if p}
    return {q: _innermost_path(n, paths) for q, n in quantizer_owners(gm).items()}


def _groups(gm: fx.GraphModule, user_paths: set[str], skip: frozenset = frozenset()) -> list[_Group]:
    """Candidates in graph order: quantizers grouped by the module scope their qconfig comes from; the
    quantizers in ``skip`` (already int16) are no candidates."""
    owner = quantizer_owners(gm)
    groups: dict[str, _Group] = {}
    for tensor, quantizer in activation_quantizers(gm).items():
        if quantizer in skip:
            continue
        src = owner.get(quantizer)
        key = _innermost_path(src, user_paths) if src is not None else ""
        g = groups.setdefault(key, _Group(key))
        if quantizer not in g.quantizers:
            g.quantizers.append(quantizer)
        g.tensors.append(tensor)
    return list(groups.values())


def fake_quant_twin(cal: fx.GraphModule) -> fx.GraphModule:
    """The fake-quant model of a calibrated ``prepare_calibration_fx`` model, frozen at its scales
    (``prepare_qat_fx`` from it, validation state, eval): it computes what ``convert_fx`` would, in
    float, up to rare 1-LSB ties, and its quantizers can be switched one by one. Each quantizer keeps
    its calibrated dtype; layers with a high-precision output keep it. ``cal`` is not modified."""
    if not isinstance(cal, fx.GraphModule) or cal.meta.get(GM_KIND) != "calibration":
        raise ConfigError(f"fake_quant_twin takes a prepare_calibration_fx model, got {type(cal).__name__}")
    entries = []
    for n in cal.graph.nodes:
        if n.op != "call_module" or placement(n) != BPU or n.meta.get(META_STUB):
            continue
        m = cal.get_submodule(n.target)
        if hasattr(m, "weight_fake_quant") and getattr(m, "activation_post_process", 0) is None:
            entries.append((str(n.target), get_default_qat_out_qconfig()))  # a high-precision output stays one
    qc: dict[str, Any] = {"": get_default_qat_qconfig()}
    if entries:
        qc["module_name"] = entries
    placed = cal.meta.get(GM_HYBRID)
    hybrid_dict = ({"module_name": list(placed.module_names), "module_type": list(placed.module_types)}
                   if placed is not None and (placed.module_names or placed.module_types) else None)
    model = set_state(prepare_qat_fx(cal, qc, hybrid=True, hybrid_dict=hybrid_dict), "validation").eval()
    # each tensor keeps its calibrated dtype, frozen at the calibrated scale: int16 stays int16, and an int8 the
    # user chose stays int8 where the march's default for the op (nash softmax) would be int16
    for path, m in cal.named_modules():
        if not (isinstance(m, CalibFakeQuantize) and m.has_observed):
            continue
        fq = model.get_submodule(path)
        if m.dtype != "qint8" or fq.dtype != m.dtype:
            fq.activation_post_process.set_dtype(m.dtype)
            fq.set_qparams(m.calculate_qparams()[0])
    return model


class _Measure:
    """Output SQNR of the fake-quant twin of a calibration model with some quantizers at int16.

    Two shortcuts keep a search cheap. The fake quants run their float32 straight-through path
    (``train()`` on them alone, observers off) instead of the exact float64 evaluation: the same grid
    up to rare rounding ties, good enough to rank candidates, and 2-3x faster. And every node's output
    of the run with the current chosen set is kept, so measuring one more candidate re-runs the graph
    only from the first node that candidate changes (``fx.Interpreter`` with an initial env).  Unless the
    graph changes a kept value in place (``a.mul_(0.5)`` after ``a`` fed a later conv): then the kept
    ``a`` is no longer the value that conv read, and every measurement reruns the whole graph.
    """

    def __init__(self, cal: fx.GraphModule, batches: list[tuple], quantizers: list[str]) -> None:
        self.model = fake_quant_twin(cal)
        for m in self.model.modules():
            if isinstance(m, FakeQuantize):
                m.train()
        self.batches = batches
        with torch.no_grad():
            self.ref = torch.cat([_flat_out(cal(*fresh_args(b))) for b in batches]).double()
        self.scales: dict[str, dict[str, torch.Tensor]] = {}
        for name in quantizers:
            obs = copy.deepcopy(cal.get_submodule(name).activation_post_process)
            s8 = obs.set_dtype("qint8").calculate_qparams()[0]
            s16 = obs.set_dtype("qint16").calculate_qparams()[0]
            self.scales[name] = {"qint8": s8, "qint16": s16}
        self.nodes = list(self.model.graph.nodes)
        self.start: dict[str, int] = {}  # quantizer -> index of the first node whose output it changes
        for i, n in enumerate(self.nodes):
            if n.op == "call_module":
                self.start.setdefault(str(n.target), i)
                self.start.setdefault(f"{n.target}.activation_post_process", i)
        self._cache: Optional[tuple[tuple[str, ...], list[dict]]] = None
        self.restarts = True  # False once a base run saw a kept value changed in place
        self.count = 0

    def _set(self, names: Iterable[str], dtype: str) -> None:
        for name in names:
            fq = self.model.get_submodule(name)
            if not isinstance(fq, FakeQuantize):
                raise InternalError(f"the fake-quant twin has {type(fq).__name__} at {name}, not a FakeQuantize")
            fq.activation_post_process.set_dtype(dtype)
            fq.scale.copy_(self.scales[name][dtype].reshape(fq.scale.shape))

    def _envs(self, base: list[str]) -> list[dict]:
        """Every node's output on each batch with ``base`` in int16 (kept for the next calls)."""
        key = tuple(sorted(base))
        if self._cache is None or self._cache[0] != key:
            self._cache = None
            self._set(base, "qint16")
            try:
                envs = []
                for b in self.batches:
                    run = _KeepingInterpreter(self.model)
                    run.run(*fresh_args(b))
                    envs.append(run.env)
                    self.restarts = self.restarts and not run.changed_in_place()
            finally:
                self._set(base, "qint8")
            self._cache = (key, envs)
        return self._cache[1]

    def sqnr(self, int16: list[str], base: Sequence[str] = ()) -> float:
        """Output SQNR (dB) with ``int16`` in int16; ``base`` (a subset of it) is the set the kept run has."""
        extra = [q for q in int16 if q not in base]
        k = min((self.start.get(q, 0) for q in extra), default=len(self.nodes) - 1)
        with torch.no_grad():
            envs = self._envs(list(base)) if k > 0 and self.restarts else None
        if envs is None or not self.restarts:  # (known only after a base run: a kept value changed in place)
            k, envs = 0, [{} for _ in self.batches]
        self._set(int16, "qint16")
        try:
            with torch.no_grad():
                outs = []
                for b, env in zip(self.batches, envs):
                    initial = {n: env[n] for n in self.nodes[:k] if n in env}
                    outs.append(_flat_out(fx.Interpreter(self.model).run(*fresh_args(b), initial_env=initial)))
        finally:
            self._set(int16, "qint8")
        self.count += 1
        noise = (self.ref - torch.cat(outs).double()).norm()
        return float("inf") if noise == 0 else float(20 * torch.log10(self.ref.norm() / noise))


class _KeepingInterpreter(fx.Interpreter):
    """Keeps every node's output (``env``) and the version counter of each tensor in it when it was made,
    so :meth:`changed_in_place` can tell whether a later node wrote into a kept value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.made: list[tuple[torch.Tensor, Optional[tuple]]] = []

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.made.extend((t, _versions(t)) for t in tensors_in(out))
        return out

    def changed_in_place(self) -> bool:
        return any(v is None or _versions(t) != v for t, v in self.made)  # (None: no counter, taken as changed)


def _flat_out(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().reshape(len(out) if out.dim() else 1, -1)
    if isinstance(out, (tuple, list)):
        return torch.cat([_flat_out(o) for o in out], dim=1)
    if isinstance(out, dict):
        return torch.cat([_flat_out(out[k]) for k in sorted(out)], dim=1)
    raise ConfigError(f"auto_int16: cannot compare model outputs of type {type(out).__name__}")


def require_int16(march: Any, who: str) -> None:
    """ConfigError naming the march when it has no int16 activations (bernoulli2)."""
    if not op_table(march).has_int16:
        raise ConfigError(f"{who}: march {to_march(march).value!r} has no int16 activations (int8 only); "
                          f"mixed precision needs a march with int16, e.g. bayes")


def check_budget(budget: Any, what: str) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0.0 <= budget <= 1.0):
        raise ConfigError(f"{what} must be a fraction in [0, 1] of the BPU activation tensors, got {budget!r}")


def _check_args(calib_model: Any, batches: Any, budget: Any, target_sqnr: Any) -> list[tuple]:
    if not isinstance(calib_model, fx.GraphModule) or calib_model.meta.get(GM_KIND) != "calibration":
        raise ConfigError("auto_int16 takes the calibrated model returned by prepare_calibration_fx, got "
                          f"{type(calib_model).__name__}")
    require_int16(calib_model.meta.get(GM_MARCH), "auto_int16")
    if collectives.active():
        raise ConfigError("auto_int16 is not supported under torch.distributed yet (each rank would measure on "
                          "its own shard and could choose differently); run it on one process and pass the "
                          "qconfig_dict it returns to every rank")
    if budget is None and target_sqnr is None:
        raise ConfigError("auto_int16: give budget (the largest fraction of BPU activation tensors in int16, "
                          "e.g. 0.1) or target_sqnr (dB), or both")
    check_budget(budget, "auto_int16: budget")
    if target_sqnr is not None and (isinstance(target_sqnr, bool) or not isinstance(target_sqnr, (int, float))
                                    or not math.isfinite(target_sqnr)):
        raise ConfigError(f"auto_int16: target_sqnr must be a finite number of dB, got {target_sqnr!r}")
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Iterable):
        raise ConfigError("auto_int16: batches must be an iterable of model inputs (e.g. the calibration "
                          "batches), not " + ("one tensor; pass [batch]" if isinstance(batches, torch.Tensor)
                                              else type(batches).__name__))
    out = [as_args(b) for b in batches]
    if not out:
        raise ConfigError("auto_int16: batches is empty; pass the calibration batches")
    signature = calib_model.meta.get(GM_INPUT_SIGNATURE)  # the example inputs it was prepared with
    if signature is not None:  # the rules calibration data follows in compile (qcompiler.batches)
        out = [check_inputs(b, signature, where=f"auto_int16: batches[{i}]") for i, b in enumerate(out)]
    return out


def _qconfig_dict(cal: fx.GraphModule, groups: list[_Group], chosen: list[_Group]) -> dict:
    """A qconfig_dict giving the chosen groups int16 and every other group its int8 observer."""
    obs_of = {g.key: observer_name(cal.get_submodule(g.quantizers[0]).activation_post_process) for g in groups}
    names = [obs_of[g.key] for g in groups]
    base = max(sorted(set(names)), key=names.count) if names else "histogram-mse"
    picked = {g.key for g in chosen}

    def qc(key: str, dtype: str):
        return get_default_calib_qconfig(dtype=dtype, observer=obs_of.get(key, base))

    glob = get_default_calib_qconfig(dtype="qint16" if "" in picked else "qint8",
                                     observer=obs_of[""] if "" in picked else base)
    entries: dict[str, Any] = {g.key: qc(g.key, "qint16") for g in groups if g.key in picked and g.key}

    def effective(path: str) -> str:
        parts = path.split(".")
        for k in range(len(parts), 0, -1):
            p = ".".join(parts[:k])
            if p in entries:
                return entries[p].dtype
        return glob.dtype

    for g in sorted(groups, key=lambda g: g.key.count(".")):
        if g.key and g.key not in picked and (effective(g.key) == "qint16" or obs_of[g.key] != base):
            entries[g.key] = qc(g.key, "qint8")
    # the user's own entries (module types, other module names, e.g. a high-precision output) stay
    user = cal.meta.get(GM_QCONFIG_DICT)
    user = dict(user) if isinstance(user, dict) else {}
    result: dict[str, Any] = {"": glob if "" in picked or user.get("") is None else user[""]}
    if user.get("module_type"):
        result["module_type"] = list(user["module_type"])
    kept = [(name, q) for name, q in user.get("module_name", []) if name not in entries]
    if entries or kept:
        result["module_name"] = kept + sorted(entries.items())
    return result


def auto_int16(calib_model: fx.GraphModule, batches: Iterable[Any], budget: Optional[float] = None,
               target_sqnr: Optional[float] = None, *, candidates_per_step: int = 4,
               progress: bool = False) -> dict:
    """Move the BPU activation tensors that gain most to int16; returns the ``qconfig_dict`` used.

    ``calib_model``: a ``prepare_calibration_fx`` model after calibration, on a march with int16
    (bayes; bernoulli2 is a ConfigError). ``batches``: model inputs to measure on (the calibration
    batches), checked like calibration data against the example inputs it was prepared with
    (:func:`qcompiler.batches.check_inputs`: any batch size, floats cast); the reference is the
    calibration model's own (float) output. ``budget``: the largest fraction of BPU activation
    tensors the search moves to int16 (tensors int16 already, by the march's defaults or the user's
    qconfig, stay so and do not count); ``target_sqnr``: stop as soon as the output SQNR
    reaches it (dB). With both, the budget caps the search; with only ``target_sqnr``, the fewest
    tensors that reach it (all of them if none do). The chosen observers are re-typed to qint16 in
    ``calib_model`` (run ``optimize_weight_rounding`` after this, then ``convert_fx``), and the
    record of the search is kept in ``calib_model.meta[qcompiler.ir.meta.GM_INT16]``: ``chosen`` (tensors),
    ``quantizers``, ``tensors`` (count), ``steps`` ``[(quantizers, SQNR after the step, tensors it moves)]``, ``baseline_sqnr``,
    ``reached_sqnr``, ``evaluations``, ``qconfig_dict``. Deterministic.
    """
    data = _check_args(calib_model, batches, budget, target_sqnr)
    if not isinstance(candidates_per_step, int) or candidates_per_step < 1:
        raise ConfigError(f"auto_int16: candidates_per_step must be a positive int, got {candidates_per_step!r}")
    user_paths = {p for p, _ in calib_model.named_modules() if p}
    calib_model.eval()
    # tensors already int16 (the march's defaults, the user's qconfig) stay so and are no candidates: measuring
    # one would switch it back to int8 in the twin afterwards, and moving it costs nothing of the budget
    wide = frozenset(q for q in set(activation_quantizers(calib_model).values())
                     if getattr(calib_model.get_submodule(q), "dtype", "qint8") != "qint8")
    groups = [g for g in _groups(calib_model, user_paths, wide)
              if all(isinstance(calib_model.get_submodule(q), CalibFakeQuantize) for q in g.quantizers)]
    n_tensors = len(activation_quantizers(calib_model))
    limit = n_tensors if budget is None else math.floor(budget * n_tensors + 1e-9)
    measure = _Measure(calib_model, data, [q for g in groups for q in g.quantizers])
    base = measure.sqnr([])
    chosen: list[_Group] = []
    steps: list[tuple[list[str], float]] = []
    current = base

    def quantizers(gs: list[_Group]) -> list[str]:
        return [q for g in gs for q in g.quantizers]

    def cost(gs: list[_Group]) -> int:
        return sum(len(g.tensors) for g in gs)

    bar = tqdm(total=None, desc="auto_int16", disable=not progress, leave=False)
    remaining = list(groups)
    first = True
    while remaining and (target_sqnr is None or current < target_sqnr):
        fits = [g for g in remaining if cost(chosen) + len(g.tensors) <= limit]
        if not fits:
            break
        # step 0 measures every candidate; later steps the best few by their last measured gain
        order = {id(g): i for i, g in enumerate(groups)}
        pool = fits if first else sorted(fits, key=lambda g: (-g.gain, order[id(g)]))[:candidates_per_step]
        for g in pool:
            g.gain = measure.sqnr(quantizers(chosen + [g]), base=quantizers(chosen)) - current
            bar.update(1)
        first = False
        best = max(pool, key=lambda g: (g.gain, -order[id(g)]))
        if best.gain <= 0.0:
            break  # nothing left that helps: fewer int16 tensors for the same SQNR
        chosen.append(best)
        remaining.remove(best)
        current = current + best.gain
        steps.append((list(best.quantizers), current, len(best.tensors)))
    bar.close()
    for name in quantizers(chosen):
        calib_model.get_submodule(name).activation_post_process.set_dtype("qint16")
    result = _qconfig_dict(calib_model, groups, chosen)
    calib_model.meta[GM_INT16] = {
        "chosen": [t for g in chosen for t in g.tensors], "quantizers": quantizers(chosen),
        "tensors": n_tensors, "already_int16": sorted(wide), "budget": budget, "target_sqnr": target_sqnr, "steps": steps,
        "baseline_sqnr": base, "reached_sqnr": current, "evaluations": measure.count, "qconfig_dict": result,
    }
    return result
