"""Structured model inputs and outputs: dicts, OrderedDicts, namedtuples, ``ModelOutput`` dataclasses.

The graph computes flat values; the structure lives beside it as a torch.utils._pytree TreeSpec
(the contract of :data:`~qcompiler.ir.meta.GM_OUTPUT_SPEC` / :data:`~qcompiler.ir.meta.GM_INPUT_SPEC`):

- :func:`flatten_output` turns an fx-traced output that holds a dict or a namedtuple into the flat
  tuple of its leaves and sets ``GM_OUTPUT_SPEC``. torch.fx keeps only plain dicts in a graph, so
  the tracer records the structure of the value the forward really returned
  (:func:`recording_output`, ``META_TRACED_OUTPUT``), and that gives OrderedDicts and
  ``ModelOutput`` classes back. Plain tensors and (nested) tuples of them are left as they are:
  no spec, so every file made from such a graph stays as it was.
- :func:`spec_to_json` / :func:`spec_from_json`: the spec as JSON, what an artifact stores. On load,
  a class is looked up only among modules already imported (``sys.modules``), never imported
  because a file names it; one not found is rebuilt as the closest plain structure (a namedtuple
  as a tuple, a ``ModelOutput`` as an OrderedDict) with a QCompilerWarning.
- :func:`leaf_names`: a name per leaf saying where it came from (``out``, ``aux``, ``0.1``), the
  ONNX export's output and input names.

Leaves of an output are graph values (tensors) or constants (None, bool, int, float, str, which come
back as they were); anything else is a ConfigError naming its key path.
"""

from __future__ import annotations

import collections
import functools
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from qcompiler.compat.torch_private import pytree
from qcompiler.errors import ArtifactError, ConfigError, QCompilerWarning
from qcompiler.ir.meta import GM_OUTPUT_SPEC, META_TRACED_OUTPUT

CONSTANTS = (type(None), bool, int, float, str)
# deepest structure a spec (JSON) may nest: an artifact is untrusted
MAX_DEPTH = 32


# ---------------------------------------------------------------------------- tracing and flattening


def recording_output(fn: Callable, tracer: Any) -> Callable:
    """``fn`` (the root forward the tracer calls) recording the structure of what it returns on
    ``tracer.traced_output`` (None where pytree cannot describe it), before torch.fx lowers the
    value into graph arguments (and an OrderedDict or ModelOutput into a plain dict)."""
    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        try:
            tracer.traced_output = pytree.tree_structure(out)
        except Exception:  # a structure pytree cannot walk: the graph's own is all there is
            tracer.traced_output = None
        return out
    return forward


def mark_traced_output(graph: fx.Graph, spec: Optional[pytree.TreeSpec]) -> None:
    """Keep the recorded structure on the graph's output node, for :func:`flatten_output`."""
    if spec is not None:
        for node in graph.nodes:
            if node.op == "output":
                node.meta[META_TRACED_OUTPUT] = spec


def is_structured(arg: Any) -> bool:
    """Whether an output argument holds a dict or a namedtuple anywhere (what needs a spec)."""
    if isinstance(arg, dict):
        return True
    if isinstance(arg, tuple) and hasattr(arg, "_fields"):
        return True
    if isinstance(arg, (tuple, list)):
        return any(is_structured(a) for a in arg)
    return False


