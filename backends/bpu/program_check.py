"""Checks of a BPU program read from an artifact, before the simulator compiles it.

A program that comes from a file is untrusted data: every op's attrs and tensors are
checked against what its kind needs (:data:`ATTRS`, :func:`_tensor_rules`), so a
malformed or edited program is an :class:`~qcompiler.errors.ArtifactError` naming the
program, the op and the attr or tensor, at load -- never a KeyError, a broadcast that
silently changes the result, or a failure deep inside a kernel at call time.

The checks are about form (types, ranges, dtypes, ranks, and the sizes that tensors of
one op must share); a consistent program that computes something else is a different
model, which no check can tell from the intended one.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from qcompiler.errors import ArtifactError
from qcompiler.quantization import fixed_point as fp

__all__ = ["check_program", "check_attrs", "check_declaration", "expect_keys", "short", "ATTRS", "MAX_INT",
           "ITEMSIZE"]

MAX_INT = 1 << 31  # every integer attr (sizes, strides, dims) lies in (-MAX_INT, MAX_INT)
MAX_INDEX_DEPTH = 32
_QDTYPES = ("qint8", "qint16", "qint32")
_STORAGE = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}
_QRANGE_SIZE = {"qint8": 1 << 8, "qint16": 1 << 16}
_M_LIMIT = 1 << 31  # |M| < 2**31 (requant_params with mult_bits <= 31): int64 products cannot overflow
_N_LIMIT = 62  # 0 <= n <= 62 (requant_params' max_shift)

# ---------------------------------------------------------------------------- attr checkers
# each returns None when the value is fine, else what was expected


def _int(lo: int = -MAX_INT, hi: int = MAX_INT) -> Callable[[Any], Optional[str]]:
    def check(v):
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi
        return None if ok else f"an int in [{lo}, {hi})"
    return check


def _pair(lo: int) -> Callable[[Any], Optional[str]]:
    elem = _int(lo)

    def check(v):
        ok = isinstance(v, list) and len(v) == 2 and all(elem(x) is None for x in v)
        return None if ok else f"a list of two ints >= {lo}"
    return check


def _padding(v) -> Optional[str]:
    """[h, w], or the four sides [top, left, bottom, right] (fixed_point.pads4) of a folded F.pad."""
    ok = isinstance(v, list) and len(v) in (2, 4) and all(_int(0)(x) is None for x in v)
    return None if ok else "a list of two ints >= 0 (h, w) or four (top, left, bottom, right)"


def _bool(v) -> Optional[str]:
    return None if isinstance(v, bool) else "true or false"


def _pos_float(v) -> Optional[str]:
    ok = isinstance(v, float) and math.isfinite(v) and v > 0
    return None if ok else "a finite float > 0"


def _float(v) -> Optional[str]:
    return None if isinstance(v, float) and math.isfinite(v) else "a finite float"


def _choice(*values) -> Callable[[Any], Optional[str]]:
    def check(v):
        return None if any(v is x or (type(v) is type(x) and v == x) for x in values) else f"one of {values}"
    return check


def _optional(inner) -> Callable[[Any], Optional[str]]:
    def check(v):
        return None if v is None else inner(v)
    return check


def _int_list(lo: int = -MAX_INT, max_len: int = 8) -> Callable[[Any], Optional[str]]:
    elem = _int(lo)

    def check(v):
        ok = isinstance(v, list) and len(v) <= max_len and all(elem(x) is None for x in v)
        return None if ok else f"a list of at most {max_len} ints >= {lo}"
    return check


def _index(v, depth: int = 0) -> Optional[str]:
    """An encoded getitem index (program.encode_index)."""
    bad = "an encoded static index (int, or {'t': none|ellipsis|slice|tuple|list})"
    if depth > MAX_INDEX_DEPTH:
        return f"{bad} nested at most {MAX_INDEX_DEPTH} deep"
    if isinstance(v, int) and not isinstance(v, bool):
        return None if _int()(v) is None else bad
    if not isinstance(v, dict) or not isinstance(v.get("t"), str):
        return bad
    t = v["t"]
    if t in ("none", "ellipsis"):
        return None if set(v) == {"t"} else bad
    items = v.get("v")
    if t == "slice":
        ok = isinstance(items, list) and len(items) == 3 and all(x is None or _int()(x) is None for x in items) \
            and items[2] != 0
        return None if ok else bad
    if t == "list":
        return None if _int_list(max_len=MAX_INT)(items) is None else bad
    if t == "tuple" and isinstance(items, list):
        for x in items:
            err = _index(x, depth + 1)
            if err:
                return err
        return None
    return bad


def _sorted_dims(v) -> Optional[str]:
    """reduce's dims: a list of distinct ints in [0, 8), ascending (fixed_point.reduce_dims)."""
    ok = _int_list(0)(v) is None and all(0 <= d < 8 for d in v) and list(v) == sorted(set(v))
    return None if ok else "an ascending list of distinct dims in [0, 8)"


