"""The autoscaling rule on recorded metric series: it scales up at once, holds near target and
through short dips, and scales down gently (one engine a minute, after five quiet minutes)."""

from __future__ import annotations

import math

import pytest

from ops.autoscale import DECODE_POLICY, PREFILL_POLICY, PoolPolicy, Sample, Signal, desired_replicas, propose

STEP_S = 15.0  # Prometheus adapter's relist / HPA sync period order of magnitude


def series(*segments: tuple[float, dict[str, float]]) -> list[Sample]:
    """Samples every ``STEP_S`` seconds: each segment is (how long, the values seen meanwhile)."""
    out: list[Sample] = []
    t = 0.0
    for duration, values in segments:
        for _ in range(int(duration // STEP_S)):
            out.append(Sample(t, values))
            t += STEP_S
    return out


def replicas_at(decisions: list, t: float) -> int:
    return [d.replicas for d in decisions if d.t <= t][-1]


IDLE = {"num_prompt_tokens_waiting": 0.0, "num_requests_waiting": 0.0, "ttft_p90_seconds": 0.2}
BURST = {"num_prompt_tokens_waiting": 30_000.0, "num_requests_waiting": 12.0, "ttft_p90_seconds": 4.0}


def test_prefill_scales_up_on_a_burst_of_waiting_prompt_tokens_and_down_gently_afterwards() -> None:
    recorded = series((300, IDLE), (240, BURST), (900, IDLE))
    decisions = desired_replicas(PREFILL_POLICY, recorded, replicas=1)
    assert replicas_at(decisions, 299) == 1  # idle: held at the minimum
    first = next(d for d in decisions if d.t >= 300)
    assert first.replicas == 5 and first.reason == "num_prompt_tokens_waiting"  # 1 -> 5 at once (+4 per minute)
    assert replicas_at(decisions, 300 + 60) == 8  # a minute later the rate limit allows the rest (8 = max)
    assert replicas_at(decisions, 540 + 299) == 8  # quiet, but within the 5-minute stabilisation window
    after = [d.replicas for d in decisions if d.t >= 540 + 300]
    steps = [a - b for a, b in zip(after, after[1:], strict=False) if a != b]
    assert steps and all(step == 1 for step in steps)  # one engine at a time (each drains on SIGTERM)
    downs = [d.t for prev, d in zip(decisions, decisions[1:], strict=False) if d.replicas < prev.replicas]
    assert all(b - a >= 60 for a, b in zip(downs, downs[1:], strict=False))  # at most one a minute
    assert decisions[-1].replicas == 1


def test_prefill_holds_through_dips_between_bursts() -> None:
    recorded = series(*[(90, BURST), (90, IDLE)] * 6)
    decisions = desired_replicas(PREFILL_POLICY, recorded, replicas=1)
    peak = max(d.replicas for d in decisions)
    assert peak == 8
    first_peak = next(d.t for d in decisions if d.replicas == peak)
    assert all(d.replicas == peak for d in decisions if d.t >= first_peak)  # no flapping


def test_a_signal_near_its_target_holds_the_pool() -> None:
    # KV usage wobbling within 10% of the 0.75 target on 3 decode engines: no change either way.
    wobble = [3 * u for u in (0.70, 0.80, 0.72, 0.78, 0.69, 0.81)]
    recorded = [Sample(i * STEP_S, {"kv_cache_usage_perc": wobble[i % len(wobble)]}) for i in range(80)]
    assert {d.replicas for d in desired_replicas(DECODE_POLICY, recorded, replicas=3)} == {3}


def test_decode_follows_kv_usage_and_running_sequences() -> None:
    # Pool sums, as the HPA's AverageValue sees them: KV usage summed over the decode engines.
    recorded = series(
        (120, {"kv_cache_usage_perc": 1.0, "num_requests_running": 100.0}),  # 2 engines at 0.5: under target
        (120, {"kv_cache_usage_perc": 1.9, "num_requests_running": 150.0}),  # 2 engines at 0.95: cache full
        (120, {"kv_cache_usage_perc": 1.2, "num_requests_running": 500.0}),  # many short sequences
        (900, {"kv_cache_usage_perc": 0.4, "num_requests_running": 20.0}),
    )
    decisions = desired_replicas(DECODE_POLICY, recorded, replicas=2)
    assert replicas_at(decisions, 119) == 2
    assert decisions[8].t == 120 and decisions[8].replicas == 3  # ceil(1.9 / 0.75)
    assert decisions[8].reason == "kv_cache_usage_perc"
    assert replicas_at(decisions, 239) == 3  # the load spread over 3: held
    assert replicas_at(decisions, 240) == 6  # ceil(500 / 96): running sequences outgrow the engines
    assert decisions[16].reason == "num_requests_running"
    assert replicas_at(decisions, 360 + 299) == 6  # stabilisation
    assert decisions[-1].replicas == 1


def test_missing_metrics_never_scale_the_pool() -> None:
    recorded = [Sample(i * STEP_S, {}) for i in range(40)] + [
        Sample(600 + i * STEP_S, {"kv_cache_usage_perc": math.nan}) for i in range(40)
    ]
    assert {d.replicas for d in desired_replicas(DECODE_POLICY, recorded, replicas=4)} == {4}
    assert propose(DECODE_POLICY, 4, {}) == (4, "hold")


def test_the_largest_proposal_wins_and_bounds_hold() -> None:
    policy = PoolPolicy(signals=(Signal("a", 10.0, pool_total=True), Signal("b", 1.0)), min_replicas=2,
                        max_replicas=5)
    assert propose(policy, 2, {"a": 30.0, "b": 0.1}) == (3, "a")
    assert propose(policy, 2, {"a": 30.0, "b": 3.0}) == (5, "b")  # ceil(2 * 3) = 6, capped at 5
    assert propose(policy, 4, {"a": 0.0, "b": 0.0})[0] == 2  # never under the minimum
    assert desired_replicas(policy, [], replicas=9) == []
    assert desired_replicas(policy, [Sample(0, {"b": 1.0})], replicas=9)[0].replicas == 5


def test_the_replay_is_pure() -> None:
    recorded = series((300, IDLE), (240, BURST), (600, IDLE))
    assert desired_replicas(PREFILL_POLICY, recorded, 1) == desired_replicas(PREFILL_POLICY, recorded, 1)


@pytest.mark.parametrize("bad", [dict(min_replicas=0), dict(min_replicas=3, max_replicas=2), dict(signals=())])
def test_a_policy_that_cannot_work_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        PoolPolicy(**{"signals": (Signal("a", 1.0),), **bad})
