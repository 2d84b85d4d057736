"""The staged API of the hybrid (BPU + CPU) flow: prepare for calibration or QAT.

``prepare_calibration_fx`` and ``prepare_qat_fx`` take the signature of the
hybrid-QAT guide plus ``example_inputs`` (for tracing and shapes) and
``march``. Both run the front end (trace, place, fuse, boundary stubs) and
attach observers (calibration) or fake quants (QAT) by qconfig. Given a
calibration model, ``prepare_qat_fx`` reuses its graph and starts every fake
quant from the calibrated range. The user's model is never modified unless
``inplace=True``.
"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.frontend import build_graph
from qcompiler.hybrid import parse_hybrid_dict
from qcompiler.ir.meta import CPU, GM_HYBRID, GM_KIND, GM_MARCH, GM_QCONFIG_DICT, META_OP, META_REASON, placement
from qcompiler.march import resolve_march
from qcompiler.passes.base import CompileContext, CompileOptions, PassManager
from qcompiler.passes.pipeline import PREPARE_PIPELINE, REQUANTIZE_PIPELINE
from qcompiler.quantization.fake_quantize import CalibFakeQuantize, FakeQuantize, assign_qc_names
from qcompiler.quantization.model_check import check_qat_model
from qcompiler.quantization.qconfig import (
    QConfig,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    parse_qconfig_dict,
)
from qcompiler.quantization.sync import sync_observers

_NOOP_OPS = ("quant", "dequant", "identity", "dropout")


def _resolver(qconfig_dict: Optional[dict], model: nn.Module, kind: str):
    if qconfig_dict is None:
        qconfig_dict = {"": get_default_calib_qconfig() if kind == "calibration" else get_default_qat_qconfig()}
    return parse_qconfig_dict(qconfig_dict, model, kind)


def _warn_translated(resolver, march) -> None:
    """One warning listing every torch.ao qconfig translated to the march's scheme, and how."""
    notes = resolver.translated
    if notes:
        listed = "\n".join(f"  {where}: {what}" for where, what in sorted(notes.items()))
        warnings.warn(f"torch.ao QConfigs translated to the {resolve_march(march).value} scheme "
                      f"(symmetric, zero point 0):\n{listed}", QCompilerWarning, stacklevel=4)


def _check_hybrid_flag(hybrid: bool, hybrid_dict: Optional[dict]) -> None:
    if not isinstance(hybrid, bool):
        raise ConfigError(f"hybrid must be True or False, got {hybrid!r}")
    if hybrid_dict and not hybrid:
        raise ConfigError("hybrid_dict forces ops to the CPU, which needs hybrid=True")


def _warn_cpu_ops_without_hybrid(gm: fx.GraphModule, hybrid: bool) -> None:
    if hybrid:
        return
    cpu = [n for n in gm.graph.nodes if placement(n) == CPU and n.meta.get(META_OP) not in _NOOP_OPS]
    if cpu:
        listed = "; ".join(f"{n.name}: {n.meta.get(META_REASON)}" for n in cpu[:5])
        more = f" and {len(cpu) - 5} more" if len(cpu) > 5 else ""
        warnings.warn(
            f"the model has ops that run on the CPU ({listed}{more}); they are prepared as a hybrid "
            f"model. Pass hybrid=True to say so and silence this warning.",
            QCompilerWarning,
            stacklevel=3,
        )


def _prepare(kind, model, qconfig_dict, prepare_custom_config_dict, optimize_graph, hybrid, hybrid_dict,
             example_inputs, march, inplace) -> fx.GraphModule:
    _check_hybrid_flag(hybrid, hybrid_dict)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise ConfigError(
            "example_inputs is required to trace the model and propagate shapes: "
            "pass example_inputs=(tensor, ...) with the shapes the model is called with"
        )
    resolver = _resolver(qconfig_dict, model, kind)
    gm = build_graph(
        model,
        example_inputs,
        march=march,
        hybrid_dict=hybrid_dict,
        prepare_custom_config_dict=prepare_custom_config_dict,
        passes=PREPARE_PIPELINE,
        options={"qconfig_resolver": resolver, "optimize_graph": optimize_graph},
        inplace=inplace,
    )
    _warn_translated(resolver, march)
    gm.meta[GM_KIND] = kind
    gm.meta[GM_HYBRID] = parse_hybrid_dict(hybrid_dict, model)
    gm.meta[GM_QCONFIG_DICT] = qconfig_dict  # as given (None: the default); auto_int16 builds on it
    assign_qc_names(gm, overwrite=True)  # errors name the observer by its path
    _warn_cpu_ops_without_hybrid(gm, hybrid)
    _warn_model_check(gm)
    return gm


# Anomalies the full report lists but prepare does not warn about: an int8/int16 boundary follows
# from asking for int16 somewhere (by hand or through auto_int16), never from a mistake alone.
QUIET_AT_PREPARE = frozenset({"mixed_dtype"})


