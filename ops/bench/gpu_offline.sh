#!/usr/bin/env bash
# `pdserve bench gpu` (ops/bench/gpu_kernels.py) on an offline CUDA host whose Python already has torch,
# triton, transformers, numpy, safetensors and nvidia-ml-py, but not this project's other dependencies
# (the usual GPU image), from a copy of this tree, as one command.
#
#   where a package index is reachable:  bash ops/bench/gpu_offline.sh download .gpu-wheels [PYTHON_VERSION]
#       the wheels of what the check imports beyond those (msgspec, at the version in
#       ops/constraints.txt), for CPython PYTHON_VERSION (default 3.12) on x86-64 Linux (.gpu-wheels is
#       ignored by git: copy it along with the tree);
#   on the GPU host:                     bash ops/bench/gpu_offline.sh run .gpu-wheels OUT_DIR [gpu_kernels flags]
#       installs those wheels into a temporary folder, prints the versions it runs with, then runs
#       `pdserve bench overhead --device cuda` (the engine's step with a null forward, its sampler on the
#       GPU, over the default model's vocabulary, each decode case profiled operation by operation;
#       GPU_OVERHEAD_TIMEOUT_S, default 120 s; 0 skips it) and
#       the check (GPU_CHECK_TIMEOUT_S, default 420 s), each under its time limit. Their reports (the
#       check's saved after every section, so a run cut short keeps what it measured) and the whole log
#       land in OUT_DIR. The engine sections run on the default model where its package is installed,
#       else on a random-weight stand-in of the same shapes (its package is larger than a copy of this tree).
#
# PYTHON names the interpreter (default python3). Exit status: the check's (0: every check passed),
# 124 when the time limit cut it short.
set -uo pipefail

python=${PYTHON:-python3}  # the interpreter that has torch
mode=${1:-}
# Folders as the caller named them (resolved before moving to the tree's root).
[ -n "${2:-}" ] && set -- "$1" "$(realpath -m "$2")" "${@:3}"
[ -n "${3:-}" ] && [ "$mode" = run ] && set -- "$1" "$2" "$(realpath -m "$3")" "${@:4}"
cd "$(dirname "$0")/../.."
case "$mode" in
  download)
    dir=${2:?usage: gpu_offline.sh download WHEEL_DIR [PYTHON_VERSION]}
    pyver=${3:-3.12}
    pin=$(grep -E '^msgspec==' ops/constraints.txt) || { echo "msgspec is not pinned in ops/constraints.txt" >&2; exit 1; }
    mkdir -p "$dir"
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
    exec "$python" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
      "${platforms[@]}" -d "$dir" "$pin"
    ;;
  run)
    wheels=${2:?usage: gpu_offline.sh run WHEEL_DIR OUT_DIR [flags]}
    out=${3:?usage: gpu_offline.sh run WHEEL_DIR OUT_DIR [flags]}
    shift 3
    mkdir -p "$out"
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    if compgen -G "$wheels/*.whl" >/dev/null; then
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || exit 1
    fi
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    # The model cache (the default model converted, or the stand-in) outlives the run: a second run on
    # the same host does not build it again.
    export PDSERVE_CACHE_DIR=${PDSERVE_CACHE_DIR:-${TMPDIR:-/tmp}/pdserve-gpu-check-cache}
    unset TRITON_INTERPRET
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
      "$python" -c 'import sys, torch, triton, transformers, msgspec
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "msgspec", msgspec.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
      if [ "${GPU_OVERHEAD_TIMEOUT_S:-120}" != 0 ]; then
        # The null forward reads only a config: the default model's shapes, written beside the wheels.
        "$python" -c 'import sys; from transformers import LlamaConfig; from ops.bench.gpu_kernels import STAND_IN_DIMS
LlamaConfig(**STAND_IN_DIMS, tie_word_embeddings=False).save_pretrained(sys.argv[1])' "$site/config-only" &&
        timeout --signal=TERM --kill-after=20 "${GPU_OVERHEAD_TIMEOUT_S:-120}" \
          "$python" -m ops.bench.overhead --device cuda --model "$site/config-only" --samplers batched \
          --batch-sizes 1,64,256,512 --profile-steps 10 --json "$out/overhead-cuda.json"
        echo "[overhead] exit status $?"
      fi
      timeout --signal=TERM --kill-after=20 "${GPU_CHECK_TIMEOUT_S:-420}" \
        "$python" -m ops.bench.gpu_kernels --out-dir "$out" "$@"
    } 2>&1 | tee "$out/gpu-check.log"
    status=${PIPESTATUS[0]}
    exit "$status"
    ;;
  *)
    sed -n '2,21p' "$0" >&2
    exit 2
    ;;
esac
