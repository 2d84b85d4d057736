"""Saving and loading a compiled model: tensors + JSON + ONNX in one zip, no pickled code.

Layout of the file (a zip archive):

* ``manifest.json`` -- format name and version, model name, march, inputs,
  steps, output structure and each BPU program's metadata;
* ``tensors.safetensors`` -- every BPU program tensor, keyed ``<program>/<key>``;
* ``islands/<name>.onnx`` -- each CPU island.

``load`` checks every member's CRC and rejects foreign, truncated, corrupted
and newer-format files with :class:`~qcompiler.errors.ArtifactError`.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Union

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from qcompiler.atomic_write import check_target, write_file
from qcompiler.backends.bpu.program import BpuProgram
from qcompiler.errors import ArtifactError

FORMAT = "qcompiler-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"

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
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(_fixed(MANIFEST), json.dumps(meta, indent=1, sort_keys=True))
        zf.writestr(_fixed(TENSORS), st_save(tensors) if tensors else st_save({}))
        for name in sorted(islands):
            zf.writestr(_fixed(f"islands/{name}.onnx"), islands[name])
    return write_file(path, buf.getvalue(), "save")


def _fixed(name: str) -> zipfile.ZipInfo:
    """A zip entry with a fixed timestamp: the same model saves to the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def load_artifact(path: PathLike):
    """``(manifest, programs, islands)`` from a saved file; ArtifactError on anything wrong."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
            if bad is not None:
                raise ArtifactError(f"{path}: corrupted (member {bad!r} fails its CRC check)")
            names = set(zf.namelist())
            if MANIFEST not in names:
                raise ArtifactError(f"{path}: not a qcompiler artifact (no {MANIFEST})")
            manifest = json.loads(zf.read(MANIFEST))
            _check_format(path, manifest)
            tensors = st_load(zf.read(TENSORS)) if TENSORS in names else {}
            islands = {}
            for step in manifest["steps"]:
                if step["kind"] == "cpu":
                    member = f"islands/{step['name']}.onnx"
                    if member not in names:
                        raise ArtifactError(f"{path}: corrupted (missing {member})")
                    islands[step["name"]] = zf.read(member)
    except ArtifactError:
        raise
    except zlib.error as exc:
        raise ArtifactError(f"{path}: corrupted (bad compressed data: {exc})") from None
    except (zipfile.BadZipFile, EOFError) as exc:
        raise ArtifactError(f"{path}: not a qcompiler artifact or truncated ({exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, ValueError, OSError) as exc:
        raise ArtifactError(f"{path}: corrupted ({type(exc).__name__}: {exc})") from None
    programs = {}
    try:
        for name, meta in manifest["programs"].items():
            prefix = f"{name}/"
            own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            programs[name] = BpuProgram.from_state(own, meta)
    except Exception as exc:  # a program that does not rebuild is a corrupted file
        raise ArtifactError(f"{path}: corrupted BPU program ({type(exc).__name__}: {exc})") from None
    return manifest, programs, islands


def _check_format(path: Path, manifest: dict) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a qcompiler artifact (foreign manifest)")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: corrupted (no format version)")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: written by a newer qcompiler (artifact format {version}; this version reads "
            f"format {FORMAT_VERSION}); upgrade qcompiler to load it"
        )
