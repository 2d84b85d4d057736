"""Constraint predicates for the op-support tables.

Each factory returns a ``Constraint``: a callable ``(OpInfo) -> str | None``
that returns ``None`` when the op fits and otherwise the reason it does not,
worded for the user (``kernel 9x9 > 7``).  ``describe`` says the limit in
words for docs and dumps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch.fx as fx
import torch.nn as nn

from qcompiler.backends.bpu.op_info import OpInfo
from qcompiler.ir.ops import bind
from qcompiler.quantization.fixed_point import LN_MAX_GROUP, max_pool_out_size

Check = Callable[["OpInfo"], Optional[str]]


@dataclass(frozen=True)
class Constraint:
    describe: str
    check: Check

    def __call__(self, info: "OpInfo") -> Optional[str]:
        return self.check(info)


def _shape(s) -> str:
    return "(" + ",".join(map(str, s)) + ")"


def _drop_trailing_ones(s: tuple[int, ...]) -> tuple[int, ...]:
    """(N, C, 1, 1) -> (N, C): the shape as NCHW memory sees it."""
    s = tuple(s)
    while len(s) > 2 and s[-1] == 1:
        s = s[:-1]
    return s


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


# ---- march-wide limits ------------------------------------------------------


def ranks(allowed: tuple[int, ...], label: str) -> Constraint:
    def check(info):
        for s in info.tensor_shapes:
            if len(s) not in allowed:
                return f"{label}; tensor {_shape(s)} is {len(s)}-D"
        return None

    return Constraint(label, check)


def max_batch(limit: int) -> Constraint:
    def check(info):
        for s in info.tensor_shapes:
            if s and s[0] > limit:
                return f"batch {s[0]} > {limit}"
        return None

    return Constraint(f"batch <= {limit}", check)


def max_dims(limit: int, names: str = "H, W, C") -> Constraint:
    def check(info):
        for s in info.tensor_shapes:
            for d in s[1:]:
                if d > limit:
                    return f"dimension {d} of {_shape(s)} > {limit}"
        return None

    return Constraint(f"{names} <= {limit}", check)


# ---- convolution -------------------------------------------------------------


def kernel_range(lo: int, hi: int) -> Constraint:
    def check(info):
        kh, kw = info.attrs.get("kernel", (1, 1))
        if max(kh, kw) > hi:
            return f"kernel {kh}x{kw} > {hi}"
        if min(kh, kw) < lo:
            return f"kernel {kh}x{kw} < {lo}"
        return None

    return Constraint(f"kernel {lo}..{hi}", check)


def max_channels(limit: int) -> Constraint:
    def check(info):
        for key in ("in_channels", "out_channels"):
            c = info.attrs.get(key)
            if c is not None and c > limit:
                return f"{key.replace('_', ' ')} {c} > {limit}"
        return None

    return Constraint(f"channels <= {limit}", check)


def max_feature_channels(limit: int) -> Constraint:
    """Channel (dim 1) limit on feature maps, for element-wise ops and concat."""

    def check(info):
        for s in info.tensor_shapes:
            if len(s) >= 2 and s[1] > limit:
                return f"channels {s[1]} of {_shape(s)} > {limit}"
        return None

    return Constraint(f"channels <= {limit}", check)


def dilation_pow2() -> Constraint:
    def check(info):
        for d in info.attrs.get("dilation", (1, 1)):
            if not _is_pow2(d):
                return f"dilation {d} is not a power of 2"
        return None

    return Constraint("dilation a power of 2", check)


def max_dilation(limit: int) -> Constraint:
    def check(info):
        d = max(info.attrs.get("dilation", (1, 1)))
        return f"dilation {d} > {limit}" if d > limit else None

    return Constraint(f"dilation <= {limit}", check)


def dilation_one() -> Constraint:
    def check(info):
        d = max(info.attrs.get("dilation", (1, 1)))
        return f"dilation {d} != 1" if d != 1 else None

    return Constraint("dilation 1", check)


def max_kernel_volume(limit: int) -> Constraint:
    """kh * kw * (input channels per group) <= limit."""

    def check(info):
        kh, kw = info.attrs.get("kernel", (1, 1))
        c = info.attrs.get("in_channels", 1) // max(1, info.attrs.get("groups", 1))
        v = kh * kw * c
        return f"kernel h*w*c = {kh}*{kw}*{c} = {v} > {limit}" if v > limit else None

    return Constraint(f"kernel h*w*c <= {limit}", check)


def max_stride(limit: int) -> Constraint:
    def check(info):
        s = max(info.attrs.get("stride", (1, 1)))
        return f"stride {s} > {limit}" if s > limit else None

    return Constraint(f"stride <= {limit}", check)


def stride_in(allowed: tuple[int, ...]) -> Constraint:
    def check(info):
        for s in info.attrs.get("stride", (1, 1)):
            if s not in allowed:
                return f"stride {s} not in {{{', '.join(map(str, allowed))}}}"
        return None

    return Constraint(f"stride in {allowed}", check)


def stride_not_all_one() -> Constraint:
    def check(info):
        return "stride 1x1 (a transposed conv must upsample)" if tuple(info.attrs.get("stride", (1, 1))) == (1, 1) else None

    return Constraint("stride not both 1", check)


# ---- pooling -------------------------------------------------------------------


def pool_limits(kernel: int, stride: Optional[int] = None, pad: Optional[int] = None) -> Constraint:
    def check(info):
        kh, kw = info.attrs.get("kernel", (1, 1))
        if max(kh, kw) > kernel:
            return f"pool kernel {kh}x{kw} > {kernel}"
        if stride is not None and max(info.attrs.get("stride", (1, 1))) > stride:
            return f"pool stride {max(info.attrs['stride'])} > {stride}"
        if pad is not None and max(info.attrs.get("padding", (0, 0))) > pad:
            return f"pool padding {max(info.attrs['padding'])} > {pad}"
        return None

    return Constraint(f"pool kernel <= {kernel}", check)


def pool_semantics() -> Constraint:
    """What the BPU's pools compute: a max pool gives values only, and an average pool divides
    every window by ``kh*kw`` (DESIGN.md), so options that change a window's divisor stay on CPU."""

    def check(info):
        a = info.attrs
        if info.op == "max_pool2d":
            return "max_pool2d with return_indices=True (the indices are not a quantized value)" \
                if a.get("return_indices") else None
        if a.get("divisor_override") is not None:
            return f"avg_pool2d with divisor_override={a['divisor_override']} (the BPU divides by kh*kw)"
        padded = any(p > 0 for p in a.get("padding", (0, 0)))
        if padded and not a.get("count_include_pad", True):
            return "avg_pool2d with count_include_pad=False and padding (the BPU divides every window by kh*kw)"
        s = info.in_shapes[0] if info.in_shapes else None
        if a.get("ceil_mode") and s is not None and len(s) == 4:
            for size, k, st, p in zip(s[2:], a["kernel"], a["stride"], a["padding"]):
                # a ceil-mode window that runs past the padded input is divided by fewer elements
                last = (max_pool_out_size(size, k, st, p, 1, True) - 1) * st + k
                if last > size + 2 * p:
                    return "avg_pool2d with ceil_mode=True and a partial last window (the BPU divides by kh*kw)"
        return None

    return Constraint("pool options the BPU computes", check)


