"""``BPUQuantizer``: a torchao PT2E ``Quantizer`` that annotates by a march's op table.

``prepare_pt2e(exported, BPUQuantizer("bayes"))`` puts observers where qcompiler's numerics contract
(docs/design.md, "BPU numerics") has quantizers, so ``convert_pt2e`` gives a Q/DQ graph that
``qcompiler.compile`` takes with its scales:

* activations: symmetric per tensor, zero point 0, int8 ``[-128, 127]`` or int16 (the config's);
* weights of conv / linear / conv-transpose: int8 symmetric per output channel; bias stays float
  (qcompiler's convert makes it int32 at ``s_in * s_w``);
* conv / linear / add followed by relu or relu6: one quantizer after the activation (the fusion
  qcompiler's ``fuse`` pass makes);
* cat: its inputs and output share one scale; the ops that keep their input's grid
  (``SCALE_PRESERVING_OPS``: max pool, reshape, ...) share their input's;
* sigmoid and tanh: a fixed output scale (``1/128`` in int8, ``1/32768`` in int16);
* an op the march's table (qcompiler.backends.bpu) does not list stays float: it runs on the CPU.

``set_global`` / ``set_module_type`` / ``set_module_name`` choose a :class:`BPUQuantizationConfig` per
module (module name over module type over global, as torch's NPU quantizers do); ``None`` keeps the
module's ops float.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torchao.quantization.pt2e import observer as ao_observer
from torchao.quantization.pt2e.fake_quantize import FakeQuantize as AoFakeQuantize
from torchao.quantization.pt2e.quantizer import (
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

from qcompiler.backends.bpu import op_table
from qcompiler.errors import ConfigError
from qcompiler.ir.ops.registry import definition
from qcompiler.march import MarchLike, to_march
from qcompiler.passes.insert_observers import SCALE_PRESERVING_OPS
from qcompiler.quantization.fixed_point import qrange
from qcompiler.quantization.observer import make_observer

ANNOTATION_KEY = "quantization_annotation"  # the node.meta key torchao's prepare reads
_TORCH_DTYPES = {"qint8": torch.int8, "qint16": torch.int16}
_WEIGHT_OPS = {"conv2d": 0, "linear": 0, "conv_transpose2d": 1}  # op -> the weight's output-channel axis
_FUSED_ACTIVATIONS = frozenset({"relu", "relu6"})
_FUSING_PRODUCERS = frozenset({"conv2d", "linear", "conv_transpose2d", "add"})
_FIXED_SCALE_OPS = frozenset({"sigmoid", "tanh"})  # outputs in [-1, 1]: scale 2^-(bits-1)
_SKIPPED = frozenset({"getitem", "size"})


@dataclass(frozen=True)
class BPUQuantizationConfig:
    """How a module's BPU ops are quantized: ``activation`` "qint8" | "qint16" (weights are int8, the
    contract's only weight type); ``is_qat`` gives fake quantizers (for ``prepare_qat_pt2e``);
    ``observer`` "histogram" (PTQ default) | "minmax"."""

    activation: str = "qint8"
    is_qat: bool = False
    observer: str = "histogram"

    def __post_init__(self) -> None:
        if self.activation not in _TORCH_DTYPES:
            raise ConfigError(f"BPUQuantizationConfig: activation must be 'qint8' or 'qint16', got "
                              f"{self.activation!r} (BPU activations are symmetric int8/int16, zero point 0)")
        if self.observer not in ("histogram", "minmax"):
            raise ConfigError(f"BPUQuantizationConfig: observer must be 'histogram' or 'minmax', got {self.observer!r}")


def get_bpu_quantization_config(activation: str = "qint8", *, is_qat: bool = False,
                                observer: str = "histogram") -> BPUQuantizationConfig:
    """The config for :meth:`BPUQuantizer.set_global` and the per-module setters."""
    return BPUQuantizationConfig(activation, is_qat, observer)


class QcHistogramObserver(ao_observer.ObserverBase):
    """torchao observer that runs qcompiler's own PTQ calibration (``histogram-mse``, the default of
    :func:`~qcompiler.quantization.get_default_calib_qconfig`): the PT2E flow gets the scale ``compile()`` would
    pick, not torchao's HistogramObserver's (its MSE search lands elsewhere: 0.65 dB below ours on resnet18 at
    64x64). Symmetric, zero point 0, as the contract says."""

    def __init__(self, dtype: torch.dtype = torch.int8, qscheme: Any = torch.per_tensor_symmetric,
                 quant_min: Optional[int] = None, quant_max: Optional[int] = None, is_dynamic: bool = False,
                 **_: Any) -> None:
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        self.qscheme, self.quant_min, self.quant_max = qscheme, quant_min, quant_max
        self.inner = make_observer("histogram-mse", "qint16" if dtype == torch.int16 else "qint8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.numel():
            self.inner(x.detach().float())
        return x

    @torch.jit.export
    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale, _ = self.inner.calculate_qparams()
        scale = scale.reshape(-1)[:1].to(torch.float32)
        return scale, torch.zeros_like(scale, dtype=torch.int32)


def _activation_spec(config: BPUQuantizationConfig) -> QuantizationSpec:
    qmin, qmax = qrange(config.activation)
    if config.is_qat:
        ctr = AoFakeQuantize.with_args(observer=ao_observer.MovingAverageMinMaxObserver)
    elif config.observer == "histogram":
        ctr = QcHistogramObserver
    else:
        ctr = ao_observer.MinMaxObserver
    return QuantizationSpec(dtype=_TORCH_DTYPES[config.activation], quant_min=qmin, quant_max=qmax,
                            qscheme=torch.per_tensor_symmetric, is_dynamic=False, observer_or_fake_quant_ctr=ctr)


def _weight_spec(config: BPUQuantizationConfig, axis: int) -> QuantizationSpec:
    # [-127, 127]: the symmetric per-channel scale is amax / 127, qcompiler's own weight scale
    ctr = (AoFakeQuantize.with_args(observer=ao_observer.MovingAveragePerChannelMinMaxObserver) if config.is_qat
           else ao_observer.PerChannelMinMaxObserver)
    return QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric,
                            ch_axis=axis, is_dynamic=False, observer_or_fake_quant_ctr=ctr)


def _fixed_spec(config: BPUQuantizationConfig) -> FixedQParamsQuantizationSpec:
    qmin, qmax = qrange(config.activation)
    return FixedQParamsQuantizationSpec(dtype=_TORCH_DTYPES[config.activation], scale=1.0 / (qmax + 1),
                                        zero_point=0, quant_min=qmin, quant_max=qmax,
                                        qscheme=torch.per_tensor_symmetric)


def canonical_op(node: fx.Node) -> Optional[str]:
    """The canonical op (qcompiler.ir.ops) of an exported ATen call; ``relu_`` counts as ``relu``."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return "getitem"
    op = definition(node.target)
    if op is None and isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__
        if name.endswith("_") and not name.startswith("_"):  # in place: the op of its out-of-place form
            packet = getattr(torch.ops.aten, name[:-1], None)
            overload = getattr(packet, node.target._overloadname, None) if packet is not None else None
            op = definition(overload) if overload is not None else None
    return None if op is None else op.name


