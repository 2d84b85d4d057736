"""``qcompiler.load`` on hostile artifacts: it never reads, runs or allocates what it shouldn't.

Each case edits a real artifact (a conv -> conv -> GELU (CPU island) -> conv model) the way
an attacker would -- usually also re-declaring sizes and shapes in the manifest, so the
edit reaches the deeper checks -- and expects an ArtifactError that names what is wrong.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import time
import tracemalloc
import zipfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
from artifact_edit import MANIFEST, TENSORS, Edit
from onnx import helper, numpy_helper
from safetensors.torch import save as st_save

import qcompiler.zoo as zoo
from qcompiler.compiled import compile as qc_compile
from qcompiler.compiled import load
from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.tools.quant_analysis import QuantAnalysis


@pytest.fixture(scope="module")
def model_and_input():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1), nn.GELU(),
                      nn.Conv2d(4, 4, 1)).eval()
    x = torch.randn(2, 3, 8, 8)
    cm = qc_compile(m, (x,), march="bayes", progress=False)
    cm.float_model = m
    return cm, x


@pytest.fixture
def artifact(model_and_input, tmp_path):
    cm, _ = model_and_input
    return cm.save(tmp_path / "m.qc")


def refused(path, match):
    with pytest.raises(ArtifactError, match=match) as info:
        load(path)
    return str(info.value)


def test_a_clean_artifact_loads_and_is_exact(model_and_input, artifact):
    cm, x = model_and_input
    assert torch.equal(load(artifact)(x), cm(x))
    # the re-zip helper itself changes nothing that matters
    assert torch.equal(load(Edit(artifact).write(artifact.with_name("same.qc")))(x), cm(x))


def _flat(v):
    return [v] if isinstance(v, torch.Tensor) else [t for e in v for t in _flat(e)]


@pytest.mark.parametrize("name,islands", [("hybrid", 3), ("lstm_seq", 1), ("transformer_block", 1)])
def test_zoo_artifacts_with_islands_load_and_are_exact(tmp_path, guide_hybrid_dict, name, islands):
    """Every island the emitter writes passes load's checks: a saved zoo model loads and runs bit-exact."""
    x = zoo.example_inputs(name)
    kw = {"hybrid_dict": guide_hybrid_dict} if name == "hybrid" else {}
    cm = qc_compile(zoo.get(name), x, march="bayes", progress=False, **kw)
    path = cm.save(tmp_path / f"{name}.qc")
    with zipfile.ZipFile(path) as zf:
        assert sum(n.startswith("islands/") for n in zf.namelist()) >= islands
    got, want = _flat(load(path)(*x)), _flat(cm(*x))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------- external data


def test_island_with_external_data_is_refused(artifact, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.txt").write_bytes(b"top secret bytes" * 4)
    e = Edit(artifact)
    island = onnx.load_from_string(e.members["islands/cpu0.onnx"])
    leak = numpy_helper.from_array(torch.zeros(16, dtype=torch.float32).numpy(), "leak")
    leak.ClearField("raw_data")
    leak.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", "secret.txt"), ("offset", "0"), ("length", "64")):
        leak.external_data.add(key=k, value=v)
    island.graph.initializer.append(leak)
    e.members["islands/cpu0.onnx"] = island.SerializeToString()
    msg = refused(e.write(tmp_path / "ext.qc"), r"islands/cpu0.onnx.*initializer 'leak' refers to external data "
                                                r"\(location 'secret.txt'\); islands must be self-contained")
    assert "top secret" not in msg


def test_external_data_in_a_constant_attribute_is_refused(artifact, tmp_path):
    e = Edit(artifact)
    island = onnx.load_from_string(e.members["islands/cpu0.onnx"])
    t = numpy_helper.from_array(torch.zeros(2, dtype=torch.float32).numpy(), "c")
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value="/etc/hostname")
    island.graph.node.append(helper.make_node("Constant", [], ["unused_c"], name="const", value=t))
    e.members["islands/cpu0.onnx"] = island.SerializeToString()
    refused(e.write(tmp_path / "ext2.qc"), r"node 'const' attribute 'value' 'c' refers to external data")


# ---------------------------------------------------------------------------- zip bombs


