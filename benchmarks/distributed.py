"""Wall time of calibration and sensitivity analysis on resnet18 with 1 vs 2 ranks (gloo, CPU).

    python benchmarks/distributed.py [--images 64] [--image-size 64] [--observer histogram-mse]

The script launches itself once per world size with torchrun's environment
variables (one thread per rank, a free port each time). Each rank:

* calibration: runs its share of the calibration batches through
  ``prepare_calibration_fx(resnet18)`` and ``sync_observers`` (timed from a
  barrier to the end of the reduction);
* sensitivity: ``QuantAnalysis.sensitivity`` on one bad case, one forward per
  quantizer, the quantizers split over the ranks (timed from a barrier).

The 1-rank and 2-rank runs alternate ``--repeats`` times (default 3) and the fastest
time of each is kept, as the machine may be shared. It checks that the 2-rank results
equal the 1-rank ones (observer state bit for bit, the sensitivity table exactly) and
prints the times and the ratios; the target is <= 0.65x with 2 ranks on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._data import SmoothNoise, reestimate_bn, stack  # noqa: E402
from qcompiler import collectives, zoo  # noqa: E402
from qcompiler.distributed import shard, sync_observers  # noqa: E402
from qcompiler.quantization.fake_quantize import set_state  # noqa: E402
from qcompiler.quantization.observer import ObserverBase  # noqa: E402
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx  # noqa: E402
from qcompiler.quantization.qconfig import get_default_calib_qconfig  # noqa: E402
from qcompiler.tools.quant_analysis import QuantAnalysis  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=64, help="calibration images (batches of 4)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--observer", default="histogram-mse")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternate 1-rank and 2-rank runs this many times, keep the fastest of each")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _timed(fn):
    """``(result, wall seconds, CPU seconds of the busiest rank)`` of ``fn`` run on every rank."""
    if dist.is_initialized():
        dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    cpu = torch.tensor([time.process_time() - c], dtype=torch.float64)
    # qcompiler's reduction, not dist.all_reduce: it returns once gloo has let go of the tensor, so a
    # rank that exits right after cannot abort in gloo's teardown (qcompiler/collectives.py)
    cpu = collectives.all_reduce(cpu, collectives.MAX, "the ranks' CPU times")
    return out, time.perf_counter() - t, float(cpu)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = zoo.get("resnet18")
    bn = SmoothNoise(32, size=args.image_size, seed=1000)
    reestimate_bn(model, [stack(bn, j, j + 8) for j in range(0, len(bn), 8)])
    model.eval()
    images = SmoothNoise(args.images, size=args.image_size, seed=0)
    batches = [stack(images, j, min(j + 4, len(images))) for j in range(0, len(images), 4)]
    example = (batches[0][:1],)
    cal = prepare_calibration_fx(model, {"": get_default_calib_qconfig(observer=args.observer)},
                                 example_inputs=example)
    cal.eval()

    def calibrate():
        with torch.no_grad():
            for b in shard(batches):
                cal(b)
        return sync_observers(cal)

    _, t_calib, c_calib = _timed(calibrate)
    state = {k: v for k, v in cal.state_dict().items()
             if any(k.startswith(p + ".") for p, m in cal.named_modules() if isinstance(m, ObserverBase))}
    fq = prepare_qat_fx(cal)
    set_state(fq, "validation")
    qa = QuantAnalysis(model, fq, "fake_quant", out_dir=tempfile.mkdtemp())
    qa.set_bad_case(batches[0])
    rows, t_sens, c_sens = _timed(lambda: qa.sensitivity("L1"))
    if rank == 0:
        torch.save({"calib": t_calib, "sens": t_sens, "calib_cpu": c_calib, "sens_cpu": c_sens, "state": state,
                    "rows": rows, "quantizers": len(rows), "batches": len(batches)}, args.worker)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace, out: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--images", str(args.images), "--image-size", str(args.image_size),
           "--observer", args.observer, "--worker", str(out)]
    procs = [subprocess.Popen(cmd, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                                            PYTHONPATH=str(ROOT), TQDM_DISABLE="1"))
             for r in range(world)]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"rank of the {world}-rank run failed with exit code {p.returncode}")
    return torch.load(out, weights_only=False)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    ones, twos = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            ones.append(launch(1, args, Path(tmp) / f"one{r}.pt"))
            twos.append(launch(2, args, Path(tmp) / f"two{r}.pt"))
    one, two = dict(ones[0]), dict(twos[0])
    for best, runs in ((one, ones), (two, twos)):
        for key in ("calib", "sens", "calib_cpu", "sens_cpu"):
            best[key] = min(r[key] for r in runs)
    same_state = one["state"].keys() == two["state"].keys() and all(
        torch.equal(v, two["state"][k]) for k, v in one["state"].items())
    same_rows = one["rows"] == two["rows"]
    result = {
        "calibration_s": [one["calib"], two["calib"]], "sensitivity_s": [one["sens"], two["sens"]],
        "calibration_ratio": two["calib"] / one["calib"], "sensitivity_ratio": two["sens"] / one["sens"],
        "same_observer_state": same_state, "same_sensitivity": same_rows,
        "calibration_cpu_s": [one["calib_cpu"], two["calib_cpu"]],
        "sensitivity_cpu_s": [one["sens_cpu"], two["sens_cpu"]],
    }
    print(f"resnet18 {args.image_size}x{args.image_size}, {args.images} calibration images in {one['batches']} "
          f"batches, observer {args.observer}, {one['quantizers']} quantizers; 1 thread per rank, "
          f"best of {args.repeats}")
    print(f"  calibration (forward + sync_observers): 1 rank {one['calib']:.2f} s, 2 ranks {two['calib']:.2f} s "
          f"-> {result['calibration_ratio']:.2f}x")
    print(f"  sensitivity (one forward per quantizer): 1 rank {one['sens']:.2f} s, 2 ranks {two['sens']:.2f} s "
          f"-> {result['sensitivity_ratio']:.2f}x")
    print(f"  CPU time of the busiest rank (what an idle core per rank would take): calibration "
          f"{one['calib_cpu']:.2f} s vs {two['calib_cpu']:.2f} s -> {two['calib_cpu'] / one['calib_cpu']:.2f}x, "
          f"sensitivity {one['sens_cpu']:.2f} s vs {two['sens_cpu']:.2f} s -> {two['sens_cpu'] / one['sens_cpu']:.2f}x")
    print(f"  2 ranks equal 1 rank: observer state bit for bit {same_state}, sensitivity table {same_rows}")
    print(json.dumps({k: v for k, v in result.items()}, default=float))
    return result


if __name__ == "__main__":
    main()
