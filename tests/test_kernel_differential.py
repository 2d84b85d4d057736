"""Differential property tests of the BPU weight-layer kernels (hypothesis).

Random conv2d / linear layers -- 1-sized dims (K, N, M, channels, spatial), groups and
depthwise, strides, padding, dilation, int8/int16 inputs, fused add, activations,
high-precision output -- and max pools, fed non-contiguous, strided, transposed and
broadcast (stride-0) inputs.  Every kernel set of the simulator (``fast`` with int8 GEMMs, ``fast``
with float GEMMs, ``fixed_point``) must equal the slow int64 reference
(``int_reference``) bit for bit (``torch.equal``), and whole random models compiled for
both marches must equal their converted model.

The examples are derandomized (the same every run) and bounded to keep the file
well under 30 s in CI.
"""

from __future__ import annotations

import operator

import int_reference as ref
import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from simulator_configs import CONFIGS
from test_bpu_reference import Tiny, geometry, rand_scales, rand_w, weight_layer

from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.native.kernels import ENV_VNNI
from qcompiler.backends.bpu.onednn_conv import NhwcRequant, exact_in_float64, onednn_conv_available
from qcompiler.backends.bpu.sim import fast_pool, gemm, onednn_layer
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.bpu.sim.gemm import int8_gemm_available
from qcompiler.compiled import compile as qc_compile
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qtensor import QTensor
from qcompiler.runtime import Runtime

MARCHES = ("bayes", "bernoulli2")

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MODEL_SETTINGS = settings(SETTINGS, max_examples=20)

SCALES = (0.05, 0.01, 0.5, 1.0, 0.003)  # powers of two make exact rounding ties
QMAX = {"qint8": 127, "qint16": 2000}  # int16 inputs: wide, but no int32 overflow at these sizes


def _ints(gen, shape, dtype: str) -> torch.Tensor:
    hi = QMAX[dtype]
    return torch.randint(-hi - 1 if dtype == "qint8" else -hi, hi + 1, shape, generator=gen)


def _outputs(prog, inputs: dict) -> dict:
    """Each kernel set's outputs (integers, or floats for f32) by config name."""
    got = {}
    for cfg in CONFIGS:
        out = BpuSimulator(prog, **cfg).run(inputs)
        got[f"{cfg['kernels']}/int8={cfg.get('int8_gemm')}/onednn={cfg.get('onednn')}/native={cfg.get('native')}"] = {
            k: v.int_repr() if isinstance(v, QTensor) else v for k, v in out.items()}
    return got


def _check_program(prog, inputs: dict) -> None:
    """All kernel sets equal to each other and to the int64 reference, bit for bit."""
    got = _outputs(prog, inputs)
    want = ref.run_program(prog, {k: v.numpy() for k, v in inputs.items()})
    base = got["fixed_point/int8=None/onednn=None/native=None"]
    for cfg, outs in got.items():
        for spec in prog.outputs:
            g, b = outs[spec.name], base[spec.name]
            assert g.dtype == b.dtype and torch.equal(g, b), f"{cfg} != fixed_point for {spec.name}"
    for spec in prog.outputs:
        b = base[spec.name].numpy()
        w = want[spec.name]
        assert b.shape == w.shape, f"{spec.name}: shape {b.shape} != reference {w.shape}"
        if b.dtype.kind == "f":
            assert np.array_equal(b, w.astype(np.float32)), f"{spec.name}: reference differs"
        else:
            assert np.array_equal(b.astype(np.int64), w), f"{spec.name}: reference differs"


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``x`` in another memory layout (the simulator's float input)."""
    if how == "transposed":  # last two dims swapped in memory
        return x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() >= 2 else x
    if how == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if how == "padded":  # a view into a wider buffer (row stride > row length)
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
        wide[..., 1:x.shape[-1] + 1] = x
        return wide[..., 1:x.shape[-1] + 1]
    if how == "broadcast" and x.dim() >= 2:  # stride 0 on the leading dim
        return x[:1].expand(x.shape)
    return x


# ---------------------------------------------------------------------------- linear


@st.composite
def linear_cases(draw):
    case = dict(
        K=draw(st.sampled_from([1, 2, 3, 5, 8, 17])),
        O=draw(st.sampled_from([1, 2, 3, 7, 10])),
        lead=draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=0, max_size=2)),
        in_dtype=draw(st.sampled_from(["qint8", "qint8", "qint16"])),
        out_dtype=draw(st.sampled_from(["qint8", "qint16"])),
        in_scale=draw(st.sampled_from(SCALES)),
        out_scale=draw(st.sampled_from(SCALES + (None,))),  # None: high-precision int32 output
        bias=draw(st.booleans()),
        act=draw(st.sampled_from([None, "relu", "relu6"])),
        add=draw(st.booleans()),
        weights=draw(st.sampled_from(["full", "small", "extreme"])),
        layout=draw(st.sampled_from(["plain", "transposed", "padded", "broadcast", "strided", "permuted"])),
        seed=draw(st.integers(0, 2 ** 16)),
    )
    if case["out_scale"] is None:
        case.update(act=None, add=False, out_dtype="qint32")
    return case


