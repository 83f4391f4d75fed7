"""``KVReceiver``: the decode side. Allocates blocks for offered requests and lets senders fill them.

``poll()`` runs on the engine's thread and is the only place (with ``abort`` and ``close``) that
calls the engine's ``BlockAllocator``; a background I/O thread receives and scatters. A result
with ``ok=True`` hands its ``block_ids`` to the engine; a failed one has already been released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from torch import Tensor

from kvtransfer.blocks.layout import KVLayout
from kvtransfer.blocks.packing import BlockUnpacker, order_after
from kvtransfer.receiving.block_allocator import Allocation, BlockAllocator, Refusal, check_allocation
from kvtransfer.receiving.incoming import Incoming, ReceiverTable
from kvtransfer.receiving.receiver_loop import ReceiverLoop, ReceiverStats
from kvtransfer.transfer_state import ABORTED, TransferResult, TransferState
from kvtransfer.wire.curve import CurveConfig, start_authenticator
from kvtransfer.wire.frames import FrameCursor
from kvtransfer.wire.messages import header_limit
from kvtransfer.wire.sockets import bind_router, bound_address

__all__ = ["Allocation", "BlockAllocator", "KVReceiver", "ReceiverStats", "Refusal", "TransferResult"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 << 20
# Frames queued per connection (ZMQ counts messages): about this many bytes, at least 16 messages.
_RECEIVE_QUEUE_BYTES = 256 << 20


class KVReceiver:
    """Binds ``bind_address`` (tcp:// or ipc://; tcp port 0 picks one, see ``address``)."""

    def __init__(
        self,
        bind_address: str,
        kv_cache: Tensor,
        layout: KVLayout,
        allocator: BlockAllocator,
        *,
        timeout_s: float = 30.0,
        defer_timeout_s: float = 30.0,
        curve: CurveConfig | None = None,
        max_meta_bytes: int = 1 << 20,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        offer_order: Callable[[bytes], Any] | None = None,
    ) -> None:
        """``offer_order``: the order offers waiting for blocks are given them in, as a sort key of an
        offer's ``meta`` (say, the engine's scheduling priority); None: the order they came in. It
        must not raise: a meta it cannot read gets the allocator's refusal later."""
        layout.check_kv_cache(kv_cache)
        self._offer_order = offer_order
        if timeout_s <= 0 or defer_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        self.kv_cache = kv_cache
        self.layout = layout
        self.allocator = allocator
        num_pool_blocks = kv_cache.shape[2]
        self._num_pool_blocks = num_pool_blocks
        # The largest frame: what the whole pool could need, capped, and never below one block-layer.
        frame_limit = max(
            min(max_frame_bytes, num_pool_blocks * layout.bytes_per_block), layout.bytes_per_block_layer
        )
        header_bytes = header_limit(max_meta_bytes, num_pool_blocks)
        self._table = ReceiverTable()
        self._unpacker = BlockUnpacker(kv_cache, layout)
        self._context = zmq.Context()
        self._auth = None
        try:
            self._auth = start_authenticator(self._context, curve) if curve is not None else None
            sock = bind_router(
                self._context,
                bind_address,
                max_msg_size=max(frame_limit, header_bytes),
                timeout_s=timeout_s,
                rcvhwm=max(16, _RECEIVE_QUEUE_BYTES // frame_limit),
                curve=curve,
            )
            self.address: str = bound_address(sock)
            self._loop = ReceiverLoop(
                self._table,
                sock,
                self._unpacker,
                layout,
                timeout_s=timeout_s,
                defer_timeout_s=defer_timeout_s,
                max_meta_bytes=max_meta_bytes,
                max_header_bytes=header_bytes,
                max_frame_bytes=frame_limit,
            )
        except BaseException:
            self._stop_auth()
            self._context.destroy(linger=0)  # closes the socket (and a monitor) too
            self._table.waker.close()
            raise
        self._waiting: list[Incoming] = []  # offers not allocated yet (new or deferred)
        self._early_abort_s = timeout_s + defer_timeout_s
        self._closed = False
        self._reported_dead = False
        self._thread = threading.Thread(target=self._loop.run, name="kv-receiver", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ReceiverStats:
        """Counters of rejected messages, layout mismatches, duplicates and refused connections."""
        return self._loop.stats

    @property
    def num_in_flight(self) -> int:
        """Transfers offered and not yet ended: waiting for blocks, or landing."""
        with self._table.lock:
            return len(self._table.records) + len(self._table.offers) + len(self._waiting)

    def poll(self) -> list[TransferResult]:
        """Allocate for new offers, retry deferred ones, release failed ones; never blocks on I/O.

        Returns the transfers that ended since the last call, each exactly once.
        """
        table = self._table
        if not self._closed and not self._thread.is_alive() and not self._reported_dead:
            self._reported_dead = True  # its transfers were failed on the way out; new ones time out
            logger.error("the kv receiver I/O thread stopped; no new transfers will arrive")
        arrived = bool(table.offers)
        while table.offers:
            record = table.offers.popleft()
            if self._offer_order is not None:
                record.order = self._offer_order(record.meta)
            self._waiting.append(record)
        if arrived and self._offer_order is not None:
            self._waiting.sort(key=lambda r: r.order)  # stable: equal keys keep their arrival order
        self._waiting = [r for r in self._waiting if not r.closed and not self._try_allocate(r)]
        while table.finished:
            self._finalize(table.finished.popleft())
        return table.board.drain()

    def state(self, request_id: str) -> TransferState:
        """Current state of a live or recently finished transfer; ``KeyError`` if unknown."""
        return self._table.board.get(request_id)

    def abort(self, request_id: str) -> None:
        """Fail a transfer now: its blocks are released before this returns and the sender is told.

        Its result (failed) still comes from ``poll``. An id not offered yet is remembered for a
        while and its offer refused (reported as aborted then); a finished one is ignored.
        """
        with self._table.lock:
            record = self._table.records.get(request_id)
            if record is None and not self._table.board.is_live(request_id):
                self._table.abort_early(request_id, self._early_abort_s)
        if record is None or not self._table.close(record, False, ABORTED):
            return
        self._release(record)
        self._table.tell_sender(record, "abort")

    def close(self, timeout_s: float = 5.0) -> None:
        """Fail and release every live transfer (results stay pollable), close the socket."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop_event.set()
        self._table.waker.wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("kv receiver I/O thread did not stop within %gs", timeout_s)
        for record in self._waiting:
            self._table.close(record, False, "receiver closed")
        while self._table.offers:
            self._table.close(self._table.offers.popleft(), False, "receiver closed")
        while self._table.finished:
            self._finalize(self._table.finished.popleft())
        self._stop_auth()
        if not self._thread.is_alive():
            self._context.term()
            self._table.waker.close()

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine-thread internals ------------------------------------------------------------
    def _try_allocate(self, record: Incoming) -> bool:
        """One allocation attempt; ``True`` once the offer is resolved (accepted or failed)."""
        request_id = record.request_id
        try:
            outcome = self.allocator.allocate_for_transfer(
                request_id, record.block_hashes, record.num_tokens, record.meta
            )
        except Exception as exc:
            logger.exception("allocate_for_transfer(%r) raised", request_id)
            if self._table.close(record, False, f"allocator failed: {exc!r}"):
                self._table.tell_sender(record, "abort")
            return True
        if isinstance(outcome, Refusal):
            if self._table.close(record, False, f"refused: {outcome.reason}", busy=outcome.busy):
                self._table.tell_sender(record, "abort")
            return True
        if isinstance(outcome, str):
            if record.defer_reason is None:
                self._table.waker.wake()  # the I/O thread sends the first Defer at once
            record.defer_reason = outcome
            return False
        num_blocks = self.layout.num_blocks_for(record.num_tokens)
        error = check_allocation(outcome, num_blocks, len(record.block_hashes), self._num_pool_blocks)
        if error is not None:
            self.allocator.release_transfer(request_id)
            logger.error("unusable allocation for %r: %s", request_id, error)
            if self._table.close(record, False, f"receiver allocation error: {error}"):
                self._table.tell_sender(record, "abort")
            return True
        dst_ids = self._unpacker.block_ids(outcome.block_ids[outcome.num_cached_blocks :])
        with record.lock:
            if record.closed:  # timed out or aborted by the sender meanwhile
                accepted = False
            else:
                accepted = True
                record.allocation = outcome
                record.dst_ids = dst_ids
                record.cursor = FrameCursor(self.layout.num_layers, num_blocks - outcome.num_cached_blocks)
                record.state = TransferState.TRANSFERRING
                record.last_activity = time.monotonic()
        if not accepted:
            self.allocator.release_transfer(request_id)
            return True
        self._table.board.set(request_id, TransferState.TRANSFERRING)
        self._table.tell_sender(record, "accept")
        return True

    def _release(self, record: Incoming) -> None:
        """Give a closed, failed record's blocks back to the engine, once. Called on the engine's thread
        (``poll``, ``abort``): a GPU scatter still running into them must finish before the engine's
        next writes into the blocks, so its stream waits for the scatter; the engine's thread does
        not. A later transfer's scatter into them goes on the same side stream, after this one."""
        if record.allocation is not None and not record.released:
            order_after(record.last_event, self.kv_cache.device)
            record.released = True
            self.allocator.release_transfer(record.request_id)

    def _finalize(self, record: Incoming) -> None:
        if not record.ok:
            self._release(record)
        with self._table.lock:
            if self._table.records.get(record.request_id) is record:
                del self._table.records[record.request_id]
        self._table.board.finish(record.result())

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
