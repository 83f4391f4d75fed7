"""Random KV caches the test process and its peer processes can both rebuild from a seed."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

SMALL = {"num_layers": 3, "num_blocks": 24, "block_size": 4, "num_kv_heads": 2, "head_size": 8}


def make_kv_cache(spec: dict[str, Any]) -> torch.Tensor:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` of seeded random values."""
    shape = (
        spec["num_layers"],
        2,
        spec["num_blocks"],
        spec["block_size"],
        spec["num_kv_heads"],
        spec["head_size"],
    )
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    return torch.randn(shape, generator=gen).to(getattr(torch, spec.get("dtype", "float32")))


def digest(kv_cache: torch.Tensor, block_ids: list[int]) -> str:
    """sha256 of the blocks' bytes, all layers, in the given order."""
    blocks = kv_cache[:, :, block_ids].contiguous()
    return hashlib.sha256(blocks.view(torch.uint8).numpy().tobytes()).hexdigest()


def hashes(prefix: str, count: int) -> list[bytes]:
    """``count`` distinct fake block hashes (only their identity matters to the transfer layer)."""
    return [hashlib.sha256(f"{prefix}/{i}".encode()).digest() for i in range(count)]
