"""Fair admission of engine requests: round robin across clients, first come first served within one.

An HTTP request becomes one engine request per prompt (with its n choices). They do not all go to the engines
at once: at most ``capacity()`` are out at the engines (sent and not finished) and the rest wait
here, in one ``Lane`` per HTTP request. Each time a slot frees, the client with waiting work that
holds the fewest slots gets it (ties: the one served longest ago), and within that client its
oldest request. So another client's single prompt beside a 100,000-prompt batch takes the very
next slot that frees. Requests with a ``priority`` (``--scheduling-policy priority``) go first by it,
lower first, whoever sent them; clients take turns among requests of equal priority.

Waiting work is bounded by a number of engine requests and of their prompt tokens. Past the bound a
new HTTP request is refused with a 429 (or a 400 when it alone exceeds the bound, so a retry could
never succeed). A client holding less than its fair share of the bound (the bound divided among the
clients that have work waiting) is let in even then, so one client cannot lock the others out; the
waiting work stays below twice the bound.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.errors import APIError

# Who a request counts against: its API key's cache salt, else the client's address (set per request).
CLIENT_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_client_key", default="")
RETRY_AFTER_S = 1
_RECHECK_S = 0.5  # a waiting lane re-checks the capacity this often (instances may have joined)


class Slot:
    """One engine request's place at the engines; ``release`` (idempotent) hands it to the next."""

    def __init__(self, admission: Admission, key: str) -> None:
        self._admission = admission
        self.key = key
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(self.key)


@dataclass(eq=False)
class Lane:
    """One HTTP request's engine requests, admitted in order. Take each one's ``Slot`` with
    ``next_slot``; ``close`` (idempotent) gives up what has not been admitted yet."""

    key: str
    admission: Admission
    costs: deque[int]  # prompt tokens of each engine request not admitted yet
    granted: deque[Slot] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    priority: int = 0  # lower first, before the turns of clients (``Admission._dispatch``)

    async def next_slot(self) -> Slot:
        """The next engine request's slot, once its turn comes."""
        while not self.granted:
            if self.closed:
                raise RuntimeError("lane is closed")
            self.admission._dispatch()
            if self.granted:
                break
            self.wakeup.clear()
            # Not asyncio.wait_for: before Python 3.12 it returns normally, swallowing a cancellation
            # that arrives as the event is set, and a cancelled lane then waited on for ever.
            recheck = asyncio.get_running_loop().call_later(_RECHECK_S, self.wakeup.set)
            try:
                await self.wakeup.wait()
            finally:
                recheck.cancel()
        return self.granted.popleft()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.admission._drop(self)
        while self.granted:
            self.granted.popleft().release()