def flatten_output(gm: fx.GraphModule) -> fx.GraphModule:
    """Make a structured output node return the flat tuple of its leaves, its structure in
    ``gm.meta[GM_OUTPUT_SPEC]``. Graphs with a spec already (torch.export sets its own) and
    plain outputs (tensors, nested tuples and lists) are left unchanged. Returns ``gm``."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return gm
    traced = out.meta.pop(META_TRACED_OUTPUT, None)
    if GM_OUTPUT_SPEC in gm.meta or not out.args:
        return gm
    arg = _constructed(out.args[0], out)
    if not is_structured(arg):
        return gm
    leaves, spec = pytree.tree_flatten(arg)
    spec = _plain(spec)
    if traced is not None and _same_shape(spec, traced):
        spec = traced  # the classes the forward really returned (OrderedDict, ModelOutput)
    names = key_paths(spec)
    for leaf, path in zip(leaves, names):
        if not isinstance(leaf, (fx.Node, *CONSTANTS)):
            raise ConfigError(f"model output {path} is a {type(leaf).__name__}; the leaves of a model's output "
                              "must be tensors (or constants: None, bool, int, float, str)")
    made = [n for n in gm.graph.nodes if n.op == "call_function" and _is_namedtuple(n.target)]
    out.args = (tuple(leaves),)
    for node in reversed(made):  # the namedtuple constructors only the output read are dead now
        if not node.users:
            gm.graph.erase_node(node)
    gm.meta[GM_OUTPUT_SPEC] = spec
    gm.recompile()
    return gm


def _is_namedtuple(target: Any) -> bool:
    return isinstance(target, type) and issubclass(target, tuple) and hasattr(target, "_fields")


def _constructed(arg: Any, out: fx.Node) -> Any:
    """``arg`` with each namedtuple the graph builds (torch.fx records ``NT(a, b)`` as a call of the
    class) and only the output reads as that namedtuple of its arguments."""
    if isinstance(arg, fx.Node):
        if (arg.op == "call_function" and _is_namedtuple(arg.target) and set(arg.users) == {out}
                and len(arg.args) + len(arg.kwargs) == len(arg.target._fields)):
            values = dict(zip(arg.target._fields, arg.args), **arg.kwargs)
            if set(values) == set(arg.target._fields):
                return arg.target(**{k: _constructed(values[k], out) for k in arg.target._fields})
        return arg
    if isinstance(arg, tuple) and hasattr(arg, "_fields"):
        return type(arg)(*(_constructed(a, out) for a in arg))
    if isinstance(arg, (tuple, list)):
        return type(arg)(_constructed(a, out) for a in arg)
    if isinstance(arg, dict):
        return {k: _constructed(v, out) for k, v in arg.items()}
    return arg


def check_output_leaves(gm: fx.GraphModule, is_tensor: Callable[[fx.Node], bool]) -> None:
    """ConfigError naming the key path of an output leaf that is a graph value but not a tensor
    (``x.size(0)``, a string a leaf module returns): only tensors and constants are outputs."""
    spec = gm.meta.get(GM_OUTPUT_SPEC)
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if spec is None or out is None:
        return
    for leaf, path in zip(out.args[0], key_paths(spec)):
        if isinstance(leaf, fx.Node) and not is_tensor(leaf):
            raise ConfigError(f"model output {path} (node {leaf.name!r}) is not a tensor; the leaves of a model's "
                              "output must be tensors or constants (None, bool, int, float, str): return it as a "
                              "tensor, or leave it out of the output")


def _plain(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` with fx's immutable containers as the plain dict and list they stand for."""
    if spec.is_leaf():
        return spec
    typ = {immutable_dict: dict, immutable_list: list}.get(spec.type, spec.type)
    return pytree.TreeSpec(typ, spec.context, [_plain(c) for c in spec.children()])


def _dict_like(spec: pytree.TreeSpec) -> bool:
    return spec.type is dict or spec.type is collections.OrderedDict or (
        isinstance(spec.context, list) and isinstance(spec.type, type) and issubclass(spec.type, dict))


def _same_shape(graph_spec: pytree.TreeSpec, traced: pytree.TreeSpec) -> bool:
    """Whether the traced structure is the graph's with (maybe) other dict classes: same leaves, keys, nesting."""
    if graph_spec.is_leaf() or traced.is_leaf():
        return graph_spec.is_leaf() and traced.is_leaf()
    if graph_spec.num_children != traced.num_children:
        return False
    if graph_spec.type is dict and _dict_like(traced):
        if list(graph_spec.context) != list(traced.context):
            return False
    elif graph_spec.type != traced.type:
        return False
    return all(_same_shape(a, b) for a, b in zip(graph_spec.children(), traced.children()))


# ---------------------------------------------------------------------------- names


