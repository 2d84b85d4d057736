"""convert_fx: a prepared (calibrated / trained) model to its fixed-point version.

The converted model evaluates the BPU numerics (integers, QTensors) for BPU
partitions and float for CPU partitions: it is for measuring accuracy.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch.fx as fx

from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.ir.inplace import mutated_input
from qcompiler.ir.meta import GM_KIND, GM_MARCH, META_ALIASED_WRITE, META_FUSED_FROM, META_PARTITION
from qcompiler.passes.base import CompileContext, PassManager
from qcompiler.passes.convert import CONVERT
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
    ctx = CompileContext(march=graph_module.meta.get(GM_MARCH))
    _warn_split_aliases(gm)  # before convert, which drops an in-place op whose result nobody reads
    gm = PassManager([CONVERT]).run(gm, ctx).gm
    for attr in config.get("preserved_attributes", []):
        setattr(gm, attr, getattr(graph_module, attr))
    gm.meta[GM_KIND] = "quantized"
    gm.eval()
    return gm


def _warn_split_aliases(gm: fx.GraphModule) -> None:
    """Warn for each in-place op left in place for an alias (passes/out_of_place.py) where the written value
    or an alias lives in another partition than the op: the stubs give each consumer its own dequantized
    tensor, so the alias misses the write, which only the calibration model (one graph, run in place) makes."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in gm.graph.nodes:  # a node fusion folded away (a BN into its conv) is now the fused node
        for name in n.meta.get(META_FUSED_FROM) or ():
            by_name.setdefault(name, n)
    for node in gm.graph.nodes:
        aliases = node.meta.get(META_ALIASED_WRITE)
        value = mutated_input(node, gm) if aliases is not None else None
        if value is None:
            continue
        group = [value, *(by_name[a] for a in aliases if a in by_name)]  # one gone altogether reads nothing
        apart = [m.name for m in group if m.meta.get(META_PARTITION) != node.meta.get(META_PARTITION)]
        if not apart:
            continue
        warnings.warn(
            f"convert_fx: '{node.name}' writes in place into the value of '{value.name}', and an alias of it (a "
            f"view, or an op returning its input{': ' + ', '.join(aliases) if aliases else ''}) is read after "
            f"the write; {', '.join(repr(a) for a in apart)} {'is' if len(apart) == 1 else 'are'} in another "
            f"partition, which gets a copy of its own through a stub, so the write does not reach it there and "
            f"the converted model differs from float. Keep the alias and the write on one side (hybrid_dict) or "
            f"write out of place (y = y * 2 for y.mul_(2)).", QCompilerWarning, stacklevel=3)
