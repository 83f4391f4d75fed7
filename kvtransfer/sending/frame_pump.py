"""The sender's data path: pack frames ahead of the network, hand them to ZMQ without copying.

A staging buffer goes back to the pool only once ZMQ reports (through its tracker) that it no
longer reads it, which also bounds how far packing runs ahead of the socket. Frames sent as views
of the cache take no staging memory; their trackers only mark progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import zmq

from kvtransfer.blocks.packing import BlockPacker, PackedFrame
from kvtransfer.sending.outgoing import Outgoing, Peer
from kvtransfer.transfer_state import TransferState
from kvtransfer.wire.messages import Data, encode

InFlight = list[tuple[zmq.MessageTracker | None, PackedFrame]]  # None: ZMQ copied every part


class FramePump:
    """Owned by the sender's I/O thread, like the sockets it writes to."""

    def __init__(
        self, packer: BlockPacker, poller: zmq.Poller, fail: Callable[[Outgoing, str], None]
    ) -> None:
        self.packer = packer
        self.poller = poller
        self.fail = fail
        self.draining: InFlight = []  # frames of finished transfers that ZMQ may still read

    def pump(self, peers: Iterable[Peer]) -> bool:
        """Pack and hand over at most one frame per transfer; ``True`` if any frame moved."""
        moved = False
        for peer in list(peers):
            for transfer in list(peer.transfers.values()):
                if transfer.state != TransferState.TRANSFERRING or peer.blocked:
                    continue
                if transfer.staged is None and transfer.frames:
                    assert transfer.send_ids is not None
                    transfer.staged = self.packer.pack(transfer.frames[0], transfer.send_ids, transfer.after)
                    if transfer.staged is None:
                        return moved  # staging memory is full until ZMQ finishes earlier frames
                    transfer.frames.popleft()
                if transfer.staged is not None and transfer.staged.ready():
                    moved |= self._send(peer, transfer, transfer.staged)
        return moved

    def _send(self, peer: Peer, transfer: Outgoing, frame: PackedFrame) -> bool:
        spec = frame.spec
        header = encode(
            Data(
                request_id=transfer.request_id,
                layer_start=spec.layer_start,
                num_layers=spec.num_layers,
                block_start=spec.block_start,
                num_blocks=spec.num_blocks,
            )
        )
        try:
            peer.sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            peer.blocked = True
            self.poller.register(peer.sock, zmq.POLLIN | zmq.POLLOUT)
            return False
        except zmq.ZMQError as exc:
            self.fail(transfer, f"send to {peer.address} failed: {exc}")
            return False
        # Once the first part of a message is queued, ZMQ always takes the rest of it. ZMQ lets
        # go of the parts in order, and pyzmq copies parts under its copy threshold at once: when
        # the last part sent without copying is done, the frame's memory is free again.
        threshold = peer.sock.copy_threshold
        tracked = max(
            (i for i, part in enumerate(frame.parts) if memoryview(part).nbytes >= threshold), default=-1
        )
        tracker: zmq.MessageTracker | None = None
        last = len(frame.parts) - 1
        for i, part in enumerate(frame.parts):
            flags = zmq.NOBLOCK if i == last else zmq.SNDMORE | zmq.NOBLOCK
            sent = peer.sock.send(part, flags, copy=False, track=i == tracked)
            if i == tracked:
                tracker = sent
        transfer.in_flight.append((tracker, frame))
        transfer.staged = None
        transfer.bytes_sent += frame.nbytes
        transfer.last_activity = time.monotonic()
        return True

    def reclaim(self, peers: Iterable[Peer]) -> bool:
        """Free staging buffers ZMQ is done with; ``True`` while packing waits on that."""
        waiting = False
        for peer in peers:
            for transfer in peer.transfers.values():
                if transfer.in_flight:
                    before = len(transfer.in_flight)
                    transfer.in_flight = self._release_done(transfer.in_flight)
                    if len(transfer.in_flight) < before:
                        transfer.last_activity = time.monotonic()  # bytes left: progress
                if transfer.state == TransferState.TRANSFERRING and transfer.has_frames_to_send:
                    waiting |= not peer.blocked
        self.draining = self._release_done(self.draining)
        return waiting

    def retire(self, transfer: Outgoing) -> None:
        """A transfer ended: drop its unsent frames; buffers ZMQ still holds are freed later."""
        if transfer.staged is not None:
            self.packer.release(transfer.staged)
            transfer.staged = None
        self.draining.extend(transfer.in_flight)
        transfer.in_flight = []
        transfer.frames.clear()

    def _release_done(self, frames: InFlight) -> InFlight:
        still: InFlight = []
        for tracker, frame in frames:
            if tracker is None or tracker.done:
                self.packer.release(frame)
            else:
                still.append((tracker, frame))
        return still
