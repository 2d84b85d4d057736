"""Every native GEMM call of a model on two builds of the native kernels, side by side in one process.

    python benchmarks/gemm_calls_ab.py --base a32cfbd [--models mobilenet_v2,resnet18] [--batches 1,8] [--repeat 15]

One ``Runtime.simulated`` call (1 thread) records the arguments of every ``qc_gemm_*`` call (its
input, fused operand and conv geometry copied); each call is then replayed on the library built
from the C sources (``qcompiler/native``, ``backends/bpu/native``) at git revision ``--base`` and on the
one built from the working tree (the compiler call of ``qcompiler/native/build.py``), alternating, the
best of ``--repeat`` each, into separate outputs that must be equal bit for bit (both builds get the
layers' current ``Int8Gemm`` arguments, so the base must accept them: any revision whose ``qc_gemm_*``
take the same leading arguments; a base before the prepared constants ignores the last one).
Prints per call rows, K, O, the epilogue mode (``f64``), both times and the ratio, then the totals.
For comparing kernel changes on a shared machine: both builds see the same load at the same moment.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler.backends.bpu.native.gemm as gemm_mod  # noqa: E402
import qcompiler.backends.bpu.native.kernels as kernels_mod  # noqa: E402
import qcompiler.zoo as zoo  # noqa: E402
from benchmarks.simulator import calibration_batches, converted_model  # noqa: E402
from qcompiler.backends.bpu.native.plan import ENV_PLAN  # noqa: E402
from qcompiler.native.build import INCLUDE, SOURCES, command  # noqa: E402
from qcompiler.runtime import Runtime  # noqa: E402

_KERNEL = re.compile(r"qc_gemm_(add_i(8|16)_)?i(8|16)")  # the GEMM kernels themselves, one call a layer
_GEO = 14  # int64 entries of a conv's geometry (the last: the address of the tail layout's weights, or 0)


ROOT = Path(__file__).resolve().parents[1]
C_DIRS = ("qcompiler/native", "backends/bpu/native")  # the C sources build.py compiles, relative to a tree


def build(tree: Path, cache: Path) -> ctypes.CDLL:
    """The C sources of ``tree`` (a checkout) compiled by ``build.command`` with that tree's sources and
    include directory in place of the working tree's, cached by the hash of its ``.c`` / ``.h`` files."""
    files = sorted(f for d in C_DIRS for f in (tree / d).glob("*.[ch]"))
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(tree)).encode() + b"\0" + f.read_bytes() + b"\0")
    target = cache / f"k_{h.hexdigest()[:16]}.so"
    if not target.is_file():
        live = {f"-I{INCLUDE}", *(str(s) for s in SOURCES)}
        cmd = [a for a in command("gcc", target) if a not in live]
        cmd[-1:-1] = [f"-I{tree / C_DIRS[0]}", *(str(f) for f in files if f.suffix == ".c")]  # before -lm
        subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(target))


