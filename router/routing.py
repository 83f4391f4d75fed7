"""Routing policies: which prefill and which decode instance serve a request.

Each policy ranks candidates best first; the dispatcher tries them in order, so an unreachable
instance costs one fallback, not a failed request.

Load of an instance = max(running + waiting it reported in its last heartbeat, requests this router
has in flight on it). The router's own count covers the second between heartbeats; taking the max
avoids counting the same requests twice once a heartbeat includes them.

* ``prefix`` (default): for prefill, ``score = hit - alpha * load / (1 + max_load)``, where ``hit`` is
  the fraction of the prompt's full blocks the instance already caches as a leading run
  (``PrefixIndex.match``) and ``max_load`` is the highest load among the candidates. With
  ``alpha = 0.5`` a full cache hit beats an idle instance unless the hit instance is the busiest,
  and a small hit never outweighs a large load difference. Highest score wins.
* ``least-loaded``: prefill by lowest load; prefix hits are ignored.
* ``round-robin``: prefill and decode in turn, ignoring load.

Decode instances (all policies but round-robin) go by
``load / (1 + max_load) + kv_weight * kv_cache_usage_perc``, lowest first, so an instance close to
running out of KV blocks is avoided. Ties rotate, so equal instances share a burst.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from common.registry import InstanceInfo

POLICIES = ("prefix", "least-loaded", "round-robin")


def instance_load(info: InstanceInfo, num_inflight: int) -> float:
    return float(max(info.num_requests_running + info.num_requests_waiting, num_inflight))


def normalized_loads(candidates: Sequence[InstanceInfo], inflight: Mapping[str, int]) -> dict[str, float]:
    """Each instance's load scaled into [0, 1) by the largest one among ``candidates``."""
    loads = {i.instance_id: instance_load(i, inflight.get(i.instance_id, 0)) for i in candidates}
    scale = 1.0 + max(loads.values(), default=0.0)
    return {instance_id: load / scale for instance_id, load in loads.items()}


class RoutingPolicy:
    """Base: least-loaded for both roles. Methods return new lists and never mutate their inputs."""

    name = "least-loaded"
    uses_prefix = False

    def __init__(self, alpha: float = 0.5, kv_weight: float = 1.0) -> None:
        self.alpha = alpha
        self.kv_weight = kv_weight
        self._turns: Counter[str] = Counter()

    def _rotated_sort(
        self, role: str, candidates: Sequence[InstanceInfo], key: Callable[[InstanceInfo], float]
    ) -> list[InstanceInfo]:
        """Sort by ``key``; equal keys in an order that advances by one on every call per role."""
        ordered = sorted(candidates, key=lambda info: info.instance_id)
        turn = self._turns[role]
        self._turns[role] += 1
        n = max(len(ordered), 1)
        rotation = {info.instance_id: (i - turn) % n for i, info in enumerate(ordered)}
        return sorted(ordered, key=lambda info: (key(info), rotation[info.instance_id]))

    def rank_prefill(
        self,
        candidates: Sequence[InstanceInfo],
        inflight: Mapping[str, int],
        matched: Mapping[str, int],
        num_blocks: int,
    ) -> list[InstanceInfo]:
        return self._rotated_sort(
            "prefill", candidates, lambda i: instance_load(i, inflight.get(i.instance_id, 0))
        )

    def rank_decode(
        self, candidates: Sequence[InstanceInfo], inflight: Mapping[str, int]
    ) -> list[InstanceInfo]:
        loads = normalized_loads(candidates, inflight)

        def cost(info: InstanceInfo) -> float:
            return loads[info.instance_id] + self.kv_weight * info.kv_cache_usage_perc

        return self._rotated_sort("decode", candidates, cost)


class LeastLoadedPolicy(RoutingPolicy):
    name = "least-loaded"


class PrefixAwarePolicy(RoutingPolicy):
    name = "prefix"
    uses_prefix = True

    def rank_prefill(
        self,
        candidates: Sequence[InstanceInfo],
        inflight: Mapping[str, int],
        matched: Mapping[str, int],
        num_blocks: int,
    ) -> list[InstanceInfo]:
        loads = normalized_loads(candidates, inflight)

        def negative_score(info: InstanceInfo) -> float:
            hit = matched.get(info.instance_id, 0) / num_blocks if num_blocks else 0.0
            return -(hit - self.alpha * loads[info.instance_id])

        return self._rotated_sort("prefill", candidates, negative_score)


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def rank_prefill(
        self,
        candidates: Sequence[InstanceInfo],
        inflight: Mapping[str, int],
        matched: Mapping[str, int],
        num_blocks: int,
    ) -> list[InstanceInfo]:
        return self._rotated_sort("prefill", candidates, lambda _: 0.0)

    def rank_decode(
        self, candidates: Sequence[InstanceInfo], inflight: Mapping[str, int]
    ) -> list[InstanceInfo]:
        return self._rotated_sort("decode", candidates, lambda _: 0.0)


def make_policy(name: str, alpha: float = 0.5, kv_weight: float = 1.0) -> RoutingPolicy:
    classes: dict[str, type[RoutingPolicy]] = {
        "prefix": PrefixAwarePolicy,
        "least-loaded": LeastLoadedPolicy,
        "round-robin": RoundRobinPolicy,
    }
    if name not in classes:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return classes[name](alpha=alpha, kv_weight=kv_weight)