def _bomb(artifact, path, size: int, *, declare: bool):
    """The tensors member replaced by ``size`` zero bytes (compresses ~1000:1)."""
    e = Edit(artifact)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        if declare:  # the manifest claims a matching huge tensor
            prog = e.manifest["programs"]["bpu0"]
            prog["ops"][1]["tensors"][0]["shape"] = [size - 2000]
            e.manifest["members"][TENSORS] = size
        for name, data in e.members.items():
            if name == MANIFEST:
                zf.writestr(name, json.dumps(e.manifest))
            elif name != TENSORS:
                zf.writestr(name, data)
        with zf.open(TENSORS, "w", force_zip64=True) as f:
            chunk = bytes(1 << 20)
            for _ in range(size >> 20):
                f.write(chunk)
    return path


@pytest.mark.parametrize("declare", [False, True], ids=["undeclared", "declared-by-manifest"])
def test_zip_bomb_fails_fast_with_bounded_memory(artifact, tmp_path, declare):
    bomb = _bomb(artifact, tmp_path / "bomb.qc", 256 << 20, declare=declare)
    assert bomb.stat().st_size < 2 << 20
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        msg = refused(bomb, "tensors.safetensors")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0
    assert peak < 16 << 20, f"load allocated {peak >> 20} MiB before refusing"
    assert ("likely zip bomb" in msg) if declare else ("the manifest says" in msg)


def test_a_lying_zip_header_is_read_no_further_than_declared(artifact, tmp_path):
    """The local and central headers declare the manifest's size, the stream inflates to 64 MiB:
    reading stops at the declared size and the CRC fails."""
    e = Edit(artifact)
    real = e.manifest["members"][TENSORS]
    path = tmp_path / "liar.qc"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in e.members.items():
            if name != TENSORS:
                zf.writestr(name, data)
        zf.writestr(TENSORS, bytes(64 << 20))
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(TENSORS)
    struct.pack_into("<I", data, info.header_offset + 22, real)  # local header: uncompressed size
    for pos in _find_all(bytes(data), b"PK\x01\x02"):
        name_len = struct.unpack_from("<H", data, pos + 28)[0]
        if bytes(data[pos + 46:pos + 46 + name_len]) == TENSORS.encode():
            struct.pack_into("<I", data, pos + 24, real)  # central directory: uncompressed size
    path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        refused(path, "tensors.safetensors")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 16 << 20


def _find_all(data: bytes, sub: bytes):
    i = data.find(sub)
    while i >= 0:
        yield i
        i = data.find(sub, i + 1)


def test_duplicate_member_is_refused(artifact, tmp_path):
    path = tmp_path / "dup.qc"
    e = Edit(artifact)
    e.write(path)
    with pytest.warns(UserWarning, match="Duplicate name"):
        with zipfile.ZipFile(path, "a") as zf:
            zf.writestr(TENSORS, b"x")
    refused(path, "member 'tensors.safetensors' appears twice")


# ---------------------------------------------------------------------------- shapes and dtypes


def test_weight_shape_edited_in_the_tensors_member(artifact, tmp_path):
    """[4,8,3,3] -> [4,8,1,1] (fewer bytes than declared), and -> [4,8,9,1] (as many)."""
    e = Edit(artifact)
    e.tensors["bpu0/2.weight"] = e.tensors["bpu0/2.weight"][:, :, :1, :1].contiguous()
    refused(e.write(tmp_path / "w.qc", redeclare=False), r"member 'tensors.safetensors' declares \d+ bytes "
                                                           r"uncompressed; the manifest says \d+")
    e.manifest["members"][TENSORS] = len(st_save(e.tensors))
    refused(e.write(tmp_path / "w1.qc", redeclare=False),
            r"BPU program 'bpu0': tensor '2.weight' is int8 \[4, 8, 1, 1\], but the program declares "
            r"int8 \[4, 8, 3, 3\]")
    e = Edit(artifact)
    e.tensors["bpu0/2.weight"] = e.tensors["bpu0/2.weight"].reshape(4, 8, 9, 1).contiguous()
    e.manifest["members"][TENSORS] = len(st_save(e.tensors))
    refused(e.write(tmp_path / "w2.qc", redeclare=False),
            r"BPU program 'bpu0': tensor '2.weight' is int8 \[4, 8, 9, 1\], but the program declares "
            r"int8 \[4, 8, 3, 3\]")


