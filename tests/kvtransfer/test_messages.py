"""Wire headers and the layout: round trips, and every kind of bad input refused before use."""

from __future__ import annotations

import contextlib
import pickle

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kvcache.hashing import HASH_SCHEME
from common.protocol import ProtocolError
from kvtransfer import KVLayout
from kvtransfer.wire.messages import (
    KV_PROTOCOL_VERSION,
    MAX_BLOCKS_PER_REQUEST,
    Abort,
    Accept,
    Data,
    Defer,
    Done,
    Hello,
    HelloReply,
    Offer,
    decode_from_receiver,
    decode_from_sender,
    encode,
    header_limit,
)

LAYOUT = KVLayout("m", "float32", 30, 3, 64, 16, HASH_SCHEME)
LIMIT = header_limit(1 << 20, 4096)


def test_layout_from_kv_cache_and_its_sizes() -> None:
    kv_cache = torch.empty(30, 2, 10, 16, 3, 64)
    layout = KVLayout.from_kv_cache(kv_cache, "m")
    assert layout == LAYOUT
    assert layout.bytes_per_block_layer == 2 * 16 * 3 * 64 * 4
    assert layout.bytes_per_block == 30 * layout.bytes_per_block_layer
    assert layout.num_blocks_for(2000) == 125 and layout.num_blocks_for(16) == 1
    with pytest.raises(ValueError, match="kv_cache must be"):
        KVLayout.from_kv_cache(torch.empty(30, 10, 16, 3, 64), "m")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVLayout.from_kv_cache(kv_cache.to(torch.int32), "m")


def test_layout_mismatch_names_every_differing_field() -> None:
    other = msgspec.structs.replace(LAYOUT, block_size=32, dtype="bfloat16")
    assert LAYOUT.mismatch(LAYOUT) is None
    assert LAYOUT.mismatch(other) == "dtype: 'float32' != 'bfloat16'; block_size: 16 != 32"


@pytest.mark.parametrize(
    "msg",
    [
        Hello(layout=LAYOUT, sender_id="prefill-0"),
        Offer(request_id="r", num_tokens=33, block_hashes=[b"\x01" * 32] * 2, meta=b"\x00\xff" * 10),
        Data(request_id="r", layer_start=2, num_layers=2, block_start=0, num_blocks=3),
        Abort(request_id="r", reason="because"),
    ],
)
def test_sender_messages_round_trip(msg: msgspec.Struct) -> None:
    assert decode_from_sender(encode(msg), LIMIT) == msg


@pytest.mark.parametrize(
    "msg",
    [
        HelloReply(ok=False, reason="layout mismatch", layout=LAYOUT, max_frame_bytes=1 << 20),
        Accept(request_id="r", block_ids=[4, 9, 1], num_cached_blocks=1),
        Defer(request_id="r", reason="pool full"),
        Done(request_id="r", bytes_received=12),
    ],
)
def test_receiver_messages_round_trip(msg: msgspec.Struct) -> None:
    assert decode_from_receiver(encode(msg), LIMIT) == msg


def _raw(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (pickle.dumps(Abort(request_id="r", reason="x")), "malformed header"),
        (b"\x93\x01\x02", "malformed header"),
        (b"", "malformed header"),
        (
            _raw(type="abort", version=KV_PROTOCOL_VERSION + 1, request_id="r", reason="x"),
            "unsupported kvtransfer version",
        ),
        (_raw(type="abort", request_id="r", reason=msgspec.msgpack.Ext(7, b"payload")), "got `ext`"),
        (
            _raw(
                type="offer", request_id="r", num_tokens=4, block_hashes=[], meta=msgspec.msgpack.Ext(1, b"")
            ),
            "got `ext`",
        ),
        (_raw(type="accept", request_id="r", block_ids=[1], num_cached_blocks=0), "Invalid value 'accept'"),
        (_raw(type="offer", request_id="", num_tokens=4, block_hashes=[]), "length >= 1"),
        (_raw(type="offer", request_id="r", num_tokens=0, block_hashes=[]), "Expected `int` >= 1"),
        (_raw(type="offer", request_id="r", num_tokens=4, block_hashes=[b"x" * 65]), "length <= 64"),
        (_raw(type="offer", request_id="r", num_tokens=4, block_hashes=["not bytes"]), "Expected `bytes`"),
        (
            _raw(type="data", request_id="r", layer_start=-1, num_layers=1, block_start=0, num_blocks=1),
            ">= 0",
        ),
        (_raw(type="data", request_id="r", layer_start=0, num_layers=0, block_start=0, num_blocks=1), ">= 1"),
        (encode(Abort(request_id="r", reason="x")) + b"\x00", "trailing characters"),
    ],
)
def test_bad_headers_are_refused_with_a_reason(raw: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        decode_from_sender(raw, LIMIT)


def test_sizes_and_counts_are_checked_before_decoding() -> None:
    huge = encode(Offer(request_id="r", num_tokens=4, block_hashes=[], meta=b"m" * 2000))
    with pytest.raises(ProtocolError, match="exceeds 1000"):
        decode_from_sender(huge, 1000)
    too_many = _raw(
        type="offer", request_id="r", num_tokens=4, block_hashes=[b"h"] * (MAX_BLOCKS_PER_REQUEST + 1)
    )
    with pytest.raises(ProtocolError, match="length <= "):
        decode_from_sender(too_many, 1 << 30)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error_only(raw: bytes) -> None:
    for decode in (decode_from_sender, decode_from_receiver):
        with contextlib.suppress(ProtocolError):  # any other exception fails the test
            decode(raw, LIMIT)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**40), st.text(max_size=300))
def test_mutated_offers_decode_or_raise_protocol_error_only(
    noise: bytes, num_tokens: int, request_id: str
) -> None:
    raw = bytearray(_raw(type="offer", request_id=request_id, num_tokens=num_tokens, block_hashes=[noise]))
    raw[len(raw) // 2] ^= noise[0]
    try:
        msg = decode_from_sender(bytes(raw), LIMIT)
    except ProtocolError:
        return
    assert isinstance(msg, Offer | Hello | Data | Abort)
