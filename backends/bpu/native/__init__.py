"""The BPU C kernels (built with qcompiler.native.build) and their Python bindings."""
