"""The load generator against a scripted OpenAI-compatible SSE server: timing and arrival behaviour."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from ops.bench.serve_client import ClientConfig, poisson_offsets, run_load
from ops.bench.serve_workloads import BenchRequest
from tests.bench.fake_openai_server import FakeServer, Script


def requests(num: int, max_tokens: int) -> list[BenchRequest]:
    return [BenchRequest(f"prompt {i}", (1, 2, 3), max_tokens) for i in range(num)]


def test_ttft_is_the_first_content_chunk_and_itl_the_gaps_between_chunks() -> None:
    script = Script(first_token_delay_s=0.3, token_gap_s=0.1, tokens_per_chunk=2)
    with FakeServer(script) as server:
        out = asyncio.run(run_load(ClientConfig(server.url), requests(1, 10)))
    (r,) = out.results
    assert r.ok, r.error
    assert 0.3 <= r.ttft_s < 0.6  # the empty role chunk sent at once does not count as the first token
    # One gap per later chunk (not per token). A chunk read late shortens the gap after it (once 89 ms
    # on a loaded host), so each gap is bounded loosely and their sum, the last chunk's time after the
    # first's, against the server's four 0.1 s waits less the first chunk's own delay.
    assert len(r.itl_s) == 4 and all(0.05 <= gap < 0.4 for gap in r.itl_s), r.itl_s
    assert sum(r.itl_s) > 0.35, r.itl_s
    assert r.output_tokens == 10  # from the usage chunk, not the 5 content chunks
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6


def test_request_body_streams_with_usage_and_ignores_eos() -> None:
    with FakeServer(Script()) as server:
        config = ClientConfig(server.url + "/v1", model="m", extra_body={"top_k": 1})
        asyncio.run(run_load(config, requests(1, 3)))
    (body,) = server.record.bodies
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["model"] == "m" and body["top_k"] == 1


def test_urgent_requests_carry_the_priority_and_the_others_none() -> None:
    from ops.bench.serve import mark_urgent
    from ops.bench.serve_workloads import Workload

    workload = Workload("w", requests(8, 2))
    mark_urgent(workload, 0.25)
    assert [r.kind for r in workload.requests] == ["urgent", "main", "main", "main", "urgent", "main", "main", "main"]
    with FakeServer(Script()) as server:
        asyncio.run(run_load(ClientConfig(server.url, urgent_priority=-3), workload.requests[:2], concurrency=1))
        asyncio.run(run_load(ClientConfig(server.url), workload.requests[:1], concurrency=1))  # a baseline run
    assert [body.get("priority") for body in server.record.bodies] == [-3, None, None]


def test_closed_loop_keeps_exactly_concurrency_requests_in_flight() -> None:
    with FakeServer(Script(first_token_delay_s=0.2, token_gap_s=0.01)) as server:
        out = asyncio.run(run_load(ClientConfig(server.url), requests(9, 3), concurrency=3))
    assert all(r.ok for r in out.results)
    assert server.record.max_in_flight == 3
    starts = sorted(r.start_s for r in out.results)
    assert starts[2] < 0.1 and starts[3] > 0.2  # the 4th waits for one of the first three to finish
    assert out.duration_s >= 3 * 0.2


def test_poisson_arrivals_follow_the_schedule_and_do_not_wait_for_answers() -> None:
    reqs = requests(12, 2)
    with FakeServer(Script(first_token_delay_s=0.6)) as server:
        out = asyncio.run(run_load(ClientConfig(server.url), reqs, request_rate=20.0, seed=7))
    expected = poisson_offsets(len(reqs), 20.0, 7)
    starts = sorted(r.start_s for r in out.results)
    # Never early; late by less than a second on a loaded host (a client that waited for the 0.6 s
    # answers would fall seconds behind by the twelfth request).
    assert all(-0.05 < s - e < 1.0 for s, e in zip(starts, expected, strict=True)), list(zip(starts, expected, strict=True))
    assert server.record.max_in_flight > 3  # open loop: arrivals overlap slow answers


def test_poisson_offsets_have_the_asked_rate_and_are_reproducible() -> None:
    offsets = poisson_offsets(5000, 10.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.08)  # exponential: sd == mean
    assert offsets == poisson_offsets(5000, 10.0, seed=3)
    assert poisson_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_http_errors_are_failed_results_not_exceptions() -> None:
    with FakeServer(Script(status=400)) as server:
        out = asyncio.run(run_load(ClientConfig(server.url), requests(2, 3)))
    assert [r.ok for r in out.results] == [False, False]
    assert "HTTP 400" in out.results[0].error
