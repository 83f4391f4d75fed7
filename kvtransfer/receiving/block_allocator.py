"""What the receiver needs from the decode engine's block pool: allocate for a transfer, release it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Allocation:
    """Blocks for all ``ceil(num_tokens / block_size)`` blocks of a request, in order.

    The first ``num_cached_blocks`` already hold the right KV (prefix-cache hits) and are not sent. Of those,
    the first ``num_released_blocks`` are not held at all: no query will read them (out of a sliding window),
    and their ids are placeholders, repeating the first block held.
    """

    block_ids: list[int]
    num_cached_blocks: int = 0
    num_released_blocks: int = 0


@dataclass(frozen=True)
class Refusal:
    """The engine will not take this transfer: fail it now.

    ``busy``: the refusal is about this engine, not the request (it is draining); the sender is told
    so, and the request may go to another receiver without counting as lost. Otherwise the engine
    will never take it (a bad or duplicate request).
    """

    reason: str
    busy: bool = False


class BlockAllocator(Protocol):
    """Implemented by the decode engine. The receiver calls it only from ``KVReceiver.poll``,
    ``abort`` and ``close``, i.e. on the engine's own thread."""

    def allocate_for_transfer(
        self, request_id: str, block_hashes: list[bytes], num_tokens: int, meta: bytes
    ) -> Allocation | Refusal | str:
        """Take blocks for a transfer; or refuse it (for now, ``busy``, or for good); or return a
        reason to defer (pool full), and be called again later. ``meta`` is the sender's opaque
        request description."""
        ...

    def release_transfer(self, request_id: str) -> None:
        """Free what ``allocate_for_transfer`` took for ``request_id``; called at most once per allocation."""
        ...


def check_allocation(
    allocation: Allocation, num_blocks: int, num_hashes: int, num_pool_blocks: int
) -> str | None:
    """Why an allocation from the engine cannot be used, or ``None`` when it can."""
    ids = allocation.block_ids
    if len(ids) != num_blocks:
        return f"{len(ids)} block ids for {num_blocks} blocks"
    if not 0 <= allocation.num_cached_blocks <= min(num_hashes, num_blocks):
        return f"num_cached_blocks {allocation.num_cached_blocks} outside 0..{min(num_hashes, num_blocks)}"
    if not all(isinstance(b, int) and 0 <= b < num_pool_blocks for b in ids):
        return "block id out of range of the kv_cache"
    if not 0 <= allocation.num_released_blocks <= allocation.num_cached_blocks:
        return f"num_released_blocks {allocation.num_released_blocks} outside 0..{allocation.num_cached_blocks}"
    held = ids[allocation.num_released_blocks :]
    if len(set(held)) != len(held):
        return "the same block id twice in one request"
    return None