_QDTYPE = _choice(*_QDTYPES)
_QMAX = {"qint8": 127, "qint16": 32767}
_ACT = _choice(None, "relu", "relu6")
_WEIGHT_LAYER = {"high_precision": _bool, "act": _ACT, "with_add": _bool, "in_scale": _pos_float}
_CONV = {"stride": _pair(1), "padding": _pair(0), "dilation": _pair(1), "groups": _int(1)}
_POOL = {"kernel_size": _pair(1), "stride": _pair(1), "padding": _pair(0)}

# op kind -> {attr: checker}; every kind but dequantize also has out_dtype / out_scale / out_axis
ATTRS: dict[str, dict[str, Callable[[Any], Optional[str]]]] = {
    "quantize": {},
    "dequantize": {},
    "requantize": {"in_scale": _pos_float},
    "conv2d": {**_WEIGHT_LAYER, **_CONV, "padding": _padding},
    "conv_transpose2d": {**_WEIGHT_LAYER, **_CONV, "output_padding": _pair(0)},
    "linear": dict(_WEIGHT_LAYER),
    "matmul": {},
    "add": {},
    "sub": {},
    "mul": {},
    "div": {"b_dtype": _choice("qint8", "qint16"), "a_scale": _pos_float, "b_scale": _pos_float},
    "cat": {"dim": _int()},
    "constant": {},
    "relu": {},
    "relu6": {"max": _int(0)},
    "prelu": {"axis": _optional(_int())},
    "leaky_relu": {"axis": _optional(_int())},
    "max_pool2d": {**_POOL, "dilation": _pair(1), "ceil_mode": _bool},
    "avg_pool2d": {**_POOL, "padding": _padding},
    "global_avg_pool": {"in_scale": _pos_float, "keepdim": _bool},
    "resize_nearest": {"size": _pair(1), "in_scale": _pos_float},
    "resize_bilinear": {"size": _pair(1), "in_scale": _pos_float, "align_corners": _bool},
    "lut": {"in_dtype": _choice("qint8", "qint16")},
    "identity": {},
    "reshape": {"shape": _int_list(-1)},
    "flatten": {"start_dim": _int(), "end_dim": _int()},
    "squeeze": {"dim": _optional(_int())},
    "unsqueeze": {"dim": _int()},
    "permute": {"dims": _int_list()},
    "transpose": {"dim0": _int(), "dim1": _int()},
    "getitem": {"index": _index},
    # --- layer_norm (nash)
    "layer_norm": {"dims": _int(1, 6), "in_dtype": _choice("qint8", "qint16"), "in_scale": _pos_float},
    # --- softmax (nash)
    "softmax": {"dim": _int(-8, 8), "in_dtype": _choice("qint8", "qint16")},
    "log_softmax": {"dim": _int(-8, 8), "in_dtype": _choice("qint8", "qint16")},
    # nash reductions: dims sorted, non-negative, each once (fixed_point.reduce_dims)
    "reduce": {"mode": _choice("sum", "mean", "amax", "amin"), "dims": _sorted_dims, "keepdim": _bool},
    # --- masked_softmax (nash)
    "masked_softmax": {"dim": _int(-8, 8), "fill_mask_is_true": _bool, "in_dtype": _choice("qint8", "qint16")},
}


