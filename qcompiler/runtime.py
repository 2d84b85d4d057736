"""The runtime of a compiled model: BPU programs in the simulator, CPU islands in onnxruntime.

Each step kind has an executor factory in :data:`EXECUTORS` (``{kind: factory}``); a new
kind of island (e.g. eager torch) is one more row, with the same ``run(env) -> outputs``
interface.

A ``Runtime`` is pure data plus sessions: an ordered list of steps (one per
partition, in a topological order), the model's inputs, and the structure of
its outputs (nested tuples of value names; for a structured output, the flat tuple of its leaves and
the TreeSpec that rebuilds it, ``output_spec``). Values flow between steps by FX
value name: QTensors between BPU partitions, float tensors everywhere else.
It never needs the model's Python class, so an artifact can rebuild it.

With ``threads`` > 1 and a graph proven per-sample (``split_refusal`` is None:
:func:`qcompiler.ir.batch_dim.split_refusal`), a call's batch is split into chunks computed
on worker threads at one torch thread each (:mod:`qcompiler.parallel`), outputs concatenated.

:meth:`Runtime.simulated` is the same scheduler over a converted model with its CPU partitions
in eager torch: a run equal to the converted model's, bit for bit (the tests' and benchmarks'
whole-model runs, with the simulator's kernel options).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import networkx as nx
import torch
import torch.fx as fx

from qcompiler.backends.bpu.lower import lower_bpu_partitions
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.eager import TORCH, EagerIsland
from qcompiler.backends.ort import OrtIsland
from qcompiler.batches import check_inputs, tensors_in
from qcompiler.compat.torch_private import TreeSpec
from qcompiler.errors import ConfigError
from qcompiler.ir.batch_dim import split_refusal
from qcompiler.ir.meta import BPU, CPU, META_PARTITION, placement
from qcompiler.ir.structure import unflatten
from qcompiler.parallel import resolve_threads, run_split

# split_refusal of a runtime built without its graph and without a saved proof (an artifact whose
# manifest has no split_refusal): nothing proves it per-sample
NOT_ANALYSED = "the graph was not analysed (an artifact without the saved proof keeps no graph)"


@dataclass
class Step:
    """One partition: ``kind`` "bpu" (a BPU program), "cpu" (an ONNX island in onnxruntime) or
    "torch" (a CPU island in eager torch; ``reason`` says why it is not ONNX)."""

    kind: str
    name: str
    inputs: list[str]
    outputs: list[str]
    nodes: list[str] = field(default_factory=list)
    reason: str = ""

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "inputs": self.inputs, "outputs": self.outputs,
                "nodes": self.nodes}

    @classmethod
    def from_json(cls, d: dict) -> "Step":
        return cls(d["kind"], d["name"], list(d["inputs"]), list(d["outputs"]), list(d.get("nodes", [])))


def output_structure(arg: Any) -> Any:
    """The output node's argument as JSON: value names in (nested) lists, constants as such."""
    if isinstance(arg, fx.Node):
        return {"value": arg.name}
    if isinstance(arg, (tuple, list)):
        return {"tuple" if isinstance(arg, tuple) else "list": [output_structure(a) for a in arg]}
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return {"const": arg}
    raise ConfigError(f"model output contains a {type(arg).__name__}; a graph's output node returns tensors, "
                      "constants and (nested) tuples of them, and a structured output (dict, namedtuple, ModelOutput) "
                      "the flat tuple of its leaves with its structure in gm.meta[GM_OUTPUT_SPEC]: run "
                      "qcompiler.ir.structure.flatten_output on the graph")


def _build_output(spec: Any, env: dict[str, Any], dequantize: bool) -> Any:
    """The outputs in ``spec``'s structure; QTensors dequantized when ``dequantize``."""
    if "value" in spec:
        v = env[spec["value"]]
        return v.dequantize() if dequantize and hasattr(v, "dequantize") and not isinstance(v, torch.Tensor) else v
    if "tuple" in spec:
        return tuple(_build_output(s, env, dequantize) for s in spec["tuple"])
    if "list" in spec:
        return [_build_output(s, env, dequantize) for s in spec["list"]]
    return spec["const"]