def zero_padding() -> Constraint:
    """The BPU conv pads with the code 0 (DESIGN.md): reflect / replicate / circular padding stays on CPU."""

    def check(info):
        mode = info.attrs.get("padding_mode", "zeros")
        if mode == "zeros" or not info.attrs.get("padded", False):
            return None
        return f"padding_mode='{mode}' (the BPU pads with zeros)"

    return Constraint("zero padding", check)


def global_pool(max_hw: Optional[int] = None) -> Constraint:
    """adaptive_avg_pool2d to 1x1 (or mean over H, W) with H*W within the limit."""

    def check(info):
        size = info.attrs.get("output_size")
        if info.op == "adaptive_avg_pool2d" and size not in (None, (1, 1)):
            return f"adaptive_avg_pool2d to {size[0]}x{size[1]} is not a global pool"
        if info.op == "mean":
            dim = info.attrs.get("dim")
            dims = tuple(sorted(d % 4 for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))) if dim is not None else None
            if dims != (2, 3):
                return f"mean over dims {dim} (only the global mean over H, W runs on the BPU)"
        s = info.in_shapes[0] if info.in_shapes else None
        if max_hw is not None and s is not None and len(s) == 4 and s[2] * s[3] > max_hw:
            return f"H*W = {s[2]}*{s[3]} = {s[2] * s[3]} > {max_hw}"
        return None

    return Constraint("global average pool" + (f", H*W <= {max_hw}" if max_hw else ""), check)


