"""End-to-end transfers between this process (receiver) and a peer process (sender), real sockets."""

from __future__ import annotations

import time

import pytest
import torch

from kvtransfer import KVLayout, KVReceiver, KVSender, Refusal, TransferState
from kvtransfer.transfer_state import ABORTED
from tests.kvtransfer.block_pool import BlockPool
from tests.kvtransfer.conftest import poll_until, wait_for_state
from tests.kvtransfer.kv_data import SMALL, digest, hashes, make_kv_cache
from tests.kvtransfer.peer_client import PeerProcess

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = SMALL["block_size"]


def make_receiver(address: str = "tcp://127.0.0.1:0", reserved: int = 0, **kwargs: object) -> tuple:
    kv_cache = make_kv_cache({**SMALL, "seed": 2})
    pool = BlockPool(SMALL["num_blocks"], BLOCK_SIZE)
    pool.num_reserved = reserved
    layout = KVLayout.from_kv_cache(kv_cache, "m")
    kwargs = {"timeout_s": 2.0, "defer_timeout_s": 2.0, **kwargs}
    return KVReceiver(address, kv_cache, layout, pool, **kwargs), kv_cache, pool  # type: ignore[arg-type]


def start_sender(peer: PeerProcess, name: str, cache: dict | None = None, **kwargs: object) -> None:
    peer.call("sender", name=name, cache=cache or {**SMALL, "seed": 1}, **kwargs)


def send(
    peer: PeerProcess,
    name: str,
    request_id: str,
    address: str,
    block_ids: list[int],
    num_tokens: int,
    block_hashes: list[bytes] = (),
    meta: bytes = b"",
) -> None:  # type: ignore[assignment]
    peer.call(
        "send",
        name=name,
        request_id=request_id,
        peer=address,
        block_ids=block_ids,
        hashes=[h.hex() for h in block_hashes],
        num_tokens=num_tokens,
        meta=meta.hex(),
    )


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_transfer_lands_bit_exact_in_other_block_ids(peer: PeerProcess, tmp_path, transport: str) -> None:
    name = f"exact-{transport}"
    start_sender(peer, name, layers_per_frame=2)
    address = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path}/rx.sock"
    receiver, kv_cache, pool = make_receiver(address)
    before = kv_cache.clone()
    src_ids = [7, 2, 19, 11, 4]  # 18 tokens: 4 full blocks and a partial one
    with receiver:
        send(peer, name, "req-1", receiver.address, src_ids, 18, hashes("a", 4), meta=b"the request")
        [result] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert result.ok and sent["ok"], (result.reason, sent["reason"])
        assert result.meta == b"the request" and result.num_tokens == 18
        assert result.block_ids != src_ids
        assert digest(kv_cache, result.block_ids) == peer.call("digest", name=name, block_ids=src_ids)
        untouched = [b for b in range(SMALL["num_blocks"]) if b not in result.block_ids]
        assert torch.equal(kv_cache[:, :, untouched], before[:, :, untouched])
        assert sent["bytes_sent"] == result.bytes_received == 5 * receiver.layout.bytes_per_block
        pool.finish(result.request_id, result.block_hashes)
        assert pool.is_clean()
    peer.call("close", name=name)


# Big enough blocks (32 KiB per layer's K or V) that a run of 8 consecutive ones goes out as views
# of the sender's cache.
ZERO_COPY = {"num_layers": 3, "num_blocks": 48, "block_size": 16, "num_kv_heads": 8, "head_size": 64}
MIXED = [*range(30, 40), 2, 0, 27, *range(11, 20)]  # runs and strays mixed
# A receiver pool that hands out runs of several lengths, as a recycled one does.
RECEIVER_RUNS = [*range(40, 48), 3, *range(20, 26), 1, *range(10, 19), 33, 32, *range(5, 8)]


