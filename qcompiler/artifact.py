"""Saving and loading a compiled model: tensors + JSON + ONNX in one zip, no pickled code.

Layout of the file (a zip archive):

* ``manifest.json`` -- format name and version, model name, march, inputs,
  steps, output structure, each BPU program's metadata (with every tensor's
  dtype and shape) and the uncompressed size of every other member; for a model
  with structured outputs or keyword inputs, ``output_spec`` / ``input_spec``
  (:func:`qcompiler.ir.structure.spec_to_json`: classes by name, never imported on load);
* ``tensors.safetensors`` -- every BPU program tensor, keyed ``<program>/<key>``;
* ``islands/<name>.onnx`` -- each CPU island (self-contained: no external data).

``load`` treats the file as untrusted (docs/artifacts.md): it reads only the members the
manifest names, each streamed with a hard stop at the size the manifest declares
(:data:`MAX_MANIFEST_BYTES` for the manifest itself, and at most
:data:`MAX_INFLATION` times the compressed size), checks CRCs, the manifest's form and
data flow, every tensor against its program's declaration, and refuses ONNX external
data and islands holding anything the emitter never writes
(:func:`~qcompiler.backends.ort.island.check_island`: no ``Loop``, no custom op).  Anything
wrong is an :class:`~qcompiler.errors.ArtifactError` naming the member, step, program, tensor
or island node.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import zipfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Union

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from qcompiler.atomic_write import check_path, check_target, describe, stat_or_none, write_file
from qcompiler.backends.bpu.program import BpuProgram
from qcompiler.backends.bpu.program_check import ITEMSIZE, check_declaration, expect_keys, short
from qcompiler.backends.ort.island import check_island
from qcompiler.errors import ArtifactError
from qcompiler.ir.structure import check_spec_json, spec_leaf_count
from qcompiler.march import March

FORMAT = "qcompiler-artifact"
FORMAT_VERSION = 2  # 2: member sizes in the manifest, tensors declare dtype and shape
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"

# limits of load (docs/artifacts.md)
MAX_MANIFEST_BYTES = 64 << 20  # the manifest cannot justify its own size
MAX_INFLATION = 100  # a member inflates to at most this many times its compressed size ...
INFLATION_SLACK = 1 << 20  # ... plus this (small members of zeros compress very well)
MAX_NESTING = 32  # output structures and input signatures nest at most this deep
_SAFETENSORS_HEADER = 8 + 64 * 1024  # header bytes allowed in the tensors member (plus 512 per tensor)
_STEP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")

PathLike = Union[str, os.PathLike]


def save_artifact(path: PathLike, manifest: dict, programs: dict, islands: dict[str, bytes]) -> Path:
    """Write atomically (:mod:`qcompiler.atomic_write`): a failure leaves no partial file behind;
    a bad path is a ConfigError naming it, before any work."""
    path = check_target(path, "save")
    tensors = {}
    meta = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION, programs={})
    for name, program in programs.items():
        t, m = program.to_state()
        meta["programs"][name] = m
        for key, value in t.items():
            tensors[f"{name}/{key}"] = value.contiguous().clone()
    tensor_bytes = st_save(tensors)
    members = {TENSORS: tensor_bytes}
    for name in sorted(islands):
        members[f"islands/{name}.onnx"] = bytes(islands[name])
    meta["members"] = {k: len(v) for k, v in members.items()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(_fixed(MANIFEST), json.dumps(meta, indent=1, sort_keys=True))
        for member, data in members.items():
            zf.writestr(_fixed(member), data)
    return write_file(path, buf.getvalue(), "save")


def _fixed(name: str) -> zipfile.ZipInfo:
    """A zip entry with a fixed timestamp: the same model saves to the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def load_artifact(path: PathLike):
    """``(manifest, programs, islands)`` from a saved file; ArtifactError on anything wrong.

    Reads only what the manifest names, each member streamed and bounded (see the module
    docstring); the manifest is checked (:func:`check_manifest`) before any tensor or
    island is read. A path that names no file at all (empty, a NUL byte) is a ConfigError.
    """
    text = check_path(path, "load")  # Path("") would be ".", and an error would name that
    path = Path(text)
    found = stat_or_none(text, "load")  # a name too long: a ConfigError (is_file() raised a raw OSError)
    if found is None:
        raise ArtifactError(f"{path}: no such file")
    if not stat.S_ISREG(found.st_mode):  # (a FIFO would block the read)
        raise ArtifactError(f"{path}: no such file: it is {describe(found.st_mode)}; give the path of a file "
                            "CompiledModel.save wrote")
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            dup = next((n for n, k in Counter(names).items() if k > 1), None)
            if dup is not None:
                raise ArtifactError(f"{path}: corrupted (member {dup!r} appears twice)")
            if MANIFEST not in names:
                raise ArtifactError(f"{path}: not a qcompiler artifact (no {MANIFEST})")
            raw = _read_member(zf, MANIFEST, MAX_MANIFEST_BYTES, path, exact=False)
            try:
                manifest = json.loads(raw)
            except RecursionError:
                raise ArtifactError(f"{path}: corrupted ({MANIFEST} nests too deep to be a manifest)") from None
            _check_format(path, manifest)
            check_manifest(manifest, path)
            sizes = manifest["members"]
            tensors = _load_tensors(zf, sizes, manifest["programs"], path)
            islands = {}
            for step in manifest["steps"]:
                if step["kind"] == "cpu":
                    member = f"islands/{step['name']}.onnx"
                    islands[step["name"]] = _read_member(zf, member, sizes[member], path)
    except ArtifactError:
        raise
    except zlib.error as exc:
        raise ArtifactError(f"{path}: corrupted (bad compressed data: {exc})") from None
    except (zipfile.BadZipFile, EOFError, NotImplementedError) as exc:
        raise ArtifactError(f"{path}: not a qcompiler artifact or truncated ({exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, OverflowError, OSError) as exc:
        raise ArtifactError(f"{path}: corrupted ({type(exc).__name__}: {exc})") from None
    programs = {}
    for name, meta in manifest["programs"].items():
        prefix = f"{name}/"
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            programs[name] = BpuProgram.from_state(own, meta)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None
    stray = sorted(k for k in tensors if k.split("/", 1)[0] not in programs)
    if stray:
        raise ArtifactError(f"{path}: {TENSORS} holds tensor {stray[0]!r} of no program")
    check_flow(manifest, programs, path)
    tensor_inputs = {v.name for p in programs.values() for v in p.inputs}  # read as one tensor
    for step in manifest["steps"]:
        if step["kind"] == "cpu":
            try:
                feeds = check_island(step["name"], islands[step["name"]], step["inputs"], step["outputs"])
            except ArtifactError as exc:
                raise ArtifactError(f"{path}: member 'islands/{step['name']}.onnx': {exc}") from None
            tensor_inputs |= feeds
    for name, sig in zip(manifest["inputs"], manifest.get("input_signature") or []):
        if isinstance(sig, list) and name in tensor_inputs:
            raise ArtifactError(f"{path}: {MANIFEST}: input_signature says input '{name}' is a tuple, but a "
                                f"step reads it as one tensor")
    return manifest, programs, islands


def _read_member(zf: zipfile.ZipFile, member: str, limit: int, path: Path, exact: bool = True) -> bytes:
    """The member's bytes, streamed: refused before reading when its declared size is not
    ``limit`` (``exact``) or above it, or above the inflation bound; a stream that runs past the
    declared size or fails its CRC is refused while reading (memory stays <= the limit)."""
    try:
        info = zf.getinfo(member)
    except KeyError:
        raise ArtifactError(f"{path}: corrupted (missing {member})") from None
    where = f"{path}: member {member!r}"
    if exact and info.file_size != limit:
        raise ArtifactError(f"{where} declares {info.file_size} bytes uncompressed; the manifest says {limit}")
    if info.file_size > limit:
        raise ArtifactError(f"{where} declares {info.file_size} bytes uncompressed, over the {limit}-byte limit")
    bound = MAX_INFLATION * info.compress_size + INFLATION_SLACK
    if info.file_size > bound:
        raise ArtifactError(f"{where} would inflate {info.file_size} bytes from {info.compress_size} "
                            f"(more than {MAX_INFLATION}x); refusing a likely zip bomb")
    out = bytearray()
    with zf.open(info) as f:  # zipfile stops at file_size and checks the CRC at the end
        while True:
            try:
                chunk = f.read(1 << 20)
            except zipfile.BadZipFile as exc:
                raise ArtifactError(f"{where} is corrupted ({exc})") from None
            if not chunk:
                break
            out += chunk
            if len(out) > info.file_size:
                raise ArtifactError(f"{where} inflates past its declared {info.file_size} bytes")
    if len(out) != info.file_size:
        raise ArtifactError(f"{where} holds {len(out)} bytes, declared {info.file_size}")
    return bytes(out)


def _load_tensors(zf: zipfile.ZipFile, sizes: dict, programs: dict, path: Path) -> dict:
    """The tensors member, whose size must match the sum of the tensors the programs declare."""
    declared = 0
    count = 0
    for meta in programs.values():
        for op in meta["ops"]:
            for decl in op["tensors"]:
                n = ITEMSIZE[decl["dtype"]]
                for d in decl["shape"]:
                    n *= d
                declared += n
                count += 1
    size = sizes[TENSORS]
    if not declared + 8 <= size <= declared + _SAFETENSORS_HEADER + 512 * count:
        raise ArtifactError(f"{path}: member {TENSORS!r} is {size} bytes, but the programs declare "
                            f"{declared} bytes of tensors ({count} tensors)")
    data = _read_member(zf, TENSORS, size, path)
    try:
        return st_load(data)
    except (SafetensorError, ValueError, TypeError, OverflowError) as exc:
        raise ArtifactError(f"{path}: member {TENSORS!r} is not a valid safetensors file ({exc})") from None




# ---------------------------------------------------------------------------- manifest checks


def check_manifest(m: dict, path: Path) -> None:
    """The manifest's form: every key ``load`` and the runtime read, with its type, before any
    other member is read.  (Programs are checked by ``BpuProgram.from_state``.)"""
    where = f"{path}: {MANIFEST}"
    expect_keys(m, {"model": str, "march": str, "inputs": list, "steps": list, "programs": dict, "members": dict},
            where)
    if "outputs" not in m:
        raise ArtifactError(f"{where}: 'outputs' is missing")
    marches = [march.value for march in March]
    if m["march"] not in marches:
        raise ArtifactError(f"{where}: march {short(m['march'])} is not a march this qcompiler knows "
                            f"({', '.join(marches)}); the file is corrupted or from another qcompiler: compile "
                            "and save the model again")
    if not all(isinstance(v, str) for v in m["inputs"]) or len(set(m["inputs"])) != len(m["inputs"]):
        raise ArtifactError(f"{where}: 'inputs' must be a list of distinct value names")
    sig = m.get("input_signature")
    if sig is not None:
        if not isinstance(sig, list) or len(sig) != len(m["inputs"]):
            raise ArtifactError(f"{where}: 'input_signature' must list one entry per input "
                                f"({len(m['inputs'])}), got {short(sig)}")
        for i, s in enumerate(sig):
            _check_signature(s, f"{where}: input_signature[{i}]", 0)
    refusal = m.get("split_refusal")
    if refusal is not None and not isinstance(refusal, str):
        raise ArtifactError(f"{where}: 'split_refusal' is {short(refusal)}, expected null (the graph was proven "
                            "per-sample) or a JSON string (why not)")
    for key, size in m["members"].items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ArtifactError(f"{where}: members[{key!r}] is {short(size)}, expected a byte count")
    if TENSORS not in m["members"]:
        raise ArtifactError(f"{where}: 'members' does not list {TENSORS}")
    seen: set[str] = set()
    for i, step in enumerate(m["steps"]):
        sw = f"{where}: steps[{i}]"
        expect_keys(step, {"kind": str, "name": str, "inputs": list, "outputs": list}, sw)
        kind, name = step["kind"], step["name"]
        if kind not in ("bpu", "cpu"):
            raise ArtifactError(f"{sw}: kind {kind!r} is not a step kind (bpu or cpu)")
        if not _STEP_NAME.fullmatch(name) or name in seen:
            raise ArtifactError(f"{sw}: name {name!r} must be a distinct [A-Za-z0-9_.-] name")
        seen.add(name)
        for key in ("inputs", "outputs", "nodes"):
            if not isinstance(step.get(key, []), list) or not all(isinstance(v, str) for v in step.get(key, [])):
                raise ArtifactError(f"{sw} ('{name}'): '{key}' must be a list of value names")
        if kind == "bpu" and name not in m["programs"]:
            raise ArtifactError(f"{sw}: BPU step '{name}' has no program (programs: "
                                f"{', '.join(m['programs']) or 'none'})")
        if kind == "cpu" and f"islands/{name}.onnx" not in m["members"]:
            raise ArtifactError(f"{sw}: CPU step '{name}' has no island (member islands/{name}.onnx)")
    unused = sorted(set(m["programs"]) - {s["name"] for s in m["steps"] if s["kind"] == "bpu"})
    if unused:
        raise ArtifactError(f"{where}: program '{unused[0]}' belongs to no BPU step")
    for name, meta in m["programs"].items():
        pw = f"{where}: programs[{name!r}]"
        expect_keys(meta, {"ops": list}, pw)
        for j, op in enumerate(meta["ops"]):
            expect_keys(op, {"tensors": list}, f"{pw} op {j}")
            for decl in op["tensors"]:
                check_declaration(decl, f"{pw} op {j}")
    _check_outputs(m["outputs"], f"{where}: outputs", 0)
    _check_specs(m, where)


def _check_specs(m: dict, where: str) -> None:
    """The optional structure specs (:mod:`qcompiler.ir.structure`): their form, and an output spec with
    one leaf per flat output, an input spec with one leaf per input."""
    counts = {"output_spec": len(_output_leaves(m["outputs"])), "input_spec": len(m["inputs"])}
    for key, count in counts.items():
        if key not in m:
            continue
        check_spec_json(m[key], f"{where}: {key}")
        leaves = spec_leaf_count(m[key])
        if leaves != count:
            raise ArtifactError(f"{where}: {key} has {leaves} leaves, but the model has {count} "
                                f"{'flat outputs' if key == 'output_spec' else 'inputs'}")


def _output_leaves(spec: dict) -> list:
    """The flat outputs of a structured model: the entries of its output tuple."""
    (key, v), = spec.items()
    return v if key in ("tuple", "list") else [v]


def check_flow(m: dict, programs: dict, path: Path) -> None:
    """Every value a step or the output reads is a model input or made by an earlier step, and
    BPU programs read what they expect (QTensors of the same quantization from a BPU step,
    floats from anything else)."""
    where = f"{path}: {MANIFEST}"
    made: dict[str, Any] = {name: None for name in m["inputs"]}  # value -> its BPU spec (None: float)
    for i, step in enumerate(m["steps"]):
        name = step["name"]
        for v in step["inputs"]:
            if v not in made:
                raise ArtifactError(f"{where}: steps[{i}] ('{name}') reads '{v}', which no earlier step or "
                                    f"model input makes")
        if step["kind"] == "bpu":
            prog = programs[name]
            for v in prog.inputs:
                if v.name not in step["inputs"]:
                    raise ArtifactError(f"{where}: steps[{i}] ('{name}') does not list its program's input "
                                        f"'{v.name}' among its inputs")
                src = made[v.name]
                have = "a float" if src is None or src.is_float else src.describe()
                if (src is None or src.is_float) != v.is_float or (
                        not v.is_float and (src.dtype, src.scale, src.axis) != (v.dtype, v.scale, v.axis)):
                    raise ArtifactError(f"{where}: steps[{i}] ('{name}') reads '{v.name}' as {v.describe()}, but "
                                        f"it is {have}")
            for v in prog.outputs:
                made[v.name] = v
        else:
            for v in step["inputs"]:
                if made[v] is not None and not made[v].is_float:
                    raise ArtifactError(f"{where}: CPU steps[{i}] ('{name}') reads '{v}', an integer BPU value "
                                        f"({made[v].describe()}); CPU islands read floats")
            for v in step["outputs"]:
                made[v] = None
    for v in _output_values(m["outputs"]):
        if v not in made:
            raise ArtifactError(f"{where}: the model output '{v}' is made by no step or input")


def _check_signature(s: Any, where: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise ArtifactError(f"{where}: nested deeper than {MAX_NESTING}")
    if s is None:
        return
    if isinstance(s, list):
        for i, x in enumerate(s):
            _check_signature(x, f"{where}[{i}]", depth + 1)
        return
    expect_keys(s, {"dtype": str, "shape": list}, where)
    if s["dtype"] not in _SIGNATURE_DTYPES or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s["shape"]):
        raise ArtifactError(f"{where}: {short(s)} is not a tensor signature (dtype, shape of ints >= 0)")


_SIGNATURE_DTYPES = {"float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"}


def _check_outputs(spec: Any, where: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise ArtifactError(f"{where}: nested deeper than {MAX_NESTING}")
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ArtifactError(f"{where}: {short(spec)} is not an output structure "
                            "({'value': name}, {'tuple': [...]}, {'list': [...]} or {'const': scalar})")
    (key, v), = spec.items()
    if key == "value" and isinstance(v, str):
        return
    if key in ("tuple", "list") and isinstance(v, list):
        for i, x in enumerate(v):
            _check_outputs(x, f"{where}.{key}[{i}]", depth + 1)
        return
    if key == "const" and (v is None or isinstance(v, (bool, int, float, str))):
        return
    raise ArtifactError(f"{where}: {short(spec)} is not an output structure")


def _output_values(spec: dict) -> list[str]:
    (key, v), = spec.items()
    if key == "value":
        return [v]
    if key in ("tuple", "list"):
        return [name for x in v for name in _output_values(x)]
    return []


def _check_format(path: Path, manifest: dict) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a qcompiler artifact (foreign manifest)")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArtifactError(f"{path}: corrupted (no format version)")
    if version < FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: written by an older qcompiler (artifact format {version}; this version reads format "
            f"{FORMAT_VERSION}, which records member sizes and tensor shapes); compile and save the model again"
        )
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: written by a newer qcompiler (artifact format {version}; this version reads "
            f"format {FORMAT_VERSION}); upgrade qcompiler to load it"
        )