@pytest.mark.parametrize("key,new,match", [
    ("1.M", lambda t: t[:1].contiguous(), r"op 1 '_0' \(conv2d\): tensor 'M' has shape \[1\], expected \[8\]"),
    ("1.bias", lambda t: t[:1].contiguous(), r"op 1 '_0' \(conv2d\): tensor 'bias' has shape \[1\], expected \[8\]"),
    ("1.weight", lambda t: t.float(),
     r"op 1: tensor 'weight' declares 'float32' \[8, 3, 3, 3\]; expected int8, int16, int32, int64"),
    ("1.weight", lambda t: t.long(), r"tensor 'weight' is int64, expected int8"),
    ("1.n", lambda t: t + 100, r"tensor 'n' holds values in \[\d+, \d+\], expected \[0, 62\]"),
    ("1.M", lambda t: t.int(), r"tensor 'M' is int32, expected int64"),
    ("1.weight", lambda t: t[:, :, :, :2].reshape(8, 3, 6).contiguous(),
     r"tensor 'weight' has shape \[8, 3, 6\], expected 4 non-zero dims"),
])
def test_tensor_edits_redeclared_in_the_manifest(artifact, tmp_path, key, new, match):
    e = Edit(artifact)
    e.tensors[f"bpu0/{key}"] = new(e.tensors[f"bpu0/{key}"])
    refused(e.write(tmp_path / "t.qc"), match)


def test_undeclared_extra_tensor_is_refused(artifact, tmp_path):
    e = Edit(artifact)
    e.tensors["bpu0/1.extra"] = torch.zeros(3, dtype=torch.int64)
    refused(e.write(tmp_path / "x.qc"), r"tensor '1.extra' is not declared by any op")
    e = Edit(artifact)
    e.tensors["nobody/0.w"] = torch.zeros(3, dtype=torch.int64)
    refused(e.write(tmp_path / "y.qc"), r"tensor 'nobody/0.w' of no program")


# ---------------------------------------------------------------------------- raw errors -> ArtifactError


MANIFEST_EDITS = {
    "step kind gpu": (lambda m: m["steps"][0].update(kind="gpu"),
                      r"steps\[0\]: kind 'gpu' is not a step kind \(bpu or cpu\)"),
    "missing step inputs": (lambda m: m["steps"][1].pop("inputs"), r"steps\[1\]: 'inputs' is missing"),
    "unknown program": (lambda m: m["steps"][2].update(name="bpu9"),
                        r"steps\[2\]: BPU step 'bpu9' has no program \(programs: bpu0, bpu1\)"),
    "missing output": (lambda m: m.update(outputs={"value": "nowhere"}),
                       r"the model output 'nowhere' is made by no step or input"),
    "missing step input": (lambda m: m["steps"][1]["inputs"].append("ghost"),
                           r"steps\[1\] \('cpu0'\) reads 'ghost', which no earlier step or model input makes"),
    "bpu input not listed": (lambda m: m["steps"][2].update(inputs=[]),
                             r"steps\[2\] \('bpu1'\) does not list its program's input '_3'"),
    "steps out of order": (lambda m: m["steps"].reverse(), r"reads '_3', which no earlier step"),
    "scale edited to a string": (
        lambda m: m["programs"]["bpu0"]["ops"][1]["attrs"].update(out_scale="0.5"),
        r"op 1 '_0' \(conv2d\): attr 'out_scale' is '0.5', expected a finite float > 0"),
    "stride edited to a bool": (
        lambda m: m["programs"]["bpu0"]["ops"][1]["attrs"].update(stride=[True, 1]),
        r"attr 'stride' is \[True, 1\], expected a list of two ints >= 1"),
    "relu6 without act_max": (
        lambda m: m["programs"]["bpu0"]["ops"][1]["attrs"].update(act="relu6"),
        r"attr 'act_max' is missing"),
    "relu6 top past int8": (
        lambda m: m["programs"]["bpu0"]["ops"][1]["attrs"].update(act="relu6", act_max=200),
        r"attr 'act_max' is 200, expected an int in \[0, 128\)"),
    "op kind unknown": (lambda m: m["programs"]["bpu0"]["ops"][1].update(kind="no_such_kind"),
                        r"unknown BPU op kind 'no_such_kind'"),
    "conv reads a float": (lambda m: m["programs"]["bpu0"]["ops"][1].update(
        inputs=["input_1"]), r"op 1 '_0' \(conv2d\): reads 'input_1' \(input_1: f32\), expected a per-tensor"),
    "nested outputs": (lambda m: m.update(outputs=_nest({"value": "output_input_dequant_0"}, 40)),
                       r"outputs.*nested deeper than 32"),
    "signature of the wrong length": (lambda m: m.update(input_signature=[]),
                                      r"'input_signature' must list one entry per input"),
    "step nodes not a list": (lambda m: m["steps"][0].update(nodes=float("nan")),
                              r"steps\[0\] \('bpu0'\): 'nodes' must be a list of value names"),
    "signature says tuple": (lambda m: m["input_signature"].__setitem__(0, []),
                             r"input_signature says input 'input_1' is a tuple, but a step reads it as one tensor"),
    "older format": (lambda m: m.update(format_version=1), r"older qcompiler \(artifact format 1"),
}


