"""The native kernels' output rows split over threads (``parts``; qc_run_rows in qcompiler/native/pool.c): the
int8 GEMM, its conv form and the VNNI depthwise conv, at 1 to 4 parts and random row ranges,
torch.equal to the one-thread call and to the int64 reference; concurrent callers; when the
simulator asks for a split (``row_parts``)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_native_gemm import (
    _OUT,
    SETTINGS,
    _case,
    _gemm_program,
    conv_case_tensors,
    conv_cases,
    gemm_cases,
    needs_gemm,
    reference,
)
from test_native_kernels import dw_case_tensors, dw_cases

from qcompiler.backends.bpu.native import gemm as gemm_mod
from qcompiler.backends.bpu.native.gemm import ENV_THREADS, SPLIT_MIN_WORK, Int8Gemm, row_parts
from qcompiler.backends.bpu.native.kernels import DepthwiseConv
from qcompiler.backends.bpu.native.plan import ENV_PLAN
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.parallel import run_split
from qcompiler.quantization import fixed_point as fp


@needs_gemm
@SETTINGS
@given(gemm_cases(), st.integers(1, 4), st.integers(0, 200), st.data())
def test_split_gemm_rows_equal_the_one_thread_call_and_the_reference(c, parts, extra_rows, data):
    c = dict(c, P=c["P"] + extra_rows)  # up to 240 rows: several micro-tiles per part
    x, w, bias, M, n, lo, hi, add, other = _case(c)
    if Int8Gemm.refusal(w, bias, M, n, lo, hi, _OUT[c["out"]], add) is not None:
        return
    k = Int8Gemm(w, bias, M, n, lo, hi, _OUT[c["out"]], add)
    P = x.shape[0]
    m0 = data.draw(st.integers(0, P))
    m1 = data.draw(st.integers(m0, P))
    one = torch.full((P, k.O), 77, dtype=k.out_dtype)
    split = one.clone()
    k(x, one, other, m0=m0, m1=m1)
    k(x, split, other, m0=m0, m1=m1, parts=parts)
    assert torch.equal(split, one)  # the rows outside [m0, m1) untouched by both
    want = reference(x, w, bias, M, n, lo, hi, add, other)
    assert torch.equal(split[m0:m1].to(torch.int64), want[m0:m1])
    assert bool((split[:m0] == 77).all()) and bool((split[m1:] == 77).all())


@needs_gemm
@SETTINGS
@given(conv_cases(), st.integers(2, 4))
def test_split_gemm_conv_equals_the_one_thread_call_and_the_reference(c, parts):
    k, xl, ol, want = conv_case_tensors({**c, "extreme": False})
    lo, hi = fp.qrange(c["out"])
    one = k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol)
    split = k.conv(xl, c["k"], c["stride"], c["padding"], c["dilation"], ol, parts=parts)
    assert torch.equal(split, one)
    assert torch.equal(split.permute(0, 3, 1, 2).to(torch.int64), want.clamp(lo, hi))


@needs_gemm
@SETTINGS
@given(dw_cases(), st.integers(2, 4))
def test_split_depthwise_conv_equals_the_one_thread_call_and_the_reference(c, parts):
    """The output rows (sample, row) cut over threads: each part is the kernel on one sample's rows
    with the padding shifted (rows above and below the input still read as padding)."""
    x, w, bias, M, n, lo, hi, want = dw_case_tensors(c)
    kernel = DepthwiseConv(w, bias, c["stride"], c["padding"], c["dilation"], M, n, lo, hi, _OUT[c["out"]])
    xl = x.permute(0, 2, 3, 1).contiguous()
    one, split = kernel(xl), kernel(xl, parts)
    assert torch.equal(split, one)
    assert torch.equal(split.permute(0, 3, 1, 2).to(torch.int64), want)


@needs_gemm
def test_concurrent_split_calls_from_several_threads_are_exact():
    """Four Python threads each splitting their calls over 3 native parts at once (the pool is shared;
    a caller runs the parts no helper has started)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (70, 300), dtype=torch.int8, generator=g)
    M, n = torch.randint(1, 1 << 15, (70,), generator=g), torch.full((70,), 22)
    k = Int8Gemm(w, None, M, n, -128, 127, torch.int8)
    xs = [torch.randint(-128, 128, (500 + 37 * i, 300), dtype=torch.int8, generator=g) for i in range(4)]
    wants = [reference(x, w, None, M, n, -128, 127, None, None).to(torch.int8) for x in xs]
    bad: list = []

    def work(i):
        for _ in range(30):
            if not torch.equal(k(xs[i], parts=3), wants[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_row_parts_follows_the_budget_the_threshold_and_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_THREADS, raising=False)
    assert row_parts(2, SPLIT_MIN_WORK) == 2
    assert row_parts(3, 10 * SPLIT_MIN_WORK) == 3
    assert row_parts(2, SPLIT_MIN_WORK - 1) == 1  # too small to pay for the hand-off
    assert row_parts(1, 10 * SPLIT_MIN_WORK) == 1  # no lent workers
    monkeypatch.setenv(ENV_THREADS, "1")
    assert row_parts(2, 10 * SPLIT_MIN_WORK) == 1


@needs_gemm
@pytest.mark.parametrize("batch,threads,want", [(1, 2, {2}), (2, 2, {1}), (1, 1, {1}), (2, 4, {2})])
def test_the_simulator_splits_native_layers_by_the_chunks_budget(batch, threads, want, monkeypatch):
    """Batch 1 at 2 threads: the one chunk has a budget of 2 and its GEMM and depthwise calls are cut in
    2; batch 2 at 2 threads: a chunk per worker, budget 1, no cut (no over-subscription).  The outputs
    are the fixed_point kernels' bit for bit either way.  (The op-by-op path: a plan cuts its steps in C.)"""
    monkeypatch.delenv(ENV_THREADS, raising=False)
    monkeypatch.setenv(ENV_PLAN, "0")
    monkeypatch.setattr(gemm_mod, "SPLIT_MIN_WORK", 1)
    seen: list = []
    real_rows, real_dw = Int8Gemm.run_rows, DepthwiseConv.__call__

    def rows(self, *a, parts=1):
        seen.append(parts)
        return real_rows(self, *a, parts=parts)

    def dw(self, x, parts=1):
        seen.append(parts)
        return real_dw(self, x, parts)

    monkeypatch.setattr(Int8Gemm, "run_rows", rows)
    monkeypatch.setattr(DepthwiseConv, "__call__", dw)
    prog, inputs = _gemm_program("conv2d", True, "relu", 1, "qint8", 3)
    inputs = {k: v[:batch] if v.shape[0] >= batch else torch.cat([v] * batch)[:batch] for k, v in inputs.items()}
    ref = {k: v.int_repr() for k, v in BpuSimulator(prog, kernels="fixed_point").run(inputs).items()}
    sim = BpuSimulator(prog, native=True)
    names = list(inputs)

    def run(*xs):  # per sample along dim 0: run_split cuts the batch, lends the idle workers
        return {k: v.int_repr() for k, v in sim.run(dict(zip(names, xs))).items()}

    got = run_split(run, tuple(inputs[k] for k in names), threads)
    assert set(seen) == want, seen
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
