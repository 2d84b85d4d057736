"""PT2E interop: qcompiler's quantizer for torchao's ``prepare_pt2e``, and compiling its Q/DQ graphs.

* :class:`BPUQuantizer` annotates a ``torch.export`` graph for a march (the march's op table says
  which ops run on the BPU), so ``torchao.quantization.pt2e.prepare_pt2e`` / ``prepare_qat_pt2e``
  insert observers where qcompiler's numerics contract has quantizers: symmetric int8/int16
  activations with zero point 0, per-channel int8 weights.
* ``qcompiler.compile(convert_pt2e(...), example_inputs)`` lowers the Q/DQ graph with its scales
  (:mod:`qcompiler.pt2e.qdq`).

torchao is an optional dependency (``pip install qcompiler[pt2e]``); importing the quantizer
without it raises a ConfigError saying so. The Q/DQ import needs no torchao import of its own.
See docs/pt2e.md.
"""

from __future__ import annotations

from qcompiler.errors import ConfigError
from qcompiler.pt2e.qdq import compile_ready, import_scales, is_qdq_graph, strip_qdq

INSTALL_HINT = "pip install qcompiler[pt2e]"


def require_torchao():
    """torchao's PT2E quantizer module, or a ConfigError naming the install command."""
    try:
        import torchao.quantization.pt2e.quantizer as quantizer
    except ImportError as exc:
        raise ConfigError(
            f"qcompiler.pt2e needs torchao (PyTorch's PT2E quantization: prepare_pt2e / convert_pt2e), "
            f"which is not installed ({exc}); install it with `{INSTALL_HINT}`") from None
    return quantizer


def __getattr__(name: str):
    """``BPUQuantizer`` and its config helpers import torchao on first use (a clear error without it)."""
    if name in ("BPUQuantizer", "BPUQuantizationConfig", "get_bpu_quantization_config"):
        require_torchao()
        from qcompiler.pt2e import quantizer

        return getattr(quantizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BPUQuantizer", "BPUQuantizationConfig", "get_bpu_quantization_config", "is_qdq_graph",
           "strip_qdq", "import_scales", "compile_ready", "require_torchao", "INSTALL_HINT"]
