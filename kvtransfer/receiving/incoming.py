"""The receiver's record of one transfer, and the table its two threads share.

Rules that keep blocks safe across the engine thread and the I/O thread:
- ``closed`` is set once, under ``lock``; the I/O thread scatters only under ``lock`` and only
  while not ``closed``, so after closing no byte lands in the blocks any more.
- ``allocation`` is set (under ``lock``) and released only on the engine thread.
- Whoever closes a record queues it on ``finished`` exactly once; the engine thread then
  releases the blocks of a failed one and reports it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.blocks.packing import BlockIds
from kvtransfer.receiving.block_allocator import Allocation
from kvtransfer.state_board import StateBoard
from kvtransfer.transfer_state import TransferResult, TransferState
from kvtransfer.wire.frames import FrameCursor
from kvtransfer.wire.sockets import Waker

MAX_EARLY_ABORTS = 65536


@dataclass(eq=False)
class Incoming:
    request_id: str
    identity: bytes  # the ZMQ routing id of the sender's connection
    num_tokens: int
    block_hashes: list[bytes]
    meta: bytes
    keepalive_s: float
    offered_at: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: TransferState = TransferState.WAITING
    closed: bool = False
    ok: bool = False
    reason: str | None = None
    busy: bool = False  # refused as busy (``Refusal.busy``): the sender may offer it elsewhere
    finished_at: float = 0.0
    allocation: Allocation | None = None
    released: bool = False
    defer_reason: str | None = None
    order: Any = None  # its place among offers waiting for blocks (``KVReceiver``'s ``offer_order``)
    last_defer_sent: float = 0.0
    dst_ids: BlockIds | None = None
    cursor: FrameCursor | None = None
    bytes_received: int = 0
    last_event: Any | None = None  # CUDA event of the latest scatter

    def close_locked(self, ok: bool, reason: str | None, *, busy: bool = False) -> bool:
        """Close while holding ``lock``; ``False`` if it was already closed. ``busy`` (the receiver's
        own state ends it) holds only for a transfer nothing was allocated for yet."""
        if self.closed:
            return False
        self.closed = True
        self.ok = ok
        self.reason = reason
        self.busy = busy and self.allocation is None
        self.state = TransferState.SUCCESS if ok else TransferState.FAILED
        self.finished_at = time.monotonic()
        return True

    def result(self) -> TransferResult:
        allocation = self.allocation
        return TransferResult(
            request_id=self.request_id,
            ok=self.ok,
            reason=self.reason,
            block_ids=list(allocation.block_ids) if allocation else [],
            num_cached_blocks=allocation.num_cached_blocks if allocation else 0,
            num_tokens=self.num_tokens,
            block_hashes=self.block_hashes,
            meta=self.meta,
            bytes_received=self.bytes_received,
            receiver_busy=self.busy,
            seconds=(self.finished_at or time.monotonic()) - self.offered_at,
        )


class ReceiverTable:
    """Everything the engine thread and the I/O thread of one receiver share."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards ``records`` and ``early_aborts``
        self.records: dict[str, Incoming] = {}
        # Ids the engine aborted before their offer arrived (the client left during prefill),
        # with when to forget them; an offer for one is refused.
        self.early_aborts: OrderedDict[str, float] = OrderedDict()
        self.offers: deque[Incoming] = deque()  # I/O -> engine: to allocate
        self.finished: deque[Incoming] = deque()  # either -> engine: to release and report
        self.commands: deque[tuple[str, Any]] = deque()  # engine -> I/O: messages to send
        self.board = StateBoard()
        self.waker = Waker()

    def close(self, record: Incoming, ok: bool, reason: str | None, *, busy: bool = False) -> bool:
        """Close ``record`` and queue it for the engine; ``False`` if it was already closed."""
        with record.lock:
            if not record.close_locked(ok, reason, busy=busy):
                return False
        self.finished.append(record)
        return True

    def abort_early(self, request_id: str, forget_after_s: float) -> None:
        """Refuse a future offer of ``request_id`` for ``forget_after_s``; call with ``lock`` held."""
        now = time.monotonic()
        self.early_aborts[request_id] = now + forget_after_s
        self.early_aborts.move_to_end(request_id)
        while self.early_aborts and (
            len(self.early_aborts) > MAX_EARLY_ABORTS or next(iter(self.early_aborts.values())) < now
        ):
            self.early_aborts.popitem(last=False)

    def take_early_abort_locked(self, request_id: str) -> bool:
        """Whether the engine aborted ``request_id`` before its offer (forgets it); ``lock`` held."""
        expiry = self.early_aborts.pop(request_id, None)
        return expiry is not None and expiry >= time.monotonic()

    def tell_sender(self, record: Incoming, kind: str) -> None:
        """Ask the I/O thread to send ``kind`` (accept/abort) for ``record``."""
        self.commands.append((kind, record))
        self.waker.wake()
