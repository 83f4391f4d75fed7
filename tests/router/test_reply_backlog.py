"""A router whose event loop was held up does not take the engines' unread messages for silence.

Before, a router busy for longer than ``--engine-stall-timeout`` (a 100,000-prompt request's
parsing on a loaded host) judged every engine dead on waking, although their progress messages
sat unread in its reply socket, and migrated every request."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from common.protocol import EngineProgress, encode
from router.engine_client import EngineClient


def _talk(address: str, stop: threading.Event, last_sent: list[float]) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    while not stop.is_set():
        push.send(encode(EngineProgress(instance_id="e1")))
        last_sent[0] = time.monotonic()
        time.sleep(0.05)
    push.close()
    ctx.term()


def test_messages_waiting_unread_are_not_silence_but_a_silent_engine_is() -> None:
    async def run() -> None:
        client = EngineClient()
        await client.start()
        stop = threading.Event()
        last_sent = [0.0]
        talker = threading.Thread(target=_talk, args=(client.reply_address, stop, last_sent), daemon=True)
        talker.start()
        try:
            deadline = time.monotonic() + 30
            while "e1" not in client.last_heard:
                assert time.monotonic() < deadline, "no progress message arrived"
                await asyncio.sleep(0.05)
            since = time.monotonic()
            client.silent_for("e1", since)  # the router reads it now: caught up
            # The stall under test: the event loop held up (no await) until the engine has gone on
            # talking for longer than the 1 s silence bound.
            while last_sent[0] < since + 1.5:
                assert time.monotonic() < since + 30, "the engine stopped talking"
                time.sleep(0.02)
            held = client.silent_for("e1", since)
            assert held < 1.0, f"{held:.1f}s of unread messages counted as silence"
            await asyncio.sleep(0)  # the receive loop reads them
            assert client.silent_for("e1", since) < 1.0
            stop.set()
            talker.join(timeout=10)
            # The engine really is silent now, and nothing waits unread: its silence grows.
            deadline = time.monotonic() + 30
            while client.silent_for("e1", since) <= 1.0:
                assert time.monotonic() < deadline, "a silent engine's silence never counted"
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await client.close()

    asyncio.run(run())
