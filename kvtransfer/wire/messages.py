"""Wire messages of the KV transfer: typed, versioned msgpack headers; block bytes ride beside them.

A message is one multipart ZMQ message: the msgpack header, then (``Data`` only) the frame's
raw bytes in 1 to ``frames.MAX_DATA_PARTS`` parts, each a whole number of block-planes (one
block's K or V in one layer; ``frames.check_parts``).
Decoding checks the size first, then types, lengths and ranges, then the version, before the
caller builds anything from it. No pickle; msgpack extension types fail validation.

Flow (sender S connects to receiver R; Hello and the first Offer are pipelined):
``S Hello -> R HelloReply``, ``S Offer -> R Defer* -> R Accept``, ``S Data* -> R Done``;
either side may send ``Abort`` at any time, after which both free the request's blocks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from common.protocol import MAX_ID_LEN, decode_checked
from kvtransfer.blocks.layout import KVLayout

KV_PROTOCOL_VERSION = 3  # 2: a Data frame may come in several parts; 3: parts of whole block-planes
MAX_HASH_BYTES = 64
MAX_BLOCKS_PER_REQUEST = 1 << 20
MAX_TOKENS_PER_REQUEST = 1 << 28
MAX_META_BYTES = 256 << 20  # static ceiling; a receiver enforces its own, smaller limit
MAX_REASON_LEN = 2048

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_LEN)]
BlockHashBytes = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Positive = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """S -> R, first on every connection: the sender's layout."""

    version: int = KV_PROTOCOL_VERSION
    layout: KVLayout
    sender_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)] = ""


class HelloReply(msgspec.Struct, tag="hello_reply", kw_only=True):
    """R -> S: the receiver's layout, whether it matches, and the largest data frame it takes."""

    version: int = KV_PROTOCOL_VERSION
    ok: bool
    reason: Reason | None = None
    layout: KVLayout
    max_frame_bytes: Positive


class Offer(msgspec.Struct, tag="offer", kw_only=True):
    """S -> R: a request whose KV is ready; ``meta`` is opaque to this layer."""

    version: int = KV_PROTOCOL_VERSION
    request_id: RequestId
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_REQUEST)]
    block_hashes: Annotated[list[BlockHashBytes], msgspec.Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
    meta: Annotated[bytes, msgspec.Meta(max_length=MAX_META_BYTES)] = b""
    # How often the receiver repeats ``Defer`` so a waiting sender knows it is alive.
    keepalive_s: Annotated[float, msgspec.Meta(ge=0.01, le=3600.0)] = 1.0


class Accept(msgspec.Struct, tag="accept", kw_only=True):
    """R -> S: blocks allocated; send all blocks after the first ``num_cached_blocks``."""

    version: int = KV_PROTOCOL_VERSION
    request_id: RequestId
    block_ids: Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
    num_cached_blocks: Count


class Defer(msgspec.Struct, tag="defer", kw_only=True):
    """R -> S: no blocks free yet; repeated every ``keepalive_s`` while the receiver waits."""

    version: int = KV_PROTOCOL_VERSION
    request_id: RequestId
    reason: Reason


class Data(msgspec.Struct, tag="data", kw_only=True):
    """S -> R, followed by the raw frame in 1 to ``MAX_DATA_PARTS`` parts: layers
    ``[layer_start, +num_layers)`` of the sent blocks ``[block_start, +num_blocks)`` (indices into
    the blocks after the cached ones)."""

    version: int = KV_PROTOCOL_VERSION
    request_id: RequestId
    layer_start: Count
    num_layers: Positive
    block_start: Count
    num_blocks: Positive


class Done(msgspec.Struct, tag="done", kw_only=True):
    """R -> S: every block landed; the sender may release its blocks."""

    version: int = KV_PROTOCOL_VERSION
    request_id: RequestId
    bytes_received: Count = 0


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    """Either way: the transfer is over and failed; the receiving side frees its blocks.

    ``busy`` (R -> S only): the receiver ended the offer for a state of its own (draining, closing, its
    pool full past its timeout), before allocating anything; the request is fine to offer elsewhere.
    """

    version: int = KV_PROTOCOL_VERSION
    request_id: RequestId
    reason: Reason
    busy: bool = False


SenderMessage = Hello | Offer | Data | Abort
ReceiverMessage = HelloReply | Accept | Defer | Done | Abort

_encoder = msgspec.msgpack.Encoder()
_from_sender = msgspec.msgpack.Decoder(SenderMessage)
_from_receiver = msgspec.msgpack.Decoder(ReceiverMessage)


def header_limit(max_meta_bytes: int, max_blocks: int) -> int:
    """Largest header either side accepts for requests of at most ``max_blocks`` blocks."""
    return 4096 + max_meta_bytes + max_blocks * (MAX_HASH_BYTES + 8)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of one header."""
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, raw: bytes | memoryview, max_bytes: int) -> msgspec.Struct:
    return decode_checked(  # type: ignore[no-any-return]
        decoder, raw, max_bytes=max_bytes, version=KV_PROTOCOL_VERSION, what="header", protocol="kvtransfer"
    )


def decode_from_sender(raw: bytes | memoryview, max_bytes: int) -> SenderMessage:
    """Validate a header a receiver got; raises ``ProtocolError``, never anything else."""
    return _decode(_from_sender, raw, max_bytes)  # type: ignore[return-value]


def decode_from_receiver(raw: bytes | memoryview, max_bytes: int) -> ReceiverMessage:
    """Validate a header a sender got; raises ``ProtocolError``, never anything else."""
    return _decode(_from_receiver, raw, max_bytes)  # type: ignore[return-value]
