"""The receiver's I/O thread: one ROUTER for all senders; validates, scatters, times out.

Every inbound message is checked (frame count, header size, schema, version, handshake, the
request's owner, the frame's place, its parts and byte length) before anything is allocated or
written. A bad message is logged and dropped; a bad frame of a live transfer fails that transfer
on both sides. Allocation is left to the engine thread (``KVReceiver.poll``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.protocol import ProtocolError
from kvtransfer.blocks.layout import KVLayout
from kvtransfer.blocks.packing import BlockUnpacker, use_cache_device, use_one_cpu_thread, wait
from kvtransfer.log_limit import RateLimitedLog
from kvtransfer.receiving.handshake import NO_HANDSHAKE, Handshakes
from kvtransfer.receiving.incoming import Incoming, ReceiverTable
from kvtransfer.receiving.receiver_outbox import ReceiverOutbox
from kvtransfer.transfer_state import ABORTED, TransferResult, TransferState
from kvtransfer.wire.frames import MAX_DATA_PARTS, FrameSpec, check_parts
from kvtransfer.wire.messages import (
    Abort,
    Data,
    Done,
    Hello,
    Offer,
    decode_from_sender,
)
from kvtransfer.wire.sockets import MONITOR_EVENTS, bound_address, describe_event, remove_ipc_file

logger = logging.getLogger(__name__)


@dataclass
class ReceiverStats:
    """Counters for monitoring and tests; written by the I/O thread only."""

    num_rejected_messages: int = 0
    num_layout_mismatches: int = 0
    num_duplicate_requests: int = 0
    num_failed_handshakes: int = 0


class ReceiverLoop:
    """Runs in one thread; owns the socket, the monitor and the unpacker."""

    def __init__(
        self,
        table: ReceiverTable,
        sock: zmq.Socket,
        unpacker: BlockUnpacker,
        layout: KVLayout,
        *,
        timeout_s: float,
        defer_timeout_s: float,
        max_meta_bytes: int,
        max_header_bytes: int,
        max_frame_bytes: int,
    ) -> None:
        self.table = table
        self.sock = sock
        self.monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        self.unpacker = unpacker
        self.layout = layout
        self.max_meta_bytes = max_meta_bytes
        self.max_header_bytes = max_header_bytes
        self.max_frame_bytes = max_frame_bytes
        self.num_pool_blocks = unpacker.kv_cache.shape[2]
        self.max_parts = 1 + MAX_DATA_PARTS  # a header, then the frame's parts
        self.bytes_per_block_layer = layout.bytes_per_block_layer  # computed once, not per frame
        self.stats = ReceiverStats()
        self.handshakes = Handshakes(layout, max_frame_bytes)
        self.outbox = ReceiverOutbox(sock, table, timeout_s=timeout_s, defer_timeout_s=defer_timeout_s)
        self.log_rejection = RateLimitedLog(logger)
        self.stop_event = threading.Event()
        self.poller = zmq.Poller()
        for item in (sock, self.monitor, table.waker.fileno()):
            self.poller.register(item, zmq.POLLIN)

    def run(self) -> None:
        """Serve until ``stop_event``; on exit tell every live sender the transfer is off."""
        use_one_cpu_thread()
        use_cache_device(self.unpacker.kv_cache)
        try:
            while not self.stop_event.is_set():
                self._step()
        except Exception:  # must not die silently: the engine would wait on timeouts forever
            logger.exception("kv receiver I/O thread failed")
        finally:
            self._shutdown()

    def _step(self) -> None:
        self.outbox.run_commands()
        for item, _ in self.poller.poll(self._poll_timeout_ms()):
            if item is self.sock:
                self._receive()
            elif item is self.monitor:
                self._on_monitor()
            else:
                self.table.waker.drain()
        self.outbox.run_commands()
        self.outbox.expire()

    def _poll_timeout_ms(self) -> int:
        return 20 if self.table.records else 100

    # ---- inbound ----------------------------------------------------------------------------
    def _receive(self) -> None:
        for _ in range(256):
            try:
                identity = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            parts: list[zmq.Frame | None] = []
            while self.sock.getsockopt(zmq.RCVMORE):
                part = self.sock.recv(copy=False)
                if len(parts) < self.max_parts:
                    parts.append(part)
                else:
                    parts.append(None)  # beyond what any message may hold: dropped unread
            try:
                self._dispatch(identity, parts)
            except ProtocolError as exc:
                self._reject(identity, str(exc))

    def _reject(self, identity: bytes, why: str, request_id: str | None = None) -> None:
        self.stats.num_rejected_messages += 1
        self.log_rejection("rejected message from sender %s: %s", identity.hex(), why)
        if request_id is not None:
            self.outbox.send(identity, Abort(request_id=request_id, reason=why[:1024]))

    def _dispatch(self, identity: bytes, parts: list) -> None:
        if not parts or parts[0] is None:
            raise ProtocolError("message without a header")
        msg = decode_from_sender(parts[0].buffer, self.max_header_bytes)
        if isinstance(msg, Data):
            if not 2 <= len(parts) <= self.max_parts:
                raise ProtocolError(f"Data with {len(parts)} frames, expected 2 to {self.max_parts}")
        elif len(parts) != 1:
            raise ProtocolError(f"{type(msg).__name__} with {len(parts)} frames, expected 1")
        if isinstance(msg, Hello):
            reply = self.handshakes.hello(identity, msg)
            self.stats.num_layout_mismatches += not reply.ok
            self.outbox.send(identity, reply)
        elif isinstance(msg, Offer):
            self._on_offer(identity, msg)
        elif isinstance(msg, Data):
            self._on_data(identity, msg, parts[1:])
        elif isinstance(msg, Abort):
            record = self._record_of(identity, msg.request_id)
            if record is not None and self.table.close(record, False, f"sender aborted: {msg.reason}"):
                self.outbox.remember_closed(record)
                logger.info("sender aborted kv transfer %r: %s", msg.request_id, msg.reason)

    def _on_offer(self, identity: bytes, msg: Offer) -> None:
        error = self.handshakes.error(identity)
        if error is not None:
            self._reject(identity, error, msg.request_id)
            if error != NO_HANDSHAKE and not self.table.board.is_live(msg.request_id):
                # A layout mismatch is reported on this side too, not only logged.
                failed = TransferResult(
                    msg.request_id, False, error, num_tokens=msg.num_tokens, meta=msg.meta
                )
                self.table.board.finish(failed)
            return
        error = self._check_offer(msg)
        if error is not None:
            self._reject(identity, error, msg.request_id)
            return
        record = Incoming(
            msg.request_id, identity, msg.num_tokens, list(msg.block_hashes), msg.meta, msg.keepalive_s
        )
        # One critical section, so an engine ``abort`` either finds the record or is seen here.
        with self.table.lock:
            aborted = self.table.take_early_abort_locked(msg.request_id)
            duplicate = not aborted and msg.request_id in self.table.records
            if not aborted and not duplicate:
                self.table.records[msg.request_id] = record
                self.table.board.start(msg.request_id, TransferState.WAITING)
        if aborted:
            self.outbox.send(identity, Abort(request_id=msg.request_id, reason=ABORTED))
            self.table.board.finish(
                TransferResult(msg.request_id, False, ABORTED, num_tokens=msg.num_tokens, meta=msg.meta)
            )
        elif duplicate:
            self.stats.num_duplicate_requests += 1
            self._reject(identity, f"duplicate request id {msg.request_id!r}", msg.request_id)
        else:
            self.outbox.recently_closed.pop(msg.request_id, None)
            self.table.offers.append(record)

    def _check_offer(self, msg: Offer) -> str | None:
        num_blocks = self.layout.num_blocks_for(msg.num_tokens)
        if num_blocks > self.num_pool_blocks:
            return f"request needs {num_blocks} blocks, the whole pool has {self.num_pool_blocks}"
        if len(msg.block_hashes) > num_blocks:
            return f"{len(msg.block_hashes)} block hashes for {num_blocks} blocks"
        if len(msg.meta) > self.max_meta_bytes:
            return f"meta of {len(msg.meta)} bytes exceeds {self.max_meta_bytes}"
        return None

    def _record_of(self, identity: bytes, request_id: str) -> Incoming | None:
        with self.table.lock:
            record = self.table.records.get(request_id)
        return record if record is not None and record.identity == identity else None

    def _on_data(self, identity: bytes, msg: Data, frames: list[zmq.Frame | None]) -> None:
        record = self._record_of(identity, msg.request_id)
        if (record is None and self.outbox.recently_closed.get(msg.request_id) == identity) or (
            record and record.closed
        ):
            logger.debug("late data for failed kv transfer %r", msg.request_id)
            return
        if record is None:
            raise ProtocolError(f"data for unknown request {msg.request_id!r}")
        if record.state != TransferState.TRANSFERRING or record.cursor is None:
            raise ProtocolError(f"data for {msg.request_id!r} before it was accepted")
        assert record.dst_ids is not None
        spec = FrameSpec(msg.layer_start, msg.num_layers, msg.block_start, msg.num_blocks)
        expected = spec.num_layers * spec.num_blocks * self.bytes_per_block_layer
        error = record.cursor.check(spec)
        if error is None:
            error = check_parts(
                [len(f) if f is not None else 0 for f in frames], spec, self.bytes_per_block_layer
            )
        if error is not None:
            self._reject(identity, f"bad frame for {msg.request_id!r}: {error}")
            if self.table.close(record, False, f"bad frame: {error}"):
                self.outbox.abort_sender(record, f"bad frame: {error}")
            return
        with record.lock:
            if record.closed:
                return
            buffers = [f.buffer for f in frames if f is not None]
            record.last_event = self.unpacker.unpack(spec, record.dst_ids, buffers)
            record.cursor.advance(spec)
            record.bytes_received += expected
            record.last_activity = time.monotonic()
            complete = record.cursor.done
            if complete:
                wait(record.last_event)
                record.close_locked(True, None)
        if complete:
            self.table.finished.append(record)
            self.outbox.send(identity, Done(request_id=msg.request_id, bytes_received=record.bytes_received))

    def _on_monitor(self) -> None:
        try:
            event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] & (MONITOR_EVENTS & ~zmq.EVENT_DISCONNECTED):
            self.stats.num_failed_handshakes += 1
            logger.warning("refused a sender connection: %s", describe_event(event["event"]))
        elif event["event"] & zmq.EVENT_DISCONNECTED:
            logger.info("a sender connection closed (a frame over %d B also closes it)", self.max_frame_bytes)

    def _shutdown(self) -> None:
        self.outbox.close_all("receiver closed")
        self.poller.unregister(self.monitor)
        self.sock.disable_monitor()
        self.monitor.close(0)
        endpoint = bound_address(self.sock)
        self.sock.close(100)
        remove_ipc_file(endpoint)
