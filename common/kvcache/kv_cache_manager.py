"""Per-request block tables over a ``BlockPool``: prefix hits, slot allocation, copy-on-write, free.

Pure bookkeeping over block ids; the runner turns it into tensors.

A model whose every layer sees only a window of keys (Mistral 7B v0.1, Phi-3, StarCoder2: ``ModelArch.kv_window``)
never reads a sequence's keys more than the window back again: ``release_out_of_window`` gives such leading
blocks back to the pool as the sequence advances (still cached, so a later prompt may hit them), as vLLM's
sliding-window manager does. Their places in the table stay, marked ``RELEASED``, and their ids point at the
sequence's first block still held, so the table keeps its positions and a kernel that reads a block it masks
out (the torch attention gathers whole blocks, then weighs the window's keys only) reads the sequence's own KV.

With a host tier (``num_host_blocks``, vLLM's ``--kv-offloading-size``: ``common/kvcache/host_tier.py``), a cached
block the pool takes back is copied to host memory first, and a prefix hit goes on past the device's cached blocks
into the host's: each such hit takes a device block and is loaded into it when the request takes its hits
(``allocate_slots``). The copies wait in ``host_copies``, in order, for the runner.
"""

from __future__ import annotations

from typing import Protocol

from common.kvcache.block_pool import BlockPool, KVBlock
from common.kvcache.hashing import BlockHash
from common.kvcache.host_tier import LOAD, SAVE, HostCopy, HostHit, HostTier


class SequenceLike(Protocol):
    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int: ...


# A place in a request's block list whose block went back to the pool (``release_out_of_window``). Never in
# the pool, never counted: every pool operation skips it.
RELEASED = KVBlock(-1)


