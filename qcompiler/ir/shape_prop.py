"""Shape propagation: run the graph once on example inputs and record tensor facts."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from qcompiler.batches import fresh_args, tensors_in
from qcompiler.compat.torch_private import pytree
from qcompiler.errors import ConfigError
from qcompiler.ir.inplace import META_INPUT_WRITES, META_RETURNED_INPUT, storage_key
from qcompiler.ir.meta import META_STORAGE, META_TENSOR, TensorInfo, format_tensor_info
from qcompiler.ir.state import ModelState, ModuleAttributes

_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def describe_value(value: Any) -> Any:
    """TensorInfo for a tensor, the same structure for tuples/lists, None otherwise."""
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(value.shape), dtype_name(value.dtype))
    if isinstance(value, (tuple, list)):
        return type(value)(describe_value(v) for v in value) if isinstance(value, list) else tuple(
            describe_value(v) for v in value
        )
    return None


class KeywordInputs(tuple):
    """Example inputs given as a dict of keyword inputs (``{"input_ids": ..., "attention_mask": ...}``).

    The tuple is the tensor leaves of ``tree_flatten((args, kwargs))``, the graph's inputs in order
    (what the captured graph is called with); ``args`` / ``kwargs`` are the call as given, ``spec``
    its TreeSpec (``gm.meta[GM_INPUT_SPEC]``). Leaves that are no tensors (None, ints, bools) are
    constants of the captured graph."""

    args: tuple
    kwargs: dict
    spec: Any

    def __new__(cls, kwargs: dict, args: tuple = ()) -> "KeywordInputs":
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"example_inputs as a dict are keyword inputs: its keys must be the forward's "
                              f"parameter names (strings), got {bad[0]!r}")
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self = super().__new__(cls, tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor)))
        self.args, self.kwargs, self.spec = tuple(args), dict(kwargs), spec
        return self


def normalize_inputs(example_inputs: Any) -> tuple:
    """Example inputs as a tuple of positional arguments (a lone tensor becomes a 1-tuple); a dict
    (keyword inputs) as :class:`KeywordInputs`, the tuple of its tensor leaves."""
    if example_inputs is None:
        raise ConfigError("example_inputs is required: pass a tensor or a tuple of the model's positional inputs")
    if isinstance(example_inputs, KeywordInputs):
        return example_inputs
    if isinstance(example_inputs, dict):
        return KeywordInputs(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs
    raise ConfigError(
        f"example_inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, "
        f"got {type(example_inputs).__name__}"
    )


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Temporarily put every submodule in eval mode (no BN statistics updates), then restore."""
    saved = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our ConfigError names the node; no torch stack dump

    def run_node(self, n: fx.Node) -> Any:
        calls = n.op in ("call_module", "call_function")
        before = [_versions(self.env[a]) for a in n.all_input_nodes] if calls else []
        try:
            value = super().run_node(n)
        except Exception as exc:
            raise _input_error(self.module, n, exc) from None
        if calls:  # which inputs the node wrote in place (meta tensors count versions too), which it returned
            n.meta[META_INPUT_WRITES] = tuple(a.name for a, was in zip(n.all_input_nodes, before)
                                              if _versions(self.env[a]) != was)
            n.meta[META_RETURNED_INPUT] = next((a.name for a in n.all_input_nodes if self.env[a] is value), None)
        n.meta[META_TENSOR] = describe_value(value)
        n.meta[META_STORAGE] = frozenset(storage_key(t) for t in tensors_in(value))  # compared among live values
        return value


def _versions(value: Any) -> list[int]:
    """The version counters of the tensors in ``value`` (each in-place write of a tensor moves its own;
    an inference tensor has none: -1)."""
    return [t._version if not t.is_inference() else -1 for t in tensors_in(value)]


def meta_state(root: nn.Module) -> list[str]:
    """Qualified names of the tensors on the meta device that ``root``'s modules hold: parameters,
    buffers and plain attributes (in lists, tuples and dicts too).  A meta tensor has no data, so a
    real run that reads one fails whatever its inputs are."""
    found = []

    def visit(name: str, value: Any, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                found.append(name)
        elif depth < 3 and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{name}[{i}]", v, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}[{k!r}]", v, depth + 1)

    for path, module in root.named_modules():
        prefix = f"{path}." if path else ""
        for key, value in (*module._parameters.items(), *module._buffers.items(),
                           *((k, v) for k, v in vars(module).items() if not k.startswith("_"))):
            visit(prefix + key, value)
    return found


