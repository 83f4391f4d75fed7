"""Dead peers, bad input and mismatched layouts: failures are reported and every block comes back."""

from __future__ import annotations

import logging
import pickle
import time

import msgspec
import pytest
import torch

from kvtransfer import KVLayout, KVSender, TransferState
from kvtransfer.wire.frames import MAX_DATA_PARTS
from kvtransfer.wire.messages import (
    Abort,
    Accept,
    Data,
    Hello,
    HelloReply,
    Offer,
    decode_from_receiver,
    decode_from_sender,
    encode,
)
from tests.kvtransfer.conftest import poll_until, wait_for_state
from tests.kvtransfer.kv_data import SMALL, make_kv_cache
from tests.kvtransfer.peer_client import PeerProcess
from tests.kvtransfer.test_transfer import make_receiver, send, start_sender

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout.from_kv_cache(make_kv_cache(SMALL), "m")


class RawSender:
    """A hand-driven DEALER in a peer process, speaking (or breaking) the protocol."""

    def __init__(self, peer: PeerProcess, name: str, address: str) -> None:
        self.peer, self.name = peer, name
        peer.call("raw_dealer", name=name, address=address)

    def send(self, *frames: bytes | int) -> None:
        self.peer.call(
            "raw_send",
            name=self.name,
            frames=[f.hex() if isinstance(f, bytes) else {"size": f} for f in frames],
        )

    def recv(self, timeout_s: float = 3.0) -> object:
        """The next reply, whatever it is (skipping none, so a test sees every reply it caused)."""
        frames = self.peer.call("raw_recv", name=self.name, wait_s=timeout_s)
        assert frames is not None, "no reply"
        return decode_from_receiver(bytes.fromhex(frames[0]), 1 << 24)

    def handshake(self) -> HelloReply:
        """Say hello; the receiver must accept our layout and state its own, equal one."""
        self.send(encode(Hello(layout=LAYOUT)))
        reply = self.recv()
        assert isinstance(reply, HelloReply), reply
        assert reply.ok and reply.reason is None, reply.reason
        assert reply.layout == LAYOUT
        # The well-formed data frames these tests send carry at most 3 blocks of one layer.
        assert reply.max_frame_bytes >= 3 * LAYOUT.bytes_per_block_layer
        return reply

    def handshake_and_offer(self, request_id: str, num_tokens: int) -> Accept:
        self.handshake()
        self.send(encode(Offer(request_id=request_id, num_tokens=num_tokens, block_hashes=[])))
        accept = self.recv()
        assert isinstance(accept, Accept)
        return accept


def offer_and_allocate(raw: RawSender, receiver, pool, request_id: str, num_tokens: int = 12) -> HelloReply:  # type: ignore[no-untyped-def]
    """Handshake, offer ``request_id`` and poll ``receiver`` until it holds blocks for it."""
    reply = raw.handshake()
    raw.send(encode(Offer(request_id=request_id, num_tokens=num_tokens, block_hashes=[])))
    while not pool.held:
        receiver.poll()
    return reply


def data_header(request_id: str, num_blocks: int, layer_start: int = 0, num_layers: int = 1) -> bytes:
    return encode(
        Data(
            request_id=request_id,
            layer_start=layer_start,
            num_layers=num_layers,
            block_start=0,
            num_blocks=num_blocks,
        )
    )


def test_sender_killed_mid_transfer_receiver_frees_within_its_timeout(spawn_peer) -> None:
    victim = spawn_peer()
    receiver, _, pool = make_receiver(timeout_s=1.0)
    with receiver:
        raw = RawSender(victim, "raw", receiver.address)
        raw.handshake()
        raw.send(encode(Offer(request_id="half", num_tokens=12, block_hashes=[])))
        accept = None
        while accept is None:
            receiver.poll()  # the engine allocates here
            frames = victim.call("raw_recv", name="raw", wait_s=0.05)
            accept = frames and decode_from_receiver(bytes.fromhex(frames[0]), 1 << 20)
        assert isinstance(accept, Accept) and pool.held
        raw.send(data_header("half", 3), 3 * LAYOUT.bytes_per_block_layer)  # layer 0 of 3 lands
        time.sleep(0.2)
        assert receiver.state("half") == TransferState.TRANSFERRING
        victim.kill()
        started = time.monotonic()
        [result] = poll_until(receiver, timeout_s=5.0)
        assert not result.ok and "timed out" in (result.reason or "")
        assert time.monotonic() - started < 1.0 + 1.0  # its timeout, plus slack for a busy host
        assert result.bytes_received == 3 * LAYOUT.bytes_per_block_layer
        assert pool.is_clean()


