"""Garbage collections where a process can afford them, not wherever an allocation tips the count.

CPython collects the young generation when its count of container allocations (less deallocations)
passes a threshold: inside whatever allocates next. In the router that is mostly the fan-out of an
engine step to its streams, and the pause (milliseconds, once hundreds of streams' objects are
young; 15-18 ms measured at 512 streams with arrivals spread) delays every token of the step still
to be sent. The count also undercounts: a long-lived object freed lowers it, so with streams ending
as others start the young generation grows well past the threshold before it is collected.

``GcPacer`` keeps CPython's thresholds and, when its owner calls ``collect`` at a quiet point (the
router: an engine message's outputs all sent, no other message waiting) once the young count has
reached a fraction of the threshold (``due``), runs the collection CPython would have chosen: the
oldest generation whose count passed its threshold. Where quiet points come often enough, the young
generation is collected there, before an allocation would have; where they do not (a burst of
requests arriving at once), the automatic collections run as they always did, no larger.

Because the count undercounts, a quiet point also collects the young generation once
``max_interval_s`` (1 s) has passed since the pacer's last collection, whatever the count says:
with 512 streams ending as others start (the router bench's staggered arrivals), the count stayed
under the threshold while the young generation grew to 87,000 objects, collected at last in one
26-64 ms pause; each stream holds about 190 tracked objects (its request's coroutines, cells,
lists, the server's per-connection objects). Collected every second, the young generation holds
what a second allocates.

Those per-stream objects live as long as their streams (seconds to minutes), and each collection of
the middle generation scans them all again: about 100,000 at 512 streams, tens of milliseconds.
Across a streaming run the collections found no cyclic garbage at all (0 unreachable objects in
every young collection once the streams ran): the router's objects die by reference counting.
So the router's pacer freezes survivors (``freeze_survivors``): each paced collection is a young
one, after which everything alive is frozen (``gc.freeze``: never scanned again, still freed by
reference counting when it dies). A collection then costs what the last second allocated. Cyclic
garbage among frozen objects would wait: every ``full_interval_s`` (10 minutes) a quiet point
unfreezes everything and runs one full collection (start-up's objects included: about 100,000,
34 ms here), then freezes again.

Frozen survivors make a collection cost only what it finds young, so the router collects in small
pieces: from 2,000 young objects or 0.1 s on (``router.main.router_gc_pacer``). The collector's
time stays the same in all, cut into pauses a tenth as long: at 512 streams with arrivals spread,
over three alternated pairs of runs, 16-17 paced collections per run of 60-118 ms in all, each
under 10-20 ms, became 145-148 of 79-92 ms in all, each under 5 ms (0.55-0.63 ms on average).

``GcPauses`` times every collection of the process (``gc.callbacks``) for a histogram, labelled by
whether the pacer or an allocation started it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

DEFAULT_THRESHOLDS = (20_000, 20, 20)  # allocations per young collection (CPython's default: 700)
EARLY = 0.75  # a quiet point collects the young generation from this fraction of its threshold on
MAX_INTERVAL_S = 1.0  # ... and once this long has passed since the pacer's last collection
FULL_INTERVAL_S = 600.0  # freezing survivors: a full collection, everything unfrozen, this often


class GcPacer:
    """Collections at the points its owner calls ``collect`` (after checking ``due``)."""

    def __init__(
        self, thresholds: tuple[int, int, int] = DEFAULT_THRESHOLDS, due_objects: int | None = None,
        max_interval_s: float = MAX_INTERVAL_S, freeze_survivors: bool = False,
        full_interval_s: float = FULL_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``due_objects``: the young count from which a quiet point collects (default: ``EARLY`` of
        the young threshold); at most that threshold."""
        due_at = max(1, int(thresholds[0] * EARLY)) if due_objects is None else due_objects
        if min(thresholds) < 1 or not 1 <= due_at <= thresholds[0] or max_interval_s <= 0 or full_interval_s <= 0:
            raise ValueError(f"thresholds {thresholds}, max_interval_s {max_interval_s} and full_interval_s "
                             f"{full_interval_s} must be positive and due_objects {due_at} in [1, {thresholds[0]}]")
        self.thresholds = thresholds
        self._due_at = due_at
        self.max_interval_s = max_interval_s
        self.freeze_survivors = freeze_survivors
        self.full_interval_s = full_interval_s
        self._clock = clock
        self._collected_at = self._full_at = clock()
        self.pacing = False  # within a collection this pacer started
        self.num_collections = [0, 0, 0]  # by generation

    def install(self) -> None:
        """Set the process's thresholds (the automatic collections')."""
        gc.set_threshold(*self.thresholds)

    def due(self) -> bool:
        """A young collection may run now (cheap: call it as often as convenient)."""
        return gc.isenabled() and (
            gc.get_count()[0] >= self._due_at or self._clock() - self._collected_at >= self.max_interval_s
        )

    def collect(self) -> int:
        """Run the collection CPython would choose now (it skips a full one while few objects were
        added to the oldest generation since the last; that count is not readable here, so a full
        collection comes every ``t1 * t2`` young ones); its generation. Freezing survivors: a young
        collection, whose survivors are then frozen, or every ``full_interval_s`` a full one over
        everything (unfrozen first, frozen again after)."""
        if self.freeze_survivors:
            generation = 2 if self._clock() - self._full_at >= self.full_interval_s else 0
        else:
            _, count1, count2 = gc.get_count()
            _, t1, t2 = self.thresholds
            generation = 2 if count2 >= t2 else 1 if count1 >= t1 else 0
        self.pacing = True
        try:
            if self.freeze_survivors and generation == 2:
                gc.unfreeze()
            gc.collect(generation)
        finally:
            self.pacing = False
            if self.freeze_survivors:
                gc.freeze()
            self._collected_at = self._clock()
            if generation == 2:
                self._full_at = self._collected_at
        self.num_collections[generation] += 1
        return generation


class GcPauses:
    """Calls ``observe(seconds, paced)`` after each collection of the process; ``close`` stops it."""

    def __init__(self, observe: Callable[[float, bool], None], pacer: GcPacer | None = None) -> None:
        self._observe = observe
        self._pacer = pacer
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif phase == "stop":
            self._observe(time.perf_counter() - self._started, self._pacer is not None and self._pacer.pacing)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
