"""Native (C) kernels compiled on first use with the system compiler and called through ctypes.

:mod:`qcompiler.native.build` builds and loads the library (or reports it off: no compiler, a
failed build, ``QCOMPILER_NATIVE=0``); :mod:`qcompiler.native.kernels` holds the checked entry
points.  Every user keeps an exact torch path for when the native kernels are off.
"""
