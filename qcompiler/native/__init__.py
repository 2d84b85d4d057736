"""Native (C) kernels compiled on first use with the system compiler and called through ctypes.

:mod:`qcompiler.native.build` builds and loads the one library (or reports it off: no compiler, a
failed build, ``QCOMPILER_NATIVE=0``) from this package's C (the thread pool, the calibration
kernels) and the BPU simulator's (``qcompiler.backends.bpu.native``, which holds their bindings);
:mod:`qcompiler.native.kernels` holds the calibration kernels' checked entry points.  Every user
keeps an exact torch path for when the native kernels are off.
"""
