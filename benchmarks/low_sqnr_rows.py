"""Why a row of the architecture zoo has a low SQNR: the compiler, or the random model?

    OMP_NUM_THREADS=1 python benchmarks/low_sqnr_rows.py [--models MobileNetV2 EfficientNet MobileViT]
    OMP_NUM_THREADS=1 python benchmarks/low_sqnr_rows.py --out docs/architecture_zoo.md   # rewrite its section

The zoo (benchmarks/architecture_zoo.py) measures random-weight models, where torch.ao FX cannot trace
most of them, so a low SQNR there has no peer. Per model this script measures, on the zoo's own model,
calibration batches and measured batch, all output tensors together:

* **qcompiler** ``compile(march="bayes")`` with its default observer (histogram-mse) and with the
  ``minmax`` and ``percentile`` observers;
* **onnxruntime's quantizer** (``onnxruntime.quantization.quantize_static``: QDQ, per-channel symmetric
  int8 weights, symmetric int8 activations -- the BPU's grid -- with its MinMax and Percentile
  calibration) on the float ONNX the project's exporter writes, the same batches;
* what **no int8 scheme** can beat: the float model with only its conv / linear weights rounded to the
  int8 per-channel grid (activations float), and qcompiler with int16 activations (weights int8);
* the float model's **perturbation gain**: its output SQNR when noise 60 dB below the input is added
  to the input. A model that turns 60 dB into 17 dB amplifies every rounding step the same way.

Rows where the peer and the weight-only bound are as low as qcompiler say the model, not the compiler,
limits the SQNR.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.architecture_zoo import CALIBRATION_BATCHES, CASES, Case  # noqa: E402
from benchmarks._float_onnx import export_float_onnx  # noqa: E402
from benchmarks.model_coverage import _quiet, sqnr  # noqa: E402
from qcompiler.compiled import compile as qc_compile  # noqa: E402
from qcompiler.quantization.qconfig import get_default_calib_qconfig  # noqa: E402

DEFAULT_MODELS = ("MobileNetV2", "EfficientNet", "MobileViT")
MEASURED = 0  # the zoo measures batch 0 of its calibration batches
NOISE_DB = 60.0
BEGIN, END = "<!-- low_sqnr_rows: begin -->", "<!-- low_sqnr_rows: end -->"


class _Positional(nn.Module):
    """The zoo's keyword model called with ``pixel_values`` positionally; returns its output tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> tuple:
        out = self.model(pixel_values=pixel_values)  # a ModelOutput: a dict of its non-None fields
        return tuple(out.values())


def _weights_on_int8_grid(model: nn.Module) -> nn.Module:
    """A copy whose conv / linear weights are rounded to the symmetric per-output-channel int8 grid."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for m in out.modules():
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)):
                w = m.weight
                s = (w.abs().flatten(1).amax(1).clamp_min(1e-12) / 127).view(-1, *([1] * (w.dim() - 1)))
                w.copy_(torch.round(w / s).clamp(-128, 127) * s)
    return out


def _ort_peer(model: nn.Module, calib: list[torch.Tensor], x: torch.Tensor, method: str) -> Any:
    """onnxruntime's static int8 quantization (symmetric, per-channel weights) of the float model's ONNX."""
    import onnxruntime as ort
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"pixel_values": b.numpy()} for b in calib])

        def get_next(self) -> Optional[dict]:
            return next(self.it, None)

    with tempfile.TemporaryDirectory() as d:
        f, q = Path(d) / "float.onnx", Path(d) / "int8.onnx"
        export_float_onnx(model, x, str(f), input_name="pixel_values", batch_axis=None)
        quantize_static(str(f), str(q), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=getattr(CalibrationMethod, method),
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
        s = ort.InferenceSession(str(q), providers=["CPUExecutionProvider"])
        return tuple(torch.from_numpy(o) for o in s.run(None, {"pixel_values": x.numpy()}))


def measure(case: Case) -> dict:
    """The row of one model (see the module docstring); a column that fails holds its error."""
    model = _Positional(case.model()).eval()
    calib = [case.inputs(i)["pixel_values"] for i in range(CALIBRATION_BATCHES)]
    x = calib[MEASURED]
    with torch.no_grad():
        ref = model(x)
    row: dict = {"model": case.name}

    def ours(label: str, **kw: Any) -> None:
        try:
            cm = qc_compile(model, (x,), march="bayes", calib_data=calib, progress=False, **kw)
            with torch.no_grad():
                row[label] = sqnr(ref, cm(x))
        except Exception as exc:  # a column, not the end of the table
            row[label] = type(exc).__name__
            print(f"{case.name} {label}: {type(exc).__name__}: {exc}", file=sys.stderr)

    ours("qcompiler (histogram-mse)")
    for obs in ("minmax", "percentile"):
        ours(f"qcompiler ({obs})", qconfig_dict={"": get_default_calib_qconfig(observer=obs)})
    for method in ("MinMax", "Percentile"):
        try:
            row[f"onnxruntime ({method})"] = sqnr(ref, _ort_peer(model, calib, x, method))
        except Exception as exc:
            row[f"onnxruntime ({method})"] = type(exc).__name__
            print(f"{case.name} onnxruntime ({method}): {type(exc).__name__}: {exc}", file=sys.stderr)
    with torch.no_grad():
        row["int8 weights only (float acts)"] = sqnr(ref, _weights_on_int8_grid(model)(x))
    ours("qcompiler int16 acts", qconfig_dict={"": get_default_calib_qconfig(dtype="qint16")})
    g = torch.Generator().manual_seed(0)
    noisy = x + x.pow(2).mean().sqrt() * 10 ** (-NOISE_DB / 20) * torch.randn(x.shape, generator=g)
    with torch.no_grad():
        row[f"float, input noise at {NOISE_DB:.0f} dB"] = sqnr(ref, model(noisy))
    return row


def _fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def table(rows: list[dict]) -> str:
    heads = list(rows[0])
    return tabulate([[_fmt(r.get(h, "")) for h in heads] for r in rows], headers=heads, tablefmt="github")


def write_section(doc: Path, text: str) -> None:
    """Replace the marked section of ``doc`` (appended when the markers are missing)."""
    body = doc.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in body and END in body:
        body = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, body, flags=re.S)
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(body)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    ap.add_argument("--out", type=Path, help="rewrite this doc's low_sqnr_rows section")
    args = ap.parse_args(argv)
    by_name = {c.name: c for c in CASES}
    unknown = [m for m in args.models if m not in by_name]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; the zoo has {', '.join(by_name)}")
    rows = []
    for name in args.models:
        with _quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows.append(measure(by_name[name]))
        print(table(rows[-1:]), flush=True)
    text = table(rows)
    print(text)
    if args.out:
        write_section(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
