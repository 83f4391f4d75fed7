"""The flags of the benchmarks that run engines in their own process (``pdserve bench window``, ``offload``)."""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from typing import Any

import torch


def add_engine_args(parser: argparse.ArgumentParser, num_blocks: int, max_num_batched_tokens: int,
                    num_blocks_help: str = "KV blocks of the pool") -> None:
    """The model, the engine's pool and step, its device and dtype, the seed and the JSON path."""
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                        help="tokens a step computes at most")
    parser.add_argument("--num-blocks", type=int, default=num_blocks, help=num_blocks_help)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")


def result_header(bench: str, argv: list[str] | None, device: str) -> dict[str, Any]:
    """A result's first keys: the date, the command that made it and what it ran on."""
    return {
        "date": dt.date.today().isoformat(),
        "command": f"pdserve bench {bench} " + " ".join(argv or []),
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "device": device,
                        "torch_threads": torch.get_num_threads()},
    }
