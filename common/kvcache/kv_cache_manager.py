"""Per-request block tables over a ``BlockPool``: prefix hits, slot allocation, copy-on-write, free.

Pure bookkeeping over block ids; the runner turns it into tensors.
"""

from __future__ import annotations

from typing import Protocol

from common.kvcache.block_pool import BlockPool, KVBlock
from common.kvcache.hashing import BlockHash


class SequenceLike(Protocol):
    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}
        # (src, dst) block copies the runner must do before the next forward (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, seq: SequenceLike) -> tuple[list[KVBlock], int]:
        """Leading cached blocks of ``seq`` and how many tokens they cover; does not take them.

        At most ``num_tokens - 1`` tokens are reported, so the last token is always computed
        (its logits are needed).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        return self.cdiv(num_tokens) <= self.pool.num_blocks

    def allocate_slots(
        self, seq: SequenceLike, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens; False (nothing changed) if short.

        ``computed_blocks`` (prefix hits from ``get_computed_blocks``) are taken first. If the
        next token lands in a block shared with another sequence, that block is copied first.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(seq.request_id, [])
        num_have = len(blocks) + len(computed_blocks)
        num_needed = self.cdiv(seq.num_computed_tokens + num_new_tokens) - num_have
        write_idx = seq.num_computed_tokens // self.block_size
        cow = (
            seq.num_computed_tokens % self.block_size != 0
            and write_idx < len(blocks)
            and blocks[write_idx].ref_cnt > 1
        )
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + int(cow) + num_evictable_hits > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = blocks + computed_blocks
        if cow:
            shared = blocks[write_idx]
            (copy,) = self.pool.get_new_blocks(1)
            self.pending_copies.append((shared.block_id, copy.block_id))
            self.num_cow_copies += 1
            self.pool.free_blocks([shared])
            blocks = blocks[:write_idx] + [copy] + blocks[write_idx + 1 :]
        if num_needed > 0:
            blocks = blocks + self.pool.get_new_blocks(num_needed)
        self.req_blocks[seq.request_id] = blocks
        return True

    def cache_blocks(self, seq: SequenceLike) -> None:
        """Register ``seq``'s newly full, computed blocks under their hashes."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(seq.request_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(blocks))
        start = self._num_hashed.get(seq.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], seq.block_hashes[i])
        self._num_hashed[seq.request_id] = max(start, num_full)

    def fork(self, parent: SequenceLike, child: SequenceLike) -> None:
        """``child`` shares all of ``parent``'s blocks (copy-on-write on its first divergent write)."""
        blocks = list(self.req_blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first so its head stays cached longest. Idempotent."""
        blocks = self.req_blocks.pop(request_id, [])
        self._num_hashed.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self) -> None:
        holders: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        self.pool.check_integrity(holders)
