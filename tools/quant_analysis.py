"""Accuracy debugging: compare a float (baseline) model with its quantized version layer by layer.

``QuantAnalysis(baseline_model, analysis_model, analysis_model_type)`` finds the
worst input (:meth:`~QuantAnalysis.auto_find_bad_case`), records every layer's
output of both models on it (:meth:`~QuantAnalysis.run`), writes a per-layer
comparison plus an advisor (:meth:`~QuantAnalysis.compare_per_layer`), ranks the
quantizers by how much each alone hurts the output (:meth:`~QuantAnalysis.sensitivity`)
and proposes the fewest quantizers to move to int16 for a target output SQNR
(:meth:`~QuantAnalysis.suggest_int16`).

Layers are matched by FX node name.  The analysis model is a prepared
(fake-quant) GraphModule, a converted GraphModule or a ``CompiledModel`` (its
``.converted`` graph is recorded).  When the baseline is a plain float module,
the per-layer baseline values come from the *float twin* of the fake-quant
model (a copy with every fake quant off: the float model with BatchNorm folded,
same node names, so fused conv+bn+relu layers compare like with like); without a
fake-quant model (``qcompiler.compile`` keeps none) they come from forward hooks on
the float model: a fused layer then compares with the output of the last module it
was fused from, and layers no float module computes (stubs, functions) are left out.
The model outputs always come from the baseline model itself (and, for "compiled",
from the compiled runtime).

Both models run in eval mode with observers off and no grad, and are left as they were
(training flags, BatchNorm statistics, observer state): see ``tools/_eval_mode.py``.
"""

from __future__ import annotations

import copy
import csv
import io
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
from tabulate import tabulate
from tqdm import tqdm

from qcompiler import collectives
from qcompiler.atomic_write import write_file
from qcompiler.batches import as_args, fresh_args
from qcompiler.errors import ConfigError
from qcompiler.ir.meta import BPU, GM_KIND, META_FUSED_FROM, META_PLACEMENT, META_SCOPE, META_STUB
from qcompiler.quantization.fake_quantize import FakeQuantize
from qcompiler.quantization.fixed_point import qrange
from qcompiler.quantization.mixed_precision import fake_quant_twin, quantizer_owners, quantizer_scopes
from qcompiler.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver
from qcompiler.quantization.qtensor import QTensor
from qcompiler.quantization.stubs import QuantStub
from qcompiler.tools._eval_mode import evaluating, run_inspected
from qcompiler.tools.case_file import case_bytes, load_case
from qcompiler.tools.config_file import write_config_file
from qcompiler.tools.metrics import (
    _LARGER_IS_WORSE,
    COMPARE_COLUMNS,
    METRICS,
    _check_metric,
    _flat,
    _to_float,
    compute_metric,
)
from qcompiler.tools.report import write_report
from qcompiler.tools.root_cause import fixes_json, layer_fixes

__all__ = ["QuantAnalysis", "METRICS", "COMPARE_COLUMNS", "compute_metric", "resolve_device"]

ANALYSIS_TYPES = ("fake_quant", "quantized", "compiled", "export")
# "export": the model qcompiler.export returns (the guide's exported graph), analysed as "compiled" is
EXPORTED_TYPES = ("compiled", "export")

BADCASE_FILE = "badcase.pt"
COMPARE_TXT = "compare_per_layer_out.txt"
COMPARE_CSV = "compare_per_layer_out.csv"
ADVISOR_FILE = "abnormal_layer_advisor.txt"
SENSITIVE_FILE = "sensitive_ops.txt"
REPORT_FILE = "report.html"
ROOT_CAUSE_FILE = "root_cause.txt"

# advisor thresholds
SATURATION_RATIO = 1.5      # base |max| above 1.5 * qscale * qmax: clipping
CLIPPED_FRACTION = 0.05     # or more than 5% of the values outside the int range
CLIP_CHEAP_SQNR = 30.0      # clipping alone keeps >= 30 dB on the tensor: say it costs little, advise nothing
UNDERUSED_RATIO = 1 / 8     # base |max| below 1/8 of qscale * qmax: scale too large
COSINE_DROP = 0.05          # cosine lower than the previous layer's by this much
COSINE_LOW = 0.99
QSCALE_DIFF_HIGH = 8.0      # outputs differ by more than 8 quantization steps


# ----------------------------------------------------------------------------- helpers


def _same_dtype_as_input(module: nn.Module, inputs: tuple, output: Any) -> Any:
    """Forward hook: the output in the dtype of the first input (a fake quant measured alone)."""
    x = inputs[0] if inputs else None
    return output.to(x.dtype) if isinstance(output, torch.Tensor) and isinstance(x, torch.Tensor) else output


def _detach_batch(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, (tuple, list)):
        return tuple(_detach_batch(v) for v in batch)
    if isinstance(batch, dict):
        return {k: _detach_batch(v) for k, v in batch.items()}
    return batch


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.7f}"
    return "" if v is None else v


