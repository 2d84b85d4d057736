"""Choosing how a model is captured into the IR: symbolic tracing, torch.export, or both in turn.

``prepare_custom_config_dict={"capture": ...}`` (CLI ``--capture``):

* ``"fx"``: symbolic tracing only, with qcompiler.ir.auto_leaf's fallback for what fails to trace;
* ``"export"``: ``torch.export`` only (qcompiler.ir.export_capture); a failure is a TraceError;
* ``"auto"`` (the default): symbolic tracing first, strictly; where it fails, torch.export; where
  that fails too, the fx fallback (untraceable modules run as a whole, in eager torch). The
  warning says which capture was used and why.

Keyword inputs (:class:`~qcompiler.ir.shape_prop.KeywordInputs`) set ``gm.meta[GM_INPUT_SPEC]`` in
both modes; symbolic tracing takes them when they are the forward's leading parameters, in order,
and all tensors; other keyword inputs need torch.export.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.errors import ConfigError, QCompilerWarning, TraceError
from qcompiler.ir.auto_leaf import trace_or_fallback
from qcompiler.ir.export_capture import export_graph
from qcompiler.ir.meta import GM_INPUT_SPEC
from qcompiler.ir.ops.registry import module_definition
from qcompiler.ir.shape_prop import KeywordInputs
from qcompiler.ir.state import ModelState

CAPTURES = ("fx", "export", "auto")
DEFAULT_CAPTURE = "auto"
# gm.meta: which capture made the graph ("fx" | "export")
GM_CAPTURE = "qc_capture"


def check_capture(value: Any) -> str:
    """The capture mode ``value`` names; ConfigError naming the allowed values otherwise."""
    if value not in CAPTURES:
        raise ConfigError(f"prepare_custom_config_dict['capture'] must be one of {', '.join(map(repr, CAPTURES))}, "
                          f"got {value!r}")
    return value


def capture(model: nn.Module, inputs: tuple, *, mode: str = DEFAULT_CAPTURE,
            leaf_module_names: Sequence[str] = (), leaf_module_types: Sequence[Any] = (),
            strict: bool = False, pristine: Optional[nn.Module] = None) -> fx.GraphModule:
    """``model`` captured into a GraphModule by ``mode`` (see the module doc). ``inputs``: the
    normalized example inputs (a tuple, or KeywordInputs)."""
    check_capture(mode)
    _check_keywords(model, inputs)
    positional = _positional(model, inputs)
    leaves = dict(leaf_module_names=leaf_module_names, leaf_module_types=leaf_module_types)
    if mode == "export":
        return _mark(_export(model, inputs, pristine, **leaves), inputs, "export")
    if positional is None:
        if mode == "fx":
            raise ConfigError(f"{type(model).__name__}: symbolic tracing takes keyword inputs only when they are "
                              f"the forward's leading parameters, in order, and all tensors; got "
                              f"{', '.join(inputs.kwargs)}. Use prepare_custom_config_dict={{'capture': 'export'}} "
                              f"(CLI: --capture export)")
        gm = _export(model, inputs, pristine, **leaves)
        warnings.warn(f"{type(model).__name__}: captured with torch.export, because symbolic tracing cannot take "
                      f"the keyword inputs {', '.join(inputs.kwargs)} (not the forward's leading parameters, "
                      f"in order, all tensors)", QCompilerWarning, stacklevel=3)
        return _mark(gm, inputs, "export")
    fx_kwargs = dict(leaf_module_names=leaf_module_names, leaf_module_types=leaf_module_types,
                     example_inputs=positional, pristine=pristine)
    if mode == "fx":
        return _mark(trace_or_fallback(model, strict=strict, **fx_kwargs), inputs, "fx")
    try:
        return _mark(trace_or_fallback(model, strict=True, **fx_kwargs), inputs, "fx")
    except TraceError as fx_error:
        if getattr(fx_error, "code_error", False):
            raise
        try:
            _fallback_first(model, fx_error)
            gm = _export(model, inputs, pristine, **leaves)
        except TraceError as export_error:
            if strict:
                raise fx_error from None
            with warnings.catch_warnings(record=True) as caught:  # the fallback's warnings, told of export too
                warnings.simplefilter("always")
                gm = trace_or_fallback(model, strict=False, **fx_kwargs)
            told = False
            for w in caught:
                message = str(w.message)
                if issubclass(w.category, QCompilerWarning) and not told \
                        and not getattr(export_error, "fallback_first", False):
                    message += f" (torch.export could not capture it either: {export_error.reason})"
                    told = True
                warnings.warn(message, w.category, stacklevel=3)
            return _mark(gm, inputs, "fx")
        warnings.warn(f"{type(model).__name__}: captured with torch.export, because symbolic tracing failed "
                      f"({_first(fx_error)}); prepare_custom_config_dict={{'capture': 'export'}} chooses it "
                      f"directly", QCompilerWarning, stacklevel=3)
        return _mark(gm, inputs, "export")


def _fallback_first(model: nn.Module, fx_error: TraceError) -> None:
    """TraceError (marked ``fallback_first``) where capture "auto" should not try torch.export after
    symbolic tracing failed, but go to the fx fallback at once:

    * the failure is a write to a parameter or buffer (``fx_error.state_write``): the fallback runs
      the writer as a leaf that keeps its state, which an exported graph would lose;
    * the model itself is one of torch's layers (an ``nn.GRU``, an ``nn.MultiheadAttention`` given as
      the whole model) or a module the catalogue spells: the fallback's one call of it is that layer,
      with its rules, where torch.export would write it out as ATen ops no rule knows (``aten.gru``).
    """
    if getattr(fx_error, "state_write", False):
        reason = "the forward writes its own state"
    elif module_definition(model) is not None or type(model).__module__.startswith("torch.nn."):
        reason = f"the model is one {type(model).__name__}, an op the fx fallback calls as it is"
    else:
        return
    err = TraceError(reason)
    err.module_path, err.reason, err.code_error, err.fallback_first = "", reason, False, True
    raise err


def _export(model: nn.Module, inputs: tuple, pristine: Optional[nn.Module], **leaves: Any) -> fx.GraphModule:
    args, kwargs = (inputs.args, inputs.kwargs) if isinstance(inputs, KeywordInputs) else (tuple(inputs), {})
    state = ModelState(model, pristine)  # what the forward writes into the model's state is undone
    try:
        return export_graph(model, args, kwargs, **leaves)
    finally:
        state.restore()


def _mark(gm: fx.GraphModule, inputs: tuple, how: str) -> fx.GraphModule:
    gm.meta[GM_CAPTURE] = how
    if isinstance(inputs, KeywordInputs):
        gm.meta[GM_INPUT_SPEC] = inputs.spec
    return gm


def _first(err: Exception) -> str:
    return getattr(err, "reason", None) or str(err).splitlines()[0]


def _check_keywords(model: nn.Module, inputs: tuple) -> None:
    """ConfigError for a keyword input the forward has no parameter for (and no ``**kwargs``)."""
    if not isinstance(inputs, KeywordInputs):
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in inputs.kwargs if k not in params or params[k].kind == inspect.Parameter.POSITIONAL_ONLY]
    if unknown:
        raise ConfigError(f"example_inputs: keyword input {unknown[0]!r} is not a parameter of "
                          f"{type(model).__name__}.forward({', '.join(params)}); a dict of example inputs gives "
                          f"the forward's keyword arguments")


def _positional(model: nn.Module, inputs: tuple) -> Optional[tuple]:
    """The inputs as positional arguments for symbolic tracing, or None: keyword inputs that are not
    the forward's leading parameters in order, or that hold anything but tensors."""
    if not isinstance(inputs, KeywordInputs):
        return tuple(inputs)
    if inputs.args or not all(isinstance(v, torch.Tensor) for v in inputs.kwargs.values()):
        return None
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    names = list(inputs.kwargs)
    if params[:len(names)] != names:
        return None
    return tuple(inputs.kwargs.values())


__all__ = ["CAPTURES", "DEFAULT_CAPTURE", "GM_CAPTURE", "capture", "check_capture"]