@pytest.mark.parametrize(
    ("src_ids", "receiver"),
    [
        (list(range(5, 25)), "in order"),  # consecutive on both sides: views sent, slices received
        (list(range(5, 25)), "shuffled"),  # consecutive on the sender only
        (MIXED, "in order"),
        (MIXED, "shuffled"),
        (MIXED, "runs"),  # fragmented on both sides, with runs long enough for views
    ],
)
def test_runs_of_consecutive_blocks_land_bit_exact_in_the_receivers_slots(
    peer: PeerProcess, src_ids: list[int], receiver: str
) -> None:
    name = f"runs-{len(src_ids)}-{src_ids[10]}-{receiver}"
    start_sender(peer, name, cache={**ZERO_COPY, "seed": 1}, layers_per_frame=2)
    kv_cache = make_kv_cache({**ZERO_COPY, "seed": 2})
    before = kv_cache.clone()
    pool = BlockPool(ZERO_COPY["num_blocks"], ZERO_COPY["block_size"])
    if receiver == "shuffled":
        pool.free = torch.randperm(len(pool.free), generator=torch.Generator().manual_seed(3)).tolist()
    elif receiver == "runs":
        pool.free = RECEIVER_RUNS[::-1] + [b for b in pool.free if b not in RECEIVER_RUNS]
    expected_ids = pool.free[::-1][: len(src_ids)]
    layout = KVLayout.from_kv_cache(kv_cache, "m")
    num_tokens = 16 * len(src_ids) - 5
    with KVReceiver("tcp://127.0.0.1:0", kv_cache, layout, pool, timeout_s=5.0) as rx:  # type: ignore[arg-type]
        send(peer, name, "runs", rx.address, src_ids, num_tokens)
        [result] = poll_until(rx)
        [sent] = peer.wait_results(name)
        assert result.ok and sent["ok"], (result.reason, sent["reason"])
        assert result.block_ids == expected_ids
        for src_id, dst_id in zip(src_ids, result.block_ids, strict=True):  # block by block, in order
            assert digest(kv_cache, [dst_id]) == peer.call("digest", name=name, block_ids=[src_id])
        untouched = [b for b in range(ZERO_COPY["num_blocks"]) if b not in result.block_ids]
        assert torch.equal(kv_cache[:, :, untouched], before[:, :, untouched])
        assert sent["bytes_sent"] == result.bytes_received == len(src_ids) * layout.bytes_per_block
        pool.finish(result.request_id, result.block_hashes)
    peer.call("close", name=name)


def test_blocks_the_receiver_caches_are_not_sent(peer: PeerProcess) -> None:
    name = "cached"
    start_sender(peer, name)
    receiver, kv_cache, pool = make_receiver()
    bytes_per_block = receiver.layout.bytes_per_block
    prompt = hashes("prompt", 4)
    with receiver:
        send(peer, name, "first", receiver.address, [7, 2, 19, 11, 4], 18, prompt)
        [first] = poll_until(receiver)
        pool.finish(first.request_id, first.block_hashes)  # its 4 full blocks are now cached
        assert peer.wait_results(name)[0]["bytes_sent"] == 5 * bytes_per_block

        # Same first 3 blocks (same prefill blocks too), then 2 new ones: only those 2 travel.
        second_ids = [7, 2, 19, 20, 21]
        send(peer, name, "second", receiver.address, second_ids, 20, prompt[:3] + hashes("other", 2))
        [second] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert second.ok and second.num_cached_blocks == 3 and sent["num_cached_blocks"] == 3
        assert sent["bytes_sent"] == second.bytes_received == 2 * bytes_per_block
        assert digest(kv_cache, second.block_ids) == peer.call("digest", name=name, block_ids=second_ids)
        pool.finish(second.request_id, second.block_hashes)

        # Every block cached: nothing is sent at all, and the transfer still completes.
        send(peer, name, "third", receiver.address, [7, 2, 19, 11], 16, prompt)
        [third] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert third.ok and sent["ok"] and third.num_cached_blocks == 4
        assert sent["bytes_sent"] == third.bytes_received == 0
        pool.finish(third.request_id, third.block_hashes)
        assert pool.is_clean()
    peer.call("close", name=name)


def test_full_receiver_defers_then_completes_when_blocks_free(peer: PeerProcess) -> None:
    name = "defer-ok"
    start_sender(peer, name, timeout_s=1.0)  # shorter than the wait: Defer keepalives hold it open
    receiver, kv_cache, pool = make_receiver(reserved=SMALL["num_blocks"] - 2, defer_timeout_s=10.0)
    with receiver:
        send(peer, name, "big", receiver.address, [1, 2, 3, 4, 5], 20)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert receiver.poll() == []
            time.sleep(0.01)
        assert receiver.state("big") == TransferState.WAITING
        assert peer.call("state", name=name, request_id="big") == TransferState.WAITING
        pool.num_reserved = 0
        [result] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert result.ok and sent["ok"], (result.reason, sent["reason"])
        assert digest(kv_cache, result.block_ids) == peer.call("digest", name=name, block_ids=[1, 2, 3, 4, 5])
        pool.finish(result.request_id, result.block_hashes)
        assert pool.is_clean()
    assert peer.call("pool", name=name)["clean"]
    peer.call("close", name=name)


