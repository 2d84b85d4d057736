"""``qcompiler build CONFIG.toml`` (tools/build_config.py, issue 35): the same build as the flags,
the config and the versions recorded in --out, and mistakes named by line and key."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from PIL import Image

from qcompiler.errors import ConfigError
from qcompiler.tools.build_config import read_build_config, to_build_config
from qcompiler.tools.cli import main


def _images(folder, n=4):
    rng = np.random.default_rng(0)
    folder.mkdir()
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_build_equals_compile_with_the_same_flags_and_records_the_config(capsys, tmp_path):
    _images(tmp_path / "photos")
    config = tmp_path / "model.toml"
    config.write_text(textwrap.dedent("""
        # the hybrid zoo model on four photos
        model = "zoo:hybrid"
        march = "bayes"
        out = "build_out"

        [[inputs]]
        shape = [1, 3, 16, 16]

        [hybrid]
        module_name = ["conv3"]

        [calibration]
        images = "photos"
        batch_size = 2

        [calibration.preprocess]
        resize = 18
        crop = 16
        mean = [0.5, 0.5, 0.5]
        std = 0.25
        channel_order = "bgr"
    """))
    code, out, err = _run(capsys, "build", config)
    assert code == 0, err
    assert f"output SQNR vs float on the calibration data, 4 images in {tmp_path / 'photos'}: " in out
    flags = ["compile", "zoo:hybrid", "--input-shape", "1,3,16,16", "--march", "bayes", "--hybrid-module-name",
             "conv3", "--calib-images", tmp_path / "photos", "--calib-batch-size", "2", "--resize", "18", "--crop",
             "16", "--mean", "0.5,0.5,0.5", "--std", "0.25", "--channel-order", "bgr", "--out", tmp_path / "flags"]
    code, _, err = _run(capsys, *flags)
    assert code == 0, err
    built = tmp_path / "build_out"
    assert (built / "model.qc").read_bytes() == (tmp_path / "flags" / "model.qc").read_bytes()
    versions = json.loads((built / "versions.json").read_text())
    assert versions["qcompiler"] and versions["torch"] and versions["python"]
    recorded = built / "build.toml"
    code, printed, _ = _run(capsys, "build", recorded, "--print-config")
    assert code == 0 and printed == recorded.read_text()  # the record reads back as itself
    code, from_flags, _ = _run(capsys, *flags[:-1], built, "--print-config")  # compile --print-config: same config
    assert code == 0 and from_flags == recorded.read_text()


def test_print_config_of_compile_compiles_nothing(capsys, tmp_path):
    code, out, _ = _run(capsys, "compile", "zoo:hybrid", "--calib-random", "3", "--print-config",
                        "--out", tmp_path / "o")
    assert code == 0 and 'model = "zoo:hybrid"' in out and "random = 3" in out
    assert not (tmp_path / "o").exists()
    cfg = tmp_path / "c.toml"
    cfg.write_text(out)
    args = read_build_config(str(cfg))
    assert args.calib_random == 3 and args.model == "zoo:hybrid" and to_build_config(args) == out


@pytest.mark.parametrize("text, message", [
    ('model = "zoo:hybrid"\nout = "o"\n[calibration]\nrandm = 3\n', ":4: calibration.randm: unknown key. Did you mean 'random'?"),
    ('model = "zoo:hybrid"\nout = "o"\n\n[[inputs]]\nshape = [1, 3]\n[[inputs]]\nshape = [1, 0]\n',
     ":7: inputs[1].shape: expected a list of positive integers"),
    ('model = "zoo:hybrid"\nout = "o"\nweight_rounding = "yes"\n', ":3: weight_rounding: expected true or false"),
    ('model = "zoo:hybrid"\nout = "o"\n[calibration]\ndata = "a.npz"\nrandom = 2\n',
     ":5: calibration.random: give one of data, images, random"),
    ('model = "zoo:hybrid"\nout = "o"\n[calibration]\nrandom = 2\n[calibration.preprocess]\ncrop = 4\n',
     ":5: calibration.preprocess: [calibration.preprocess] applies to calibration.images only"),
    ('model = "zoo:hybrid"\nout = "o"\n[calibration]\nimages = "d"\n[calibration.preprocess]\nlayout = "chw"\n',
     ":6: calibration.preprocess.layout: expected one of 'nchw', 'nhwc'"),
    ('out = "o"\n', "the key 'model' is required"),
    ('model = "zoo:hybrid"\nout = \n', "not valid TOML"),
])
def test_config_mistakes_name_the_line_and_the_key(capsys, tmp_path, text, message):
    cfg = tmp_path / "m.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_build_config(str(cfg))
    assert str(info.value).startswith(str(cfg)) or str(info.value).startswith(f"build config {cfg}")
    assert message in str(info.value)
    code, out, err = _run(capsys, "build", cfg)
    assert code == 2 and err.startswith("error: ") and message in err and not (tmp_path / "o").exists()


def test_missing_config_file(capsys, tmp_path):
    code, _, err = _run(capsys, "build", tmp_path / "absent.toml")
    assert code == 2 and "cannot read it" in err
