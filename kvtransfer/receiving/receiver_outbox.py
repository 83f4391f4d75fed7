"""What the receiver sends, and the timers that make it send: accepts, keepalives, aborts, acks.

Owned by the receiver's I/O thread together with the socket. A failed transfer's id is
remembered for a while, so frames its sender had already queued are dropped quietly.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import zmq

from kvtransfer.receiving.incoming import Incoming, ReceiverTable
from kvtransfer.transfer_state import TransferState
from kvtransfer.wire.messages import Abort, Accept, Defer, Done, encode

logger = logging.getLogger(__name__)

RECENTLY_CLOSED = 4096


class ReceiverOutbox:
    """Sends on the receiver's ROUTER; closes a record whose sender cannot be reached."""

    def __init__(
        self, sock: zmq.Socket, table: ReceiverTable, *, timeout_s: float, defer_timeout_s: float
    ) -> None:
        self.sock = sock
        self.table = table
        self.timeout_s = timeout_s
        self.defer_timeout_s = defer_timeout_s
        self.recently_closed: OrderedDict[str, bytes] = OrderedDict()  # failed request id -> its sender

    def run_commands(self) -> None:
        while self.table.commands:
            kind, record = self.table.commands.popleft()
            if kind == "abort":
                self.abort_sender(record, record.reason or "aborted")
            elif kind == "accept" and not record.closed:
                assert record.allocation is not None
                accept = Accept(
                    request_id=record.request_id,
                    block_ids=record.allocation.block_ids,
                    num_cached_blocks=record.allocation.num_cached_blocks,
                )
                sent = self.send(record.identity, accept, record)
                # Every block was cached: nothing will come, the transfer is complete now.
                if (
                    sent
                    and record.cursor is not None
                    and record.cursor.done
                    and self.table.close(record, True, None)
                ):
                    self.send(record.identity, Done(request_id=record.request_id))

    def abort_sender(self, record: Incoming, reason: str) -> None:
        """Tell the sender a transfer failed here; its frames still on the way are then expected."""
        self.remember_closed(record)
        self.send(record.identity, Abort(request_id=record.request_id, reason=reason[:1024], busy=record.busy))

    def remember_closed(self, record: Incoming) -> None:
        self.recently_closed[record.request_id] = record.identity
        self.recently_closed.move_to_end(record.request_id)
        while len(self.recently_closed) > RECENTLY_CLOSED:
            self.recently_closed.popitem(last=False)

    def send(self, identity: bytes, msg: object, record: Incoming | None = None) -> bool:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)  # type: ignore[arg-type]
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that sender is gone
            if record is not None:
                self.table.close(record, False, f"sender unreachable: {exc}")
            return False

    def expire(self) -> None:
        now = time.monotonic()
        with self.table.lock:
            records = [r for r in self.table.records.values() if not r.closed]
        for record in records:
            if record.state == TransferState.WAITING:
                if now - record.offered_at > self.defer_timeout_s:
                    why = record.defer_reason or "the engine did not allocate"
                    reason = f"no free blocks within {self.defer_timeout_s:g}s ({why})"
                    # Deferred for a full pool: this receiver is busy, the request is fine elsewhere.
                    self._expire_one(record, TransferState.WAITING, reason, busy=record.defer_reason is not None)
                elif record.defer_reason and now - record.last_defer_sent >= record.keepalive_s:
                    record.last_defer_sent = now
                    self.send(
                        record.identity, Defer(request_id=record.request_id, reason=record.defer_reason)
                    )
            elif record.state == TransferState.TRANSFERRING and now - record.last_activity > self.timeout_s:
                self._expire_one(record, TransferState.TRANSFERRING, f"no data for {self.timeout_s:g}s")

    def _expire_one(self, record: Incoming, state: TransferState, reason: str, busy: bool = False) -> None:
        with record.lock:
            if record.state != state or not record.close_locked(False, f"timed out: {reason}", busy=busy):
                return
        self.table.finished.append(record)
        logger.info("kv transfer %r timed out: %s", record.request_id, reason)
        self.abort_sender(record, f"receiver timed out: {reason}")

    def close_all(self, reason: str) -> None:
        """Fail every live transfer and tell its sender (the receiver is shutting down): one offered
        but not yet given blocks as busy, so its sender's engine may offer it elsewhere as fine."""
        with self.table.lock:
            records = list(self.table.records.values())
        for record in records:
            if self.table.close(record, False, reason, busy=True):
                self.abort_sender(record, reason)
