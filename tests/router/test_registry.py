"""Registry and prefix index against a real redis-server."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from common import registry
from common.kvcache.hashing import compute_block_hashes
from common.registry import Beat, HeartbeatThread, InstanceInfo, PrefixIndex, Registry


def _ns() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def _info(instance_id: str, role: str = "prefill", **kw: Any) -> InstanceInfo:
    return InstanceInfo(
        instance_id=instance_id, role=role, model="m", control_address="tcp://127.0.0.1:1", **kw
    )


def test_heartbeat_registers_and_role_filter_selects(redis_url: str) -> None:
    reg = Registry(redis_url, namespace=_ns())
    assert reg.heartbeat(_info("p0", num_requests_running=3))
    assert reg.heartbeat(_info("d0", role="decode"))
    assert {i.instance_id for i in reg.instances()} == {"p0", "d0"}
    [p0] = reg.instances("prefill")
    assert p0.num_requests_running == 3
    assert [i.instance_id for i in reg.instances("decode")] == ["d0"]


def test_ttl_expiry_drops_instance_and_its_prefix_entries(redis_url: str) -> None:
    ns = _ns()
    reg = Registry(redis_url, namespace=ns, ttl_s=0.3)
    index = PrefixIndex(redis_url, namespace=ns)
    hashes = compute_block_hashes(list(range(64)), 16, "m")
    reg.heartbeat(_info("p0"))
    reg.heartbeat(_info("p1"))
    index.add("p0", hashes)
    index.add("p1", hashes[:2])
    assert index.match(hashes) == {"p0": 4, "p1": 2}
    time.sleep(0.25)
    reg.heartbeat(_info("p1"))  # only p1 keeps beating
    time.sleep(0.2)
    assert [i.instance_id for i in reg.instances()] == ["p1"]
    assert index.match(hashes) == {"p1": 2}


def test_match_counts_only_leading_blocks(redis_url: str) -> None:
    ns = _ns()
    reg = Registry(redis_url, namespace=ns)
    index = PrefixIndex(redis_url, namespace=ns)
    for name in ("a", "b"):
        reg.heartbeat(_info(name))
    hashes = compute_block_hashes(list(range(80)), 16, "m")
    assert index.add("a", [hashes[0], hashes[1], hashes[3]])  # a gap after block 1
    assert index.add("b", hashes[1:])  # no first block: no prefix at all
    assert index.match(hashes) == {"a": 2}
    assert index.match([]) == {}
    assert index.remove("a", [hashes[1]])
    assert index.match(hashes) == {"a": 1}
    index.clear_instance("a")
    assert index.match(hashes) == {}


def test_a_windowed_model_s_hit_needs_only_the_blocks_its_next_query_reads(
    redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Queries reading 20 keys back, in blocks of 16: a hit ending at block k needs blocks k - 2 and k - 1 only, as
    the engines count it; the longest such end counts, looked for among the prompt's last block ends."""
    ns = _ns()
    reg = Registry(redis_url, namespace=ns)
    index = PrefixIndex(redis_url, namespace=ns)
    for name in ("a", "b", "c", "d"):
        reg.heartbeat(_info(name))
    hashes = compute_block_hashes(list(range(128)), 16, "m")  # 8 blocks
    assert index.add("a", [hashes[0], hashes[1], hashes[3]])  # its hit ends at 2: block 3 alone is no window
    assert index.add("b", hashes[1:])  # its first block went back and was taken: the whole prompt still hits
    assert index.add("c", hashes[4:6])  # a window ending at 6
    assert index.add("d", hashes[7:])  # one block: no window ends there
    assert index.add("gone", hashes[6:])  # holds the last window, but is not registered
    assert index.match(hashes) == {"a": 2}  # without a window: leading blocks only
    assert index.match(hashes, 16, 20) == {"a": 2, "b": 8, "c": 6}
    assert index.match(hashes, 16, 1000) == {"a": 2}  # a window past the prompt needs every block
    monkeypatch.setattr(registry, "WINDOW_PROBE_BLOCKS", 1)  # only the ends at 7 and 8 are looked at
    assert index.match(hashes, 16, 20) == {"a": 2, "b": 8}
    assert index.match([], 16, 20) == {}


def test_deregister_removes_instance_and_blocks(redis_url: str) -> None:
    ns = _ns()
    reg = Registry(redis_url, namespace=ns)
    index = PrefixIndex(redis_url, namespace=ns)
    info = _info("p0")
    reg.heartbeat(info)
    hashes = compute_block_hashes(list(range(32)), 16, "m")
    index.add("p0", hashes)
    reg.deregister(info)
    assert reg.instances() == []
    reg.heartbeat(info)
    assert index.match(hashes) == {}


def test_heartbeat_thread_refreshes_with_fresh_info_and_deregisters(redis_url: str) -> None:
    reg = Registry(redis_url, namespace=_ns(), ttl_s=0.5)
    count = iter(range(1000))
    thread = HeartbeatThread(reg, lambda: _info("p0", num_requests_waiting=next(count)), interval_s=0.1)
    thread.start()
    time.sleep(0.8)  # longer than the TTL: only refreshes keep it alive
    [info] = reg.instances()
    assert info.num_requests_waiting >= 3
    thread.stop()
    thread.stop()
    assert reg.instances() == []


def test_heartbeat_thread_asks_for_republish_when_its_entry_vanishes(redis_url: str) -> None:
    """A Redis restart can fall between two beats, so no beat ever fails: the lost entry is the signal."""
    ns = _ns()
    reg = Registry(redis_url, namespace=ns)
    calls: list[float] = []
    thread = HeartbeatThread(reg, lambda: _info("p0"), interval_s=0.05, on_reconnect=lambda: calls.append(1))
    thread.start()
    try:
        assert _eventually(lambda: len(reg.instances()) == 1)
        time.sleep(0.2)
        assert calls == []  # registering the first time is not a reconnect
        redis.Redis.from_url(redis_url).delete(f"{ns}:instance:p0")  # as a restart or a flush would
        assert _eventually(lambda: len(calls) == 1)
        time.sleep(0.2)
        assert len(calls) == 1
    finally:
        thread.stop()


def test_redis_down_methods_return_and_recover_on_restart(make_redis_server) -> None:
    server = make_redis_server()
    ns = _ns()
    reg = Registry(server.url, namespace=ns)
    index = PrefixIndex(server.url, namespace=ns)
    hashes = compute_block_hashes(list(range(32)), 16, "m")
    assert reg.heartbeat(_info("p0")) is Beat.REGISTERED
    assert reg.heartbeat(_info("p0")) is Beat.REFRESHED
    assert index.add("p0", hashes)
    server.stop()

    started = time.monotonic()
    assert reg.heartbeat(_info("p0")) is Beat.UNREACHABLE
    assert reg.instances() == []
    assert reg.try_instances() is None
    assert index.add("p0", hashes) is False
    assert index.remove("p0", hashes) is False
    assert index.match(hashes) == {}
    assert index.clear_instance("p0") is False
    reg.deregister(_info("p0"))
    assert time.monotonic() - started < 2.0  # no retries with back-off stacking up

    make_redis_server(port=server.port)  # a new, empty server on the same port
    assert _eventually(lambda: reg.heartbeat(_info("p0")) is Beat.REGISTERED)  # the entry was lost
    assert [i.instance_id for i in reg.instances()] == ["p0"]
    assert _eventually(lambda: index.add("p0", hashes))
    assert index.match(hashes) == {"p0": 2}


def _eventually(fn, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not fn():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
