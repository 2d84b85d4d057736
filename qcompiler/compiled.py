"""``qcompiler.compile``: the whole pipeline, and the ``CompiledModel`` it returns.

A facade (the top layer, docs/design.md): it composes the workflow, the lowering, the
runtime, the export and the artifact format, and imports all of them here.

compile = prepare for calibration -> calibrate -> convert to fixed point ->
lower BPU partitions to programs and CPU partitions to ONNX islands.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
from tabulate import tabulate
from tqdm import tqdm

from qcompiler.artifact import load_artifact, save_artifact
from qcompiler.atomic_write import check_directory
from qcompiler.backends.bpu.lower import lower_bpu_partitions
from qcompiler.backends.eager import TORCH, EagerIsland
from qcompiler.backends.onnx.emitter import emit_island
from qcompiler.batches import (as_args, check_inputs, fresh_args, input_signature, require_dense, require_samples,
                               tensors_in)
from qcompiler.collectives import active as distributed_active
from qcompiler.errors import ArtifactError, ConfigError, QCompilerWarning, UnsupportedOpError
from qcompiler.ir.batch_dim import split_refusal
from qcompiler.ir.dump import DUMP_STEM, dump_contents, write_dump
from qcompiler.ir.meta import (BPU, GM_INPUT_SPEC, GM_INT16, GM_KIND, GM_MARCH, GM_OUTPUT_SPEC, META_PLACEMENT,
                               META_QDTYPE, META_REASON, META_TENSOR, TensorInfo)
from qcompiler.ir.capture import GM_CAPTURE
from qcompiler.ir.shape_prop import KeywordInputs, normalize_inputs
from qcompiler.ir.state import ModelState
from qcompiler.ir.structure import bind_structured, check_output_leaves, spec_from_json, spec_to_json
from qcompiler.march import resolve_march
from qcompiler.onnx import export_to_onnx
from qcompiler.parallel import resolve_threads
from qcompiler.pt2e.qdq import compile_ready, import_scales
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.mixed_precision import auto_int16, check_budget, require_int16
from qcompiler.quantization.prepare import prepare_calibration_fx
from qcompiler.quantization.sync import require_batches
from qcompiler.quantization.weight_rounding import optimize_weight_rounding
from qcompiler.runtime import NOT_ANALYSED, Runtime, Step, output_structure, plan_steps

MODES = ("ptq", "qat")


def _leaf_state(gm: fx.GraphModule) -> ModelState:
    """The state of the modules ``gm`` calls as a whole that are the user's own (torch's layers and
    qcompiler's quantizers are not leaves of that kind): one that writes its state (a running mean, a
    call counter) moves it on every forward, and calibration has run it once per batch already."""
    own = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if not type(module).__module__.startswith(("torch.", "qcompiler.")):
                own[node.target.replace(".", "/")] = module
    return ModelState(nn.ModuleDict(own))


class CompiledModel:
    """A compiled model: call it to run BPU programs in the simulator and CPU islands in onnxruntime.

    Built by :func:`compile` (then it also keeps the converted graph for dumps and
    export) or by :func:`load` (runtime only). A call takes inputs like the example
    inputs (the rules of :mod:`qcompiler.batches`: any batch size; float64 is cast to
    float32); anything else is a ConfigError naming the input, before any backend runs.

    ``threads`` (settable; None: ``torch.get_num_threads()`` at each call): a batch of B
    samples is split into ``min(threads, B)`` chunks run on as many worker threads at one
    torch thread each, outputs concatenated, bit for bit the unsplit result; only when the
    graph is proven per-sample (``split_refusal`` is None; else it says why and calls run
    whole, as with ``threads=1``). docs/performance.md, "Throughput".
    """

    def __init__(self, runtime: Runtime, *, name: str, march: str, converted: Optional[fx.GraphModule] = None,
                 example_inputs: tuple = ()) -> None:
        self.runtime, self.name, self.march = runtime, name, march
        self.converted, self.example_inputs = converted, example_inputs
        self.int16: Optional[dict] = None  # compile(int16_budget=...): the auto_int16 record

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on its inputs, given by position or by name (:attr:`input_names`), checked
        like the example inputs before any backend runs."""
        with torch.no_grad():
            return self.runtime(*self._bind(args, kwargs))

    @property
    def input_names(self) -> list[str]:
        """The names of the model's inputs, in order: what a call takes as keyword arguments."""
        return list(self.runtime.input_names)

    def _keywords(self) -> dict[str, int]:
        """Keyword -> input position: the input names, and (with the graph) the forward's own
        parameter names, which torch.fx renames where they shadow a builtin (``input`` -> ``input_1``)."""
        positions = {name: i for i, name in enumerate(self.runtime.input_names)}
        if self.converted is not None:
            targets = [n.target for n in self.converted.graph.nodes if n.op == "placeholder"]
            positions.update({t: i for i, t in enumerate(targets) if isinstance(t, str) and t.isidentifier()})
        return positions

    def _bind(self, args: tuple, kwargs: dict) -> tuple:
        """``args`` and ``kwargs`` as one tuple in input order; a keyword that names no input or an input
        given already, or a call by keyword that leaves an input out, is a ConfigError naming it. A model
        prepared with keyword (dict) example inputs takes them as keywords (``cm(**batch)``), flattened
        by its input spec (:func:`qcompiler.ir.structure.bind_structured`)."""
        if self.runtime.input_spec is not None:
            return bind_structured(self.runtime.input_spec, args, kwargs, "compiled model")
        if not kwargs:
            return args
        names, positions = self.input_names, self._keywords()
        where, listed = "compiled model", ", ".join(names) or "none"
        unknown = [k for k in kwargs if k not in positions]
        if unknown:
            raise ConfigError(f"{where}: keyword argument {unknown[0]!r} names no input of the model; its inputs "
                              f"are {listed} (pass them by position or by these names)")
        given: dict[int, Any] = dict(enumerate(args))
        for key, value in kwargs.items():
            i = positions[key]
            if i in given:
                how = "by position" if i < len(args) else "by another keyword"
                raise ConfigError(f"{where}: input {i} ({names[i]!r}) is given twice ({how} and as {key}=); "
                                  "pass it once")
            given[i] = value
        missing = [f"input {i} ({names[i]!r})" for i in range(len(names)) if i not in given]
        if missing:
            raise ConfigError(f"{where}: {', '.join(missing)} missing; the model takes {len(names)} inputs ({listed})")
        return tuple(given[i] for i in range(len(given)))

    @property
    def threads(self) -> Optional[int]:
        """Worker threads a call's batch is split over (None: ``torch.get_num_threads()``)."""
        return self.runtime.threads

    @threads.setter
    def threads(self, value: Optional[int]) -> None:
        self.runtime.threads = None if value is None else resolve_threads(value, "CompiledModel.threads")

    @property
    def split_refusal(self) -> Optional[str]:
        """None when a batch may be split over threads (the graph is proven per-sample), else why not."""
        return self.runtime.split_refusal

    @property
    def activation_dtypes(self) -> dict[str, str]:
        """Every BPU activation tensor (node name, graph order) -> its integer type (``"qint8"`` /
        ``"qint16"``; ``"qint32"`` for a high-precision output). Needs the compiled graph."""
        graph = self._need_graph("activation_dtypes")
        return {n.name: n.meta[META_QDTYPE] for n in graph.graph.nodes
                if n.meta.get(META_PLACEMENT) == BPU and META_QDTYPE in n.meta}

    @property
    def partitions(self) -> list[dict]:
        """One row per partition: name, placement, number of ops, inputs and outputs crossing it."""
        rows = []
        for step in self.runtime.steps:
            rows.append({"name": step.name, "placement": step.kind, "ops": len(step.nodes),
                         "inputs": list(step.inputs), "outputs": list(step.outputs)})
        return rows

    def boundary_edges(self) -> int:
        """Number of values crossing between a BPU and a CPU partition."""
        kind = {s.name: s.kind for s in self.runtime.steps}
        produced_by = {o: s.name for s in self.runtime.steps for o in s.outputs}
        return sum(1 for s in self.runtime.steps for i in s.inputs
                   if i in produced_by and (kind[produced_by[i]] == BPU) != (s.kind == BPU))

    def summary(self) -> str:
        table = tabulate(
            [(p["name"], p["placement"], p["ops"], len(p["inputs"]), len(p["outputs"])) for p in self.partitions],
            headers=["partition", "placement", "ops", "inputs", "outputs"],
        )
        nb = sum(p["placement"] == BPU for p in self.partitions)
        text = (f"{self.name} ({self.march}): {nb} bpu, {len(self.partitions) - nb} cpu partitions; "
                f"BPU<->CPU boundary edges: {self.boundary_edges()}\n{table}")
        for name, reason in self.torch_islands().items():
            text += f"\n{name} runs in eager torch (placement 'torch'): {reason}"
        return text

    def _need_graph(self, what: str) -> fx.GraphModule:
        if self.converted is None:
            raise ConfigError(f"{what} needs the compiled graph; a model loaded from an artifact has only its runtime")
        return self.converted

    def dump(self, out_dir: Union[str, Path], name: Optional[str] = None) -> list[Path]:
        """Graph dumps (code, table, JSON, DOT/SVG), each CPU island's ONNX and each BPU program's listing,
        into the directory ``out_dir`` (created if missing; an empty path, a file or a path below one is
        a ConfigError naming it). The graph files are ``model.*`` (``DUMP_STEM``) unless ``name`` says
        otherwise, as every other dump names them."""
        out = check_directory(fs_path(out_dir, "dump"), "dump")
        contents, _ = dump_contents(self._need_graph("dump"), name or DUMP_STEM)
        for step in self.runtime.steps:
            if step.kind == BPU:
                contents.append((f"{step.name}.program.txt", self.runtime.programs[step.name].summary().encode()))
            elif step.kind == TORCH:
                contents.append((f"{step.name}.torch.py.txt", self.runtime.eager[step.name].code().encode()))
            else:
                contents.append((f"{step.name}.onnx", self.runtime.islands[step.name]))
        return write_dump(out, contents)  # every file or none: a failure leaves no half dump

    def torch_islands(self) -> dict[str, str]:
        """CPU islands that run in eager torch (ONNX opset 11 cannot express them): name -> reason."""
        return {s.name: s.reason for s in self.runtime.steps if s.kind == TORCH}

    def _refuse_torch_islands(self, what: str, error: type, why: str) -> None:
        islands = [s for s in self.runtime.steps if s.kind == TORCH]
        if islands:
            listed = "; ".join(f"{s.name} (nodes {', '.join(s.nodes)}): {s.reason}" for s in islands)
            raise error(f"{what}: {len(islands)} CPU island(s) run in eager torch, which {why}: {listed}. "
                        f"Keep those modules out of the model you {what}, or give them an ONNX form")

    def export_onnx(self, path: Union[str, Path], *, dynamic_batch: bool = True) -> dict:
        """The whole model as one ONNX opset-11 file plus its ``.quant.json`` sidecar; returns the sidecar.

        ``dynamic_batch``: a symbolic batch axis where the graph is per-sample, as in
        :func:`qcompiler.onnx.export_to_onnx` (False: the example inputs' batch).
        A model with torch islands (:meth:`torch_islands`) has no ONNX form: an UnsupportedOpError
        names each island's nodes and why."""
        self._refuse_torch_islands("export_onnx", UnsupportedOpError, "ONNX opset 11 cannot express")
        return export_to_onnx(self._need_graph("export_onnx"), self.example_inputs, fs_path(path, "export_onnx"),
                              dynamic_batch=dynamic_batch)

    def save(self, path: Union[str, Path]) -> Path:
        """Write the runtime (tensors, JSON, ONNX; no pickled code) to one file; :func:`load` reads it.

        A torch island is Python code, which artifacts never hold: saving a model with one is an
        ArtifactError naming its nodes."""
        path = fs_path(path, "save")
        self._refuse_torch_islands("save", ArtifactError, "an artifact cannot hold without pickling code")
        manifest = {
            "model": self.name,
            "march": self.march,
            "inputs": self.runtime.input_names,
            "outputs": self.runtime.outputs,
            "input_signature": self.runtime.input_signature,
            "steps": [s.to_json() for s in self.runtime.steps],
            "split_refusal": self.runtime.split_refusal,  # the batch split's proof: the file keeps no graph
        }
        for key, spec in (("output_spec", self.runtime.output_spec), ("input_spec", self.runtime.input_spec)):
            if spec is not None:  # only structured models have one: the files of the others stay as they were
                manifest[key] = spec_to_json(spec, f"save: {key}")
        return save_artifact(path, manifest, self.runtime.programs, self.runtime.islands)

    def __reduce__(self) -> tuple:
        """Pickle as the file :meth:`save` writes (tensors, JSON, ONNX: no code), so a model can go to a
        worker process; it unpickles as :func:`load` gives it (the runtime, ``threads`` kept). A model
        ``save`` refuses (eager-torch islands) raises save's ArtifactError."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.qc"
            try:
                self.save(path)
            except ArtifactError as exc:
                why = "a CompiledModel pickles as the file CompiledModel.save writes"
                raise ArtifactError(f"pickle: {why}; {exc}") from None
            data = path.read_bytes()
        return _from_artifact, (data, self.runtime.ort_threads, self.threads)


def _from_artifact(data: bytes, ort_threads: int, threads: Optional[int]) -> CompiledModel:
    """The model a pickle holds: :func:`load` of the artifact bytes ``CompiledModel.__reduce__`` wrote
    (checked like any file; an error names the pickle, not the temporary file)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.qc"
        path.write_bytes(data)
        try:
            return load(path, ort_threads=ort_threads, threads=threads)
        except ArtifactError as exc:
            raise ArtifactError(str(exc).replace(str(path), "the pickled CompiledModel")) from None


