"""Garbage collections at quiet points (``common/gc_pacer.py``): the collection CPython would
choose, due from three quarters of the automatic threshold, the pauses timed, and the router's receive
loop collecting after an engine message (its wake loop when no message comes)."""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from common.gc_pacer import GcPacer, GcPauses
from common.protocol import OutputBatch, RequestOutput, encode
from router.main import router_gc_pacer
from tests.router.engine_client_harness import client_and_engine, until


@pytest.fixture(autouse=True)
def gc_thresholds() -> Iterator[None]:
    """The process's thresholds as they were, whatever a test set, and nothing left frozen."""
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def test_the_pacer_runs_the_generation_cpython_would() -> None:
    pacer = GcPacer((10**7, 2, 2))  # nothing automatic during the test
    pacer.install()
    assert gc.get_threshold() == (10**7, 2, 2)
    gc.collect()  # every generation's count from zero
    # Two young collections make the middle generation's due, two of those the oldest's.
    assert [pacer.collect() for _ in range(7)] == [0, 0, 1, 0, 0, 1, 2]
    assert pacer.num_collections == [4, 2, 1]


def test_a_young_collection_is_due_from_three_quarters_of_the_automatic_threshold() -> None:
    pacer = GcPacer((10_000, 10, 10), clock=lambda: 0.0)  # never due by the interval
    pacer.install()
    gc.collect()
    kept = [[] for _ in range(5000)]  # containers the collector tracks, alive
    assert not pacer.due()
    kept += [[] for _ in range(3000)]  # past 7,500 young, short of the 10,000 of an automatic collection
    assert pacer.due()
    pacer.collect()
    assert not pacer.due() and len(kept) == 8000


def test_a_young_generation_the_count_misses_is_due_once_the_interval_has_passed() -> None:
    """Old objects freed as new ones are made keep the count low while the young generation grows
    (streams ending as others start): due anyway a second after the pacer's last collection."""
    now = [0.0]
    pacer = GcPacer((10_000, 10**6, 10**6), max_interval_s=1.0, clock=lambda: now[0])
    pacer.install()
    old = [[] for _ in range(6000)]
    pacer.collect()  # the old ones leave the young generation
    young = []
    for _ in range(6000):
        old.pop()  # each freed old container lowers the count by one
        young.append([])  # and each new one raises it
    assert gc.get_count()[0] < 7500, "the count saw the churn"
    assert len(gc.get_objects(0)) >= 6000
    now[0] = 0.9
    assert not pacer.due()
    now[0] = 1.0
    assert pacer.due()
    pacer.collect()
    assert not pacer.due() and len(gc.get_objects(0)) < 6000 and len(young) == 6000


class _Node:
    """A container the collector tracks, which can be made part of a cycle; says when it is freed."""

    def __init__(self, freed: list[str], name: str) -> None:
        self.other: object = None
        self._finalizer = weakref.finalize(self, freed.append, name)


def _cycle(freed: list[str], name: str) -> None:
    """A two-node cycle, dropped: garbage only a collection can free."""
    a, b = _Node(freed, name), _Node(freed, name)
    a.other, b.other = b, a


def test_freezing_survivors_collects_young_cycles_and_leaves_the_rest_for_the_full_interval() -> None:
    """Each paced collection is a young one and freezes what survives (never scanned again; freed by
    reference counting when it dies); garbage cycles among frozen objects wait for the full
    collection every ``full_interval_s``, which unfreezes everything first and freezes again after."""
    now = [0.0]
    pacer = GcPacer((10**7, 10**6, 10**6), freeze_survivors=True, full_interval_s=600.0, clock=lambda: now[0])
    pacer.install()
    gc.collect()
    freed: list[str] = []
    a, b = _Node(freed, "old"), _Node(freed, "old")
    a.other, b.other = b, a  # alive for now
    plain = _Node(freed, "plain")  # no cycle: reference counting frees it, frozen or not
    assert pacer.collect() == 0
    assert gc.get_freeze_count() > 0 and gc.get_objects(1) == [] and gc.get_objects(2) == []
    del a, b, plain  # the old pair becomes a cycle of garbage among frozen objects
    assert freed == ["plain"]
    _cycle(freed, "young")  # a cycle made and dropped since the last collection
    now[0] = 300.0
    assert pacer.collect() == 0
    assert sorted(freed) == ["plain", "young", "young"], "a young collection freed what it should not, or missed"
    now[0] = 600.0
    assert pacer.collect() == 2 and pacer.num_collections == [2, 0, 1]
    assert sorted(freed) == ["old", "old", "plain", "young", "young"]
    assert gc.get_freeze_count() > 0, "not frozen again after the full collection"


def test_the_routers_pacer_collects_in_small_pieces() -> None:
    """The router's collections come from 2,000 young objects or 0.1 s on (each a few milliseconds
    at most), not from three quarters of the 20,000-object threshold or once a second (tens)."""
    now = [0.0]
    pacer = router_gc_pacer(clock=lambda: now[0])
    pacer.install()
    assert pacer.freeze_survivors
    gc.collect()
    kept: list[list[int]] = [[] for _ in range(1000)]
    assert not pacer.due()
    kept += [[] for _ in range(1500)]
    assert pacer.due(), "2,500 young objects and not due: the router's pauses grow with what it waits for"
    pacer.collect()
    assert not pacer.due()
    now[0] = 0.1
    assert pacer.due(), "0.1 s since the last collection and not due"
    assert len(kept) == 2500


def test_a_pacer_left_as_cpython_would_freezes_nothing() -> None:
    pacer = GcPacer((10**7, 10**6, 10**6))
    gc.collect()
    frozen = gc.get_freeze_count()  # what this process froze before (a service run in it)
    kept = [[] for _ in range(100)]
    pacer.collect()
    assert gc.get_freeze_count() == frozen and len(kept) == 100


def test_every_pause_is_timed_and_says_whether_the_pacer_chose_it() -> None:
    pacer = GcPacer((100, 2, 2))
    pauses: list[tuple[float, bool]] = []
    timer = GcPauses(lambda seconds, paced: pauses.append((seconds, paced)), pacer)
    try:
        pacer.collect()
        gc.collect(0)
    finally:
        timer.close()
    gc.collect(0)  # after close: not seen
    assert [paced for _, paced in pauses] == [True, False]
    assert all(0 <= seconds < 10 for seconds, _ in pauses)


class _RecordingPacer(GcPacer):
    """Records which function of the router asked for each collection."""

    def __init__(self) -> None:
        super().__init__((1, 10**6, 10**6))  # always due; young collections only
        self.callers: list[str] = []

    def collect(self) -> int:
        self.callers.append(sys._getframe(1).f_code.co_name)
        return super().collect()


def test_the_receive_loop_collects_after_an_engine_message_and_the_wake_loop_without_one() -> None:
    async def scenario() -> None:
        pacer = _RecordingPacer()
        async with client_and_engine(pacer) as (client, push):
            queue = client.open("a")
            batch = OutputBatch(instance_id="decode-0", outputs=[
                RequestOutput(request_id="a", new_token_ids=[1], instance_id="decode-0", phase="decode"),
            ])
            push.send(encode(batch))
            await until(lambda: "_receive_loop" in pacer.callers)
            assert queue.qsize() == 1  # after the message's outputs were handed on
            # No engine message for longer than the wake interval: the wake loop collects.
            await until(lambda: "_wake_loop" in pacer.callers)

    asyncio.run(scenario())
