"""The simulator's default GEMM: the int8 one only where the CPU has int8 dot-product
instructions (and the self-test proved it exact); the exact float32 GEMMs elsewhere, where
``torch._int_mm`` is the slower of the two. Both give the same integers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.bpu.sim import executor
from qcompiler.backends.bpu.sim.gemm import int8_dot_product, int8_gemm_available, int8_gemm_preferred

EPYC_AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
             "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2 sha_ni\n")
XEON_VNNI = "processor\t: 0\nflags\t\t: sse4_2 avx2 avx512f avx512bw avx512_vnni avx512_vbmi\n"
ALDER_LAKE = "flags\t\t: sse4_2 avx2 avx_vnni\n"
SAPPHIRE = "flags\t\t: avx512f avx512_vnni amx_tile amx_int8 amx_bf16\n"


@pytest.mark.parametrize("text,has", [(EPYC_AVX2, False), (XEON_VNNI, True), (ALDER_LAKE, True),
                                      (SAPPHIRE, True), ("", False),
                                      ("Features\t: fp asimd asimddp\n", False)])
def test_int8_dot_product_reads_the_flags_line(text, has):
    assert int8_dot_product(text) is has


def test_the_flag_must_be_a_whole_word():
    assert not int8_dot_product("flags\t\t: avx512_vnnix not_avx_vnni\n")


def test_preferred_needs_the_self_test_too():
    assert not int8_gemm_preferred() or int8_gemm_available()


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    cm = qcompiler.compile(model, (torch.randn(2, 3, 12, 12),), march="bayes")
    (prog,) = cm.runtime.programs.values()
    return prog


@pytest.mark.parametrize("preferred", [False, True])
def test_the_simulator_default_follows_the_preference(program, monkeypatch, preferred):
    monkeypatch.setattr(executor, "int8_gemm_preferred", lambda: preferred)
    monkeypatch.setattr(executor, "int8_gemm_available", lambda: True)
    assert executor.BpuSimulator(program).int8_gemm is preferred
    assert executor.BpuSimulator(program, kernels="fixed_point").int8_gemm is False
    assert executor.BpuSimulator(program, int8_gemm=True).int8_gemm is True  # asked for: still given
