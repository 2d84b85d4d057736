"""ONNX-rule coverage: every op a march runs on the BPU can also be emitted as ONNX, and every
fixed-point module convert makes has an export rule; the check fails when a rule goes missing.

The float rule is what runs the op on the CPU (a ``hybrid_dict`` entry or a failed constraint sends
any BPU op to an onnxruntime island); the module rule is what the integer export writes for it.
The convert, lowering and reference-kernel halves of the same check are test_convert_coverage.py
and test_lower_coverage.py.
"""

from __future__ import annotations

import inspect

import pytest

import qcompiler.backends.onnx.rules  # noqa: F401  (registers the rules)
from qcompiler.backends.bpu import TABLES
from qcompiler.backends.onnx import registry
from qcompiler.march import March
from qcompiler.nn import quantized as qnn


def fixed_point_modules() -> list[type]:
    """The concrete modules of a converted model (every QuantizedModule subclass but the base)."""
    return [cls for _, cls in inspect.getmembers(qnn, inspect.isclass)
            if issubclass(cls, qnn.QuantizedModule) and cls is not qnn.QuantizedModule]


def coverage_gaps(march: March) -> list[str]:
    """The march's BPU ops with no float ONNX rule, and the fixed-point modules with no export rule."""
    gaps = [f"{op}: no ONNX rule" for op in sorted(TABLES[march].rules) if registry.op_rule(op) is None]
    return gaps + [f"{cls.__name__}: no ONNX module rule" for cls in fixed_point_modules()
                   if registry.module_rule(cls) is None]


@pytest.mark.parametrize("march", list(TABLES), ids=lambda m: m.value)
def test_every_bpu_op_and_fixed_point_module_has_an_onnx_rule(march):
    assert coverage_gaps(march) == []


def test_the_module_list_is_the_converted_model_s():
    names = {cls.__name__ for cls in fixed_point_modules()}
    assert {"Quantize", "DeQuantize", "QuantizedWeightLayer", "QuantizedCat", "QuantizedLookup"} <= names
    assert "QuantizedModule" not in names


@pytest.mark.parametrize("march", list(TABLES), ids=lambda m: m.value)
def test_the_check_fails_when_an_op_rule_is_missing(march, monkeypatch):
    monkeypatch.delitem(registry._OP_RULES, "avg_pool2d")  # restored after the test
    assert coverage_gaps(march) == ["avg_pool2d: no ONNX rule"]


def test_the_check_fails_when_a_module_rule_is_missing(monkeypatch):
    monkeypatch.delitem(registry._MODULE_RULES, qnn.QuantizedCat)
    assert coverage_gaps(March.BAYES) == ["QuantizedCat: no ONNX module rule"]