class Admission:
    """The router's waiting queue of engine requests. Not thread-safe: use from the event loop.

    ``capacity()`` is read at each dispatch: how many engine requests may be out at once."""

    def __init__(
        self, capacity: Callable[[], int], max_waiting_requests: int, max_queued_tokens: int
    ) -> None:
        if max_waiting_requests < 1 or max_queued_tokens < 1:
            raise ValueError("max_waiting_requests and max_queued_tokens must be at least 1")
        self.capacity = capacity
        self.max_waiting_requests = max_waiting_requests
        self.max_queued_tokens = max_queued_tokens
        self.num_running = 0  # slots handed out and not released
        self.num_waiting = 0  # engine requests in lanes, not admitted
        self.num_queued_tokens = 0
        self._lanes: dict[str, deque[Lane]] = {}  # per client, oldest first; only lanes with work
        self._running: Counter[str] = Counter()  # slots out per client
        self._last_turn: dict[str, int] = {}  # when each client with work last got a slot
        self._num_turns = 0
        self._num_prioritized = 0  # lanes waiting with a nonzero priority: none, the turns alone decide

    # -- entering ------------------------------------------------------------------------------
    def enter(self, key: str, costs: list[int], priority: int = 0) -> Lane:
        """Queue an HTTP request's engine requests (``costs``: prompt tokens of each); raises a
        429 ``APIError`` when the queue is full, a 400 when the request alone exceeds the bound."""
        self.check(key, len(costs), sum(costs))
        lane = Lane(key, self, deque(costs), priority=priority)
        if costs:
            self.num_waiting += len(costs)
            self.num_queued_tokens += sum(costs)
            self._num_prioritized += priority != 0
            if key not in self._lanes:
                self._lanes[key] = deque()
                self._last_turn.setdefault(key, -1)
            self._lanes[key].append(lane)
            self._dispatch()
        return lane

    def check(self, key: str, num: int, tokens: int = 0) -> None:
        """Raise what ``enter`` would for ``num`` engine requests of ``tokens`` prompt tokens."""
        if num > self.max_waiting_requests:
            raise APIError(
                400, f"the request makes {num} engine requests (one per prompt); this server queues at most "
                f"{self.max_waiting_requests} (--max-waiting-requests)", param="prompt", code="request_too_large",
            )
        if tokens > self.max_queued_tokens:
            raise APIError(
                400, f"the request queues {tokens} prompt tokens; this server queues at most "
                f"{self.max_queued_tokens} (--max-queued-tokens)", param="prompt", code="request_too_large",
            )
        if not self._fits(key, num, tokens):
            raise APIError(
                429, f"the server is overloaded: {self.num_waiting} engine requests ({self.num_queued_tokens} "
                f"prompt tokens) are waiting, the bound is {self.max_waiting_requests} "
                f"(--max-waiting-requests) and {self.max_queued_tokens} tokens (--max-queued-tokens); retry later",
                code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def _fits(self, key: str, num: int, tokens: int) -> bool:
        if (self.num_waiting + num <= self.max_waiting_requests
                and self.num_queued_tokens + tokens <= self.max_queued_tokens):
            return True
        lanes = self._lanes.get(key, ())
        num_keys = len(self._lanes) + (key not in self._lanes)
        held = sum(len(lane.costs) for lane in lanes) + num
        held_tokens = sum(sum(lane.costs) for lane in lanes) + tokens
        return held <= self.max_waiting_requests // num_keys and held_tokens <= self.max_queued_tokens // num_keys

    # -- turns ---------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hand free slots out: each to the client with work that holds the fewest slots (of those,
        the one served longest ago), and within a client to its oldest lane; where lanes have
        priorities, only among the lanes of the lowest first."""
        limit = max(1, self.capacity())
        while self.num_running < limit and self._lanes:
            lane = self._next_lane()
            key = lane.key
            lanes = self._lanes[key]
            cost = lane.costs.popleft()
            self.num_waiting -= 1
            self.num_queued_tokens -= cost
            self.num_running += 1
            self._running[key] += 1
            self._last_turn[key] = self._num_turns
            self._num_turns += 1
            lane.granted.append(Slot(self, key))
            lane.wakeup.set()
            if not lane.costs:
                lanes.remove(lane)
                self._num_prioritized -= lane.priority != 0
            if not lanes:
                self._forget_client(key)

    def _next_lane(self) -> Lane:
        turn = lambda k: (self._running[k], self._last_turn[k])  # noqa: E731
        if not self._num_prioritized:
            return self._lanes[min(self._lanes, key=turn)][0]
        best = min(lane.priority for lanes in self._lanes.values() for lane in lanes)
        key = min((k for k, lanes in self._lanes.items() if any(lane.priority == best for lane in lanes)), key=turn)
        return next(lane for lane in self._lanes[key] if lane.priority == best)

    def _forget_client(self, key: str) -> None:
        del self._lanes[key]
        if not self._running[key]:
            del self._running[key]
            self._last_turn.pop(key, None)

    def _release(self, key: str) -> None:
        self.num_running -= 1
        self._running[key] -= 1
        if not self._running[key] and key not in self._lanes:
            del self._running[key]
            self._last_turn.pop(key, None)
        self._dispatch()

    def _drop(self, lane: Lane) -> None:
        """Forget a lane's engine requests that were not admitted."""
        if lane.costs:
            self.num_waiting -= len(lane.costs)
            self.num_queued_tokens -= sum(lane.costs)
            lane.costs.clear()
            self._num_prioritized -= lane.priority != 0
            lanes = self._lanes[lane.key]
            lanes.remove(lane)
            if not lanes:
                self._forget_client(lane.key)

    def check_integrity(self) -> None:
        """The counters match the lanes, every client with work has exactly one turn."""
        lanes = [lane for queue in self._lanes.values() for lane in queue]
        assert self.num_waiting == sum(len(lane.costs) for lane in lanes), "waiting count drifted"
        assert self.num_queued_tokens == sum(sum(lane.costs) for lane in lanes), "token count drifted"
        assert all(lane.costs and not lane.closed for lane in lanes), "an empty or closed lane is queued"
        assert set(self._lanes) <= set(self._last_turn), "a client with work has no turn record"
        assert all(n > 0 or k in self._lanes for k, n in self._running.items()), "an idle client is counted"
        assert self.num_running == sum(self._running.values()), "running count drifted"
        assert self._num_prioritized == sum(lane.priority != 0 for lane in lanes), "prioritized count drifted"
