"""Fixed pool of KV blocks with refcounts, an O(1) LRU free queue and a hash -> block map.

Free blocks that still hold a cached full block stay findable by hash until they are reused
(evicted). The free queue is a doubly linked list threaded through the blocks, so a prefix hit
takes a block out of the middle in O(1). Eviction order: least recently freed first; a request's
tail blocks are freed before its head, and blocks with no hash go to the front. A multi-block
allocation may reorder its victims within a bounded window of that order (``CONTIGUITY_WINDOW``)
to hand out runs of consecutive ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from operator import attrgetter, sub

from common.kvcache.hashing import BlockHash

# A multi-block allocation takes its blocks from the ``CONTIGUITY_WINDOW * num_blocks`` least
# recently freed, preferring long runs of consecutive ids: the KV transfer sends a run straight from
# the cache and lands it with one copy, while scattered ids cost a gather and a scatter copy on the
# transfer's critical path (``kvtransfer/blocks/packing.py``). Measured with ``pdserve bench kv``
# (recycled ids): 41 runs for a 125-block prompt with strict LRU, 2 to 4 runs with a window of 2.
# The price: a cached block up to ``num_blocks`` places younger than strict LRU's victims may go
# first; in a simulated churn of a 500-block pool under pressure (shared prefixes drawn from a Zipf
# mix) the prefix-cache hit rate fell from 51% to 50% of prompt tokens. 1 restores strict LRU.
CONTIGUITY_WINDOW = 2

# Prefix events (hashes stored and evicted) are kept for ``drain_events``; in a pool nobody has drained yet (an
# offline engine, which publishes nothing) they are dropped once there are this many, not kept for ever.
UNDRAINED_EVENTS_MAX = 1 << 16

_BLOCK_ID = attrgetter("block_id")


def note_event(events: list[BlockHash], block_hash: BlockHash, drained: bool) -> None:
    """``block_hash`` added to ``events`` for whoever drains them; where nobody has (``drained`` false), the list is
    emptied once it holds more than ``UNDRAINED_EVENTS_MAX``."""
    events.append(block_hash)
    if not drained and len(events) > UNDRAINED_EVENTS_MAX:
        events.clear()


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        self.remove_all((block,))

    def remove_all(self, blocks: Sequence[KVBlock]) -> None:
        """Unlink each of ``blocks`` (an allocation's, in one call), wherever it is in the queue."""
        for block in blocks:
            prev, nxt = block.prev_free, block.next_free
            assert prev is not None and nxt is not None, f"{block} is not free"
            prev.next_free, nxt.prev_free = nxt, prev
            block.prev_free = block.next_free = None
        self.num_free_blocks -= len(blocks)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def __iter__(self):  # type: ignore[no-untyped-def]
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def first(self, num_blocks: int) -> list[KVBlock]:
        """The first ``num_blocks`` free blocks (fewer if there are fewer), next victim first."""
        out: list[KVBlock] = []
        node, tail = self._head.next_free, self._tail
        while node is not None and node is not tail and len(out) < num_blocks:
            out.append(node)
            node = node.next_free
        return out


class BlockPool:
    """Owns every block. Callers hold blocks through refcounts; nothing here touches tensors."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, contiguity_window: int = CONTIGUITY_WINDOW
    ) -> None:
        if num_blocks < 1 or contiguity_window < 1:
            raise ValueError("a block pool needs at least one block and a contiguity window >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.contiguity_window = contiguity_window
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # Hashes stored / evicted since the last drain (published to the prefix index).
        self._stored: list[BlockHash] = []
        self._removed: list[BlockHash] = []
        self._drained = False  # whether anyone has drained the events (``UNDRAINED_EVENTS_MAX``)
        # Called with each cached block the pool takes back for another use, before it goes (the host tier
        # copies it out: ``KVCacheManager``); not for a block ``uncache`` forgets.
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks (evicting their cached contents), each with refcount 1.

        One block is the head of the free queue (eviction order). Several come from the
        ``contiguity_window * num_blocks`` at its head, as few runs of consecutive ids as that
        window allows (``_runs_to_take``). They are handed out in ascending id order, so that
        blocks freed together (a request's, freed tail first) come back as runs of consecutive
        ids, which the KV transfer moves without packing.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        queue = self.free_queue
        if num_blocks <= 1 or self.contiguity_window <= 1:
            out = [queue.popleft() for _ in range(num_blocks)]
        else:
            out = self._runs_to_take(num_blocks)
            queue.remove_all(out)
        evict, on_evict, cached = self._evict, self.on_evict, self.cached
        for block in out:
            if block.block_hash is not None:
                if on_evict is not None and cached.get(block.block_hash) is block:
                    on_evict(block)
                evict(block)
            block.ref_cnt = 1
        out.sort(key=_BLOCK_ID)
        return out

    def _runs_to_take(self, num_blocks: int) -> list[KVBlock]:
        """``num_blocks`` of the window at the free queue's head, in the fewest runs of ids.

        Longest runs first (fewest runs for the count); among equally long runs, the one whose
        oldest block comes first in the queue. O(window log window); does not modify the queue.
        Per allocation on the scheduler's path (a batch of prompts is a call each), so the runs are
        found with one sort of the window's ids and a pass over them, each run kept as a tuple that
        sorts by itself.
        """
        window = self.free_queue.first(self.contiguity_window * num_blocks)
        ids = [block.block_id for block in window]
        order = sorted(range(len(window)), key=ids.__getitem__)  # places, by block id
        # Each run: (-length, its oldest place, where it starts in ``order``); no two share a place.
        runs: list[tuple[int, int, int]] = []
        start, oldest, prev_id = 0, order[0], ids[order[0]]
        for i in range(1, len(order)):
            place = order[i]
            block_id = ids[place]
            if block_id == prev_id + 1:
                if place < oldest:
                    oldest = place
            else:
                runs.append((start - i, oldest, start))
                start, oldest = i, place
            prev_id = block_id
        runs.append((start - len(order), oldest, start))
        runs.sort()
        out: list[KVBlock] = []
        for k, (neg_len, _, start) in enumerate(runs):
            need = num_blocks - len(out)
            if need <= 0:
                break
            if neg_len == -1:  # single blocks from here on, oldest first (often every run: one pass)
                out += [window[place] for _, place, _ in runs[k : k + need]]
                break
            places = order[start : start - neg_len]
            if len(places) > need:  # the stretch of the run whose blocks are oldest (least place sum)
                sums = list(accumulate(places, initial=0))
                costs = list(map(sub, sums[need:], sums[: len(sums) - need]))  # stretch i: sums[i + need] - sums[i]
                best = costs.index(min(costs))  # the first of the least, as ``min`` with a key picks
                places = places[best : best + need]
            out.extend([window[place] for place in places])
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                note_event(self._removed, block.block_hash, self._drained)
            block.block_hash = None

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Forget what these blocks hold: no prefix hit finds them (the prefix index hears of it)."""
        for block in blocks:
            self._evict(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one holder to each block, taking free ones off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one holder from each block, in eviction-priority order (first freed, first evicted)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` holds the full block ``block_hash``; a duplicate keeps the first."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            note_event(self._stored, block_hash, self._drained)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed while no block is in use."""
        if self.num_used_blocks:
            return False
        self.uncache(self.blocks)
        return True

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) hashes since the last call, for the prefix index; each reported once.

        Net of what happened in between (a hash stored then evicted is only removed, one evicted
        then stored again only stored), so the two lists are disjoint and their order does not matter.
        """
        stored = [h for h in dict.fromkeys(self._stored) if h in self.cached]
        removed = [h for h in dict.fromkeys(self._removed) if h not in self.cached]
        self._stored, self._removed, self._drained = [], [], True
        return stored, removed

    def check_integrity(self, holders: dict[int, int] | None = None) -> None:
        """Raise ``AssertionError`` unless free + used == total and refcounts are consistent.

        ``holders`` maps block_id -> number of holders known to the caller; when given, every
        refcount must equal it.
        """
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == self.num_free_blocks == len(set(free_ids)), "free queue corrupt"
        for block in self.blocks:
            in_queue = block.prev_free is not None
            assert in_queue == (block.ref_cnt == 0), f"{block}: refcount and free queue disagree"
            assert block.ref_cnt >= 0
            if holders is not None:
                assert block.ref_cnt == holders.get(block.block_id, 0), (
                    f"{block}: refcount {block.ref_cnt} != holders {holders.get(block.block_id, 0)}"
                )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} is mapped under a hash it does not hold"
        assert self.num_free_blocks + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
