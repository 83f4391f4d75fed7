"""Launch-time checks shared by the Triton wrappers: fail with a clear message before a bad launch.

A Triton kernel reads raw pointers, so a wrong shape or stride does not raise: it reads garbage or
writes out of bounds. Every wrapper calls these first. Nothing here synchronizes with the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The model's dtype, or 8 bits (``--kv-cache-dtype fp8`` / ``fp8_e5m2``: ``pdserve_kernels.reference.FP8_CACHES``).
CACHE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_kv_layer(kv_layer: Tensor) -> None:
    """``kv_layer`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]`` with a unit last stride."""
    assert kv_layer.dim() == 5 and kv_layer.shape[0] == 2, (
        f"kv_layer must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(kv_layer.shape)}"
    )
    assert kv_layer.dtype in CACHE_DTYPES, f"unsupported cache dtype {kv_layer.dtype}"
    assert kv_layer.stride(-1) == 1, "kv_layer's head_size dimension must be contiguous"


def check_kv_cache(kv_cache: Tensor) -> None:
    """``kv_cache`` is a contiguous ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``."""
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, (
        f"kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size], "
        f"got {tuple(kv_cache.shape)}"
    )
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous (a slice of whole layers is)"


def check_index(name: str, t: Tensor, length: int | None = None, device: torch.device | None = None) -> None:
    assert t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}"
    assert t.dtype in INDEX_DTYPES, f"{name} must be int32 or int64, got {t.dtype}"
    assert t.is_contiguous(), f"{name} must be contiguous"
    if length is not None:
        assert t.shape[0] == length, f"{name} has {t.shape[0]} entries, expected {length}"
    if device is not None:
        assert t.device == device, f"{name} is on {t.device}, expected {device}"


def check_block_tables(block_tables: Tensor, num_seqs: int, device: torch.device) -> None:
    assert block_tables.dim() == 2 and block_tables.shape[0] >= num_seqs, (
        f"block_tables must be [num_seqs >= {num_seqs}, max_num_blocks], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype in INDEX_DTYPES, f"block_tables must be int32 or int64, got {block_tables.dtype}"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert block_tables.device == device, f"block_tables is on {block_tables.device}, expected {device}"


def check_heads(query: Tensor, kv_layer: Tensor, latent: bool = False) -> tuple[int, int, int]:
    """Returns ``(num_heads, num_kv_heads, head_size)`` after checking ``query`` against the cache; ``head_size``
    is the cache's (``latent``: half the queries', ``pdserve_kernels.reference``)."""
    assert query.dim() == 3, f"query must be [tokens, num_heads, head_size], got {tuple(query.shape)}"
    assert query.dtype in FLOAT_DTYPES, f"unsupported query dtype {query.dtype}"
    assert query.stride(-1) == 1, "query's head_size dimension must be contiguous"
    assert query.device == kv_layer.device, f"query is on {query.device}, cache on {kv_layer.device}"
    num_heads, head_size = query.shape[1], query.shape[2] // (2 if latent else 1)
    num_kv_heads = kv_layer.shape[3]
    assert kv_layer.shape[4] == head_size and query.shape[2] == head_size * (2 if latent else 1), (
        f"query head_size {query.shape[2]} != cache head_size {kv_layer.shape[4]}{' x 2 (latent)' if latent else ''}")
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of {num_kv_heads}"
    assert head_size >= 16, f"head_size {head_size} is below the 16 that tensor-core dots need"
    return num_heads, num_kv_heads, head_size


def check_out(out: Tensor, query: Tensor) -> None:
    assert out.shape == query.shape, f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}"
    assert out.dtype in FLOAT_DTYPES, f"unsupported out dtype {out.dtype}"
    assert out.stride(-1) == 1, "out's head_size dimension must be contiguous"
    assert out.device == query.device, f"out is on {out.device}, query on {query.device}"


def check_block_n(block_n: int) -> None:
    """A key-tile width a compiled kernel takes: a power of two, at least 16 (``tl.dot``'s least)."""
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"


def check_sinks(sinks: Tensor | None, num_heads: int, device: torch.device) -> None:
    """Attention sinks, where given: one float logit per query head, contiguous, on the queries' device."""
    if sinks is None:
        return
    assert sinks.shape == (num_heads,) and sinks.is_floating_point() and sinks.stride(0) == 1, (
        f"sinks must be a float [{num_heads}] (one logit per query head), got {sinks.dtype} {tuple(sinks.shape)}")
    assert sinks.device == device, f"sinks are on {sinks.device}, the queries on {device}"
