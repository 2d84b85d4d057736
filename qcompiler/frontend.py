"""From a user's float model to a placed, partitioned GraphModule: the shared front end.

Validates every user input before touching anything, copies the model once
(unless ``inplace=True``), traces it and runs the partition pipeline.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch.fx as fx
import torch.nn as nn

from qcompiler.batches import input_signature, require_dense
from qcompiler.errors import ConfigError
from qcompiler.hybrid import parse_hybrid_dict
from qcompiler.ir.capture import DEFAULT_CAPTURE, capture, check_capture
from qcompiler.ir.meta import GM_INPUT_SIGNATURE, GM_MARCH
from qcompiler.ir.shape_prop import normalize_inputs
from qcompiler.ir.state import tensor_attributes
from qcompiler.ir.structure import flatten_output
from qcompiler.march import MarchLike, resolve_march
from qcompiler.passes.base import CompileContext, CompileOptions, Pass, PassManager
from qcompiler.passes.pipeline import PARTITION_PIPELINE

PREPARE_CUSTOM_KEYS = ("preserved_attributes", "non_traceable_module_name", "non_traceable_module_class",
                       "strict_tracing", "capture")
# keys whose value is a flag, not a list: strict_tracing=True raises a TraceError where tracing fails,
# instead of running the untraceable module as a whole in eager torch (qcompiler.ir.auto_leaf)
FLAG_KEYS = ("strict_tracing",)


def parse_prepare_custom_config(config: Optional[dict]) -> dict:
    """Validate ``prepare_custom_config_dict``; ConfigError names an unknown key."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f"prepare_custom_config_dict must be a dict, got {type(config).__name__}")
    for key, value in config.items():
        if key not in PREPARE_CUSTOM_KEYS:
            raise ConfigError(
                f"prepare_custom_config_dict: unknown key {key!r}; allowed keys: {', '.join(PREPARE_CUSTOM_KEYS)}"
            )
        if key == "capture":  # how the model is captured: "fx" | "export" | "auto" (qcompiler.ir.capture)
            check_capture(value)
        elif key in FLAG_KEYS:
            if not isinstance(value, bool):
                raise ConfigError(f"prepare_custom_config_dict[{key!r}] must be True or False, got {value!r}")
        elif not isinstance(value, (list, tuple)):
            raise ConfigError(f"prepare_custom_config_dict[{key!r}] must be a list, got {type(value).__name__}")
    return dict(config)


def build_graph(
    model: nn.Module,
    example_inputs: Any,
    *,
    march: Optional[MarchLike] = None,
    hybrid_dict: Optional[dict] = None,
    prepare_custom_config_dict: Optional[dict] = None,
    passes: Sequence[Pass],
    options: Optional[Mapping[str, Any]] = None,
    dump_dir: Optional[Union[str, Path]] = None,
    verify: bool = True,
    inplace: bool = False,
) -> fx.GraphModule:
    """Validate inputs, copy and trace ``model``, and run ``passes``. Returns the GraphModule.

    ``options``: the :class:`~qcompiler.passes.base.CompileOptions` the passes read, by name."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ctx = CompileContext(
        march=resolve_march(march),
        example_inputs=normalize_inputs(example_inputs),
        hybrid_dict=parse_hybrid_dict(hybrid_dict, model),
        prepare_custom_config_dict=parse_prepare_custom_config(prepare_custom_config_dict),
        options=CompileOptions.by_name(options or {}),
    )
    require_dense(ctx.example_inputs, where="example_inputs")
    custom = ctx.prepare_custom_config_dict
    preserved = list(custom.get("preserved_attributes", []))
    for attr in preserved:
        if not hasattr(model, attr):
            raise ConfigError(f"prepare_custom_config_dict['preserved_attributes']: model has no attribute {attr!r}")
    work = model if inplace else _copy(model)
    with environment_kept():
        gm = capture(  # fx tracing, torch.export, or both; untraceable code runs in torch (unless strict)
            work,
            ctx.example_inputs,  # defaulted forward args they leave out: constants
            mode=custom.get("capture", DEFAULT_CAPTURE),
            leaf_module_names=custom.get("non_traceable_module_name", ()),
            leaf_module_types=custom.get("non_traceable_module_class", ()),
            strict=custom.get("strict_tracing", False),
            pristine=None if inplace else model,  # what tracing writes into the copy's state is undone from it
        )
        gm = flatten_output(gm)  # a dict / namedtuple / ModelOutput output: flat leaves + GM_OUTPUT_SPEC
        for attr in preserved:
            setattr(gm, attr, getattr(work, attr))
        gm.meta[GM_MARCH] = ctx.march
        gm.meta[GM_INPUT_SIGNATURE] = input_signature(ctx.example_inputs)
        gm = PassManager(passes, verify=verify, dump_dir=dump_dir).run(gm, ctx).gm
    gm.recompile()
    return gm


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """Undo what torch's first import of ``torch._dynamo`` inside the block does to ``os.environ``.

    Tracing (fx's stack traces) and shape propagation on meta tensors (torch's Python references)
    import it lazily, and that sets TORCHINDUCTOR_CACHE_DIR for the rest of the user's process.
    The import cannot be avoided (it comes with every meta op); its setting is taken back.
    """
    if "torch._dynamo" in sys.modules:
        yield
        return
    saved = dict(os.environ)
    try:
        yield
    finally:
        if "torch._dynamo" in sys.modules:
            for key in [k for k in os.environ if k not in saved]:
                del os.environ[key]
            for key, value in saved.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` to trace and rewrite; a ConfigError naming the tensor if torch cannot copy it."""
    try:
        return copy.deepcopy(model)
    except RuntimeError as exc:
        if "deepcopy" not in str(exc):
            raise
        made = [name for name, value in tensor_attributes(model) if value.grad_fn is not None]
        which = f" ('{made[0]}')" if made else ""
        raise ConfigError(
            f"{type(model).__name__} cannot be copied: a tensor it holds{which} is the result of an autograd "
            f"computation (its forward changed it while gradients were recorded), and torch copies only tensors "
            f"made directly. Detach it (self.x = self.x.detach()), or run the model under torch.no_grad() "
            f"before compiling; the model is left as it is.") from None


def partition(
    model: nn.Module,
    example_inputs: Any,
    *,
    march: Optional[MarchLike] = None,
    hybrid_dict: Optional[dict] = None,
    prepare_custom_config_dict: Optional[dict] = None,
    dump_dir: Optional[Union[str, Path]] = None,
    verify: bool = True,
) -> fx.GraphModule:
    """Trace, place, fuse, insert boundary stubs and partition ``model`` for ``march``.

    The returned GraphModule computes the same float outputs as ``model``
    (up to BN folding) and carries placement, reasons and partitions in its
    node meta and ``gm.meta``. ``model`` itself is never modified.
    """
    return build_graph(
        model,
        example_inputs,
        march=march,
        hybrid_dict=hybrid_dict,
        prepare_custom_config_dict=prepare_custom_config_dict,
        passes=PARTITION_PIPELINE,
        dump_dir=dump_dir,
        verify=verify,
    )