def _hello_by_hand(peer: PeerProcess, name: str, layout: KVLayout, max_frame_bytes: int) -> str:
    """Answer a sender's Hello on the peer's raw ROUTER ``name`` with ``layout``; the sender's identity."""
    identity, hello = peer.call("raw_recv", name=name)
    assert isinstance(decode_from_sender(bytes.fromhex(hello), 1 << 20), Hello)
    reply = HelloReply(ok=True, layout=layout, max_frame_bytes=max_frame_bytes)
    peer.call("raw_send", name=name, frames=[identity, encode(reply).hex()])
    return str(identity)


def _accept_by_hand(peer: PeerProcess, name: str, identity: str, request_id: str, block_ids: list[int],
                    num_cached_blocks: int = 0) -> None:
    """Take the sender's next Offer on the raw ROUTER ``name`` and accept it into ``block_ids``."""
    _, offer = peer.call("raw_recv", name=name)
    assert isinstance(decode_from_sender(bytes.fromhex(offer), 1 << 20), Offer)
    accept = Accept(request_id=request_id, block_ids=block_ids, num_cached_blocks=num_cached_blocks)
    peer.call("raw_send", name=name, frames=[identity, encode(accept).hex()])


def test_receiver_killed_mid_transfer_sender_frees(spawn_peer) -> None:
    victim = spawn_peer()
    address = victim.call("raw_router", name="router", address="tcp://127.0.0.1:0")["address"]
    kv_cache = make_kv_cache({**SMALL, "seed": 1})
    with KVSender(kv_cache, LAYOUT, timeout_s=5.0, layers_per_frame=1, staging_bytes=1) as sender:
        sender.send("orphan", address, [1, 2, 3], [], 12)
        identity = _hello_by_hand(victim, "router", LAYOUT, 1 << 20)
        _accept_by_hand(victim, "router", identity, "orphan", [5, 6, 7])
        _, header, _ = victim.call("raw_recv", name="router")  # the first frame arrived
        assert isinstance(decode_from_sender(bytes.fromhex(header), 1 << 20), Data)
        assert sender.state("orphan") == TransferState.TRANSFERRING
        victim.kill()
        started = time.monotonic()
        [result] = poll_until(sender, timeout_s=5.0)
        assert not result.ok and "disconnected" in (result.reason or "")
        assert time.monotonic() - started < 2.0  # noticed at once, not at the 5 s timeout


