"""``prepare(model, example_inputs, qconfig_setter)``: the accuracy-debugging guide's one-call prepare.

One call does what the staged API does in steps: trace, place and fuse the float model
(:func:`qcompiler.partition`), let the qconfig setter (:mod:`.qconfig_template`) choose the
qconfig_dict from that graph, prepare with it (:func:`prepare_qat_fx` for a QAT setter,
:func:`prepare_calibration_fx` for a calibration one) and run the model check
(:func:`check_qat_model`), printing what it finds. The result is the model the staged API gives
for the same qconfig_dict; ``check_qat_model`` stays callable on its own.

``qcompiler.quantization.prepare`` is also the module of the staged API
(``from qcompiler.quantization.prepare import prepare_qat_fx``); that module is callable, and
calling it calls :func:`prepare` here (``prepare._CallableModule``).
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Callable, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.frontend import partition
from qcompiler.ir.meta import GM_MARCH
from qcompiler.quantization.model_check import ModelCheckResult, check_qat_model
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.quantization.qconfig_template import default_qat_qconfig_setter, setter_kind

__all__ = ["prepare", "MODEL_CHECK"]

MODEL_CHECK = "model_check"  # gm.meta key: the ModelCheckResult prepare printed


def _qconfig_dict(setter: Callable, graph: fx.GraphModule) -> dict:
    if isinstance(setter, dict):
        raise ConfigError("prepare: qconfig_setter is a setter (a template from qcompiler.quantization."
                          "qconfig_template, or a function graph -> qconfig_dict), not a qconfig_dict; for a "
                          "dict use prepare_qat_fx(model, qconfig_dict, example_inputs=...)")
    if not callable(setter):
        raise ConfigError(f"prepare: qconfig_setter must be callable (graph -> qconfig_dict), got "
                          f"{type(setter).__name__}")
    result = setter(graph)
    if not isinstance(result, dict):
        raise ConfigError(f"prepare: the qconfig setter {setter!r} returned {type(result).__name__}, not a "
                          "qconfig_dict")
    return result


def prepare(model: nn.Module, example_inputs: Any, qconfig_setter: Callable = default_qat_qconfig_setter,
            march=None, hybrid_dict: Optional[dict] = None, *, check: bool = True,
            verbose: bool = True) -> fx.GraphModule:
    """A QAT-ready (or, with a calibration setter, calibration) model of ``model`` in one call.

    ``qconfig_setter``: ``graph -> qconfig_dict`` (:mod:`qcompiler.quantization.qconfig_template`);
    its ``kind`` ("qat" / "calibration") chooses the staged call, and a plain function's kind is
    the kind of the qconfigs it returns. ``march``: as everywhere (None: :func:`qcompiler.get_march`).
    ``hybrid_dict``: ops forced to the CPU; ops the march cannot run go there anyway (the model is
    prepared as a hybrid one). The model check runs on the result (``check=False`` skips it) and
    prints its findings (``verbose=False``: only anomalies); its result is kept in
    ``gm.meta["model_check"]``. ``model`` is not modified.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"prepare: model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise ConfigError("prepare: example_inputs is required to trace the model (pass the tensor or tuple of "
                          "tensors the model is called with)")
    graph = partition(model, example_inputs, march=march, hybrid_dict=hybrid_dict)
    qconfig_dict = _qconfig_dict(qconfig_setter, graph)
    kind = setter_kind(qconfig_setter, qconfig_dict)
    stage = prepare_qat_fx if kind == "qat" else prepare_calibration_fx
    with warnings.catch_warnings():
        # the staged call's one-line model-check warning: the full check runs (and prints) below
        warnings.filterwarnings("ignore", message="model check:", category=QCompilerWarning)
        gm = stage(model, qconfig_dict, hybrid=True, hybrid_dict=hybrid_dict, example_inputs=example_inputs,
                   march=graph.meta[GM_MARCH])
    if check:
        result: ModelCheckResult = check_qat_model(gm, example_inputs, verbose=verbose)
        gm.meta[MODEL_CHECK] = result
    return gm