def _nest(v, depth):
    for _ in range(depth):
        v = {"tuple": [v]}
    return v


@pytest.mark.parametrize("case", list(MANIFEST_EDITS))
def test_manifest_edits_are_artifact_errors(artifact, tmp_path, case):
    fn, match = MANIFEST_EDITS[case]
    e = Edit(artifact)
    fn(e.manifest)
    refused(e.write(tmp_path / "edited.qc"), match)


def test_member_sizes_missing(artifact, tmp_path):
    e = Edit(artifact)
    e.manifest.pop("members")
    refused(e.write(tmp_path / "nosizes.qc", redeclare=False), r"manifest.json: 'members' is missing")


def test_deeply_nested_json_manifest(artifact, tmp_path):
    e = Edit(artifact)
    e.manifest = ("[" * 100_000 + "]" * 100_000).encode()
    refused(e.write(tmp_path / "deep.qc", redeclare=False), r"manifest.json nests too deep")


def _with_tensors_member(artifact, tmp_path, raw: bytes):
    e = Edit(artifact)
    e.manifest["members"][TENSORS] = len(raw)
    return e.write(tmp_path / "raw.qc", redeclare=False, raw_tensors=raw)


def test_pickle_in_the_tensors_member(artifact, tmp_path):
    buf = io.BytesIO()
    torch.save({"bpu0/1.weight": torch.zeros(8, 3, 3, 3, dtype=torch.int8)}, buf)
    refused(_with_tensors_member(artifact, tmp_path, buf.getvalue()), r"member 'tensors.safetensors'")


def test_safetensors_header_length_2_62(artifact, tmp_path):
    raw = Edit(artifact).members[TENSORS]
    refused(_with_tensors_member(artifact, tmp_path, struct.pack("<Q", 1 << 62) + raw[8:]),
            r"member 'tensors.safetensors' is not a valid safetensors file")


def test_safetensors_shape_2_40(artifact, tmp_path):
    raw = Edit(artifact).members[TENSORS]
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["bpu0/1.weight"]["shape"] = [1 << 40]
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    refused(_with_tensors_member(artifact, tmp_path, struct.pack("<Q", len(text)) + text + raw[8 + n:]),
            r"member 'tensors.safetensors' is not a valid safetensors file")
    e = Edit(artifact)  # the manifest declaring it: refused before anything is read
    e.manifest["programs"]["bpu0"]["ops"][1]["tensors"][0]["shape"] = [1 << 40]
    refused(e.write(tmp_path / "decl.qc", redeclare=False), r"declares 'int8' \[1099511627776\]")


def test_garbage_island(artifact, tmp_path):
    e = Edit(artifact)
    e.members["islands/cpu0.onnx"] = b"\x08\x07garbage\xff\xff" * 20
    refused(e.write(tmp_path / "g.qc"), r"member 'islands/cpu0.onnx': island 'cpu0': not an ONNX model")


def test_island_that_does_not_make_the_step_output(artifact, tmp_path):
    e = Edit(artifact)
    island = onnx.load_from_string(e.members["islands/cpu0.onnx"])
    island.graph.output[0].name = "other"
    island.graph.node[-1].output[0] = "other"
    e.members["islands/cpu0.onnx"] = island.SerializeToString()
    refused(e.write(tmp_path / "o.qc"), r"island 'cpu0': the step's output '_3' is not a graph output")


