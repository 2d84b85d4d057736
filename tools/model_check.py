"""``check_qat_model``, under the path of the accuracy-debugging guide.

The implementation is :mod:`qcompiler.quantization.model_check`: ``prepare_calibration_fx`` and
``prepare_qat_fx`` run its static part and warn, so it sits in the workflow layer below the
tools (docs/design.md, "Layers").
"""

from qcompiler.quantization.model_check import RESULT_FILE, Anomaly, ModelCheckResult, check_qat_model

__all__ = ["ModelCheckResult", "Anomaly", "check_qat_model", "RESULT_FILE"]
