"""The output-row split of one image's convolutions (backends/bpu/sim/row_split.py): bit-exact.

A conv2d computed in bands of output rows on several worker threads (a batch smaller than the
worker count, qcompiler.parallel) must equal the unsplit layer, torch.equal, for every kernel
configuration of the simulator: random geometries with stride, dilation, symmetric and
four-sided padding (also larger than the kernel), groups and depthwise, 1-row and tiny inputs,
int16 inputs, a fused add, relu / relu6, high-precision outputs and odd input layouts.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from simulator_configs import CONFIGS
from test_bpu_reference import Tiny, geometry, rand_scales, weight_layer
from test_kernel_differential import SCALES, SETTINGS, _ints, _layout, _weights

from qcompiler import parallel
from qcompiler.backends.bpu.sim import row_split
from qcompiler.backends.bpu.lower import lower_partition
from qcompiler.backends.bpu.program import BpuProgram
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.backends.bpu.sim.row_split import RowSplitConv, band_rows
from qcompiler.quantization.qtensor import QTensor

FAST = [cfg for cfg in CONFIGS if cfg["kernels"] == "fast"]


@st.composite
def split_cases(draw):
    depthwise = draw(st.booleans())
    if depthwise:
        g, cg, og = draw(st.sampled_from([1, 3, 8])), 1, 1
    else:
        g = draw(st.sampled_from([1, 1, 2]))
        cg, og = draw(st.sampled_from([1, 2, 5])), draw(st.sampled_from([1, 3, 4]))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    pads = [draw(st.integers(0, 4)) for _ in range(4)]  # t, l, b, r: up to past the kernel
    four = draw(st.booleans())
    t, l, b, r = pads if four else (pads[0], pads[1], pads[0], pads[1])
    sh = draw(st.integers(1, 3))
    eff_h, eff_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    H = draw(st.integers(max(1, eff_h - t - b), max(1, eff_h - t - b) + 9))
    W = draw(st.integers(max(1, eff_w - l - r), max(1, eff_w - l - r) + 4))
    case = dict(
        N=draw(st.integers(1, 2)), Cin=g * cg, O=g * og, groups=g, k=(kh, kw), H=H, W=W,
        stride=(sh, draw(st.integers(1, 2))), padding=(t, l, b, r), four=four, dilation=(dh, dw),
        in_dtype=draw(st.sampled_from(["qint8", "qint8", "qint16"])),
        out_dtype=draw(st.sampled_from(["qint8", "qint16"])),
        in_scale=draw(st.sampled_from(SCALES)), out_scale=draw(st.sampled_from(SCALES + (None,))),
        bias=draw(st.booleans()), act=draw(st.sampled_from([None, "relu", "relu6"])), add=draw(st.booleans()),
        weights=draw(st.sampled_from(["full", "small", "extreme"])),
        layout=draw(st.sampled_from(["plain", "channels_last", "transposed", "padded"])),
        workers=draw(st.integers(2, 4)), seed=draw(st.integers(0, 2 ** 16)))
    if case["out_scale"] is None:
        case.update(act=None, add=False, out_dtype="qint32")
    return case


def _program(c: dict) -> tuple[BpuProgram, list[torch.Tensor]]:
    """A one-conv program (padding as drawn, four-sided when ``four``) and its float inputs."""
    tiny = Tiny(seed=c["seed"])
    N, Cin, O, (kh, kw), H, W = c["N"], c["Cin"], c["O"], c["k"], c["H"], c["W"]
    (sh, sw), (t, l, b, r), (dh, dw) = c["stride"], c["padding"], c["dilation"]
    x = tiny.input(_ints(tiny.gen, (N, Cin, H, W), c["in_dtype"]), c["in_scale"], c["in_dtype"])
    Ho = (H + t + b - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + l + r - dw * (kw - 1) - 1) // sw + 1
    args, other_scale = [x], None
    if c["add"]:
        other_scale = 0.04
        args.append(tiny.input(_ints(tiny.gen, (N, O, Ho, Wo), "qint8"), other_scale))
    w = _weights(tiny.gen, (O, Cin // c["groups"], kh, kw), c["weights"])
    bias = torch.randn(O, generator=tiny.gen) if c["bias"] else None
    layer = weight_layer("conv2d", w, rand_scales(tiny.gen, O), bias, c["in_scale"], c["out_scale"],
                         out_dtype=c["out_dtype"] if c["out_scale"] is not None else "qint8",
                         geometry=geometry(c["stride"], (t, l), c["dilation"], c["groups"]), act=c["act"],
                         other_scale=other_scale, name="conv")
    prog = lower_partition(tiny.build(tiny.call(layer, *args, name="conv")), "bpu0")
    if c["four"]:  # the folded-F.pad form: [top, left, bottom, right]
        for op in prog.ops:
            if op.kind == "conv2d":
                op.attrs["padding"] = [t, l, b, r]
    return prog, [_layout(v, c["layout"]) for v in tiny.inputs]


def _split_layers(sim: BpuSimulator) -> list[RowSplitConv]:
    return [fn for fn, *_ in sim._steps if isinstance(fn, RowSplitConv)]


def _run(sim: BpuSimulator, xs: list[torch.Tensor], workers: int) -> list[torch.Tensor]:
    """The program's outputs with the batch split over ``workers`` threads (batch < workers: the
    chunks are lent the idle workers, and the convs cut their rows)."""
    names = [v.name for v in sim.program.inputs]

    def call(*tensors):
        out = sim.run(dict(zip(names, tensors)))
        return tuple(v.int_repr() if isinstance(v, QTensor) else v for v in out.values())

    return list(parallel.run_split(call, xs, workers))


@settings(SETTINGS, max_examples=80)
@given(split_cases())
def test_row_split_equals_the_unsplit_layer(case):
    prog, xs = _program(case)
    for cfg in FAST:
        sim = BpuSimulator(prog, **cfg, plan=False)  # the op-by-op row split (a plan cuts rows in C)
        want = _run(sim, xs, 1)
        layers = _split_layers(sim)
        assert layers, "the fast conv2d kernel is not wrapped for the row split"
        for layer in layers:
            layer.enabled, layer.min_work = True, 0  # cut every layer, however small
        got = _run(sim, xs, case["workers"])
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{cfg}: the row split differs from the unsplit layer"
        Ho = layers[0].out_rows(xs[0].shape[2])
        chunks = min(case["workers"], case["N"])
        budget = case["workers"] // chunks + (case["workers"] % chunks > 0)  # the first chunk's
        # the split really ran (the band kernel exists) exactly when there were rows to cut
        assert (layers[0]._band is not None) == (Ho >= 2 and budget >= 2), (Ho, budget)


def test_band_rows_cover_the_output_once():
    for Ho in range(1, 12):
        for n in range(1, 6):
            bands = band_rows(Ho, n)
            assert bands[0][0] == 0 and bands[-1][1] == Ho and len(bands) == min(n, Ho)
            assert all(b0 < b1 for b0, b1 in bands) and all(a[1] == b[0] for a, b in zip(bands, bands[1:]))
            assert max(b1 - b0 for b0, b1 in bands) - min(b1 - b0 for b0, b1 in bands) <= 1


def _big_case(**kw) -> dict:
    case = dict(N=1, Cin=16, O=16, groups=1, k=(3, 3), H=24, W=24, stride=(1, 1), padding=(1, 1, 1, 1), four=False,
                dilation=(1, 1), in_dtype="qint8", out_dtype="qint8", in_scale=0.05, out_scale=0.5, bias=True,
                act="relu", add=False, weights="full", layout="plain", workers=2, seed=3)
    case.update(kw)
    return case


def test_small_layers_stay_whole_and_large_ones_split():
    """The MIN_WORK threshold: a layer below it runs whole even with idle workers."""
    prog, xs = _program(_big_case())
    sim = BpuSimulator(prog)
    (layer,) = _split_layers(sim)
    work = 24 * 24 * 16 * (16 * 9 + row_split.OUTPUT_COST)
    assert layer.work(xs[0].shape) == work
    layer.enabled, layer.min_work = True, work + 1
    want = _run(sim, xs, 1)
    got = _run(sim, xs, 2)
    assert layer._band is None and all(torch.equal(g, w) for g, w in zip(got, want))
    layer.min_work = work
    got = _run(sim, xs, 2)
    assert layer._band is not None and all(torch.equal(g, w) for g, w in zip(got, want))
    assert layer.min_work == work and BpuSimulator(prog)._steps[1][0].min_work == row_split.MIN_WORK > 0


def test_no_split_outside_a_lent_worker():
    """threads=1, a call from the main thread, or a batch that fills every worker: no bands."""
    prog, xs = _program(_big_case(N=2))
    sim = BpuSimulator(prog)
    (layer,) = _split_layers(sim)
    layer.enabled, layer.min_work = True, 0
    sim.run({v.name: x for v, x in zip(prog.inputs, xs)})
    _run(sim, xs, 1)
    _run(sim, xs, 2)  # two samples, two workers: each chunk has a budget of 1
    assert layer._band is None
    _run(sim, xs, 4)  # two samples, four workers: each chunk cuts its rows in two
    assert layer._band is not None


def test_a_failing_band_raises_in_the_caller_after_every_band():
    """An exception in a part is raised by run_parts (the first in part order) once all parts ended."""
    done = []

    def part(i):
        if i == 1:
            raise ValueError("band 1 failed")
        done.append(i)
        return i

    def chunk(x):
        assert parallel.part_budget() == 3
        return parallel.run_parts(part, 3)

    with pytest.raises(ValueError, match="band 1 failed"):
        parallel.run_split(chunk, (torch.zeros(1),), 3)
    assert sorted(done) == [0, 2]


def test_parts_run_on_other_threads_at_one_torch_thread():
    seen = {}

    def part(i):
        seen[i] = (threading.get_ident(), torch.get_num_threads(), parallel.part_budget())
        return i

    def chunk(x):
        return torch.tensor(parallel.run_parts(part, 2))

    saved = torch.get_num_threads()
    try:
        # batch 1 with torch at the same thread count: the chunk runs in the calling thread (its native plans
        # use torch's own team), with a budget of 2
        torch.set_num_threads(2)
        assert parallel.run_split(chunk, (torch.zeros(1),), 2).tolist() == [0, 1]
        assert all(budget == 1 for _, _, budget in seen.values())
        assert seen[0][0] == threading.get_ident()
        # a part a worker ran (the caller takes back a part no worker has started) ran at one torch thread
        assert all(threads == 1 for ident, threads, _ in seen.values() if ident != threading.get_ident())
        assert parallel.part_budget() == 1  # the caller's budget is untouched
        # another torch thread count: one worker computes the chunk (the caller's torch ops would use another count)
        torch.set_num_threads(1)
        seen.clear()
        assert parallel.run_split(chunk, (torch.zeros(1),), 2).tolist() == [0, 1]
        assert seen[0][0] != threading.get_ident() and seen[0][1] == 1
    finally:
        torch.set_num_threads(saved)


def test_the_split_is_off_by_default():
    """Not measured faster end to end yet (docs/performance.md): a layer copies ENABLED (False)."""
    prog, xs = _program(_big_case())
    sim = BpuSimulator(prog)
    (layer,) = _split_layers(sim)
    assert row_split.ENABLED is False and layer.enabled is False
    layer.min_work = 0
    want = _run(sim, xs, 1)
    assert all(torch.equal(g, w) for g, w in zip(_run(sim, xs, 2), want)) and layer._band is None
