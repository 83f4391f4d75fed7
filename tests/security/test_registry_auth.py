"""Registry entries are signed with the cluster key: a reader holding the key drops every entry
that is unsigned, forged or moved, and counts it; the router never routes to such an instance.
Redis credentials travel in the redis URL, unchanged."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import zmq

from common.cluster_key import ClusterKey
from common.registry import Beat, InstanceInfo, PrefixIndex, RedisClient, Registry
from tests.conftest import RedisServer
from tests.router.fake_engine import FakeCluster, FakeEngine
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state, wait_until

pytestmark = pytest.mark.timeout(120)


def _ns() -> str:
    return f"sec-{uuid.uuid4().hex[:8]}"


def _info(instance_id: str, **kw: Any) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role="decode", model="m", control_address="tcp://127.0.0.1:9", **kw)


def _key() -> ClusterKey:
    return ClusterKey(zmq.curve_keypair()[1])


def test_signed_entries_are_read_back_with_the_key_and_without_one(redis_url: str) -> None:
    ns, key = _ns(), _key()
    writer = Registry(redis_url, ns, cluster_key=key)
    assert writer.heartbeat(_info("d0", num_requests_running=3))
    raw = bytes(redis.Redis.from_url(redis_url).get(f"{ns}:instance:d0") or b"")  # type: ignore[arg-type]
    assert raw.startswith(b'{"entry":{') and b'"mac":' in raw
    [mine] = Registry(redis_url, ns, cluster_key=key).instances()
    assert mine == _info("d0", num_requests_running=3)
    assert Registry(redis_url, ns).instances() == [mine], "a reader without a key takes every entry"
    assert writer.num_rejected_entries == 0


def test_a_reader_with_the_key_drops_unsigned_forged_and_moved_entries(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ns, key = _ns(), _key()
    Registry(redis_url, ns, cluster_key=key).heartbeat(_info("good"))
    Registry(redis_url, ns).heartbeat(_info("unsigned"))  # a writer without the key
    Registry(redis_url, ns, cluster_key=_key()).heartbeat(_info("other-cluster"))
    client = redis.Redis.from_url(redis_url)
    signed = bytes(client.get(f"{ns}:instance:good") or b"")  # type: ignore[arg-type]
    assert signed
    # The MAC of a real entry with one byte of the entry changed; and a real entry under another id.
    client.set(f"{ns}:instance:tampered", signed.replace(b'"role":"decode"', b'"role":"prefil"'))
    client.set(f"{ns}:instance:moved", signed)
    client.sadd(f"{ns}:instances", "tampered", "moved")
    reader = Registry(redis_url, ns, cluster_key=key)
    with caplog.at_level(logging.WARNING, logger="common.registry"):
        assert [i.instance_id for i in reader.instances()] == ["good"]
        assert [i.instance_id for i in reader.instances()] == ["good"]
    assert reader.num_rejected_entries == 8, "four bad entries, each counted per read"
    for instance_id in ("unsigned", "other-cluster", "tampered", "moved"):
        assert caplog.text.count(f"ignoring registry entry of {instance_id!r}") == 1, "logged once per instance"
    # Without a key nothing is verified, but an entry under another instance's name is still refused.
    assert {i.instance_id for i in Registry(redis_url, ns).instances()} == {"good", "unsigned", "other-cluster"}


@pytest.fixture
def secured_stack(redis_url: str, prompts: Any) -> Iterator[tuple[RouterServer, ClusterKey, str]]:
    namespace, key = _ns(), _key()
    state = make_state(prompts, redis_url=redis_url, namespace=namespace, cluster_key=key)
    with FakeCluster(redis_url, namespace, [28, 29, 30, 31], cluster_key=key), RouterServer(state) as server:
        server.wait_ready(30)
        yield server, key, namespace


def _ready_counts(url: str) -> dict[str, int]:
    body = httpx.get(f"{url}/ready", timeout=5).json()
    return {role: body.get(role, 0) for role in ("prefill", "decode")}


def test_with_the_key_the_router_serves_and_an_unsigned_engine_is_never_used(
    secured_stack: tuple[RouterServer, ClusterKey, str], redis_url: str
) -> None:
    server, _, namespace = secured_stack
    body = {"model": SERVED_MODEL, "prompt": "hello " * 40, "max_tokens": 4}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert _ready_counts(server.url) == {"prefill": 1, "decode": 1}

    intruder = FakeEngine("decode", "decode-intruder", redis_url, namespace, [28], peers={})  # no key
    intruder.start()
    try:
        def rejected() -> float:
            text = httpx.get(f"{server.url}/metrics", timeout=5).text
            line = next(x for x in text.splitlines() if x.startswith("pdserve:registry_entries_rejected_total"))
            return float(line.split()[-1])

        assert wait_until(lambda: rejected() >= 2, 30), "the router never read the intruder's entry"
        assert server.state.pool.get("decode-intruder") is None
        assert _ready_counts(server.url) == {"prefill": 1, "decode": 1}
        for _ in range(4):
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        assert intruder.requests == []
    finally:
        intruder.stop()


# ---------------------------------------------------------------- Redis credentials
def test_a_password_in_the_redis_url_works_and_a_missing_one_fails_clearly(
    make_redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server: RedisServer = make_redis_server(password="s3cret-pass")
    ns = _ns()
    registry, index = Registry(server.url, ns), PrefixIndex(server.url, ns)
    assert registry.heartbeat(_info("p0")) is Beat.REGISTERED
    assert index.add("p0", [b"\x01" * 32])
    assert [i.instance_id for i in registry.instances()] == ["p0"]
    assert index.match([b"\x01" * 32]) == {"p0": 1}

    no_password = server.url.replace(":s3cret-pass@", "")
    wrong_password = server.url.replace("s3cret-pass", "guess")
    for url in (no_password, wrong_password):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="common.registry"):
            assert Registry(url, ns).heartbeat(_info("p1")) is Beat.UNREACHABLE
            assert Registry(url, ns).try_instances() is None
        assert "refused this service's credentials" in caplog.text
        assert "redis://[USER]:PASSWORD@HOST:PORT/DB" in caplog.text
        assert "s3cret-pass" not in caplog.text, "the password never reaches a log"
    assert [i.instance_id for i in registry.instances()] == ["p0"]


def test_redis_urls_reach_the_client_unchanged() -> None:
    """TLS and ACL users come from the URL as redis-py reads it; nothing here rewrites it."""
    tls = RedisClient("rediss://alice:pw@redis.example:6380/2", "ns")._client.connection_pool
    assert tls.connection_class.__name__ == "SSLConnection"
    kwargs = tls.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["host"], kwargs["port"], kwargs["db"]) == (
        "alice", "pw", "redis.example", 6380, 2,
    )


def test_runtime_lora_adapters_are_kept_signed_and_forged_ones_are_dropped(redis_url: str) -> None:
    """The cluster's runtime-loaded adapters: put, read back, removed; with a key, an entry written without it, under
    another key, with its path changed, or moved to another name is dropped (an engine would load its weights)."""
    from common.registry import RuntimeAdapters

    ns, key = _ns(), _key()
    writer = RuntimeAdapters(redis_url, ns, cluster_key=key)
    assert writer.put("chat", "/adapters/chat") and writer.put("sql", "/adapters/sql")
    assert RuntimeAdapters(redis_url, ns, cluster_key=key).all() == {"chat": "/adapters/chat", "sql": "/adapters/sql"}
    assert writer.remove("sql") and writer.all() == {"chat": "/adapters/chat"}
    RuntimeAdapters(redis_url, ns).put("unsigned", "/tmp/evil")
    RuntimeAdapters(redis_url, ns, cluster_key=_key()).put("other-cluster", "/tmp/evil")
    client = redis.Redis.from_url(redis_url)
    signed = bytes(client.hget(f"{ns}:lora_adapters", "chat") or b"")  # type: ignore[arg-type]
    client.hset(f"{ns}:lora_adapters", "moved", signed)  # a real entry under another name
    client.hset(f"{ns}:lora_adapters", "garbage", b"{not json")
    assert writer.all() == {"chat": "/adapters/chat"}
    # A reader without a key takes every well-formed entry under its own name.
    assert RuntimeAdapters(redis_url, ns).all() == {"chat": "/adapters/chat", "unsigned": "/tmp/evil",
                                                    "other-cluster": "/tmp/evil"}
    client.hset(f"{ns}:lora_adapters", "chat", signed.replace(b"/adapters/chat", b"/adapters/evil"))
    assert writer.all() == {}
    # Redis down: None (the engines keep what they knew), and put and remove say they failed.
    down = RuntimeAdapters("redis://127.0.0.1:1/0", ns)
    assert down.all() is None and not down.put("x", "/x") and not down.remove("x")