def _parts(spec: pytree.TreeSpec) -> list[list[Any]]:
    """Per leaf, the keys leading to it from the root (dict keys, field names, indices)."""
    if spec.is_leaf():
        return [[]]
    if spec.type is type(None):
        return []
    keys = _child_keys(spec)
    return [[k, *rest] for k, child in zip(keys, spec.children()) for rest in _parts(child)]


def _namedtuple_class(spec: pytree.TreeSpec) -> Optional[type]:
    """The namedtuple class of a spec node (pytree keys namedtuples by ``collections.namedtuple``, the
    class in the context), else None."""
    if spec.type is collections.namedtuple and _is_namedtuple(spec.context):
        return spec.context
    return spec.type if _is_namedtuple(spec.type) else None


def _child_keys(spec: pytree.TreeSpec) -> list[Any]:
    cls = _namedtuple_class(spec)
    if cls is not None:
        return list(cls._fields)
    if isinstance(spec.context, (list, tuple)) and len(spec.context) == spec.num_children:
        return list(spec.context)
    return list(range(spec.num_children))


def key_paths(spec: pytree.TreeSpec, root: str = "output") -> list[str]:
    """Per leaf, where it sits, as an error message names it: ``output['aux']``, ``output[0][1]``."""
    return [root + "".join(f"[{k!r}]" for k in parts) for parts in _parts(spec)]


def leaf_names(spec: pytree.TreeSpec, single: str = "output") -> list[str]:
    """Per leaf, a name saying where it came from: the keys and indices joined by "." (``out``, ``aux``,
    ``last_hidden_state``, ``0.1``); ``single`` for a spec that is one leaf. Names are made distinct
    with a ``_<n>`` suffix where keys would give the same name twice."""
    names, seen = [], set()
    for parts in _parts(spec):
        name = ".".join(str(k) for k in parts) or single
        base, n = name, 1
        while name in seen:
            name, n = f"{base}_{n}", n + 1
        seen.add(name)
        names.append(name)
    return names


def input_leaf_names(spec: pytree.TreeSpec, defaults: Sequence[str]) -> list[str]:
    """Names of the leaves of an ``(args, kwargs)`` input spec: a keyword input by its keyword (and the
    keys below it: ``pixel_values``, ``past.0``), a positional one by ``defaults[i]`` (the graph's own
    name of leaf i). ``defaults`` as they are when the spec is not of that form or counts other leaves."""
    parts = _parts(spec)
    if spec.type is not tuple or spec.num_children != 2 or len(parts) != len(defaults):
        return list(defaults)
    names = [".".join(str(k) for k in p[1:]) if p[0] == 1 and len(p) > 1 else d for p, d in zip(parts, defaults)]
    return names if len(set(names)) == len(names) else list(defaults)


# ---------------------------------------------------------------------------- JSON codec


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def spec_to_json(spec: pytree.TreeSpec, where: str = "output") -> dict:
    """``spec`` as JSON: ``{"type": "leaf"}``, ``{"type": "tuple"|"list", "children": [...]}``,
    ``{"type": "dict"|"ordered_dict", "keys": [...], ...}``, a namedtuple with its ``class`` and
    ``fields``, a registered dict class (``ModelOutput``) with its ``class`` and ``keys``, and
    ``{"type": "none"}``. A structure of another kind is a ConfigError naming it."""
    if spec.is_leaf():
        return {"type": "leaf"}
    children = [spec_to_json(c, where) for c in spec.children()]
    typ = spec.type
    if typ is type(None):
        return {"type": "none"}
    if typ in (tuple, list):
        return {"type": typ.__name__, "children": children}
    if typ is dict or typ is collections.OrderedDict:
        return {"type": "dict" if typ is dict else "ordered_dict", "keys": _json_keys(spec.context, where),
                "children": children}
    cls = _namedtuple_class(spec)
    if cls is not None:
        return {"type": "namedtuple", "class": _class_name(cls), "fields": list(cls._fields), "children": children}
    if isinstance(typ, type) and isinstance(spec.context, list) and len(spec.context) == len(children):
        return {"type": "class", "class": _class_name(typ), "keys": _json_keys(spec.context, where),
                "children": children}
    raise ConfigError(f"{where}: a {getattr(typ, '__name__', typ)} in the model's structure cannot be saved (dicts, "
                      "OrderedDicts, namedtuples, tuples, lists and ModelOutput-like dict classes can)")


