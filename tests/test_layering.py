"""The package's layering, checked statically (docs/design.md, "Layers").

Every ``qcompiler`` module belongs to one layer of :data:`LAYERS`; a module imports only
from its own layer or below, the import graph has no cycle, and an import of a
``qcompiler`` module inside a function is allowed only where :data:`ALLOWED_LOCAL_IMPORTS`
says why. Importing ``a.b.c`` runs the ``__init__`` of ``a.b`` too, so those edges count
(except the root ``qcompiler``, which is the top layer and always runs first).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> folder, as [tool.setuptools.package-dir] in pyproject.toml maps them
PACKAGE_DIRS = {
    "qcompiler": ROOT / "qcompiler",
    "qcompiler.passes": ROOT / "passes",
    "qcompiler.backends": ROOT / "backends",
    "qcompiler.tools": ROOT / "tools",
}

# Layers, lowest first: (name, module prefixes). The longest matching prefix decides.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", (
        "qcompiler.errors", "qcompiler.compat", "qcompiler.march", "qcompiler.atomic_write", "qcompiler.collectives", "qcompiler.batches", "qcompiler.calib_data", "qcompiler.parallel",
        "qcompiler.ir", "qcompiler.native",
        "qcompiler.nn", "qcompiler.zoo",
        "qcompiler.quantization",  # the primitives; the workflow modules are listed under "workflow"
    )),
    ("tables", ("qcompiler.hybrid", "qcompiler.backends", "qcompiler.backends.bpu",
                "qcompiler.backends.bpu.support", "qcompiler.backends.bpu.constraints",
                "qcompiler.backends.bpu.op_info", "qcompiler.backends.bpu.bayes",
                "qcompiler.backends.bpu.bernoulli2")),
    ("passes", ("qcompiler.passes",)),
    ("workflow", ("qcompiler.frontend", "qcompiler.quantization.prepare", "qcompiler.quantization.convert",
                  "qcompiler.quantization.weight_rounding", "qcompiler.quantization.model_check",
                  "qcompiler.quantization.mixed_precision",
                  # the guide's one-call prepare and its qconfig templates (issue 38)
                  "qcompiler.quantization.prepare_one_call", "qcompiler.quantization.qconfig_template",
                  # PT2E interop: BPUQuantizer (tables, passes) and the Q/DQ import (docs/pt2e.md)
                  "qcompiler.pt2e")),
    ("lowering", ("qcompiler.backends.bpu.lower", "qcompiler.backends.bpu.program",
                  "qcompiler.backends.bpu.sim", "qcompiler.backends.bpu.native",
                  "qcompiler.backends.bpu.onednn_conv",
                  "qcompiler.backends.onnx", "qcompiler.backends.ort",
                  "qcompiler.backends.eager", "qcompiler.runtime")),
    ("facade", ("qcompiler.compiled", "qcompiler.onnx", "qcompiler.artifact", "qcompiler.distributed",
                "qcompiler.deploy")),
    ("tools", ("qcompiler.tools", "qcompiler.__init__")),
)

# Function-level imports of qcompiler modules that are allowed, and why: (module, imported) -> reason.
# Keep it short; an entry here is a dependency the layering does not show.
ALLOWED_LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    # the command line parses and checks its arguments before torch and the compiler are imported
    # (issue 35: --help and argument errors answer at once); cli_commands imports cli's checks
    ("qcompiler.tools.cli", "qcompiler.tools.cli_commands"): "start-up: the commands are imported once the "
                                                              "arguments are good",
    # the staged API's module is also the guide's one-call prepare, which builds on the staged calls
    ("qcompiler.quantization.prepare", "qcompiler.quantization.prepare_one_call"): "a cycle: prepare_one_call "
                                                                                  "calls prepare_qat_fx",
    # torchao is optional: its quantizer module imports only when BPUQuantizer is asked for
    ("qcompiler.pt2e", "qcompiler.pt2e.quantizer"): "optional dependency: a ConfigError naming "
                                                    "`pip install qcompiler[pt2e]` without torchao",
}

# Modules imported lazily by name (importlib) under an older public path: module -> targets' layer.
LAZY_REEXPORTS = {"qcompiler.quantization": "workflow"}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    local: bool  # inside a function or class body


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if pkg == "qcompiler" and parts[0] in ("passes", "backends", "tools"):
                continue  # symlinked sub-package folders in a worktree
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = f
    return mods


def _resolve(base: str, names: list[str], mods: dict[str, Path]) -> list[str]:
    """``from base import a, b``: the submodules named, else ``base`` itself."""
    out = [f"{base}.{n}" if f"{base}.{n}" in mods else base for n in names]
    return list(dict.fromkeys(out))


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names if a.name.split(".")[0] == "qcompiler"]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - child.level + 1]
                    base = ".".join(pkg + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                targets = (_resolve(base, [a.name for a in child.names], mods)
                           if base.split(".")[0] == "qcompiler" else [])
            else:
                targets = []
            found.extend(Import(name, t, child.lineno, local) for t in targets)
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(tree, False)
    return found


def _with_parents(target: str, source: str, mods: dict[str, Path]) -> list[str]:
    """``target`` and the packages importing it runs (not the root, not the source's own packages)."""
    parts = target.split(".")
    out = [target]
    for k in range(2, len(parts)):
        pkg = ".".join(parts[:k])
        if pkg in mods and not source.startswith(pkg + ".") and pkg != source:
            out.append(pkg)
    return out


def layer_of(module: str) -> str:
    key = "qcompiler.__init__" if module == "qcompiler" else module
    best, best_len = None, -1
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (key == p or key.startswith(p + ".")) and len(p) > best_len:
                best, best_len = layer, len(p)
    if best is None:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS in tests/test_layering.py")
    return best


RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def build_graph():
    """``(modules, every import, graph of the module-level imports with the packages they run)``."""
    mods = _modules()
    all_imports = [i for name, path in mods.items() for i in _imports(name, path, mods)]
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for imp in all_imports:
        if not imp.local:
            for t in _with_parents(imp.target, imp.source, mods):
                g.add_edge(imp.source, t, line=imp.line)
    return mods, all_imports, g


def cycles(g: nx.DiGraph) -> list[list[str]]:
    found = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    return found + [[n] for n in g if g.has_edge(n, n)]


def upward(g: nx.DiGraph) -> list[str]:
    return [f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)}) at line {d['line']}"
            for a, b, d in g.edges(data=True) if RANK[layer_of(b)] > RANK[layer_of(a)]]


