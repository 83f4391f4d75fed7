"""The outputs of one engine request on their way from the receive loop to the request's reader.

A deque and at most one waiting future: cheaper per token than ``asyncio.Queue`` (no getter list)
and than ``asyncio.wait_for`` around it (no task per wait). Waits have no timer of their own: the
``EngineClient`` wakes every waiting reader that got no output for ``WAKE_INTERVAL_S`` once per
``WAKE_INTERVAL_S``, and the reader checks its deadlines and its instances' liveness then.

A streaming response may set a ``sink`` (``router/inline_stream.py``): while its reader waits with
nothing queued, an output is first offered to the sink, which may take it there and then.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from common.protocol import RequestOutput

WAKE_INTERVAL_S = 1.0

# Work a sink leaves until its engine message's outputs are all sent: (function, output) pairs, each
# called with the output and the time then (``EngineClient.after_sends``).
AfterSends = list[tuple[Callable[[RequestOutput, float], None], RequestOutput]]


class OutputQueue:
    """Filled by the receive loop (``put_nowait``), read by one consumer (``wait`` then
    ``get_nowait``). Not thread-safe: use from the event loop."""

    __slots__ = ("_items", "_loop", "_waiter", "last_put", "sink", "started_on")

    def __init__(self) -> None:
        self._items: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # The consumer's loop, looked up at its first wait: ``asyncio.get_running_loop`` makes a
        # getpid() system call on Python 3.11, once per token if made per wait.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sink: Callable[[RequestOutput], bool] | None = None
        # When the receive loop last handed it an output (monotonic): a reader with outputs coming
        # needs no wake to check its deadline and its instances (``EngineClient._wake_loop``).
        self.last_put = 0.0
        # The instances that said they run this attempt (``RequestsStarted``), before their first step of it.
        self.started_on: tuple[str, ...] = ()

    def put_nowait(self, output: RequestOutput) -> None:
        sink = self.sink
        # Only to a reader parked in ``wait`` with nothing before this output: whatever the reader
        # is in the middle of, and what is queued, come first.
        if sink is not None and self._waiter is not None and not self._items and sink(output):
            return
        self._items.append(output)
        self.wake()

    def wake(self) -> None:
        """End the consumer's ``wait`` (if it waits), with or without an output."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float | None = None) -> None:
        """Returns at once when an output is queued, else at the next output or ``wake``, or after
        ``timeout_s`` (a timer only for waits that need one shorter than the wake interval)."""
        if self._items:
            return
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout_s, self.wake) if timeout_s is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def get(self) -> RequestOutput:
        """The next output, waiting as long as it takes (wakes without one are skipped)."""
        while not self._items:
            await self.wait()
        return self._items.popleft()

    def get_nowait(self) -> RequestOutput:
        """The next output; ``IndexError`` when there is none."""
        return self._items.popleft()

    def peek(self) -> RequestOutput | None:
        return self._items[0] if self._items else None

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