# ---- resize, element-wise, concat, layout ----------------------------------------------


def resize_hw(nearest_pow2: bool = True) -> Constraint:
    def check(info):
        mode = info.attrs.get("mode", "nearest")
        if mode not in ("nearest", "bilinear"):
            return f"resize mode '{mode}'"
        s_in, s_out = info.in_shapes[0], info.out_shapes[0] if info.out_shapes else None
        if s_in is None or s_out is None or len(s_in) != 4:
            return "resize of a non-4-D tensor"
        if s_in[:2] != s_out[:2]:
            return "resize changes N or C"
        if nearest_pow2 and mode == "nearest":
            for a, b in zip(s_in[2:], s_out[2:]):
                if b % a or not _is_pow2(b // a):
                    return f"nearest resize factor {b / a:g} is not a power of 2"
        return None

    return Constraint("resize over H, W" + ("; nearest by power-of-2 factors" if nearest_pow2 else ""), check)


def max_lut_volume(limit: int) -> Constraint:
    def check(info):
        s = info.in_shapes[0] if info.in_shapes else None
        if s is not None:
            v = math.prod(s[1:])
            if v > limit:
                return f"c*h*w = {v} > {limit} for a lookup-table op"
        return None

    return Constraint(f"c*h*w <= {limit}", check)


def nchw_or_nc11_broadcast() -> Constraint:
    def check(info):
        shapes = [s for s in info.in_shapes if s is not None]
        if len(shapes) == 2 and shapes[0] != shapes[1]:
            a, b = shapes
            small = b if math.prod(b) <= math.prod(a) else a
            big = a if small is b else b
            ok = len(small) == 4 and len(big) == 4 and small[:2] == big[:2] and small[2:] == (1, 1)
            if not ok:
                return f"operands {_shape(a)} and {_shape(b)}: only NCHW with NCHW or NC11 broadcast"
        return None

    return Constraint("operands NCHW with NCHW or NC11", check)


def feature_map_operands(minimum: int) -> Constraint:
    """At least ``minimum`` operands computed at run time (constants -- numbers, buffers,
    parameters -- do not count): an op on constants only is not a BPU op."""

    def check(info):
        n = info.attrs.get("feature_map_operands")
        if n is None:
            n = sum(1 for s in info.in_shapes if s is not None)
        if n >= minimum:
            return None
        if n == 0:
            return "no run-time operand: it computes on constants only (numbers, buffers, parameters)"
        return f"{n} feature-map operand(s); needs {minimum}"

    return Constraint(f"{minimum} feature-map operand(s)", check)


def max_constant_operands(limit: int) -> Constraint:
    def check(info):
        n = info.attrs.get("constant_operands", 0)
        return f"{n} constant operands > {limit}" if n > limit else None

    return Constraint(f"at most {limit} constant operand", check)


def true_division() -> Constraint:
    """div rounds once at the output scale (a reciprocal table); floor / trunc division is not that."""

    def check(info):
        mode = info.attrs.get("rounding_mode")
        return f"div with rounding_mode={mode!r} (the BPU divides exactly, then requantizes)" if mode else None

    return Constraint("true division", check)


def number_exponent() -> Constraint:
    """pow as a table of ``x ** c``: a feature-map base and a Python-number exponent ``c``, fixed when
    the table is built (a tensor exponent, or a number raised to a tensor, is another function)."""

    def check(info):
        if not info.attrs.get("tensor_base", False):
            return "the base is not a tensor (a number raised to a tensor has no table of x ** c)"
        if info.attrs.get("exponent") is None:
            return "the exponent is a tensor; a table needs a Python-number exponent"
        return None

    return Constraint("a Python-number exponent", check)


def constant_weight() -> Constraint:
    """A functional prelu's slope is folded into multipliers at convert time: it must be a
    buffer or parameter of the model, not a value computed in forward."""

    def check(info):
        if info.attrs.get("weight_constant", True):
            return None
        return "the slope is computed at run time (the BPU takes a constant slope: a parameter or buffer)"

    return Constraint("constant weight", check)


def module_form() -> Constraint:
    """conv / conv-transpose / linear run on the BPU as modules, whose weights prepare
    quantizes (weight fake quant, bias grid); a functional call with a weight tensor stays on CPU."""

    def check(info):
        if info.module is not None:
            return None
        return (f"functional {info.op} (the BPU lowers nn.Conv2d / nn.ConvTranspose2d / nn.Linear modules, "
                f"whose weights prepare quantizes)")

    return Constraint("a module (not the functional form)", check)


def batch_norm_affine() -> Constraint:
    """A standalone BN runs as a per-channel affine (a depthwise 1x1 layer) from an
    nn.BatchNorm2d's running statistics: the functional form, or a BN without running
    statistics (it normalizes with each batch's), stay on CPU."""

    def check(info):
        bn = info.module
        if not isinstance(bn, nn.BatchNorm2d):
            return "functional batch_norm (the BPU lowers an nn.BatchNorm2d module with running statistics)"
        if bn.running_mean is None or bn.running_var is None:
            return "BatchNorm2d without running statistics (track_running_stats=False) is not a fixed affine"
        return None

    return Constraint("nn.BatchNorm2d with running statistics", check)


def rank_between(lo: int, hi: int) -> Constraint:
    def check(info):
        for s in info.tensor_shapes:
            if not lo <= len(s) <= hi:
                return f"tensor {_shape(s)} is {len(s)}-D, not {lo}..{hi}-D"
        return None

    return Constraint(f"{lo}..{hi}-D", check)


def not_along_batch() -> Constraint:
    def check(info):
        dim = info.attrs.get("dim", 0)
        return "concat along N (dim 0)" if dim == 0 else None

    return Constraint("not along N", check)


def folds_away() -> Constraint:
    """A layout op that moves no data in NCHW: adds or drops trailing 1-sized dims only."""

    def check(info):
        s_in = info.in_shapes[0] if info.in_shapes else None
        s_out = info.out_shapes[0] if info.out_shapes else None
        if s_in is None or s_out is None:
            return "layout op with unknown shapes"
        if info.op in ("permute", "transpose") or _drop_trailing_ones(s_in) != _drop_trailing_ones(s_out):
            return f"{info.op} {_shape(s_in)} -> {_shape(s_out)} moves data (bernoulli2 runs layout ops on CPU unless they fold away)"
        return None

    return Constraint("folds away (only trailing 1-sized dims change)", check)


def static_arguments() -> Constraint:
    """A layout op's sizes and dims are part of the BPU program: none may be computed at run time
    (``x.reshape(b, n, h * e)`` with sizes read from a tensor, where the rewrite to numbers declined:
    an example size that equals the batch makes the batch entry ambiguous)."""

    def check(info):
        node = info.node
        rest = list(node.args[1:]) + list(node.kwargs.values())
        flat = [x for v in rest for x in (v if isinstance(v, (list, tuple)) else (v,))]
        computed = [x.name for x in flat if isinstance(x, fx.Node)]
        if computed:
            return (f"{info.op} argument(s) {', '.join(repr(n) for n in computed)} computed at run time (sizes read "
                    "from a tensor); BPU layout ops need static sizes: write them as numbers")
        return None

    return Constraint("static sizes / dims", check)


# ---- layer_norm (nash) -------------------------------------------------------


def _layer_norm_args(info) -> dict:
    """The normalized dims count (None when the call does not say it statically), weight and bias of a
    layer_norm node, by name."""
    module = info.module
    kw = bind(info.node, {info.node.target: module} if module is not None else {})
    shape = kw["normalized_shape"]
    dims = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (tuple, list)) else None
    return {"dims": dims, "weight": kw["weight"], "bias": kw["bias"]}


