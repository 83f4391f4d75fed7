"""The prefill autoscaling signal ``pdserve:num_prompt_tokens_waiting``: exported only once the
engine reports it, so an autoscaler never reads a false zero."""

from __future__ import annotations

from prometheus_client import generate_latest

from common.engine.engine import EngineStats
from common.metrics import EngineMetrics


def stats(**extra: float) -> EngineStats:
    return EngineStats(1, 3, 0.5, 100, 50, 0, 0, 0, extra=dict(extra))


def test_prompt_tokens_waiting_is_absent_until_the_engine_reports_it_then_follows_it() -> None:
    metrics = EngineMetrics("prefill", "prefill-0", "m")
    metrics.update(stats())
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE pdserve:num_prompt_tokens_waiting gauge" in text  # the family is declared...
    assert "pdserve:num_prompt_tokens_waiting{" not in text  # ...with no sample
    metrics.update(stats(num_prompt_tokens_waiting=1234))
    line = 'pdserve:num_prompt_tokens_waiting{instance="prefill-0",model_name="m",role="prefill"} 1234.0'
    assert line in generate_latest(metrics.registry).decode()
    metrics.update(stats(num_prompt_tokens_waiting=0))
    assert line.replace("1234.0", "0.0") in generate_latest(metrics.registry).decode()