def _input_error(gm: fx.GraphModule, n: fx.Node, exc: Exception) -> ConfigError:
    if n.op == "call_module":
        what = f"module '{n.target}' ({type(gm.get_submodule(n.target)).__name__})"
    else:
        what = f"{n.op} {getattr(n.target, '__name__', n.target)}"
    seen = [format_tensor_info(a.meta.get(META_TENSOR)) for a in n.all_input_nodes]
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    held = meta_state(gm)
    if held:  # the model's state, not the inputs: say so
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        return ConfigError(
            f"node '{n.name}' ({what}) failed on inputs ({', '.join(seen)}): {msg}. The model holds tensors "
            f"on the meta device, which have no data ({', '.join(held[:3])}{more}): the cause is the model's "
            f"state, not example_inputs. Load or create the model with real tensors (e.g. "
            f"model.to_empty(device='cpu') then load_state_dict).")
    if "meta tensor" in msg or "device meta" in msg or "'meta'" in msg:
        return ConfigError(
            f"node '{n.name}' ({what}) failed on inputs ({', '.join(seen)}): {msg}. A tensor on the meta "
            f"device (no data) reached the real run, and no module of the model holds one: the model keeps "
            f"it elsewhere (a global or a closure's cache filled on an earlier call); the cause is the "
            f"model's state, not example_inputs.")
    return ConfigError(
        f"example_inputs do not fit the model: node '{n.name}' ({what}) failed on inputs "
        f"({', '.join(seen)}): {msg}. Check the shapes and dtypes of example_inputs."
    )


def check_arity(gm: fx.GraphModule, inputs: tuple) -> None:
    """ConfigError if the number of inputs does not fit the traced forward's signature."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]  # args hold a default value, if any
    if not len(required) <= len(inputs) <= len(placeholders):
        names = ", ".join(n.target for n in placeholders)
        raise ConfigError(
            f"example_inputs do not fit the model: forward({names}) takes "
            f"{len(required)}{'' if len(required) == len(placeholders) else f'..{len(placeholders)}'} "
            f"inputs, got {len(inputs)}. Pass a tuple with one entry per forward argument."
        )


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


class _Run(nn.Module):
    """Lets ``torch.func.functional_call`` swap the graph's weights for meta tensors."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> Any:
        return _Recorder(self.gm).run(*args)


def propagate_shapes(gm: fx.GraphModule, example_inputs: Any) -> None:
    """Record META_TENSOR (shape, dtype) per node by running ``gm`` on ``example_inputs``.

    Shapes only need metadata, so the graph first runs on meta tensors (weights
    swapped for meta copies: no arithmetic, a 224x224 ResNet in milliseconds).
    Code that meta tensors cannot run (data-dependent values, tensors created
    inside forward) falls back to a real forward without grad and in eval mode,
    which also produces the error that names the failing node when the inputs
    do not fit the model.
    """
    inputs = normalize_inputs(example_inputs)
    check_arity(gm, inputs)
    with eval_mode(gm):
        attributes = ModuleAttributes(gm)  # a leaf rebinding a plain attribute (a list of anchors) on meta
        try:                               # tensors must not keep them: the real run would read them
            state = {f"gm.{k}": v.to("meta") for k, v in gm.state_dict(keep_vars=True).items()}
            with torch.no_grad():
                torch.func.functional_call(_Run(gm), state, _to_meta(inputs), strict=False)
            return
        except Exception:  # fall back to the real thing, which reports errors properly
            pass
        finally:
            attributes.restore()
        state = ModelState(gm)  # a module writing its own state (a leaf's running mean) must not move it here
        try:
            with torch.no_grad():  # on copies: a model may change its input in place (the example is the user's)
                _Recorder(gm).run(*fresh_args(inputs))
        finally:
            state.restore()
