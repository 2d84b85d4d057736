"""QConfig setters: templates that choose each op's qconfig by looking at the traced graph.

A *setter* is called with the placed, fused float graph of a model (what
:func:`qcompiler.partition` returns: every node has its op, its placement and its module
scope) and returns the ``qconfig_dict`` that :func:`~qcompiler.prepare_qat_fx` (or
:func:`~qcompiler.prepare_calibration_fx`) takes. Unlike a dict written by hand, it can see
which layers feed the model's outputs, which ops the march runs at int16 and which ops an
analysis found sensitive, so the user does not have to name them. The one-call
:func:`qcompiler.quantization.prepare` traces the model, calls the setter and prepares with
the dict it returns; :meth:`QConfigSetter.qconfig_dict` gives the dict itself (for review, or
for the staged API).

The templates here (the accuracy-debugging guide's names):

* :data:`default_qat_qconfig_setter` / :data:`default_calibration_qconfig_setter`: int8
  everywhere, a high-precision (int32) output on the layers whose result is a model output;
* :func:`sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter` and its calibration twin:
  the default, plus int16 activations on the ops a list or a ``QuantAnalysis.sensitivity``
  table names, up to a count or a fraction.

A plain function ``graph -> qconfig_dict`` is a setter too.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch.fx as fx

from qcompiler.backends.bpu import op_table
from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.ir.meta import BPU, GM_MARCH, META_FUSED_FROM, META_OP, META_SCOPE, META_STUB, placement
from qcompiler.march import to_march
from qcompiler.nn.qat import has_weight_layer
from qcompiler.quantization.qconfig import (
    KINDS,
    QConfig,
    get_default_calib_out_qconfig,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
)

__all__ = [
    "QConfigSetter",
    "DefaultQConfigSetter",
    "SensitiveOpQConfigSetter",
    "default_qat_qconfig_setter",
    "default_calibration_qconfig_setter",
    "sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter",
    "sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter",
    "high_precision_outputs",
    "setter_kind",
]

# Fused parts after which a layer's int32 accumulator is no longer its result (insert_observers says the same).
_AFTER_ACCUMULATOR = ("add", "relu", "relu6")
# The name suffix of a graph-node activation quantizer (passes/insert_stubs.ACTIVATION_POST_PROCESS).
_OBSERVER_SUFFIX = "_activation_post_process"


def _path(node: fx.Node) -> str:
    """The module path a qconfig_dict ``module_name`` entry needs for ``node`` ("" = the root)."""
    scopes = node.meta.get(META_SCOPE) or ()
    return getattr(scopes[-1], "path", "") if scopes else ""


def _reaches_output_only(node: fx.Node) -> bool:
    """Every use of ``node`` is the model output, directly or through a dequant (a stub the front end put)."""
    if not node.users:
        return False
    for user in node.users:
        if user.op == "output":
            continue
        if user.meta.get(META_OP) == "dequant" and user.users and all(u.op == "output" for u in user.users):
            continue
        return False
    return True


def high_precision_outputs(graph: fx.GraphModule) -> list[str]:
    """Module paths of the BPU weight layers (conv / linear) whose result is a model output, in graph order.

    Such a layer may emit its int32 accumulator (a high-precision output qconfig): nothing on the
    BPU reads it, so quantizing it to int8 would only add error. A layer fused with an add or an
    activation is left out: its accumulator is not its result. A module called twice is left out
    too (one qconfig for both calls)."""
    modules = dict(graph.named_modules())
    calls: dict[str, int] = {}
    for n in graph.graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1
    out = []
    for n in graph.graph.nodes:
        if n.op != "call_module" or placement(n) != BPU or n.meta.get(META_STUB):
            continue
        module = modules.get(str(n.target))
        if module is None or not has_weight_layer(module) or calls[str(n.target)] > 1:
            continue
        fused = tuple(getattr(module, "fused_from", ())) or tuple(n.meta.get(META_FUSED_FROM) or ())
        if any(p in _AFTER_ACCUMULATOR for p in fused[1:]):
            continue
        path = _path(n)
        if path and _reaches_output_only(n) and path not in out:
            out.append(path)
    return out


def _march(graph: fx.GraphModule):
    march = graph.meta.get(GM_MARCH)
    if march is None:
        raise ConfigError("qconfig setter: the graph has no march (gm.meta[GM_MARCH]); pass the graph "
                          "qcompiler.partition returns, or call the setter through qcompiler.quantization.prepare")
    return to_march(march)


class QConfigSetter:
    """Base of the templates: ``setter(graph) -> qconfig_dict``; ``kind`` is "qat" or "calibration"."""

    kind: str = "qat"

    def __call__(self, graph: fx.GraphModule) -> dict:
        return self.qconfig_dict(graph)

    def qconfig_dict(self, graph: fx.GraphModule) -> dict:
        raise NotImplementedError

    # -- the qconfigs of the kind
    def _int(self, dtype: str = "qint8") -> QConfig:
        return get_default_qat_qconfig(dtype) if self.kind == "qat" else get_default_calib_qconfig(dtype)

    def _out(self) -> QConfig:
        return get_default_qat_out_qconfig() if self.kind == "qat" else get_default_calib_out_qconfig()


class DefaultQConfigSetter(QConfigSetter):
    """int8 activations and weights everywhere; a high-precision output on each layer whose result is a
    model output.

    Why: int8 is what every march runs fastest and what the guide's tables show for a plain model;
    the last conv / linear of a model feeds nothing on the BPU, so its int32 accumulator can leave
    as it is (with its scale) instead of being rounded to int8 (:func:`high_precision_outputs`).
    """

    def __init__(self, kind: str = "qat") -> None:
        if kind not in KINDS:
            raise ConfigError(f"qconfig setter: unknown kind {kind!r}; allowed: " + ", ".join(map(repr, KINDS)))
        self.kind = kind

    def qconfig_dict(self, graph: fx.GraphModule) -> dict:
        _march(graph)
        result: dict[str, Any] = {"": self._int()}
        outputs = high_precision_outputs(graph)
        if outputs:
            result["module_name"] = [(p, self._out()) for p in outputs]
        return result

    def __repr__(self) -> str:
        return f"default_{'qat' if self.kind == 'qat' else 'calibration'}_qconfig_setter"


default_qat_qconfig_setter = DefaultQConfigSetter("qat")
default_calibration_qconfig_setter = DefaultQConfigSetter("calibration")


def _op_names_of(table: Any) -> list[str]:
    """Op names, most sensitive first, from a list of names or the rows of ``QuantAnalysis.sensitivity``.

    Only activation rows count: this setter raises activations to int16; a weight's sensitivity
    needs int16 weights, which it does not set."""
    if isinstance(table, (str, bytes)) or not isinstance(table, Iterable):
        raise ConfigError("sensitive-op setter: pass a list of op names or the table QuantAnalysis.sensitivity "
                          f"returns, got {type(table).__name__}")
    names: list[str] = []
    for i, row in enumerate(table):
        if isinstance(row, str):
            name = row
        elif isinstance(row, (list, tuple)) and len(row) >= 2 and isinstance(row[0], str):
            if row[1] != "activation":
                continue
            name = row[0]
        else:
            raise ConfigError(f"sensitive-op setter: entry {i} is {row!r}; expected an op name or a sensitivity row "
                              "[op_name, sensitive_type, op_type, metric, dtype, flops, ...]")
        if name not in names:
            names.append(name)
    return names


class SensitiveOpQConfigSetter(DefaultQConfigSetter):
    """The default template plus int16 activations (weights stay int8) on the most sensitive ops.

    ``table``: op names, most sensitive first, or the rows :meth:`QuantAnalysis.sensitivity` returns
    (activation rows; op names are module paths, or graph-node quantizers such as
    ``add_activation_post_process``, which stand for the module scope of the op they observe).
    ``topk``: at most this many ops; ``ratio``: at most this fraction of the activation rows
    (rounded down, at least one when the fraction is positive); neither: all of them.

    Why: the guide's experience is that the first few ops of the L1 sensitivity ranking carry most of
    the quantization error; int16 on their outputs removes it for the cost of those tensors only.
    An op that is a high-precision output stays int32 (more precise still). An op whose qconfig
    comes from the root scope cannot be raised alone (it would make every op int16): it is skipped
    (with a warning, not counted against the budget) and listed in :attr:`skipped`; a ConfigError
    when no op is left.
    """

    def __init__(self, table: Any, topk: Optional[int] = None, ratio: Optional[float] = None,
                 kind: str = "qat") -> None:
        super().__init__(kind)
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 0):
            raise ConfigError(f"sensitive-op setter: topk must be a non-negative int, got {topk!r}")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                                  or not 0.0 <= ratio <= 1.0):
            raise ConfigError(f"sensitive-op setter: ratio must be a fraction in [0, 1], got {ratio!r}")
        self.names = _op_names_of(table)
        self.topk, self.ratio = topk, ratio
        self.skipped: list[str] = []
        self.chosen: list[str] = []

    def _budget(self) -> int:
        n = len(self.names)
        if self.topk is not None:
            n = min(n, self.topk)
        if self.ratio is not None:
            n = min(n, max(1, math.floor(self.ratio * len(self.names) + 1e-9)) if self.ratio > 0 else 0)
        return n

    def _module_path(self, name: str, graph: fx.GraphModule, paths: set[str], nodes: dict) -> Optional[str]:
        if name in paths:
            return name
        key = name[:-len(_OBSERVER_SUFFIX)] if name.endswith(_OBSERVER_SUFFIX) else name
        node = nodes.get(key)
        if node is None:
            raise ConfigError(f"sensitive-op setter: {name!r} names no module and no op of the model; pass module "
                              "paths or the table QuantAnalysis.sensitivity returned for this model")
        return _path(node) or None

    def qconfig_dict(self, graph: fx.GraphModule) -> dict:
        march = _march(graph)
        if not op_table(march).has_int16:
            raise ConfigError(f"sensitive-op setter: march {march.value!r} has no int16 activations (int8 only); "
                              "use default_qat_qconfig_setter there, or a march with int16 (bayes, nash)")
        result = super().qconfig_dict(graph)
        outputs = {p for p, _ in result.get("module_name", [])}
        paths = {p for p, _ in graph.named_modules() if p}
        nodes = {n.name: n for n in graph.graph.nodes}
        self.skipped, self.chosen = [], []
        budget, taken = self._budget(), 0
        for name in self.names:
            if taken >= budget:
                break
            path = self._module_path(name, graph, paths, nodes)
            if path is None:
                self.skipped.append(name)
                continue
            taken += 1
            if path not in outputs and path not in self.chosen:
                self.chosen.append(path)
        if self.skipped:
            why = (f"{', '.join(self.skipped)} take(s) the qconfig of the root scope, so int16 there would make "
                   "every op int16; put the op in a module of its own, or give the qconfig_dict by hand")
            if not self.chosen and budget:
                raise ConfigError(f"sensitive-op setter: no op left to raise to int16: {why}")
            warnings.warn(f"sensitive-op setter: skipped {why}", QCompilerWarning, stacklevel=3)
        if self.chosen:
            result["module_name"] = list(result.get("module_name", [])) + [(p, self._int("qint16"))
                                                                           for p in self.chosen]
        return result

    def __repr__(self) -> str:
        return (f"sensitive_op_{'qat' if self.kind == 'qat' else 'calibration'}_8bit_weight_16bit_act_qconfig_setter"
                f"({len(self.names)} ops, topk={self.topk}, ratio={self.ratio})")


def sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(
        table: Union[Sequence[str], Sequence[Sequence[Any]]], topk: Optional[int] = None,
        ratio: Optional[float] = None) -> SensitiveOpQConfigSetter:
    """QAT: the default template plus int16 activations on the ``topk`` (or ``ratio``) most sensitive ops
    of ``table`` (op names or ``QuantAnalysis.sensitivity`` rows); see :class:`SensitiveOpQConfigSetter`."""
    return SensitiveOpQConfigSetter(table, topk=topk, ratio=ratio, kind="qat")


def sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(
        table: Union[Sequence[str], Sequence[Sequence[Any]]], topk: Optional[int] = None,
        ratio: Optional[float] = None) -> SensitiveOpQConfigSetter:
    """Calibration twin of :func:`sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter`."""
    return SensitiveOpQConfigSetter(table, topk=topk, ratio=ratio, kind="calibration")


def setter_kind(setter: Callable, qconfig_dict: Any) -> str:
    """"qat" or "calibration": the setter's ``kind``, else the kind of the qconfigs its dict holds."""
    kind = getattr(setter, "kind", None)
    if kind in KINDS:
        return kind
    if isinstance(qconfig_dict, dict):
        found = [qconfig_dict.get("")] + [qc for key in ("module_type", "module_name")
                                          for _, qc in qconfig_dict.get(key, [])]
        kinds = {qc.kind for qc in found if isinstance(qc, QConfig)}
        if len(kinds) > 1:
            raise ConfigError("qconfig setter: its qconfig_dict mixes calibration and QAT qconfigs; use one kind")
        if kinds:
            return kinds.pop()
    return "qat"