def _type_name(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__name__"):
        mod = getattr(obj, "__module__", None) or ""
        return f"{mod}.{obj.__name__}" if mod else obj.__name__
    return str(obj)


def _node_op_type(node: fx.Node, modules: dict) -> str:
    if node.op == "call_module":
        m = modules.get(node.target)
        return _type_name(type(m)) if m is not None else str(node.target)
    if node.op == "call_function":
        return _type_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return node.op


class _Recorder(fx.Interpreter):
    """Runs a GraphModule and keeps every node's output (dequantized, detached)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, Any] = {}
        self.raw: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            self.raw[n.name] = out
            self.values[n.name] = _to_float(out, copy=True)  # kept: a later in-place op must not change it
        return out


def _record_graph(gm: fx.GraphModule, args: tuple) -> tuple[dict, dict, Any]:
    rec = _Recorder(gm)
    with evaluating(gm):
        out = rec.run(*fresh_args(args))
    return rec.values, rec.raw, out


def _module_paths(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_modules() if n}


def _graph_scope_paths(gm: fx.GraphModule) -> set[str]:
    paths = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            paths.add(str(node.target))
        for entry in node.meta.get(META_SCOPE) or ():
            p = getattr(entry, "path", "")
            if p:
                paths.add(p)
    return paths


def _fake_quants(model: nn.Module) -> list[tuple[str, FakeQuantize]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FakeQuantize)]


def _op_of_quantizer(name: str) -> tuple[str, str]:
    """``conv1.op.weight_fake_quant`` -> (``conv1``, weight); ``conv0.activation_post_process`` -> (``conv0``, activation)."""
    parts = name.split(".")
    kind = "weight" if parts[-1] == "weight_fake_quant" else "activation"
    if parts[-1] in ("weight_fake_quant", "activation_post_process") and len(parts) > 1:
        parts = parts[:-1]
    if kind == "weight" and len(parts) > 1 and parts[-1] == "op":
        parts = parts[:-1]
    return ".".join(parts), kind


def _layer_flops(model: nn.Module, args: tuple) -> dict[str, int]:
    """MACs per conv / linear module path (from the shapes seen on ``args``); fused layers count their ``op``."""
    flops: dict[str, int] = {}
    hooks = []

    def hook_for(name: str):
        def hook(mod, inp, out):
            out_t = _flat(out)
            if not out_t:
                return
            n_out = out_t[0].numel()
            if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                k = int(torch.tensor(mod.kernel_size).prod())
                f = n_out * (mod.in_channels // mod.groups) * k
            elif isinstance(mod, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
                k = int(torch.tensor(mod.kernel_size).prod())
                inp_t = _flat(inp)
                f = (inp_t[0].numel() * (mod.out_channels // mod.groups) * k) if inp_t else 0
            elif isinstance(mod, nn.Linear):
                f = n_out * mod.in_features
            else:
                return
            owner = name[:-3] if name.endswith(".op") else name
            flops[owner] = flops.get(owner, 0) + int(f)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                            nn.ConvTranspose3d, nn.Linear)):
            hooks.append(mod.register_forward_hook(hook_for(name)))
    try:
        with torch.no_grad():
            model(*fresh_args(args))
    finally:
        for h in hooks:
            h.remove()
    return flops


def _hooked_key(node: fx.Node, hook_paths: dict[str, str]) -> Optional[str]:
    """The key of the float model's module output (recorded by forward hooks) that ``node`` computes, or None.

    Hook keys are spelled like node names, but only a module call's name means that module (a function
    node can take a module's name: ``F.selu`` -> ``selu`` while module ``selu`` runs later), so the node
    must call the module the key was recorded for.  A fused node (conv+bn+relu, conv+bn+add+relu)
    computes what the last op it was fused from computed in the unfused float model: that op's module,
    in the same parent module, gives the baseline; without one the layer is not compared.
    """
    scopes = node.meta.get(META_SCOPE) or ()
    path = getattr(scopes[-1], "path", "") if scopes else ""
    if node.op != "call_module" or not path or hook_paths.get(node.name) != path:
        return None
    fused_from = node.meta.get(META_FUSED_FROM)
    if not fused_from:
        return node.name
    last_path = hook_paths.get(fused_from[-1])
    if last_path is None or last_path.rpartition(".")[0] != path.rpartition(".")[0]:
        return None
    return fused_from[-1]


# ----------------------------------------------------------------------------- the analysis


def resolve_device(device_ids: Any, analysis_model_type: str = "fake_quant") -> torch.device:
    """The device the analysis runs on: the CPU for None / "cpu", else the GPU the index (or the first of a
    list of indices, or a ``cuda:N`` device) names. A GPU index is a ConfigError when torch sees no GPU or
    not that one, and for a compiled / exported model, whose programs run in the BPU simulator on the CPU."""
    if device_ids is None:
        return torch.device("cpu")
    if isinstance(device_ids, (list, tuple)):
        if not device_ids:
            return torch.device("cpu")
        device_ids = device_ids[0]  # the analysis runs on one device: the first one listed
    try:
        if isinstance(device_ids, bool):
            raise TypeError
        device = (torch.device("cuda", device_ids) if isinstance(device_ids, int)
                  else torch.device(device_ids))
    except (TypeError, RuntimeError, ValueError):
        raise ConfigError(f"device_ids must be None or 'cpu' (CPU), a GPU index or a list of them, got "
                          f"{device_ids!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device_ids: {device} is neither the CPU nor a GPU; pass None, 'cpu' or a GPU index")
    if analysis_model_type in EXPORTED_TYPES:
        raise ConfigError(f"device_ids={device.index}: a {analysis_model_type!r} model runs its BPU programs in "
                          "the simulator on the CPU; pass device_ids=None")
    index = 0 if device.index is None else device.index
    if not torch.cuda.is_available():
        raise ConfigError(f"device_ids={index} asks for GPU {index}, but torch sees no GPU "
                          "(torch.cuda.is_available() is False); pass device_ids=None to run on the CPU")
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device_ids={index}: torch sees {torch.cuda.device_count()} GPU(s) (indices 0.."
                          f"{torch.cuda.device_count() - 1}); pass one of them, or None for the CPU")
    return torch.device("cuda", index)


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _is_calibration(model: Any) -> bool:
    return isinstance(model, fx.GraphModule) and model.meta.get(GM_KIND) == "calibration"


def _is_worse(v: float, worst: Optional[float], larger_worse: bool) -> bool:
    """Does ``v`` replace ``worst`` (None: nothing yet)? NaN loses to any number; ties keep the earlier."""
    return worst is None or (not math.isnan(v) and (math.isnan(worst) or (v > worst if larger_worse else v < worst)))


class QuantAnalysis:
    """Compare ``baseline_model`` (high precision) with ``analysis_model`` (the one losing accuracy).

    ``analysis_model_type``: ``"fake_quant"`` (a prepared GraphModule; a calibrated
    ``prepare_calibration_fx`` model stands for its fake-quant twin at the calibrated scales, so PTQ
    users get sensitivity and int16 advice without ``prepare_qat_fx``), ``"quantized"``
    (a converted GraphModule) or ``"compiled"`` (a :class:`qcompiler.CompiledModel`).
    ``fake_quant_model``: the prepared (QAT, or calibrated calibration) model a quantized/compiled model came from
    (needed by :meth:`sensitivity` and :meth:`suggest_int16`; also supplies the
    quantizer scales and the float twin).  ``post_process`` is applied to both
    models' outputs before any metric.  Files go to ``out_dir`` (default
    ``./quant_analysis``). ``"export"`` takes the model :func:`qcompiler.export` returns and is analysed
    as ``"compiled"`` is. ``device_ids`` (the guide's): None or ``"cpu"`` runs on the CPU; a GPU index
    (or a list, of which the first is used) moves the models there, and is a ConfigError when torch
    sees no such GPU (:func:`resolve_device`).
    """

    def __init__(self, baseline_model: nn.Module, analysis_model: Any, analysis_model_type: str = "fake_quant",
                 post_process: Optional[Callable] = None, out_dir: Optional[Union[str, Path]] = None, *,
                 fake_quant_model: Optional[fx.GraphModule] = None,
                 device_ids: Union[None, str, int, Sequence[int], torch.device] = None) -> None:
        if analysis_model_type not in ANALYSIS_TYPES:
            raise ConfigError(f"unknown analysis_model_type {analysis_model_type!r}; allowed: "
                              + ", ".join(ANALYSIS_TYPES))
        if not callable(baseline_model):
            raise ConfigError(f"baseline_model must be a callable model, got {type(baseline_model).__name__}")
        if post_process is not None and not callable(post_process):
            raise ConfigError(f"post_process must be a callable applied to both models' outputs, got "
                              f"{type(post_process).__name__}; the GPU index is the keyword device_ids=")
        self.device = resolve_device(device_ids, analysis_model_type)
        self.baseline_model = baseline_model
        self.analysis_model = analysis_model
        self.analysis_model_type = analysis_model_type
        self.post_process = post_process
        self.out_dir = Path(out_dir if out_dir is not None else "quant_analysis")

        # a calibration model (the PTQ path) stands for its fake-quant twin, frozen at the calibrated scales
        if _is_calibration(analysis_model) and analysis_model_type == "fake_quant":
            analysis_model = self.analysis_model = fake_quant_twin(analysis_model)
        if _is_calibration(fake_quant_model):
            fake_quant_model = fake_quant_twin(fake_quant_model)
        if analysis_model_type == "fake_quant":
            if not isinstance(analysis_model, fx.GraphModule):
                raise ConfigError("analysis_model_type='fake_quant' needs a prepared GraphModule "
                                  "(prepare_calibration_fx / prepare_qat_fx), got "
                                  f"{type(analysis_model).__name__}")
            self.analysis_graph = analysis_model
            fake_quant_model = analysis_model if fake_quant_model is None else fake_quant_model
        elif analysis_model_type == "quantized":
            if not isinstance(analysis_model, fx.GraphModule):
                hint = ("; for a CompiledModel use analysis_model_type='compiled'"
                        if hasattr(analysis_model, "converted") else "")
                raise ConfigError("analysis_model_type='quantized' needs a converted GraphModule (convert_fx), "
                                  f"got {type(analysis_model).__name__}{hint}")
            self.analysis_graph = analysis_model
        else:  # "compiled" / "export": a CompiledModel (qcompiler.compile / qcompiler.export)
            graph = getattr(analysis_model, "converted", None)
            if not isinstance(graph, fx.GraphModule):
                got, hint = type(analysis_model).__name__, ""
                if isinstance(analysis_model, fx.GraphModule):
                    got = f"a GraphModule ({got})"
                    hint = ("; for a GraphModule use analysis_model_type='quantized' (convert_fx) "
                            "or 'fake_quant' (prepared)")
                elif hasattr(analysis_model, "converted"):
                    hint = ("; this one was loaded from an artifact (qcompiler.load) and has no graph to compare "
                            "layer by layer: analyse the model returned by qcompiler.compile")
                raise ConfigError(f"analysis_model_type={analysis_model_type!r} needs the CompiledModel returned "
                                  f"by qcompiler.compile, got {got}{hint}")
            self.analysis_graph = graph
        self.fake_quant_model = fake_quant_model
        if self.device.type != "cpu":  # the guide's device_ids: the models run on that GPU
            for m in {id(m): m for m in (self.baseline_model, self.analysis_model, fake_quant_model)
                      if isinstance(m, nn.Module)}.values():
                m.to(self.device)
        self._check_correspondence()

        self.bad_case: Any = None
        self.bad_case_index: Optional[int] = None
        self.bad_case_metric: Optional[float] = None
        self.case_metrics: list[float] = []
        self.layers: list[dict] = []
        self.compare_rows: list[dict] = []
        self.advice: list[dict] = []
        self.sensitive_ops: list[list] = []
        self.written: list[Path] = []
        # each written path -> (where it is, which file it was): what clean() may remove (see _wrote)
        self._stamps: dict[Path, tuple[Path, Optional[tuple]]] = {}
        self._out_abs = Path(os.path.abspath(self.out_dir))
        self._hook_paths: dict[str, str] = {}

    # ------------------------------------------------------------------ setup checks

    def _check_correspondence(self) -> None:
        analy = _graph_scope_paths(self.analysis_graph)
        if isinstance(self.baseline_model, fx.GraphModule):
            base = {n.name for n in self.baseline_model.graph.nodes} | _graph_scope_paths(self.baseline_model)
            analy |= {n.name for n in self.analysis_graph.graph.nodes if n.op not in ("placeholder", "output")}
        elif isinstance(self.baseline_model, nn.Module):
            base = _module_paths(self.baseline_model)
        else:
            return
        if not (base & analy):
            raise ConfigError(
                "baseline_model and analysis_model have no layer in common (no module path or node name matches); "
                "the analysis model must be prepared/converted from the baseline model"
            )

    def _outputs(self, which: str, args: tuple) -> Any:
        model = self.baseline_model if which == "base" else self.analysis_model
        out = _to_float(run_inspected(model, "baseline" if which == "base" else "analysis", args))
        return self.post_process(out) if self.post_process is not None else out

    # ------------------------------------------------------------------ bad case

    def auto_find_bad_case(self, data_generator: Iterable, num_steps: Optional[int] = None, metric: str = "L1",
                           custom_metric_func: Optional[Callable] = None,
                           custom_metric_order_seq: Optional[str] = None) -> dict:
        """Run both models on every batch (or the first ``num_steps``) and keep the worst one.

        Worst = largest L1/ATOL, smallest COSINE/SQNR; with ``custom_metric_func(base_out, analy_out)``
        the order is ``custom_metric_order_seq`` ("descending": larger is worse, "ascending": smaller is worse).
        Writes ``badcase.pt``; returns ``{"index", "metric", "value"}``. Under ``torch.distributed``
        every rank passes the same batches and runs every world-th one; all ranks get the same result
        as one process, and rank 0 writes the file.
        """
        if custom_metric_func is not None:
            if custom_metric_order_seq not in ("ascending", "descending"):
                raise ConfigError(f"custom_metric_order_seq must be 'ascending' or 'descending', "
                                  f"got {custom_metric_order_seq!r}")
            larger_worse = custom_metric_order_seq == "descending"
            metric_name = getattr(custom_metric_func, "__name__", "custom")
        else:
            metric_name = _check_metric(metric)
            larger_worse = _LARGER_IS_WORSE[metric_name]
        if num_steps is not None and num_steps < 1:
            raise ConfigError(f"num_steps must be at least 1, got {num_steps}")
        # under torch.distributed, batch i runs on rank i % world; every rank iterates the same generator
        rank, world = collectives.rank(), collectives.world_size()
        worst, worst_i, worst_batch, mine = None, None, None, []
        total = num_steps
        if total is None:
            try:
                total = len(data_generator)  # type: ignore[arg-type]
            except TypeError:
                total = None
        for i, batch in enumerate(tqdm(data_generator, total=total, desc="auto_find_bad_case", leave=False)):
            if num_steps is not None and i >= num_steps:
                break
            if i % world != rank:
                continue
            args = _to_device(as_args(batch), self.device)
            b, a = self._outputs("base", args), self._outputs("analy", args)
            v = float(custom_metric_func(b, a)) if custom_metric_func is not None else compute_metric(metric_name, b, a)
            mine.append((i, v))
            if _is_worse(v, worst, larger_worse):
                worst, worst_i, worst_batch = v, i, _detach_batch(batch)
        values = [v for _, v in sorted(p for part in collectives.all_gather_object(
            mine, "auto_find_bad_case: gathering the metrics") for p in part)]
        if not values:
            raise ConfigError("auto_find_bad_case: the data generator produced no data")
        worst_i, worst = None, None
        for i, v in enumerate(values):
            if _is_worse(v, worst, larger_worse):
                worst, worst_i = v, i
        worst_batch = collectives.broadcast_object(worst_batch if worst_i % world == rank else None,
                                                   worst_i % world, "auto_find_bad_case: sharing the bad case")
        self.bad_case, self.bad_case_index, self.bad_case_metric = worst_batch, worst_i, worst
        self.case_metrics = values
        if collectives.rank() == 0:
            self.save_bad_case()
        return {"index": worst_i, "metric": metric_name, "value": worst}

    def set_bad_case(self, data: Any) -> None:
        """Use ``data`` (one model input, or a tuple of positional inputs) as the bad case."""
        if data is None:
            raise ConfigError("set_bad_case: data is None")
        self.bad_case = _detach_batch(data)
        self.bad_case_index = None

    def save_bad_case(self) -> Path:
        """Write the bad case to ``out_dir/badcase.pt``: safetensors with the nesting as JSON
        metadata (:mod:`qcompiler.tools.case_file`), never a pickle."""
        self._need_bad_case("save_bad_case")
        path = self.out_dir / BADCASE_FILE
        write_file(path, case_bytes(self.bad_case), "save_bad_case")
        self._wrote(path)
        return path

    def load_bad_case(self, path: Optional[Union[str, Path]] = None) -> Any:
        """Load the bad case from ``path`` (default ``out_dir/badcase.pt``), written by
        :meth:`save_bad_case`; nothing is unpickled (any other file is an ArtifactError)."""
        p = Path(path) if path is not None else self.out_dir / BADCASE_FILE
        if not p.is_file():
            raise ConfigError(f"no bad case file at {str(p)!r}; run auto_find_bad_case or save_bad_case first")
        self.bad_case = load_case(p)
        return self.bad_case

    def _need_bad_case(self, who: str) -> tuple:
        if self.bad_case is None:
            raise ConfigError(f"{who} needs a bad case: call auto_find_bad_case, set_bad_case or load_bad_case first")
        return _to_device(as_args(self.bad_case), self.device)

    def _wrote(self, path: Path) -> None:
        """Record a file this analysis wrote, by absolute path (a later chdir does not move it) and by
        identity (:func:`_stamp`), so :meth:`clean` removes it only while it is still that file."""
        if path not in self.written:
            self.written.append(path)
        full = Path(os.path.abspath(path))
        self._stamps[path] = (full, _stamp(full))

    # ------------------------------------------------------------------ per-layer recording

    def _float_twin(self) -> Optional[fx.GraphModule]:
        if self.fake_quant_model is None:
            return None
        twin = copy.deepcopy(self.fake_quant_model)
        for _, fq in _fake_quants(twin):
            fq.disable_fake_quant()
            fq.disable_observer()
        return twin.eval()

    def _baseline_layers(self, args: tuple) -> tuple[dict, dict, str]:
        """Per-layer baseline values keyed by node name, with op types, and where they came from."""
        if isinstance(self.baseline_model, fx.GraphModule):
            values, _, _ = _record_graph(self.baseline_model, args)
            mods = dict(self.baseline_model.named_modules())
            types = {n.name: _node_op_type(n, mods) for n in self.baseline_model.graph.nodes}
            return values, types, "baseline graph"
        twin = self._float_twin()
        base_types = {path: _type_name(type(m)) for path, m in self.baseline_model.named_modules()}
        if twin is not None:
            values, _, _ = _record_graph(twin, args)
            mods = dict(twin.named_modules())
            types = {}
            for n in twin.graph.nodes:
                path = str(n.target) if n.op == "call_module" else None
                types[n.name] = base_types.get(path) or _node_op_type(n, mods)
            return values, types, "float twin of the fake-quant model"
        # plain float module, no fake-quant model: forward hooks, keyed like fx node names
        values, types, calls, hooks = {}, {}, {}, []
        hook_paths = self._hook_paths = {}

        def hook_for(path: str, mod: nn.Module):
            def hook(m, inp, out):
                base = path.replace(".", "_")
                k = calls.get(base, 0)
                calls[base] = k + 1
                key = base if k == 0 else f"{base}_{k}"
                values[key] = _to_float(out, copy=True)  # kept: a later in-place op must not change it
                types[key] = _type_name(type(m))
                hook_paths[key] = path
            return hook

        for path, mod in self.baseline_model.named_modules():
            if path:
                hooks.append(mod.register_forward_hook(hook_for(path, mod)))
        try:
            with evaluating(self.baseline_model):
                self.baseline_model(*fresh_args(args))
        finally:
            for h in hooks:
                h.remove()
        return values, types, "baseline module hooks"

    def _quantizer_at(self, node_name: str, fq_nodes: dict, fq_mods: dict, memo: dict) -> Optional[FakeQuantize]:
        """The fake quant that sets the scale of node ``node_name``'s output in the fake-quant model."""
        if node_name in memo:
            return memo[node_name]
        memo[node_name] = None
        node = fq_nodes.get(node_name)
        if node is None:
            return None
        q = None
        if node.op == "call_module":
            m = fq_mods.get(node.target)
            if isinstance(m, FakeQuantize):
                q = m
            elif isinstance(getattr(m, "activation_post_process", None), FakeQuantize):
                q = m.activation_post_process
        if q is None:  # a functional op's output quantizer is the fake quant that reads it (matmul, mul, softmax)
            for user in node.users:
                m = fq_mods.get(user.target) if user.op == "call_module" else None
                if isinstance(m, FakeQuantize) and user.all_input_nodes == [node]:
                    q = m
                    break
        if q is None and node.meta.get(META_PLACEMENT) == BPU and not node.meta.get(META_STUB):
            # a scale-preserving op (transpose, view) carries its input's grid
            for inp in node.all_input_nodes:
                q = self._quantizer_at(inp.name, fq_nodes, fq_mods, memo)
                if q is not None:
                    break
        memo[node_name] = q
        return q

    def run(self) -> list[dict]:
        """Run both models on the bad case and record every common layer's output."""
        args = self._need_bad_case("run")
        base_vals, base_types, self.baseline_source = self._baseline_layers(args)
        analy_vals, analy_raw, _ = _record_graph(self.analysis_graph, args)
        self.base_output = self._outputs("base", args)
        self.analy_output = self._outputs("analy", args)
        # quantizers of the fake-quant model
        fq_nodes, fq_mods = {}, {}
        if self.fake_quant_model is not None:
            fq_nodes = {n.name: n for n in self.fake_quant_model.graph.nodes}
            fq_mods = dict(self.fake_quant_model.named_modules())
        memo: dict = {}
        mods = dict(self.analysis_graph.named_modules())
        layers, used_names = [], set()
        hook_paths = self._hook_paths if self.baseline_source == "baseline module hooks" else None
        for node in self.analysis_graph.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            key = node.name if hook_paths is None else _hooked_key(node, hook_paths)
            if key is None or key not in base_vals:
                continue
            b, a = base_vals[key], analy_vals.get(node.name)
            if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor) or b.numel() != a.numel():
                continue
            if not b.is_floating_point() and not a.is_floating_point():
                continue
            raw = analy_raw.get(node.name)
            dtype, qscale = "torch.float32", None
            if isinstance(raw, QTensor):
                dtype = str(raw.dtype)
                try:
                    qscale = float(raw.q_scale())
                except Exception:
                    try:
                        qscale = float(raw.q_per_channel_scales().max())
                    except Exception:
                        qscale = None
            else:
                q = self._quantizer_at(node.name, fq_nodes, fq_mods, memo)
                if q is not None and bool(q.fake_quant_enabled[0]) and getattr(q, "_has_qparams", False):
                    dtype, qscale = str(q.dtype), float(q.scale.max())
            scopes = node.meta.get(META_SCOPE) or ()
            path = getattr(scopes[-1], "path", "") if node.op == "call_module" and scopes else ""
            if not path and node.op == "call_module" and self.analysis_type_is_graph_with_paths():
                path = str(node.target)
            mod_name = path if path and path not in used_names else node.name
            used_names.add(mod_name)
            layers.append({
                "node": node.name, "mod_name": mod_name,
                "base_op_type": base_types.get(node.name) or base_types.get(key, ""),
                "analy_op_type": _node_op_type(node, mods),
                "shape": tuple(a.shape), "quant_dtype": dtype, "qscale": qscale,
                "placement": node.meta.get(META_PLACEMENT), "base": b.double(), "analy": a.double(),
            })
        if not layers:
            raise ConfigError("baseline_model and analysis_model have no layer in common on the bad case "
                              "(no node name matches with a tensor of the same size)")
        self.layers = layers
        return layers

    def analysis_type_is_graph_with_paths(self) -> bool:
        return self.analysis_model_type == "fake_quant"

    # ------------------------------------------------------------------ compare_per_layer

    def compare_per_layer(self) -> list[dict]:
        """Write ``compare_per_layer_out.txt``/``.csv`` and ``abnormal_layer_advisor.txt``; return the rows."""
        if not self.layers:
            self.run()
        rows = []
        for i, layer in enumerate(self.layers):
            b, a = layer["base"], layer["analy"]
            finite_b, finite_a = b[torch.isfinite(b)], a[torch.isfinite(a)]
            atol = compute_metric("ATOL", b, a)
            qs = layer["qscale"]
            rows.append({
                "index": i, "mod_name": layer["mod_name"], "base_op_type": layer["base_op_type"],
                "analy_op_type": layer["analy_op_type"], "shape": str(list(layer["shape"])),
                "quant_dtype": layer["quant_dtype"], "qscale": qs,
                "Cosine": compute_metric("COSINE", b, a), "L1": compute_metric("L1", b, a), "Atol": atol,
                "max_qscale_diff": (atol / qs) if qs else None,
                "base_min": float(finite_b.min()) if finite_b.numel() else float("nan"),
                "base_max": float(finite_b.max()) if finite_b.numel() else float("nan"),
                "base_mean": float(finite_b.mean()) if finite_b.numel() else float("nan"),
                "analy_min": float(finite_a.min()) if finite_a.numel() else float("nan"),
                "analy_max": float(finite_a.max()) if finite_a.numel() else float("nan"),
                "analy_mean": float(finite_a.mean()) if finite_a.numel() else float("nan"),
            })
        self.compare_rows = rows
        table = tabulate([[_fmt(r[c]) for c in COMPARE_COLUMNS] for r in rows], headers=list(COMPARE_COLUMNS),
                         tablefmt="psql", disable_numparse=True)
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(COMPARE_COLUMNS)
        for r in rows:
            w.writerow([_fmt(r[c]) for c in COMPARE_COLUMNS])
        self.advice = self._advise(rows)
        advisor = self._advisor_text(self.advice)
        for name, text in ((COMPARE_TXT, table + "\n"), (COMPARE_CSV, out.getvalue()), (ADVISOR_FILE, advisor)):
            write_file(self.out_dir / name, text.encode("utf-8"), "compare_per_layer")
            self._wrote(self.out_dir / name)
        return rows

    def _advise(self, rows: list[dict]) -> list[dict]:
        advice = []
        prev_cos, prev_mqd = None, 0.0
        for r, layer in zip(rows, self.layers):
            b, a = layer["base"], layer["analy"]
            name, qs, dt = r["mod_name"], r["qscale"], r["quant_dtype"]
            issues = []
            if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
                where = "analysis" if not bool(torch.isfinite(a).all()) else "baseline"
                issues.append(("nan_inf", f"NaN/Inf in the {where} model's output",
                               "check the inputs and the layer's parameters; a zero/inf scale or a division "
                               "by a tiny value are typical causes"))
            if qs and dt.startswith("qint"):
                qmax = qrange(dt)[1]
                limit = qs * qmax
                amax = float(b[torch.isfinite(b)].abs().max()) if bool(torch.isfinite(b).any()) else 0.0
                clipped = float((b.abs() > limit * 1.0001).double().mean())
                if amax > SATURATION_RATIO * limit or clipped > CLIPPED_FRACTION:
                    # what the clipping alone costs this tensor: clipping many values by a little costs little,
                    # and the int16 advice / sensitivity (measured at the output) then rightly ignore it
                    fin = b[torch.isfinite(b)]
                    cost = compute_metric("SQNR", fin, fin.clamp(-limit, limit)) if fin.numel() else math.inf
                    cheap = cost >= CLIP_CHEAP_SQNR
                    issues.append(("saturation",
                                   f"output saturates: baseline |max| {amax:.6g} vs quantized range +-{limit:.6g} "
                                   f"(qscale {qs:.6g} * {qmax}); {clipped:.1%} of the values are clipped; "
                                   f"the clipping alone leaves this tensor at {cost:.1f} dB SQNR"
                                   + (" -- it costs little" if cheap else " -- scale too small / clipping"),
                                   "no change needed for the clipping (int16 advice and sensitivity measure the "
                                   "output effect)" if cheap else
                                   "check the calibration (data, observer/percentile) of this layer; use int16 "
                                   "or a high-precision (int32/float) output, or a fixed scale for it"))
                elif 0 < amax < UNDERUSED_RATIO * limit:
                    issues.append(("scale_too_large",
                                   f"qscale {qs:.6g} is far too large: baseline |max| {amax:.6g} uses "
                                   f"{amax / limit:.1%} (< 1/8) of the int range",
                                   "check the calibration data (outliers inflate the range); a percentile/MSE "
                                   "observer or int16 keeps more precision"))
                mqd = r["max_qscale_diff"]
                if (mqd is not None and mqd > QSCALE_DIFF_HIGH and mqd > 2 * prev_mqd
                        and not any(k == "saturation" for k, *_ in issues)):
                    issues.append(("large_error", f"outputs differ by up to {mqd:.1f} quantization steps",
                                   "error accumulates here; try int16 for this layer or its inputs"))
            if r["max_qscale_diff"] is not None:
                prev_mqd = r["max_qscale_diff"]
            cos = r["Cosine"]
            if prev_cos is not None and not math.isnan(cos) and cos < prev_cos - COSINE_DROP and cos < COSINE_LOW:
                issues.append(("cosine_drop", f"cosine drops sharply: {prev_cos:.4f} -> {cos:.4f}",
                               "this layer adds most of the error: set it to int16 or a high-precision output"))
            if not math.isnan(cos):
                prev_cos = cos
            for kind, msg, suggestion in issues:
                advice.append({"index": r["index"], "mod_name": name, "kind": kind, "message": msg,
                               "suggestion": suggestion})
        return advice

    @staticmethod
    def _advisor_text(advice: list[dict]) -> str:
        if not advice:
            return "No abnormal layer found.\n"
        lines = [f"{len(advice)} abnormal finding(s):", ""]
        for a in advice:
            lines.append(f"[{a['index']}] {a['mod_name']}: {a['kind']}: {a['message']}")
            lines.append(f"    suggestion: {a['suggestion']}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ sensitivity

    def _need_fake_quant(self, who: str) -> fx.GraphModule:
        if self.fake_quant_model is None:
            raise ConfigError(
                f"{who} needs a fake-quant model (it switches quantizers on and off one at a time): "
                f"pass fake_quant_model=<the prepared model this {self.analysis_model_type} model came from>"
            )
        return self.fake_quant_model

    def _run_fq(self, model: nn.Module, args: tuple) -> Any:
        out = _to_float(run_inspected(model, "fake-quant", args))
        return self.post_process(out) if self.post_process is not None else out

    def sensitivity(self, metric: str = "L1") -> list[list]:
        """Rank every quantizer by the output error it causes alone (all other quantizers off).

        Returns (and writes to ``sensitive_ops.txt``) rows
        ``[op_name, sensitive_type, op_type, metric value, quant_dtype, flops, flops_share]``,
        most sensitive first. Under ``torch.distributed`` the quantizers are split over the ranks;
        every rank returns the rows one process would, and rank 0 writes the file.
        """
        metric = _check_metric(metric)
        fq_model = self._need_fake_quant("sensitivity")
        args = self._need_bad_case("sensitivity")
        base_out = self._outputs("base", args)
        model = copy.deepcopy(fq_model).eval()
        quantizers = [(n, q) for n, q in _fake_quants(model) if getattr(q, "_has_qparams", False)]
        if not quantizers:
            raise ConfigError("sensitivity: the fake-quant model has no calibrated FakeQuantize; run calibration "
                              "batches through the prepare_calibration_fx model (eval, no_grad) before the analysis")
        enabled = {n: bool(q.fake_quant_enabled[0]) for n, q in quantizers}
        for _, q in _fake_quants(model):
            q.disable_fake_quant()
            q.disable_observer()
        flops = _layer_flops(model, args)
        total_flops = sum(flops.values())
        mods = dict(model.named_modules())
        rows = []
        todo = [(name, q) for name, q in quantizers if enabled[name]]
        # under torch.distributed each rank measures every world-th quantizer; all ranks get all values
        mine = {}
        for name, q in tqdm(todo[collectives.rank()::collectives.world_size()], desc="sensitivity", leave=False):
            q.enable_fake_quant()
            # alone, an eval-mode fake quant's exact float64 grid values would meet float32 values of the
            # quantizers left off (a matmul of the two fails): give its values back in its input's dtype
            cast = q.register_forward_hook(_same_dtype_as_input)
            try:
                mine[name] = compute_metric(metric, base_out, self._run_fq(model, args))
            finally:
                cast.remove()
                q.disable_fake_quant()
        values = {k: v for part in collectives.all_gather_object(mine, "sensitivity: gathering the metrics")
                  for k, v in part.items()}
        for name, q in todo:
            value = values[name]
            op, kind = _op_of_quantizer(name)
            f = flops.get(op, 0)
            rows.append([op, kind, _type_name(type(mods.get(op, q))), value, str(q.dtype), f,
                         (f / total_flops) if total_flops else 0.0, name])
        larger_worse = _LARGER_IS_WORSE[metric]
        rows.sort(key=lambda r: (math.isnan(r[3]), -r[3] if larger_worse else r[3]))
        self.sensitive_ops = [r[:7] for r in rows]
        self._sensitive_quantizers = [r[7] for r in rows]
        self.sensitivity_metric = metric
        table = tabulate([[r[0], r[1], r[2], f"{r[3]:.7g}", r[4], f"{r[5]}({r[6]:.2%})"] for r in rows],
                         headers=["op_name", "sensitive_type", "op_type", metric, "quant_dtype", "flops"])
        if collectives.rank() == 0:  # under torch.distributed rank 0 writes
            write_file(self.out_dir / SENSITIVE_FILE, (table + "\n").encode("utf-8"), "sensitivity")
            self._wrote(self.out_dir / SENSITIVE_FILE)
        return self.sensitive_ops

    # ------------------------------------------------------------------ int16 suggestion

    @staticmethod
    def _int16_quantizer(old: FakeQuantize) -> FakeQuantize:
        if old.ch_axis >= 0:
            obs = PerChannelMinMaxObserver(ch_axis=old.ch_axis, dtype="qint16")
        else:
            obs = MinMaxObserver(dtype="qint16")
        new = FakeQuantize(obs)
        new.qc_name = old.qc_name
        # start from the int8 range, then widen with what the data shows
        obs._seed_amax(old.scale.detach() * old.quant_max)
        new.set_qparams(obs.calculate_qparams()[0])
        new.enable_observer()
        new.train(old.training)
        return new

    def _int16_model(self, names: Sequence[str], calib_args: tuple) -> nn.Module:
        model = copy.deepcopy(self._need_fake_quant("suggest_int16")).eval()
        for _, q in _fake_quants(model):
            q.disable_observer()
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, attr)
            setattr(parent, attr, self._int16_quantizer(old))
        # one pass over the data widens the new observers' ranges, then freeze them
        with torch.no_grad():
            model(*calib_args)
        for name in names:
            fq = model.get_submodule(name)
            fq.set_qparams(fq.activation_post_process.calculate_qparams()[0])
        return model

    def suggest_int16(self, target_sqnr: float, data: Any = None) -> tuple[list[str], float]:
        """Greedily move the most sensitive quantizers (sensitivity order) to int16 until output SQNR
        >= ``target_sqnr`` dB on ``data`` (default: the bad case).

        Returns ``(quantizer names switched, reached SQNR)``; the SQNR is measured by re-running.
        Every step is kept in :attr:`int16_advice` (the report and ``qcompiler report`` show it):
        ``{"target_sqnr", "baseline_sqnr" (all int8), "steps": [(quantizer, op, SQNR after it)],
        "quantizers", "reached_sqnr", "gain" (reached - baseline, dB), "met"}``.
        Raises ConfigError when even every quantizer in int16 misses the target (the advice is kept).
        """
        args = as_args(data) if data is not None else self._need_bad_case("suggest_int16")
        if not self.sensitive_ops or getattr(self, "sensitivity_metric", None) is None:
            self.sensitivity()
        base_out = self._outputs("base", args)
        op_of = {q: row[0] for q, row in zip(self._sensitive_quantizers, self.sensitive_ops)}
        chosen: list[str] = []
        sqnr = compute_metric("SQNR", base_out, self._run_fq(self._int16_model([], args), args))
        advice = {"target_sqnr": float(target_sqnr), "baseline_sqnr": sqnr, "steps": [], "quantizers": [],
                  "reached_sqnr": sqnr, "gain": 0.0, "met": sqnr >= target_sqnr}
        self.int16_advice = advice
        for name in self._sensitive_quantizers:
            if advice["met"]:
                break
            chosen.append(name)
            sqnr = compute_metric("SQNR", base_out, self._run_fq(self._int16_model(chosen, args), args))
            advice["steps"].append((name, op_of[name], sqnr))
            advice.update(quantizers=list(chosen), reached_sqnr=sqnr, gain=sqnr - advice["baseline_sqnr"],
                          met=sqnr >= target_sqnr)
        if not advice["met"]:
            raise ConfigError(f"suggest_int16: SQNR {sqnr:.2f} dB with every quantizer in int16 is still below "
                              f"the target {target_sqnr} dB")
        self.int16_suggestion = (list(chosen), sqnr)
        return list(chosen), sqnr

    def int16_advice_text(self) -> str:
        """The int16 advice of the last :meth:`suggest_int16` as a few lines of text ("" before it)."""
        adv = getattr(self, "int16_advice", None)
        if not adv:
            return ""
        head = (f"int16 advice (target output SQNR {adv['target_sqnr']:.2f} dB): all int8 "
                f"{adv['baseline_sqnr']:.2f} dB")
        if not adv["steps"]:
            return head + " already meets the target; nothing to move to int16\n"
        verdict = "meets" if adv["met"] else "still misses"
        lines = [f"{head}; moving {len(adv['quantizers'])} quantizer(s) to int16 gives {adv['reached_sqnr']:.2f} dB "
                 f"(predicted gain {adv['gain']:+.2f} dB, {verdict} the target)"]
        lines += [f"  {i}. {q} ({op}): {v:.2f} dB" for i, (q, op, v) in enumerate(adv["steps"], 1)]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ one-step root cause

    def advise(self, top_k: int = 3) -> list[dict]:
        """From the bad case to the worst layers to a measured fix for each.

        The layers are ranked by :meth:`sensitivity` (run with ``"SQNR"`` if not run yet); for each of
        the ``top_k`` worst, every fix of :mod:`qcompiler.tools.root_cause` (int16 for its output, the op
        to the CPU through hybrid_dict, a clipping observer) is applied alone and the output SQNR on the
        bad case measured. Returns (and writes to ``root_cause.txt``) rows ``{"rank", "layer" (module
        path a config entry names), "quantizers", "sensitivity", "metric", "base_sqnr", "fixes"
        (best first), "best"}``; :meth:`apply_advice` writes the best fixes as a config file.
        """
        if not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"advise: top_k must be a positive int, got {top_k!r}")
        fq_model = self._need_fake_quant("advise")
        args = self._need_bad_case("advise")
        if not self.sensitive_ops or getattr(self, "sensitivity_metric", None) is None:
            self.sensitivity(metric="SQNR")
        base_out = self._outputs("base", args)
        model = copy.deepcopy(fq_model).eval()
        for _, q in _fake_quants(model):
            q.disable_observer()

        def run(m: nn.Module) -> float:
            return compute_metric("SQNR", base_out, self._run_fq(m, args))

        base = run(model)
        scopes = quantizer_scopes(model)
        paths = {p for p, _ in model.named_modules() if p}
        by_op: dict[str, dict] = {}
        for row, q in zip(self.sensitive_ops, self._sensitive_quantizers):
            entry = by_op.setdefault(row[0], {"sensitivity": row[3], "activation": None, "weight": None})
            entry[row[1]] = q
        owners = quantizer_owners(model)
        rows = []
        named = 0  # layers a config entry can name: only they count towards top_k
        for op, entry in by_op.items():
            if named >= top_k:
                break
            act, weight = entry["activation"], entry["weight"]
            target = scopes.get(act, "") if act else (op if op in paths else "")
            stub = target in paths and isinstance(model.get_submodule(target), QuantStub)
            fixes = layer_fixes(model, act, weight, target, run, base, model, cpu=not stub)
            named += bool(target)
            rows.append({"rank": len(rows) + 1, "layer": target or op, "quantizers": [q for q in (act, weight) if q],
                         "sensitivity": entry["sensitivity"], "metric": self.sensitivity_metric, "base_sqnr": base,
                         "fixes": fixes, "best": fixes[0] if fixes else None,
                         "why_no_fix": "" if target else _unnamed_reason(owners.get(act) if act else None, op)})
        self.fix_advice = rows
        if collectives.rank() == 0:
            write_file(self.out_dir / ROOT_CAUSE_FILE, self.fix_advice_text().encode("utf-8"), "advise")
            self._wrote(self.out_dir / ROOT_CAUSE_FILE)
        return rows

    def fix_advice_text(self) -> str:
        """The last :meth:`advise` as text ("" before it)."""
        rows = getattr(self, "fix_advice", None)
        if not rows:
            return ""
        where = f"batch {self.bad_case_index}" if self.bad_case_index is not None else "the given bad case"
        lines = [f"root cause on the bad case ({where}; output SQNR {rows[0]['base_sqnr']:.2f} dB), worst layers first:"]
        for r in rows:
            lines.append(f"  {r['rank']}. {r['layer']} (sensitivity {r['metric']} {r['sensitivity']:.4g}, "
                         f"quantizers {', '.join(r['quantizers'])})")
            if not r["fixes"]:
                lines.append(f"     no config fix: {r.get('why_no_fix') or 'no config entry can name this tensor'}")
            for i, f in enumerate(r["fixes"]):
                lines.append(f"     {'best: ' if i == 0 else '      '}{f.describe()}")
        return "\n".join(lines) + "\n"

    def apply_advice(self, path: Union[str, Path]) -> Optional[Path]:
        """Write the best fix of each advised layer that gains at least ``MIN_FIX_GAIN`` dB as a JSON config file for
        ``qcompiler compile --qconfig FILE --hybrid FILE`` (:mod:`qcompiler.tools.config_file`).
        Returns None and writes nothing when no fix gains: an empty file is not a fix."""
        if not getattr(self, "fix_advice", None):
            raise ConfigError("apply_advice needs the fixes of advise(); call advise() first")
        config = fixes_json(self.fix_advice)
        if not config["qconfig"]["module_name"] and not config["hybrid"]["module_name"]:
            return None  # no fix gains on the bad case: an empty file would only look like one
        p = write_config_file(path, config)
        self._wrote(p)
        return p

    # ------------------------------------------------------------------ files

    def report(self, path: Optional[Union[str, Path]] = None) -> Path:
        """Write the self-contained HTML report (default ``out_dir/report.html``)."""
        p = Path(path) if path is not None else self.out_dir / REPORT_FILE
        write_report(self, p)
        self._wrote(p)
        return p

    def clean(self) -> list[Path]:
        """Remove the files this analysis wrote that are still the ones it wrote (a file of the same
        name written since, by another analysis or by hand, stays), and out_dir if that left it empty.
        Returns the removed files (absolute paths)."""
        removed = []
        for full, stamp in self._stamps.values():
            if stamp is not None and _stamp(full) == stamp:
                full.unlink()
                removed.append(full)
        self.written, self._stamps = [], {}
        if any(p.parent == self._out_abs for p in removed):
            try:
                self._out_abs.rmdir()
            except OSError:  # not empty: files this analysis did not write
                pass
        return removed


def _unnamed_reason(owner: Optional[fx.Node], op: str) -> str:
    """Why no qconfig_dict / hybrid_dict ``module_name`` entry can name a quantizer's tensor: the model
    input without a QuantStub module, or a value computed in the root module's own forward."""
    if owner is not None and owner.op == "placeholder":
        return (f"{owner.name!r} is the model input, quantized where it enters the BPU; to configure it, "
                "quantize it with a QuantStub module of the model and name that module")
    what = repr(op)
    if owner is not None:
        what = f"{owner.name!r} ({getattr(owner.target, '__name__', owner.target)})"
    return (f"{what} is computed in the root module's forward, which no module_name entry can name "
            "(the global qconfig would change every layer); move the op into a submodule to configure it alone")


def _stamp(path: Path) -> Optional[tuple]:
    """Which file is at ``path`` (device, inode, size, modification time), or None if none: a file
    replaced since (atomic writes rename a new one in) or rewritten in place has another stamp."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