def fs_path(path: Any, what: str) -> Union[str, os.PathLike]:
    """``path`` as ``open()`` takes it: a str or os.PathLike as it is, bytes (or a PathLike of bytes)
    decoded with ``os.fsdecode``; anything else is a ConfigError naming ``what``."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ConfigError(f"{what}: the path must be a str, bytes or os.PathLike, got {type(path).__name__}")
    return os.fsdecode(path) if isinstance(os.fspath(path), bytes) else path


def check_ort_threads(value: Any, what: str) -> int:
    """``ort_threads`` (onnxruntime's intra-op threads per CPU island) must be a positive int, not a
    bool: onnxruntime takes 0 as "its default" and True as 1, neither of which the caller meant."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what}: ort_threads must be a positive int, got {value!r}; pass e.g. ort_threads=1")
    return value


def load(path: Union[str, bytes, os.PathLike], *, ort_threads: int = 1,
         threads: Optional[int] = None) -> CompiledModel:
    """A runnable model from a file written by ``CompiledModel.save`` (no Python class needed);
    ``path`` as ``open()`` takes it (str, bytes or os.PathLike).

    ``threads`` is kept (``CompiledModel.threads``); the batch split runs where the saved model's
    graph was proven per-sample (the manifest's ``split_refusal``, null then; a file without it runs
    every batch whole: it has no graph to prove the split safe with)."""
    check_ort_threads(ort_threads, "load")
    if threads is not None:
        resolve_threads(threads, "load")
    path = fs_path(path, "load")
    manifest, programs, islands = load_artifact(path)  # checked: form, sizes, tensors, data flow
    steps = [Step.from_json(s) for s in manifest["steps"]]
    specs = {key: spec_from_json(manifest[key], f"{path}: {key}") if key in manifest else None
             for key in ("output_spec", "input_spec")}  # classes from imported modules only, else plain
    try:
        runtime = Runtime(steps, manifest["inputs"], manifest["outputs"], programs, islands,
                          ort_threads=ort_threads, input_signature=manifest.get("input_signature"), threads=threads,
                          split_refusal=manifest.get("split_refusal", NOT_ANALYSED), **specs)
    except Exception as exc:  # a program the simulator cannot compile, an island onnxruntime refuses
        raise ArtifactError(f"{path}: the runtime cannot be built from this file ({type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None
    return CompiledModel(runtime, name=manifest["model"], march=manifest["march"])


def lower(converted: fx.GraphModule, *, ort_threads: int = 1, example_inputs: Optional[tuple] = None,
          threads: Optional[int] = None) -> Runtime:
    """Runtime of a converted model: BPU partitions -> programs, CPU partitions -> ONNX islands, or
    eager-torch islands where the ONNX emitter has no opset-11 form for a node (the step says why).

    With ``example_inputs``, calls are checked against them (else only their number).
    ``threads``: the batch split's worker threads, where :func:`split_refusal` proves it safe.
    """
    check_output_leaves(converted, lambda n: n.meta.get(META_TENSOR, True) is not None)
    steps = plan_steps(converted)
    programs = lower_bpu_partitions(converted)
    islands, eager = {}, {}
    for step in steps:
        if step.kind == BPU:
            continue
        try:
            model = emit_island(converted, step.name, step.nodes, step.inputs, step.outputs)
        except UnsupportedOpError as exc:  # no (valid) opset-11 form: the island runs in eager torch
            step.kind, step.reason = TORCH, str(exc)
            eager[step.name] = EagerIsland.from_graph(step.name, converted, step.nodes, step.inputs, step.outputs,
                                                      step.reason)
            continue
        islands[step.name] = model.SerializeToString()
    inputs = [n.name for n in converted.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in converted.graph.nodes if n.op == "output")
    signature = input_signature(example_inputs) if example_inputs is not None else None
    return Runtime(steps, inputs, output_structure(out_node.args[0]), programs, islands, ort_threads=ort_threads,
                   input_signature=signature, eager=eager, threads=threads, split_refusal=split_refusal(converted),
                   output_spec=converted.meta.get(GM_OUTPUT_SPEC), input_spec=converted.meta.get(GM_INPUT_SPEC),
                   batch_outputs=_batch_outputs(converted, out_node, example_inputs))


def _batch_outputs(converted: fx.GraphModule, out_node: fx.Node,
                   example_inputs: Any) -> Optional[tuple[int, Optional[tuple[bool, ...]]]]:
    """(the example's batch, per output tensor leaf whether its dim 0 is that batch, or None), from the
    traced output shapes; None without example inputs. The outputs are checked only for a graph torch.export
    captured: it took every size from the example, so an output at the example's batch is one that follows
    the input's (symbolic tracing keeps sizes read at run time, and a ``view(1, -1)`` may mean it)."""
    first = next((t for t in tensors_in(example_inputs) if t.dim() > 0), None) if example_inputs is not None else None
    if first is None:
        return None
    b0 = int(first.shape[0])
    infos = _tensor_infos(out_node.meta.get(META_TENSOR))
    exported = converted.meta.get(GM_CAPTURE) == "export"
    return b0, tuple(bool(i.shape) and i.shape[0] == b0 for i in infos) if exported and infos else None


def _tensor_infos(info: Any) -> list:
    if isinstance(info, TensorInfo):
        return [info]
    if isinstance(info, (tuple, list)):
        return [t for v in info for t in _tensor_infos(v)]
    return []


def calibration_batches(calib_data: Optional[Iterable[Any]], inputs: tuple) -> list[tuple]:
    """``calib_data`` as a list of argument tuples, each checked against the example ``inputs``
    (floats cast), so a mismatch is reported with its batch index before any calibration.
    Without ``calib_data`` the example inputs are the one batch. Every batch needs data (no
    meta tensors) and at least one sample."""
    signature = input_signature(inputs)
    checked = check_inputs(inputs, signature, where="example_inputs")
    if calib_data is None:
        require_samples(checked, where="example_inputs (the calibration batch without calib_data)")
        return [checked]
    if isinstance(calib_data, torch.Tensor) or not isinstance(calib_data, Iterable):
        raise ConfigError(f"calib_data must be an iterable of batches (e.g. a list of tensors), got "
                          f"{'one tensor' if isinstance(calib_data, torch.Tensor) else type(calib_data).__name__}"
                          "; pass [batch] for a single batch")
    batches = list(calib_data)
    require_batches(len(batches), "calib_data")  # under torch.distributed: an empty shard fails on every rank
    if not batches:
        raise ConfigError("calib_data is empty: pass at least one batch of calibration inputs")
    out = []
    for i, b in enumerate(batches):
        if isinstance(inputs, KeywordInputs) and isinstance(b, Mapping):  # by the example's keys
            b = bind_structured(inputs.spec, (), dict(b), where=f"calib_data batch {i}")
        out.append(check_inputs(as_args(b), signature, where=f"calib_data batch {i}"))
        require_samples(out[-1], where=f"calib_data batch {i}")
    return out


def check_has_data(model: nn.Module) -> None:
    """ConfigError naming the first parameter or buffer of ``model`` on the meta device (shapes
    without values: nothing to calibrate or convert)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ConfigError(f"compile: the model's {name!r} is on the meta device (a shape without data); load "
                              "its weights first, e.g. model.to_empty(device='cpu') then model.load_state_dict(...)")


def _warn_if_float(converted: fx.GraphModule, runtime: Runtime, name: str) -> None:
    """A model none of whose ops runs on the BPU compiles to a float CPU model: say so, with the reasons."""
    if any(step.kind == BPU for step in runtime.steps):
        return
    reasons = [f"{n.name}: {n.meta[META_REASON]}" for n in converted.graph.nodes
               if n.op.startswith("call_") and n.meta.get(META_REASON)]
    listed = "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else "")
    warnings.warn(f"compile: no op of {name} runs on the BPU, so the compiled model computes in float on the CPU "
                  f"({listed})", QCompilerWarning, stacklevel=3)


def compile(
    model: nn.Module,
    example_inputs: Any,
    *,
    march=None,
    qconfig_dict: Optional[dict] = None,
    hybrid_dict: Optional[dict] = None,
    calib_data: Optional[Iterable[Any]] = None,
    mode: str = "ptq",
    prepare_custom_config_dict: Optional[dict] = None,
    ort_threads: int = 1,
    progress: bool = True,
    weight_rounding: bool = False,
    int16_budget: Optional[float] = None,
    threads: Optional[int] = None,
) -> CompiledModel:
    """Quantize and lower ``model`` for ``march``; returns a runnable :class:`CompiledModel`.

    ``mode="ptq"``: ``model`` is a float model; it is calibrated on ``calib_data``
    (an iterable of inputs: a tensor, or a tuple for multi-input models; by
    default the example inputs) and converted; each batch is checked against the example
    inputs first (:func:`qcompiler.batches.check_inputs`: any batch size, float64 cast to
    float32). ``mode="qat"``: ``model`` is a trained ``prepare_qat_fx`` model; it is
    converted as it is. ``weight_rounding=True`` (PTQ only) re-rounds the BPU weights on
    the calibration data after calibrating (:func:`qcompiler.quantization.optimize_weight_rounding`).
    ``int16_budget`` (PTQ on a march with int16): at most this fraction of the BPU activation tensors
    becomes int16, the ones whose int16 gains most output SQNR on the calibration data
    (:func:`qcompiler.quantization.mixed_precision`; the choice and its ``qconfig_dict`` are in
    ``CompiledModel.int16``; per tensor: ``activation_dtypes``).
    ``threads``: worker threads a call's batch is split over (:attr:`CompiledModel.threads`).
    Under ``torch.distributed`` pass each rank its own shard as ``calib_data``: the
    observers are reduced over the ranks before convert, so every rank gets the model one
    process would compile from all shards (docs/distributed.md).
    """
    if mode not in MODES:
        raise ConfigError(f"compile: unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    check_ort_threads(ort_threads, "compile")
    if threads is not None:
        resolve_threads(threads, "compile")
    if weight_rounding and mode != "ptq":
        raise ConfigError("compile: weight_rounding=True is a PTQ step (mode='ptq'); QAT trains its weights")
    if int16_budget is not None:
        if mode != "ptq":
            raise ConfigError("compile: int16_budget is a PTQ step (mode='ptq'); for QAT give the int16 qconfig "
                              "to prepare_qat_fx")
        check_budget(int16_budget, "compile: int16_budget")
        if distributed_active():
            raise ConfigError("compile: int16_budget is not supported under torch.distributed yet (each rank "
                              "would choose on its own shard); run auto_int16 on one process and compile every "
                              "rank with the qconfig_dict it returns")
        require_int16(resolve_march(march), "compile(int16_budget=...)")
    if weight_rounding and distributed_active():
        raise ConfigError("compile: weight_rounding=True is not supported under torch.distributed yet (its "
                          "statistics are not reduced over ranks); compile with weight_rounding on one process")
    inputs = normalize_inputs(example_inputs)
    require_dense(inputs, where="example_inputs")
    # PT2E: a convert_pt2e Q/DQ graph is stripped to float and compiled with its own scales (docs/pt2e.md)
    pt2e = compile_ready(model, mode, weight_rounding, int16_budget, prepare_custom_config_dict)
    if pt2e is not None:
        pt2e, prepare_custom_config_dict = pt2e
        model = pt2e.gm
    if isinstance(model, nn.Module):
        check_has_data(model)
    if mode == "qat":
        if not (isinstance(model, fx.GraphModule) and model.meta.get(GM_KIND) == "qat"):
            raise ConfigError("compile(mode='qat') takes a model from prepare_qat_fx (after training)")
        prepared = copy.deepcopy(model)  # the caller keeps training its model: no switch or flag of it changes
        type(prepared).__name__ = type(model).__name__  # deepcopy renames the per-instance class
        set_state(prepared, "validation")
        prepared.eval()
        name = type(model).__name__
    else:
        batches = calibration_batches(calib_data, inputs)
        prepared = prepare_calibration_fx(model, qconfig_dict, prepare_custom_config_dict, hybrid=True,
                                          hybrid_dict=hybrid_dict, example_inputs=inputs, march=march)
        prepared.eval()
        with torch.no_grad():
            for batch in tqdm(batches, desc="calibrating", unit="batch", disable=not progress, leave=False):
                prepared(*fresh_args(batch))  # the batches are run again (int16, rounding, the report)
        leaves = _leaf_state(prepared)  # their extra forwards must not move a leaf's own state again
        if pt2e is not None:
            import_scales(prepared, pt2e, inputs)
        try:
            if int16_budget is not None:  # before weight rounding: it rounds for the int16 input scales
                auto_int16(prepared, batches, budget=int16_budget, progress=progress)
            if weight_rounding:
                optimize_weight_rounding(prepared, batches, progress=progress)
        finally:
            leaves.restore()
        name = type(model).__name__
    converted = convert_fx(prepared, inplace=True)  # ``prepared`` is compile's own copy
    runtime = lower(converted, ort_threads=ort_threads, example_inputs=inputs, threads=threads)
    march_value = converted.meta.get(GM_MARCH)
    _warn_if_float(converted, runtime, name)
    compiled = CompiledModel(runtime, name=name, march=getattr(march_value, "value", str(march_value)),
                             converted=converted, example_inputs=inputs)
    compiled.int16 = prepared.meta.get(GM_INT16)
    return compiled
