"""CLI --capture {fx,export,auto}: torch.export capture from the command line."""

from __future__ import annotations

import json


from test_cli import HYBRID_FLAGS, SUMMARY, _assert_usage_error, _run


def test_partition_with_export_capture_matches_fx(capsys, tmp_path):
    placed = {}
    for capture in ("fx", "export"):
        out_dir = tmp_path / capture
        code, out, err = _run(capsys, "partition", "zoo:hybrid", *HYBRID_FLAGS, "--capture", capture,
                              "--out", str(out_dir))
        assert code == 0, err
        assert SUMMARY in out.splitlines()
        data = json.loads((out_dir / "model.json").read_text())
        placed[capture] = [(n["node"], n["placement"]) for n in data["nodes"]]
    assert placed["fx"] == placed["export"]
    assert ("conv3", "cpu") in placed["export"]


def test_capture_must_be_one_of_the_modes(capsys, tmp_path):
    _assert_usage_error(*_run(capsys, "partition", "zoo:hybrid", "--capture", "dynamo", "--out", str(tmp_path)))
