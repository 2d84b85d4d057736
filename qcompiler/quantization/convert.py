"""convert_fx: a prepared (calibrated / trained) model to its fixed-point version.

The converted model evaluates the BPU numerics (integers, QTensors) for BPU
partitions and float for CPU partitions: it is for measuring accuracy.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch.fx as fx

from qcompiler.errors import ConfigError
from qcompiler.passes.base import CompileContext, PassManager
from qcompiler.passes.convert import CONVERT
from qcompiler.quantization.prepare import GM_KIND
from qcompiler.quantization.sync import sync_observers

CONVERT_CUSTOM_KEYS = ("preserved_attributes",)


def convert_fx(graph_module: fx.GraphModule, convert_custom_config_dict: Optional[dict] = None,
               *, inplace: bool = False) -> fx.GraphModule:
    """Fixed-point model from a ``prepare_calibration_fx`` / ``prepare_qat_fx`` model.

    Raises CalibrationError naming the observers that never ran. The prepared
    model is not modified unless ``inplace=True``. Under ``torch.distributed``
    the observers are first reduced over all ranks (:func:`qcompiler.distributed.sync_observers`),
    so every rank converts the model one process would get from all shards.
    """
    if not isinstance(graph_module, fx.GraphModule) or graph_module.meta.get(GM_KIND) not in ("calibration", "qat"):
        raise ConfigError(
            "convert_fx takes the model returned by prepare_calibration_fx or prepare_qat_fx "
            f"(after calibration or training), got {type(graph_module).__name__}"
        )
    config = dict(convert_custom_config_dict or {})
    for key in config:
        if key not in CONVERT_CUSTOM_KEYS:
            raise ConfigError(f"convert_custom_config_dict: unknown key {key!r}; allowed keys: "
                              + ", ".join(CONVERT_CUSTOM_KEYS))
    gm = graph_module if inplace else copy.deepcopy(graph_module)
    type(gm).__name__ = type(graph_module).__name__
    sync_observers(gm)
    ctx = CompileContext(march=graph_module.meta.get("qc_march"))
    gm = PassManager([CONVERT]).run(gm, ctx).gm
    for attr in config.get("preserved_attributes", []):
        setattr(gm, attr, getattr(graph_module, attr))
    gm.meta[GM_KIND] = "quantized"
    gm.eval()
    return gm