def out_of_window(num_tokens: int, block_size: int, sliding_window: int) -> int:
    """How many leading blocks of a sequence no query at ``num_tokens`` or later reads, when each reads keys at most
    ``sliding_window - 1`` back: all but the last block at most."""
    return max(0, min((num_tokens - sliding_window + 1) // block_size, -(-num_tokens // block_size) - 1))


def max_blocks_held(num_tokens: int, block_size: int, sliding_window: int | None, max_step_tokens: int) -> int:
    """The most blocks a sequence of ``num_tokens`` tokens holds at once, in steps of ``max_step_tokens`` tokens
    at most: all of them, or with a window, those of the keys a step's queries read. Blocks go back a step late
    (``release_out_of_window`` goes by the step's first query), so a step holds the window of the step before
    it and both steps' tokens, plus a block where they straddle block edges."""
    whole = -(-num_tokens // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-(sliding_window + 2 * max_step_tokens - 2) // block_size) + 1)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        # ``ModelArch.kv_window``: no query reads a key more than ``sliding_window - 1`` before it.
        self.sliding_window = sliding_window
        # Per request, its leading blocks given back by ``release_out_of_window`` (``RELEASED`` in its list).
        self._num_released: dict[str, int] = {}
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        # The prefix cache's host tier, and the copies to and from it the runner does before the next forward.
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_caching else None
        self.host_copies: list[HostCopy] = []
        if self.host is not None:
            self.pool.on_evict = self._save_to_host
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
        # With a host tier, beside them the hashes they held when freed: one evicted since may sit in the host tier.
        self._freed: dict[str, tuple[list[KVBlock], list[BlockHash]]] = {}

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

    def get_computed_blocks(self, seq: SequenceLike, max_blocks: int | None = None) -> tuple[list[KVBlock], int]:
        """Leading cached blocks of ``seq`` and how many tokens they cover; does not take them.

        At most ``num_tokens - 1`` tokens are reported, so the last token is always computed
        (its logits are needed); at most ``max_blocks`` blocks where given. With a host tier, a block
        cached there only is a ``HostHit`` in the list.

        With a window, a hit needs only the blocks a query after it reads: the longest prefix whose last
        window of blocks is cached counts, however many blocks before it are gone (as vLLM's sliding-window
        manager finds its hits), and the list's leading places for those are ``RELEASED``, to be neither held
        nor read (``allocate_slots`` takes them as released places). At least one hit block is real.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        lookup = self.pool.get_cached_block if self.host is None else self._lookup_both
        hashes = seq.block_hashes[: limit if max_blocks is None else min(limit, max_blocks)]
        if self.sliding_window is None:
            hits: list[KVBlock] = []
            for block_hash in hashes:
                block = lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits, len(hits) * bs
        found = [lookup(h) for h in hashes]
        best, best_skip, run = 0, 0, 0  # run: cached blocks ending at the one looked at
        for k in range(1, len(found) + 1):
            run = run + 1 if found[k - 1] is not None else 0
            skip = self._out_of_window(k * bs)
            if run >= k - skip > 0:
                best, best_skip = k, skip
        window_hits = [RELEASED] * best_skip + [b for b in found[best_skip:best] if b is not None]
        return window_hits, best * bs

    def _lookup_both(self, block_hash: BlockHash) -> KVBlock | None:
        """The device's cached block, else the host tier's as a ``HostHit``, else None."""
        block = self.pool.get_cached_block(block_hash)
        if block is None:
            assert self.host is not None
            slot = self.host.lookup(block_hash)
            if slot is not None:
                return HostHit(slot, block_hash)
        return block

    def _save_to_host(self, block: KVBlock) -> None:
        """``BlockPool.on_evict``: a cached block about to be reused goes to the host tier, unless it is there."""
        assert self.host is not None and block.block_hash is not None
        if self.host.lookup(block.block_hash) is None:
            slot = self.host.store(block.block_hash)
            if slot is not None:
                self.host_copies.append(HostCopy(SAVE, block.block_id, slot))

    def _take_hits(self, hits: list[KVBlock]) -> list[KVBlock]:
        """Hold the prefix hits ``hits``: the device's are touched, each ``HostHit`` gets a new device block,
        cached under its hash, with its load queued. Their slots are pinned while the pool gives the blocks (its
        evictions save to the host tier, never into a slot about to be loaded from)."""
        if self.host is None:
            self.pool.touch(hits)
            return hits
        real = [b for b in hits if type(b) is not HostHit]
        self.pool.touch(real)
        if len(real) == len(hits):
            return hits
        from_host = [(i, b) for i, b in enumerate(hits) if isinstance(b, HostHit)]
        self.host.pinned = {b.slot for _, b in from_host}
        try:
            new = self.pool.get_new_blocks(len(from_host))
        finally:
            self.host.pinned = set()
        taken = list(hits)
        for (i, hit), block in zip(from_host, new, strict=True):
            assert hit.block_hash is not None
            self.pool.cache_full_block(block, hit.block_hash)
            self.host_copies.append(HostCopy(LOAD, block.block_id, hit.slot))
            taken[i] = block
        self.host.num_loaded += len(new)
        return taken

    def _out_of_window(self, num_tokens: int) -> int:
        assert self.sliding_window is not None
        return out_of_window(num_tokens, self.block_size, self.sliding_window)

    def can_fit(self, num_tokens: int, max_step_tokens: int) -> bool:
        """Whether the pool could ever hold a sequence of ``num_tokens`` tokens (``max_blocks_held``)."""
        return self.max_blocks_held(num_tokens, max_step_tokens) <= self.pool.num_blocks

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens holds at once (``max_blocks_held``)."""
        return max_blocks_held(num_tokens, self.block_size, self.sliding_window, max_step_tokens)

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
        # A hit out of a window (``get_computed_blocks``) starts with released places, taken by a new request.
        skipped = computed_blocks.count(RELEASED)
        assert not skipped or not blocks, f"{rid} already holds blocks"
        hits = computed_blocks[skipped:]
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_needed, 0) + int(cow) + num_evictable_hits > self.pool.num_free_blocks:
            return False
        ids = self._block_ids.get(rid)
        if ids is None:
            ids = self._block_ids[rid] = []
            self._num_marked[rid] = num_computed
        if hits:
            hits = self._take_hits(hits)
            blocks = blocks + [RELEASED] * skipped + hits
            ids.extend(b.block_id for b in hits)
            for b in hits:  # cached, so full
                self._fill(b.block_id, bs)
            if skipped:
                self._place_released(rid, skipped, hits, ids)
                self._num_hashed[rid] = skipped
                ids = self._block_ids[rid]
        if cow:
            shared = blocks[write_idx]
            (copy,) = self.pool.get_new_blocks(1)
            self.pending_copies.append((shared.block_id, copy.block_id))
            self.num_cow_copies += 1
            self.pool.free_blocks([shared])
            blocks = blocks[:write_idx] + [copy] + blocks[write_idx + 1 :]
            ids = self._block_ids[rid] = [*ids[:write_idx], copy.block_id, *ids[write_idx + 1 :]]
            if write_idx and write_idx == self._num_released.get(rid, 0):  # released places follow their block
                ids[:write_idx] = [copy.block_id] * write_idx
            self._fill(copy.block_id, num_computed - write_idx * bs)
        if num_needed > 0:
            new_blocks = self.pool.get_new_blocks(num_needed)
            blocks = blocks + new_blocks
            ids.extend(b.block_id for b in new_blocks)
        self.req_blocks[rid] = blocks
        return True

    def allocate_remote(self, seq: SequenceLike, num_kv_tokens: int, computed_blocks: list[KVBlock]) -> int | None:
        """Blocks for a request whose first ``num_kv_tokens`` of KV another instance sends, after its prefix hits
        here (``computed_blocks``, from ``get_computed_blocks``); sets ``seq.num_computed_tokens`` to what needs
        no sending. Returns how many leading blocks the sender skips, or None (nothing changed) if the pool is
        short. With a window, the blocks no query from ``num_kv_tokens`` on reads are skipped too, and where the
        hits do not reach them they are neither held nor sent: their places are ``RELEASED`` from the start."""
        bs = self.block_size
        skip = 0 if self.sliding_window is None else self._out_of_window(num_kv_tokens)
        if skip <= len(computed_blocks):  # the hits reach the window: as any prefix hit
            seq.num_computed_tokens = len(computed_blocks) * bs
            if not self.allocate_slots(seq, num_kv_tokens - seq.num_computed_tokens, computed_blocks):
                seq.num_computed_tokens = 0
                return None
            return len(computed_blocks)
        rid = seq.request_id
        assert rid not in self.req_blocks, f"{rid} already holds blocks"
        num_new = self.cdiv(num_kv_tokens) - skip
        if num_new > self.pool.num_free_blocks:
            return None
        new = self.pool.get_new_blocks(num_new)
        self._place_released(rid, skip, new, [b.block_id for b in new])
        self._num_hashed[rid] = skip  # never cached: their KV was never here
        self._num_marked[rid] = skip * bs
        seq.num_computed_tokens = skip * bs
        return skip

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
        released = self._num_released.get(parent.request_id, 0)
        self.pool.touch(blocks[released:])
        self.req_blocks[child.request_id] = blocks
        self._block_ids[child.request_id] = list(self._block_ids.get(parent.request_id, ()))
        self._num_marked[child.request_id] = self._num_marked.get(parent.request_id, 0)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)
        if released:
            self._num_released[child.request_id] = released

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first so its head stays cached longest. Idempotent."""
        blocks = self.req_blocks.pop(request_id, [])
        released = self._num_released.pop(request_id, 0)
        if released:
            blocks = blocks[released:]
        if self.keep_freed and blocks:
            hashes = [] if self.host is None else [b.block_hash for b in blocks if b.block_hash is not None]
            self._freed[request_id] = (blocks, hashes)
        self._block_ids.pop(request_id, None)
        self._num_marked.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._give_back(blocks)

    def _give_back(self, blocks: list[KVBlock]) -> None:
        """Drop one holder of each block, tail first; a block no one holds any more has no filled slots."""
        self.pool.free_blocks(reversed(blocks))
        for b in blocks:
            if b.ref_cnt == 0:
                self.num_filled_slots -= self._slot_fill[b.block_id]
                self._slot_fill[b.block_id] = 0

    def release_out_of_window(self, seq: SequenceLike, first_query: int) -> None:
        """Give back the leading blocks of ``seq`` that hold only keys no query at ``first_query`` or later
        reads (those before ``first_query - sliding_window + 1``), once they are cached (with caching on): the
        caller passes the position of the first token its step computed, so the step's own queries, which may
        still be running, read none of them either. The table's ids are rewritten (another list, as
        ``block_ids_view`` says), pointing the released places at the first block still held. At least one
        block stays. O(1) unless a block is released; then O(blocks in the table)."""
        bs = self.block_size
        assert self.sliding_window is not None
        num = (first_query - self.sliding_window + 1) // bs
        rid = seq.request_id
        done = self._num_released.get(rid, 0)
        if num <= done:
            return
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            return
        # Cached before they go (a block goes back findable, as a finished request's does), and one held.
        num = min(num, len(blocks) - 1, self._num_hashed.get(rid, 0) if self.enable_caching else num)
        if num <= done:
            return
        gone = blocks[done:num]
        self._place_released(rid, num, blocks[num:], self._block_ids[rid][num:])
        self._give_back(gone)

    def _place_released(self, rid: str, num: int, held: list[KVBlock], held_ids: list[int]) -> None:
        """The request's table: ``num`` released places, their ids its first block held's, then ``held``."""
        self.req_blocks[rid] = [RELEASED] * num + held
        self._block_ids[rid] = [held_ids[0]] * num + held_ids
        self._num_released[rid] = num

    def num_released(self, request_id: str) -> int:
        """How many of the request's leading blocks ``release_out_of_window`` gave back."""
        return self._num_released.get(request_id, 0)

    def take_freed(self) -> dict[str, tuple[list[KVBlock], list[BlockHash]]]:
        """The block lists of the requests freed since the last call (only kept under ``keep_freed``),
        as they were when freed, with the hashes they held then where a host tier may have kept them since; their
        blocks may have been taken since."""
        freed, self._freed = self._freed, {}
        return freed

    def uncache(self, blocks: list[KVBlock], hashes: list[BlockHash] | None = None) -> None:
        """No prefix hit finds what these blocks hold, nor the host tier's copies of them or of ``hashes``."""
        if self.host is not None:
            for block_hash in [*(b.block_hash for b in blocks if b.block_hash is not None), *(hashes or ())]:
                self.host.drop(block_hash)
        self.pool.uncache(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, the host tier's too; only allowed while no block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.clear()
        return True

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash a prefix hit would find, on the device or in the host tier."""
        if self.host is None:
            return list(self.pool.cached)
        return list(dict.fromkeys([*self.pool.cached, *self.host.hashes()]))

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) hashes since the last call, for the prefix index (``BlockPool.drain_events``): a
        block the device gave up is removed only if the host tier does not hold it, and one the host tier gave up
        only if the device does not."""
        stored, removed = self.pool.drain_events()
        if self.host is None:
            return stored, removed
        host, cached = self.host, self.pool.cached
        gone = [h for h in dict.fromkeys([*removed, *host.drain_dropped()]) if h not in host and h not in cached]
        return stored, gone

    def take_host_copies(self) -> list[HostCopy]:
        copies, self.host_copies = self.host_copies, []
        return copies

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self) -> None:
        holders: dict[int, int] = {}
        for request_id, blocks in self.req_blocks.items():
            released = self._num_released.get(request_id, 0)
            ids = self._block_ids.get(request_id, [])
            assert blocks[:released] == [RELEASED] * released and RELEASED not in blocks[released:], request_id
            assert ids[released:] == [b.block_id for b in blocks[released:]], f"{request_id}: block ids differ"
            assert ids[:released] == ids[released : released + 1] * released, f"{request_id}: released ids"
            for b in blocks[released:]:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert set(self._block_ids) == set(self.req_blocks), "block ids kept for requests that hold no blocks"
        assert set(self._num_released) <= set(self.req_blocks), "releases kept for requests that hold no blocks"
        self.pool.check_integrity(holders)
        if self.host is not None:
            self.host.check_integrity()
        assert all(0 <= f <= self.block_size for f in self._slot_fill)
        assert all(self._slot_fill[i] == 0 for i in range(self.pool.num_blocks) if i not in holders), "fill of a free block"
        assert sum(self._slot_fill) == self.num_filled_slots, "filled-slot count drifted"