def layer_norm_group(max_group: int = LN_MAX_GROUP) -> Constraint:
    """The normalized dims are the last k dims after the batch (dim 0 is never normalized: the BPU
    normalizes within a batch item) and hold at most ``max_group`` elements (the integer kernel's
    overflow bounds, fixed_point.int_layer_norm)."""

    def check(info):
        s = info.in_shapes[0] if info.in_shapes else None
        if s is None:
            return "unknown input shape"
        dims = _layer_norm_args(info)["dims"]
        if dims is None:
            return "normalized_shape is computed at run time (its number of dims is unknown)"
        if dims >= len(s):
            return (f"normalizing all {len(s)} dims of {_shape(s)} normalizes across the batch (dim 0); "
                    f"the BPU normalizes the last dims of each batch item")
        shape = tuple(s[len(s) - dims:])
        group = math.prod(shape)
        if group > max_group:
            return f"normalized group of {group} elements {_shape(shape)} > {max_group}"
        return None

    return Constraint(f"normalized dims after the batch, group <= {max_group} elements", check)


def layer_norm_constant_affine() -> Constraint:
    """gamma / beta are folded into multipliers at convert time: they must be parameters or buffers
    (a module's, or get_attr operands of a functional call), not values computed in forward."""

    def check(info):
        args = _layer_norm_args(info)
        for name in ("weight", "bias"):
            v = args[name]
            if isinstance(v, fx.Node) and v.op != "get_attr":
                return (f"{name} is computed at run time (the BPU takes a constant {name}: "
                        f"a parameter or buffer)")
        return None

    return Constraint("constant weight and bias", check)


