"""compile(): the runtime (BPU simulator + onnxruntime islands), artifacts, and their errors."""

import json
import subprocess
import sys
import zipfile

import pytest
import torch

import qcompiler
import qcompiler.zoo as zoo
from qcompiler.errors import ArtifactError, ConfigError

SMALL = {"resnet18": dict(image_size=32), "mobilenet_v2": dict(image_size=32)}


def flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in flat(v)]


def compiled(name, march="bayes", **kw):
    size = SMALL.get(name, {})
    x = zoo.example_inputs(name, **size)
    calib = [zoo.example_inputs(name, batch=2, **size) for _ in range(2)]
    return qcompiler.compile(zoo.get(name), x, march=march, calib_data=calib, progress=False, **kw), x


@pytest.mark.parametrize("name", ["hybrid", "lstm_seq", "transformer_block", "resnet18"])
def test_runtime_matches_the_converted_model(name):
    cm, x = compiled(name)
    out, ref = cm(*x), cm.converted(*x)
    assert type(out) is type(ref)
    for a, b in zip(flat(out), flat(ref)):
        # BPU partitions are bit-exact; CPU islands run in onnxruntime (float, within 1e-5)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_weight_rounding_changes_bpu_weights_and_keeps_runtime_exact():
    plain, x = compiled("resnet18")
    rounded, _ = compiled("resnet18", weight_rounding=True)
    for a, b in zip(flat(rounded(*x)), flat(rounded.converted(*x))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # all-BPU model: bit-exact
    # the fixed-point model holds other int8 codes for at least one layer's weights
    differ = [k for k, v in plain.converted.state_dict().items()
              if v.dtype == torch.int8 and not torch.equal(v, rounded.converted.state_dict()[k])]
    assert differ


def test_nested_tuple_outputs_are_kept():
    cm, x = compiled("lstm_seq")
    out = cm(*x)
    assert isinstance(out, tuple) and isinstance(out[1], tuple) and len(out[1]) == 2


def test_partitions_summary_and_dump(tmp_path, guide_hybrid_dict):
    cm, x = compiled("hybrid", hybrid_dict=guide_hybrid_dict)
    assert [(p["name"], p["placement"]) for p in cm.partitions] == [
        ("bpu0", "bpu"), ("cpu0", "cpu"), ("bpu1", "bpu"), ("cpu1", "cpu"), ("bpu2", "bpu"), ("cpu2", "cpu")]
    assert cm.boundary_edges() == 5
    assert "3 bpu, 3 cpu partitions; BPU<->CPU boundary edges: 5" in cm.summary()
    names = {p.name for p in cm.dump(tmp_path)}
    assert {"bpu0.program.txt", "cpu0.onnx", "HybridModel.json", "summary.txt"} <= names


def test_save_load_in_a_fresh_process(tmp_path):
    cm, x = compiled("lstm_seq")
    path = cm.save(tmp_path / "m.qc")
    torch.save({"x": x, "out": cm(*x)}, tmp_path / "io.pt")
    code = (
        "import torch, qcompiler, sys\n"
        f"m = qcompiler.load({str(path)!r})\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
        "out = m(*io['x'])\n"
        "flat = lambda v: [v] if isinstance(v, torch.Tensor) else [t for e in v for t in flat(e)]\n"
        "assert all(torch.equal(a, b) for a, b in zip(flat(out), flat(io['out'])))\n"
        "print('ok', type(m).__name__)\n"
    )
    # the fresh process never imports the zoo: the artifact needs no model class
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok CompiledModel"


def test_artifact_holds_no_pickle_and_saves_deterministically(tmp_path):
    cm, _ = compiled("hybrid")
    a, b = cm.save(tmp_path / "a.qc"), cm.save(tmp_path / "b.qc")
    assert a.read_bytes() == b.read_bytes()
    with zipfile.ZipFile(a) as zf:
        assert sorted(zf.namelist()) == ["islands/cpu0.onnx", "islands/cpu1.onnx", "islands/cpu2.onnx",
                                         "manifest.json", "tensors.safetensors"]
        for member in zf.namelist():
            assert b"\x80\x04" not in zf.read(member)[:2]  # no pickle protocol header


@pytest.fixture
def artifact(tmp_path):
    cm, _ = compiled("hybrid")
    return cm.save(tmp_path / "m.qc")


def test_truncated_artifact(artifact):
    data = artifact.read_bytes()
    artifact.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="not a qcompiler artifact or truncated"):
        qcompiler.load(artifact)


