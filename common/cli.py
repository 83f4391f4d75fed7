"""The ``pdserve`` command: one entry point for every service, the offline engine and benchmarks.

    pdserve up [--prefill N] [--decode M]     the whole local stack (Redis, router, engines)
    pdserve router | prefill | decode ...     one service
    pdserve generate --prompt TEXT ...        offline generation in this process
    pdserve bench offline|serve|kv|gpu|chaos|overhead|fuzz|structured|kv-dtype|spec ...   benchmarks
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "up": ("ops.launcher", "main"),
    "router": ("router.main", "main"),
    "prefill": ("prefill_svc.main", "main"),
    "decode": ("decode_svc.main", "main"),
    "generate": ("common.generate", "main"),
    "bench": ("ops.bench", "main"),
}


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
