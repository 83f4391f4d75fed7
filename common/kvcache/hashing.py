"""Block hashes: sha256 over a canonical, type-tagged encoding; one function for every process.

A block's hash covers its parent's hash, its token ids and the extra keys (model identity, cache
salt) and, for a block that holds a position of a prompt's image, that image's digest and offset, so
equal hashes mean equal KV for the same model and tenant. Only full blocks are hashed.
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


# A block's bytes, after the domain: its parent (``_parent_part``), its tokens (``T``, their count,
# each as int64) and the extra keys (``_keys_part``).
_SEEDED = hashlib.sha256(_DOMAIN)  # copied for each block: the domain is not hashed again


def _parent_part(parent: BlockHash | None) -> bytes:
    return b"P\x00" if parent is None else b"P\x01" + struct.pack("<I", len(parent)) + parent


def _keys_part(extra_keys: Sequence[str]) -> bytes:
    return b"X" + struct.pack("<I", len(extra_keys)) + b"".join(_tagged_str(b"S", key) for key in extra_keys)


# An image a block's positions reach into: its first position and ``common.protocol.image_digest``.
ImageSpan = tuple[int, int, str]  # offset, length, digest (64 hex digits)


def _images_part(images: Sequence[tuple[int, str]]) -> bytes:
    return b"I" + struct.pack("<I", len(images)) + b"".join(
        struct.pack("<Q", offset) + bytes.fromhex(digest) for offset, digest in images)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash one full block given its parent's hash (``None`` for the first block)."""
    h = _SEEDED.copy()
    n = len(token_ids)
    h.update(_parent_part(parent) + b"T" + struct.pack(f"<I{n}q", n, *token_ids) + _keys_part(extra_keys))
    return BlockHash(h.digest())


def adapter_model_key(model_id: str, lora_name: str | None) -> str:
    """The model identity a request's blocks are hashed under: the base model's, or, for a request with a
    LoRA adapter (whose KV differs from the base model's), the adapter's under it."""
    return model_id if lora_name is None else f"{model_id}\x00lora\x00{lora_name}"


def extra_keys_for(model_id: str, cache_salt: str | None) -> tuple[str, ...]:
    return (model_id,) if cache_salt is None else (model_id, cache_salt)


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
    images: Sequence[ImageSpan] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` when ``start > 0``; this lets a growing
    sequence hash only its newly filled blocks.

    The bytes hashed per block are ``hash_block_tokens``' own, put together with less work: the
    tokens of every block packed in one call, the extra keys' encoding made once (every request's
    prompt and every routed prompt go through here).

    ``images``: the prompt's images' spans; a block holding a position of one hashes its offset and digest
    too (after the extra keys; a block of text alone is hashed as without them).
    """
    num_full = len(token_ids) // block_size
    if num_full <= start:
        return []
    tail = _keys_part(extra_keys_for(model_id, cache_salt))
    head = b"T" + struct.pack("<I", block_size)
    lo, hi = start * block_size, num_full * block_size
    packed = struct.pack(f"<{hi - lo}q", *token_ids[lo:hi])
    width = 8 * block_size
    hashes: list[BlockHash] = []
    for index, offset in enumerate(range(0, len(packed), width), start=start):
        h = _SEEDED.copy()
        block_tail = tail
        if images:
            first = index * block_size
            reached = [(o, d) for o, n, d in images if o < first + block_size and first < o + n]
            if reached:
                block_tail = tail + _images_part(reached)
        h.update(_parent_part(parent) + head + packed[offset : offset + width] + block_tail)
        parent = BlockHash(h.digest())
        hashes.append(parent)
    return hashes