def plan_steps(gm: fx.GraphModule) -> list[Step]:
    """One step per partition of a converted graph, ordered topologically (ties: first node)."""
    members: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        part = node.meta.get(META_PARTITION)
        if node.op in ("placeholder", "output") or part is None:
            continue
        members.setdefault(part, []).append(node)
    owner = {n: p for p, nodes in members.items() for n in nodes}
    first = {}
    for i, node in enumerate(gm.graph.nodes):
        if node in owner:
            first.setdefault(owner[node], i)
    dag = nx.DiGraph()
    dag.add_nodes_from(members)
    steps = {}
    for part, nodes in members.items():
        inside = set(nodes)
        inputs: list[str] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.name not in inputs:
                    inputs.append(a.name)
                    if a in owner:
                        dag.add_edge(owner[a], part)
        outputs = [n.name for n in nodes if any(u not in inside for u in n.users)]
        kinds = {placement(n) for n in nodes}
        if len(kinds) != 1 or kinds.pop() not in (BPU, CPU):
            raise ConfigError(f"partition {part} mixes placements; the model was not partitioned")
        steps[part] = Step(placement(nodes[0]), part, inputs, outputs, [n.name for n in nodes])
    if not nx.is_directed_acyclic_graph(dag):
        raise ConfigError("the partitions of this model form a cycle; partition it again")
    order = nx.lexicographical_topological_sort(dag, key=lambda p: first[p])
    return [steps[p] for p in order]


# run(env) -> {output name: value}: reads the step's inputs from env by FX value name
Executor = Callable[[dict[str, Any]], dict[str, Any]]


def bpu_executor(step: Step, runtime: "Runtime") -> Executor:
    """A BPU program in the integer-exact simulator, built with the runtime's ``simulator`` options
    and kept in ``runtime.simulators``."""
    program = runtime.programs.get(step.name)
    if program is None:
        raise ConfigError(f"BPU step {step.name!r} has no program (programs: {', '.join(runtime.programs) or 'none'})")
    sim = runtime.simulators[step.name] = BpuSimulator(program, **runtime.simulator)
    return sim.run


def ort_executor(step: Step, runtime: "Runtime") -> Executor:
    """A CPU island in onnxruntime."""
    return OrtIsland(step.name, runtime.islands[step.name], step.inputs, step.outputs,
                     threads=runtime.ort_threads).run


def eager_executor(step: Step, runtime: "Runtime") -> Executor:
    """A CPU island in eager torch (``qcompiler.backends.eager``)."""
    return runtime.eager[step.name].run


EXECUTORS: dict[str, Callable[[Step, "Runtime"], Executor]] = {
    BPU: bpu_executor,
    CPU: ort_executor,
    TORCH: eager_executor,
}