def _type_name(t: Any) -> str:
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


class BPUQuantizer(Quantizer):
    """Annotate a ``torch.export`` graph for ``march`` (see the module docstring)."""

    def __init__(self, march: MarchLike = "bayes") -> None:
        super().__init__()
        self.march = to_march(march)
        self.table = op_table(self.march)
        self.global_config: Optional[BPUQuantizationConfig] = BPUQuantizationConfig()
        self.module_type_config: dict[str, Optional[BPUQuantizationConfig]] = {}
        self.module_name_config: dict[str, Optional[BPUQuantizationConfig]] = {}

    # -- the overrides torch's NPU quantizers have ---------------------------------------------
    def _checked(self, config: Any, where: str) -> Optional[BPUQuantizationConfig]:
        if config is not None and not isinstance(config, BPUQuantizationConfig):
            raise ConfigError(f"BPUQuantizer.{where}: config must be a BPUQuantizationConfig "
                              f"(qcompiler.pt2e.get_bpu_quantization_config()) or None, got {type(config).__name__}")
        if config is not None and config.activation == "qint16" and not self.table.has_int16:
            raise ConfigError(f"BPUQuantizer.{where}: march {self.march.value!r} has no int16 activations; "
                              f"use activation='qint8' or a march with int16 (bayes)")
        return config

    def set_global(self, config: Optional[BPUQuantizationConfig]) -> "BPUQuantizer":
        self.global_config = self._checked(config, "set_global")
        return self

    def set_module_type(self, module_type: Any, config: Optional[BPUQuantizationConfig]) -> "BPUQuantizer":
        self.module_type_config[_type_name(module_type)] = self._checked(config, "set_module_type")
        return self

    def set_module_name(self, module_name: str, config: Optional[BPUQuantizationConfig]) -> "BPUQuantizer":
        if not isinstance(module_name, str):
            raise ConfigError(f"BPUQuantizer.set_module_name: module_name must be a str, got {module_name!r}")
        self.module_name_config[module_name] = self._checked(config, "set_module_name")
        return self

    def config_for(self, node: fx.Node) -> Optional[BPUQuantizationConfig]:
        """The node's config: the innermost named module, else the innermost typed one, else global."""
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        for path, _ in reversed(stack):
            for name, config in self.module_name_config.items():
                if path == name or path.startswith(name + "."):
                    return config
        for _, mtype in reversed(stack):
            key = _type_name(mtype)
            if key in self.module_type_config:
                return self.module_type_config[key]
        return self.global_config

    # -- annotation ---------------------------------------------------------------------------
    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        fused_into: set[fx.Node] = set()  # producers whose output is quantized after their relu
        for node in model.graph.nodes:
            op = canonical_op(node)
            if op is None or op in _SKIPPED or ANNOTATION_KEY in node.meta or not self.table.supports(op):
                continue
            config = self.config_for(node)
            if config is None:
                continue
            self._annotate(node, op, config, fused_into)
        return model

    def _annotate(self, node: fx.Node, op: str, config: BPUQuantizationConfig, fused_into: set) -> None:
        act = _activation_spec(config)
        tensors = [a for a in _flat(node.args) if isinstance(a, fx.Node) and _is_float_tensor(a)]
        inputs: dict[fx.Node, Any] = {}
        if op in _WEIGHT_OPS:
            inputs[node.args[0]] = act
            if len(node.args) > 1 and isinstance(node.args[1], fx.Node):
                inputs[node.args[1]] = _weight_spec(config, _WEIGHT_OPS[op])
        elif op == "cat":
            first, *rest = [a for a in node.args[0] if isinstance(a, fx.Node)]
            inputs[first] = act
            for other in rest:  # every input and the output on the first input's scale
                inputs[other] = SharedQuantizationSpec((first, node))
            output = SharedQuantizationSpec((first, node))
        elif not tensors:
            return
        fused = op in _FUSED_ACTIVATIONS and bool(tensors) and tensors[0] in fused_into
        if op not in _WEIGHT_OPS and op != "cat":
            inputs = {} if fused else {a: act for a in tensors}
        if op != "cat":
            if op in SCALE_PRESERVING_OPS and not fused:
                output = SharedQuantizationSpec((tensors[0], node))
            elif op in _FIXED_SCALE_OPS:
                output = _fixed_spec(config)
            else:
                output = act
            user = _only_user(node)
            if op in _FUSING_PRODUCERS and user is not None and canonical_op(user) in _FUSED_ACTIVATIONS \
                    and self.table.supports(canonical_op(user)) and self.config_for(user) == config:
                output = None  # quantized after the activation, as qcompiler's fuse pass fuses them
                fused_into.add(node)
        node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=output,
                                                           _annotated=True)

    def validate(self, model: fx.GraphModule) -> None:
        """Nothing beyond torchao's own checks: every annotation here is one the contract takes."""


def _flat(args: Any):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _is_float_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None

