"""``export_to_onnx``: a prepared, calibrated/trained or converted model as ONNX opset 11.

Signature after the hybrid-QAT guide's ``horizon_plugin_pytorch.utils.onnx_helper.export_to_onnx``
(without the arguments that have one sensible value here: eval mode, standard
ops only, constant folding, stripped doc strings). The graph is emitted by the
project's one ONNX emitter (``qcompiler.backends.onnx``) from the GraphModule
itself; the model is never run or modified. Quantization: per-tensor int8
activations as QuantizeLinear/DequantizeLinear; a converted model's conv / linear
layers on integers (ConvInteger / MatMulInteger on int8 codes, int32 bias, the BPU's
requantization: bit for bit the compiled model); a prepared model's weights (and
the layers opset 11 cannot do on integers, e.g. transposed convs) as their
dequantized int8 values; and a sidecar JSON with every scale and requantization
keyed by ONNX tensor name (see ``qcompiler.backends.onnx.quant``, docs/onnx_export.md).

Run an exported model with :func:`inference_session` (or pass
``disabled_optimizers=ORT_DISABLED_OPTIMIZERS`` to onnxruntime yourself): one
onnxruntime optimization re-quantizes the stored weights per tensor, another replaces
Q/DQ-wrapped ops by integer kernels that compute differently, a third merges the two
roundings of a requantize into one.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from typing import Any, Optional, Sequence, Union

import onnx
import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.atomic_write import check_target, write_files
from qcompiler.backends.onnx.batch_axis import batch_fixing_node
from qcompiler.backends.onnx.emitter import OnnxEmitter, _check_names, check_dynamic_axes, graph_input_leaves
from qcompiler.errors import ConfigError, QCompilerError, QCompilerWarning
from qcompiler.ir.batch_dim import batch_refusal
from qcompiler.ir.meta import GM_KIND, GM_PARTITIONS, META_TENSOR, TensorInfo
from qcompiler.ir.partitions import partitions
from qcompiler.ir.shape_prop import dtype_name

SIDECAR_SUFFIX = ".quant.json"
BATCH_AXIS = "batch"  # the dim_param of the symbolic batch axis
_EXPORTABLE_KINDS = ("calibration", "qat", "quantized")

PathOrFile = Union[str, os.PathLike, io.IOBase]


def export_to_onnx(
    model: nn.Module,
    args: Any,
    f: PathOrFile,
    input_names: Optional[Sequence[str]] = None,
    output_names: Optional[Sequence[str]] = None,
    opset_version: int = 11,
    dynamic_axes: Optional[dict] = None,
    enable_onnx_checker: bool = True,
    dynamic_batch: bool = True,
) -> dict:
    """Write ``model`` as an ONNX opset-11 file to ``f`` and its quantization sidecar next to it.

    ``model``: from ``prepare_calibration_fx`` (after calibration), ``prepare_qat_fx``,
    ``convert_fx``, or a float ``qcompiler.partition`` result. ``args``: the model's
    inputs (a tensor or a tuple, nested tuples allowed), of the shapes and dtypes the
    model was traced with (checked; sizes may differ only on ``dynamic_axes``). ``f``: a
    path (the sidecar goes to ``<f>.quant.json``) or a binary file object open for writing
    (only the returned sidecar; a text, read-only or closed file object is a ConfigError).
    ``dynamic_axes``: as in ``torch.onnx.export``, ``{"input": {0: "batch"}}`` or
    ``{"input": [0]}``, for graph inputs and outputs; output dims that follow a dynamic input
    axis become symbolic too (ONNX shape inference says which), named like the input's axis
    when the label propagates; given, it is all there is (no default batch axis).
    ``dynamic_batch`` (without ``dynamic_axes``): dim 0 of every input and output is the symbolic
    ``"batch"`` where the graph is proven per-sample along dim 0 (the analysis the batch split
    uses, :func:`qcompiler.ir.batch_dim.batch_refusal`), else the traced batch with a
    QCompilerWarning naming the node that fixes it; ``False``: the traced batch, no warning.
    ``enable_onnx_checker``: run ``onnx.checker.check_model(full_check=True)`` before writing.

    Returns the sidecar dict. Raises ConfigError for ``opset_version != 11``, a model
    that is not prepared, args that do not match the traced inputs, unknown names or
    axes in ``dynamic_axes``, or a path no file can be written to (empty, a directory, below
    a file, a device or FIFO: :mod:`qcompiler.atomic_write`); missing parent directories are
    created; nothing is written unless the export succeeds.
    """
    if opset_version != 11:
        raise ConfigError(
            f"opset_version={opset_version!r}: only opset 11 is supported (the BPU toolchain reads "
            f"opset 11, and the export's quantization mapping is written for it); pass opset_version=11"
        )
    _check_destination(f)
    gm = _check_model(model)
    dyn = _dynamic_axes(dynamic_axes)
    batch = _batch_axis(gm) if dynamic_axes is None and dynamic_batch else None
    infos = _check_inputs(gm, _flatten_args(args), input_names, dyn, batch)

    emitter = OnnxEmitter(gm, quantize=True)
    proto = emitter.emit_graph(input_names=input_names, output_names=output_names, input_infos=infos,
                               dynamic_axes=dyn, batch_axis=batch).model
    fixing = batch_fixing_node(proto) if batch is not None else None
    if fixing is not None:  # an emitted constant holds the traced batch: export that batch
        _warn_fixed_batch(infos, f"ONNX node '{fixing}' holds the traced batch size in a constant")
        emitter = OnnxEmitter(gm, quantize=True)
        proto = emitter.emit_graph(input_names=input_names, output_names=output_names, input_infos=infos,
                                   dynamic_axes=dyn).model
    if enable_onnx_checker:
        try:
            onnx.checker.check_model(proto, full_check=True)
        except onnx.checker.ValidationError as exc:
            raise QCompilerError(f"the exported ONNX model fails onnx.checker (an emitter bug; please "
                                 f"report it): {exc}") from exc
    sidecar = emitter.quant.sidecar(emitter, partitions(gm, quantizers=True))
    data = proto.SerializeToString()
    text = json.dumps(sidecar, sort_keys=True, indent=2) + "\n"
    _write(f, data, text)
    return sidecar


# onnxruntime's level-1 "WeightBiasQuantization" assumes a float Conv/Gemm weight between a
# DequantizeLinear and a QuantizeLinear is *unquantized* and quantizes it per tensor (int8).
# The float-form weights (prepared models, transposed convs) are already the dequantized
# per-channel int8 values (opset 11 has no per-channel Q/DQ): re-quantizing them per tensor
# loses most of their precision (UNet: errors of several LSB on most outputs). Sessions for
# exported models must disable it. (The integer layers of a converted model are left alone by
# every onnxruntime rewrite: tests/test_export_exact.py runs them with all of them on.) Also the fusion of
# DequantizeLinear -> op -> QuantizeLinear into QLinear* kernels: their integer arithmetic is not
# the graph's (QLinearAveragePool treats ceil-mode edge windows differently: 21% of outputs off
# by up to 0.17 for a CPU avg_pool2d(ceil_mode=True) between BPU parts).
# DoubleQDQPairsRemover folds Q(s1) -> DQ(s1) -> Q(s2) -> DQ(s2) (a requantize: a QuantStub on a quantized
# value) into one Q/DQ, dropping the first rounding (10% of a requantized conv's outputs one LSB off).
ORT_DISABLED_OPTIMIZERS = ("WeightBiasQuantization", "QDQSelectorActionTransformer", "DoubleQDQPairsRemover")


def inference_session(model: Union[onnx.ModelProto, bytes, str, os.PathLike], sess_options=None,
                      providers: Sequence[str] = ("CPUExecutionProvider",)):
    """An onnxruntime session for an exported model (``ModelProto``, bytes or a path), with
    ``ORT_DISABLED_OPTIMIZERS`` off; every other optimization stays on."""
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    return ort.InferenceSession(model, sess_options, providers=list(providers),
                                disabled_optimizers=list(ORT_DISABLED_OPTIMIZERS))


def _check_destination(f: Any) -> None:
    """``f`` a path a file can be written to (:func:`~qcompiler.atomic_write.check_target`) or an open
    binary file object that can be written: a text file (``open(p, "w")``), a file opened for
    reading only or a closed one is a ConfigError saying how to open it, before any work."""
    if hasattr(f, "write"):
        _check_file_object(f)
        return
    if not isinstance(f, (str, os.PathLike)):
        raise ConfigError(f"export_to_onnx: f must be a path or a binary file object, got {type(f).__name__}")
    check_target(f, "export_to_onnx")


def _check_file_object(f: Any) -> None:
    name = getattr(f, "name", None)
    shown = f"f ({name!r})" if isinstance(name, (str, bytes, int)) else f"f ({type(f).__name__})"
    if getattr(f, "closed", False) is True:
        raise ConfigError(f"export_to_onnx: {shown} is closed; pass an open binary file, e.g. open(path, 'wb')")
    if isinstance(f, io.TextIOBase) or isinstance(getattr(f, "encoding", None), str):
        raise ConfigError(f"export_to_onnx: {shown} is a text file object, but an ONNX file is bytes; open it in "
                          "binary mode, e.g. open(path, 'wb'), or pass the path")
    writable = getattr(f, "writable", None)
    if callable(writable) and not writable():
        mode = getattr(f, "mode", None)
        opened = f" (opened with mode {mode!r})" if isinstance(mode, str) else ""
        raise ConfigError(f"export_to_onnx: {shown} is not open for writing{opened}; open it with "
                          "open(path, 'wb'), or pass the path")


def _check_model(model: Any) -> fx.GraphModule:
    if isinstance(model, fx.GraphModule):
        if model.meta.get(GM_KIND) in _EXPORTABLE_KINDS or GM_PARTITIONS in model.meta:
            return model
    if isinstance(model, nn.Module):
        raise ConfigError(
            f"export_to_onnx takes a model prepared by qcompiler (prepare_calibration_fx / prepare_qat_fx, "
            f"convert_fx, or qcompiler.partition), got a plain {type(model).__name__}: prepare it first, "
            f"or export a float model with torch.onnx.export yourself"
        )
    raise ConfigError(f"export_to_onnx: model must be a torch.nn.Module, got {type(model).__name__}")


def _flatten_args(args: Any) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (list, tuple)):
        out = []
        for a in args:
            out.extend(_flatten_args(a) if isinstance(a, (list, tuple)) else [a])
        bad = [type(a).__name__ for a in out if not isinstance(a, torch.Tensor)]
        if bad:
            raise ConfigError(f"export_to_onnx: args must be tensors or (nested) tuples of tensors, got {bad}")
        return out
    raise ConfigError(f"export_to_onnx: args must be a tensor or a tuple of the model's inputs, "
                      f"got {type(args).__name__}")


def _batch_axis(gm: fx.GraphModule) -> Optional[str]:
    """:data:`BATCH_AXIS` when ``gm`` is proven per-sample along dim 0, else None after a
    QCompilerWarning saying which node fixes the batch."""
    why = batch_refusal(gm)
    if why is None:
        return BATCH_AXIS
    _, infos = graph_input_leaves(gm)
    _warn_fixed_batch(infos, why)
    return None


def _warn_fixed_batch(infos: Sequence[Any], why: str) -> None:
    first = next((i for i in infos if isinstance(i, TensorInfo) and i.shape), None)
    size = f" at {first.shape[0]}" if first is not None else ""
    warnings.warn(f"export_to_onnx: the exported model's batch is fixed{size} (the traced batch), as the graph "
                  f"does not keep its samples apart along dim 0: {why}. Pass dynamic_batch=False to export the "
                  "fixed batch without this warning, or dynamic_axes to declare the axes yourself",
                  QCompilerWarning, stacklevel=3)


def _check_inputs(gm: fx.GraphModule, args: list[torch.Tensor], input_names: Optional[Sequence[str]],
                  dynamic: dict[str, dict[int, str]], batch: Optional[str] = None) -> list[Any]:
    """The graph inputs' TensorInfos, after checking ``args`` against the shapes the model was traced
    with (shape propagation, ``node.meta[META_TENSOR]``): count, dtype, rank, and every size except on
    axes declared in ``dynamic_axes`` (dim 0 of every input with a ``batch`` axis). The graph's constants (reshape sizes, calibrated scales) are
    those of the traced shapes, so other inputs would give a failing or silently wrong file."""
    defaults, recorded = graph_input_leaves(gm)
    names = _check_names(input_names, defaults, "input_names")
    if len(args) != len(recorded):
        raise ConfigError(f"export_to_onnx: the model takes {len(recorded)} input tensor(s) ({', '.join(names)}), "
                          f"got {len(args)} in args: pass one tensor per input, as for the model's forward")
    infos = []
    for name, info, t in zip(names, recorded, args):
        given = TensorInfo(tuple(t.shape), dtype_name(t.dtype))
        if not isinstance(info, TensorInfo):  # not recorded: nothing to check against
            infos.append(given)
            continue
        if given.dtype != info.dtype:
            raise ConfigError(f"export_to_onnx: input '{name}' has dtype {given.dtype}, the model was traced "
                              f"with {info.dtype}; pass a {info.dtype} tensor")
        axes = dynamic.get(name, {0: batch} if batch is not None else {})
        check_dynamic_axes(name, axes, info)
        traced = f"the model was traced with shape {info.shape}; pass an input of the traced shape"
        if len(given.shape) != len(info.shape):
            raise ConfigError(f"export_to_onnx: input '{name}' has shape {given.shape}, {traced}")
        if 0 in given.shape and 0 not in info.shape:
            raise ConfigError(f"export_to_onnx: input '{name}' has shape {given.shape}, an empty tensor; {traced}")
        free = {a % len(info.shape) for a in axes}
        differ = [a for a, (e, g) in enumerate(zip(info.shape, given.shape)) if e != g and a not in free]
        if differ:
            hint = (f", or declare axis 0 in dynamic_axes[{name!r}] for a batch size that may vary"
                    if differ == [0] else "")
            raise ConfigError(f"export_to_onnx: input '{name}' has shape {given.shape}, {traced}{hint}")
        infos.append(info)
    return infos


def _dynamic_axes(dynamic_axes: Optional[dict]) -> dict[str, dict[int, str]]:
    if dynamic_axes is None:
        return {}
    if not isinstance(dynamic_axes, dict):
        raise ConfigError(f"dynamic_axes must be a dict like {{'input': {{0: 'batch'}}}}, got "
                          f"{type(dynamic_axes).__name__}")
    out: dict[str, dict[int, str]] = {}
    for name, axes in dynamic_axes.items():
        if isinstance(axes, (list, tuple)):
            axes = {a: f"{name}_dynamic_axes_{a + 1}" if isinstance(a, int) else a for a in axes}
        if not isinstance(axes, dict) or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
            raise ConfigError(f"dynamic_axes[{name!r}] must be a dict {{axis: name}} or a list of axes (ints), "
                              f"got {axes!r}")
        out[str(name)] = {a: str(label) for a, label in axes.items()}
    return out


def _write(f: PathOrFile, data: bytes, sidecar_text: str) -> None:
    """Write the model and its sidecar whole or not at all (:mod:`qcompiler.atomic_write`)."""
    if hasattr(f, "write"):
        f.write(data)
        return
    path = os.fspath(f)
    write_files([(path, data), (path + SIDECAR_SUFFIX, sidecar_text.encode("utf-8"))], "export_to_onnx")


__all__ = ["export_to_onnx", "inference_session", "SIDECAR_SUFFIX", "BATCH_AXIS", "ORT_DISABLED_OPTIMIZERS"]
