"""Scheduler token budgets: chunked prefill and the per-request cap on long prompts."""

from __future__ import annotations

import pytest

from common.engine.request import Request
from common.engine.scheduler import Scheduler
from common.kvcache.kv_cache_manager import KVCacheManager
from common.sampling_params import SamplingParams

BS = 16


def _scheduler(threshold: int, chunked: bool = True) -> Scheduler:
    return Scheduler(
        KVCacheManager(256, BS),
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=2048,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
    )


def _add(sched: Scheduler, request_id: str, num_tokens: int) -> None:
    params = SamplingParams(max_tokens=4)
    sched.add(Request(request_id, list(range(num_tokens)), params, block_size=BS, model_id="m"))


def _step(sched: Scheduler) -> dict[str, int]:
    """One step as the engine runs it: requests whose KV is complete sample a token."""
    out = sched.schedule()
    sampling = [s.request for s in out.scheduled if s.completes]
    sched.update_after_step(out)
    for request in sampling:
        request.append_output_token(7)
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_without_a_threshold_a_long_prompt_takes_the_budget_and_short_ones_wait() -> None:
    sched = _scheduler(0)
    _add(sched, "long", 1000)
    _add(sched, "short-1", 60)
    _add(sched, "short-2", 60)
    assert _step(sched) == {"long": 1000, "short-1": 24}  # what is left: a chunk of one short prompt


def test_a_threshold_caps_each_prompt_per_step_so_short_prompts_go_along() -> None:
    sched = _scheduler(256)
    _add(sched, "long", 1000)
    _add(sched, "short-1", 60)
    _add(sched, "short-2", 60)
    assert _step(sched) == {"long": 256, "short-1": 60, "short-2": 60}
    # The long prompt goes on in capped chunks while the short ones decode one token per step.
    assert _step(sched) == {"long": 256, "short-1": 1, "short-2": 1}
    assert _step(sched) == {"long": 256, "short-1": 1, "short-2": 1}
    assert _step(sched) == {"long": 232, "short-1": 1, "short-2": 1}


def test_the_threshold_needs_chunked_prefill() -> None:
    sched = _scheduler(256, chunked=False)
    _add(sched, "long", 1000)
    _add(sched, "short", 60)
    assert _step(sched) == {"long": 1000}  # whole, and too little budget is left for the short prompt


def test_a_request_not_forked_yet_takes_a_seat_per_choice_so_no_step_samples_past_max_num_seqs() -> None:
    """``max_num_seqs`` bounds the rows a step samples, which the engine sized its memory for: a request
    with n = 3 takes three seats when admitted (its first sampling adds its other choices, or samples
    them beside it), so with 8 seats a fourth n = 3 request waits while six are taken, and a request
    with n above the seats is refused with both numbers named."""
    sched = _scheduler(0)
    for name, n in (("a", 3), ("b", 3), ("c", 3), ("d", 1)):
        sched.add(Request(name, list(range(20)), SamplingParams(max_tokens=4, n=n), block_size=BS, model_id="m"))
    assert set(_step(sched)) == {"a", "b"}  # 6 seats: c needs 3 more of the 2 left, and d waits behind it
    sched.running[0].forked = True  # as the engine's first sampling of "a" does, its choices joining:
    for i in (1, 2):
        child = sched.running[0].fork(f"a#{i}", seed_offset=i)
        sched.kv.fork(sched.running[0], child)
        sched.add_running(child)
    assert set(_step(sched)) == {"a", "a#1", "a#2", "b"}  # still 6 seats taken
    with pytest.raises(ValueError, match="n=9 exceeds max_num_seqs 8"):
        sched.add(Request("e", [1, 2], SamplingParams(max_tokens=4, n=9), block_size=BS, model_id="m"))
