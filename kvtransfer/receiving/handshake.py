"""The receiver's side of the handshake: compare layouts, remember each connection's outcome."""

from __future__ import annotations

import logging
from collections import OrderedDict

from kvtransfer.blocks.layout import KVLayout
from kvtransfer.wire.messages import Hello, HelloReply

logger = logging.getLogger(__name__)

NO_HANDSHAKE = "offer before handshake"


class Handshakes:
    """Outcome per ZMQ routing id, for the last ``capacity`` connections. One I/O thread owns it."""

    def __init__(self, layout: KVLayout, max_frame_bytes: int, capacity: int = 4096) -> None:
        self.layout = layout
        self.max_frame_bytes = max_frame_bytes
        self.capacity = capacity
        self._errors: OrderedDict[bytes, str | None] = OrderedDict()

    def hello(self, identity: bytes, msg: Hello) -> HelloReply:
        """Record a sender's layout; the reply carries ours and, on a mismatch, every differing field."""
        diff = self.layout.mismatch(msg.layout)
        error = f"layout mismatch: {diff}" if diff else None
        if error:
            logger.error("sender %s (%s) has a different KV layout: %s", identity.hex(), msg.sender_id, diff)
        self._errors[identity] = error
        self._errors.move_to_end(identity)
        while len(self._errors) > self.capacity:
            self._errors.popitem(last=False)
        return HelloReply(
            ok=error is None, reason=error, layout=self.layout, max_frame_bytes=self.max_frame_bytes
        )

    def error(self, identity: bytes) -> str | None:
        """Why this connection may not offer (``NO_HANDSHAKE`` or a layout mismatch), else ``None``."""
        if identity not in self._errors:
            return NO_HANDSHAKE
        return self._errors[identity]