def _out_attrs(op) -> dict:
    a = op.attrs
    if a.get("high_precision") is True:
        return {"out_dtype": _choice("qint32"), "out_axis": _int(),
                "out_scale": lambda v: None if isinstance(v, list) and v and all(_pos_float(x) is None for x in v)
                else "a non-empty list of finite floats > 0 (per-channel accumulator scales)"}
    return {"out_dtype": _QDTYPE, "out_axis": _optional(_int()), "out_scale": _pos_float}


def check_attrs(op, where: str) -> None:
    """ArtifactError unless ``op``'s attrs have the keys and value types its kind needs."""
    rules = dict(ATTRS[op.kind])
    if op.kind != "dequantize":
        rules.update(_out_attrs(op))
    if op.kind in ("conv2d", "conv_transpose2d", "linear") and op.attrs.get("act") == "relu6":
        # the relu6 top is a code of the output type: a larger one would wrap in a narrowing store
        rules["act_max"] = _int(0, _QMAX.get(op.attrs.get("out_dtype"), MAX_INT - 1) + 1)
    if op.kind in ("add", "sub", "mul") and "constant" in op.tensors:
        rules["constant_index"] = _choice(0, 1)
    if op.kind == "mul" and len(op.inputs) == 1 and "constant" not in op.tensors:
        rules["sign"] = _choice(-1, 1)
    for key, check in rules.items():
        if key not in op.attrs:
            raise ArtifactError(f"{where}: attr '{key}' is missing")
        err = check(op.attrs[key])
        if err is not None:
            raise ArtifactError(f"{where}: attr '{key}' is {short(op.attrs[key])}, expected {err}")


# ---------------------------------------------------------------------------- tensors


class _Spec:
    """What one tensor must be: dtypes, shape (None entries: any size), required, value range."""

    def __init__(self, dtypes, shape=None, required=True, values=None, rank=None):
        self.dtypes, self.shape, self.required, self.values, self.rank = dtypes, shape, required, values, rank


_I64 = (torch.int64,)
_SCALAR_M = _Spec(_I64, (), values=(-_M_LIMIT + 1, _M_LIMIT - 1))
_SCALAR_N = _Spec(_I64, (), values=(0, _N_LIMIT))


def _weight_layer_rules(op, where: str) -> dict[str, _Spec]:
    a, T = op.attrs, op.tensors
    w = T.get("weight")
    if w is None:
        raise ArtifactError(f"{where}: tensor 'weight' is missing")
    rank = 2 if op.kind == "linear" else 4
    if w.dim() != rank or w.numel() == 0:
        raise ArtifactError(f"{where}: tensor 'weight' has shape {list(w.shape)}, expected {rank} non-zero dims")
    groups = int(a.get("groups", 1)) if isinstance(a.get("groups", 1), int) else 1
    if op.kind == "conv_transpose2d":
        if w.shape[0] % groups:
            raise ArtifactError(f"{where}: weight {list(w.shape)}: {w.shape[0]} input channels do not split "
                                f"into groups={groups}")
        n_out = w.shape[1] * groups
    else:
        n_out = w.shape[0]
        if n_out % groups:
            raise ArtifactError(f"{where}: weight {list(w.shape)}: {n_out} output channels do not split into "
                                f"groups={groups}")
    rules = {"weight": _Spec((torch.int8,), tuple(w.shape)),
             "bias": _Spec((torch.int32,), (n_out,), required=False)}
    if a.get("high_precision") is True:
        if isinstance(a.get("out_scale"), list) and len(a["out_scale"]) != n_out:
            raise ArtifactError(f"{where}: attr 'out_scale' has {len(a['out_scale'])} per-channel scales, "
                                f"expected {n_out} (the weight's output channels)")
        return rules
    rules["M"] = _Spec(_I64, (n_out,), values=(-_M_LIMIT + 1, _M_LIMIT - 1))
    rules["n"] = _Spec(_I64, (n_out,), values=(0, _N_LIMIT))
    if a.get("with_add") is True:
        rules["Mb"], rules["nb"] = _SCALAR_M, _SCALAR_N
    return rules


