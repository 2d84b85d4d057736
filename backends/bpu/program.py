"""A BPU program as plain data: what ``lower`` produces and the simulator runs.

A :class:`BpuProgram` is a straight-line list of :class:`BpuOp` over named
values.  Every value is an integer tensor with static quantization
parameters (symmetric, zero point 0), except the float inputs that a
``quantize`` op consumes and the float results of ``dequantize``:

* ``inputs`` / ``outputs`` are :class:`ValueSpec` (name, dtype, scale, axis);
  dtype is ``"qint8"``/``"qint16"``/``"qint32"`` or ``"f32"``.
* each op names its input values and its one output value; ``attrs`` holds
  JSON-able settings (ints, floats, strings, bools, None, lists, and the
  encoded index of ``getitem``); ``tensors`` holds the integer data read from
  the converted model: int8 weights, int32 biases, the requantization
  multipliers ``M`` and shifts ``n`` (int64), lookup tables.
* every op that makes a quantized value records its output quantization in
  ``attrs["out_dtype"]``, ``attrs["out_scale"]`` (a float, or a per-channel
  list) and ``attrs["out_axis"]`` (None for per-tensor).

Op kinds (:data:`OP_KINDS`) mirror the modules of ``qcompiler.nn.quantized``.
The program serialises without pickle: :meth:`BpuProgram.to_state` returns
``(tensors, meta)`` -- a flat ``dict[str, Tensor]`` (for safetensors or
``torch.save(..., weights_only)``) and a JSON-able dict -- and
:meth:`BpuProgram.from_state` rebuilds it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from qcompiler.backends.bpu.program_check import check_declaration, check_program, expect_keys, short
from qcompiler.errors import ArtifactError, ConfigError

__all__ = [
    "OP_KINDS",
    "LAYOUT_KINDS",
    "QUANT_DTYPES",
    "FORMAT_VERSION",
    "ValueSpec",
    "BpuOp",
    "BpuProgram",
    "encode_index",
    "decode_index",
]

FORMAT_VERSION = 2  # 2: each op declares its tensors' dtype and shape

QUANT_DTYPES = ("qint8", "qint16", "qint32")
FLOAT_DTYPE = "f32"

# op kind -> short description (for docs and validation)
OP_KINDS: dict[str, str] = {
    "quantize": "float -> integers: clamp(round_half_even(x / out_scale)) (fixed_point.quantize)",
    "dequantize": "integers -> float32: float32(q) * float32(scale)",
    "requantize": "integers -> integers on another grid: requant(q, M, n) with M/2^n ~= in_scale/out_scale "
                  "(a QuantStub on a quantized value)",
    "conv2d": "int8 conv2d (+bias) (+add) -> requantize (+relu/relu6) | int32 high-precision output",
    "conv_transpose2d": "int8 transposed conv2d, same epilogue as conv2d",
    "linear": "int8 linear, same epilogue as conv2d (channel axis -1)",
    "matmul": "matmul of two feature maps, requantized",
    "add": "a*Ma/2^na + b*Mb/2^nb, one rounding; with one input, tensor 'constant' is the operand at "
           "position attrs['constant_index']",
    "sub": "a*Ma/2^na - b*Mb/2^nb, one rounding; one input: as add",
    "mul": "a*b requantized by M/2^n; one input: a times tensor 'constant' (at attrs['constant_index']), "
           "or sign*a for a number (attrs const, sign)",
    "div": "a * M[b]/2^n[b] from a reciprocal table indexed by b - qmin (fixed_point.int_div); b == 0 "
           "saturates to qmax / qmin by the sign of a (0 for a == 0)",
    "cat": "concat after requantizing input i by M[i]/2^n[i]",
    "constant": "no input: tensor 'value' (integers at the op's out_scale), e.g. a layer's fused add operand",
    "relu": "max(q, 0)",
    "relu6": "clamp(q, 0, attrs['max']); with tensors M, n (its own output scale): "
             "clamp(requant(q, M, n), 0, attrs['max'])",
    "prelu": "q >= 0 ? requant(q, Mp, np) : requant(q, Mn, nn) (per-channel slope on axis 1)",
    "leaky_relu": "as prelu with one slope",
    "max_pool2d": "integer max pool (exact)",
    "avg_pool2d": "integer window sum requantized by M/2^n (count_include_pad)",
    "global_avg_pool": "integer sum over H*W requantized by s_in / (H*W*s_out) (fixed_point); keepdim False "
                       "drops both spatial dims",
    "resize_nearest": "nearest resize, values rescaled by in_scale/out_scale in float64, half-even",
    "resize_bilinear": "bilinear resize in float64 on the integers, rescaled, half-even",
    "lut": "table[q - qmin] (element-wise non-linearity built at convert time)",
    "identity": "the input (identity, dropout in eval, contiguous)",
    "reshape": "reshape/view to attrs['shape']",
    "flatten": "flatten(start_dim, end_dim)",
    "squeeze": "squeeze(dim) (dim None: all size-1 dims)",
    "unsqueeze": "unsqueeze(dim)",
    "permute": "permute(dims)",
    "transpose": "transpose(dim0, dim1)",
    "getitem": "x[index] (static index)",
    # --- layer_norm (nash)
    "layer_norm": "integer layer norm over the last attrs['dims'] dims (fixed_point.int_layer_norm): group sums, "
                  "a table rsqrt, per-element multipliers M/2^n and bias codes B (of the normalized shape), "
                  "tensor 'eps' the eps in variance units",
    # --- softmax (nash)
    "softmax": "along attrs['dim']: E = table[min(max - q, len - 1)], S = sum(E) in int64, "
               "clamp((E*M + (S<<n)//2) // (S<<n)) (fixed_point.int_softmax)",
    "log_softmax": "along attrs['dim']: softmax's E and S, then clamp(-((log_k[c] + log_f[r] + d*M + 2^(n-1)) >> n)) "
                   "with 2^(16+c) <= S the exponent and r the 15-bit mantissa of S (fixed_point.int_log_softmax)",
    # --- nash: reductions over any dims (fixed_point.int_reduce)
    "reduce": "attrs['mode'] sum / mean: the int32 sum over attrs['dims'] requantized by M/2^n (a mean's "
              "1/count folded into M); amax / amin: the largest / smallest code, on the input's grid "
              "(no tensors); keepdim keeps the reduced dims as 1",
    # --- masked_softmax (nash)
    "masked_softmax": "softmax along attrs['dim'] over the positions the mask (input 1, 0/1 codes) keeps "
                      "(filled where the code is 1 if attrs['fill_mask_is_true'] else 0): filled ones output 0, "
                      "an all-filled row is 0 (fixed_point.int_masked_softmax)",
}
LAYOUT_KINDS = frozenset({"identity", "reshape", "flatten", "squeeze", "unsqueeze", "permute", "transpose",
                          "getitem"})

Scale = Union[float, list]


def _check_dtype(dtype: str, where: str, allow_float: bool = True) -> str:
    ok = QUANT_DTYPES + ((FLOAT_DTYPE,) if allow_float else ())
    if dtype not in ok:
        raise ConfigError(f"{where}: unknown dtype {dtype!r}; use one of {', '.join(ok)}")
    return dtype


@dataclass
class ValueSpec:
    """A program input or output: name, dtype ("qint8"/"qint16"/"qint32"/"f32"), scale, axis.

    ``scale`` is a float (per tensor), a list of floats (per channel along
    ``axis``), or None for a float value.
    """

    name: str
    dtype: str
    scale: Optional[Scale] = None
    axis: Optional[int] = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, f"value '{self.name}'")
        if isinstance(self.scale, (tuple, torch.Tensor)):
            self.scale = [float(s) for s in (self.scale.tolist() if torch.is_tensor(self.scale) else self.scale)]
        elif self.scale is not None and not isinstance(self.scale, list):
            self.scale = float(self.scale)
        if isinstance(self.scale, list) and self.axis is None:
            raise ConfigError(f"value '{self.name}': a per-channel scale needs an axis")

    @property
    def is_float(self) -> bool:
        return self.dtype == FLOAT_DTYPE

    @property
    def per_channel(self) -> bool:
        return isinstance(self.scale, list)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "scale": self.scale, "axis": self.axis}

    @classmethod
    def from_json(cls, d: dict) -> "ValueSpec":
        return cls(d["name"], d["dtype"], d.get("scale"), d.get("axis"))

    def describe(self) -> str:
        if self.is_float:
            return f"{self.name}: f32"
        return f"{self.name}: {self.dtype} {_fmt_scale(self.scale, self.axis)}"


@dataclass
class BpuOp:
    """One program step: ``output = kind(*inputs)`` with static ``attrs`` and integer ``tensors``."""

    kind: str
    inputs: list[str]
    output: str
    attrs: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ConfigError(f"op '{self.output}': unknown BPU op kind {self.kind!r}; known: "
                              + ", ".join(sorted(OP_KINDS)))
        self.inputs = list(self.inputs)
        self.attrs = _jsonable(dict(self.attrs), f"op '{self.output}' attrs")
        for k, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"op '{self.output}': tensor '{k}' must be a torch.Tensor, got "
                                  f"{type(t).__name__}")

    def out_spec(self) -> ValueSpec:
        """The quantization of this op's output (f32 for dequantize)."""
        if self.kind == "dequantize":
            return ValueSpec(self.output, FLOAT_DTYPE)
        return ValueSpec(self.output, self.attrs["out_dtype"], self.attrs["out_scale"], self.attrs.get("out_axis"))