def test_waiting_offers_get_blocks_in_the_order_the_engine_gives(peer: PeerProcess) -> None:
    """With ``offer_order`` (the decode engine's priority, read from each offer's meta), blocks freed
    go to the offer that sorts first, not to the one that came first."""
    name = "ordered"
    start_sender(peer, name, timeout_s=30.0)
    receiver, _, pool = make_receiver(reserved=SMALL["num_blocks"], defer_timeout_s=30.0,
                                      offer_order=lambda meta: meta[0])
    with receiver:
        send(peer, name, "lax", receiver.address, [1, 2], 8, meta=bytes([9]))
        wait_for_state(receiver, "lax", TransferState.WAITING)
        send(peer, name, "urgent", receiver.address, [3, 4], 8, meta=bytes([1]))
        wait_for_state(receiver, "urgent", TransferState.WAITING)
        pool.num_reserved = SMALL["num_blocks"] - 2  # room for one of them
        [first] = poll_until(receiver)
        assert first.request_id == "urgent" and first.ok
        assert receiver.state("lax") == TransferState.WAITING
        pool.finish(first.request_id, first.block_hashes)
        pool.num_reserved = 0
        [second] = poll_until(receiver)
        assert second.request_id == "lax" and second.ok
        pool.finish(second.request_id, second.block_hashes)
        assert pool.is_clean()
    assert len(peer.wait_results(name, count=2)) == 2
    peer.call("close", name=name)


def test_full_receiver_fails_at_defer_timeout_with_both_pools_clean(peer: PeerProcess) -> None:
    name = "defer-timeout"
    start_sender(peer, name, timeout_s=5.0)
    receiver, _, pool = make_receiver(reserved=SMALL["num_blocks"], defer_timeout_s=0.5)
    with receiver:
        send(peer, name, "never", receiver.address, [1, 2, 3], 12)
        [result] = poll_until(receiver, timeout_s=5.0)
        [sent] = peer.wait_results(name, timeout_s=5.0)
        assert not result.ok and "no free blocks" in (result.reason or "")
        assert not sent["ok"] and "receiver timed out" in sent["reason"]
        # The pool was full: the receiver was busy, not the request wrong (it may go to another decode).
        assert result.receiver_busy and sent["receiver_busy"]
        assert pool.is_clean() and pool.calls.count("release never") == 0  # nothing was allocated
    assert peer.call("pool", name=name)["clean"]
    peer.call("close", name=name)


def test_duplicate_request_id_is_rejected(peer: PeerProcess) -> None:
    start_sender(peer, "dup-a")
    start_sender(peer, "dup-b")
    receiver, _, pool = make_receiver(reserved=SMALL["num_blocks"], defer_timeout_s=10.0)
    with receiver:
        send(peer, "dup-a", "same-id", receiver.address, [1, 2], 8)
        wait_for_state(receiver, "same-id", TransferState.WAITING)
        with pytest.raises(RuntimeError, match="duplicate request id"):  # the same sender: refused at once
            send(peer, "dup-a", "same-id", receiver.address, [3, 4], 8)
        send(peer, "dup-b", "same-id", receiver.address, [3, 4], 8)  # another sender: refused by the receiver
        [rejected] = peer.wait_results("dup-b")
        assert not rejected["ok"] and "duplicate request id" in rejected["reason"]
        assert receiver.stats.num_duplicate_requests == 1
        pool.num_reserved = 0
        [result] = poll_until(receiver)
        assert result.ok and peer.wait_results("dup-a")[0]["ok"]
        pool.finish(result.request_id, result.block_hashes)
        assert pool.is_clean()
    peer.call("close", name="dup-a")
    peer.call("close", name="dup-b")


