"""The sender's records: one request being sent, and one receiver with its connection."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvtransfer.blocks.packing import BlockIds, PackedFrame
from kvtransfer.transfer_state import TransferResult, TransferState
from kvtransfer.wire.frames import FrameSpec


@dataclass(eq=False)
class Outgoing:
    """One request being sent; once queued, only the sender's I/O thread touches it."""

    request_id: str
    peer_address: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    meta: bytes
    after: Any | None = None  # CUDA event: the engine's writes to the blocks
    num_released_blocks: int = 0  # leading blocks out of the window, not held: never to be sent
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.BOOTSTRAPPING
    num_cached_blocks: int = 0
    send_ids: BlockIds | None = None  # the blocks to send
    frames: deque[FrameSpec] = field(default_factory=deque)  # not packed yet
    staged: PackedFrame | None = None  # packed, not handed to ZMQ yet
    in_flight: list[tuple[zmq.MessageTracker | None, PackedFrame]] = field(default_factory=list)
    bytes_sent: int = 0

    @property
    def has_frames_to_send(self) -> bool:
        return bool(self.frames) or self.staged is not None

    def result(self, ok: bool, reason: str | None, *, receiver_busy: bool = False) -> TransferResult:
        return TransferResult(
            request_id=self.request_id,
            ok=ok,
            reason=reason,
            block_ids=self.block_ids,
            num_cached_blocks=self.num_cached_blocks,
            num_tokens=self.num_tokens,
            block_hashes=self.block_hashes,
            meta=self.meta,
            bytes_sent=self.bytes_sent,
            seconds=time.monotonic() - self.started,
            receiver_busy=receiver_busy,
        )


class Peer:
    """One receiver: its DEALER, the monitor of that socket, and the transfers to it."""

    def __init__(self, address: str, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        self.address = address
        self.sock = sock
        self.monitor = monitor
        self.ready = False  # its HelloReply accepted our layout
        self.max_frame_bytes = 0
        self.blocked = False  # ZMQ refused a send (high-water mark); wait for POLLOUT
        self.transfers: dict[str, Outgoing] = {}
        self.idle_since = time.monotonic()
