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
        # The same tables as block ids, for the runner (see ``block_ids_view``).
        self._block_ids: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}
        # Slots holding KV, each counted once however many requests share its block: per block, how
        # many of its slots some holder has computed; kept as requests advance (``mark_computed``),
        # so the engine reads the total instead of walking every block each step.
        self._slot_fill = [0] * num_blocks
        self._num_marked: dict[str, int] = {}
        self.num_filled_slots = 0
        # (src, dst) block copies the runner must do before the next forward (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # When set (async scheduling), the block lists of requests freed since the last
        # ``take_freed``: a request freed while its step is still in flight may yet turn out to have
        # written NaN into them, and the engine scrubs what it can once it knows.
        self.keep_freed = False
        self._freed: dict[str, list[KVBlock]] = {}

    def cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy)."""
        return list(self._block_ids.get(request_id, ()))

    def block_ids_view(self, request_id: str) -> list[int]:
        """The request's block table itself, not to be mutated: new blocks are appended to this list,
        and any other change (copy-on-write, free) replaces it by another list, so a holder of an
        earlier one tells a grown table (same list, longer) from a rewritten one (another list)."""
        return self._block_ids.get(request_id, [])

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
        bs = self.block_size
        rid = seq.request_id
        num_computed = seq.num_computed_tokens
        blocks = self.req_blocks.get(rid, [])
        if blocks and not computed_blocks and num_computed + num_new_tokens <= len(blocks) * bs and (
            num_computed % bs == 0 or blocks[num_computed // bs].ref_cnt == 1
        ):
            return True  # a decode inside its last block: nothing to take, nothing to copy
        computed_blocks = computed_blocks or []
        num_have = len(blocks) + len(computed_blocks)
        num_needed = self.cdiv(num_computed + num_new_tokens) - num_have
        write_idx = num_computed // bs
        cow = num_computed % bs != 0 and write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + int(cow) + num_evictable_hits > self.pool.num_free_blocks:
            return False
        ids = self._block_ids.get(rid)
        if ids is None:
            ids = self._block_ids[rid] = []
            self._num_marked[rid] = num_computed
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = blocks + computed_blocks
            ids.extend(b.block_id for b in computed_blocks)
            for b in computed_blocks:  # cached, so full
                self._fill(b.block_id, bs)
        if cow:
            shared = blocks[write_idx]
            (copy,) = self.pool.get_new_blocks(1)
            self.pending_copies.append((shared.block_id, copy.block_id))
            self.num_cow_copies += 1
            self.pool.free_blocks([shared])
            blocks = blocks[:write_idx] + [copy] + blocks[write_idx + 1 :]
            ids = self._block_ids[rid] = [b.block_id for b in blocks]
            self._fill(copy.block_id, num_computed - write_idx * bs)
        if num_needed > 0:
            new_blocks = self.pool.get_new_blocks(num_needed)
            blocks = blocks + new_blocks
            ids.extend(b.block_id for b in new_blocks)
        self.req_blocks[rid] = blocks
        return True

    def _fill(self, block_id: int, num_slots: int) -> None:
        """Record that ``num_slots`` leading slots of a held block hold KV."""
        if num_slots > self._slot_fill[block_id]:
            self.num_filled_slots += num_slots - self._slot_fill[block_id]
            self._slot_fill[block_id] = num_slots

    def mark_computed(self, seq: SequenceLike) -> None:
        """After ``seq.num_computed_tokens`` advanced: count the slots it filled and cache its newly
        full blocks. O(blocks it advanced through), so a decode costs O(1)."""
        rid = seq.request_id
        start = self._num_marked.get(rid)
        end = seq.num_computed_tokens
        if start is None or end <= start:
            self.cache_blocks(seq)
            return
        bs = self.block_size
        ids = self._block_ids[rid]
        first = start // bs
        self._num_marked[rid] = end
        if end <= (first + 1) * bs:  # within one block (a decode step): no block filled unless this one
            block_id, num_slots, fill = ids[first], end - first * bs, self._slot_fill
            if num_slots > fill[block_id]:  # ``_fill``, inlined on the path of every decode
                self.num_filled_slots += num_slots - fill[block_id]
                fill[block_id] = num_slots
            if end == (first + 1) * bs:
                self.cache_blocks(seq)
            return
        fill, added = self._slot_fill, 0  # ``_fill`` of each block it advanced through, inlined
        for i in range(first, min(self.cdiv(end), len(ids))):
            block_id, num_slots = ids[i], min(bs, end - i * bs)
            if num_slots > fill[block_id]:
                added += num_slots - fill[block_id]
                fill[block_id] = num_slots
        self.num_filled_slots += added
        self.cache_blocks(seq)

    def cache_blocks(self, seq: SequenceLike) -> None:
        """Register ``seq``'s newly full, computed blocks under their hashes."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(seq.request_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(blocks))
        start = self._num_hashed.get(seq.request_id, 0)
        cache_full_block, hashes = self.pool.cache_full_block, seq.block_hashes
        for i in range(start, num_full):
            cache_full_block(blocks[i], hashes[i])
        self._num_hashed[seq.request_id] = max(start, num_full)

    def fork(self, parent: SequenceLike, child: SequenceLike) -> None:
        """``child`` shares all of ``parent``'s blocks (copy-on-write on its first divergent write)."""
        blocks = list(self.req_blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks
        self._block_ids[child.request_id] = [b.block_id for b in blocks]
        self._num_marked[child.request_id] = self._num_marked.get(parent.request_id, 0)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first so its head stays cached longest. Idempotent."""
        blocks = self.req_blocks.pop(request_id, [])
        if self.keep_freed and blocks:
            self._freed[request_id] = blocks
        self._block_ids.pop(request_id, None)
        self._num_marked.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))
        for b in blocks:
            if b.ref_cnt == 0:
                self.num_filled_slots -= self._slot_fill[b.block_id]
                self._slot_fill[b.block_id] = 0

    def take_freed(self) -> dict[str, list[KVBlock]]:
        """The block lists of the requests freed since the last call (only kept under ``keep_freed``),
        as they were when freed; their blocks may have been taken since."""
        freed, self._freed = self._freed, {}
        return freed

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self) -> None:
        holders: dict[int, int] = {}
        for request_id, blocks in self.req_blocks.items():
            assert self._block_ids.get(request_id) == [b.block_id for b in blocks], f"{request_id}: block ids differ"
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert set(self._block_ids) == set(self.req_blocks), "block ids kept for requests that hold no blocks"
        self.pool.check_integrity(holders)
        assert all(0 <= f <= self.block_size for f in self._slot_fill)
        assert all(self._slot_fill[i] == 0 for i in range(self.pool.num_blocks) if i not in holders), "fill of a free block"
        assert sum(self._slot_fill) == self.num_filled_slots, "filled-slot count drifted"
