"""The runnable examples in examples/ run end to end (in-process, small sizes)."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"qcompiler_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ptq_fx():
    return load_example("ptq_fx")


# Floors measured on 2 cores with torch 2.13: resnet18 at 32x32 (BN re-estimated on
# smooth noise) reaches ~16.4 dB with histogram-mse; the hybrid model ~40.8 dB.
# Random-weight resnet18 with re-estimated BN amplifies small perturbations by
# ~13 dB, so its floor is lower than a trained model's would be.
@pytest.mark.parametrize("args, floor", [
    (["--model", "resnet18", "--image-size", "32", "--calib-batches", "2", "--bn-batches", "4"], 12.0),
    (["--model", "hybrid", "--image-size", "16", "--calib-batches", "2", "--bn-batches", "2",
      "--march", "bernoulli2"], 30.0),
])
def test_ptq_fx_example_runs_and_tracks_float(ptq_fx, args, floor):
    result = ptq_fx.main(args + ["--quiet"])
    assert math.isfinite(result["sqnr_db"]), result
    assert result["sqnr_db"] > floor, f"output SQNR {result['sqnr_db']:.2f} dB <= {floor} dB: {result}"
    assert result["partitions"].startswith("partitions: ")
    assert result["calib_images"] == 2 * 4 and result["eval_images"] == 8


# The layers whose calibration inputs outnumber their columns (the stem, layer1, the layer2/layer3
# downsamples); the deeper ones see fewer and keep nearest rounding.
FULL_RANK_RESNET18_LAYERS = {"conv1.op", "layer1.0.conv1.op", "layer1.0.conv2.op", "layer1.1.conv1.op",
                             "layer1.1.conv2.op", "layer2.0.downsample.0.op", "layer3.0.downsample.0.op"}


def test_ptq_fx_example_weight_rounding_beats_nearest(ptq_fx, monkeypatch):
    # resnet18 at 32x32 on 32 calibration images (with 8 images most layers see fewer input vectors
    # than they have columns and keep nearest rounding)
    reports = []
    optimize = ptq_fx.optimize_weight_rounding

    def recording(*args, **kwargs):
        reports.append(optimize(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(ptq_fx, "optimize_weight_rounding", recording)
    args = ["--model", "resnet18", "--image-size", "32", "--calib-batches", "8", "--bn-batches", "4", "--quiet"]
    plain = ptq_fx.main(args)
    rounded = ptq_fx.main(args + ["--weight-rounding"])
    assert rounded["weight_rounding"] and not plain["weight_rounding"]
    # What the rounding optimizes: each layer's output error on the calibration data. GPTQ is
    # taken on every full-rank layer and cuts its error by 4.1-11.9 dB (stem and layer1.0.conv1
    # 11.0-11.9, downsamples 4.1-7.2) over data seeds 0-3 and model seeds 7, 11, 18, within 0.1 dB
    # under 1e-6 perturbations of the images (float noise barely moves it); no layer gets worse.
    (report,) = reports
    assert {r.name for r in report if r.method == "gptq"} == FULL_RANK_RESNET18_LAYERS, str(report)
    for r in report:
        assert r.rounded_mse <= r.nearest_mse, str(report)
        assert r.method != "gptq" or r.gain_db > 3.0, str(report)
    # End to end the gain is noisy: the random-weight resnet18 amplifies perturbations by ~13 dB.
    # Here (data seed 0, model seed 18) it was 16.13 -> 16.59 dB (+0.46) on an AVX2 EPYC, with or
    # without the native kernels (bit-identical), 16.03 -> 17.08 (+1.05) on the AVX-512 machine
    # the test was written on and +0.79 with that commit's code on the EPYC; scaling the images by
    # 1 + 1e-6 * randn (float noise) gave +0.56, +0.89, +0.82. Other seeds: +0.97, +0.77, +1.57
    # (data 1-3), +0.35, +0.88 (model 7, 11); 32 held-out images instead of 8: +0.47 to +1.05.
    # So: rounding helps, by a margin below every measured gain (not the per-machine +0.5); no
    # gain would mean the layers are fitted to inputs other than those the fixed-point model sees.
    assert rounded["sqnr_db"] > plain["sqnr_db"] + 0.2, (plain["sqnr_db"], rounded["sqnr_db"])


def test_ptq_fx_example_partition_summary_for_hybrid_model(ptq_fx):
    result = ptq_fx.main(["--model", "hybrid", "--image-size", "16", "--calib-batches", "1",
                          "--bn-batches", "0", "--quiet"])
    assert "cpu" in result["partitions"] and " 0 cpu" not in result["partitions"]
    assert result["march"] == "bayes"


def test_ptq_fx_example_rejects_bad_arguments(ptq_fx):
    with pytest.raises(SystemExit):
        ptq_fx.main(["--model", "lstm_seq"])
    with pytest.raises(SystemExit):
        ptq_fx.main(["--calib-batches", "0"])


@pytest.mark.slow
def test_qat_ddp_example_trains_on_two_ranks_with_equal_scales(tmp_path):
    pytest.importorskip("sklearn")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(EXAMPLES.parent))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(EXAMPLES / "qat_ddp.py"), "--epochs", "8", "--qat-epochs", "1"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("ranks ")]
    assert len(lines) == 1, run.stdout  # rank 0 reports, once
    m = re.match(r"ranks 2: float top-1 ([\d.]+)%, int8 QAT top-1 ([\d.]+)% on 450 held-out digits; "
                 r"fake-quant scales equal on all ranks: True", lines[0])
    assert m, lines[0]
    # 8 float epochs reach ~96%; int8 QAT stays within a few points of float
    assert float(m.group(1)) > 90.0 and float(m.group(2)) > float(m.group(1)) - 3.0, lines[0]