def _weights(gen, shape, how: str) -> torch.Tensor:
    if how == "small":
        return rand_w(gen, shape, -3, 3)
    if how == "extreme":  # +-127 everywhere: the largest sums the int32 bound admits
        return torch.where(torch.rand(shape, generator=gen) < 0.5, -127, 127)
    return rand_w(gen, shape)


def _linear_program(c: dict):
    t = Tiny(seed=c["seed"])
    K, O, lead = c["K"], c["O"], list(c["lead"])
    shape = lead + [K]
    x_ints = _ints(t.gen, shape, c["in_dtype"])
    layout = c["layout"]
    if layout == "strided":  # program input twice as wide, sliced with step 2 on the last dim
        x = t.input(_ints(t.gen, lead + [2 * K], c["in_dtype"]), c["in_scale"], c["in_dtype"])
        x = t.same_scale("getitem", x, (Ellipsis, slice(None, None, 2)), function=operator.getitem,
                         dtype=c["in_dtype"], name="strided")
    elif layout == "permuted":  # program input (..., K, L) transposed inside the program
        L = lead[-1] if lead else 2
        x = t.input(_ints(t.gen, lead[:-1] + [K, L], c["in_dtype"]), c["in_scale"], c["in_dtype"])
        x = t.same_scale("transpose", x, -1, -2, method="transpose", dtype=c["in_dtype"], name="permuted")
        lead = lead[:-1] + [L]
    else:
        x = t.input(x_ints, c["in_scale"], c["in_dtype"])
    w = _weights(t.gen, (O, K), c["weights"])
    bias = torch.randn(O, generator=t.gen) if c["bias"] else None
    other_scale = None
    args = [x]
    if c["add"]:
        other_scale = 0.02
        args.append(t.input(_ints(t.gen, lead + [O], "qint8"), other_scale))
    layer = weight_layer("linear", w, rand_scales(t.gen, O), bias, c["in_scale"], c["out_scale"],
                         out_dtype=c["out_dtype"] if c["out_scale"] is not None else "qint8", act=c["act"],
                         other_scale=other_scale, name="fc")
    gm = t.build(t.call(layer, *args, name="fc"))
    prog = lower_partition(gm, "bpu0")
    names = [v.name for v in prog.inputs]
    inputs = {n: _layout(v, layout) for n, v in zip(names, t.inputs)}
    return prog, inputs


@SETTINGS
@given(linear_cases())
def test_linear_kernels_agree(case):
    prog, inputs = _linear_program(case)
    _check_program(prog, inputs)


# ---------------------------------------------------------------------------- conv2d


@st.composite
def conv_cases(draw):
    depthwise = draw(st.booleans())
    g = draw(st.sampled_from([1, 1, 2, 3]))
    cg, og = (1, 1) if depthwise else (draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 3])))
    if depthwise:
        g = draw(st.sampled_from([1, 2, 4, 5]))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ph, pw = draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))
    eff_h, eff_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    H = draw(st.integers(max(1, eff_h - 2 * ph), max(1, eff_h - 2 * ph) + 4))
    W = draw(st.integers(max(1, eff_w - 2 * pw), max(1, eff_w - 2 * pw) + 4))
    case = dict(
        N=draw(st.integers(1, 2)), Cin=g * cg, O=g * og, groups=g, k=(kh, kw), H=H, W=W,
        stride=(draw(st.integers(1, 2)), draw(st.integers(1, 2))), padding=(ph, pw), dilation=(dh, dw),
        in_dtype=draw(st.sampled_from(["qint8", "qint8", "qint16"])),
        out_dtype=draw(st.sampled_from(["qint8", "qint16"])),
        in_scale=draw(st.sampled_from(SCALES)),
        out_scale=draw(st.sampled_from(SCALES + (None,))),
        bias=draw(st.booleans()),
        act=draw(st.sampled_from([None, "relu", "relu6"])),
        add=draw(st.booleans()),
        weights=draw(st.sampled_from(["full", "small", "extreme"])),
        layout=draw(st.sampled_from(["plain", "channels_last", "transposed", "padded", "broadcast", "strided"])),
        seed=draw(st.integers(0, 2 ** 16)),
    )
    if case["out_scale"] is None:
        case.update(act=None, add=False, out_dtype="qint32")
    return case


