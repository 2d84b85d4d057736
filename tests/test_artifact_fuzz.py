"""Fuzzing ``qcompiler.load`` with byte and structure mutations of a real artifact.

Every mutation must give an ArtifactError, or a model whose output on the reference input
is identical -- never another exception, never a hang (each case runs under an alarm),
and memory stays bounded (Python allocations per case, and the process's peak RSS).

Mutations are seeded (the same every run):

* bytes of the zip file: flips, random values, truncation, insertion, zeroed ranges;
* the manifest's JSON: a key deleted, an element of a list of names or objects removed or
  duplicated, a value
  replaced by one of another JSON type (a string, a huge int, NaN, a bool, a deep list...)
  -- type-breaking on purpose: a well-typed edit (another scale, stride, shape or ``act``) is a
  different model, which no check can tell from the intended one (docs/artifacts.md);
* tensors: another dtype, a dim dropped or added, fewer elements, out-of-range
  multipliers and shifts -- with the manifest re-declaring them (as an attacker would) or not;
* members: deleted, renamed, added, an island replaced by garbage.
"""

from __future__ import annotations

import copy
import json
import math
import random
import resource
import signal
import tracemalloc

import pytest
import torch
import torch.nn as nn
from artifact_edit import MANIFEST, TENSORS, Edit

from qcompiler.compiled import compile as qc_compile
from qcompiler.compiled import load
from qcompiler.errors import ArtifactError

SEED = 20261123
CASES = 400
TIMEOUT_S = 10
PY_MEMORY_LIMIT = 64 << 20  # Python allocations while loading one case
RSS_GROWTH_LIMIT = 512 << 20  # peak RSS growth over the whole run (bytes)

# values that may legitimately be null: replacing them by None is a well-typed edit
NULLABLE = {"act", "axis", "out_axis", "dim", "scale", "const", "input_signature"}
POOL = ["qc", 1 << 70, -(1 << 70), True, [], {}, math.nan, math.inf, None, json.loads("[" * 40 + "]" * 40)]


def _json_type(v):
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    return type(v).__name__


