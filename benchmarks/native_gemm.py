"""The native int8 GEMM (``backends/bpu/native/gemm.py``) vs the simulator's other kernels, in one run.

    python benchmarks/native_gemm.py [--models mobilenet_v2,resnet18] [--batches 1,8] [--repeat 10]

For each zoo model (quantized as ``benchmarks/simulator.py`` does) two ``Runtime.simulated`` runtimes are
built on the same converted model: ``gemm`` with the native GEMM for the 1x1 convs and linear
layers it proves exact, ``old`` with ``QCOMPILER_NATIVE_VNNI=0`` at build time (oneDNN's int8
conv with a float32 output + the native requantization, or the int8/float GEMMs).  Both outputs
must be ``torch.equal`` to the converted model's.  Times are the best of ``--repeat`` calls in
rotation at one torch thread (the machine may be shared: the rotation exposes both to the same
load); then the time per op kind of each, also in rotation.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from tabulate import tabulate

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler.zoo as zoo  # noqa: E402
from benchmarks.simulator import best_times, calibration_batches, converted_model, environment, op_kind_profile  # noqa: E402
from qcompiler.backends.bpu.lower import lower_bpu_partitions  # noqa: E402
from qcompiler.backends.bpu.native.gemm import ENV_VNNI, gemm_available  # noqa: E402
from qcompiler.runtime import Runtime  # noqa: E402


def _runner(gm, programs, gemm: bool) -> Runtime:
    saved = os.environ.get(ENV_VNNI)
    os.environ[ENV_VNNI] = "1" if gemm else "0"
    try:
        return Runtime.simulated(gm, programs, threads=1)
    finally:
        if saved is None:
            os.environ.pop(ENV_VNNI, None)
        else:
            os.environ[ENV_VNNI] = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mobilenet_v2,resnet18")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(environment())
    if not gemm_available():
        print("the native int8 GEMM is not available here (no AVX512-VNNI build, or native kernels off)")
        return
    calib = calibration_batches(args.size)
    rows, profiles = [], []
    for name in args.models.split(","):
        gm = converted_model(name, args.size, calib)
        programs = lower_bpu_partitions(gm)
        runners = {"gemm": _runner(gm, programs, True), "old": _runner(gm, programs, False)}
        for batch in (int(b) for b in args.batches.split(",")):
            x = zoo.example_inputs(name, batch=batch, image_size=args.size)[0]
            with torch.no_grad():
                want = gm(x)
                for key, r in runners.items():
                    got = r(x)
                    if not torch.equal(got, want):
                        raise SystemExit(f"{name} batch {batch}: the {key} runner differs from the converted model")
                t = best_times({k: (lambda r=r: r(x)) for k, r in runners.items()}, args.repeat)
                prof = {k: {} for k in runners}
                for _ in range(3):
                    for k, r in runners.items():
                        got = op_kind_profile(r, x, repeat=1)
                        if not prof[k] or got["(total)"] < prof[k]["(total)"]:
                            prof[k] = got
            rows.append([name, batch, round(t["gemm"] * 1e3, 2), round(t["old"] * 1e3, 2),
                         round(t["gemm"] / t["old"], 2), "yes"])
            kinds = sorted(set(prof["gemm"]) | set(prof["old"]), key=lambda k: -prof["old"].get(k, 0.0))
            profiles.append((f"{name} batch {batch}", [[k, round(prof["gemm"].get(k, 0.0) * 1e3, 2),
                                                        round(prof["old"].get(k, 0.0) * 1e3, 2),
                                                        round(prof["gemm"].get(k, 0.0) / prof["old"][k], 2)
                                                        if prof["old"].get(k) else "-"] for k in kinds]))
            print(f"  {name} {batch}: gemm {t['gemm'] * 1e3:.2f} ms, old {t['old'] * 1e3:.2f} ms", flush=True)
    print()
    print(tabulate(rows, headers=["model", "batch", "gemm ms", "old ms", "gemm / old", "exact"], tablefmt="github"))
    for title, table in profiles:
        print(f"\n{title}, 1 thread: time per op kind")
        print(tabulate(table, headers=["op kind", "gemm ms", "old ms", "gemm / old"], tablefmt="github"))


if __name__ == "__main__":
    main()
