"""The priority scheduling policy: waiting requests by priority (lower first, then arrival), the
running request of the highest value preempted first, and the engine refusing a priority it would
not honour."""

from __future__ import annotations

import pytest

from common.engine.request import Request
from common.engine.scheduler import Scheduler
from common.engine.waiting_queue import FcfsQueue, PriorityQueue
from common.kvcache.kv_cache_manager import KVCacheManager
from common.sampling_params import SamplingParams
from tests.engine.conftest import drain_tokens, prompt_ids

BS = 16


def _request(request_id: str, priority: int, arrival: float, num_tokens: int = 8, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    return Request(request_id, list(range(num_tokens)), params, block_size=BS, model_id="m", arrival_time=arrival)


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
                     max_model_len=2048, policy=policy)  # type: ignore[arg-type]


def _step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.completes:
            s.request.append_output_token(7)
    return [s.request.request_id for s in out.scheduled]


def test_the_queues_order_by_arrival_or_by_priority_then_arrival() -> None:
    reqs = [_request("late-urgent", 0, 3.0), _request("early-lax", 5, 1.0), _request("early-urgent", 0, 2.0),
            _request("negative", -1, 4.0)]
    fcfs, prio = FcfsQueue(), PriorityQueue()
    for r in reqs:
        fcfs.append(r)
        prio.append(r)
    assert [r.request_id for r in fcfs] == ["late-urgent", "early-lax", "early-urgent", "negative"]
    assert [r.request_id for r in prio] == ["negative", "early-urgent", "late-urgent", "early-lax"]
    prio.remove(reqs[2])
    prio.requeue(reqs[2])  # a preempted request goes back to its place, not to the front
    assert [prio.pop().request_id for _ in range(len(prio))] == ["negative", "early-urgent", "late-urgent", "early-lax"]
    with pytest.raises(ValueError):
        prio.remove(reqs[0])


def test_waiting_requests_start_by_priority_when_seats_free() -> None:
    sched = _scheduler("priority", max_num_seqs=1)
    for rid, priority, arrival in [("lax", 9, 1.0), ("urgent", 0, 3.0), ("middle", 4, 2.0)]:
        sched.add(_request(rid, priority, arrival, max_tokens=1))
    started = []
    while sched.waiting or sched.running:
        ids = _step(sched)
        started += [i for i in ids if i not in started]
        for req in list(sched.running):
            if req.num_output_tokens >= 1:
                sched.finish(req, req.status.FINISHED_LENGTH)
    assert started == ["urgent", "middle", "lax"]


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "late-urgent"), ("priority", "early-lax")])
def test_under_memory_pressure_the_least_urgent_running_request_is_preempted(policy: str, victim: str) -> None:
    """Two requests fill the pool; the next block either needs is taken from the other. First come,
    first served preempts the later one; priority the one of the higher value, though it came first."""
    sched = _scheduler(policy, num_blocks=4)
    sched.add(_request("early-lax", 5, 1.0, num_tokens=2 * BS, max_tokens=8))
    sched.add(_request("late-urgent", 0, 2.0, num_tokens=2 * BS, max_tokens=8))
    _step(sched)  # both prompts: 2 blocks each, the pool is full
    out = sched.schedule()  # each now needs a third block
    assert out.preempted_ids == [victim]
    assert [s.request.request_id for s in out.scheduled] == [r for r in ("early-lax", "late-urgent") if r != victim]


def test_the_engine_refuses_a_priority_it_would_not_honour_and_serves_it_under_the_policy(engine_factory):  # type: ignore[no-untyped-def]
    prompt = list(prompt_ids()[0])
    fcfs = engine_factory()
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        fcfs.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=4, priority=1))
    engine = engine_factory(scheduling_policy="priority", max_num_seqs=1)
    for rid, priority in [("lax", 3), ("urgent", -2)]:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, priority=priority))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finish_reason is not None]
    assert finished == ["urgent", "lax"]
    engine.add_request("again", prompt, SamplingParams(temperature=0.0, max_tokens=4))
    assert len(drain_tokens(engine)[0]["again"]) == 4
