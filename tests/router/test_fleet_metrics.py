"""The router's /metrics re-exports each registered instance's heartbeat state, one family per name."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.registry import InstanceInfo, Registry
from tests.conftest import free_port
from tests.router.fake_engine import MODEL_ID, FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state, wait_until

FLEET_GAUGES = (
    "pdserve:num_requests_running",
    "pdserve:num_requests_waiting",
    "pdserve:kv_cache_usage_perc",
    "pdserve:num_blocks_in_use",
    "pdserve:instance_draining",
)

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[str, Series]:
    """The page and its samples keyed by (name, labels)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def of(instance: str, role: str, model: str) -> frozenset[tuple[str, str]]:
    return frozenset({"instance": instance, "role": role, "model_name": model}.items())


ROUTER = frozenset({"role": "router"}.items())


def _info(instance_id: str, role: str, **load: Any) -> InstanceInfo:
    return InstanceInfo(
        instance_id=instance_id,
        role=role,
        model="model-" + instance_id,
        control_address=f"tcp://127.0.0.1:{free_port()}",
        **load,
    )


@pytest.fixture
def router(redis_url: str, prompts: Any) -> Iterator[tuple[RouterServer, Registry]]:
    namespace = f"fleet-{uuid.uuid4().hex[:8]}"
    registry = Registry(redis_url, namespace, ttl_s=60.0)  # entries stay until deregistered
    state = make_state(prompts, redis_url=redis_url, namespace=namespace)
    with RouterServer(state) as server:
        yield server, registry
    registry.close()


def test_metrics_show_each_instance_heartbeat_state_and_drop_an_instance_that_left(
    router: tuple[RouterServer, Registry],
) -> None:
    server, registry = router
    prefill = _info(
        "prefill-a",
        "prefill",
        num_requests_running=3,
        num_requests_waiting=2,
        kv_cache_usage_perc=0.25,
        num_blocks=100,
        num_blocks_in_use=25,
    )
    decode = _info(
        "decode-b",
        "decode",
        num_requests_running=7,
        kv_cache_usage_perc=0.5,
        num_blocks=128,
        num_blocks_in_use=64,
        draining=True,
    )
    assert registry.heartbeat(prefill) and registry.heartbeat(decode)
    p, d = of("prefill-a", "prefill", "model-prefill-a"), of("decode-b", "decode", "model-decode-b")
    assert wait_until(lambda: ("pdserve:num_requests_running", d) in scrape(server.url)[1], timeout_s=10)

    text, samples = scrape(server.url)
    expected = {
        "pdserve:num_requests_running": (3.0, 7.0),
        "pdserve:num_requests_waiting": (2.0, 0.0),
        "pdserve:kv_cache_usage_perc": (0.25, 0.5),
        "pdserve:num_blocks_in_use": (25.0, 64.0),
        "pdserve:instance_draining": (0.0, 1.0),
    }
    for name, (prefill_value, decode_value) in expected.items():
        assert samples[(name, p)] == prefill_value, name
        assert samples[(name, d)] == decode_value, name
        assert text.count(f"# TYPE {name} gauge") == 1, f"{name} must be one family"
    # The router's own HTTP requests stay in the same family, as its role="router" series.
    assert samples[("pdserve:num_requests_running", ROUTER)] == 0.0

    # Values are read at scrape time: a new heartbeat shows up without anything else happening.
    assert registry.heartbeat(msgspec.structs.replace(prefill, num_requests_waiting=9))
    assert wait_until(
        lambda: scrape(server.url)[1].get(("pdserve:num_requests_waiting", p)) == 9.0, timeout_s=10
    )

    registry.deregister(decode)
    assert wait_until(lambda: not any(labels == d for _, labels in scrape(server.url)[1]), timeout_s=15), (
        "the series of an instance that left the registry are still exported"
    )
    _, samples = scrape(server.url)
    assert all((name, p) in samples for name in FLEET_GAUGES)


def test_metrics_follow_a_request_on_the_router_and_on_the_decode_instance_serving_it(
    redis_url: str, prompts: Any, tokenizer: Any
) -> None:
    namespace = f"fleet-{uuid.uuid4().hex[:8]}"
    reply_tokens = list(
        tokenizer.encode("One two three four five six seven eight.", add_special_tokens=False)
    )
    state = make_state(prompts, redis_url=redis_url, namespace=namespace)
    with (
        FakeCluster(redis_url, namespace, reply_tokens, token_delay_s=1.0) as cluster,
        RouterServer(state) as server,
    ):
        server.wait_ready()
        decode = of("decode-0", "decode", MODEL_ID)

        def running() -> tuple[float | None, float | None]:
            samples = scrape(server.url)[1]
            name = "pdserve:num_requests_running"
            return samples.get((name, ROUTER)), samples.get((name, decode))

        assert running() == (0.0, 0.0)
        body = {
            "model": SERVED_MODEL,
            "prompt": "Count for me, please, slowly.",
            "max_tokens": 40,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            assert wait_until(lambda: running() == (1.0, 1.0), timeout_s=10), running()
        # The client left: the router aborts the request, and the decode instance's next
        # heartbeat reports it idle.
        assert wait_until(lambda: running() == (0.0, 0.0), timeout_s=10), running()
        assert cluster.engine("decode-0").aborts