def _tensor_rules(op, where: str) -> dict[str, _Spec]:
    """name -> _Spec of every tensor ``op`` may hold (extra names are refused)."""
    k, a = op.kind, op.attrs
    if k in ("conv2d", "conv_transpose2d", "linear"):
        return _weight_layer_rules(op, where)
    if k in ("matmul", "avg_pool2d", "requantize"):
        return {"M": _SCALAR_M, "n": _SCALAR_N}
    const = _Spec((torch.int8, torch.int16, torch.int32), required=False, rank=(0, 6))
    if k in ("add", "sub"):
        return {"Ma": _SCALAR_M, "na": _SCALAR_N, "Mb": _SCALAR_M, "nb": _SCALAR_N, "constant": const}
    if k == "mul":
        return {"M": _SCALAR_M, "n": _SCALAR_N, "constant": const}
    if k == "relu6":
        return {"M": _Spec(_I64, (), required=False, values=(-_M_LIMIT + 1, _M_LIMIT - 1)),
                "n": _Spec(_I64, (), required=False, values=(0, _N_LIMIT))}
    if k in ("prelu", "leaky_relu"):
        per_channel = a.get("axis") is not None
        shape = (None,) if per_channel else ()
        return {"Mp": _SCALAR_M, "np": _SCALAR_N,
                "Mn": _Spec(_I64, shape, values=(-_M_LIMIT + 1, _M_LIMIT - 1)),
                "nn": _Spec(_I64, shape, values=(0, _N_LIMIT))}
    if k == "cat":
        n_in = len(op.inputs)
        return {"M": _Spec(_I64, (n_in,), values=(-_M_LIMIT + 1, _M_LIMIT - 1)),
                "n": _Spec(_I64, (n_in,), values=(0, _N_LIMIT))}
    if k == "div":
        size = _QRANGE_SIZE.get(a.get("b_dtype"), 0)
        return {"M": _Spec(_I64, (size,), values=(-_M_LIMIT + 1, _M_LIMIT - 1)),
                "n": _Spec(_I64, (size,), values=(0, _N_LIMIT))}
    if k == "reduce":  # sum / mean requantize once; amax / amin select (no tensors)
        return {"M": _SCALAR_M, "n": _SCALAR_N} if a.get("mode") in ("sum", "mean") else {}
    if k == "lut":
        size = _QRANGE_SIZE.get(a.get("in_dtype"), 0)
        return {"table": _Spec((_STORAGE.get(a.get("out_dtype"), torch.int8),), (size,))}
    if k == "constant":
        return {"value": _Spec((_STORAGE.get(a.get("out_dtype"), torch.int8),), rank=(0, 6))}
    if k == "layer_norm":
        return _layer_norm_rules(op, where)
    if k in ("softmax", "log_softmax", "masked_softmax"):  # int_softmax bounds: E <= 2**16, M < 2**24, n <= 30
        rules = {"table": _Spec((torch.int32,), (None,), values=(0, 1 << 16)),
                 "M": _Spec(_I64, (), values=(1, (1 << 24) - 1)), "n": _Spec(_I64, (), values=(0, 30))}
        if k == "log_softmax":  # int_log_softmax: w = log_k + log_f + d*M < 2**62
            rules["log_k"] = _Spec(_I64, (17,), values=(0, 1 << 60))
            rules["log_f"] = _Spec(_I64, ((1 << 15) + 1,), values=(0, 1 << 60))
        return rules
    return {}


