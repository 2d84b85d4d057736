#!/usr/bin/env bash
# Set up qcompiler on a fresh machine: the graphviz binary (for SVG graph dumps;
# optional, dumps fall back to .dot without it), Chromium (for the HTML report's
# browser test; optional, the test skips without it) and the package with its test extras.
# torch: pyproject.toml declares the supported range; a torch already installed inside it is kept,
# otherwise scripts/torch_cpu.py installs one, the CPU build where one exists.
set -euo pipefail
cd "$(dirname "$0")/.."

can_apt() { command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; }
apt_updated=0
apt_install() {  # apt_install PACKAGE: update the package lists once, then install quietly
  if [ "$apt_updated" = 0 ]; then apt-get update -qq || return 1; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}

if ! command -v dot >/dev/null 2>&1; then
  if can_apt; then
    echo "setup: installing graphviz (dot) with apt-get" >&2
    apt_install graphviz || echo "setup: could not install graphviz; graph dumps will write .dot files only" >&2
  else
    echo "setup: graphviz 'dot' not found; install it (apt-get install graphviz) for SVG dumps" >&2
  fi
fi

# headless Chromium renders report.html in tests/test_report_browser.py (skipped without it)
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1; then
  if can_apt; then
    echo "setup: installing chromium with apt-get (for the report's browser test)" >&2
    apt_install chromium || echo "setup: could not install chromium; the browser test will be skipped" >&2
  else
    echo "setup: chromium not found; install it (apt-get install chromium) to run the report's browser test" >&2
  fi
fi

python scripts/torch_cpu.py
PIP_ROOT_USER_ACTION=ignore python -m pip install -q --disable-pip-version-check -e '.[dev]'
# torchao for the PT2E tests (tests/test_pt2e.py; optional for users: pip install qcompiler[pt2e]). --no-deps:
# it must keep the torch installed above
PIP_ROOT_USER_ACTION=ignore python -m pip install -q --disable-pip-version-check --no-deps 'torchao>=0.18,<0.20' \
  || echo "setup: could not install torchao; the PT2E tests will be skipped" >&2
python -c "import qcompiler" && python scripts/torch_cpu.py --check