def _conv_program(c: dict):
    t = Tiny(seed=c["seed"])
    N, Cin, O, (kh, kw), H, W = c["N"], c["Cin"], c["O"], c["k"], c["H"], c["W"]
    if c["layout"] == "strided":  # every other row and column of a twice larger input
        x = t.input(_ints(t.gen, (N, Cin, 2 * H, 2 * W), c["in_dtype"]), c["in_scale"], c["in_dtype"])
        x = t.same_scale("getitem", x, (slice(None), slice(None), slice(None, None, 2), slice(None, None, 2)),
                         function=operator.getitem, dtype=c["in_dtype"], name="strided")
    else:
        x = t.input(_ints(t.gen, (N, Cin, H, W), c["in_dtype"]), c["in_scale"], c["in_dtype"])
    (sh, sw), (ph, pw), (dh, dw) = c["stride"], c["padding"], c["dilation"]
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    w = _weights(t.gen, (O, Cin // c["groups"], kh, kw), c["weights"])
    bias = torch.randn(O, generator=t.gen) if c["bias"] else None
    args, other_scale = [x], None
    if c["add"]:
        other_scale = 0.04
        args.append(t.input(_ints(t.gen, (N, O, Ho, Wo), "qint8"), other_scale))
    layer = weight_layer("conv2d", w, rand_scales(t.gen, O), bias, c["in_scale"], c["out_scale"],
                         out_dtype=c["out_dtype"] if c["out_scale"] is not None else "qint8",
                         geometry=geometry(c["stride"], c["padding"], c["dilation"], c["groups"]), act=c["act"],
                         other_scale=other_scale, name="conv")
    gm = t.build(t.call(layer, *args, name="conv"))
    prog = lower_partition(gm, "bpu0")
    inputs = {v.name: _layout(x_, c["layout"]) for v, x_ in zip(prog.inputs, t.inputs)}
    return prog, inputs


@SETTINGS
@given(conv_cases())
def test_conv2d_kernels_agree(case):
    prog, inputs = _conv_program(case)
    _check_program(prog, inputs)


# ---------------------------------------------------------------------------- max pool (int8: torch's quantized max pool)


@st.composite
def pool_cases(draw):
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ph, pw = draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))
    H = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 7))
    W = draw(st.integers(max(1, dw * (kw - 1) + 1 - 2 * pw), 7))
    return dict(N=draw(st.integers(1, 2)), C=draw(st.integers(1, 3)), H=H, W=W, k=(kh, kw),
                stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))), padding=(ph, pw), dilation=(dh, dw),
                ceil=draw(st.booleans()), dtype=draw(st.sampled_from(["qint8", "qint16"])),
                layout=draw(st.sampled_from(["plain", "channels_last", "transposed", "padded", "broadcast"])),
                seed=draw(st.integers(0, 2 ** 16)))


@pytest.mark.parametrize("min_channels", [None, 1], ids=["default", "quantized_always"])
@SETTINGS
@given(c=pool_cases())
def test_max_pool_kernels_agree(c, min_channels):
    """int8 pools take torch's quantized max pool from 64 channels, the running maximum below;
    ``quantized_always`` forces the quantized path for every channel count."""
    with pytest.MonkeyPatch.context() as mp:
        if min_channels is not None:
            mp.setattr(fast_pool, "_QUANTIZED_POOL_MIN_CHANNELS", min_channels)
        _check_pool(c)


