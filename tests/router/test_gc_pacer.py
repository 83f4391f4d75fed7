"""Garbage collections at quiet points (``common/gc_pacer.py``): the collection CPython would
choose, due from three quarters of the automatic threshold, the pauses timed, and the router's receive
loop collecting after an engine message (its wake loop when no message comes)."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator

import pytest

from common.gc_pacer import GcPacer, GcPauses
from common.protocol import OutputBatch, RequestOutput, encode
from tests.router.engine_client_harness import client_and_engine, until


@pytest.fixture(autouse=True)
def gc_thresholds() -> Iterator[None]:
    """The process's thresholds as they were, whatever a test set."""
    saved = gc.get_threshold()
    try:
        yield
    finally:
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
    pacer = GcPacer((10_000, 10, 10))
    pacer.install()
    gc.collect()
    kept = [[] for _ in range(5000)]  # containers the collector tracks, alive
    assert not pacer.due()
    kept += [[] for _ in range(3000)]  # past 7,500 young, short of the 10,000 of an automatic collection
    assert pacer.due()
    pacer.collect()
    assert not pacer.due() and len(kept) == 8000


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
