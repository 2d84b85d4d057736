"""How partitioning time grows with graph size: our passes vs torch.fx's CapabilityBasedPartitioner.

    python benchmarks/partition_scaling.py [--sizes 1000,5000,10000,20000,40000] [--repeat 3]

Synthetic ``fx.GraphModule``s of N call nodes are built directly with
``torch.fx.Graph`` (no tracing): chains of BPU ops (``torch.relu``,
``torch.sigmoid``, residual ``operator.add`` reaching back 2..6 nodes, some
fan-out) with ~7% CPU ops (``F.selu``, ``torch.erf``); every node carries
``META_TENSOR`` so placement needs no shape propagation.

* ours: ``place`` + ``insert_stubs`` + ``partition`` on a fresh graph, timed together.
* peer: ``CapabilityBasedPartitioner`` on a fresh graph placed by our ``place``
  (untimed), with ``is_node_supported`` = "our placement is bpu"; timed
  ``__init__`` (it builds the all-pairs downstream sets) + ``propose_partitions``.
  The peer is skipped at a size whose time (or dependency-set memory) estimated
  from the growth over the smaller sizes would exceed the caps.

``--graph merge-heavy`` builds instead blocks that each need one merge of two
BPU groups in our partition pass (the worst case of its former bitset merge step,
quadratic: 75 s at 40k nodes; now a dynamically maintained topological order).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import operator
import pstats
import random
import sys
import time
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from qcompiler.ir.meta import BPU, CPU, META_PLACEMENT, META_TENSOR, TensorInfo
from qcompiler.ir.partitions import partitions
from qcompiler.march import March
from qcompiler.passes.base import CompileContext
from qcompiler.passes.insert_stubs import insert_stubs
from qcompiler.passes.partition import partition
from qcompiler.passes.place import place

INFO = TensorInfo((1, 8, 8, 8), "f32")
BPU_UNARY = (torch.relu, torch.sigmoid)
CPU_UNARY = (F.selu, torch.erf)


def build_graph(n: int, seed: int = 0, cpu_fraction: float = 0.07) -> fx.GraphModule:
    """A GraphModule of ``n`` call_function nodes (deterministic for ``seed``)."""
    rng = random.Random(seed)
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[META_TENSOR] = INFO
    values = [x]
    for _ in range(n):
        r = rng.random()
        if r < cpu_fraction:
            node = g.call_function(rng.choice(CPU_UNARY), (values[-1],))
        elif r < cpu_fraction + 0.2 and len(values) > 2:  # residual add
            back = values[-rng.randint(2, min(6, len(values)))]
            node = g.call_function(operator.add, (values[-1], back))
        else:
            # mostly a chain; sometimes a fan-out branch from an older value
            src = values[-rng.randint(2, min(4, len(values)))] if rng.random() < 0.1 and len(values) > 2 else values[-1]
            node = g.call_function(rng.choice(BPU_UNARY), (src,))
        node.meta[META_TENSOR] = INFO
        values.append(node)
    g.output(values[-1])
    return fx.GraphModule(nn.Module(), g)


def build_merge_heavy(n: int, seed: int = 0) -> fx.GraphModule:
    """~``n`` call nodes in blocks of 8 that each need one merge of two BPU groups in the partition pass.

    Block (v is a CPU value): a = relu(erf(v)) -> sigmoid(a) (a side output) and -> add;
    matmul(v, v) -> selu (CPU) -> relu -> add; v' = erf(add) (CPU).  ``a`` (behind its own
    observer) has users on two levels, so it is not lifted and its group is merged
    with the add's group afterwards.  (The matmul is BPU work: a lone relu there would do
    none between CPU ops, and placement keeps such a region on the CPU.)
    """
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[META_TENSOR] = INFO

    def call(fn, *args):
        node = g.call_function(fn, args)
        node.meta[META_TENSOR] = INFO
        return node

    v, side = call(torch.erf, x), []
    for _ in range(max(1, n // 8)):
        a = call(torch.relu, call(torch.erf, v))
        side.append(call(torch.sigmoid, a))
        e = call(torch.relu, call(F.selu, call(torch.matmul, v, v)))
        v = call(torch.erf, call(operator.add, a, e))
    g.output((v, *side))
    return fx.GraphModule(nn.Module(), g)


GRAPHS = {"mixed": build_graph, "merge-heavy": build_merge_heavy}


def run_ours(gm: fx.GraphModule, ctx: CompileContext) -> dict[str, float]:
    """Run our three passes; per-pass seconds."""
    times = {}
    for name, fn in (("place", place), ("insert_stubs", insert_stubs), ("partition", partition)):
        t0 = time.perf_counter()
        gm = fn(gm, ctx).gm
        times[name] = time.perf_counter() - t0
    times["total"] = sum(times.values())
    times["gm"] = gm
    return times


class PlacedOnBpu(OperatorSupportBase):
    """Supported iff our place pass put the node on the BPU (the same predicate as ours)."""

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return node.meta.get(META_PLACEMENT) == BPU


def run_peer(gm: fx.GraphModule, fuse: bool) -> dict:
    t0 = time.perf_counter()
    partitioner = CapabilityBasedPartitioner(gm, PlacedOnBpu(), allows_single_node_partition=True)
    t1 = time.perf_counter()
    proposed = partitioner.propose_partitions()
    t2 = time.perf_counter()
    dep_bytes = sum(sys.getsizeof(s) for s in partitioner.dependency_viewer.downstreams.values())
    out = {"init": t1 - t0, "propose": t2 - t1, "total": t2 - t0, "parts": len(proposed), "dep_bytes": dep_bytes}
    if fuse:
        t3 = time.perf_counter()
        partitioner.fuse_partitions(proposed)
        out["fuse"] = time.perf_counter() - t3
    return out


def best_of(repeat: int, make: Callable[[], fx.GraphModule], run: Callable[[fx.GraphModule], dict], key="total") -> dict:
    """Best of ``repeat`` runs, each on a fresh graph; the GC is off while timing (as in timeit)."""
    best = None
    for _ in range(repeat):
        gm = make()
        gc.collect()
        gc.disable()
        try:
            res = run(gm)
        finally:
            gc.enable()
        if best is None or res[key] < best[key]:
            best = res
        del gm
    return best


def estimate(history: list[tuple[int, float]], n: int) -> Optional[float]:
    """Extrapolate a measured quantity to size ``n`` by the log-log slope of the last two points (>= 1)."""
    if not history:
        return None
    if len(history) == 1:
        (n0, v0), slope = history[0], 2.0  # assume quadratic until we have a slope
    else:
        (na, va), (n0, v0) = history[-2], history[-1]
        slope = max(1.0, math.log(max(v0, 1e-9) / max(va, 1e-9)) / math.log(n0 / na))
    return v0 * (n / n0) ** slope


def slope(points: list[tuple[int, float]]) -> float:
    (n0, t0), (n1, t1) = points[0], points[-1]
    return math.log(t1 / t0) / math.log(n1 / n0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,5000,10000,20000,40000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peer-cap", type=float, default=120.0, help="skip the peer above this estimated time (s)")
    ap.add_argument("--peer-mem-cap-gb", type=float, default=4.0, help="skip the peer above this estimated memory")
    ap.add_argument("--fuse-cap", type=float, default=20.0, help="time fuse_partitions only below this estimate (s)")
    ap.add_argument("--graph", choices=sorted(GRAPHS), default="mixed",
                    help="mixed: the realistic mix (default); merge-heavy: worst case for our merge step")
    ap.add_argument("--profile", action="store_true", help="cProfile our passes at the largest size")
    args = ap.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    ctx = CompileContext(march=March.BAYES)

    build = GRAPHS[args.graph]

    def placed(n: int) -> fx.GraphModule:
        return place(build(n), ctx).gm

    # two extra small sizes first give the peer's growth slope before the first requested size
    calibration = [c for c in (sizes[0] // 4, sizes[0] // 2) if c >= 50 and c not in sizes]
    rows = []
    ours_pts: list[tuple[int, float]] = []
    peer_pts: list[tuple[int, float]] = []
    mem_pts: list[tuple[int, float]] = []
    fuse_pts: list[tuple[int, float]] = []
    for n in calibration + sizes:
        ours = best_of(args.repeat, lambda: build(n), lambda gm: run_ours(gm, ctx))
        parts = partitions(ours.pop("gm"))
        nb = sum(p.placement == BPU for p in parts)
        nc = sum(p.placement == CPU for p in parts)
        if n not in calibration:
            ours_pts.append((n, ours["total"]))

        est_t, est_m = estimate(peer_pts, n), estimate(mem_pts, n)
        note = ""
        if est_t is not None and est_t > args.peer_cap:
            note = f"peer skipped: est. {est_t:.0f} s > {args.peer_cap:.0f} s"
        elif est_m is not None and est_m > args.peer_mem_cap_gb * 2**30:
            note = f"peer skipped: est. {est_m / 2**30:.1f} GB dependency sets > {args.peer_mem_cap_gb:g} GB"
        peer = None
        if not note:
            est_f = estimate(fuse_pts, n)
            do_fuse = est_f is None or est_f < args.fuse_cap
            reps = args.repeat if (est_t is None or est_t * args.repeat < args.peer_cap) else 1
            peer = best_of(reps, lambda: placed(n), lambda gm: run_peer(gm, do_fuse))
            peer_pts.append((n, peer["total"]))
            mem_pts.append((n, peer["dep_bytes"]))
            if "fuse" in peer:
                fuse_pts.append((n, peer["fuse"]))
            elif est_f is not None:
                note = f"fuse_partitions not timed: est. {est_f:.0f} s"
        if n in calibration:
            note = (note + "; " if note else "") + "extra size: calibrates the peer's slope"
        prev = ours_pts[-2] if n not in calibration and len(ours_pts) > 1 else None
        rows.append([
            n,
            f"{ours['total']:.3f}",
            f"{ours['total'] / prev[1]:.2f}x for {n / prev[0]:g}x nodes" if prev else "-",
            f"{ours['place']:.2f} / {ours['insert_stubs']:.2f} / {ours['partition']:.2f}",
            f"{peer['total']:.3f} ({peer['init']:.2f} + {peer['propose']:.2f})" if peer else "skipped",
            f"{peer['fuse']:.2f}" if peer and "fuse" in peer else "-",
            f"{peer['total'] / ours['total']:.1f}x" if peer else "-",
            f"{nb + nc} ({nb}/{nc})",
            peer["parts"] if peer else "-",
            f"{peer['dep_bytes'] / 2**20:.0f}" if peer else "-",
            note,
        ])
        print(f"  done N={n}: ours {ours['total']:.3f} s" + (f", peer {peer['total']:.3f} s" if peer else f" ({note})"),
              file=sys.stderr, flush=True)

    headers = [
        "nodes", "ours (s)", "ours: growth\n(vs the size before)", "place / stubs / partition (s)",
        "torch.fx CapabilityBasedPartitioner (s)\n(__init__ + propose_partitions)", "peer fuse_partitions (s)",
        "ratio peer/ours", "our #partitions (bpu/cpu)", "peer #partitions (bpu)", "peer dep. sets (MiB)", "note",
    ]
    print(f"graph '{args.graph}', march bayes, best of {args.repeat} (GC off while timing), torch {torch.__version__}, "
          f"peer caps: {args.peer_cap:g} s, {args.peer_mem_cap_gb:g} GB")
    print(tabulate(rows, headers=headers, tablefmt="github"))
    if len(ours_pts) > 1:
        print(f"ours: growth exponent (log-log slope {ours_pts[0][0]} -> {ours_pts[-1][0]} nodes): {slope(ours_pts):.2f}")
    if len(peer_pts) > 1:
        print(f"peer: growth exponent ({peer_pts[0][0]} -> {peer_pts[-1][0]} nodes): {slope(peer_pts):.2f}")
    print("ours counts the inserted stub nodes too (observers/dequants are BPU nodes); the peer partitions "
          "only the BPU nodes of the placed graph (no stubs), so its counts are of BPU partitions only.")
    if any(r[3] == "skipped" for r in rows):
        print(f"peer capped: sizes marked 'skipped' were estimated (log-log extrapolation of the measured sizes) "
              f"to exceed {args.peer_cap:g} s or {args.peer_mem_cap_gb:g} GB, and were not run.")

    if args.profile:
        gm = build(sizes[-1])
        prof = cProfile.Profile()
        prof.enable()
        run_ours(gm, ctx)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(r"passes|recompile|python_code|compile", 14)
        print(f"\ncProfile of ours at {sizes[-1]} nodes (cumulative, our passes and fx codegen):")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
