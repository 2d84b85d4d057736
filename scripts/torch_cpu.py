"""Get a torch inside the range pyproject.toml declares, as the CPU build where one exists.

``python scripts/torch_cpu.py`` keeps an installed torch that is inside the range (a user installs
the compiler beside the torch their model already uses); otherwise it installs one, trying in turn

1. pip's own wheel sources without an index (``--no-index``: the ``find-links`` a machine's pip
   config names, where an admin keeps the CPU wheel),
2. PyTorch's CPU index (``https://download.pytorch.org/whl/cpu``),
3. PyPI -- whose Linux x86_64 wheel is the CUDA build (several GB of nvidia-* packages), so this
   last step says so; on other platforms PyPI's wheel is the CPU build.

``python scripts/torch_cpu.py --check`` (after the package is installed) fails unless torch
imports and is inside the range, and warns on a CUDA build.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_CLAUSE = re.compile(r"\s*(>=|<=|==|<|>)\s*([0-9][0-9.]*)\s*$")


def torch_requirement() -> str:
    """The ``torch...`` requirement string of pyproject.toml's dependencies."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [d for d in deps if re.match(r"torch\s*[<>=]", d)]
    if len(found) != 1:
        sys.exit(f"torch_cpu: expected one torch requirement in pyproject.toml, found {found}")
    return found[0].replace(" ", "")


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)`` (the local label and pre-release tags do not count)."""
    return tuple(int(p) for p in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split("."))


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def in_range(version: str, requirement: str) -> bool:
    """Whether ``version`` satisfies ``requirement`` (comma-separated ``>= <= == < >`` clauses)."""
    v = _release(version)
    for clause in requirement[len("torch"):].split(","):
        m = _CLAUSE.match(clause)
        if m is None:
            sys.exit(f"torch_cpu: cannot read the clause {clause!r} of {requirement!r}")
        c = _cmp(v, _release(m.group(2)))
        ok = {">=": c >= 0, "<=": c <= 0, "==": c == 0, "<": c < 0, ">": c > 0}[m.group(1)]
        if not ok:
            return False
    return True


def installed() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(*args: str) -> bool:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore")
    return subprocess.run(cmd, env=env).returncode == 0


def ensure() -> None:
    req = torch_requirement()
    have = installed()
    if have is not None and in_range(have, req):
        print(f"torch_cpu: keeping the installed torch {have} ({req})", file=sys.stderr)
        return
    if have is not None:
        print(f"torch_cpu: installed torch {have} is outside {req}; replacing it", file=sys.stderr)
    print(f"torch_cpu: installing {req} from pip's local wheels (--no-index)", file=sys.stderr)
    if _pip("--no-index", req):
        return
    print(f"torch_cpu: trying PyTorch's CPU index {CPU_INDEX}", file=sys.stderr)
    if _pip("--index-url", CPU_INDEX, "--timeout", "20", "--retries", "1", req):
        return
    if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
        print(f"torch_cpu: no CPU build of {req} reachable (local wheels, {CPU_INDEX}); installing PyPI's "
              "CUDA build, several GB", file=sys.stderr)
    if not _pip(req):
        sys.exit(f"torch_cpu: could not install {req}")


def check() -> None:
    req = torch_requirement()
    import torch  # noqa: PLC0415 -- only after the install

    if not in_range(torch.__version__, req):
        sys.exit(f"torch_cpu: torch {torch.__version__} is outside the supported {req}")
    if torch.version.cuda is not None:
        print(f"torch_cpu: torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda}); "
              "qcompiler runs on the CPU and needs none of it", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check the installed torch instead of installing")
    args = parser.parse_args()
    check() if args.check else ensure()


if __name__ == "__main__":
    main()