class Runtime:
    """Executes steps in order, each with the executor :data:`EXECUTORS` has for its kind.

    ``threads``: worker threads for the batch split (None: ``torch.get_num_threads()`` at each
    call); ``split_refusal``: None when the graph is proven per-sample along dim 0, else why not
    (then calls run whole, with torch's own threads).  ``simulator``: keyword options of every
    :class:`BpuSimulator` (``kernels``, ``int8_gemm``, ``onednn``, ``native``); ``dequantize``:
    whether quantized outputs (QTensors) are returned as floats, as a compiled model returns them."""

    def __init__(self, steps: Sequence[Step], input_names: Sequence[str], outputs: Any,
                 programs: dict, islands: dict[str, bytes], *, ort_threads: int = 1,
                 input_signature: Optional[list] = None, eager: Optional[dict] = None,
                 threads: Optional[int] = None, split_refusal: Optional[str] = NOT_ANALYSED,
                 simulator: Optional[dict[str, Any]] = None, dequantize: bool = True,
                 output_spec: Optional[TreeSpec] = None, input_spec: Optional[TreeSpec] = None,
                 batch_outputs: Optional[tuple[int, Optional[tuple[bool, ...]]]] = None) -> None:
        self.steps, self.input_names, self.outputs = list(steps), list(input_names), outputs
        # (the example's batch, per output tensor whether its dim 0 was that batch, for an exported graph): a
        # graph not proven per-sample is checked at another batch (torch.export bakes the example's sizes in)
        self.batch_outputs = batch_outputs
        # the model's structured output and input (qcompiler.ir.structure): outputs are the flat tuple of
        # the spec's leaves, rebuilt into its structure; None: returned as ``outputs`` says
        self.output_spec, self.input_spec = output_spec, input_spec
        # what calls are checked against (qcompiler.batches.input_signature of the example inputs);
        # None (an artifact from before signatures were saved): the number of inputs only
        self.input_signature = input_signature
        self.programs, self.islands = dict(programs), dict(islands)
        self.eager = dict(eager or {})  # step name -> EagerIsland (never saved: it is Python code)
        self.ort_threads = ort_threads
        self.threads = None if threads is None else resolve_threads(threads, "threads")
        self.split_refusal = split_refusal
        self.simulator, self.dequantize = dict(simulator or {}), dequantize
        self.simulators: dict[str, BpuSimulator] = {}  # step name -> its simulator (bpu_executor)
        self._run: dict[str, Executor] = {}
        for step in self.steps:
            factory = EXECUTORS.get(step.kind)
            if factory is None:
                raise ConfigError(f"step {step.name!r} has kind {step.kind!r}, which no executor runs; "
                                  f"known kinds: {', '.join(sorted(EXECUTORS))}")
            self._run[step.name] = factory(step, self)

    @classmethod
    def simulated(cls, converted: fx.GraphModule, programs: Optional[dict] = None, *, threads: Optional[int] = None,
                  **simulator: Any) -> "Runtime":
        """``converted`` (a ``convert_fx`` model) with its BPU partitions in the simulator and its CPU
        partitions in eager torch, quantized outputs kept as QTensors: each call equals
        ``converted(*inputs)`` bit for bit.  ``programs`` defaults to
        :func:`~qcompiler.backends.bpu.lower.lower_bpu_partitions`; ``simulator`` holds
        :class:`BpuSimulator`'s kernel options (e.g. ``kernels="fixed_point"``)."""
        steps = plan_steps(converted)
        eager = {}
        for step in steps:
            if step.kind != BPU:
                step.kind, step.reason = TORCH, "a simulated run computes the CPU nodes in torch"
                eager[step.name] = EagerIsland.from_graph(step.name, converted, step.nodes, step.inputs,
                                                          step.outputs, step.reason)
        inputs = [n.name for n in converted.graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in converted.graph.nodes if n.op == "output")
        return cls(steps, inputs, output_structure(out_node.args[0]),
                   lower_bpu_partitions(converted) if programs is None else programs, {}, eager=eager,
                   threads=threads, split_refusal=split_refusal(converted), simulator=simulator, dequantize=False)

    def __call__(self, *args: Any) -> Any:
        """Run the steps on ``args``, checked first whichever backend runs first (one check for both)."""
        signature = self.input_signature or [None] * len(self.input_names)
        args = check_inputs(args, signature, where="compiled model", names=self.input_names)
        if self.split_refusal is None:
            out = run_split(self._run_checked, args, resolve_threads(self.threads, "threads"))
        else:
            out = self._run_at_another_batch(args)
        return unflatten(out, self.output_spec)

    def _run_at_another_batch(self, args: tuple) -> Any:
        """A graph not proven per-sample, run at a batch other than the example's: a failure, or an output
        whose batch is not the call's, is a ConfigError saying the graph fixes the batch (a shape torch.export
        or a folded constant took from the example), not a traceback from inside torch or a wrong answer."""
        first = next((t for t in tensors_in(args) if t.dim() > 0), None)
        if self.batch_outputs is None or first is None or first.shape[0] == self.batch_outputs[0]:
            return self._run_checked(*args)
        b, b0 = first.shape[0], self.batch_outputs[0]
        fix = (f"the graph is not proven per-sample ({self.split_refusal}) and may fix the batch at the "
               f"example's {b0}: call it at batch {b0}, or compile with example inputs of the batch you run")
        try:
            out = self._run_checked(*args)
        except RuntimeError as exc:
            raise ConfigError(f"compiled model: batch {b} failed ({exc}); {fix}") from None
        for t, batched in zip(tensors_in(out), self.batch_outputs[1] or ()):
            if batched and t.shape[0] != b:
                raise ConfigError(f"compiled model: called at batch {b}, an output came back at batch {t.shape[0]}; "
                                  f"{fix}")
        return out

    def _run_checked(self, *args: Any) -> Any:
        env: dict[str, Any] = dict(zip(self.input_names, args))
        for step in self.steps:
            feeds = {name: env[name] for name in step.inputs}
            try:
                env.update(self._run[step.name](feeds))
            except ConfigError:
                self._refuse_nan(step, feeds)
                raise
        return _build_output(self.outputs, env, self.dequantize)

    def _refuse_nan(self, step: Step, feeds: dict[str, Any]) -> None:
        """After a BPU step failed: if a float value it reads holds NaN (which the step's quantize
        refuses without knowing whose value it is), a ConfigError naming that value: a model input
        by position and name, else the step whose output it is."""
        if step.kind != BPU:
            return
        for name, value in feeds.items():
            where = _nan_at(value)
            if where is None:
                continue
            if name in self.input_names:
                what = f"input {self.input_names.index(name)} ({name!r}){where}"
            else:
                made_by = next((s.name for s in self.steps if name in s.outputs), "an earlier step")
                what = f"the value {name!r}{where} (an output of step {made_by!r})"
            raise ConfigError(f"compiled model: {what} contains NaN, which BPU step {step.name!r} cannot quantize "
                              "(NaN has no integer value); replace the NaNs first, e.g. with torch.nan_to_num") \
                from None


def _nan_at(value: Any) -> Optional[str]:
    """Where a float tensor in ``value`` (a tensor or nested tuples) holds NaN: "" for ``value`` itself,
    "[i]..." inside tuples; None when none does."""
    if isinstance(value, torch.Tensor):
        return "" if value.is_floating_point() and bool(torch.isnan(value).any()) else None
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            inner = _nan_at(v)
            if inner is not None:
                return f"[{i}]{inner}"
    return None
