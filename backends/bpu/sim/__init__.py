"""The BPU simulator: runs a :class:`~qcompiler.backends.bpu.program.BpuProgram` on integers.

:class:`~qcompiler.backends.bpu.sim.executor.BpuSimulator` (``executor``) runs a program's ops,
each with its kernel from the tables of ``registry``: ``REFERENCE`` (``reference``, ``layout``)
and the ``FAST`` overlay, one module per family (``fast_conv``, ``fast_linear``, ``fast_pool``,
``fast_cat``, ``fast_resize``, ``fast_quantize``, with the layers they pick: ``native_gemm``,
``native_depthwise``, ``onednn_layer``), each registering on import (importing this package
imports them all).  ``gemm`` holds the exact GEMM entry and its self-test, ``epilogue`` the
weight layers' requantization, ``plan`` the per-shape native plans and ``row_split`` the
output-row bands.

Values are plain integer tensors with the static quantization recorded in
the program; QTensors appear only at the program boundary.  Every op computes
exactly what the converted model's module (``qcompiler.nn.quantized``)
computes, bit for bit.  Two kernel sets are available:

``kernels="fixed_point"``
    Each op calls the ``qcompiler.quantization.fixed_point`` functions the
    converted modules call, with the same arguments (identical by
    construction).

``kernels="fast"`` (default)
    conv2d / linear / max_pool2d / cat / nearest and bilinear resize use faster kernels
    that are *provably* exact (and are tested bit-exact against
    ``fixed_point`` and a pure-integer reference):

    * int8 convs (any groups) go to oneDNN's int8 convolution when
      :func:`~qcompiler.backends.bpu.onednn_conv.onednn_conv_available`
      verified it once (``onednn=``): float32 accumulators exact below 2**24
      (proven per chunk of input channels), requantized in float64 in
      channels-last memory with no tie check (proven statically; see
      ``backends/bpu/onednn_conv.py``); with the native kernels
      (``native=``, default :func:`~qcompiler.native.build.native_enabled`)
      that epilogue is one pass of integer arithmetic in C.  Layers whose epilogue is not
      proven exact that way, and int16 inputs, use the kernels below.
    * with the native kernels on a CPU with AVX512-VNNI, groups-1 convs and linear layers of int8
      inputs run on the native int8 GEMM with the requantization fused
      (:class:`~qcompiler.backends.bpu.native.gemm.Int8Gemm`, ``native_gemm``), and depthwise convs on
      its VNNI depthwise kernel, where each proves the layer exact; ``QCOMPILER_NATIVE_VNNI=0``
      keeps the kernels above.
    * int8 max pools are torch's quantized max pool on the same bytes; cat
      copies or requantizes each input into its output slice in float64
      (exact for int8/int16 inputs); nearest resize requantizes the input,
      then selects bytes.  With the native kernels: bilinear resize is one
      int32 pass when its taps are exact dyadics (``BilinearResize``: then
      the reference's float64 value is that rational exactly), cat inputs
      are requantized in int32 where proven equal on every input value,
      channels-last max pools are one native pass.
    * int8 x int8 -> int32 GEMMs (``torch._int_mm``, oneDNN) when
      :func:`~qcompiler.backends.bpu.sim.gemm.int8_gemm_available` verified once that they do not saturate on
      this machine and the CPU has VNNI or AMX (:func:`~qcompiler.backends.bpu.sim.gemm.int8_gemm_preferred`:
      without them ``torch._int_mm`` is exact but slower than the float32 GEMMs below;
      ``int8_gemm=True`` still asks for it) (VNNI/AMX arithmetic wraps modulo 2**32, so a sum whose
      true value fits int32 is exact whatever the order), and only for layers
      whose int32 range is proven: ``128 * max_o sum_i |w[o, i]| < 2**31``.
      Operands always reach it row-major (``gemm.gemm_operand``): with a
      1-sized dim, a "contiguous" tensor can have strides it misreads.
    * otherwise (or ``int8_gemm=False``) float32 GEMMs with the reduction
      split into input-channel chunks whose every partial sum stays below
      2**24: the bound ``max|x| * max_o sum_{i in chunk} |w[o, i]|`` (an L1
      bound per output channel, much tighter than fixed_point's
      ``k * max|x| * max|w|``), ``max|x| = 128`` for int8 activations; the
      chunks are summed in float64 (exact below 2**53).
    * convolutions are explicit im2col (never Winograd/FFT), gathered per
      tile of output positions in the integer type, so a tile's GEMM
      operands and epilogue temporaries stay in cache; 1x1 convs read the
      input directly; depthwise convs multiply-add shifted windows per
      channel block in float32 (partial sums < 2**24 by the same bound).
    * activations leave a conv in channel-major memory (``C,N,H,W`` under
      an ``N,C,H,W`` view), which the next conv reads without a copy.
    * the int32 range of the accumulator is proven from the L1 bound (plus
      ``max|bias|``) when possible, else checked on the data.
    * requantization ``round_half_even(acc * M / 2**n)`` is evaluated in
      float64 as ``(acc + bias) * (M * 2**-n)`` (the factor is exact).
      Rounding that product once cannot change the result when
      ``|t| < 2**(53-n)``; values that matter (``|t| < 2**b``, ``2**b >= qmax+1``)
      qualify when ``n <= 53 - b`` (an exact tie ``m + 1/2`` is representable,
      so it stays a tie and ``torch.round`` breaks it to even).  When that
      static condition fails, or a fused add makes a second rounding, every
      element whose float64 value lies within ``eps`` (a bound on the float
      error) of a rounding boundary is recomputed exactly in int64 with
      ``fixed_point.rounding_shift`` / ``round_scaled_sum``.
    * max pool is the running maximum of the strided windows of a
      qmin-padded copy (equal to ``F.max_pool2d``).

    * with the native kernels, ``quantize`` (per-tensor scale) is one native pass, and the global
      average pool requantizes its int32 sums in one native pass.

    Everything else (add, avg pools, LUTs, matmul, other bilinear resizes, ...) uses
    the fixed_point functions in both modes.

Accumulator overflow is never silent: every accumulating op either proves its
int32 range statically or checks it on the data, raising
:class:`~qcompiler.quantization.fixed_point.AccumulatorOverflow` naming the op
(``<program>/<value>``).

A whole converted model runs through the runtime's scheduler:
:meth:`qcompiler.runtime.Runtime.simulated` (BPU partitions here, CPU partitions in torch).
"""

from qcompiler.backends.bpu.sim import (  # noqa: F401  (each module registers its kernels on import)
    fast_cat,
    fast_conv,
    fast_linear,
    fast_nash,
    fast_pool,
    fast_quantize,
    fast_resize,
    layout,
    reference,
)

