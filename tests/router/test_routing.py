"""Routing policies: prefix hits weighed against load, least-loaded, round-robin, decode by load."""

from __future__ import annotations

from collections import Counter

import pytest

from common.registry import InstanceInfo
from router.routing import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy, make_policy


def inst(
    instance_id: str, role: str = "prefill", running: int = 0, waiting: int = 0, kv: float = 0.0
) -> InstanceInfo:
    return InstanceInfo(
        instance_id=instance_id,
        role=role,
        model="m",
        control_address=f"tcp://127.0.0.1:{abs(hash(instance_id)) % 1000 + 1000}",
        num_requests_running=running,
        num_requests_waiting=waiting,
        kv_cache_usage_perc=kv,
    )


def ids(ranked: list[InstanceInfo]) -> list[str]:
    return [i.instance_id for i in ranked]


def test_prefix_policy_prefers_the_longest_cached_prefix_at_equal_load() -> None:
    policy = PrefixAwarePolicy()
    candidates = [inst("a"), inst("b"), inst("c")]
    assert ids(policy.rank_prefill(candidates, {}, {"b": 4, "c": 2}, 4)) == ["b", "c", "a"]


def test_prefix_policy_full_hit_beats_an_idle_instance_unless_it_is_much_busier() -> None:
    policy = PrefixAwarePolicy(alpha=0.5)
    busy_hit, idle = inst("hit", running=3), inst("idle")
    assert ids(policy.rank_prefill([busy_hit, idle], {}, {"hit": 8}, 8))[0] == "hit"
    small_hit = {"hit": 1}  # 1 of 8 blocks does not justify queueing behind 3 requests
    assert ids(policy.rank_prefill([busy_hit, idle], {}, small_hit, 8))[0] == "idle"


def test_router_in_flight_count_counts_as_load_before_heartbeats_catch_up() -> None:
    policy = LeastLoadedPolicy()
    candidates = [inst("a"), inst("b")]
    assert ids(policy.rank_prefill(candidates, {"a": 5}, {}, 0))[0] == "b"
    # Once a heartbeat reports the same requests, they are not counted twice.
    assert ids(policy.rank_prefill([inst("a", running=5), inst("b", running=4)], {"a": 5}, {}, 0))[0] == "b"


def test_least_loaded_ignores_prefix_hits() -> None:
    policy = LeastLoadedPolicy()
    ranked = policy.rank_prefill([inst("a", waiting=2), inst("b", running=1)], {}, {"a": 10}, 10)
    assert ids(ranked) == ["b", "a"]


def test_ties_rotate_so_equal_instances_share_a_burst() -> None:
    policy = LeastLoadedPolicy()
    candidates = [inst("a"), inst("b"), inst("c")]
    firsts = Counter(ids(policy.rank_prefill(candidates, {}, {}, 0))[0] for _ in range(9))
    assert firsts == {"a": 3, "b": 3, "c": 3}


def test_round_robin_cycles_prefill_and_decode_independently() -> None:
    policy = RoundRobinPolicy()
    prefills = [inst("p0", running=9), inst("p1")]
    decodes = [inst("d0", "decode"), inst("d1", "decode", running=9), inst("d2", "decode")]
    order = []
    for _ in range(6):
        order.append(
            (ids(policy.rank_prefill(prefills, {}, {}, 0))[0], ids(policy.rank_decode(decodes, {}))[0])
        )
    assert [p for p, _ in order] == ["p0", "p1"] * 3
    assert [d for _, d in order] == ["d0", "d1", "d2"] * 2


def test_decode_choice_weighs_load_and_kv_usage() -> None:
    policy = LeastLoadedPolicy()
    assert ids(policy.rank_decode([inst("d0", "decode", running=4), inst("d1", "decode")], {}))[0] == "d1"
    nearly_full = inst("d0", "decode", kv=0.95)
    assert ids(policy.rank_decode([nearly_full, inst("d1", "decode", running=1)], {}))[0] == "d1"
    assert ids(policy.rank_decode([inst("d0", "decode"), inst("d1", "decode")], {"d0": 2}))[0] == "d1"


def test_policies_do_not_mutate_candidates() -> None:
    candidates = [inst("b"), inst("a")]
    for name in ("prefix", "least-loaded", "round-robin"):
        make_policy(name).rank_prefill(candidates, {}, {}, 0)
    assert ids(candidates) == ["b", "a"]


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
