"""Int8 PTQ / QAT accuracy: qcompiler vs torch.ao FX PTQ vs onnxruntime quantize_static.

    python benchmarks/accuracy.py [--quick] [--part all|zoo|digits] [--threads 2]

Needs scikit-learn (for its bundled 8x8 digits; nothing is downloaded).
Everything is deterministic (fixed seeds; results can move in the last digit
with another thread count).  ONNX files go to a temporary directory that is
removed at exit; nothing else is written.

(a) zoo resnet18 and mobilenet_v2, random weights, at 64x64 input (32x32 with
    --quick) to keep the run short.  The random models' BatchNorm statistics
    are re-estimated on smooth-noise images (train mode, running stats reset,
    momentum=None i.e. a cumulative average, 20 batches of 8 under no_grad),
    so every layer sees activations of the scale a trained network produces.
    32 smooth-noise images calibrate every method, 8 other ones are held out
    (and 64 more, other seeds, show how much of a difference is noise);
    the metric is the output SQNR 20*log10(||f|| / ||f - q||) over the
    held-out logits, f float, q the quantized model.
      * ours: prepare_calibration_fx (default int8 qconfig: symmetric
        per-tensor activations with the given observer, symmetric per-channel
        weights) -> calibrate -> convert_fx (the fixed-point model); and the
        same with optimize_weight_rounding on the calibration images before
        convert_fx ("+ weight rounding");
      * torch.ao: quantize_fx.prepare_fx / convert_fx with
        get_default_qconfig_mapping("x86") (quint8 activations with
        reduce_range=True, per-channel qint8 weights);
      * onnxruntime: quantize_static on the float model's ONNX (qcompiler's
        exporter, opset 13: benchmarks/_float_onnx.py), QDQ format, per_channel,
        QInt8 activations and weights (asymmetric activations, ORT's default),
        MinMax and Percentile calibration through a CalibrationDataReader.
    Reference rows ("ref: ...") put the numbers in context: ORT with
    symmetric activations (ActivationSymmetric=True, the scheme the BPU uses),
    the float ONNX export run by ORT (export sanity check) and the float model
    with Gaussian noise added to its input at 40 dB SQNR (how much these
    random networks amplify a small perturbation), and our fake-quant model
    with only the activations (float weights) or only the weights quantized
    (where our error comes from; where the two errors add up, as in resnet18,
    the activations-only row bounds what any weight rounding can reach).

(b) real data: scikit-learn's 8x8 digits (1797 images), fixed stratified
    75/25 split (random_state=0).  A small CNN (conv 1->16 3x3 + BN + ReLU,
    conv 16->32 3x3 stride 2 + BN + ReLU, global average pool, linear 32->10)
    is trained with seed 0.  256 training images calibrate every method.
    Reported: top-1 on the 450 held-out images, agreement of the top-1 with
    the float model, and the logit SQNR vs float, for float, our PTQ with
    every observer, our QAT (starting from the histogram-mse calibration
    model, high-precision int32 output on the final linear; Adam lr 1e-3),
    torch.ao FX PTQ and onnxruntime quantize_static.  As QAT trains further,
    the float model fine-tuned for the same epochs at the same lr is listed as
    its reference.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import io
import logging
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler.zoo as zoo  # noqa: E402
from benchmarks._data import SmoothNoise, reestimate_bn, sqnr_db, stack  # noqa: E402
from benchmarks._float_onnx import export_float_onnx  # noqa: E402
from qcompiler.quantization import (  # noqa: E402
    FakeQuantize,
    auto_int16,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    optimize_weight_rounding,
    prepare_calibration_fx,
    prepare_qat_fx,
    set_state,
)

OBSERVERS = ("minmax", "percentile", "histogram-mse", "kl")
ZOO_MODELS = ("resnet18", "mobilenet_v2")
OURS = "ours int8 PTQ, {}"
OURS_ROUNDED = "ours int8 PTQ, {} + weight rounding"
AO = "torch.ao FX PTQ (x86)"
ORT = "onnxruntime QDQ, {}"
ORT_SYM = "ref: onnxruntime QDQ, {}, symmetric act."
NOISE = "ref: float, input noise at 40 dB"
ONLY_ACTS = "ref: ours, activations only ({}), float weights"
ONLY_WEIGHTS = "ref: ours, weights only{}"


# ---------------------------------------------------------------------------
# the three quantizers: each takes a float model, calibration batches and
# returns a callable batch -> float outputs


def _calibrated(model: nn.Module, calib: Sequence[torch.Tensor], observer: str, rounding: bool) -> nn.Module:
    cal = prepare_calibration_fx(model, {"": get_default_calib_qconfig(observer=observer)},
                                 example_inputs=(calib[0][:1],))
    cal.eval()
    with torch.no_grad():
        for x in calib:
            cal(x)
    if rounding:  # GPTQ-style re-rounding of the weights on the same calibration batches
        optimize_weight_rounding(cal, calib)
    return cal


def ours_ptq(model: nn.Module, calib: Sequence[torch.Tensor], observer: str, rounding: bool = False) -> Callable:
    q = convert_fx(_calibrated(model, calib, observer, rounding))
    return lambda x: q(x).float()


def ours_partly_quantized(model: nn.Module, calib: Sequence[torch.Tensor], observer: str, rounding: bool,
                          quantize: str) -> Callable:
    """Our fake-quant model with only the ``"weights"`` or only the ``"activations"`` quantized.

    Where the error comes from: with ``"activations"`` (and ``rounding=False``, so the
    weights stay float) it is the SQNR our activation scheme allows with error-free weights.
    """
    cal = _calibrated(model, calib, observer, rounding)
    qat = set_state(prepare_qat_fx(cal, {"": get_default_qat_qconfig()}), "validation").eval()
    for path, m in qat.named_modules():
        if isinstance(m, FakeQuantize):
            m.enable_fake_quant(path.endswith("weight_fake_quant") == (quantize == "weights"))
    return lambda x: qat(x)


def torch_ao_ptq(model: nn.Module, calib: Sequence[torch.Tensor]) -> Callable:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
    from torch.ao.quantization.quantize_fx import prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices (torch.ao -> torchao)
        prepared = prepare_fx(copy.deepcopy(model).eval(), get_default_qconfig_mapping("x86"),
                              (calib[0][:1],))
        with torch.no_grad():
            for x in calib:
                prepared(x)
        q = ao_convert_fx(prepared)
    return lambda x: q(x)


def ort_session(path: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])


@contextlib.contextmanager
def _quiet():
    """Silence onnxruntime.quantization's prints, logging warnings and Python warnings."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def preprocessed(float_onnx: str) -> str:
    """ORT's recommended pre-processing (symbolic shape inference + graph optimization), once per model."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = float_onnx.replace(".onnx", ".pre.onnx")
    if not os.path.exists(out):
        with _quiet():
            quant_pre_process(float_onnx, out)
    return out


def ort_ptq(float_onnx: str, calib: Sequence[torch.Tensor], method: str, threads: int,
            symmetric_activations: bool = False) -> Callable:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": x.numpy()} for x in calib])

        def get_next(self):
            return next(self.batches, None)

    out = float_onnx.replace(".onnx", f".q_{method}_{int(symmetric_activations)}.onnx")
    with _quiet():
        quantize_static(preprocessed(float_onnx), out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=getattr(CalibrationMethod, method),
                        extra_options={"ActivationSymmetric": symmetric_activations})
    return ort_session(out, threads)


def run_all(model: nn.Module, calib: Sequence[torch.Tensor], tmp: str, tag: str, threads: int,
            with_reference: bool) -> dict:
    """{row label: batch -> output callable} for every method, plus timings."""
    runners, seconds = {}, {}

    def timed(label, fn, *args, **kw):
        t = time.perf_counter()
        runners[label] = fn(*args, **kw)
        seconds[label] = time.perf_counter() - t

    for obs in OBSERVERS:
        timed(OURS.format(obs), ours_ptq, model, calib, obs)
    for obs in OBSERVERS:
        timed(OURS_ROUNDED.format(obs), ours_ptq, model, calib, obs, rounding=True)
    timed(AO, torch_ao_ptq, model, calib)
    float_onnx = export_float_onnx(model, calib[0][:1], os.path.join(tmp, f"{tag}.onnx"))
    for method in ("MinMax", "Percentile"):
        timed(ORT.format(method), ort_ptq, float_onnx, calib, method, threads)
    if with_reference:
        for obs in OBSERVERS:
            timed(ONLY_ACTS.format(obs), ours_partly_quantized, model, calib, obs, False, "activations")
        timed(ONLY_WEIGHTS.format(""), ours_partly_quantized, model, calib, "histogram-mse", False, "weights")
        timed(ONLY_WEIGHTS.format(" + weight rounding"), ours_partly_quantized, model, calib, "histogram-mse",
              True, "weights")
        for method in ("MinMax", "Percentile"):
            timed(ORT_SYM.format(method), ort_ptq, float_onnx, calib, method, threads,
                  symmetric_activations=True)
    return {"runners": runners, "seconds": seconds, "float_onnx": float_onnx}


def best_of(scores: dict, labels: Sequence[str]) -> tuple[str, float]:
    label = max(labels, key=lambda k: scores[k])
    return label, scores[label]


# ---------------------------------------------------------------------------
# (a) zoo models on smooth noise


def part_zoo(args, tmp: str) -> dict:
    size = args.image_size
    n_calib, n_test, n_more, n_bn, batch = 32, 8, 64, 20 * 8, 8
    columns, more, notes = {}, {}, []
    for name in ZOO_MODELS:
        t0 = time.perf_counter()
        model = zoo.get(name)
        images = SmoothNoise(n_calib + n_test + n_bn, size=size, seed=1)
        calib = list(stack(images, 0, n_calib).split(batch))
        test = stack(images, n_calib, n_calib + n_test)
        # a second, larger held-out set (other seeds): how much of a difference is noise
        test_more = stack(SmoothNoise(n_more, size=size, seed=2))
        reestimate_bn(model, stack(images, n_calib + n_test).split(batch))
        with torch.no_grad():
            ref, ref_more = model(test), model(test_more)
            g = torch.Generator().manual_seed(7)
            noise = torch.randn(test.shape, generator=g)
            noise *= test.norm() / noise.norm() * 10 ** (-40 / 20)
            noisy = model(test + noise)
        res = run_all(model, calib, tmp, name, args.threads, with_reference=True)
        col, col_more = {}, {}
        with torch.no_grad():
            for label, run in res["runners"].items():
                col[label] = sqnr_db(ref, run(test))
                col_more[label] = sqnr_db(ref_more, run(test_more))
            float_ort = ort_session(res["float_onnx"], args.threads)
            col["ref: float ONNX export (sanity)"] = sqnr_db(ref, float_ort(test))
            col_more["ref: float ONNX export (sanity)"] = sqnr_db(ref_more, float_ort(test_more))
        col[NOISE] = sqnr_db(ref, noisy)
        col_more[NOISE] = float("nan")
        columns[name], more[name] = col, col_more
        notes.append(f"{name}: {time.perf_counter() - t0:.1f} s")
    labels = list(next(iter(columns.values())))
    headers = ["method"]
    for m in ZOO_MODELS:
        headers += [m, f"{m} ({n_more} more)"]

    def cell(v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.2f}"

    rows = [[label] + [cell(c[m][label]) for m in ZOO_MODELS for c in (columns, more)] for label in labels]
    print(f"\n(a) output SQNR (dB) vs float, random-weight zoo models, BN re-estimated on smooth "
          f"noise, {size}x{size} input, {n_calib} calibration / {n_test} held-out images "
          f"(and {n_more} more held-out images, other seeds); higher is better")
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    ours = [OURS.format(o) for o in OBSERVERS] + [OURS_ROUNDED.format(o) for o in OBSERVERS]
    peers = [AO] + [ORT.format(m) for m in ("MinMax", "Percentile")]
    verdicts = {}
    for m in ZOO_MODELS:
        for tag, scores in ((f"{n_test} held-out", columns[m]), (f"{n_more} more held-out", more[m])):
            bl, bv = best_of(scores, ours)
            pl, pv = best_of(scores, peers)
            beats = bv > pv
            verdicts.setdefault(m, {})[tag] = beats
            al, av = best_of(scores, [ONLY_ACTS.format(o) for o in OBSERVERS])
            print(f"  {m}, {tag}: our best is {bl.removeprefix('ours int8 PTQ, ')} at {bv:.2f} dB; best peer is "
                  f"{pl} at {pv:.2f} dB -> ours {'BEATS' if beats else 'does NOT beat'} every peer "
                  f"({bv - pv:+.2f} dB); our activations alone (float weights) reach "
                  f"{av:.2f} dB ({al.split('(')[1].split(')')[0]})")
    print("  time: " + ", ".join(notes))
    return {"columns": columns, "more": more, "beats": verdicts}


# ---------------------------------------------------------------------------
# (c) mixed precision: SQNR against the share of int16 activation tensors

SHARES = (0.0, 0.02, 0.05, 0.10, 0.20)
DIGITS_SHARES = SHARES + (0.34, 0.5)  # the digits CNN has 6 tensors: below 1/6 nothing moves


def ours_mixed(model: nn.Module, calib: Sequence[torch.Tensor], share: float,
               observer: str = "histogram-mse") -> tuple[Callable, Callable, dict, float]:
    """Our PTQ with auto_int16 at this share of int16 tensors: (with weight rounding, without, the
    search record, its seconds). The search runs once per share (a budget that cannot take the next
    greedy pick takes a cheaper one, so smaller budgets are not prefixes of larger ones)."""
    cal = _calibrated(model, calib, observer, rounding=False)
    t = time.perf_counter()
    auto_int16(cal, calib, budget=share)
    secs = time.perf_counter() - t
    rec = cal.meta["qc_int16"]
    plain = convert_fx(cal)
    optimize_weight_rounding(cal, calib)
    rounded = convert_fx(cal)
    return (lambda x: rounded(x).float()), (lambda x: plain(x).float()), rec, secs


def part_int16(args, tmp: str) -> dict:
    """resnet18 (64 more held-out images) and digits: output / logit SQNR vs the int16 share, and the peers."""
    size = args.image_size
    out: dict = {}
    model = zoo.get("resnet18")
    images = SmoothNoise(32 + 8 + 160, size=size, seed=1)
    calib = list(stack(images, 0, 32).split(8))
    test_more = stack(SmoothNoise(64, size=size, seed=2))
    reestimate_bn(model, stack(images, 40).split(8))
    with torch.no_grad():
        ref = model(test_more)
    curve, recs, secs = {}, {}, {}
    for share in SHARES:
        run, run8, recs[share], secs[share] = ours_mixed(model, calib, share)
        with torch.no_grad():
            curve[share] = (sqnr_db(ref, run(test_more)), len(recs[share]["chosen"]), sqnr_db(ref, run8(test_more)))
    n = recs[SHARES[0]]["tensors"]
    float_onnx = export_float_onnx(model, calib[0][:1], os.path.join(tmp, "r18_int16.onnx"))
    peers = {}
    with torch.no_grad():
        for method in ("MinMax", "Percentile"):
            peers[ORT.format(method)] = sqnr_db(ref, ort_ptq(float_onnx, calib, method, args.threads)(test_more))
            peers[ORT_SYM.format(method)] = sqnr_db(
                ref, ort_ptq(float_onnx, calib, method, args.threads, symmetric_activations=True)(test_more))
        peers[AO] = sqnr_db(ref, torch_ao_ptq(model, calib)(test_more))
    rows = [[f"ours, {100 * s:.0f}% int16 budget", f"{u} of {n}", f"{curve[s][2]:.2f}", f"{curve[s][0]:.2f}"]
            for s, (_, u, _) in curve.items()]
    rows += [[label, "-", "-", f"{v:.2f}"] for label, v in peers.items()]
    print(f"\n(c) resnet18 {size}x{size}, histogram-mse, 64 more held-out images: output SQNR (dB) vs the share of "
          f"BPU activation tensors in int16 (auto_int16 per share: "
          + ", ".join(f"{100 * k:.0f}%: {recs[k]['evaluations']} evaluations, {v:.0f} s" for k, v in secs.items())
          + ")")
    print(tabulate(rows, headers=["method", "int16 tensors", "no weight rounding", "+ weight rounding"],
                   tablefmt="github", disable_numparse=True))
    for share in SHARES:
        print(f"  {100 * share:.0f}%: " + ("; ".join(f"{'+'.join(q)} ({c} tensor(s)) -> {v:.2f} dB (calib)"
                                                   for q, v, c in recs[share]["steps"]) or "all int8"))
    best_asym = max(peers[ORT.format(m)] for m in ("MinMax", "Percentile"))
    at10 = curve[0.10][0]
    print(f"  at 10%: {at10:.2f} dB vs onnxruntime's best asymmetric int8 {best_asym:.2f} dB: "
          f"{at10 - best_asym:+.2f} dB (target +3.00)")
    out["resnet18"] = {"curve": curve, "peers": peers, "tensors": n, "steps": {k: r["steps"] for k, r in recs.items()}}
    if getattr(args, "plot", None):
        plot_curve(curve, peers, n, args.plot)
    out["digits"] = digits_int16(args, tmp)
    return out


def digits_int16(args, tmp: str) -> dict:
    Xtr, ytr, Xte, yte = digits_data()
    torch.manual_seed(0)
    model = DigitsCNN()
    train(model, Xtr, ytr, epochs=args.digits_epochs, lr=1e-2, seed=0)
    calib = list(Xtr[:256].split(32))
    with torch.no_grad():
        ref = model(Xte)
    rows, res = [], {}
    with torch.no_grad():
        for share in DIGITS_SHARES:
            run, _, rec, _ = ours_mixed(model, calib, share)
            used, n = len(rec["chosen"]), rec["tensors"]
            o = run(Xte)
            res[share] = (sqnr_db(ref, o), float((o.argmax(1) == yte).float().mean()), used)
            rows.append([f"ours, {100 * share:.0f}% int16 budget (+ weight rounding)", f"{used} of {n}",
                         f"{100 * res[share][1]:.2f}", f"{res[share][0]:.2f}"])
        float_onnx = export_float_onnx(model, calib[0][:1], os.path.join(tmp, "digits_int16.onnx"))
        for method in ("MinMax", "Percentile"):
            o = ort_ptq(float_onnx, calib, method, args.threads)(Xte)
            rows.append([ORT.format(method), "-", f"{100 * float((o.argmax(1) == yte).float().mean()):.2f}",
                         f"{sqnr_db(ref, o):.2f}"])
        rows.append(["float", "-", f"{100 * float((ref.argmax(1) == yte).float().mean()):.2f}", "-"])
    print("\n(c) digits: logit SQNR and top-1 vs the int16 share")
    print(tabulate(rows, headers=["method", "int16 tensors", "top-1 %", "logit SQNR dB"], tablefmt="github",
                   disable_numparse=True))
    return res


def plot_curve(curve: dict, peers: dict, n: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    xs = [100 * s for s in curve]
    ax.plot(xs, [v[0] for v in curve.values()], "o-", label="ours, auto int16 + weight rounding")
    ax.plot(xs, [v[2] for v in curve.values()], "o--", label="ours, auto int16 (no weight rounding)")
    styles = iter(["-", "--", ":", "-.", (0, (1, 1))])
    for i, (label, v) in enumerate(sorted(peers.items(), key=lambda kv: kv[1])):
        ax.axhline(v, linestyle=next(styles), color="grey", linewidth=1)
        ax.annotate(label.replace("onnxruntime QDQ", "ORT").replace("ref: ", ""), (xs[-1] if i % 2 else xs[0], v),
                    fontsize=6, ha="right" if i % 2 else "left", va="bottom" if i % 2 else "top")
    best = max(v for k, v in peers.items() if k.startswith("onnxruntime") and "symmetric" not in k)
    ax.axhline(best + 3, color="tab:red", linestyle=":", linewidth=1)
    ax.annotate("target: best asymmetric ORT + 3 dB", (xs[0], best + 3), fontsize=6, color="tab:red",
                ha="left", va="bottom")
    ax.set_xlabel(f"share of BPU activation tensors in int16 (% of {n})")
    ax.set_ylabel("output SQNR, dB (64 held-out)")
    ax.set_title("resnet18 64x64: SQNR vs int16 share", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


# ---------------------------------------------------------------------------
# (b) sklearn digits


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))


def digits_data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = X.astype(np.float32).reshape(-1, 1, 8, 8) / 16.0
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    mean, std = Xtr.mean(), Xtr.std()
    Xtr, Xte = (Xtr - mean) / std, (Xte - mean) / std
    return (torch.from_numpy(Xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(Xte), torch.from_numpy(yte).long())


def train(model: nn.Module, X: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int,
          batch: int = 64) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * math.ceil(len(X) / batch)))
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=g)
        for i in range(0, len(X), batch):
            idx = perm[i:i + batch]
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def ours_qat(Xtr, ytr, model, calib, epochs: int, lr: float) -> Callable:
    cal = prepare_calibration_fx(model, {"": get_default_calib_qconfig(observer="histogram-mse")},
                                 example_inputs=(calib[0][:1],))
    cal.eval()
    with torch.no_grad():
        for x in calib:
            cal(x)
    qat = prepare_qat_fx(cal, {"": get_default_qat_qconfig(),
                               "module_name": [("fc", get_default_qat_out_qconfig())]})
    set_state(qat, "qat")
    train(qat, Xtr, ytr, epochs=epochs, lr=lr, seed=1)
    set_state(qat, "validation")
    qat.eval()
    q = convert_fx(qat)
    return lambda x: q(x).float()


def part_digits(args, tmp: str) -> dict:
    t0 = time.perf_counter()
    Xtr, ytr, Xte, yte = digits_data()
    torch.manual_seed(0)
    model = DigitsCNN()
    train(model, Xtr, ytr, epochs=args.digits_epochs, lr=1e-2, seed=0)
    t_train = time.perf_counter() - t0
    calib = list(Xtr[:256].split(32))
    with torch.no_grad():
        ref = model(Xte)
    res = run_all(model, calib, tmp, "digits", args.threads, with_reference=False)
    runners = {"float": lambda x: model(x)}
    for obs in OBSERVERS:
        runners[OURS.format(obs)] = res["runners"][OURS.format(obs)]
    for obs in OBSERVERS:
        runners[OURS_ROUNDED.format(obs)] = res["runners"][OURS_ROUNDED.format(obs)]
    t = time.perf_counter()
    qat_label = f"ours int8 QAT ({args.qat_epochs} ep. from hist-mse calib, int32 fc out)"
    runners[qat_label] = ours_qat(Xtr, ytr, model, calib, args.qat_epochs, lr=1e-3)
    t_qat = time.perf_counter() - t
    # QAT trains further; the float model trained the same extra epochs at the same lr is its reference
    tuned = train(copy.deepcopy(model), Xtr, ytr, epochs=args.qat_epochs, lr=1e-3, seed=1)
    runners[f"ref: float, + the same {args.qat_epochs} ep. fine-tuning"] = lambda x: tuned(x)
    runners[AO] = res["runners"][AO]
    for m in ("MinMax", "Percentile"):
        runners[ORT.format(m)] = res["runners"][ORT.format(m)]
    rows, scores = [], {}
    with torch.no_grad():
        for label, run in runners.items():
            out = run(Xte).float()
            acc = float((out.argmax(1) == yte).float().mean())
            agree = float((out.argmax(1) == ref.argmax(1)).float().mean())
            s = sqnr_db(ref, out)
            scores[label] = acc
            retrained = "QAT" in label or label.startswith("ref: float")
            rows.append([label, f"{100 * acc:.2f}", f"{100 * agree:.2f}",
                         "-" if math.isinf(s) else f"{s:.2f}" + (" *" if retrained else "")])
    print(f"\n(b) sklearn digits 8x8: small CNN trained {args.digits_epochs} epochs (seed 0), "
          f"{len(Xtr)} train / {len(Xte)} held-out images, 256 calibration images")
    print(tabulate(rows, headers=["method", "top-1 %", "agrees w/ float %", "logit SQNR dB"],
                   tablefmt="github", disable_numparse=True))
    print("  * weights retrained after the float model, so its logits differ from the float model's by "
          "more than quantization error")
    print(f"  time: training {t_train:.1f} s, QAT {t_qat:.1f} s, total {time.perf_counter() - t0:.1f} s")
    return {"top1": scores}


# ---------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller run: 32x32 zoo inputs, 10 training / 1 QAT epochs on digits")
    p.add_argument("--part", choices=("all", "zoo", "digits", "int16"), default="all",
                   help="int16: (c) only, SQNR against the int16 share (not part of 'all')")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="with --part int16: write the curve")
    p.add_argument("--threads", type=int, default=2, help="torch / onnxruntime intra-op threads")
    args = p.parse_args(argv)
    args.image_size = 32 if args.quick else 64
    args.digits_epochs = 10 if args.quick else 30
    args.qat_epochs = 1 if args.quick else 3
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import onnxruntime

    versions = [f"torch {torch.__version__}", f"onnxruntime {onnxruntime.__version__}"]
    try:
        import sklearn

        versions.append(f"scikit-learn {sklearn.__version__}")
    except ImportError:
        if args.part in ("all", "digits", "int16"):
            sys.exit("benchmarks/accuracy.py needs scikit-learn for the digits part: pip install scikit-learn "
                     "(or run --part zoo)")
    print(f"accuracy benchmark, {datetime.date.today().isoformat()}, {platform.machine()} "
          f"{os.cpu_count()} cores, {args.threads} threads; " + ", ".join(versions)
          + (" [--quick]" if args.quick else ""))
    t0 = time.perf_counter()
    out = {}
    with tempfile.TemporaryDirectory(prefix="qc_accuracy_") as tmp:
        if args.part in ("all", "zoo"):
            out["zoo"] = part_zoo(args, tmp)
        if args.part in ("all", "digits"):
            out["digits"] = part_digits(args, tmp)
        if args.part == "int16":
            out["int16"] = part_int16(args, tmp)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
