"""Block hashes: sha256 over a canonical, type-tagged encoding; one function for every process.

A block's hash covers its parent's hash, its token ids and the extra keys (model identity, cache
salt), so equal hashes mean equal KV for the same model and tenant. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

HASH_SCHEME = "sha256-v1"
_DOMAIN = b"pdserve/block-hash/v1"


def _tagged_str(tag: bytes, value: str) -> bytes:
    raw = value.encode("utf-8")
    return tag + struct.pack("<I", len(raw)) + raw


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash one full block given its parent's hash (``None`` for the first block)."""
    h = hashlib.sha256(_DOMAIN)
    if parent is None:
        h.update(b"P\x00")
    else:
        h.update(b"P\x01" + struct.pack("<I", len(parent)) + parent)
    h.update(b"T" + struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(b"X" + struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        h.update(_tagged_str(b"S", key))
    return BlockHash(h.digest())


def extra_keys_for(model_id: str, cache_salt: str | None) -> tuple[str, ...]:
    return (model_id,) if cache_salt is None else (model_id, cache_salt)


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` when ``start > 0``; this lets a growing
    sequence hash only its newly filled blocks.
    """
    extra = extra_keys_for(model_id, cache_salt)
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start, num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