class BpuProgram:
    """A BPU partition as data: named inputs and outputs and a list of ops in execution order."""

    def __init__(self, name: str, inputs: Sequence[ValueSpec], outputs: Sequence[ValueSpec],
                 ops: Sequence[BpuOp]) -> None:
        self.name = name
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.ops = list(ops)
        self.validate()

    # ------------------------------------------------------------------ checks

    def value_specs(self) -> dict[str, ValueSpec]:
        """The spec of every value: the inputs and each op's output."""
        specs = {v.name: v for v in self.inputs}
        for op in self.ops:
            specs[op.output] = op.out_spec()
        return specs

    def validate(self) -> None:
        """ConfigError unless every op reads defined values and each value is defined once."""
        defined: set[str] = set()
        for v in self.inputs:
            if v.name in defined:
                raise ConfigError(f"program {self.name}: input '{v.name}' is listed twice")
            defined.add(v.name)
        for op in self.ops:
            for i in op.inputs:
                if i not in defined:
                    raise ConfigError(f"program {self.name}: op '{op.output}' ({op.kind}) reads '{i}' "
                                      f"before it is defined")
            if op.output in defined:
                raise ConfigError(f"program {self.name}: value '{op.output}' is defined twice")
            defined.add(op.output)
        for v in self.outputs:
            if v.name not in defined:
                raise ConfigError(f"program {self.name}: output '{v.name}' is never computed")

    # ------------------------------------------------------------------ serialisation

    def to_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, meta)``: a flat dict of tensors (``"<op index>.<name>"``) and a JSON-able dict.

        No pickle is involved; ``meta`` survives ``json.dumps``/``json.loads``
        exactly (floats are written with their shortest round-trip repr).
        """
        tensors: dict[str, torch.Tensor] = {}
        ops = []
        for i, op in enumerate(self.ops):
            for k, t in op.tensors.items():
                tensors[f"{i}.{k}"] = t.detach().contiguous().clone()
            ops.append({"kind": op.kind, "inputs": list(op.inputs), "output": op.output,
                        "attrs": _jsonable(op.attrs, f"op '{op.output}' attrs"),
                        "tensors": [{"name": k, "dtype": _dtype_name(t), "shape": list(t.shape)}
                                    for k, t in op.tensors.items()]})
        meta = {
            "format": "qcompiler.bpu_program",
            "version": FORMAT_VERSION,
            "name": self.name,
            "inputs": [v.to_json() for v in self.inputs],
            "outputs": [v.to_json() for v in self.outputs],
            "ops": ops,
        }
        json.dumps(meta)  # fail here, not at the caller's write, if something is not JSON-able
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict) -> "BpuProgram":
        """Rebuild a program from :meth:`to_state` output; ArtifactError if it is not one.

        ``meta`` and ``tensors`` are untrusted (they come from a file): the JSON's form, each
        tensor against its declared dtype and shape, and every op's attrs and tensors
        (:func:`~qcompiler.backends.bpu.program_check.check_program`) are checked, so anything
        malformed is an ArtifactError naming the program, op and tensor.
        """
        if not isinstance(meta, dict) or meta.get("format") != "qcompiler.bpu_program":
            raise ArtifactError("not a BPU program state (meta['format'] != 'qcompiler.bpu_program')")
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
            raise ArtifactError(f"BPU program format version {version!r} is newer than this qcompiler "
                                f"supports ({FORMAT_VERSION}); upgrade qcompiler")
        if version < FORMAT_VERSION:
            raise ArtifactError(f"BPU program format version {version} is older than this qcompiler reads "
                                f"({FORMAT_VERSION}: tensors declare their dtype and shape); compile and save "
                                f"the model again")
        name = meta.get("name")
        if not isinstance(name, str):
            raise ArtifactError(f"BPU program state: 'name' is {name!r}, expected a string")
        where = f"BPU program '{name}'"
        for key in ("inputs", "outputs", "ops"):
            if not isinstance(meta.get(key), list):
                raise ArtifactError(f"{where}: '{key}' is {short(meta.get(key))}, expected a list")
        used: set[str] = set()
        try:
            ops = []
            for i, d in enumerate(meta["ops"]):
                op_where = f"{where} op {i}"
                expect_keys(d, {"kind": str, "inputs": list, "output": str, "attrs": dict, "tensors": list},
                            op_where)
                if not all(isinstance(x, str) for x in d["inputs"]):
                    raise ArtifactError(f"{op_where}: 'inputs' must be a list of value names")
                ts = {}
                for decl in d["tensors"]:
                    k = check_declaration(decl, op_where)
                    key = f"{i}.{k}"
                    if key not in tensors:
                        raise ArtifactError(f"{where}: tensor '{key}' is missing")
                    if k in ts:
                        raise ArtifactError(f"{op_where}: tensor '{k}' is declared twice")
                    t = tensors[key]
                    if _dtype_name(t) != decl["dtype"] or list(t.shape) != decl["shape"]:
                        raise ArtifactError(f"{where}: tensor '{key}' is {_dtype_name(t)} {list(t.shape)}, but "
                                            f"the program declares {decl['dtype']} {decl['shape']}")
                    ts[k] = t
                    used.add(key)
                ops.append(BpuOp(d["kind"], d["inputs"], d["output"], _from_jsonable(d["attrs"]), ts))
            for v in meta["inputs"] + meta["outputs"]:
                _check_value_json(v, where)
            program = cls(name, [ValueSpec.from_json(v) for v in meta["inputs"]],
                          [ValueSpec.from_json(v) for v in meta["outputs"]], ops)
        except ConfigError as e:
            raise ArtifactError(f"{where} is malformed: {e}") from None
        extra = sorted(set(tensors) - used)
        if extra:
            raise ArtifactError(f"{where}: tensor '{extra[0]}' is not declared by any op")
        check_program(program)
        return program

    # ------------------------------------------------------------------ text

    def summary(self) -> str:
        """A readable listing: inputs, outputs, one line per op with its attrs and tensors."""
        head = f"BpuProgram {self.name}: {len(self.inputs)} inputs, {len(self.outputs)} outputs, {len(self.ops)} ops"
        lines = [head]
        lines.append("inputs:")
        lines += [f"  {v.describe()}" for v in self.inputs]
        lines.append("outputs:")
        lines += [f"  {v.describe()}" for v in self.outputs]
        lines.append("ops:")
        width = max([len(op.kind) for op in self.ops] + [1])
        for i, op in enumerate(self.ops):
            lines.append(f"  {i:3d} {op.kind:<{width}} {op.output} <- {', '.join(op.inputs)}")
            detail = _op_detail(op)
            if detail:
                lines.append(f"      {detail}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"BpuProgram({self.name!r}, inputs={[v.name for v in self.inputs]}, "
                f"outputs={[v.name for v in self.outputs]}, ops={len(self.ops)})")


# ---------------------------------------------------------------------------- helpers


def _fmt_scale(scale, axis) -> str:
    if scale is None:
        return ""
    if isinstance(scale, list):
        return f"scale=per-channel[{len(scale)}] axis={axis}"
    return f"scale={scale:.6g}"


def _fmt_attr(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        if len(v) > 8:
            return f"[{len(v)} values]"
        return "[" + ", ".join(_fmt_attr(x) for x in v) + "]"
    if isinstance(v, dict):
        return repr(decode_index(v)) if "t" in v else json.dumps(v)
    return str(v)


def _fmt_tensor(t: torch.Tensor) -> str:
    dt = str(t.dtype).replace("torch.", "")
    return f"{dt}[{','.join(map(str, t.shape))}]"


def _op_detail(op: BpuOp) -> str:
    parts = []
    out_dtype = op.attrs.get("out_dtype")
    if op.kind != "dequantize" and out_dtype is not None:
        parts.append(f"-> {out_dtype} {_fmt_scale(op.attrs.get('out_scale'), op.attrs.get('out_axis'))}")
    for k, v in op.attrs.items():
        if k in ("out_dtype", "out_scale", "out_axis") or v is None or v is False:
            continue
        parts.append(f"{k}={_fmt_attr(v)}")
    for k, t in op.tensors.items():
        parts.append(f"{k}={int(t)}" if t.dim() == 0 and not t.is_floating_point() else f"{k}:{_fmt_tensor(t)}")
    return " ".join(parts)


def _jsonable(v: Any, where: str) -> Any:
    """Attrs -> JSON values (tuples become lists); ConfigError on anything else."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"{where}: non-finite float {v!r} cannot be stored")
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, where) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise ConfigError(f"{where}: dict keys must be strings")
        return {k: _jsonable(x, where) for k, x in v.items()}
    raise ConfigError(f"{where}: value {v!r} of type {type(v).__name__} is not JSON-able; "
                      f"use ints, floats, strings, lists or a tensor")


