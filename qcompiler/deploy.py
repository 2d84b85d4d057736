"""``qcompiler.export(model, example_inputs)``: the deployable model of a QAT or calibration model.

The accuracy-debugging guide exports its QAT model to the deployable graph and compares the two.
Here the deployable graph is what :func:`qcompiler.compile` makes: the converted fixed-point graph
lowered to BPU programs and CPU islands, as a :class:`~qcompiler.CompiledModel`. A QAT model is
compiled as ``compile(model, example_inputs, mode="qat")`` does; a calibrated calibration model
is converted at the scales it observed (no new calibration). The model given is not modified.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.fx as fx

from qcompiler.batches import require_dense
from qcompiler.compiled import CompiledModel, compile, lower
from qcompiler.errors import ConfigError
from qcompiler.ir.meta import GM_KIND, GM_MARCH
from qcompiler.ir.shape_prop import normalize_inputs
from qcompiler.quantization.convert import convert_fx

__all__ = ["export"]


def export(model: fx.GraphModule, example_inputs: Any, *, ort_threads: int = 1) -> CompiledModel:
    """The deployable model of ``model`` (a ``prepare_qat_fx`` / ``prepare`` model, or a calibrated
    ``prepare_calibration_fx`` one); ``example_inputs`` as the model is called (a tensor or a tuple).

    QAT: exactly ``compile(model, example_inputs, mode="qat")``. Calibration: ``convert_fx`` of a
    copy, lowered like compile's (an observer that never ran is convert_fx's CalibrationError)."""
    kind = model.meta.get(GM_KIND) if isinstance(model, fx.GraphModule) else None
    if kind == "qat":
        return compile(model, example_inputs, mode="qat", ort_threads=ort_threads)
    if kind != "calibration":
        raise ConfigError(f"export takes a model from prepare / prepare_qat_fx / prepare_calibration_fx, got "
                          f"{type(model).__name__}; for a float model use qcompiler.compile(model, example_inputs)")
    inputs = normalize_inputs(example_inputs)
    require_dense(inputs, where="example_inputs")
    work = copy.deepcopy(model).eval()
    type(work).__name__ = type(model).__name__  # deepcopy renames the per-instance class
    converted = convert_fx(work, inplace=True)
    runtime = lower(converted, ort_threads=ort_threads, example_inputs=inputs)
    march = converted.meta.get(GM_MARCH)
    return CompiledModel(runtime, name=type(model).__name__, march=getattr(march, "value", str(march)),
                         converted=converted, example_inputs=inputs)
