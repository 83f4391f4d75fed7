"""A small block pool for the tests: a free list plus a prefix cache of full blocks by hash."""

from __future__ import annotations

import math

from kvtransfer import Allocation


class BlockPool:
    """Implements ``BlockAllocator`` the simple way and can say whether every block came back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks))[::-1]  # pop() hands out 0, 1, 2, ...
        self.cached: dict[bytes, int] = {}  # hash -> block holding that full block's KV
        self.held: dict[str, list[int]] = {}  # request -> blocks allocated for it
        self.num_reserved = 0
        self.calls: list[str] = []

    def allocate_for_transfer(
        self, request_id: str, block_hashes: list[bytes], num_tokens: int, meta: bytes = b""
    ) -> Allocation | str:
        self.calls.append(f"allocate {request_id}")
        num_blocks = math.ceil(num_tokens / self.block_size)
        hits = []
        for block_hash in block_hashes:
            if block_hash not in self.cached:
                break
            hits.append(self.cached[block_hash])
        need = num_blocks - len(hits)
        if len(self.free) - self.num_reserved < need:
            return f"pool full: need {need} blocks, {len(self.free) - self.num_reserved} free"
        ids = hits + [self.free.pop() for _ in range(need)]
        self.held[request_id] = ids
        return Allocation(ids, len(hits))

    def release_transfer(self, request_id: str) -> None:
        self.calls.append(f"release {request_id}")
        ids = self.held.pop(request_id)  # KeyError: released twice or never allocated
        cached_ids = set(self.cached.values())
        self.free.extend(b for b in ids if b not in cached_ids)

    def finish(self, request_id: str, block_hashes: list[bytes]) -> None:
        """The engine is done with a delivered request: keep its full blocks cached, free the rest."""
        ids = self.held.pop(request_id)
        cached_ids = set(self.cached.values())
        for i, block_id in enumerate(ids):
            if block_id in cached_ids:
                continue
            if i < len(block_hashes) and block_hashes[i] not in self.cached:
                self.cached[block_hashes[i]] = block_id
                cached_ids.add(block_id)
            else:
                self.free.append(block_id)

    def is_clean(self) -> bool:
        """Nothing held, and every block is either free or cached, exactly once."""
        everything = self.free + list(self.cached.values())
        return not self.held and sorted(everything) == list(range(self.num_blocks))