def hidden(imports: list[Import]) -> list[str]:
    return [f"{i.source}:{i.line} imports {i.target}" for i in imports
            if i.local and (i.source, i.target) not in ALLOWED_LOCAL_IMPORTS]


@pytest.fixture(scope="module")
def graph():
    return build_graph()


def test_every_module_has_a_layer(graph):
    mods, _, _ = graph
    for m in mods:
        layer_of(m)


def test_no_import_cycles(graph):
    _, _, g = graph
    assert not cycles(g), f"import cycles: {cycles(g)}"


def test_imports_point_downward(graph):
    _, _, g = graph
    assert not upward(g), "imports that point up the layers:\n" + "\n".join(upward(g))


def test_no_hidden_imports(graph):
    """A function-level qcompiler import hides a dependency (or a cycle); each needs a reason here."""
    _, imports, _ = graph
    assert not hidden(imports), "function-level imports of qcompiler modules:\n" + "\n".join(hidden(imports))


def test_allow_list_is_current(graph):
    _, imports, _ = graph
    used = {(i.source, i.target) for i in imports if i.local}
    stale = set(ALLOWED_LOCAL_IMPORTS) - used
    assert not stale, f"allow-listed imports that no longer exist: {sorted(stale)}"


def test_lazy_reexports_point_to_their_layer():
    """``qcompiler.quantization.prepare_qat_fx`` (the guide's path) resolves to the workflow layer."""
    import qcompiler.quantization as q

    for pkg, layer in LAZY_REEXPORTS.items():
        assert pkg == "qcompiler.quantization"
        for name, module in q.WORKFLOW.items():
            assert layer_of(module) == layer, (name, module)
            assert getattr(q, name) is getattr(sys.modules[module], name)