def _from_jsonable(v: Any) -> Any:
    return v  # attrs are stored exactly as JSON values


# getitem indices as JSON values


def encode_index(idx: Any) -> Any:
    """A static Python index (ints, slices, None, Ellipsis, tuples/lists of them) as JSON data."""
    if isinstance(idx, bool):
        raise ConfigError(f"getitem: boolean index {idx!r} is not supported")
    if isinstance(idx, int):
        return idx
    if idx is None:
        return {"t": "none"}
    if idx is Ellipsis:
        return {"t": "ellipsis"}
    if isinstance(idx, slice):
        for part in (idx.start, idx.stop, idx.step):
            if part is not None and (isinstance(part, bool) or not isinstance(part, int)):
                raise ConfigError(f"getitem: slice {idx!r} has a non-constant bound")
        return {"t": "slice", "v": [idx.start, idx.stop, idx.step]}
    if isinstance(idx, tuple):
        return {"t": "tuple", "v": [encode_index(i) for i in idx]}
    if isinstance(idx, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in idx):
        return {"t": "list", "v": list(idx)}
    raise ConfigError(f"getitem: index {idx!r} ({type(idx).__name__}) is not a static index")


def decode_index(enc: Any) -> Any:
    """Inverse of :func:`encode_index`."""
    if isinstance(enc, int):
        return enc
    t = enc["t"]
    if t == "none":
        return None
    if t == "ellipsis":
        return Ellipsis
    if t == "slice":
        return slice(*enc["v"])
    if t == "tuple":
        return tuple(decode_index(i) for i in enc["v"])
    if t == "list":
        return list(enc["v"])
    raise ArtifactError(f"unknown encoded index {enc!r}")


# state checks (untrusted JSON)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_value_json(v: Any, where: str) -> None:
    """A ValueSpec as JSON: name, dtype, scale (float, list of floats, or null), axis (int or null)."""
    expect_keys(v, {"name": str, "dtype": str}, f"{where} value")
    scale, axis = v.get("scale"), v.get("axis")
    ok_scale = scale is None or isinstance(scale, float) or (
        isinstance(scale, list) and all(isinstance(x, float) for x in scale))
    ok_axis = axis is None or (isinstance(axis, int) and not isinstance(axis, bool))
    if not (ok_scale and ok_axis):
        raise ArtifactError(f"{where}: value '{v['name']}' has scale {short(scale)} and axis {short(axis)}; "
                            f"expected a float or a list of floats, and an int axis")
