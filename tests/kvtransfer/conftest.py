"""Fixtures: peer processes, and engine-like polling of the side that lives in the test process."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtransfer import KVReceiver, KVSender, TransferResult
from tests.kvtransfer.peer_client import PeerProcess


@pytest.fixture(scope="session")
def peer() -> Iterator[PeerProcess]:
    """One long-lived peer process; tests give each object they create a unique name."""
    proc = PeerProcess()
    yield proc
    proc.close()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[[], PeerProcess]]:
    """Fresh peer processes for tests that kill them."""
    started: list[PeerProcess] = []

    def spawn() -> PeerProcess:
        started.append(PeerProcess())
        return started[-1]

    yield spawn
    for proc in started:
        proc.close()


def poll_until(
    side: KVReceiver | KVSender,
    count: int = 1,
    timeout_s: float = 10.0,
    on_result: Callable[[Any], None] | None = None,
) -> list[TransferResult]:
    """Poll like an engine step loop until ``count`` results arrived; ``TimeoutError`` otherwise."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(results)} of {count} results after {timeout_s}s")
        for result in side.poll():
            results.append(result)
            if on_result is not None:
                on_result(result)
        time.sleep(0.002)
    return results


def wait_for_state(side: KVReceiver | KVSender, request_id: str, state: Any, timeout_s: float = 5.0) -> None:
    """Poll like an engine until ``request_id`` is in ``state`` (no result may arrive meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if side.state(request_id) == state:
                return
        except KeyError:
            pass  # not offered yet
        assert side.poll() == [], "finished while waiting for a state"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id} never reached {state}")
        time.sleep(0.002)
