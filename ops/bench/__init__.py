"""``pdserve bench offline|kv|serve|gpu|chaos|overhead|fuzz|structured|kv-dtype|spec|lora|tp|mla|images|window|offload|quantized-weights``: benchmarks that print measured figures beside baselines."""

from __future__ import annotations

import importlib

_BENCHES = {
    "offline": "ops.bench.offline",
    "kv": "ops.bench.kv_transfer_bench",
    "serve": "ops.bench.serve",
    "gpu": "ops.bench.gpu_kernels",
    "chaos": "ops.bench.chaos",
    "overhead": "ops.bench.overhead",
    "fuzz": "ops.bench.fuzz",
    "structured": "ops.bench.structured",
    "kv-dtype": "ops.bench.kv_dtype",
    "spec": "ops.bench.spec_decode",
    "lora": "ops.bench.lora",
    "tp": "ops.bench.tensor_parallel",
    "mla": "ops.bench.mla",
    "images": "ops.bench.images",
    "window": "ops.bench.window",
    "offload": "ops.bench.offload",
    "quantized-weights": "ops.bench.quantized_weights",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] not in _BENCHES:
        print(f"usage: pdserve bench {{{','.join(_BENCHES)}}} [options]")
        return 2
    module = importlib.import_module(_BENCHES[argv[0]])
    return int(module.main(argv[1:]) or 0)