def _json_keys(keys: Any, where: str) -> list:
    keys = list(keys)
    bad = [k for k in keys if not isinstance(k, (str, int)) or isinstance(k, bool)]
    if bad:
        raise ConfigError(f"{where}: the dict key {bad[0]!r} cannot be saved; keys must be str or int")
    return keys


def spec_from_json(data: Any, where: str = "output_spec") -> pytree.TreeSpec:
    """The TreeSpec :func:`spec_to_json` wrote. Classes come from already imported modules only;
    one not found (or not of the kind recorded) is rebuilt as the closest plain structure, with a
    QCompilerWarning naming it. A malformed spec is an ArtifactError naming ``where``."""
    check_spec_json(data, where)
    return _decode(data, where)


def check_spec_json(data: Any, where: str, depth: int = 0) -> None:
    """The form of a JSON spec (an artifact is untrusted): ArtifactError naming the bad part."""
    if depth > MAX_DEPTH:
        raise ArtifactError(f"{where}: nested deeper than {MAX_DEPTH}")
    kinds = {"leaf": (), "none": (), "tuple": ("children",), "list": ("children",),
             "dict": ("keys", "children"), "ordered_dict": ("keys", "children"),
             "namedtuple": ("class", "fields", "children"), "class": ("class", "keys", "children")}
    if not isinstance(data, dict) or data.get("type") not in kinds:
        raise ArtifactError(f"{where}: {str(data)[:80]} is not a structure spec (type one of {', '.join(kinds)})")
    for key in kinds[data["type"]]:
        if not isinstance(data.get(key), str if key == "class" else list):
            raise ArtifactError(f"{where}: the {data['type']} spec needs {key!r}")
    if "class" in data and ":" not in data["class"]:
        raise ArtifactError(f"{where}: class {data['class'][:80]!r} is not 'module:qualname'")
    for key in ("keys", "fields"):
        if key in data:
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in data[key]):
                raise ArtifactError(f"{where}: {key} must be strings or ints")
            if len(data[key]) != len(data["children"]):
                raise ArtifactError(f"{where}: {len(data[key])} {key} for {len(data['children'])} children")
    for i, child in enumerate(data.get("children", [])):
        check_spec_json(child, f"{where}[{i}]", depth + 1)


def spec_leaf_count(data: dict) -> int:
    """The number of leaves of a checked JSON spec."""
    if data["type"] == "leaf":
        return 1
    return sum(spec_leaf_count(c) for c in data.get("children", []))


def resolve_class(name: str) -> Optional[type]:
    """The class ``module:qualname`` names, from ``sys.modules`` only (nothing is imported); None if absent."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part.startswith("<"):
            return None
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _decode(data: dict, where: str) -> pytree.TreeSpec:
    kind = data["type"]
    if kind == "leaf":
        return pytree.treespec_leaf()
    if kind == "none":
        return pytree.TreeSpec(type(None), None, [])
    children = [_decode(c, f"{where}[{i}]") for i, c in enumerate(data["children"])]
    if kind in ("tuple", "list"):
        return pytree.TreeSpec(tuple if kind == "tuple" else list, None, children)
    if kind in ("dict", "ordered_dict"):
        return pytree.TreeSpec(dict if kind == "dict" else collections.OrderedDict, list(data["keys"]), children)
    cls = resolve_class(data["class"])
    if kind == "namedtuple":
        if _is_namedtuple(cls) and list(cls._fields) == data["fields"]:
            return pytree.TreeSpec(collections.namedtuple, cls, children)
        _warn_plain(data["class"], "a tuple", where)
        return pytree.TreeSpec(tuple, None, children)
    if cls is not None and cls in pytree.SUPPORTED_NODES and issubclass(cls, dict):
        return pytree.TreeSpec(cls, list(data["keys"]), children)
    _warn_plain(data["class"], "an OrderedDict", where)
    return pytree.TreeSpec(collections.OrderedDict, list(data["keys"]), children)


def _warn_plain(name: str, plain: str, where: str) -> None:
    module = name.partition(":")[0]
    warnings.warn(f"{where}: class {name} is not available (module {module!r} is not imported, or it has no such "
                  f"class), so this part of the output comes back as {plain}; import {module} before loading to get "
                  "the class back (qcompiler never imports a module a file names)", QCompilerWarning, stacklevel=4)


# ---------------------------------------------------------------------------- calls


def unflatten(values: Sequence[Any], spec: Optional[pytree.TreeSpec]) -> Any:
    """The flat ``values`` in ``spec``'s structure (``values`` as they are without a spec)."""
    if spec is None:
        return values
    return pytree.tree_unflatten(list(values), spec)


