"""compile(): the runtime (BPU simulator + onnxruntime islands), artifacts, and their errors."""

import json
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn

import qcompiler
import qcompiler.zoo as zoo
from qcompiler.errors import ArtifactError, ConfigError, QCompilerWarning

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
    assert {"bpu0.program.txt", "cpu0.onnx", "model.json", "summary.txt"} <= names


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
    with pytest.raises(ArtifactError, match=r"newer qcompiler \(artifact format 99; this version reads format 2\)"):
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


# ----------------------------------------------------------------------------- inputs checked at the boundary


class _NormFirst(torch.nn.Module):
    """A layer_norm (CPU) before the convs: the compiled model starts with an onnxruntime island."""

    def __init__(self):
        super().__init__()
        self.ln, self.c = torch.nn.LayerNorm([8, 8]), torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.c(self.ln(x))


class _ConvFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.c2 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.c(x)))


X8 = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
FIRST = {  # name -> (model, hybrid_dict), and the placement of the first partition
    "layer_norm_on_cpu": (_NormFirst, None, "cpu"),
    "hybrid_dict_forces_cpu": (_ConvFirst, {"module_name": ["c"]}, "cpu"),
    "conv_on_bpu": (_ConvFirst, None, "bpu"),
}


@pytest.fixture(scope="module")
def first_part():
    """name -> CompiledModel of FIRST[name], built once."""
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            cls, hybrid_dict, where = FIRST[name]
            cm = qcompiler.compile(cls().eval(), X8, march="bayes", hybrid_dict=hybrid_dict,
                                   calib_data=[X8], progress=False)
            assert cm.partitions[0]["placement"] == where
            cache[name] = cm
        return cache[name]

    return get


BAD_CALLS = {  # args -> the message, the same whichever backend runs first
    "shape": ((torch.rand(1, 3, 9, 9),), r"input 0 \('x'\) has shape \(1, 3, 9, 9\); the example input has "
                                         r"\(1, 3, 8, 8\), and only the batch size may differ"),
    "rank": ((torch.rand(3, 8, 8),), r"input 0 \('x'\) has shape \(3, 8, 8\) \(3 dims\); the example input "
                                     r"has \(1, 3, 8, 8\) \(4 dims\)"),
    "int64": ((torch.ones(1, 3, 8, 8, dtype=torch.int64),), r"input 0 \('x'\) must be a float32 tensor .*got int64"),
    "bool": ((torch.ones(1, 3, 8, 8, dtype=torch.bool),), r"input 0 \('x'\) must be a float32 tensor .*got bool"),
    "two_inputs": ((X8, X8), r"the model takes 1 inputs \(x\), got 2"),
    "no_input": ((), r"the model takes 1 inputs \(x\), got 0"),
    "numpy": ((X8.numpy(),), r"input 0 \('x'\) must be a float32 tensor, got ndarray \(torch.from_numpy"),
    "empty": ((torch.rand(0, 3, 8, 8),), r"input 0 \('x'\) is empty"),
}


@pytest.mark.parametrize("bad", sorted(BAD_CALLS))
@pytest.mark.parametrize("name", sorted(FIRST))
def test_bad_call_is_a_config_error_whichever_backend_runs_first(first_part, name, bad, tmp_path):
    args, message = BAD_CALLS[bad]
    cm = first_part(name)
    with pytest.raises(ConfigError, match="^compiled model: " + message):
        cm(*args)
    loaded = qcompiler.load(cm.save(tmp_path / "m.qc"))  # the artifact keeps what calls are checked against
    with pytest.raises(ConfigError, match="^compiled model: " + message):
        loaded(*args)


@pytest.mark.parametrize("name", sorted(FIRST))
def test_float64_input_is_cast_to_float32_and_any_batch_size_runs(first_part, name):
    cm = first_part(name)
    x64 = torch.rand(1, 3, 8, 8, dtype=torch.float64)
    out = cm(x64)
    assert out.dtype == torch.float32
    assert torch.equal(out, cm(x64.float()))
    batch = torch.rand(3, 3, 8, 8)
    assert torch.equal(cm(batch)[1:2], cm(batch[1:2]))