def test_no_submodule_shadows_a_name_of_its_package(graph):
    """``from pkg import x`` must not silently bind the submodule ``pkg.x`` instead of pkg's function x."""
    mods, _, _ = graph
    clashes = []
    for pkg, path in mods.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        clashes += [f"{pkg}.{d}" for d in defined if f"{pkg}.{d}" in mods]
    assert not clashes, f"submodules that share a name with their package's function/class/constant: {clashes}"


@pytest.mark.parametrize("module", ["qcompiler.quantization.observer", "qcompiler.backends.onnx.rules",
                                    "qcompiler.tools.cli", "qcompiler.backends.bpu.sim"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    """Any module can be the first one imported (the order the root happens to use hides nothing)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _fake_package(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    pkg = tmp_path / "qcompiler"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setitem(PACKAGE_DIRS, "qcompiler", pkg)
    for k in ("qcompiler.passes", "qcompiler.backends", "qcompiler.tools"):
        monkeypatch.delitem(PACKAGE_DIRS, k, raising=False)


def test_checks_catch_a_hidden_cycle(tmp_path, monkeypatch):
    """A cycle closed inside a function is a hidden import; hoisted, it is a cycle."""
    b_local = "def g():\n    from qcompiler.compiled import f\n    return f\n"
    _fake_package(tmp_path, monkeypatch, {"compiled.py": "from qcompiler.errors import g\n\ndef f():\n    return g()\n",
                                          "errors.py": b_local})
    _, imports, g = build_graph()
    assert hidden(imports) == ["qcompiler.errors:2 imports qcompiler.compiled"]
    assert not cycles(g)
    _fake_package(tmp_path, monkeypatch, {"errors.py": "from qcompiler.compiled import f\n"})
    _, imports, g = build_graph()
    assert not hidden(imports) and cycles(g) == [["qcompiler.compiled", "qcompiler.errors"]]
    assert upward(g) == ["qcompiler.errors (core) imports qcompiler.compiled (facade) at line 1"]


def test_checks_catch_a_package_init_cycle(tmp_path, monkeypatch):
    """``import qcompiler.p.leaf`` runs ``qcompiler/p/__init__``: an init that imports its importer is a cycle."""
    _fake_package(tmp_path, monkeypatch, {"p/__init__.py": "from qcompiler.q import x\n", "p/leaf.py": "",
                                          "q.py": "from qcompiler.p.leaf import y\n"})
    _, _, g = build_graph()
    assert cycles(g) == [["qcompiler.p", "qcompiler.q"]]


def _declared_packages() -> tuple[list[str], dict[str, str]]:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setup["packages"], setup["package-dir"]


def test_pyproject_lists_every_package_and_its_folder():
    """A wheel holds only the packages pyproject.toml names: every folder with an __init__.py is listed."""
    packages, dirs = _declared_packages()
    assert {k: str(ROOT / v) for k, v in dirs.items()} == {k: str(v) for k, v in PACKAGE_DIRS.items()}
    found = set()
    for pkg, folder in PACKAGE_DIRS.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            name = ".".join((pkg, *rel.parts))
            # a worktree's qcompiler/passes symlink is the passes folder, found under its own mapping
            owner = max((p for p in PACKAGE_DIRS if name == p or name.startswith(p + ".")), key=len)
            if owner == pkg:
                found.add(name)
    assert sorted(found) == sorted(packages)
