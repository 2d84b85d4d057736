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


def test_ptq_fx_example_weight_rounding_beats_nearest(ptq_fx):
    # resnet18 at 32x32 on 32 calibration images: re-rounding the weights lifts the output
    # SQNR from 16.03 to 17.08 dB here (with 8 images most layers see fewer input vectors than
    # they have columns and keep nearest rounding); a drop would mean it works on wrong inputs
    args = ["--model", "resnet18", "--image-size", "32", "--calib-batches", "8", "--bn-batches", "4", "--quiet"]
    plain = ptq_fx.main(args)
    rounded = ptq_fx.main(args + ["--weight-rounding"])
    assert rounded["weight_rounding"] and not plain["weight_rounding"]
    assert rounded["sqnr_db"] > plain["sqnr_db"] + 0.5, (plain["sqnr_db"], rounded["sqnr_db"])


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