def test_max_pool_without_quantized_tensors(monkeypatch):
    """Where torch has no quantized tensors (deprecated), 64-channel int8 pools take the running
    maximum and stay exact."""
    def gone(*a, **k):
        raise AttributeError("no quantized tensors in this torch")
    t = Tiny(seed=5)
    x = t.input(_ints(t.gen, (1, 64, 5, 6), "qint8"), 0.05)
    gm = t.build(t.same_scale("max_pool2d", x, module=nn.MaxPool2d(3, 2, 1), name="pool"))
    prog = lower_partition(gm, "bpu0")
    monkeypatch.setattr(torch, "_make_per_tensor_quantized_tensor", gone)
    _check_program(prog, {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)})


def _windows_see_input(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> bool:
    """Every pooling window along one axis holds at least one real element (not only padding)."""
    out = fp.max_pool_out_size(size, k, s, p, d, ceil)
    return all(any(0 <= o * s - p + i * d < size for i in range(k)) for o in range(out))


def _check_pool(c):
    # a window of padding only has no defined integer maximum (the int64 reference refuses it)
    assume(all(_windows_see_input(c[dim], c["k"][a], c["stride"][a], c["padding"][a], c["dilation"][a], c["ceil"])
               for a, dim in enumerate(("H", "W"))))
    t = Tiny(seed=c["seed"])
    x = t.input(_ints(t.gen, (c["N"], c["C"], c["H"], c["W"]), c["dtype"]), 0.05, c["dtype"])
    pool = nn.MaxPool2d(c["k"], c["stride"], c["padding"], c["dilation"], ceil_mode=c["ceil"])
    gm = t.build(t.same_scale("max_pool2d", x, module=pool, dtype=c["dtype"], name="pool"))
    prog = lower_partition(gm, "bpu0")
    _check_program(prog, {v.name: _layout(x_, c["layout"]) for v, x_ in zip(prog.inputs, t.inputs)})


# ---------------------------------------------------------------------------- cat and nearest resize


@st.composite
def cat_cases(draw):
    k = draw(st.integers(1, 3))
    return dict(
        N=draw(st.integers(1, 2)), C=[draw(st.integers(1, 4)) for _ in range(k)], H=draw(st.integers(1, 4)),
        W=draw(st.integers(1, 4)), dim=draw(st.sampled_from([1, 1, 0, 2, 3, -1])),
        dtypes=[draw(st.sampled_from(["qint8", "qint8", "qint16"])) for _ in range(k)],
        scales=[draw(st.sampled_from(SCALES)) for _ in range(k)],
        out_scale=draw(st.sampled_from(SCALES)), out_dtype=draw(st.sampled_from(["qint8", "qint16"])),
        layout=draw(st.sampled_from(["plain", "channels_last", "transposed", "padded", "broadcast"])),
        seed=draw(st.integers(0, 2 ** 16)),
    )


@SETTINGS
@given(cat_cases())
def test_cat_kernels_agree(c):
    """The fast cat (copy at factor 1, float64 requantization else) equals the int64 reference,
    inputs at the output scale included (the copy), and concatenation along every dim."""
    t = Tiny(seed=c["seed"])
    d = c["dim"] % 4
    xs = []
    for i, (C, dtype, scale) in enumerate(zip(c["C"], c["dtypes"], c["scales"])):
        shape = [c["N"], C, c["H"], c["W"]] if d == 1 else [c["N"], c["C"][0], c["H"], c["W"]]
        if d != 1:
            shape[d] += i  # other sizes along the cat dim
        xs.append(t.input(_ints(t.gen, shape, dtype), c["out_scale"] if i == 0 else scale, dtype))
    scales = [c["out_scale"]] + c["scales"][1:]
    cat = t.call(qnn.QuantizedCat(scales, c["out_scale"], c["out_dtype"]), xs, dim=c["dim"], name="cat")
    prog = lower_partition(t.build(cat), "bpu0")
    _check_program(prog, {v.name: _layout(x_, c["layout"]) for v, x_ in zip(prog.inputs, t.inputs)})


@pytest.mark.parametrize("shape,dim,layout", [((1, 3, 200, 190), 1, "channels_last"), ((3, 2, 150, 160), 1, "plain"),
                                              ((2, 3, 170, 200), 2, "transposed")])
def test_cat_in_slices_equals_fixed_point(shape, dim, layout):
    """Inputs larger than one slice of the fast cat (several float64 slices per input) give the
    fixed_point kernel's result (itself equal to the int64 reference above), ties included."""
    t = Tiny(seed=sum(shape))
    xs = [t.input(_ints(t.gen, shape, "qint8"), s) for s in (0.05, 0.025)]  # 0.05 / 0.04: exact ties
    prog = lower_partition(t.build(t.call(qnn.QuantizedCat([0.05, 0.025], 0.04, "qint8"), xs, dim=dim,
                                          name="cat")), "bpu0")
    inputs = {v.name: _layout(x_, layout) for v, x_ in zip(prog.inputs, t.inputs)}
    got = _outputs(prog, inputs)
    base = got.pop("fixed_point/int8=None/onednn=None/native=None")
    assert all(torch.equal(g["cat"], base["cat"]) for g in got.values())


@SETTINGS
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.integers(1, 13),
       st.integers(1, 13), st.sampled_from(SCALES), st.sampled_from(SCALES + ("same",)),
       st.sampled_from(["qint8", "qint16"]),
       st.sampled_from(["plain", "channels_last", "transposed", "padded", "broadcast"]), st.integers(0, 2 ** 16))
