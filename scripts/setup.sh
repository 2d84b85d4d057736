#!/usr/bin/env bash
# Set up qcompiler on a fresh machine: the graphviz binary (for SVG graph dumps;
# optional, dumps fall back to .dot without it) and the package with its test extras.
# torch is pinned to 2.13.0 (CPU build) in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "setup: installing graphviz (dot) with apt-get" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
      || echo "setup: could not install graphviz; graph dumps will write .dot files only" >&2
  else
    echo "setup: graphviz 'dot' not found; install it (apt-get install graphviz) for SVG dumps" >&2
  fi
fi

PIP_ROOT_USER_ACTION=ignore python -m pip install -q --disable-pip-version-check -e '.[dev]'
python -c "import qcompiler, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
