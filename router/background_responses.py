"""The Responses API's ``background`` mode: a response that runs on after its request has returned,
read back with ``GET /v1/responses/{id}`` and stopped with ``POST /v1/responses/{id}/cancel``.

The request returns at once the response ``in_progress``, already stored. The router process that
took it runs it as a task, and renews a lease on its record (``LEASE_S``, every ``RENEW_S``) until the
response ends: ``completed`` (or ``incomplete`` at ``max_output_tokens``), ``failed`` (an engine's
error), or ``cancelled``. Any router process on the same Redis serves the record, so:

* a cancel that reaches another process marks the record ``cancelled``; the process running it sees
  that at its next renewal (within ``RENEW_S``) and stops, its engine requests aborted as a client's
  disconnect aborts them;
* a process that dies (killed, restarted) stops renewing: once the lease has lapsed, a read finds the
  response ``failed``, saying why, and stores that. Its engine requests end with its router lease.

A background response holds a seat among the router's requests in flight (``--max-inflight``) until
it ends, taken before the request returns (a 429 then, as for any request).

With ``stream`` too, the process running it logs its events in the store as they come, and every
stream of it (the request's own, and ``GET /v1/responses/{id}?stream=true&starting_after=N`` on any
process) reads that log (``router/serving_responses.py``'s ``tail_events``): a client that drops its
connection leaves the response running and picks up where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from router.response_store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

LEASE_S = 10.0  # how long a renewal vouches for a running response
RENEW_S = 2.0  # how often the running process renews (and looks for a cancel from another process)
IN_PROGRESS = "in_progress"  # a background response's status while it runs


def running(record: StoredResponse) -> bool:
    return record.response.get("status") == IN_PROGRESS


def lapsed(record: StoredResponse) -> bool:
    """Whether ``record`` says it runs but no process has vouched for it lately."""
    return running(record) and record.lease_until < time.time()


def leased(record: StoredResponse) -> StoredResponse:
    """``record`` vouched for another ``LEASE_S`` from now."""
    return msgspec.structs.replace(record, lease_until=time.time() + LEASE_S)


def failed_by_loss(record: StoredResponse) -> StoredResponse:
    """``record`` as failed because the process running it stopped."""
    response = {**record.response, "status": "failed", "error": {
        "code": "server_error", "message": "the router process running this background response stopped before "
                                           "it finished; create it again"}}
    return msgspec.structs.replace(record, response=response, lease_until=0.0)


class BackgroundResponses:
    """This process's running background responses: their tasks, and each one's cancel signal."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}

    def start(self, response_id: str, run: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
        """Run ``run(cancelled)`` as a task; ``cancelled`` is set when the response is to stop."""
        cancelled = asyncio.Event()
        task = asyncio.create_task(run(cancelled), name=f"background {response_id}")
        self._running[response_id] = (task, cancelled)
        task.add_done_callback(lambda _: self._running.pop(response_id, None))

    def cancel(self, response_id: str) -> None:
        """Signal the response to stop, if it runs here."""
        if response_id in self._running:
            self._running[response_id][1].set()

    def __len__(self) -> int:
        return len(self._running)

    async def stop(self) -> None:
        """At shutdown: stop every task. Their records' leases then lapse, and readers see them failed."""
        tasks = [task for task, _ in self._running.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def keep_lease(store: ResponseStore, record: StoredResponse, cancelled: asyncio.Event) -> None:
    """Renew ``record``'s lease every ``RENEW_S`` until cancelled (the caller's task ends it); set
    ``cancelled`` when the stored record says it was cancelled, or is gone (deleted)."""
    response_id = record.response["id"]
    while not cancelled.is_set():
        await asyncio.sleep(RENEW_S)
        try:  # renewed only while it runs: a cancel saved since the read is not undone (``update``)
            current = await store.update(response_id, record.owner, lambda r: leased(r) if running(r) else None)
        except Exception:  # the store unreachable: keep running; a read will judge the lease
            logger.warning("background response %s: could not read its record to renew its lease", response_id)
            continue
        if current is None or not running(current):
            cancelled.set()  # cancelled or deleted through another router process
            return