def test_nearest_resize_kernels_agree(N, C, H, W, Ho, Wo, in_scale, out_scale, in_dtype, layout, seed):
    """The fast nearest resize (requantize the input, then select bytes) equals the reference:
    up- and down-sampling to any size, at the same scale (no requantization) or another."""
    t = Tiny(seed=seed)
    x = t.input(_ints(t.gen, (N, C, H, W), in_dtype), in_scale, in_dtype)
    out_scale = in_scale if out_scale == "same" else out_scale
    y = t.call(qnn.QuantizedResize("nearest", in_scale, out_scale, "qint8", (Ho, Wo), None), x, name="resize")
    prog = lower_partition(t.build(y), "bpu0")
    _check_program(prog, {v.name: _layout(x_, layout) for v, x_ in zip(prog.inputs, t.inputs)})


# ---------------------------------------------------------------------------- oneDNN convolutions


@pytest.mark.skipif(not onednn_conv_available(), reason="no exact oneDNN int8 convolution on this machine")
@pytest.mark.parametrize("cin,k,weights", [(1100, 1, "extreme"), (700, 1, "extreme"), (300, 3, "full"),
                                           (40, 3, "extreme")])
def test_onednn_conv_splits_input_channels(cin, k, weights, monkeypatch):
    """Layers whose L1 bound passes 2**24 run as several oneDNN convolutions over input-channel
    chunks (summed in float64); the result equals the int64 reference.  +-127 weights over 1100
    channels are the worst case of one chunk per ~1030 channels."""
    t = Tiny(seed=cin)
    x = t.input(_ints(t.gen, (1, cin, 3, 3), "qint8"), 0.05)
    w = _weights(t.gen, (3, cin, k, k), weights)
    layer = weight_layer("conv2d", w, rand_scales(t.gen, 3), torch.randn(3, generator=t.gen), 0.05, 0.5,
                         geometry=geometry(1, k // 2, 1, 1), act="relu", name="conv")
    prog = lower_partition(t.build(t.call(layer, x, name="conv")), "bpu0")
    conv_op = next(op for op in prog.ops if op.kind == "conv2d")
    with monkeypatch.context() as m:
        m.setenv(ENV_VNNI, "0")  # (the native int8 GEMM would take the layer)
        sim = BpuSimulator(prog, onednn=True)
    kernel = next(k for k in (getattr(s[0], "whole", s[0]) for s in sim._steps) if isinstance(k, onednn_layer._OnednnConvLayer))
    bound = 128 * int(w.abs().sum(dim=(1, 2, 3)).max()) + int(conv_op.tensors["bias"].abs().max())
    assert (len(kernel.conv.chunks) > 1) == (bound >= 2 ** 24)
    _check_program(prog, {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)})


def test_float64_epilogue_exactness_rule():
    """Where the float64 epilogue is exact: n <= 53 - b without a fused add; with one, also the
    other term's magnitude and shift count.  Outside, oneDNN layers use the tie-checking epilogue."""
    assert exact_in_float64(46, 7) and not exact_in_float64(47, 7)
    assert exact_in_float64(38, 15) and not exact_in_float64(39, 15)
    assert exact_in_float64(40, 7, other_max=128.0, nb=40)
    assert not exact_in_float64(45, 7, other_max=128.0, nb=30)  # 2**7 + 1 + 128 > 2**8
    assert not exact_in_float64(30, 7, other_max=1.0, nb=46)  # the sum's grid is 2**-46
    assert NhwcRequant.applies(torch.tensor([40, 41]), "qint8")
    assert not NhwcRequant.applies(torch.tensor([40, 50]), "qint8")
    assert not NhwcRequant.applies(torch.tensor([10]), "qint32")


@pytest.mark.skipif(not onednn_conv_available(), reason="no exact oneDNN int8 convolution on this machine")
@pytest.mark.parametrize("k, dilation, padding, hw", [((1, 2), (1, 2), (1, 1), (3, 1)), ((3, 2), (2, 2), (2, 1), (5, 1))])
def test_onednn_layer_is_not_used_where_a_window_lies_wholly_in_the_padding(k, dilation, padding, hw, monkeypatch):
    """oneDNN's int8 convolution computes nonzero values for output positions whose every tap is
    padding (seen: a kernel 2 wide of dilation 2 with padding 1 on a 1-wide input, with vertical
    padding too); the layer takes the exact fallback for such input sizes."""
    t = Tiny(seed=5)
    x = t.input(_ints(t.gen, (1, 3) + hw, "qint8"), 0.05)
    layer = weight_layer("conv2d", _weights(t.gen, (2, 3) + k, "full"), torch.full((2,), 0.01), None, 0.05, 0.05,
                         geometry=geometry(1, padding, dilation, 1), name="conv")
    prog = lower_partition(t.build(t.call(layer, x, name="conv")), "bpu0")
    with monkeypatch.context() as m:
        m.setenv(ENV_VNNI, "0")  # (the native int8 GEMM would take the layer)
        sim = BpuSimulator(prog, onednn=True)
    kernel = next(k for k in (getattr(s[0], "whole", s[0]) for s in sim._steps) if isinstance(k, onednn_layer._OnednnConvLayer))
    assert kernel._empty_window(*hw)
    _check_program(prog, {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)})
    assert onednn_layer._window_in_padding(1, 2, 1, 1, 2) and onednn_layer._window_in_padding(3, 1, 1, 1, 1)
    assert not onednn_layer._window_in_padding(56, 3, 1, 1, 1) and not onednn_layer._window_in_padding(5, 2, 1, 1, 2)


