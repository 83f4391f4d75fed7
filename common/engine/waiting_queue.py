"""The scheduler's queue of waiting requests, in the order the scheduling policy takes them.

``fcfs`` (the default, as vLLM's): arrival order, and a preempted request goes back to the front.
``priority`` (vLLM's ``--scheduling-policy priority``): the lowest ``priority`` value first, arrival
order among equals; a preempted request goes back to its place by that order. The scheduler also
preempts by it (``Scheduler._victim``): the running request that sorts last goes first.

Both take and give requests the same way, so the scheduler does not know which it has. Iterating
copies the queue in one C call first: the heartbeat thread reads it while the engine's thread steps.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Literal

from common.engine.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float]:
    """Where ``req`` sorts under the priority policy: lower first."""
    return req.sampling_params.priority, req.arrival_time


class FcfsQueue:
    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def append(self, req: Request) -> None:
        self._items.append(req)

    def requeue(self, req: Request) -> None:
        """A preempted request: the front, so it runs again first."""
        self._items.appendleft(req)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, req: Request) -> None:
        """``ValueError`` when it is not queued."""
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(tuple(self._items))


class PriorityQueue:
    def __init__(self) -> None:
        # Sorted by (priority, arrival time, order added): ties keep the order requests came in.
        self._keys: list[tuple[int, float, int]] = []
        self._items: list[Request] = []
        self._order = itertools.count()

    def append(self, req: Request) -> None:
        key = (*priority_key(req), next(self._order))
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._items.insert(at, req)

    requeue = append  # a preempted request goes back to its place in the order

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        del self._keys[0]
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        at = next((i for i, r in enumerate(self._items) if r is req), None)
        if at is None:
            raise ValueError("request not queued")
        del self._keys[at], self._items[at]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(tuple(self._items))


def waiting_queue(policy: SchedulingPolicy) -> FcfsQueue | PriorityQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