def _layer_norm_rules(op, where: str) -> dict[str, _Spec]:
    """layer_norm: M, n, B of one normalized shape (attrs['dims'] dims, at most LN_MAX_GROUP elements)
    in the kernel's ranges, and the scalar eps units (fixed_point.int_layer_norm)."""
    M = op.tensors.get("M")
    if M is None:
        raise ArtifactError(f"{where}: tensor 'M' is missing")
    dims = op.attrs.get("dims")
    if M.dim() != dims or not 1 <= M.numel() <= fp.LN_MAX_GROUP:
        raise ArtifactError(f"{where}: tensor 'M' has shape {list(M.shape)}, expected {dims} dims holding "
                            f"1..{fp.LN_MAX_GROUP} elements")
    shape = tuple(M.shape)
    return {"M": _Spec(_I64, shape, values=(-(1 << fp.LN_MULT_BITS) + 1, (1 << fp.LN_MULT_BITS) - 1)),
            "n": _Spec(_I64, shape, values=(0, fp.LN_MAX_SHIFT)),
            "B": _Spec(_I64, shape, values=(-fp.LN_BIAS_LIMIT, fp.LN_BIAS_LIMIT)),
            "eps": _Spec(_I64, (), values=(0, fp.LN_MAX_EPS_UNITS))}


def _arity(op) -> set[int]:
    """How many values ``op`` reads (its kernel's positional arguments)."""
    k, a, T = op.kind, op.attrs, op.tensors
    if k in ("conv2d", "conv_transpose2d", "linear"):
        return {2 if a.get("with_add") is True else 1}
    if k in ("add", "sub", "mul"):
        return {1} if "constant" in T or (k == "mul" and "sign" in a) else {2}
    if k in ("matmul", "div"):
        return {2}
    if k == "cat":
        return {len(T["M"])} if "M" in T and T["M"].dim() == 1 and len(T["M"]) > 0 else {1}
    if k == "constant":
        return {0}
    if k == "masked_softmax":  # scores, mask codes
        return {2}
    return {1}


def _check_tensor(name: str, t: torch.Tensor, spec: _Spec, where: str) -> None:
    what = f"{where}: tensor '{name}'"
    if t.dtype not in spec.dtypes:
        raise ArtifactError(f"{what} is {str(t.dtype).replace('torch.', '')}, expected "
                            + " or ".join(str(d).replace("torch.", "") for d in spec.dtypes))
    if spec.shape is not None:
        ok = t.dim() == len(spec.shape) and all(s is None or s == d for s, d in zip(spec.shape, t.shape))
        if not ok:
            want = "[" + ", ".join("N" if s is None else str(s) for s in spec.shape) + "]"
            raise ArtifactError(f"{what} has shape {list(t.shape)}, expected {want}")
    if spec.rank is not None and not spec.rank[0] <= t.dim() <= spec.rank[1]:
        raise ArtifactError(f"{what} has {t.dim()} dims, expected {spec.rank[0]} to {spec.rank[1]}")
    if spec.values is not None and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < spec.values[0] or hi > spec.values[1]:
            raise ArtifactError(f"{what} holds values in [{lo}, {hi}], expected [{spec.values[0]}, "
                                f"{spec.values[1]}]")


def check_program(program) -> None:
    """ArtifactError naming the op and attr/tensor unless every op of ``program`` is well formed."""
    for i, op in enumerate(program.ops):
        where = f"BPU program '{program.name}' op {i} '{op.output}' ({op.kind})"
        check_attrs(op, where)
        want = _arity(op)
        if len(op.inputs) not in want:
            raise ArtifactError(f"{where}: reads {len(op.inputs)} values, expected "
                                f"{' or '.join(map(str, sorted(want)))}")
        rules = _tensor_rules(op, where)
        for name, t in op.tensors.items():
            if name not in rules:
                raise ArtifactError(f"{where}: unexpected tensor '{name}' (this kind holds "
                                    f"{', '.join(rules) or 'no tensors'})")
            _check_tensor(name, t, rules[name], where)
        for name, spec in rules.items():
            if spec.required and name not in op.tensors:
                raise ArtifactError(f"{where}: tensor '{name}' is missing")
    for v in list(program.inputs) + list(program.outputs):
        _check_value_spec(v, f"BPU program '{program.name}' value '{v.name}'")
    for op in program.ops:
        if op.kind != "dequantize":
            _check_value_spec(op.out_spec(), f"BPU program '{program.name}' value '{op.output}'")
    _check_flow(program)