# ---- softmax (nash) ------------------------------------------------------------------------


def softmax_call(max_len: int) -> Constraint:
    """softmax along a dim the call names as a constant int (torch's implicit dim is deprecated and
    rank-dependent), no dtype cast, and an axis of at most ``max_len`` elements: the integer kernel's
    int64 sum bound (``fixed_point.SOFTMAX_MAX_LEN``)."""

    def check(info):
        dim, dtype = info.attrs.get("dim"), info.attrs.get("dtype")
        if dim is None:
            return f"{info.op} without dim (torch's implicit dim is deprecated); give dim=..."
        if not isinstance(dim, int) or isinstance(dim, bool):
            return f"{info.op} dim {dim!r} is not a constant int"
        if dtype is not None:
            return f"{info.op} with dtype={dtype} (the BPU computes on the quantized input)"
        s = info.in_shapes[0] if info.in_shapes else None
        if s is not None and len(s):
            if not -len(s) <= dim < len(s):
                return f"{info.op} dim {dim} out of range for {_shape(s)}"
            if s[dim] > max_len:
                return f"{info.op} axis of {s[dim]} elements > {max_len}"
        return None

    return Constraint(f"dim given, axis <= {max_len} elements", check)


# ---- nash: reductions and selection with constants ---------------------------------------------

# the BPU sums in an int32 accumulator: 65536 int16 codes (|q| <= 32768) reach -2**31 at most
MAX_REDUCED_ELEMENTS = 65536


def reduction(max_elements: int = MAX_REDUCED_ELEMENTS) -> Constraint:
    """sum / mean / amax / amin over any dims (int, tuple, negative) but the batch's (dim 0: the BPU works
    on one batch item at a time, as for cat and layer_norm): the integers themselves, so no ``dtype``
    (a float or wider result is not a quantized value), and at most ``max_elements`` reduced into one
    output (a sum's int32 accumulator holds that many int16 codes)."""

    def check(info):
        a = info.attrs
        if a.get("dtype") is not None:
            return f"{info.op} with dtype={a['dtype']} (the BPU reduces the integers, in their own type)"
        s = info.in_shapes[0] if info.in_shapes else None
        if s is None:
            return None
        dim = a.get("dim")
        seq = () if dim is None else (dim if isinstance(dim, (tuple, list)) else (dim,))
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in seq):
            return f"{info.op} over dims {dim!r} computed at run time (the BPU takes constant dims)"
        dims = {d % len(s) for d in seq} if seq and len(s) else set(range(len(s)))
        if 0 in dims:
            return (f"{info.op} over dims {dim!r} reduces across the batch (dim 0); the BPU reduces within "
                    f"each batch item")
        count = math.prod(s[d] for d in dims)
        if info.op in ("sum", "mean") and count > max_elements:
            return f"{info.op} of {count} elements into one output > {max_elements} (int32 accumulator)"
        return None

    return Constraint(f"not along N, no dtype, at most {max_elements} elements summed", check)


def _index_entries(idx) -> tuple:
    return idx if isinstance(idx, tuple) else (idx,)


def _has_node(v) -> bool:
    if isinstance(v, fx.Node):
        return True
    if isinstance(v, (tuple, list)):
        return any(_has_node(x) for x in v)
    if isinstance(v, slice):
        return any(_has_node(x) for x in (v.start, v.stop, v.step))
    return False