@pytest.mark.skipif(not onednn_conv_available(), reason="no exact oneDNN int8 convolution on this machine")
def test_onednn_layer_falls_back_when_the_epilogue_is_not_proven(monkeypatch):
    """A shift past 53 - b makes the builder pick the tie-checking kernel; results stay exact."""
    t = Tiny(seed=3)
    x = t.input(_ints(t.gen, (1, 4, 5, 5), "qint8"), 0.05)
    w = _weights(t.gen, (3, 4, 3, 3), "full")
    # a tiny real multiplier: n = 31 + ~20 > 46
    layer = weight_layer("conv2d", w, torch.full((3,), 1e-7), None, 0.05, 1.0, geometry=geometry(1, 1, 1, 1),
                         name="conv")
    prog = lower_partition(t.build(t.call(layer, x, name="conv")), "bpu0")
    assert int(next(op for op in prog.ops if op.kind == "conv2d").tensors["n"].max()) > 46
    with monkeypatch.context() as m:
        m.setenv(ENV_VNNI, "0")  # (the native int8 GEMM would take the layer)
        kinds = [type(getattr(s[0], "whole", s[0])).__name__ for s in BpuSimulator(prog, onednn=True)._steps]
    assert "_OnednnConvLayer" not in kinds and "_FastConv" in kinds
    _check_program(prog, {v.name: x_ for v, x_ in zip(prog.inputs, t.inputs)})


# ---------------------------------------------------------------------------- the int8 GEMM entry


@pytest.mark.skipif(not int8_gemm_available(), reason="no exact torch._int_mm on this machine")
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (17, 1, 10), (17, 5, 1), (1, 5, 3), (3, 1, 1), (1, 1, 9), (4, 6, 2)])
def test_int_mm_entry_is_exact_in_every_layout(M, K, N):
    """The kernels' one ``_int_mm`` entry: exact for 1-sized dims and any operand/output layout."""
    g = torch.Generator().manual_seed(M * 100 + K * 10 + N)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (K, N), dtype=torch.int8, generator=g)
    want = a.to(torch.int64) @ b.to(torch.int64)
    for aa in gemm._layouts(a):
        for bb in gemm._layouts(b):
            for out in (torch.empty(M, N, dtype=torch.int32), torch.empty(N, M, dtype=torch.int32).t()):
                got = gemm.int_mm(aa, bb, out)
                assert got is out and torch.equal(out.to(torch.int64), want), (aa.stride(), bb.stride())