def _check_flow(program) -> None:
    """What each op reads: quantize a float value, dequantize any integer value, every other op
    per-tensor integers (int8/int16 for weight layers); outputs as the ops make them."""
    specs = program.value_specs()
    for i, op in enumerate(program.ops):
        where = f"BPU program '{program.name}' op {i} '{op.output}' ({op.kind})"
        for name in op.inputs:
            s = specs[name]
            if op.kind == "quantize":
                ok, want = s.is_float, "a float (f32) value"
            elif op.kind == "dequantize":
                ok, want = not s.is_float, "an integer value"
            elif op.kind in ("conv2d", "conv_transpose2d", "linear"):
                ok, want = s.dtype in ("qint8", "qint16") and not s.per_channel, "a per-tensor qint8/qint16 value"
            else:
                ok, want = not s.is_float and not s.per_channel, "a per-tensor integer value"
            if not ok:
                raise ArtifactError(f"{where}: reads '{name}' ({s.describe()}), expected {want}")
    for v in program.outputs:
        made = specs[v.name]
        if (made.dtype, made.scale, made.axis) != (v.dtype, v.scale, v.axis):
            raise ArtifactError(f"BPU program '{program.name}': output '{v.name}' is declared "
                                f"{v.describe()} but computed as {made.describe()}")


def _check_value_spec(v, where: str) -> None:
    if v.is_float:
        return
    if v.per_channel:
        if not v.scale or any(_pos_float(s) for s in v.scale) or _int()(v.axis):
            raise ArtifactError(f"{where}: per-channel scales must be finite floats > 0 with an int axis")
    elif _pos_float(v.scale) is not None:
        raise ArtifactError(f"{where}: scale is {short(v.scale)}, expected a finite float > 0")


# ---------------------------------------------------------------------------- JSON helpers (also for artifact.py)

ITEMSIZE = {"int8": 1, "int16": 2, "int32": 4, "int64": 8}  # the dtypes program tensors may have


def short(v: Any) -> str:
    """``repr(v)`` cut to 60 characters, for messages about untrusted values."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def expect_keys(d: Any, types: dict[str, type], where: str) -> None:
    """ArtifactError unless ``d`` is a JSON object with each key of ``types`` of that type
    (a bool is not an int)."""
    if not isinstance(d, dict):
        raise ArtifactError(f"{where}: expected a JSON object, got {short(d)}")
    for key, typ in types.items():
        if key not in d:
            raise ArtifactError(f"{where}: '{key}' is missing")
        if not isinstance(d[key], typ) or (isinstance(d[key], bool) and typ is not bool):
            raise ArtifactError(f"{where}: '{key}' is {short(d[key])}, expected a JSON {typ.__name__}")


def check_declaration(decl: Any, where: str) -> str:
    """A tensor declaration ``{"name", "dtype", "shape"}`` (an integer dtype, at most 8 dims,
    each in [0, 2**31)); returns the name."""
    expect_keys(decl, {"name": str, "dtype": str, "shape": list}, f"{where} tensor declaration")
    name, dtype, shape = decl["name"], decl["dtype"], decl["shape"]
    if dtype not in ITEMSIZE or len(shape) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_INT for d in shape):
        raise ArtifactError(f"{where}: tensor {short(name)} declares {short(dtype)} {short(shape)}; expected "
                            f"{', '.join(ITEMSIZE)} and at most 8 dims, each in [0, 2**31)")
    return name
