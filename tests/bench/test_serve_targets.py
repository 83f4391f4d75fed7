"""Reading engine metrics: the names the benchmark sums are the ones an engine serves."""

from __future__ import annotations

from ops.bench.serve_metrics import prefix_reuse
from ops.bench.serve_targets import BatchSampler, add_metrics, scrape
from tests.conftest import free_port


def test_scraped_engine_counters_give_the_prefix_reuse() -> None:
    from common.engine.engine import EngineStats
    from common.metrics import EngineMetrics

    metrics = EngineMetrics("prefill", "prefill-0")
    port = free_port()
    metrics.serve("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/metrics"
    metrics.update(EngineStats(2, 1, 0.5, 100, 50, prefix_cache_queries=2100, prefix_cache_hits=0, num_preemptions=0))
    before = scrape(url)
    metrics.update(EngineStats(0, 0, 0.1, 100, 90, prefix_cache_queries=6300, prefix_cache_hits=4000, num_preemptions=1))
    after = add_metrics([scrape(url), {"pdserve:prefix_cache_hits_total": 0.0}])
    assert before["pdserve:num_requests_running"] == 2.0
    assert after["pdserve:num_preemptions_total"] == 1.0
    reuse = prefix_reuse(before, after, num_requests=3, prefix_len=2000, block_size=16)
    assert reuse["prompt_tokens_queried"] == 4200 and reuse["reused_fraction"] == 4000 / 6000


def test_batch_sampler_averages_only_busy_samples() -> None:
    sampler = BatchSampler([])
    sampler.samples = [0.0, 4.0, 2.0, 0.0]
    assert sampler.mean_busy == 3.0
    assert BatchSampler([]).mean_busy == 0.0