def bind_structured(spec: pytree.TreeSpec, args: Sequence[Any], kwargs: dict, where: str) -> tuple:
    """A call's ``args`` and ``kwargs`` as the flat leaves of the input ``spec`` (an ``(args, kwargs)``
    TreeSpec): keywords in any order, positional values past the spec's own filling its keywords in
    order (``cm(ids, mask)`` for ``example_inputs={"input_ids": ..., "attention_mask": ...}``). A keyword
    the spec has not, one given twice or left out, or a structure other than the example's, is a
    ConfigError naming it."""
    args, kwargs = list(args), dict(kwargs)
    if spec.type is not tuple or spec.num_children != 2 or spec.child(1).type is not dict:
        leaves, got = pytree.tree_flatten((tuple(args), kwargs))
        if got != spec:
            raise ConfigError(f"{where}: the inputs' structure {got} is not the example inputs' {spec}")
        return tuple(leaves)
    args_spec, kw_spec = spec.children()
    n_pos, keys = args_spec.num_children, list(kw_spec.context)
    listed = ", ".join([*(f"positional {i}" for i in range(n_pos)), *keys]) or "none"
    extra, args = args[n_pos:], args[:n_pos]
    free = [k for k in keys if k not in kwargs]
    if len(extra) > len(free):
        raise ConfigError(f"{where}: {n_pos + len(extra) + len(kwargs)} inputs given; the model takes "
                          f"{n_pos + len(keys)} ({listed})")
    for key, value in zip(free, extra):
        kwargs[key] = value
    unknown = [k for k in kwargs if k not in keys]
    if unknown:
        raise ConfigError(f"{where}: keyword argument {unknown[0]!r} names no input of the model; its inputs are "
                          f"{listed}")
    missing = [f"positional input {i}" for i in range(len(args), n_pos)] + [repr(k) for k in keys if k not in kwargs]
    if missing:
        raise ConfigError(f"{where}: input {', '.join(missing)} missing; the model takes {listed}")
    leaves, got = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in keys}))
    if got != spec:
        paths = key_paths(spec, "inputs")
        raise ConfigError(f"{where}: the inputs' structure differs from the example inputs' (leaves: "
                          f"{', '.join(paths)}); pass the same nesting of tensors")
    # the graph's inputs are the tensor leaves (qcompiler.ir.shape_prop.KeywordInputs): other leaves of
    # the example (None, a flag) are constants of the captured graph
    return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def flatten_like(value: Any, spec: Optional[pytree.TreeSpec]) -> Any:
    """A structured value (what the float model returns) as the flat tuple of its leaves, the way a
    graph with ``spec`` returns it; ``value`` as it is without a spec or when it is flat already."""
    if spec is None or not is_structured(value):
        return value
    return tuple(pytree.tree_leaves(value))


__all__ = ["flatten_output", "check_output_leaves", "recording_output", "mark_traced_output", "spec_to_json",
           "spec_from_json", "check_spec_json", "leaf_names", "input_leaf_names", "key_paths", "unflatten",
           "flatten_like", "bind_structured", "resolve_class", "is_structured"]
