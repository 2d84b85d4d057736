#!/usr/bin/env bash
# Install qcompiler beside other torch releases and Pythons, each in a throwaway virtualenv, and run
# the smoke subset there: the main job (compile, dumps, ONNX export), save/load, bit-exactness, CLI.
#
#   bash scripts/compat.sh [PYTHON:TORCH ...]      default: the oldest and newest supported releases
#   bash scripts/compat.sh 3.11:2.12.1 3.13:2.15.0
#
# For each pair it checks that `pip install` of the project keeps the torch already there (the
# package declares a range, not a pin), then runs the smoke tests and the README's main job. Each
# venv lives under $COMPAT_DIR (default /tmp/qcompiler-compat) and is removed afterwards unless
# COMPAT_KEEP=1. Where no CPU build of a release exists (most releases on Linux x86_64, on PyPI),
# the venv gets PyPI's CUDA build, several GB. A pip config that caps torch (a `constraint` file)
# applies here too; run with PIP_CONFIG_FILE=/dev/null to ignore it.
# Prints one line per pair and exits non-zero if any pair failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
COMPAT_DIR=${COMPAT_DIR:-/tmp/qcompiler-compat}
PAIRS=("$@")
[ ${#PAIRS[@]} -gt 0 ] || PAIRS=(3.11:2.12.1 3.13:2.15.0)

SMOKE_TESTS=(
  tests/test_compile.py          # compile(): partitions, simulator vs onnxruntime islands
  tests/test_export_onnx.py      # the opset-11 export and its sidecar
  tests/test_export_exact.py     # the integer ONNX export equals the simulator bit for bit
  tests/test_bpu_reference.py    # the simulator's kernels against the exact reference
  tests/test_artifact_security.py  # save / load of compiled artifacts
  tests/test_cli.py              # the command line
)

pip_in() {  # pip_in VENV ARGS...: quiet pip inside the venv
  PIP_ROOT_USER_ACTION=ignore "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}"
}

find_python() {  # find_python 3.12: an interpreter of that version (on PATH, else one pyenv installed)
  if "python$1" -c "" 2>/dev/null; then echo "python$1"; return; fi
  local found
  found=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$1".*/bin/"python$1" 2>/dev/null | tail -1)
  [ -n "$found" ] && echo "$found"
}

run_pair() {  # run_pair PY TORCH LOG
  local py=$1 torch=$2 log=$3 venv="$COMPAT_DIR/py$1-torch$2" python
  rm -rf "$venv"
  python=$(find_python "$py") || true
  [ -n "$python" ] || { echo "no python$py on this machine"; return 1; }
  "$python" -m venv "$venv" || { echo "python$py cannot make a venv"; return 1; }
  pip_in "$venv" --upgrade pip || return 1
  # the CPU build where one exists: local wheels, then PyTorch's CPU index, then PyPI
  pip_in "$venv" --no-index "torch==$torch" 2>/dev/null \
    || pip_in "$venv" --index-url https://download.pytorch.org/whl/cpu --timeout 20 --retries 1 "torch==$torch" \
         2>/dev/null \
    || pip_in "$venv" "torch==$torch" || { echo "cannot install torch $torch for Python $py"; return 1; }
  local before; before=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  pip_in "$venv" -e "$ROOT[dev]" || { echo "pip install of the project failed"; return 1; }
  local after; after=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  if [ "$before" != "$after" ]; then echo "pip install replaced torch $before with $after"; return 1; fi
  echo "torch $after, $("$venv/bin/python" --version)"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${SMOKE_TESTS[@]}" || return 1
  local out="$venv/out"
  "$venv/bin/qcompiler" compile zoo:resnet18 --input-shape 1,3,64,64 --march bayes --out "$out" || return 1
  ls "$out"/*.onnx >/dev/null || { echo "the main job wrote no ONNX file"; return 1; }
}

mkdir -p "$COMPAT_DIR"
failed=0
summary=()
for pair in "${PAIRS[@]}"; do
  py=${pair%%:*} torch=${pair#*:}
  log="$COMPAT_DIR/py$py-torch$torch.log"
  echo "compat: Python $py, torch $torch (log: $log)" >&2
  start=$(date +%s)
  if run_pair "$py" "$torch" "$log" >"$log" 2>&1; then status=ok; else status=FAILED; failed=1; fi
  summary+=("$(printf '%-8s %-8s %-7s %5ss  %s' "$py" "$torch" "$status" $(( $(date +%s) - start )) \
    "$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)")")
  # the editable install in the venv points at this checkout; the checkout's own install is untouched
  [ "${COMPAT_KEEP:-0}" = 1 ] || rm -rf "$COMPAT_DIR/py$py-torch$torch"
done
printf 'python   torch    result    time  tests\n'
printf '%s\n' "${summary[@]}"
exit $failed