def test_island_onnxruntime_refuses_is_an_artifact_error(artifact, tmp_path):
    """Only ops qcompiler writes, but a node reads a value nothing makes: onnxruntime refuses it."""
    e = Edit(artifact)
    island = onnx.load_from_string(e.members["islands/cpu0.onnx"])
    island.graph.node[1].input[0] = "ghost"
    e.members["islands/cpu0.onnx"] = island.SerializeToString()
    refused(e.write(tmp_path / "r.qc"), r"the runtime cannot be built from this file")


# ---------------------------------------------------------------------------- what an island may hold


NOT_OURS = r"; the island is not one qcompiler writes"


def _island(artifact):
    e = Edit(artifact)
    return e, onnx.load_from_string(e.members["islands/cpu0.onnx"])


def _append(island, make):
    """The island with a node ``make(x, y)`` between its last node and the step output: it reads
    ``x`` (what the last node made) and writes ``y`` (the output), so the graph stays valid."""
    last = island.graph.node[-1]
    y = last.output[0]
    last.output[0] = f"{y}/pre"
    island.graph.node.append(make(f"{y}/pre", y))
    return island


def _store(e, island, path):
    e.members["islands/cpu0.onnx"] = island.SerializeToString()
    return e.write(path)


def _onnxruntime_accepts(path):
    """onnxruntime builds a session for the edited island: only qcompiler's check stops it."""
    ort.InferenceSession(Edit(path).members["islands/cpu0.onnx"], providers=["CPUExecutionProvider"])


def _no_sessions(monkeypatch):
    """onnxruntime.InferenceSession fails the test: the check must refuse before any session exists."""
    def session(*args, **kwargs):
        raise AssertionError("an onnxruntime session was made for a refused island")
    monkeypatch.setattr(ort, "InferenceSession", session)