def _paths(tree, prefix=()):
    """Every (path, value) of a JSON tree (iteratively)."""
    out, stack = [], [(prefix, tree)]
    while stack:
        path, v = stack.pop()
        out.append((path, v))
        if isinstance(v, dict):
            stack.extend((path + (k,), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((path + (i,), x) for i, x in enumerate(v))
    return out


def _parent(tree, path):
    for k in path[:-1]:
        tree = tree[k]
    return tree


def mutate_manifest(m: dict, rng: random.Random) -> str:
    paths = [p for p, _ in _paths(m) if p]
    path = rng.choice(paths)
    parent, key = _parent(m, path), path[-1]
    value = parent[key]
    action = rng.choice(["delete", "replace", "replace", "list"])
    numbers = isinstance(parent, list) and any(_json_type(v) in ("int", "float") for v in parent)
    if action == "delete" and not numbers:
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
        return f"delete {path}"
    # (a list of numbers edited is a well-typed edit: another shape, stride or signature)
    if action == "list" and isinstance(value, list) and value and not any(
            _json_type(v) in ("int", "float") for v in value):
        if rng.random() < 0.5:
            value.pop(rng.randrange(len(value)))
            return f"remove an element of {path}"
        value.append(copy.deepcopy(rng.choice(value)))
        return f"duplicate an element of {path}"
    choices = [v for v in POOL if _json_type(v) != _json_type(value)
               and not (v is None and key in NULLABLE)]
    new = copy.deepcopy(rng.choice(choices))
    parent[key] = new
    return f"replace {path} ({str(value)[:30]}) by {str(new)[:30]}"


def mutate_tensors(e: Edit, rng: random.Random) -> str:
    key = rng.choice(sorted(e.tensors))
    t = e.tensors[key]
    how = rng.choice(["dtype", "drop dim", "add dim", "fewer", "values"])
    if how == "dtype":
        dtype = rng.choice([d for d in (torch.float32, torch.int64, torch.int32, torch.int16, torch.int8)
                            if d != t.dtype])
        e.tensors[key] = t.to(dtype)
    elif how == "drop dim" and t.dim() > 0:
        e.tensors[key] = t.reshape(-1)[: max(1, t.numel() // max(1, t.shape[-1]))].contiguous() \
            if t.dim() == 1 else t.select(-1, 0).contiguous()
    elif how == "add dim":
        e.tensors[key] = torch.cat([t.unsqueeze(0)] * 2).contiguous()
    elif how == "fewer" and t.numel() > 1:
        e.tensors[key] = t.reshape(-1)[:-1].contiguous()
    else:  # out-of-range values where the range is part of the contract (multipliers, shifts)
        if key.rsplit(".", 1)[-1] in ("M", "n", "Mb", "nb", "Ma", "na"):
            e.tensors[key] = t + (1 << 40 if key.endswith("M") else 64)
        else:
            e.tensors[key] = t.to(torch.float32)
    return f"tensor {key}: {how}"


def mutate_members(e: Edit, rng: random.Random) -> str:
    names = sorted(n for n in e.members if n not in (MANIFEST, TENSORS))
    how = rng.choice(["delete", "rename", "extra", "garbage"])
    if how == "delete":
        victim = rng.choice(names + [TENSORS])
        e.members.pop(victim)
        return f"delete member {victim}"
    if how == "rename" and names:
        victim = rng.choice(names)
        e.members[victim + ".bak"] = e.members.pop(victim)
        return f"rename member {victim}"
    if how == "extra":
        e.members["islands/evil.onnx"] = b"\x00" * 64
        return "extra member"
    victim = rng.choice(names + [TENSORS])
    e.members[victim] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    if victim == TENSORS:
        e.raw_tensors = e.members[victim]
    return f"garbage in {victim}"


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    b = bytearray(data)
    how = rng.choice(["flip", "set", "truncate", "insert", "zero"])
    i = rng.randrange(len(b))
    if how == "flip":
        b[i] ^= 1 << rng.randrange(8)
    elif how == "set":
        b[i] = rng.randrange(256)
    elif how == "truncate":
        del b[i:]
    elif how == "insert":
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    else:
        b[i:i + rng.randrange(1, 64)] = bytes(min(64, len(b) - i))
    return bytes(b), f"bytes: {how} at {i}"


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1), nn.GELU(),
                      nn.Conv2d(4, 4, 1), nn.ReLU6()).eval()
    x = torch.randn(2, 3, 8, 8)
    cm = qc_compile(m, (x,), march="bayes", progress=False)
    path = cm.save(tmp_path_factory.mktemp("fuzz") / "ref.qc")
    return path, x, load(path)(x)


def test_load_fuzz(reference, tmp_path):
    path, x, want = reference
    rng = random.Random(SEED)
    original = path.read_bytes()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    old = signal.signal(signal.SIGALRM, _alarm)
    outcomes = {"refused": 0, "identical": 0}
    try:
        for case in range(CASES):
            kind = ("bytes", "manifest", "tensors", "members")[case % 4]
            target = tmp_path / f"case{case % 8}.qc"
            if kind == "bytes":
                data, what = mutate_bytes(original, rng)
                target.write_bytes(data)
            else:
                e = Edit(path)
                if kind == "manifest":
                    what = mutate_manifest(e.manifest, rng)
                    e.write(target, redeclare=False)
                elif kind == "tensors":
                    what = mutate_tensors(e, rng)
                    redeclare = rng.random() < 0.5
                    e.write(target, redeclare=redeclare)
                    what += " (re-declared)" if redeclare else ""
                else:
                    what = mutate_members(e, rng)
                    e.write(target, redeclare=rng.random() < 0.5)
            tracemalloc.start()
            signal.alarm(TIMEOUT_S)
            try:
                model = load(target)
                got = model(x)
            except ArtifactError:
                outcomes["refused"] += 1
                continue
            except _Timeout:
                pytest.fail(f"case {case} ({what}): load or call took more than {TIMEOUT_S} s")
            except Exception as exc:  # noqa: BLE001 - the point of the test
                pytest.fail(f"case {case} ({what}): {type(exc).__name__}: {exc}")
            finally:
                signal.alarm(0)
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                assert peak < PY_MEMORY_LIMIT, f"case {case} ({what}): {peak >> 20} MiB allocated"
            assert torch.equal(got, want), f"case {case} ({what}): loaded, but the output differs"
            outcomes["identical"] += 1
    finally:
        signal.signal(signal.SIGALRM, old)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert rss - rss0 < RSS_GROWTH_LIMIT, f"peak RSS grew by {(rss - rss0) >> 20} MiB"
    # both outcomes occur: the mutations reach past the first check, and harmless ones load
    assert outcomes["refused"] > CASES // 2 and outcomes["identical"] > 0, outcomes


def test_fuzz_mutations_are_deterministic(reference):
    path, _, _ = reference
    a, b = Edit(path), Edit(path)
    ra, rb = random.Random(SEED), random.Random(SEED)
    assert [mutate_manifest(a.manifest, ra) for _ in range(20)] == [mutate_manifest(b.manifest, rb) for _ in range(20)]
    assert json.dumps(a.manifest, sort_keys=True) == json.dumps(b.manifest, sort_keys=True)
