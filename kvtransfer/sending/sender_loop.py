"""The sender's I/O thread: one DEALER per receiver, the protocol, timeouts and endings.

The thread owns every socket. Per receiver it sends ``Hello`` and then offers without waiting
(replies arrive in order); a ``FramePump`` moves the data. However a transfer ends, it is
reported once through the ``StateBoard``, and this layer reads the engine's blocks no more.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

import zmq
from torch import Tensor
from zmq.utils.monitor import recv_monitor_message

from common.protocol import ProtocolError
from kvtransfer.blocks.layout import KVLayout
from kvtransfer.blocks.packing import BlockPacker, use_cache_device, use_one_cpu_thread
from kvtransfer.sending.frame_pump import FramePump
from kvtransfer.sending.outgoing import Outgoing, Peer
from kvtransfer.state_board import StateBoard
from kvtransfer.transfer_state import ABORTED, TransferState
from kvtransfer.wire.curve import CurveConfig
from kvtransfer.wire.frames import auto_layers_per_frame, plan_frames
from kvtransfer.wire.messages import (
    Abort,
    Accept,
    Defer,
    Done,
    Hello,
    HelloReply,
    Offer,
    decode_from_receiver,
    encode,
    header_limit,
)
from kvtransfer.wire.sockets import MONITOR_EVENTS, Waker, connect_dealer, describe_event

logger = logging.getLogger(__name__)

IDLE_PEER_S = 60.0  # a connection without transfers for this long is closed


class SenderLoop:
    """Runs in one thread; the engine reaches it only through ``commands`` and the ``board``."""

    def __init__(
        self,
        kv_cache: Tensor,
        layout: KVLayout,
        board: StateBoard,
        waker: Waker,
        *,
        timeout_s: float,
        curve: CurveConfig | None,
        layers_per_frame: int,
        max_frame_bytes: int,
        staging_bytes: int,
        sender_id: str,
    ) -> None:
        self.layout = layout
        self.board = board
        self.waker = waker
        self.timeout_s = timeout_s
        self.curve = curve
        self.layers_per_frame = layers_per_frame
        self.max_frame_bytes = max_frame_bytes
        self.sender_id = sender_id
        self.commands: deque[tuple[str, Any]] = deque()
        self.stop_event = threading.Event()
        self.context = zmq.Context()
        self.packer = BlockPacker(kv_cache, layout, staging_bytes)
        self.max_inbound = header_limit(0, kv_cache.shape[2])
        self.poller = zmq.Poller()
        self.poller.register(waker.fileno(), zmq.POLLIN)  # poll() reports it as this int
        self.pump = FramePump(self.packer, self.poller, lambda t, why: self._fail(t, why, notify=False))
        self.peers: dict[str, Peer] = {}
        self.by_socket: dict[zmq.Socket, Peer] = {}

    def run(self) -> None:
        """Serve until ``stop_event``; on any exit every live transfer is reported failed."""
        use_one_cpu_thread()
        use_cache_device(self.packer.kv_cache)
        try:
            while not self.stop_event.is_set():
                self._step()
        except Exception as exc:  # a bug here must not leave the engine's blocks pinned forever
            logger.exception("kv sender I/O thread failed")
            self._shutdown(f"sender I/O thread failed: {exc!r}")
        else:
            self._shutdown("sender closed")

    def _step(self) -> None:
        self._run_commands()
        moved = self.pump.pump(self.peers.values())
        waiting = self.pump.reclaim(self.peers.values())
        timeout = 0 if moved else (1 if waiting else self._poll_timeout_ms())
        for sock, events in self.poller.poll(timeout):
            if sock == self.waker.fileno():
                self.waker.drain()
                continue
            peer = self.by_socket.get(sock)
            if peer is None:
                continue
            if sock is peer.monitor:
                self._on_monitor(peer)
                continue
            if events & zmq.POLLOUT and peer.blocked:
                peer.blocked = False
                self.poller.register(peer.sock, zmq.POLLIN)
            if events & zmq.POLLIN:
                self._receive(peer)
        self._expire()

    def _poll_timeout_ms(self) -> int:
        deadlines = [
            t.last_activity + self.timeout_s for p in self.peers.values() for t in p.transfers.values()
        ]
        if not deadlines:
            return 100
        return int(min(max((min(deadlines) - time.monotonic()) * 1000, 0), 100)) + 1

    # ---- commands from the engine -------------------------------------------------------------
    def _run_commands(self) -> None:
        while self.commands:
            kind, arg = self.commands.popleft()
            if kind == "send":
                self._start(arg)
            elif kind == "abort":
                for peer in list(self.peers.values()):
                    if arg in peer.transfers:
                        self._fail(peer.transfers[arg], ABORTED, notify=True)

    def _start(self, transfer: Outgoing) -> None:
        try:
            peer = self.peers.get(transfer.peer_address) or self._connect(transfer.peer_address)
        except zmq.ZMQError as exc:
            self.board.finish(transfer.result(False, f"cannot connect to {transfer.peer_address}: {exc}"))
            return
        peer.transfers[transfer.request_id] = transfer
        if peer.ready:
            self._set_state(transfer, TransferState.WAITING)
        offer = Offer(
            request_id=transfer.request_id,
            num_tokens=transfer.num_tokens,
            block_hashes=transfer.block_hashes,
            meta=transfer.meta,
            keepalive_s=max(0.01, min(self.timeout_s / 4.0, 3600.0)),
        )
        try:
            peer.sock.send(encode(offer), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._fail(transfer, f"cannot reach receiver {peer.address}: {exc}", notify=False)

    def _connect(self, address: str) -> Peer:
        sock = connect_dealer(
            self.context, address, max_msg_size=self.max_inbound, timeout_s=self.timeout_s, curve=self.curve
        )
        peer = Peer(address, sock, sock.get_monitor_socket(MONITOR_EVENTS))
        self.peers[address] = peer
        for s in (peer.sock, peer.monitor):
            self.by_socket[s] = peer
            self.poller.register(s, zmq.POLLIN)
        sock.send(encode(Hello(layout=self.layout, sender_id=self.sender_id)), zmq.NOBLOCK)
        return peer

    def _close_peer(self, peer: Peer, linger_ms: int = 0) -> None:
        for sock in (peer.sock, peer.monitor):
            self.poller.unregister(sock)
            self.by_socket.pop(sock, None)
        with contextlib.suppress(zmq.ZMQError):
            peer.sock.disable_monitor()
        peer.monitor.close(0)
        peer.sock.close(linger_ms)
        self.peers.pop(peer.address, None)

    # ---- messages from receivers ---------------------------------------------------------------
    def _receive(self, peer: Peer) -> None:
        for _ in range(256):
            if peer.address not in self.peers:
                return  # closed while handling an earlier message
            try:
                parts = peer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(parts) != 1:
                    raise ProtocolError(f"expected 1 frame, got {len(parts)}")
                msg = decode_from_receiver(parts[0], self.max_inbound)
            except ProtocolError as exc:
                logger.warning("rejected message from receiver %s: %s", peer.address, exc)
                continue
            if isinstance(msg, HelloReply):
                self._on_hello_reply(peer, msg)
                continue
            transfer = peer.transfers.get(msg.request_id)
            if transfer is None:
                logger.debug("%s for a finished or unknown request %r", type(msg).__name__, msg.request_id)
                continue
            transfer.last_activity = time.monotonic()
            if isinstance(msg, Accept):
                self._on_accept(peer, transfer, msg)
            elif isinstance(msg, Done):
                if transfer.state != TransferState.TRANSFERRING or transfer.has_frames_to_send:
                    self._fail(transfer, "receiver acknowledged before every frame was sent", notify=True)
                else:
                    self._finish(transfer, None)
            elif isinstance(msg, Abort):
                self._fail(transfer, f"receiver aborted: {msg.reason}", notify=False, receiver_busy=msg.busy)
            elif isinstance(msg, Defer):
                logger.debug("receiver %s defers %r: %s", peer.address, msg.request_id, msg.reason)

    def _on_hello_reply(self, peer: Peer, msg: HelloReply) -> None:
        diff = self.layout.mismatch(msg.layout)
        if not msg.ok or diff:
            reason = f"layout mismatch with receiver {peer.address}: {diff or msg.reason}"
            logger.error("%s", reason)
            self._fail_peer(peer, reason)
        elif msg.max_frame_bytes < self.layout.bytes_per_block_layer:
            self._fail_peer(peer, f"receiver frame limit {msg.max_frame_bytes} B is below one block-layer")
        else:
            peer.ready = True
            peer.max_frame_bytes = min(msg.max_frame_bytes, self.max_frame_bytes)
            for transfer in peer.transfers.values():
                if transfer.state == TransferState.BOOTSTRAPPING:
                    transfer.last_activity = time.monotonic()
                    self._set_state(transfer, TransferState.WAITING)

    def _on_accept(self, peer: Peer, transfer: Outgoing, msg: Accept) -> None:
        num_blocks = len(transfer.block_ids)
        num_cached = msg.num_cached_blocks
        if transfer.state != TransferState.WAITING:
            self._fail(transfer, f"unexpected Accept in state {transfer.state.name}", notify=True)
            return
        if len(msg.block_ids) != num_blocks or num_cached > min(num_blocks, len(transfer.block_hashes)):
            self._fail(transfer, "receiver sent an inconsistent Accept", notify=True)
            return
        if num_cached < transfer.num_released_blocks:
            self._fail(transfer, f"receiver asks for blocks from {num_cached}, but this sender gave back the first "
                       f"{transfer.num_released_blocks} (out of the model's window)", notify=True)
            return
        transfer.num_cached_blocks = num_cached
        transfer.send_ids = self.packer.block_ids(transfer.block_ids[num_cached:])
        num_to_send = num_blocks - num_cached
        layers_per_frame = self.layers_per_frame or auto_layers_per_frame(
            num_to_send, self.layout.bytes_per_block_layer
        )
        transfer.frames = deque(
            plan_frames(
                self.layout.num_layers,
                num_to_send,
                layers_per_frame,
                self.layout.bytes_per_block_layer,
                peer.max_frame_bytes,
            )
        )
        self._set_state(transfer, TransferState.TRANSFERRING)

    def _on_monitor(self, peer: Peer) -> None:
        try:
            event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] & MONITOR_EVENTS:
            reason = f"{describe_event(event['event'])}: {peer.address}"
            logger.warning("%s", reason)
            self._fail_peer(peer, reason)

    # ---- endings --------------------------------------------------------------------------------
    def _set_state(self, transfer: Outgoing, state: TransferState) -> None:
        transfer.state = state
        self.board.set(transfer.request_id, state)

    def _expire(self) -> None:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            for transfer in list(peer.transfers.values()):
                if now - transfer.last_activity > self.timeout_s:
                    reason = f"timed out after {self.timeout_s:g}s in {transfer.state.name}"
                    self._fail(transfer, reason, notify=True)
            if not peer.transfers and now - peer.idle_since > IDLE_PEER_S:
                self._close_peer(peer)

    def _finish(self, transfer: Outgoing, reason: str | None, *, receiver_busy: bool = False) -> None:
        peer = self.peers.get(transfer.peer_address)
        if peer is not None and peer.transfers.pop(transfer.request_id, None) is not None:
            peer.idle_since = time.monotonic()
        self.pump.retire(transfer)
        self.board.finish(transfer.result(reason is None, reason, receiver_busy=receiver_busy))

    def _fail(self, transfer: Outgoing, reason: str, *, notify: bool, receiver_busy: bool = False) -> None:
        peer = self.peers.get(transfer.peer_address)
        if notify and peer is not None:
            abort = encode(Abort(request_id=transfer.request_id, reason=reason[:1024]))
            with contextlib.suppress(zmq.ZMQError):
                peer.sock.send(abort, zmq.NOBLOCK)
        logger.info("kv transfer %r to %s failed: %s", transfer.request_id, transfer.peer_address, reason)
        self._finish(transfer, reason, receiver_busy=receiver_busy)

    def _fail_peer(self, peer: Peer, reason: str) -> None:
        for transfer in list(peer.transfers.values()):
            self._fail(transfer, reason, notify=False)
        self._close_peer(peer)

    def _shutdown(self, reason: str) -> None:
        while self.commands:
            kind, arg = self.commands.popleft()
            if kind == "send":
                self.board.finish(arg.result(False, reason))
        for peer in list(self.peers.values()):
            for transfer in list(peer.transfers.values()):
                self._fail(transfer, reason, notify=True)
            self._close_peer(peer, linger_ms=100)  # let the Aborts out
        self.context.term()