def test_corrupted_artifact(artifact, tmp_path):
    with zipfile.ZipFile(artifact) as zf:
        info = zf.getinfo("tensors.safetensors")
        offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + 10
    data = bytearray(artifact.read_bytes())
    data[offset] ^= 0xFF
    artifact.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupted"):
        qcompiler.load(artifact)


def test_foreign_files(tmp_path):
    junk = tmp_path / "junk.qc"
    junk.write_bytes(b"hello world" * 10)
    with pytest.raises(ArtifactError, match="not a qcompiler artifact"):
        qcompiler.load(junk)
    foreign = tmp_path / "foreign.qc"
    with zipfile.ZipFile(foreign, "w") as zf:
        zf.writestr("readme.txt", "not ours")
    with pytest.raises(ArtifactError, match=r"no manifest.json"):
        qcompiler.load(foreign)
    with pytest.raises(ArtifactError, match="no such file"):
        qcompiler.load(tmp_path / "missing.qc")


def test_newer_format_says_so(artifact, tmp_path):
    with zipfile.ZipFile(artifact) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    manifest = json.loads(members["manifest.json"])
    manifest["format_version"] = 99
    members["manifest.json"] = json.dumps(manifest).encode()
    newer = tmp_path / "newer.qc"
    with zipfile.ZipFile(newer, "w") as zf:
        for n, b in members.items():
            zf.writestr(n, b)
    with pytest.raises(ArtifactError, match=r"newer qcompiler \(artifact format 99; this version reads format 1\)"):
        qcompiler.load(newer)


def test_bad_arguments():
    m, x = zoo.get("hybrid"), zoo.example_inputs("hybrid")
    with pytest.raises(ConfigError, match="unknown mode 'int8'"):
        qcompiler.compile(m, x, mode="int8")
    with pytest.raises(ConfigError, match="calib_data is empty"):
        qcompiler.compile(m, x, calib_data=[], progress=False)
    with pytest.raises(ConfigError, match="takes a model from prepare_qat_fx"):
        qcompiler.compile(m, x, mode="qat")
    with pytest.raises(ConfigError, match="weight_rounding=True is a PTQ step"):
        qcompiler.compile(m, x, mode="qat", weight_rounding=True)
    cm, _ = compiled("hybrid")
    with pytest.raises(ConfigError, match="takes 1 inputs"):
        cm(x[0], x[0])


class _Chunks(torch.nn.Module):
    """chunk / split spelled as functions and methods, and a cat of a tuple value (reversed chunks)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.c, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.c(x)
        if self.kind == "reversed":
            return self.c2(torch.cat(y.chunk(2, 1)[::-1], 1))
        a, b = torch.chunk(y, 2, dim=1) if self.kind == "torch.chunk" else torch.split(y, 4, dim=1)
        return self.c2(torch.cat([b, a], 1))


@pytest.mark.parametrize("kind", ["torch.chunk", "torch.split", "reversed"])
def test_chunk_split_functions_and_a_cat_of_a_tuple_compile_and_match(kind):
    torch.manual_seed(0)
    model, x = _Chunks(kind).eval(), torch.randn(2, 3, 8, 8)
    cm = qcompiler.compile(model, (x,), march="bayes", calib_data=[x], progress=False)
    placed = {n.name: n.meta["qc_placement"] for n in cm.converted.graph.nodes if n.name in ("cat", "chunk", "split")}
    if kind == "reversed":  # the cat reads one tuple value, not a list of tensors: it runs on CPU, saying why
        assert placed["cat"] == "cpu"
        reason = next(n.meta["qc_reason"] for n in cm.converted.graph.nodes if n.name == "cat")
        assert reason.startswith("input 'getitem' is a tuple of tensors, not one tensor")
    with torch.no_grad():
        out, ref, f = cm(x), cm.converted(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert 20 * torch.log10(f.norm() / (f - out).norm()) > 30  # int8 quantization error only