def test_self_test_catches_ambiguous_strides(monkeypatch):
    """With operands passed as they come (the old fast linear), the widened self-test fails
    wherever ``torch._int_mm`` misreads a (1, N) operand with strides (1, 1)."""
    if getattr(torch, "_int_mm", None) is None:
        pytest.skip("no torch._int_mm")
    w = torch.arange(10, dtype=torch.int8).view(10, 1) - 5
    x = torch.ones(3, 1, dtype=torch.int8)
    raw_ok = torch.equal(torch._int_mm(x, w.t().contiguous()).to(torch.int64), x.long() @ w.t().long())
    if raw_ok:
        pytest.skip("this torch build reads (1, N) operands with strides (1, 1) correctly")
    monkeypatch.setattr(gemm, "gemm_operand", lambda t: t)
    assert not gemm._int8_self_test()
    monkeypatch.undo()
    assert gemm._int8_self_test() == int8_gemm_available()


# ---------------------------------------------------------------------------- whole models, both marches


def _assert_compiled_exact(model: nn.Module, x: torch.Tensor, march: str) -> None:
    cm = qc_compile(model, (x,), march=march, calib_data=[x], progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"], f"{march}: expected one BPU partition"
    with torch.no_grad():
        want = cm.converted(x)
    first, second = cm(x), cm(x)
    assert torch.equal(first, second), f"{march}: two calls on the same input differ"
    assert torch.equal(first, want), f"{march}: compiled != converted, max |diff| {(first - want).abs().max()}"
    (prog,) = cm.runtime.programs.values()
    for cfg in CONFIGS:
        assert torch.equal(Runtime.simulated(cm.converted, cm.runtime.programs, **cfg)(x), want), cfg
    (inp,) = prog.inputs
    (out,) = prog.outputs
    reference = ref.run_program(prog, {inp.name: x.contiguous().numpy()})[out.name]
    assert np.array_equal(first.numpy(), reference.astype(np.float32)), f"{march}: reference differs"


@pytest.mark.parametrize("march", MARCHES)
def test_linear_5_1_then_1_10_regression(march):
    """Linear(5, 1) -> Linear(1, 10): the (10, 1) weight's transpose has strides (1, 1); the fast
    linear's int8 GEMM read the wrong memory (garbage, different on every call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 1), nn.Linear(1, 10)).eval()
    x = torch.randn(64, 5)
    _assert_compiled_exact(model, x, march)


@st.composite
def models(draw):
    if draw(st.booleans()):
        feats = draw(st.lists(st.sampled_from([1, 2, 3, 5, 10]), min_size=2, max_size=4))
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(feats, feats[1:])):
            layers.append(nn.Linear(a, b, bias=draw(st.booleans())))
            if draw(st.booleans()) and i < len(feats) - 2:
                layers.append(nn.ReLU())
        shape = (draw(st.sampled_from([1, 2, 7])), feats[0])
    else:
        chans = [draw(st.sampled_from([1, 2, 4]))]
        layers = []
        for _ in range(draw(st.integers(1, 2))):
            cin = chans[-1]
            g = draw(st.sampled_from([1, 2]))
            g = g if cin % g == 0 else 1
            cout = g * draw(st.sampled_from([1, 2, 3]))
            k = draw(st.sampled_from([1, 3]))
            layers.append(nn.Conv2d(cin, cout, k, stride=draw(st.sampled_from([1, 2])), padding=k // 2, groups=g))
            chans.append(cout)
        shape = (draw(st.sampled_from([1, 2])), chans[0], draw(st.integers(3, 6)), draw(st.integers(3, 6)))
    layout = draw(st.sampled_from(["plain", "transposed", "channels_last", "padded"]))
    return layers, shape, layout, draw(st.integers(0, 2 ** 16))


@pytest.mark.parametrize("march", MARCHES)
@MODEL_SETTINGS
@given(case=models())
def test_random_models_compile_exactly(march, case):
    layers, shape, layout, seed = case
    torch.manual_seed(seed)
    model = nn.Sequential(*layers).eval()
    x = _layout(torch.randn(shape), layout)
    _assert_compiled_exact(model, x, march)
