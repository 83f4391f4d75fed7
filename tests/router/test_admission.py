"""Fair admission: clients take turns for engine slots, the waiting queue is bounded, nothing leaks."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from typing import Any

import httpx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from router.admission import Admission, Lane, Slot
from router.config import RequestLimits
from router.errors import APIError
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state, wait_until


def _take_all(lane: Lane) -> list[Slot]:
    slots = list(lane.granted)
    lane.granted.clear()
    return slots


def test_a_single_prompt_gets_the_next_free_slot_beside_a_huge_batch() -> None:
    admission = Admission(lambda: 4, max_waiting_requests=200_000, max_queued_tokens=1 << 30)
    flood = admission.enter("a", [1] * 100_000)
    running = _take_all(flood)
    assert len(running) == 4 and admission.num_waiting == 100_000 - 4
    small = admission.enter("b", [30])
    assert not small.granted, "no slot is free yet"
    running.pop().release()
    assert len(small.granted) == 1, "the freed slot went to the flood instead of the other client"
    assert not flood.granted
    admission.check_integrity()


def test_priorities_go_first_whoever_sent_them_and_clients_take_turns_among_equals() -> None:
    admission = Admission(lambda: 1, max_waiting_requests=100, max_queued_tokens=10_000)
    [slot] = _take_all(admission.enter("a", [1]))
    lax_a = admission.enter("a", [1], priority=5)
    lax_b = admission.enter("b", [1, 1], priority=5)
    plain_c = admission.enter("c", [1])
    urgent_a = admission.enter("a", [1], priority=-1)
    order = []
    for _ in range(5):
        slot.release()
        [granted] = [(name, lane) for name, lane in
                     (("lax_a", lax_a), ("lax_b", lax_b), ("plain_c", plain_c), ("urgent_a", urgent_a)) if lane.granted]
        order.append(granted[0])
        [slot] = _take_all(granted[1])
        admission.check_integrity()
    # The urgent one although its client had the last turn; then priority 0; then turns among the 5s.
    assert order == ["urgent_a", "plain_c", "lax_b", "lax_a", "lax_b"]
    slot.release()
    assert admission.num_running == admission.num_waiting == 0


def test_clients_alternate_and_one_client_is_first_come_first_served() -> None:
    admission = Admission(lambda: 1, max_waiting_requests=100, max_queued_tokens=10_000)
    first = admission.enter("a", [1, 1])
    [slot] = _take_all(first)
    second_a = admission.enter("a", [1])
    b = admission.enter("b", [1, 1])
    order = []
    lanes = {"a1": first, "a2": second_a, "b": b}
    for _ in range(4):
        slot.release()
        [(name, lane)] = [(n, lane) for n, lane in lanes.items() if lane.granted]
        order.append(name)
        [slot] = _take_all(lane)
    slot.release()
    assert order == ["b", "a1", "b", "a2"], order
    assert admission.num_running == 0 and admission.num_waiting == 0
    admission.check_integrity()


def test_a_full_queue_answers_429_with_retry_after_and_a_too_large_request_400() -> None:
    admission = Admission(lambda: 1, max_waiting_requests=10, max_queued_tokens=1000)
    admission.enter("a", [5] * 10)  # 1 runs, 9 wait
    with pytest.raises(APIError) as full:
        admission.enter("a", [5, 5])
    assert full.value.status == 429 and full.value.headers == {"Retry-After": "1"}
    assert "--max-waiting-requests" in full.value.message
    with pytest.raises(APIError) as alone:
        admission.enter("c", [5] * 11)
    assert alone.value.status == 400 and "--max-waiting-requests" in alone.value.message
    with pytest.raises(APIError) as tokens:
        admission.enter("c", [1001])
    assert tokens.value.status == 400 and "--max-queued-tokens" in tokens.value.message
    admission.check_integrity()


def test_a_client_below_its_fair_share_gets_in_while_another_fills_the_queue() -> None:
    admission = Admission(lambda: 1, max_waiting_requests=100, max_queued_tokens=100_000)
    admission.enter("flood", [1] * 100)  # 1 runs, 99 wait
    admission.enter("flood", [1])  # the queue is full
    small = admission.enter("small", [1, 1])  # its share: 100 // 2
    assert not small.closed and admission.num_waiting == 102
    with pytest.raises(APIError) as more:
        admission.enter("flood", [1])
    assert more.value.status == 429
    admission.check_integrity()


def test_closing_a_lane_gives_up_its_waiting_requests_and_unused_slots() -> None:
    admission = Admission(lambda: 2, max_waiting_requests=100, max_queued_tokens=1000)
    lane = admission.enter("a", [3] * 10)
    assert len(lane.granted) == 2
    lane.close()
    lane.close()
    assert admission.num_running == 0 and admission.num_waiting == 0 and admission.num_queued_tokens == 0
    admission.check_integrity()


def test_next_slot_waits_for_a_release_and_sees_new_capacity() -> None:
    capacity = [1]

    async def run() -> None:
        admission = Admission(lambda: capacity[0], max_waiting_requests=10, max_queued_tokens=100)
        lane = admission.enter("a", [1, 1, 1])
        first = await lane.next_slot()
        waiter = asyncio.create_task(lane.next_slot())
        await asyncio.sleep(0)
        assert not waiter.done()
        first.release()
        second = await asyncio.wait_for(waiter, 5)
        capacity[0] = 2  # an instance joined: a waiting lane notices without any release
        third = await asyncio.wait_for(lane.next_slot(), 5)
        for slot in (second, third):
            slot.release()
        assert admission.num_running == 0
        admission.check_integrity()

    asyncio.run(run())


def test_a_waiting_lane_cancelled_as_its_wakeup_fires_stops_waiting() -> None:
    """Before Python 3.12, asyncio.wait_for returned normally when cancelled in the same turn its
    awaitable finished: the cancellation was lost and the router's prompt sender for a client that
    had left waited on (and took slots) for ever. Cancel at every turn around a wakeup."""

    async def run() -> None:
        for turns in range(6):
            admission = Admission(lambda: 1, max_waiting_requests=10, max_queued_tokens=100)
            holder = admission.enter("b", [1])
            assert holder.granted, "b holds the only slot"
            lane = admission.enter("a", [1])
            waiter = asyncio.create_task(lane.next_slot())
            for _ in range(3):
                await asyncio.sleep(0)
            lane.wakeup.set()  # what a release does; nothing is granted (b holds the slot)
            for _ in range(turns):
                await asyncio.sleep(0)
            waiter.cancel()
            done, _ = await asyncio.wait([waiter], timeout=5)
            assert done and waiter.cancelled(), f"the cancellation {turns} turns after a wakeup was lost"
            lane.close()
            holder.close()
            admission.check_integrity()
            assert admission.num_running == 0 and admission.num_waiting == 0

    asyncio.run(run())


class AdmissionMachine(RuleBasedStateMachine):
    """Random enters, slot takes, releases, closes and capacity changes; the counters always match
    the lanes, and no more slots are out than the capacity allowed when they were handed out."""

    lanes = Bundle("lanes")
    slots = Bundle("slots")

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 2
        self.admission = Admission(lambda: self.capacity, max_waiting_requests=20, max_queued_tokens=200)
        self.max_capacity_seen = self.capacity

    @rule(target=lanes, key=st.sampled_from("abc"), costs=st.lists(st.integers(0, 30), max_size=8),
          priority=st.sampled_from([0, 0, 0, 1, -1]))
    def enter(self, key: str, costs: list[int], priority: int) -> Lane | None:
        try:
            return self.admission.enter(key, costs, priority)
        except APIError as exc:
            assert exc.status in (400, 429)
            return None

    @rule(target=slots, lane=lanes)
    def take(self, lane: Lane | None) -> Slot | None:
        if lane is None or not lane.granted:
            return None
        return lane.granted.popleft()

    @rule(slot=consumes(slots))
    def release(self, slot: Slot | None) -> None:
        if slot is not None:
            slot.release()
            slot.release()

    @rule(lane=lanes)
    def close(self, lane: Lane | None) -> None:
        if lane is not None:
            lane.close()

    @rule(capacity=st.integers(1, 4))
    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.max_capacity_seen = max(self.max_capacity_seen, capacity)
        self.admission._dispatch()

    @invariant()
    def consistent(self) -> None:
        self.admission.check_integrity()
        assert self.admission.num_running <= self.max_capacity_seen
        assert self.admission.num_waiting <= 2 * self.admission.max_waiting_requests


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_through_the_router_a_small_request_passes_a_2000_prompt_flood_which_leaves_nothing_behind(
    redis_url: str, prompts: Any
) -> None:
    """Fake engines take 0.25 s per engine request and the router keeps 8 at the decode instance:
    the flood needs a minute, another key's request must not wait for it; when the flood's client
    leaves, its waiting prompts are dropped and its running ones end."""
    namespace = f"fair-{uuid.uuid4().hex[:8]}"
    tokens = list(prompts.tokenizer.encode(" one two three four five", add_special_tokens=False))
    with FakeCluster(redis_url, namespace, tokens, token_delay_s=0.05) as cluster:
        state = make_state(prompts, redis_url=redis_url, namespace=namespace, api_keys=["flood", "small"],
                           max_requests_per_instance=8, limits=RequestLimits(max_prompts_per_request=2000))
        with RouterServer(state) as server:
            server.wait_ready()
            body = json.dumps({"model": SERVED_MODEL, "prompt": [[5]] * 2000, "max_tokens": 5}).encode()
            flood = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            flood.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer flood\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            try:
                assert wait_until(lambda: state.admission.num_waiting > 1000, 30), "the flood was not queued"
                started = time.monotonic()
                small = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer small"},
                                   json={"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 5}, timeout=60)
                small_s = time.monotonic() - started
                assert small.status_code == 200, small.text
                assert small_s < 5.0, f"the small request waited {small_s:.1f}s behind the flood"
                assert state.admission.num_waiting > 1000, "the flood ended early: nothing was tested"
            finally:
                flood.close()
            assert wait_until(lambda: state.admission.num_waiting == 0 and state.admission.num_running == 0, 60)
            state.admission.check_integrity()
            assert len(cluster.requests()) < 200, "the flood's waiting prompts were sent after it left"
