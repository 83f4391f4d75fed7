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
