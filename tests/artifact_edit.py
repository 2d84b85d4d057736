"""Helpers for tests that edit saved artifacts the way an attacker (or a bad disk) would.

``Edit`` opens an artifact's members (manifest as JSON, tensors as a dict); ``write``
re-zips them, by default also re-declaring sizes and tensor shapes/dtypes in the
manifest so the edit reaches the deeper checks instead of the size check.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

MANIFEST, TENSORS = "manifest.json", "tensors.safetensors"


class Edit:
    def __init__(self, path: Path) -> None:
        with zipfile.ZipFile(path) as zf:
            self.members = {n: zf.read(n) for n in zf.namelist()}
        self.manifest = json.loads(self.members[MANIFEST])
        self.tensors = st_load(self.members[TENSORS])
        self.raw_tensors = None  # bytes to store instead of the (re-saved) tensors

    def write(self, path: Path, *, redeclare: bool = True, raw_tensors: bytes = None) -> Path:
        """Zip the members to ``path``; ``redeclare``: make the manifest agree with the edit
        (member sizes, and every tensor's dtype and shape)."""
        members = dict(self.members)
        raw_tensors = raw_tensors if raw_tensors is not None else self.raw_tensors
        if TENSORS in members:  # (a test may have deleted it)
            members[TENSORS] = raw_tensors if raw_tensors is not None else st_save(self.tensors)
        m = self.manifest
        if redeclare and isinstance(m, dict):
            for prog, meta in m.get("programs", {}).items():
                for i, op in enumerate(meta.get("ops", [])):
                    for decl in op.get("tensors", []):
                        t = self.tensors.get(f"{prog}/{i}.{decl['name']}")
                        if t is not None:
                            decl["dtype"] = str(t.dtype).replace("torch.", "")
                            decl["shape"] = list(t.shape)
            m["members"] = {k: len(v) for k, v in members.items() if k != MANIFEST}
        members[MANIFEST] = json.dumps(m).encode() if not isinstance(m, bytes) else m
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return path

    def op(self, program: str, kind: str) -> tuple[int, dict]:
        """(index, JSON) of the first op of ``kind`` in ``program``."""
        for i, op in enumerate(self.manifest["programs"][program]["ops"]):
            if op["kind"] == kind:
                return i, op
        raise LookupError(kind)