def test_receiver_abort_releases_at_once_and_tells_the_sender(peer: PeerProcess) -> None:
    name = "rx-abort"
    start_sender(peer, name)
    receiver, _, pool = make_receiver(reserved=SMALL["num_blocks"], defer_timeout_s=10.0)
    with receiver:
        send(peer, name, "to-abort", receiver.address, [1, 2], 8)
        wait_for_state(receiver, "to-abort", TransferState.WAITING)
        receiver.abort("to-abort")
        [result] = poll_until(receiver)
        assert not result.ok and result.reason == ABORTED
        [sent] = peer.wait_results(name)
        assert not sent["ok"] and "receiver aborted" in sent["reason"]
        assert pool.is_clean()
    peer.call("close", name=name)


def test_sender_abort_frees_both_sides(peer: PeerProcess) -> None:
    rx_address = peer.call(
        "receiver",
        name="rx-for-abort",
        address="tcp://127.0.0.1:0",
        cache={**SMALL, "seed": 5},
        reserved=SMALL["num_blocks"],
        defer_timeout_s=10.0,
    )["address"]
    kv_cache = make_kv_cache({**SMALL, "seed": 1})
    layout = KVLayout.from_kv_cache(kv_cache, "m")
    with KVSender(kv_cache, layout, timeout_s=2.0) as sender:
        sender.send("stop-me", rx_address, [1, 2, 3], [], 12)
        wait_for_state(sender, "stop-me", TransferState.WAITING)
        sender.abort("stop-me")
        [result] = poll_until(sender)
        assert not result.ok and result.reason == ABORTED
        [received] = peer.wait_results("rx-for-abort")
        assert not received["ok"] and "sender aborted" in received["reason"]
        assert peer.call("pool", name="rx-for-abort")["clean"]
    peer.call("close", name="rx-for-abort")


def test_abort_before_the_offer_refuses_it_when_it_comes(peer: PeerProcess) -> None:
    name = "early-abort"
    start_sender(peer, name)
    receiver, _, pool = make_receiver()
    with receiver:
        receiver.abort("client-left")  # e.g. the client went away while the prompt was prefilling
        send(peer, name, "client-left", receiver.address, [1, 2], 8)
        [result] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert not result.ok and result.reason == ABORTED and result.block_ids == []
        assert not sent["ok"] and "receiver aborted" in sent["reason"]
        assert pool.calls == [] and pool.is_clean()
        send(peer, name, "client-left", receiver.address, [1, 2], 8)  # forgotten once refused
        [again] = poll_until(receiver)
        assert again.ok
        pool.finish(again.request_id, again.block_hashes)
    peer.call("close", name=name)


def test_send_refuses_bad_arguments_at_once() -> None:
    kv_cache = make_kv_cache(SMALL)
    with KVSender(kv_cache, KVLayout.from_kv_cache(kv_cache, "m")) as sender:
        address = "tcp://127.0.0.1:1"
        for args, error in [
            (("r", address, [1, 2], [], 12), "need 3 blocks"),
            (("r", address, [1, 2, 99], [], 12), "out of range"),
            (("r", address, [1, 2, 3], hashes("h", 4), 12), "at most one"),
            (("r", "http://x", [1, 2, 3], [], 12), "tcp:// or ipc://"),
            (("", address, [1, 2, 3], [], 12), "request_id"),
        ]:
            with pytest.raises(ValueError, match=error):
                sender.send(*args)
        assert sender.poll() == []
        with pytest.raises(KeyError):
            sender.state("r")
    with pytest.raises(ValueError, match="does not match the layout"):
        KVSender(kv_cache, KVLayout.from_kv_cache(make_kv_cache({**SMALL, "block_size": 8}), "m"))


def test_closing_fails_live_transfers_and_still_reports_them() -> None:
    kv_cache = make_kv_cache(SMALL)
    sender = KVSender(kv_cache, KVLayout.from_kv_cache(kv_cache, "m"), timeout_s=30.0)
    sender.send("pending", "tcp://127.0.0.1:1", [1, 2, 3], [], 12)  # nobody listens there
    sender.close()
    [result] = sender.poll()
    assert not result.ok and result.reason == "sender closed" and result.block_ids == [1, 2, 3]
    sender.send("late", "tcp://127.0.0.1:1", [1, 2, 3], [], 12)
    assert [r.reason for r in sender.poll()] == ["sender closed"]


