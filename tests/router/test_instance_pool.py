"""The router's view of the instances, read afresh before a refused or lost request is sent again:
one registry read serves every request that asks at once, a fresh view is kept, and a registry
slower than the bound is not waited for."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from router.instance_pool import InstancePool


class _Registry:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.reads = 0
        self.release = threading.Event()

    def try_instances(self) -> list[Any]:
        self.reads += 1
        if self.delay_s:
            self.release.wait(self.delay_s)
        return []


class _Client:
    last_heard: dict[str, float] = {}

    def connect(self, address: str) -> None:
        pass

    def prune(self, addresses: set[str]) -> None:
        pass


def test_one_read_serves_the_requests_that_ask_at_once_and_a_fresh_view_is_kept() -> None:
    registry = _Registry(delay_s=0.05)
    pool = InstancePool(registry, _Client())  # type: ignore[arg-type]

    async def run() -> None:
        await asyncio.gather(*(pool.refresh_soon() for _ in range(20)))
        assert registry.reads == 1
        await pool.refresh_soon(max_age_s=60)  # just read: kept
        assert registry.reads == 1
        await pool.refresh_soon(max_age_s=0)
        assert registry.reads == 2

    asyncio.run(run())


def test_a_hung_registry_is_not_waited_for() -> None:
    registry = _Registry(delay_s=30)
    pool = InstancePool(registry, _Client())  # type: ignore[arg-type]

    async def run() -> float:
        start = time.monotonic()
        await pool.refresh_soon(max_wait_s=0.2)
        took = time.monotonic() - start
        registry.release.set()  # the read ends; the pool takes its answer
        while pool._refreshing is not None:
            await asyncio.sleep(0.01)
        return took

    assert asyncio.run(run()) < 5
    assert registry.reads == 1


def test_instances_of_another_model_in_the_same_namespace_are_left_out(redis_url: str, caplog: Any) -> None:
    """Two deployments of different models sharing a Redis namespace: a router takes only the instances
    whose model config is its own (another folder name for the same config is the same model), and says
    once which it left out."""
    import logging
    import uuid

    from common.registry import InstanceInfo, Registry

    registry = Registry(redis_url, f"models-{uuid.uuid4().hex[:8]}")
    mine, theirs = "my-llama:0123456789abcdef", "their-qwen:fedcba9876543210"
    for instance_id, model in [("ours", mine), ("ours-elsewhere", "llama-copy:0123456789abcdef"),
                               ("foreign", theirs)]:
        registry.heartbeat(InstanceInfo(instance_id=instance_id, role="decode", model=model,
                                        control_address=f"tcp://127.0.0.1:{1000 + len(instance_id)}"))
    pool = InstancePool(registry, _Client(), model_identity=mine)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="router.instance_pool"):
        for _ in range(3):
            asyncio.run(pool.refresh())
    assert sorted(info.instance_id for info in pool.alive("decode")) == ["ours", "ours-elsewhere"]
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warnings) == 1 and "foreign serves model their-qwen" in warnings[0]
    anyone = InstancePool(registry, _Client())  # type: ignore[arg-type]  # no identity: a router before stand-ins
    asyncio.run(anyone.refresh())
    assert len(anyone.alive("decode")) == 3
    registry.close()