def test_lstm_state_batch_is_its_dim_1_and_other_sizes_are_checked():
    cm, (tokens, (h0, c0)) = compiled("lstm_seq")  # example batch 1, calibrated with batch 2
    tokens3, (h3, c3) = zoo.example_inputs("lstm_seq", batch=3)
    logits, (h, c) = cm(tokens3, (h3, c3))  # the states' batch is dim 1: (layers, batch, hidden)
    assert logits.shape[0] == 3 and h.shape == (1, 3, 64)
    with pytest.raises(ConfigError, match=r"input 1 \('hidden'\)\[0\] has shape \(1, 1, 32\); the example input "
                                          r"has \(1, 1, 64\)"):
        cm(tokens, (torch.zeros(1, 1, 32), c0))
    with pytest.raises(ConfigError, match=r"input 1 \('hidden'\)\[1\] has shape \(1, 2, 64\).*here 3, dim 0 of "
                                          r"input 0 \('input_1'\)"):  # FX renames the `input` argument
        cm(tokens3, (h3, torch.zeros(1, 2, 64)))  # one batch size per call
    with pytest.raises(ConfigError, match=r"input 1 \('hidden'\) must be a tuple of 2 values .*got float32 tensor"):
        cm(tokens, h0)


@pytest.mark.parametrize("calib, message", [
    ([torch.rand(2, 3, 8, 8), torch.rand(2, 3, 9, 9)],
     r"calib_data batch 1: input 0 has shape \(2, 3, 9, 9\); the example input has \(1, 3, 8, 8\)"),
    ([torch.rand(3, 8, 8)], r"calib_data batch 0: input 0 has shape \(3, 8, 8\) \(3 dims\)"),
    ([X8, torch.ones(1, 3, 8, 8, dtype=torch.int64)], r"calib_data batch 1: input 0 must be a float32 tensor"),
    ([(X8, X8)], r"calib_data batch 0: the model takes 1 inputs, got 2"),
    ([X8.numpy()], r"calib_data batch 0: input 0 must be a float32 tensor, got ndarray"),
    (torch.rand(4, 3, 8, 8), r"calib_data must be an iterable of batches .*got one tensor"),
])
def test_calib_data_is_checked_against_example_inputs_before_any_work(calib, message, monkeypatch):
    from conftest import assert_untouched, snapshot

    import qcompiler.quantization as quantization

    def not_reached(*_, **__):
        raise AssertionError("prepare ran before calib_data was checked")

    monkeypatch.setattr(quantization, "prepare_calibration_fx", not_reached)
    model = _ConvFirst().eval()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match=message):
        qcompiler.compile(model, X8, calib_data=calib, progress=False)
    assert_untouched(model, snap)


def test_float64_calib_data_calibrates_like_float32():
    torch.manual_seed(0)
    model = _NormFirst().eval()
    data = [torch.rand(2, 3, 8, 8) for _ in range(2)]
    a = qcompiler.compile(model, X8, calib_data=data, progress=False)
    b = qcompiler.compile(model, X8, calib_data=[d.double() for d in data], progress=False)
    assert torch.equal(a(X8), b(X8))


def test_a_model_with_nothing_on_the_bpu_says_so():
    """Functional linear with parameter weights has no BPU form: the compiled model is float, and compile warns."""

    class FunctionalLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.b = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w, self.b)

    with pytest.warns(QCompilerWarning, match=r"compile: no op of FunctionalLinear runs on the BPU, so the compiled "
                                              r"model computes in float on the CPU \(linear: "):
        cm = qcompiler.compile(FunctionalLinear().eval(), (torch.randn(2, 4),), progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["cpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)  # a model with a BPU part: no such warning
        qcompiler.compile(nn.Sequential(nn.Conv2d(3, 4, 3)).eval(), (torch.rand(1, 3, 8, 8),), progress=False)