def test_receiver_abort_after_the_first_frame_of_a_fragmented_transfer_frees_the_sender(
    peer: PeerProcess,
) -> None:
    # Blocks of 32 KiB per layer's K (or V): runs of 8 go out as views of the cache.
    cache = make_kv_cache(
        {"num_layers": 2, "num_blocks": 40, "block_size": 16, "num_kv_heads": 8, "head_size": 64}
    )
    layout = KVLayout.from_kv_cache(cache, "m")
    block_plane = layout.bytes_per_block_layer // 2
    address = peer.call("raw_router", name="abort-mid", address="tcp://127.0.0.1:0")["address"]
    src_ids = [*range(0, 10), 25, 20, *range(30, 40)]  # a run, two strays, a run
    with KVSender(cache, layout, timeout_s=5.0, layers_per_frame=1, staging_bytes=1) as sender:
        sender.send("mid", address, src_ids, [], 16 * len(src_ids))
        identity = _hello_by_hand(peer, "abort-mid", layout, 1 << 24)
        _accept_by_hand(peer, "abort-mid", identity, "mid", list(range(len(src_ids))))
        _, header, *parts = peer.call("raw_recv", name="abort-mid")
        data = decode_from_sender(bytes.fromhex(header), 1 << 20)
        assert isinstance(data, Data) and (data.layer_start, data.num_layers) == (0, 1)
        # Layer 0's K, then V: each run as it lies in the cache, the strays gathered between them.
        assert [len(p) // 2 // block_plane for p in parts] == [10, 2, 10] * 2
        expected = cache[0, :, src_ids].contiguous().view(torch.uint8).flatten().numpy().tobytes()
        assert b"".join(bytes.fromhex(p) for p in parts) == expected
        assert sender.state("mid") == TransferState.TRANSFERRING
        abort = Abort(request_id="mid", reason="engine went away")
        peer.call("raw_send", name="abort-mid", frames=[identity, encode(abort).hex()])
        [result] = poll_until(sender, timeout_s=5.0)
        assert not result.ok and "receiver aborted: engine went away" in (result.reason or "")
        assert result.bytes_sent <= len(src_ids) * layout.bytes_per_block  # ZMQ may have taken both frames
        deadline = time.monotonic() + 5
        while sender.staging_bytes_in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.staging_bytes_in_use == 0  # the gathered strays' buffer came back
    peer.call("close", name="abort-mid")


def test_receiver_process_killed_while_deferring_sender_frees(spawn_peer) -> None:
    victim = spawn_peer()
    address = victim.call(
        "receiver",
        name="rx",
        address="tcp://127.0.0.1:0",
        cache={**SMALL, "seed": 5},
        reserved=SMALL["num_blocks"],
        defer_timeout_s=30.0,
    )["address"]
    with KVSender(make_kv_cache({**SMALL, "seed": 1}), LAYOUT, timeout_s=10.0) as sender:
        sender.send("waiting", address, [1, 2], [], 8)
        wait_for_state(sender, "waiting", TransferState.WAITING)
        victim.kill()
        [result] = poll_until(sender, timeout_s=5.0)
        assert not result.ok and "disconnected" in (result.reason or "")


def test_malformed_messages_are_rejected_logged_and_survived(peer: PeerProcess, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtransfer")
    receiver, _, pool = make_receiver(max_meta_bytes=4096)
    with receiver:
        raw = RawSender(peer, "malformed", receiver.address)
        offer = Offer(request_id="x", num_tokens=8, block_hashes=[])
        bad = [
            (b"\xc1\xff not msgpack",),
            (pickle.dumps({"type": "hello", "layout": None}),),
            (
                msgspec.msgpack.encode(
                    {"type": "hello", "version": 1, "layout": msgspec.msgpack.Ext(1, b"x")}
                ),
            ),
            (
                msgspec.msgpack.encode(
                    {"type": "hello", "version": 99, "layout": msgspec.to_builtins(LAYOUT)}
                ),
            ),
            (encode(offer),),  # an offer before any handshake
            (encode(Hello(layout=LAYOUT)), b"extra frame"),
        ]
        for frames in bad:
            raw.send(*frames)
        # Only the early offer is answered (its sender learns why), and nothing spoilt the
        # connection: a good hello afterwards is accepted.
        abort = raw.recv()
        assert isinstance(abort, Abort) and abort.request_id == "x", abort
        assert "offer before handshake" in (abort.reason or "")
        raw.handshake()
        raw.send(data_header("nobody", 1), LAYOUT.bytes_per_block_layer)  # data for an unknown request
        raw.send(data_header("nobody", 1), *[8] * (MAX_DATA_PARTS + 1))  # more parts than any frame may have
        raw.send(encode(Offer(request_id="huge-meta", num_tokens=8, block_hashes=[], meta=b"m" * 5000)))
        raw.send(encode(Offer(request_id="too-long", num_tokens=10_000, block_hashes=[])))
        deadline = time.monotonic() + 5
        while receiver.stats.num_rejected_messages < len(bad) + 4 and time.monotonic() < deadline:
            receiver.poll()
            time.sleep(0.01)
        assert receiver.stats.num_rejected_messages == len(bad) + 4
        for needle in (
            "malformed header",
            "unsupported kvtransfer version",
            "offer before handshake",
            "expected 1",
            "data for unknown request",
            f"Data with {MAX_DATA_PARTS + 2} frames, expected 2 to {MAX_DATA_PARTS + 1}",
            "meta of 5000 bytes",
            "the whole pool has",
        ):
            assert needle in caplog.text, needle
        assert "got `ext`" in caplog.text and receiver.poll() == [] and pool.is_clean()
        # Still serving: a real transfer goes through afterwards.
        start_sender(peer, "after-malformed")
        send(peer, "after-malformed", "fine", receiver.address, [3, 4], 8)
        [result] = poll_until(receiver)
        assert result.ok
        pool.finish(result.request_id, result.block_hashes)
        assert pool.is_clean()
    peer.call("close", name="after-malformed")
    peer.call("close", name="malformed")


def test_frame_of_wrong_size_fails_the_transfer_on_both_sides(peer: PeerProcess) -> None:
    receiver, _, pool = make_receiver()
    with receiver:
        raw = RawSender(peer, "wrong-size", receiver.address)
        offer_and_allocate(raw, receiver, pool, "bad-frame")
        assert isinstance(raw.recv(), Accept)
        raw.send(data_header("bad-frame", 3), 3 * LAYOUT.bytes_per_block_layer + 1)
        [result] = poll_until(receiver)
        assert not result.ok and "bad frame" in (result.reason or "")
        abort = raw.recv()
        assert type(abort).__name__ == "Abort" and "bad frame" in abort.reason  # type: ignore[attr-defined]
        assert pool.is_clean()
    peer.call("close", name="wrong-size")


def test_frame_in_parts_lands_and_parts_that_split_a_block_fail_the_transfer(peer: PeerProcess) -> None:
    receiver, kv_cache, pool = make_receiver()
    plane = 3 * LAYOUT.bytes_per_block_layer // 2  # one layer's K (or V) of 3 blocks
    with receiver:
        raw = RawSender(peer, "parts", receiver.address)
        offer_and_allocate(raw, receiver, pool, "in-parts")
        accept = raw.recv()
        assert isinstance(accept, Accept)
        k, v = bytes(range(256)) * (plane // 256), bytes(range(255, -1, -1)) * (plane // 256)
        block = plane // 3
        # Layer 0 in parts of whole blocks that do not follow the planes: K's first block, then
        # its other two with V's first, then V's last two.
        raw.send(data_header("in-parts", 3), k[:block], k[block:] + v[:block], v[block:])
        deadline = time.monotonic() + 5
        while receiver.state("in-parts") == TransferState.TRANSFERRING and time.monotonic() < deadline:
            if bytes(kv_cache[0, 1, accept.block_ids].contiguous().view(torch.uint8).flatten()) == v:
                break
            time.sleep(0.01)
        assert bytes(kv_cache[0, 0, accept.block_ids].contiguous().view(torch.uint8).flatten()) == k
        assert bytes(kv_cache[0, 1, accept.block_ids].contiguous().view(torch.uint8).flatten()) == v
        # 1.5 blocks, then 4.5: the cut falls inside a block's K.
        raw.send(data_header("in-parts", 3, layer_start=1), plane // 2, plane + plane // 2)
        [result] = poll_until(receiver)
        assert not result.ok and "whole block-planes" in (result.reason or "")
        assert result.bytes_received == 2 * plane
        assert isinstance(raw.recv(), Abort)
        assert pool.is_clean()
    peer.call("close", name="parts")


def test_frame_over_the_size_limit_drops_the_connection_and_times_out_clean(peer: PeerProcess) -> None:
    receiver, _, pool = make_receiver(timeout_s=0.5, max_meta_bytes=1024)
    with receiver:
        raw = RawSender(peer, "oversized", receiver.address)
        hello = offer_and_allocate(raw, receiver, pool, "oversized")
        assert hello.max_frame_bytes < 1 << 20
        raw.send(data_header("oversized", 3), 1 << 20)  # far above this receiver's MAXMSGSIZE
        [result] = poll_until(receiver, timeout_s=5.0)
        # ZeroMQ drops the connection: the receiver sees it at its deadline, or at once if it writes to the sender
        # first (its router socket refuses a write to a peer that is gone), whichever comes first on a busy host.
        reason = result.reason or ""
        assert not result.ok and ("timed out" in reason or "sender unreachable" in reason), reason
        assert result.bytes_received == 0
        assert pool.is_clean()
        # Still serving others.
        start_sender(peer, "after-oversized")
        send(peer, "after-oversized", "fine", receiver.address, [3, 4], 8)
        [result] = poll_until(receiver)
        assert result.ok
    peer.call("close", name="after-oversized")
    peer.call("close", name="oversized")


@pytest.mark.parametrize("field", ["block_size", "hash_scheme"])
def test_layout_mismatch_is_a_clear_error_on_both_sides(peer: PeerProcess, field: str) -> None:
    name = f"mismatch-{field}"
    if field == "block_size":
        start_sender(peer, name, cache={**SMALL, "seed": 1, "block_size": 8})
    else:
        peer.call("sender", name=name, cache={**SMALL, "seed": 1}, hash_scheme="md5-v0")
    receiver, _, pool = make_receiver()
    with receiver:
        send(peer, name, "mismatched", receiver.address, [1, 2], 16 if field == "block_size" else 8)
        [result] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert not result.ok and "layout mismatch" in (result.reason or "") and field in (result.reason or "")
        assert not sent["ok"] and "layout mismatch" in sent["reason"] and field in sent["reason"]
        assert receiver.stats.num_layout_mismatches == 1
        assert pool.is_clean() and pool.calls == []
    peer.call("close", name=name)


def test_closing_the_receiver_tells_a_waiting_offer_it_is_busy_and_a_landing_one_it_failed(peer: PeerProcess) -> None:
    """A decode exits (its drain over) holding an offer it never gave blocks: nothing started there, so
    the Abort says busy (the sender's engine sends the request elsewhere as fine); one whose blocks
    were taken failed there, and its Abort does not."""
    receiver, _, pool = make_receiver(reserved=SMALL["num_blocks"] - 3, defer_timeout_s=30.0, timeout_s=30.0)
    raw = RawSender(peer, "raw-closing", receiver.address)
    offer_and_allocate(raw, receiver, pool, "landing")  # 3 blocks: the pool has no more
    assert isinstance(raw.recv(), Accept)
    raw.send(encode(Offer(request_id="waiting", num_tokens=12, block_hashes=[])))
    wait_for_state(receiver, "waiting", TransferState.WAITING)
    receiver.close()
    aborts = {}
    while len(aborts) < 2:
        msg = raw.recv()
        if isinstance(msg, Abort):
            aborts[msg.request_id] = msg
    assert aborts["waiting"].busy and not aborts["landing"].busy, aborts
    assert pool.is_clean()
    peer.call("close", name="raw-closing")


def test_a_receiver_asking_for_blocks_the_sender_gave_back_out_of_the_window_fails_the_transfer(
    peer: PeerProcess,
) -> None:
    """A prefill gives back its blocks out of a sliding window as its chunks go: a receiver that would skip fewer
    of them (another model's window) fails the transfer, told so, instead of receiving blocks now others' KV. One
    that skips them gets the rest, and only the rest."""
    cache = make_kv_cache({**SMALL, "seed": 3})
    address = peer.call("raw_router", name="window", address="tcp://127.0.0.1:0")["address"]
    src_ids = [7, 3, 11, 12, 5]  # the first two are out of the window
    with KVSender(cache, LAYOUT, timeout_s=5.0, layers_per_frame=1) as sender:
        with pytest.raises(ValueError, match="num_released_blocks 5 outside"):
            sender.send("all", address, src_ids, [], 4 * len(src_ids), num_released_blocks=5)
        identity = None
        for request_id, num_cached in (("short", 1), ("skips", 2)):
            sender.send(request_id, address, src_ids, [b"h%d" % i for i in range(4)], 4 * len(src_ids),
                        num_released_blocks=2)
            identity = identity or _hello_by_hand(peer, "window", LAYOUT, 1 << 24)
            _accept_by_hand(peer, "window", identity, request_id, list(range(len(src_ids))), num_cached)
            if num_cached == 1:
                [result] = poll_until(sender, timeout_s=5.0)
                assert not result.ok and "gave back the first 2 (out of the model's window)" in (result.reason or "")
                assert result.bytes_sent == 0
                _, told = peer.call("raw_recv", name="window")
                assert isinstance(decode_from_sender(bytes.fromhex(told), 1 << 20), Abort)
                continue
            for layer in range(LAYOUT.num_layers):
                _, header, *parts = peer.call("raw_recv", name="window")
                data = decode_from_sender(bytes.fromhex(header), 1 << 20)
                assert isinstance(data, Data) and (data.layer_start, data.num_layers) == (layer, 1)
                expected = cache[layer, :, src_ids[2:]].contiguous().view(torch.uint8).flatten().numpy().tobytes()
                assert b"".join(bytes.fromhex(p) for p in parts) == expected
    peer.call("close", name="window")