def _loop_forever(x, y):
    """Loop(M = 2^62, cond = true) whose body passes ``x`` through: a valid model whose run never ends."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["v_in"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", onnx.TensorProto.FLOAT, None)])
    return helper.make_node("Loop", ["trip_count", "keep_going", x], [y], name="forever", body=body)


def test_island_with_a_loop_of_2_62_iterations_is_refused_at_load(artifact, tmp_path, monkeypatch):
    e, island = _island(artifact)
    island.graph.initializer.extend([numpy_helper.from_array(np.array(1 << 62, np.int64), "trip_count"),
                                     numpy_helper.from_array(np.array(True), "keep_going")])
    path = _store(e, _append(island, _loop_forever), tmp_path / "loop.qc")
    onnx.checker.check_model(onnx.load_from_string(Edit(path).members["islands/cpu0.onnx"]), full_check=True)
    _onnxruntime_accepts(path)  # (and its first run would never return)
    _no_sessions(monkeypatch)
    t0 = time.perf_counter()
    msg = refused(path, r"loop.qc: member 'islands/cpu0.onnx': island 'cpu0': node 'forever' has op type 'Loop', "
                        r"which qcompiler never writes" + NOT_OURS)
    assert time.perf_counter() - t0 < 5.0
    assert "compile and save the model again" in msg


@pytest.mark.parametrize("op", ["NoSuchOp", "Hardmax", "Constant"])
def test_island_with_an_op_type_qcompiler_never_writes_is_refused(artifact, tmp_path, monkeypatch, op):
    """An unknown op, and real opset-11 ops onnxruntime runs but our emitter never writes."""
    e, island = _island(artifact)
    if op == "Constant":
        island.graph.node.append(helper.make_node("Constant", [], ["unused"], name="extra",
                                                  value=numpy_helper.from_array(np.zeros(2, np.float32))))
    else:
        _append(island, lambda x, y: helper.make_node(op, [x], [y], name="extra"))
    path = _store(e, island, tmp_path / "op.qc")
    if op != "NoSuchOp":
        _onnxruntime_accepts(path)
    _no_sessions(monkeypatch)
    refused(path, rf"island 'cpu0': node 'extra' has op type '{op}', which qcompiler never writes" + NOT_OURS)


def _resize_extrapolating(x, y):
    return helper.make_node("Resize", [x, "roi", "scales"], [y], name="resize", mode="nearest",
                            extrapolation_value=0.5)


def test_island_with_an_attribute_qcompiler_never_writes_is_refused(artifact, tmp_path, monkeypatch):
    """Resize is ours, with mode / coordinate_transformation_mode / nearest_mode / cubic_coeff_a;
    extrapolation_value is valid ONNX that onnxruntime runs, but not ours."""
    e, island = _island(artifact)
    island.graph.initializer.extend([numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
                                     numpy_helper.from_array(np.ones(4, np.float32), "scales")])
    path = _store(e, _append(island, _resize_extrapolating), tmp_path / "attr.qc")
    _onnxruntime_accepts(path)
    _no_sessions(monkeypatch)
    refused(path, r"island 'cpu0': node 'resize' \(Resize\) has attribute 'extrapolation_value', which qcompiler "
                  r"never writes on Resize" + NOT_OURS)


def test_island_with_a_custom_domain_is_refused(artifact, tmp_path, monkeypatch):
    """com.microsoft Gelu: an onnxruntime contrib op, outside the ONNX domain qcompiler writes."""
    e, island = _island(artifact)
    island.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _append(island, lambda x, y: helper.make_node("Gelu", [x], [y], name="gelu", domain="com.microsoft"))
    path = _store(e, island, tmp_path / "domain.qc")
    _onnxruntime_accepts(path)
    _no_sessions(monkeypatch)
    refused(path, r"island 'cpu0': imports domain 'com.microsoft' \(version 1\); qcompiler imports only the "
                  r"default ONNX domain at opset 11" + NOT_OURS)
    island.ClearField("opset_import")  # the node alone, its domain not imported
    island.opset_import.append(helper.make_opsetid("", 11))
    path = _store(e, island, tmp_path / "domain2.qc")
    refused(path, r"island 'cpu0': node 'gelu' has op type 'Gelu' of domain 'com.microsoft'; qcompiler writes "
                  r"only the default ONNX domain" + NOT_OURS)


def test_island_of_another_opset_is_refused(artifact, tmp_path, monkeypatch):
    e, island = _island(artifact)
    island.opset_import[0].version = 13  # Mul, Erf, Add are the same in opset 13: onnxruntime would run it
    path = _store(e, island, tmp_path / "opset.qc")
    _onnxruntime_accepts(path)
    _no_sessions(monkeypatch)
    refused(path, r"island 'cpu0': imports domain '' \(version 13\); qcompiler imports only the default ONNX "
                  r"domain at opset 11" + NOT_OURS)


def _if_node(x, y):
    def branch(name):
        return helper.make_graph([helper.make_node("Identity", [x], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, None)])
    return helper.make_node("If", ["keep_going"], [y], name="branch", then_branch=branch("then"),
                            else_branch=branch("else"))


def _graph_attribute(x, y):
    node = helper.make_node("Identity", [x], [y], name="carrier")
    body = helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "hidden",
                             [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, None)],
                             [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, None)])
    node.attribute.append(helper.make_attribute("body", body))
    return node


@pytest.mark.parametrize("make,match", [
    (_if_node, r"node 'branch' has op type 'If', which qcompiler never writes"),
    (_graph_attribute, r"node 'carrier' \(Identity\) has attribute 'body', which qcompiler never writes on Identity"),
], ids=["if-with-branches", "graph-attribute"])
def test_island_with_a_nested_subgraph_is_refused(artifact, tmp_path, monkeypatch, make, match):
    e, island = _island(artifact)
    island.graph.initializer.append(numpy_helper.from_array(np.array(True), "keep_going"))
    path = _store(e, _append(island, make), tmp_path / "nested.qc")
    _no_sessions(monkeypatch)
    refused(path, r"island 'cpu0': " + match + NOT_OURS)


def test_an_allowed_attribute_holding_a_graph_is_refused(artifact, tmp_path, monkeypatch):
    """Softmax's axis is ours -- as an int; the same name holding a subgraph is not."""
    e, island = _island(artifact)

    def softmax(x, y):
        node = helper.make_node("Softmax", [x], [y], name="softmax")
        sub = helper.make_graph([], "g", [], [])
        node.attribute.append(helper.make_attribute("axis", sub))
        return node
    path = _store(e, _append(island, softmax), tmp_path / "graph_axis.qc")
    _no_sessions(monkeypatch)
    refused(path, r"island 'cpu0': node 'softmax' \(Softmax\) has attribute 'axis' of type GRAPH; qcompiler "
                  r"writes it as INT" + NOT_OURS)


