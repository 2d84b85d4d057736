"""The one native library is built from both C folders, wherever the package is installed from.

The BPU kernels' folder was once computed as ``qcompiler/backends/bpu/native``: right for an
installed wheel and for a worktree with symlinks, but an editable checkout (the README's setup)
maps ``qcompiler.backends`` to ``./backends``, so the build found only the calibration kernels and
the simulator silently ran without its native kernels."""

from __future__ import annotations

from pathlib import Path

import qcompiler.backends.bpu.native as bpu_native
from qcompiler.native import build


def test_the_bpu_kernels_folder_is_the_imported_package_s():
    assert build._BPU.resolve() == Path(bpu_native.__file__).parent.resolve()


def test_the_sources_cover_both_folders():
    folders = {p.parent.resolve() for p in build.SOURCES}
    assert folders == {build.INCLUDE.resolve(), Path(bpu_native.__file__).parent.resolve()}
    names = {p.name for p in build.SOURCES}
    assert {"kernels.c", "pool.c", "gemm.c", "gemm_vnni.c", "gemm_amx.c", "cat.c"} <= names
    assert {p.name for p in build.HEADERS} >= {"qc_pool.h", "gemm.h", "plan.h"}
