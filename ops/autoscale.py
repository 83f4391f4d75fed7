"""The autoscaling rule for the prefill and decode pools, as a pure function over recorded metrics.

It is the rule the HorizontalPodAutoscalers of ``ops/k8s/autoscaling.yaml`` apply (Kubernetes'
algorithm, written out so it can be replayed and tested on recorded series):

1. each signal proposes ``ceil(replicas * value / target)``, where ``value`` is per replica: a pool
   total divided by the replicas (as the HPA's ``AverageValue`` of a pods metric), or a latency
   as recorded (an external metric's ``Value``); a signal
   within ``tolerance`` of its target proposes no change; the largest proposal wins (a pool scales
   up when any signal is over target, down only when all are under);
2. stabilisation: the pool scales down only to the highest proposal of the last
   ``scale_down_window_s`` (and up only to the lowest of ``scale_up_window_s``), so a dip does not
   drain engines that a returning burst needs;
3. rate limits: at most ``scale_up_max_pods`` more (or double, whichever is more) per
   ``period_s``, at most ``scale_down_max_pods`` fewer per ``period_s``: an engine drains on
   SIGTERM for up to 30 s, so pods leave one at a time;
4. always within ``[min_replicas, max_replicas]``.

The signals and their default targets (the README's table):

| pool | signal | target | source metric |
|---|---|---|---|
| prefill | prompt tokens waiting, per replica | 4096 | ``pdserve:num_prompt_tokens_waiting`` |
| prefill | requests waiting, per replica | 4 | ``pdserve:num_requests_waiting{role="prefill"}`` |
| prefill | TTFT p90 (router), seconds | 1.0 | ``pdserve:time_to_first_token_seconds_bucket`` |
| decode | KV cache usage, per replica | 0.75 | ``pdserve:kv_cache_usage_perc{role="decode"}`` |
| decode | running sequences, per replica | 96 (0.75 x ``--max-num-seqs`` 128) | ``pdserve:num_requests_running{role="decode"}`` |
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Signal:
    """One metric a pool follows. ``pool_total``: the recorded value is the sum over the pool's
    engines (divided by the replicas to compare with ``target``, so load spreads over new
    replicas in a replay as it does in a pool); otherwise it is compared as it is (a latency)."""

    name: str
    target: float
    pool_total: bool = False


@dataclass(frozen=True)
class PoolPolicy:
    signals: tuple[Signal, ...]
    min_replicas: int = 1
    max_replicas: int = 8
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    period_s: float = 60.0
    scale_up_max_pods: int = 4
    scale_down_max_pods: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if not self.signals or any(s.target <= 0 for s in self.signals):
            raise ValueError("need at least one signal, each with a positive target")


PREFILL_POLICY = PoolPolicy(signals=(
    Signal("num_prompt_tokens_waiting", 4096, pool_total=True),
    Signal("num_requests_waiting", 4, pool_total=True),
    Signal("ttft_p90_seconds", 1.0),
))
DECODE_POLICY = PoolPolicy(signals=(
    Signal("kv_cache_usage_perc", 0.75, pool_total=True),
    Signal("num_requests_running", 96, pool_total=True),
))


@dataclass(frozen=True)
class Sample:
    """Metrics of one pool at time ``t`` (seconds); a signal that is missing (or NaN) is skipped."""

    t: float
    values: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    t: float
    replicas: int
    proposed: int  # before stabilisation and rate limits
    reason: str  # the signal that proposed the most, or "hold"


def propose(policy: PoolPolicy, replicas: int, values: Mapping[str, float]) -> tuple[int, str]:
    """Step 1 alone: the replicas the signals ask for now, and which signal asked for the most."""
    best, reason = None, "hold"
    for signal in policy.signals:
        value = values.get(signal.name)
        if value is None or math.isnan(value):
            continue
        per_replica = value / replicas if signal.pool_total else value
        ratio = per_replica / signal.target
        wanted = replicas if abs(ratio - 1.0) <= policy.tolerance else math.ceil(replicas * ratio - 1e-9)
        if best is None or wanted > best:
            best, reason = wanted, signal.name
    if best is None:
        return replicas, "hold"  # nothing measured: never scale on silence
    return max(policy.min_replicas, min(policy.max_replicas, best)), reason


def desired_replicas(policy: PoolPolicy, series: Sequence[Sample], replicas: int) -> list[Decision]:
    """Replay ``series`` (in time order) from ``replicas``; one decision per sample.

    Pure: the same inputs give the same decisions. Each decision takes effect at once (the next
    sample is read with the new count), as the HPA's does.
    """
    replicas = max(policy.min_replicas, min(policy.max_replicas, replicas))
    proposals: list[tuple[float, int]] = []  # (t, proposal), for the stabilisation windows
    changes: list[tuple[float, int]] = []  # (t, replicas added or removed), for the rate limits
    decisions = []
    for sample in series:
        proposed, reason = propose(policy, replicas, sample.values)
        proposals.append((sample.t, proposed))
        target = replicas
        if proposed > replicas:
            window = [p for t, p in proposals if sample.t - t <= policy.scale_up_window_s]
            target = max(replicas, min(window))
            added = sum(d for t, d in changes if d > 0 and sample.t - t < policy.period_s)
            start = replicas - added
            target = min(target, max(start + policy.scale_up_max_pods, 2 * start))
        elif proposed < replicas:
            window = [p for t, p in proposals if sample.t - t <= policy.scale_down_window_s]
            target = min(replicas, max(window))
            removed = -sum(d for t, d in changes if d < 0 and sample.t - t < policy.period_s)
            start = replicas + removed
            target = max(target, start - policy.scale_down_max_pods)
        target = max(policy.min_replicas, min(policy.max_replicas, target))
        if target != replicas:
            changes.append((sample.t, target - replicas))
        replicas = target
        decisions.append(Decision(sample.t, replicas, proposed, reason))
    return decisions