def test_constants_that_fold_to_a_huge_tensor_are_not_computed_at_load(artifact, tmp_path):
    """ConstantOfShape([2^28]) -> ReduceSum, all ops qcompiler writes: onnxruntime's constant folding
    would fill 1 GiB while the session is made (7 s here); load leaves it to a call."""
    e, island = _island(artifact)
    island.graph.initializer.append(numpy_helper.from_array(np.array([1 << 28], np.int64), "huge_shape"))
    one = numpy_helper.from_array(np.ones(1, np.float32))
    _append(island, lambda x, y: helper.make_node("Add", [x, "huge_sum"], [y], name="add"))
    nodes = [helper.make_node("ConstantOfShape", ["huge_shape"], ["huge"], name="fill", value=one),
             helper.make_node("ReduceSum", ["huge"], ["huge_sum"], name="sum", keepdims=0), *island.graph.node]
    island.graph.ClearField("node")
    island.graph.node.extend(nodes)
    path = _store(e, island, tmp_path / "fold.qc")
    t0 = time.perf_counter()
    load(path)
    assert time.perf_counter() - t0 < 2.0


def test_island_with_local_functions_or_training_info_is_refused(artifact, tmp_path, monkeypatch):
    e, island = _island(artifact)
    island.functions.append(helper.make_function("", "Mul", ["a", "b"], ["c"],
                                                 [helper.make_node("Add", ["a", "b"], ["c"])],
                                                 [helper.make_opsetid("", 11)]))
    island.ir_version = 8  # (functions need IR 8)
    path = _store(e, island, tmp_path / "fn.qc")
    _onnxruntime_accepts(path)
    _no_sessions(monkeypatch)
    refused(path, r"island 'cpu0': defines 1 local function \('Mul'\); "
                                                   r"qcompiler writes none" + NOT_OURS)
    e, island = _island(artifact)
    island.training_info.add().algorithm.CopyFrom(helper.make_graph([], "train", [], []))
    refused(_store(e, island, tmp_path / "train.qc"), r"island 'cpu0': carries training info; qcompiler writes "
                                                      r"none" + NOT_OURS)


def test_load_rejects_a_bad_thread_count_before_reading(artifact):
    with pytest.raises(ConfigError, match="ort_threads must be a positive int"):
        load(artifact, ort_threads=0)


# ---------------------------------------------------------------------------- bad cases never unpickle


class _Boom:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


def test_load_bad_case_never_unpickles(model_and_input, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cm, x = model_and_input
    qa = QuantAnalysis(cm.float_model, cm, "compiled", out_dir=tmp_path / "qa")
    crafted = tmp_path / "crafted.pt"
    crafted.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(ArtifactError, match=r"crafted.pt: not a qcompiler bad-case file"):
        qa.load_bad_case(crafted)
    legacy = tmp_path / "legacy.pt"
    torch.save((x,), legacy)
    with pytest.raises(ArtifactError, match=r"legacy.pt: not a qcompiler bad-case file"):
        qa.load_bad_case(legacy)
    assert not (tmp_path / "PWNED").exists()


def test_bad_case_round_trip_without_pickle(model_and_input, tmp_path):
    cm, x = model_and_input
    qa = QuantAnalysis(cm.float_model, cm, "compiled", out_dir=tmp_path)
    case = (x, {"mask": torch.ones(2, dtype=torch.bool), "k": 3, "name": "a"}, [torch.arange(3), None])
    qa.set_bad_case(case)
    path = qa.save_bad_case()
    data = path.read_bytes()
    assert b"\x80" not in data[:2] and data[8:9] == b"{"  # a safetensors header, not a pickle
    loaded = qa.load_bad_case()
    assert torch.equal(loaded[0], x)
    assert torch.equal(loaded[1]["mask"], case[1]["mask"]) and loaded[1]["k"] == 3 and loaded[1]["name"] == "a"
    assert isinstance(loaded[2], tuple) and torch.equal(loaded[2][0], torch.arange(3)) and loaded[2][1] is None
