"""The engine's side port: /metrics, /health (alive) and /ready (loaded, registered, not draining)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from common.metrics import EngineMetrics
from common.metrics_server import serve_health_and_metrics
from common.registry import InstanceInfo
from common.service import EngineService


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture()
def served() -> Iterator[SimpleNamespace]:
    metrics = EngineMetrics("decode", "decode-0", "m")
    state = {"ready": False}

    def ready() -> bool:
        if state.get("raise"):
            raise RuntimeError("redis gone")
        return state["ready"]

    server = serve_health_and_metrics("127.0.0.1", 0, metrics.registry, ready)
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}", state=state)
    server.shutdown()
    server.server_close()


def test_ready_is_503_until_the_engine_says_so_and_health_is_always_200(served: SimpleNamespace) -> None:
    assert get(served.url + "/health")[0] == 200
    status, body = get(served.url + "/ready")
    assert status == 503 and json.loads(body) == {"ready": False}
    served.state["ready"] = True
    assert get(served.url + "/ready") == (200, b'{"ready": true}')
    served.state["raise"] = True  # a failing check is "not ready", never a 500 or a dead server
    assert get(served.url + "/ready")[0] == 503
    assert get(served.url + "/health")[0] == 200


def test_metrics_are_still_served_beside_the_probes(served: SimpleNamespace) -> None:
    status, body = get(served.url + "/metrics")
    assert status == 200 and b'pdserve:kv_cache_usage_perc{instance="decode-0"' in body


def fake_service(entries: list[InstanceInfo] | None, draining: bool = False) -> SimpleNamespace:
    calls = []

    def try_instances(role: str | None = None) -> list[InstanceInfo] | None:
        calls.append(role)
        return entries

    return SimpleNamespace(
        role="prefill", instance_id="prefill-0", draining=draining, _stop=threading.Event(),
        _registered=False, registry=SimpleNamespace(try_instances=try_instances), calls=calls,
    )


def info(instance_id: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role="prefill", model="m", control_address="tcp://x:1")


def test_engine_is_ready_once_registered_and_stays_ready_through_a_redis_outage() -> None:
    svc = fake_service([info("prefill-1")])
    assert EngineService.ready(svc) is False  # type: ignore[arg-type]  # another instance, not this one
    svc.registry.try_instances = lambda role=None: [info("prefill-1"), info("prefill-0")]
    assert EngineService.ready(svc) is True  # type: ignore[arg-type]
    svc.registry.try_instances = lambda role=None: None  # Redis down: a hint, not a readiness condition
    assert EngineService.ready(svc) is True  # type: ignore[arg-type]


def test_a_draining_engine_is_not_ready() -> None:
    svc = fake_service([info("prefill-0")], draining=True)
    assert EngineService.ready(svc) is False  # type: ignore[arg-type]
    assert svc.calls == []  # not even asked: draining wins
    assert EngineService.ready(fake_service(None)) is False  # type: ignore[arg-type]  # Redis down, never registered