def _static_entry(e) -> bool:
    """An int, a slice of int bounds (step > 0), None or Ellipsis (a list of ints, a constant gather, is not
    yet one: the opset-11 export has no rule for it)."""
    if e is None or e is Ellipsis:
        return True
    if isinstance(e, bool):
        return False
    if isinstance(e, int):
        return True
    if isinstance(e, slice):
        parts = (e.start, e.stop, e.step)
        return all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts) \
            and (e.step is None or e.step > 0)
    return False


def _keeps_batch(entries: tuple, rank: int) -> bool:
    """The index leaves dim 0 whole and in place: its first entry a full slice, or an Ellipsis that spans dim 0."""
    if not entries:
        return True
    first = entries[0]
    if isinstance(first, slice):
        return first == slice(None)
    if first is Ellipsis:
        indexing = sum(1 for e in entries[1:] if e is not None and e is not Ellipsis)
        return indexing < rank
    return False


# aten.slice.Tensor(input, dim=0, start=None, end=None, step=1): what torch.export makes of x[:, a:b:c]
SLICE_ARGS = (("dim", 0), ("start", None), ("end", None), ("step", 1))


def slice_args(node: fx.Node) -> Optional[tuple]:
    """(dim, start, end, step) of an ``aten.slice.Tensor`` node given by position or keyword, or None when
    one is computed at run time (dim and step ints; start and end ints or None)."""
    values = dict(SLICE_ARGS)
    values.update(zip((k for k, _ in SLICE_ARGS), node.args[1:]))
    values.update({k: v for k, v in node.kwargs.items() if k in values})
    ints = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if len(node.args) > 1 + len(SLICE_ARGS) or not (ints(values["dim"]) and ints(values["step"])) \
            or not all(v is None or ints(v) for v in (values["start"], values["end"])):
        return None
    return values["dim"], values["start"], values["end"], values["step"]


def _whole(start, end, step, size: int) -> bool:
    """The slice keeps all ``size`` entries in order."""
    return step == 1 and start in (None, 0, -size) and (end is None or end >= size)


def constant_index() -> Constraint:
    """getitem / narrow / slice with a constant index: the same codes moved (the input's grid), the index data
    of the program. A tensor index (a buffer, or computed in forward) is a gather the BPU does not take; dim 0
    (the batch) is kept whole, as for cat; a getitem of a tuple picks one output of an op, no BPU op."""

    def check(info):
        node, s = info.node, (info.in_shapes[0] if info.in_shapes else None)
        if info.op == "getitem":
            if s is None:
                return "getitem of a non-tensor (a tuple or list, e.g. one output of a multi-output op, or a shape)"
            idx = node.args[1] if len(node.args) > 1 else node.kwargs.get("index")
            entries = _index_entries(idx)
            if _has_node(idx):
                return "getitem with a tensor index (a buffer or a value computed in forward): the BPU takes " \
                       "constant int / slice indices"
            if not all(_static_entry(e) for e in entries):
                return f"getitem with index {idx!r}: only ints, slices (step > 0), None and ..."
            if not _keeps_batch(entries, len(s)):
                return f"getitem with index {idx!r} indexes the batch (dim 0); the BPU keeps it whole"
            return None
        if info.op == "narrow":
            rest = list(node.args[1:]) + [node.kwargs[k] for k in ("dim", "start", "length") if k in node.kwargs]
            if len(rest) != 3 or _has_node(rest) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                            for v in rest):
                return "narrow with dim / start / length computed at run time (the BPU takes constants)"
            if s is not None and len(s) and rest[0] % len(s) == 0:
                return "narrow along the batch (dim 0); the BPU keeps it whole"
        if info.op == "slice":
            bounds = slice_args(node)
            if bounds is None or _has_node(node.args[1:]) or _has_node(node.kwargs):
                return "slice with dim / start / end / step computed at run time (the BPU takes constants)"
            dim, start, end, step = bounds
            if step < 1:
                return f"slice with step {step}: the BPU takes steps >= 1"
            if s is not None and len(s) and dim % len(s) == 0 and not _whole(start, end, step, s[0]):
                return "slice along the batch (dim 0); the BPU keeps it whole"
        return None

    return Constraint("constant index, not along N", check)
