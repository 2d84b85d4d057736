"""The int8 GEMM's conv layers on AVX512-VNNI vectors vs AMX tiles, in one run (GMAC/s, outputs equal).

    python benchmarks/gemm_layers.py [--repeat 9]

Each row is one conv of a zoo model at 224x224 and batch 8 (2 for unet's large ones), as the simulator
calls it (``Int8Gemm.conv``, channels-last int8 input, random int8 weights, a per-channel requantization
to int8), run at one torch thread on the vector path and on the tile path in rotation (best of
``--repeat``), with the layout the tile path reads it in (``conv_layout``: "slide" reads a padded copy in
place, the others copy rows into a panel).  Both outputs must be equal (the run stops otherwise).  On a
machine without AMX the tile columns are empty.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qcompiler.backends.bpu.native.gemm import Int8Gemm  # noqa: E402
from qcompiler.backends.bpu.native.kernels import amx_mode, set_amx  # noqa: E402

# name: (N, H, W, C, O, k, stride, padding)
LAYERS = {
    "resnet18 stem 7x7/2": (8, 224, 224, 3, 64, 7, 2, 3),
    "resnet18 layer1 3x3": (8, 56, 56, 64, 64, 3, 1, 1),
    "resnet18 layer2 3x3/2": (8, 56, 56, 64, 128, 3, 2, 1),
    "resnet18 layer2 3x3": (8, 28, 28, 128, 128, 3, 1, 1),
    "resnet18 layer3 3x3": (8, 14, 14, 256, 256, 3, 1, 1),
    "resnet18 layer4 3x3": (8, 7, 7, 512, 512, 3, 1, 1),
    "unet dec1 3x3 (48 -> 16)": (2, 224, 224, 48, 16, 3, 1, 1),
    "unet enc1 3x3 (16 -> 16)": (2, 224, 224, 16, 16, 3, 1, 1),
    "unet dec2 3x3 (96 -> 32)": (2, 112, 112, 96, 32, 3, 1, 1),
    "mobilenet_v2 1x1 (32 -> 192)": (8, 56, 56, 32, 192, 1, 1, 0),
    "mobilenet_v2 1x1 (320 -> 1280)": (8, 7, 7, 320, 1280, 1, 1, 0),
}


def layer(N, H, W, C, O, k, s, p, gen):
    w = torch.randint(-128, 128, (O, k * k * C), dtype=torch.int8, generator=gen)
    x = torch.randint(-128, 128, (N, H, W, C), dtype=torch.int8, generator=gen)
    M, n = torch.randint(1, 1 << 15, (O,), generator=gen), torch.full((O,), 22)
    g = Int8Gemm(w, torch.randint(-1000, 1000, (O,), generator=gen), M, n, -128, 127, torch.int8)
    Ho, Wo = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    outs = {amx: torch.empty(N, Ho, Wo, O, dtype=torch.int8) for amx in (False, True)}
    return g, x, outs, N * Ho * Wo * O * k * k * C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    was = amx_mode()
    has_amx = set_amx(True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for name, (N, H, W, C, O, k, s, p) in LAYERS.items():
            g, x, outs, macs = layer(N, H, W, C, O, k, s, p, gen)
            conv = dict(kernel_size=(k, k), stride=(s, s), padding=(p, p), dilation=(1, 1))
            best = {False: float("inf"), True: float("inf")}
            paths = (False, True) if has_amx else (False,)
            for _ in range(args.repeat + 1):  # (the first round warms up)
                for amx in paths:
                    set_amx(amx)
                    t0 = time.perf_counter()
                    g.conv(x, out=outs[amx], **conv)
                    best[amx] = min(best[amx], time.perf_counter() - t0)
            set_amx(True)
            layout = g.conv_layout(tuple(x.shape), **conv) if has_amx else "-"
            if has_amx and not torch.equal(outs[False], outs[True]):
                raise SystemExit(f"{name}: the tile path's output differs from the vector path's")
            vec, til = best[False], best[True]
            rows.append([name, f"{macs / 1e6:.0f}", f"{vec * 1e3:.2f}", f"{macs / vec / 1e9:.0f}", layout,
                         f"{til * 1e3:.2f}" if has_amx else "-", f"{macs / til / 1e9:.0f}" if has_amx else "-",
                         f"{til / vec:.2f}" if has_amx else "-"])
    finally:
        set_amx(was > 0, every_call=was == 2)
    print(tabulate(rows, headers=["conv", "MMAC", "vnni ms", "vnni GMAC/s", "tile layout", "amx ms", "amx GMAC/s",
                                  "amx / vnni"], tablefmt="github"))


if __name__ == "__main__":
    main()
