"""The ``pdserve`` command: one entry point for every service, the offline engine and benchmarks.

    pdserve up [--prefill N] [--decode M]     the whole local stack (Redis, router, engines)
    pdserve router | prefill | decode ...     one service
    pdserve generate --prompt TEXT ...        offline generation in this process
    pdserve bench offline|serve|kv|gpu|chaos|overhead|fuzz|structured|kv-dtype|spec|lora|images ...   benchmarks
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

_COMMANDS = {
    "up": ("ops.launcher", "main"),
    "router": ("router.main", "main"),
    "prefill": ("prefill_svc.main", "main"),
    "decode": ("decode_svc.main", "main"),
    "generate": ("common.generate", "main"),
    "bench": ("ops.bench", "main"),
}


def json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's value read as a JSON object (vLLM's JSON flags); ``ValueError`` naming the flag otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


HF_OVERRIDES_HELP = (
    "vLLM's flag: a JSON object of keys set over the model's config.json (top level), e.g. to serve a causal "
    'LM reranker as a classifier: {"architectures": ["Qwen3ForSequenceClassification"], '
    '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}. Every engine and router of '
    "a deployment needs the same")


def hf_overrides_arg(text: str) -> dict[str, Any]:
    try:
        return json_object(text, "--hf-overrides")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = _COMMANDS[argv[0]]
    result = getattr(importlib.import_module(module), func)(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