class _RefusingPool(BlockPool):
    """Refuses for good any request whose meta says so (as the engine does a bad or duplicate one)."""

    def allocate_for_transfer(self, request_id, block_hashes, num_tokens, meta=b""):  # type: ignore[no-untyped-def]
        if meta in (b"refuse me", b"busy"):
            self.calls.append(f"refuse {request_id}")
            return Refusal("the engine will not take it", busy=meta == b"busy")
        return super().allocate_for_transfer(request_id, block_hashes, num_tokens, meta)


def test_a_refused_offer_fails_at_once_on_both_sides_without_blocks(peer: PeerProcess) -> None:
    name = "refused"
    start_sender(peer, name)
    kv_cache = make_kv_cache({**SMALL, "seed": 2})
    pool = _RefusingPool(SMALL["num_blocks"], BLOCK_SIZE)
    layout = KVLayout.from_kv_cache(kv_cache, "m")
    # Timeouts far longer than the test: a refusal must not wait for them as a deferral would.
    receiver = KVReceiver("tcp://127.0.0.1:0", kv_cache, layout, pool, timeout_s=60, defer_timeout_s=60)
    with receiver:
        started = time.monotonic()
        send(peer, name, "no", receiver.address, [1, 2], 8, meta=b"refuse me")
        [result] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert time.monotonic() - started < 10
        assert not result.ok and "the engine will not take it" in (result.reason or "")
        assert not sent["ok"]
        assert not result.receiver_busy and not sent["receiver_busy"]  # a refusal for good
        assert pool.calls == ["refuse no"] and pool.is_clean()
    peer.call("close", name=name)


def test_an_offer_refused_as_busy_says_so_on_both_sides(peer: PeerProcess) -> None:
    """A draining engine refuses for a state of its own: the sender learns the request itself is
    fine (its engine sends it elsewhere without counting a loss)."""
    name = "refused-busy"
    start_sender(peer, name)
    kv_cache = make_kv_cache({**SMALL, "seed": 2})
    pool = _RefusingPool(SMALL["num_blocks"], BLOCK_SIZE)
    receiver = KVReceiver("tcp://127.0.0.1:0", kv_cache, KVLayout.from_kv_cache(kv_cache, "m"), pool,
                          timeout_s=60, defer_timeout_s=60)
    with receiver:
        send(peer, name, "later", receiver.address, [1, 2], 8, meta=b"busy")
        [result] = poll_until(receiver)
        [sent] = peer.wait_results(name)
        assert not result.ok and result.receiver_busy and result.block_ids == []
        assert not sent["ok"] and sent["receiver_busy"] and "the engine will not take it" in sent["reason"]
        assert pool.calls == ["refuse later"] and pool.is_clean()
    peer.call("close", name=name)


def test_both_io_threads_make_the_cache_s_gpu_their_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O thread's current device is GPU 0 unless set: for an engine on another GPU, its event
    queries and stream switches made a CUDA context on GPU 0. Each thread sets the cache's device
    first (on the CPU that does nothing; here the call is recorded)."""
    import threading
    import types

    import kvtransfer.blocks.packing as packing
    import kvtransfer.receiving.receiver_loop as receiver_loop
    import kvtransfer.sending.sender_loop as sender_loop

    calls: list[tuple[str, torch.Tensor]] = []
    for module in (sender_loop, receiver_loop):
        monkeypatch.setattr(module, "use_cache_device",
                            lambda cache: calls.append((threading.current_thread().name, cache)))
    rx, kv_cache, _ = make_receiver()
    sender_cache = make_kv_cache({**SMALL, "seed": 1})
    with rx, KVSender(sender_cache, KVLayout.from_kv_cache(sender_cache, "m"), timeout_s=5.0):
        deadline = time.monotonic() + 30.0
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert {id(cache) for _, cache in calls} == {id(kv_cache), id(sender_cache)}
    assert threading.main_thread().name not in {name for name, _ in calls}
    # What it does: nothing for a CPU cache; set_device for a GPU one.
    set_to: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    packing.use_cache_device(kv_cache)
    packing.use_cache_device(types.SimpleNamespace(device=torch.device("cuda", 1)))  # type: ignore[arg-type]
    assert set_to == [torch.device("cuda", 1)]
