"""One-step root cause: for the worst layers, measure concrete fixes on a fake-quant model.

Used by :meth:`qcompiler.tools.quant_analysis.QuantAnalysis.advise`. For one layer (its activation
quantizer, its weight quantizer, the module path a qconfig_dict / hybrid_dict entry names) each fix
is applied alone to a copy of the fake-quant model with every other quantizer as it is, and the
output SQNR against the baseline is measured on the bad case:

* ``int16``: the layer's output at int16, over the range its observer recorded (256x finer steps);
* ``cpu``: the op runs on the CPU through ``hybrid_dict``: float weights and a float output; when its
  output feeds the BPU again, a boundary observer quantizes it (int8 at the recorded range);
* ``observer``: a re-calibrated int8 scale from ``minmax``, ``percentile`` or ``histogram-mse``
  (clipping) fitted on the tensor's values on the bad case; the best of the three is reported.

The gains are measured, not predicted, but on the bad case only: they tell which fix addresses the
layer, and by roughly how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.ir.meta import BPU, META_OP, META_STUB, placement
from qcompiler.quantization.fake_quantize import FakeQuantize
from qcompiler.quantization.observer import make_observer

__all__ = ["Fix", "layer_fixes", "CLIPPING_OBSERVERS", "MIN_FIX_GAIN", "fixes_json"]

CLIPPING_OBSERVERS = ("minmax", "percentile", "histogram-mse")
MIN_FIX_GAIN = 0.1  # dB on the bad case: below it a fix is noise, not a change worth a config entry


@dataclass(frozen=True)
class Fix:
    """One measured fix: ``kind`` (int16 / cpu / observer), the module path it configures, the observer
    (kind observer), the output SQNR with it and its gain over the model as it is (dB)."""

    kind: str
    target: str
    sqnr: float
    gain: float
    observer: str = ""

    def describe(self) -> str:
        what = {"int16": f"int16 for {self.target!r}",
                "cpu": f"{self.target!r} to the CPU (hybrid_dict module_name)",
                "observer": f"{self.observer} observer for {self.target!r}"}[self.kind]
        return f"{what}: {self.gain:+.2f} dB"


def _feeds_bpu(gm: fx.GraphModule, quantizer: str) -> bool:
    """Does the value this activation quantizer sets reach a BPU op (so a CPU version of its op would be
    re-quantized at a boundary)?"""
    layer = quantizer.rpartition(".")[0] if quantizer.endswith(".activation_post_process") else None
    for node in gm.graph.nodes:
        if node.op != "call_module" or str(node.target) not in (quantizer, layer):
            continue
        return any(placement(u) == BPU and u.meta.get(META_OP) != "dequant" and u.meta.get(META_STUB) is None
                   for u in node.users)
    return False


def _tensor_values(model: nn.Module, fq: FakeQuantize, run: Callable[[nn.Module], float]) -> torch.Tensor:
    """The values ``fq`` quantizes on the bad case (one run, its SQNR unused)."""
    seen: list[torch.Tensor] = []
    hook = fq.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach().to(torch.float32, copy=True)))
    try:
        run(model)
    finally:
        hook.remove()
    return torch.cat([v.reshape(-1) for v in seen]) if seen else torch.zeros(0)


def layer_fixes(model: nn.Module, quantizer: Optional[str], weight: Optional[str], target: str,
                run: Callable[[nn.Module], float], base_sqnr: float, gm: fx.GraphModule,
                cpu: bool = True) -> list[Fix]:
    """Measure each fix of one layer on ``model`` (restored after each); best first.

    ``quantizer``/``weight``: paths of the layer's activation / weight fake quants (None if it has
    none); ``target``: the module path a config entry names ("" when none can: no int16/observer
    /cpu entry is proposed then); ``run(model) -> output SQNR`` on the bad case; ``cpu=False``: no CPU fix
    (a QuantStub: the input is quantized wherever it enters the BPU)."""
    fixes: list[Fix] = []
    if not target:
        return fixes
    fq = model.get_submodule(quantizer) if quantizer else None
    wq = model.get_submodule(weight) if weight else None
    if isinstance(fq, FakeQuantize):
        saved = (fq.scale.clone(), fq.activation_post_process.dtype, bool(fq.fake_quant_enabled[0]))
        obs = fq.activation_post_process
        amax = float(obs.calculate_amax().max()) if obs.has_observed else float(fq.scale.max()) * fq.quant_max

        def restore() -> None:
            obs.set_dtype(saved[1])
            fq.scale.copy_(saved[0])
            fq.enable_fake_quant(saved[2])

        def with_scale(dtype: str, scale: float) -> float:
            obs.set_dtype(dtype)
            fq.scale.fill_(scale)
            try:
                return run(model)
            finally:
                restore()

        s = with_scale("qint16", amax / 32767)
        fixes.append(Fix("int16", target, s, s - base_sqnr))
        values = _tensor_values(model, fq, run)
        best: Optional[Fix] = None
        for name in CLIPPING_OBSERVERS:
            o = make_observer(name, saved[1])
            if values.numel():
                o(values)
            if not o.has_observed:
                continue
            s = with_scale(saved[1], float(o.calculate_qparams()[0].max()))
            if best is None or s > best.sqnr:
                best = Fix("observer", target, s, s - base_sqnr, observer=name)
        if best is not None:
            fixes.append(best)
    if not cpu:
        fixes.sort(key=lambda f: (-(f.gain if not math.isnan(f.gain) else -math.inf), f.kind))
        return fixes
    # cpu: float weights; a float output unless it goes back to the BPU (then int8 at the recorded range)
    w_on = bool(wq.fake_quant_enabled[0]) if isinstance(wq, FakeQuantize) else None
    if isinstance(wq, FakeQuantize):
        wq.disable_fake_quant()
    try:
        if isinstance(fq, FakeQuantize):
            if _feeds_bpu(gm, quantizer):
                s = with_scale(saved[1], amax / fq.quant_max)
            else:
                fq.disable_fake_quant()
                try:
                    s = run(model)
                finally:
                    restore()
        else:
            s = run(model)
    finally:
        if w_on is not None:
            wq.enable_fake_quant(w_on)
    fixes.append(Fix("cpu", target, s, s - base_sqnr))
    fixes.sort(key=lambda f: (-(f.gain if not math.isnan(f.gain) else -math.inf), f.kind))
    return fixes


def fixes_json(advice: list[dict]) -> dict:
    """The best fix gaining at least ``MIN_FIX_GAIN`` of each advised layer as a config file (``--apply FILE``):
    ``{"qconfig": {"module_name": {path: {"dtype": ..., "observer": ...}}}, "hybrid": {"module_name": [...]}}``,
    which ``qcompiler compile --qconfig FILE --hybrid FILE`` reads."""
    qconfig: dict[str, dict] = {}
    cpu: list[str] = []
    for row in advice:
        best = row.get("best")
        if best is None or not best.gain >= MIN_FIX_GAIN:
            continue
        if best.kind == "cpu":
            if best.target not in cpu:
                cpu.append(best.target)
        elif best.kind == "int16":
            qconfig.setdefault(best.target, {})["dtype"] = "qint16"
        else:
            qconfig.setdefault(best.target, {})["observer"] = best.observer
    return {"qconfig": {"module_name": qconfig}, "hybrid": {"module_name": cpu}}