def checkout(rev: str, dest: Path) -> Path:
    """The C directories of git revision ``rev`` (those it has) extracted under ``dest``."""
    dirs = subprocess.run(["git", "ls-tree", "-d", "--name-only", rev, "--", *C_DIRS], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.split()
    tar = subprocess.run(["git", "archive", rev, "--", *dirs], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return dest


def record_calls(name: str, batch: int) -> list:
    """``(kernel name, argtypes, args, kept tensors)`` of every single-threaded ``qc_gemm_*`` call of one run.
    The arguments point into the layers' own tensors (weights, bias, multipliers) as well: each call's
    kept list holds the runner, so they outlive the replay."""
    calls, orig = [], kernels_mod._fn

    def fn(kname, argtypes, restype=ctypes.c_int):
        f = orig(kname, argtypes, restype)
        if not _KERNEL.fullmatch(kname):  # (not the row-split, step, layout, repack or constants entries)
            return f

        def wrapped(*a):
            a, keep = list(a), []
            m1, K, O = a[3], a[4], a[5]
            if a[16]:  # a conv: copy the geometry and the whole input
                geo = torch.tensor((ctypes.c_int64 * _GEO).from_address(a[16])[:], dtype=torch.int64)
                H, W, C, Ho, Wo = (int(geo[i]) for i in (0, 1, 2, 11, 12))
                nx = -(-m1 // (Ho * Wo)) * H * W * C
                if int(geo[13]):  # the tail layout's weights (Op x Kp bytes), kept as the input is
                    nw = -(-O // 16) * 16 * -(-K // 4) * 4
                    wt = torch.frombuffer((ctypes.c_int8 * nw).from_address(int(geo[13])), dtype=torch.int8).clone()
                    keep.append(wt)
                    geo[13] = wt.data_ptr()
                keep.append(geo)
                a[16] = geo.data_ptr()
            else:
                nx = (m1 - 1) * a[1] + K
            xc = torch.frombuffer((ctypes.c_int8 * nx).from_address(a[0]), dtype=torch.int8).clone()
            keep.append(xc)
            a[0] = xc.data_ptr()
            if a[10]:  # the fused operand
                nb = m1 * O * (2 if kname.startswith("qc_gemm_add_i16") else 1)
                bc = torch.frombuffer((ctypes.c_int8 * nb).from_address(a[10]), dtype=torch.int8).clone()
                keep.append(bc)
                a[10] = bc.data_ptr()
            calls.append((kname, argtypes, tuple(a), keep))
            return f(*a)
        return wrapped

    kernels_mod._fn = gemm_mod._fn = fn
    saved = os.environ.get(ENV_PLAN)
    os.environ[ENV_PLAN] = "0"  # op by op: each layer's call goes through _fn (a plan calls its steps in C)
    try:
        conv = converted_model(name, 224, calibration_batches(224))
        runner = Runtime.simulated(conv, kernels="fast", threads=1)
        runner(zoo.example_inputs(name, image_size=224)[0].repeat(batch, 1, 1, 1))
        for call in calls:  # (the layers' weights, bias and multipliers the arguments point into)
            call[3].append(runner)
    finally:
        kernels_mod._fn = gemm_mod._fn = orig
        if saved is None:
            del os.environ[ENV_PLAN]
        else:
            os.environ[ENV_PLAN] = saved
    return calls


def compare(calls: list, libs: list, repeat: int) -> tuple[list, float, float, int]:
    rows, tot, bad = [], [0.0, 0.0], 0
    for kname, argtypes, a, _ in calls:
        fs = []
        for lib in libs:
            f = getattr(lib, kname)
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            fs.append(f)
        O = a[5]
        dt = torch.int16 if kname.endswith("_i16") else torch.int8
        outs = [torch.zeros(a[3] * O, dtype=dt) for _ in libs]
        best = [float("inf")] * len(libs)
        for _ in range(repeat):
            for i, f in enumerate(fs):
                args = list(a)
                args[17] = outs[i].data_ptr()  # (then the prepared constants, args[18])
                t = time.perf_counter()
                if f(*args) != 0:
                    raise MemoryError(f"{kname}: the kernel could not allocate its tables")
                best[i] = min(best[i], time.perf_counter() - t)
        same = torch.equal(outs[0], outs[1])
        bad += not same
        tot = [tot[0] + best[0], tot[1] + best[1]]
        rows.append([kname, "conv" if a[16] else "1x1/linear", a[3] - a[2], a[4], O, a[15], f"{best[0] * 1e3:.3f}",
                     f"{best[1] * 1e3:.3f}", f"{best[0] / best[1]:.2f}", "yes" if same else "NO"])
    return rows, tot[0], tot[1], bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision of the base C sources")
    ap.add_argument("--models", default="mobilenet_v2,resnet18")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bad_total = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = checkout(args.base, Path(tmp))
        libs = [build(base, Path(tmp)), build(ROOT, Path(tmp))]
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                rows, t0, t1, bad = compare(record_calls(name, batch), libs, args.repeat)
                bad_total += bad
                print(f"\n{name}, batch {batch}: base {args.base} vs working tree (ms, best of {args.repeat})")
                print(tabulate(rows, headers=["kernel", "layer", "rows", "K", "O", "f64", "base", "new", "base/new",
                                              "equal"], disable_numparse=True))
                print(f"total: base {t0 * 1e3:.3f} ms, new {t1 * 1e3:.3f} ms, base/new {t0 / t1:.3f}; "
                      f"{bad} unequal outputs")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
