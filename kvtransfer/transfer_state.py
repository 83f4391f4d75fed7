"""Where a transfer stands, as an engine step loop polls it, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ABORTED = "aborted"  # the reason of a transfer this side's engine aborted


class TransferState(enum.IntEnum):
    """Polled state of one transfer; the finished states sort last."""

    BOOTSTRAPPING = 0  # connecting and exchanging layouts with the peer
    WAITING = 1  # offered; the receiver has not allocated blocks yet (may be deferred)
    TRANSFERRING = 2  # blocks allocated, data moving
    SUCCESS = 3
    FAILED = 4

    @property
    def finished(self) -> bool:
        return self >= TransferState.SUCCESS


@dataclass(frozen=True)
class TransferResult:
    """One finished transfer, reported once by ``poll()``.

    On the receiver, ``ok`` hands ``block_ids`` to the engine; a failure has already released them.
    On the sender, any result means the engine may free or reuse its ``block_ids`` again.
    A failure before allocation (refused offer) has no ``block_ids``. ``reason`` is ``ABORTED``
    exactly when this side's engine called ``abort``. ``receiver_busy``: the receiving side ended the
    offer for a state of its own (draining, closing, its pool full past its timeout) before anything
    was allocated; nothing is wrong with the request, and another receiver may take it.
    """

    request_id: str
    ok: bool
    reason: str | None
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    meta: bytes = b""
    bytes_received: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    receiver_busy: bool = False
