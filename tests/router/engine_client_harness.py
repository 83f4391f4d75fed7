"""An ``EngineClient`` started on a loopback reply socket, with a PUSH socket that plays the engines."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import zmq

from common.gc_pacer import GcPacer
from router.engine_client import EngineClient


@contextlib.asynccontextmanager
async def client_and_engine(gc_pacer: GcPacer | None = None) -> AsyncIterator[tuple[EngineClient, zmq.Socket]]:
    client = EngineClient()
    client.gc_pacer = gc_pacer
    await client.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(client.reply_address)
    try:
        yield client, push
    finally:
        push.close(0)
        ctx.term()
        await client.close()


async def until(predicate: Callable[[], object], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