def _warn_model_check(gm: fx.GraphModule) -> None:
    """Run check_qat_model on the graph (no forward, nothing printed) and warn about what it finds
    beyond :data:`QUIET_AT_PREPARE`."""
    result = check_qat_model(gm, None, run_forward=False, verbose=False, printed=False)
    result.abnormal = [a for a in result.abnormal if a.kind not in QUIET_AT_PREPARE]
    if result.has_anomalies:
        warnings.warn(f"model check: {result.summary()}. Run qcompiler.tools.model_check.check_qat_model("
                      f"model, example_inputs, save_results=True) for the full report.",
                      QCompilerWarning, stacklevel=3)


def prepare_calibration_fx(
    model: nn.Module,
    qconfig_dict: Optional[dict] = None,
    prepare_custom_config_dict: Optional[dict] = None,
    optimize_graph: bool = False,
    hybrid: bool = False,
    hybrid_dict: Optional[dict] = None,
    *,
    example_inputs: Any = None,
    march=None,
    inplace: bool = False,
) -> fx.GraphModule:
    """A calibration model: observers record ranges; outputs equal the float model's exactly.

    Run it in eval mode over calibration data, then ``prepare_qat_fx`` or ``convert_fx``.
    ``qconfig_dict`` defaults to ``{"": get_default_calib_qconfig()}``.
    """
    return _prepare("calibration", model, qconfig_dict, prepare_custom_config_dict, optimize_graph,
                    hybrid, hybrid_dict, example_inputs, march, inplace)


def prepare_qat_fx(
    model: nn.Module,
    qconfig_dict: Optional[dict] = None,
    prepare_custom_config_dict: Optional[dict] = None,
    optimize_graph: bool = False,
    hybrid: bool = False,
    hybrid_dict: Optional[dict] = None,
    *,
    example_inputs: Any = None,
    march=None,
    inplace: bool = False,
) -> fx.GraphModule:
    """A QAT model: fake quants with straight-through gradients, ready for training.

    ``model`` is a float model (``example_inputs`` required) or a model from
    ``prepare_calibration_fx``, whose graph is reused and whose calibrated
    ranges start every fake quant at the same place (under ``torch.distributed``,
    the ranges reduced over all ranks). ``qconfig_dict``
    defaults to ``{"": get_default_qat_qconfig()}``.
    """
    if isinstance(model, fx.GraphModule) and model.meta.get(GM_KIND) == "calibration":
        return _from_calibration(model, qconfig_dict, optimize_graph, hybrid, hybrid_dict, march, inplace)
    return _prepare("qat", model, qconfig_dict, prepare_custom_config_dict, optimize_graph,
                    hybrid, hybrid_dict, example_inputs, march, inplace)


def _from_calibration(calib: fx.GraphModule, qconfig_dict, optimize_graph, hybrid, hybrid_dict, march, inplace):
    _check_hybrid_flag(hybrid, hybrid_dict)
    placed_with = calib.meta.get(GM_HYBRID)
    diffs = placed_with.differences(parse_hybrid_dict(hybrid_dict, None))
    if diffs:
        raise ConfigError(
            f"hybrid_dict differs from the one the calibration model was prepared with "
            f"({'; '.join(diffs)}); pass the same hybrid_dict, or prepare the float model again"
        )
    calib_march = calib.meta.get(GM_MARCH)
    if march is not None and resolve_march(march) != calib_march:
        raise ConfigError(
            f"march {resolve_march(march).value!r} differs from the calibration model's {calib_march.value!r}"
        )
    gm = calib if inplace else copy.deepcopy(calib)
    type(gm).__name__ = type(calib).__name__  # deepcopy renames the per-instance class
    sync_observers(gm)  # every rank starts QAT from the ranges of all ranks' calibration data
    calibrated = {
        path: m.calculate_qparams()[0]
        for path, m in gm.named_modules()
        if isinstance(m, CalibFakeQuantize) and m.has_observed
    }
    resolver = _resolver(qconfig_dict, gm, "qat")
    ctx = CompileContext(
        march=calib_march,
        hybrid_dict=placed_with,
        options=CompileOptions(qconfig_resolver=resolver, optimize_graph=optimize_graph),
    )
    gm = PassManager(REQUANTIZE_PIPELINE).run(gm, ctx).gm
    _warn_translated(resolver, calib_march)
    for path, m in gm.named_modules():
        if isinstance(m, FakeQuantize) and path in calibrated:
            m.set_qparams(calibrated[path])
            m.enable_observer()
    gm.meta[GM_KIND] = "qat"
    assign_qc_names(gm, overwrite=True)
    return gm


class _CallableModule(types.ModuleType):
    """This module both as the staged API (``prepare_qat_fx`` ...) and as the accuracy guide's one-call
    ``prepare(model, example_inputs, qconfig_setter)`` (:mod:`.prepare_one_call`, which builds on the
    staged calls above and so is imported when first called)."""

    def __call__(self, *args: Any, **kwargs: Any) -> fx.GraphModule:
        from qcompiler.quantization.prepare_one_call import prepare

        return prepare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["prepare_calibration_fx", "prepare_qat_fx", "QConfig"]
