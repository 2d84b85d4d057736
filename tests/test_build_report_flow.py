"""Issue 35 done-criterion: a folder of JPEGs + a model file + one build config, two commands:
``qcompiler build model.toml --report`` (report on those images, advice into ``fixes``) and
``qcompiler build model.toml`` (a build that applies it), as README.md shows."""

import json
import re
import textwrap

import numpy as np
import pytest

from qcompiler.tools.cli import main

PIL = pytest.importorskip("PIL.Image")

MODEL = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.relu1 = nn.ReLU()
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
            self.relu2 = nn.ReLU()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            y = self.relu2(self.conv2(self.relu1(self.conv1(x))))
            return self.fc(torch.flatten(self.pool(y), 1))

    def build():
        torch.manual_seed(0)
        m = Net()
        with torch.no_grad():  # a weight outlier: conv2's int8 weight scale crushes every other tap
            m.conv2.weight[:, 0, 1, 1] = 8.0
        return m.eval()
''')

CONFIG = textwrap.dedent('''
    model = "net.py:build"
    march = "bayes"
    out = "out"
    fixes = "fixes.json"

    [[inputs]]
    shape = [1, 3, 32, 32]

    [calibration]
    images = "photos"
    batch_size = 2

    [calibration.preprocess]
    resize = 36
    crop = 32
    mean = [0.485, 0.456, 0.406]
    std = [0.229, 0.224, 0.225]
''')


def _project(tmp_path):
    (tmp_path / "net.py").write_text(MODEL)
    (tmp_path / "model.toml").write_text(CONFIG)
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        PIL.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(photos / f"{i}.jpg")
    return tmp_path / "model.toml"


def _sqnr(text):
    found = re.findall(r"output SQNR vs float on the calibration data, 4 images in \S+: (-?[\d.]+) dB", text)
    assert len(found) == 1, text
    return float(found[0])


def test_report_then_build_applies_the_advice_and_gains(tmp_path, capsys):
    config = _project(tmp_path)
    # a build before any report: no fixes file yet, said so
    assert main(["build", str(config)]) == 0
    out = capsys.readouterr().out
    assert "no fixes file" in out and "building without it" in out
    before = _sqnr(out)
    # command 1: the report on those images, its advice into the config's fixes file
    assert main(["build", str(config), "--report"]) == 0
    out = capsys.readouterr().out
    assert "measured on the calibration data, 4 images in" in out
    assert (tmp_path / "out" / "report" / "report.html").is_file()
    fixes = json.loads((tmp_path / "fixes.json").read_text())
    assert "conv2" in fixes["hybrid"]["module_name"] or "conv2" in fixes["qconfig"]["module_name"]
    assert f"fixes written to {tmp_path / 'fixes.json'}: qcompiler build {config} applies them" in out
    # command 2: the build that applies them
    assert main(["build", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"applying the report's fixes {tmp_path / 'fixes.json'}" in out
    after = _sqnr(out)
    assert after > before + 3.0, (before, after)
    recorded = (tmp_path / "out" / "build.toml").read_text()
    assert f'qconfig = "{tmp_path / "fixes.json"}"' in recorded and "fixes =" not in recorded


def test_fixes_next_to_a_qconfig_file_is_an_error(tmp_path, capsys):
    config = _project(tmp_path)
    (tmp_path / "fixes.json").write_text('{"qconfig": {"module_name": {}}, "hybrid": {"module_name": ["conv2"]}}')
    (tmp_path / "q.json").write_text('{"module_name": {}}')
    config.write_text(CONFIG.replace('fixes = "fixes.json"', 'fixes = "fixes.json"\nqconfig = "q.json"'))
    assert main(["build", str(config)]) == 2
    err = capsys.readouterr().err
    assert "fixes = " in err and "both set" in err
