"""The prefix cache's second tier, in host memory (vLLM's ``--kv-offloading-size``): which cached blocks it holds.

A cached block the device pool takes back for another use (``BlockPool.get_new_blocks``) is copied to a slot of
this tier first, unless the tier holds its hash already; a prefix lookup that misses on the device finds it here,
and the block comes back into a new device block before the step that reads it. Like the device's, the tier is a
cache: least recently used first out, and a hash it drops is simply computed again when next needed.

Bookkeeping only, as ``BlockPool`` is: the ``KVCacheManager`` queues the copies (``HostCopy``) in the order it
decides them, and the runner performs them in that order before the step's forward, so a slot read by a load and
written by a later save, or a block saved and then loaded into, each see what the bookkeeping saw.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from common.kvcache.block_pool import KVBlock, note_event
from common.kvcache.hashing import BlockHash

SAVE, LOAD = 0, 1


class HostCopy(NamedTuple):
    """One block's copy between the device pool and the host tier: ``SAVE`` device block -> slot, ``LOAD`` slot ->
    device block."""

    direction: int
    block_id: int
    slot: int


def copy_batches(copies: list[HostCopy], max_blocks: int = 1 << 30) -> list[tuple[int, list[int], list[int]]]:
    """``copies`` as batches to run one after another, each one direction and one indexed copy of at most
    ``max_blocks`` blocks: (direction, block ids, slots). A batch ends where the direction changes or a destination
    repeats (a slot saved to twice, its first hash dropped in between), so running the batches in order is running
    the copies in order."""
    batches: list[tuple[int, list[int], list[int]]] = []
    written: set[int] = set()
    for direction, block_id, slot in copies:
        dest = slot if direction == SAVE else block_id
        if not batches or batches[-1][0] != direction or dest in written or len(written) >= max_blocks:
            batches.append((direction, [], []))
            written = set()
        batches[-1][1].append(block_id)
        batches[-1][2].append(slot)
        written.add(dest)
    return batches


def available_host_memory() -> int | None:
    """Bytes of memory the host can still give (``MemAvailable``), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostHit(KVBlock):
    """A prefix hit found in the host tier (``KVCacheManager.get_computed_blocks``): a device block is taken for it,
    and its slot loaded into it, only when the request takes its hits (``allocate_slots``). Counted as a free
    cached block would be: it needs one free block of the pool."""

    __slots__ = ("slot",)

    def __init__(self, slot: int, block_hash: BlockHash) -> None:
        super().__init__(-2)
        self.slot = slot
        self.block_hash = block_hash


class HostTier:
    """Slots of host memory, each holding one cached block's KV under its hash, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a host tier needs at least one slot")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        # Slots being loaded from while the pool gives up blocks for them (``KVCacheManager._take_hits``): no
        # save in between may take them.
        self.pinned: set[int] = set()
        self._dropped: list[BlockHash] = []  # hashes given up since the last ``drain_dropped``
        self._drained = False  # never drained (an offline engine): dropped hashes are not kept for ever
        self.num_saved = 0  # blocks copied in
        self.num_loaded = 0  # blocks copied back out for a hit

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def entries(self) -> list[tuple[BlockHash, int]]:
        """(hash, slot) of every block held, least recently used first; nothing is touched."""
        return list(self._slots.items())

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash`` (now the most recently used), or None."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot to copy ``block_hash``'s block into: a free one, else the least recently used one not pinned
        (its hash dropped). None if every slot is pinned."""
        assert block_hash not in self._slots, "stored twice"
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            note_event(self._dropped, victim, self._drained)
        self._slots[block_hash] = slot
        self.num_saved += 1
        return slot

    def drop(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (its KV is not to be trusted); its slot is free."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            note_event(self._dropped, block_hash, self._drained)

    def clear(self) -> None:
        for block_hash in list(self._slots):
            self.drop(block_hash)

    def drain_dropped(self) -> list[BlockHash]:
        """Hashes given up since the last call (some may have been stored again since)."""
        dropped, self._dropped, self._drained = self._dropped, [], True
        return dropped

    def check_integrity(self) -> None:
        slots = list(self._slots.values())
        assert len(set(slots)) == len(slots), "a slot under two hashes"
        assert not set(slots) & set(self._free), "a slot both free and held"
        assert len(slots) + len(self._free) == self.num_slots, "slots lost"
