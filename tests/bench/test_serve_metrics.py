"""The report math: percentiles, distributions, throughput, goodput and prefix reuse on synthetic samples."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ops.bench.serve_metrics import (
    SLO,
    RequestResult,
    distribution_ms,
    percentile,
    prefix_reuse,
    summarize,
    summarize_by_kind,
)


def result(ttft: float, e2e: float, tokens: int, itl: list[float] | None = None, ok: bool = True, kind: str = "main") -> RequestResult:
    return RequestResult(ok=ok, kind=kind, prompt_len=10, max_tokens=tokens, output_tokens=tokens if ok else 0,
                         ttft_s=ttft, e2e_s=e2e, itl_s=itl or [])


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(1)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(3.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_ignores_nan_and_is_nan_for_no_values() -> None:
    assert percentile([1.0, math.nan, 3.0], 50) == 2.0
    assert math.isnan(percentile([], 50))
    assert math.isnan(distribution_ms([])["p99"])


def test_distribution_is_in_milliseconds() -> None:
    d = distribution_ms([0.1, 0.2, 0.3, 0.4])
    assert d["mean"] == pytest.approx(250.0)
    assert d["p50"] == pytest.approx(250.0)
    assert d["p90"] == pytest.approx(370.0)


def test_summary_throughput_counts_only_successful_requests() -> None:
    results = [result(0.1, 1.0, 10, [0.1] * 9), result(0.2, 2.0, 30, [0.06] * 29), result(0, 0, 0, ok=False)]
    s = summarize(results, duration_s=4.0)
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (3, 2, 1)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(10.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
    # ITL pools every gap of every request: 9 of 100 ms and 29 of 60 ms.
    assert s["itl_ms"]["mean"] == pytest.approx((9 * 100 + 29 * 60) / 38)
    assert s["tpot_ms"]["p50"] == pytest.approx((100 + 1800 / 29) / 2)
    assert s["goodput"] == pytest.approx(0.5)  # no SLO: every successful request is good


def test_goodput_needs_both_ttft_and_mean_itl_within_the_slo() -> None:
    results = [
        result(0.1, 1.0, 11),  # ttft 100 ms, tpot 90 ms: good
        result(0.5, 1.4, 11),  # ttft 500 ms: too slow to start
        result(0.1, 3.1, 11),  # tpot 300 ms: too slow to stream
        result(0.1, 0.1, 1),  # one token, ttft fine: good (no inter-token gap to judge)
        result(0.1, 1.0, 11, ok=False),  # failed: never good
    ]
    s = summarize(results, duration_s=2.0, slo=SLO(ttft_ms=200, itl_ms=100))
    assert s["num_good"] == 2
    assert s["goodput"] == pytest.approx(1.0)
    assert s["good_fraction"] == pytest.approx(0.4)
    assert summarize(results, 2.0, SLO(ttft_ms=200))["num_good"] == 3


def test_summary_by_kind_splits_mixed_workloads_only() -> None:
    mixed = [result(0.1, 1, 5, kind="decode"), result(2.0, 2.5, 5, kind="long")]
    by_kind = summarize_by_kind(mixed, 3.0)
    assert set(by_kind) == {"decode", "long"}
    assert by_kind["long"]["ttft_ms"]["p50"] == pytest.approx(2000.0)
    assert summarize_by_kind([result(0.1, 1, 5)], 3.0) == {}


def test_prefix_reuse_counts_the_first_request_in_the_denominator() -> None:
    before = {"pdserve:prefix_cache_queries_total": 100.0, "pdserve:prefix_cache_hits_total": 40.0}
    after = {"pdserve:prefix_cache_queries_total": 100.0 + 32 * 2030, "pdserve:prefix_cache_hits_total": 40.0 + 31 * 2000}
    reuse = prefix_reuse(before, after, num_requests=32, prefix_len=2000, block_size=16)
    assert reuse["reused_fraction"] == pytest.approx(31 / 32)
    assert reuse["best_possible_fraction"] == pytest.approx(31 / 32)
    assert reuse["hit_fraction_of_all_prompt_tokens"] == pytest.approx(31 * 2000 / (32 * 2030))


def test_prefix_reuse_credits_no_more_than_the_prefix_and_only_full_blocks() -> None:
    after = {"pdserve:prefix_cache_queries_total": 1e6, "pdserve:prefix_cache_hits_total": 1e6}
    assert prefix_reuse({}, after, 4, 100, 16)["reused_fraction"] == 1.0
    # 100 tokens hold 6 full blocks of 16: at most 96 tokens of each later request can come from the cache.
    assert prefix_reuse({}, after, 4, 100, 16)["best_possible_fraction"] == pytest.approx(3 * 96 / 400)
    assert prefix_reuse({}, after, 4, 100, 16, num_prefixes=2)["best_possible_fraction"] == pytest.approx(2 * 96 / 400)
