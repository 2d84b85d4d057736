"""The simulator's kernel configurations that the exactness tests run, as available on this machine.

Every configuration must give the same integers: ``fixed_point`` (the functions the converted
modules call), the fast kernels with float32 GEMMs only, with exact int8 GEMMs
(``torch._int_mm``) and with oneDNN's int8 convolution, the last two where this machine has
them exact (their self-tests decide); the native (C) kernels (depthwise convs, the oneDNN conv
epilogue) on and off when this machine builds them.
"""

from __future__ import annotations

from qcompiler.backends.bpu.onednn_conv import onednn_conv_available
from qcompiler.backends.bpu.sim.gemm import int8_gemm_available
from qcompiler.native.build import native_enabled

_NATIVE = native_enabled()
# without oneDNN: the torch kernels (native=False); with it: the native kernels where they apply
# (depthwise convs, the oneDNN conv epilogue) and, when those are on, the same without them
CONFIGS = [dict(kernels="fixed_point"), dict(kernels="fast", int8_gemm=False, onednn=False, native=False)] + (
    [dict(kernels="fast", int8_gemm=True, onednn=False, native=False)] if int8_gemm_available() else []) + (
    [dict(kernels="fast", onednn=True)] if onednn_conv_available() else []) + (
    [dict(kernels="fast", onednn=True, native=False)] if onednn_conv_available() and _NATIVE else []) + (
    [dict(kernels="fast", onednn=False, native=True)] if not onednn_conv_available() and _NATIVE else [])
