"""Runs a workload against each target and each load level, and the in-process baselines.

Each served run records, besides the client's measurements, the engines' counters before and
after (read from the registry's ``metrics_url`` of each instance) and the decode instances'
running batch sampled during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import time
from typing import Any

import httpx

from ops.bench import serve_report as report
from ops.bench.serve_client import ClientConfig, first_model, run_load, send_one
from ops.bench.serve_metrics import SLO, prefix_reuse, summarize, summarize_by_kind
from ops.bench.serve_targets import (
    IN_PROCESS,
    BatchSampler,
    LaunchedStack,
    add_metrics,
    block_size_of,
    engine_metrics_urls,
    metrics_of,
)
from ops.bench.serve_workloads import BenchRequest, PromptBuilder, Workload

_METRICS_SETTLE_S = 1.2  # engines refresh their counters every 0.5 s


def _counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.endswith("_total")}


async def _warm_up(config: ClientConfig, builder: PromptBuilder, num: int) -> None:
    async with httpx.AsyncClient(timeout=config.timeout_s) as client:
        for _ in range(num):
            text, ids = builder.build(24)
            result = await send_one(client, config, BenchRequest(text, tuple(ids), 4, "warmup"), time.perf_counter())
            if not result.ok:
                raise RuntimeError(f"warm-up request failed: {result.error}")


def run_target(
    name: str, url: str, redis_url: str | None, args: argparse.Namespace, workload: Workload,
    builder: PromptBuilder, levels: list[int | None], slo: SLO,
) -> list[dict[str, Any]]:
    """Every load level against one URL; engine metrics too when a registry is known."""
    model = args.served_model_name or asyncio.run(first_model(url, args.api_key))
    config = ClientConfig(url, model, args.endpoint, args.api_key, args.temperature, args.ignore_eos,
                          args.request_timeout, urgent_priority=getattr(args, "urgent_priority", 0))
    asyncio.run(_warm_up(config, builder, args.warmup))
    urls = engine_metrics_urls(redis_url) if redis_url else {}
    decode_urls = list(engine_metrics_urls(redis_url, "decode").values()) if redis_url else []
    runs = []
    for level in levels:
        time.sleep(_METRICS_SETTLE_S)
        before = add_metrics(list(metrics_of(urls).values()))
        load_before = os.getloadavg()[0]
        with BatchSampler(decode_urls) as sampler:
            outcome = asyncio.run(run_load(
                config, workload.requests, request_rate=args.request_rate, concurrency=level, seed=args.seed,
                long_requests=workload.long_requests, long_rate=workload.long_rate,
            ))
        time.sleep(_METRICS_SETTLE_S)
        after = add_metrics(list(metrics_of(urls).values()))
        run: dict[str, Any] = {
            "target": name, "url": url if name.startswith("url") else None, "concurrency": level,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "summary": summarize(outcome.results, outcome.duration_s, slo),
            "by_kind": summarize_by_kind(outcome.results, outcome.duration_s, slo),
            "mean_decode_batch": sampler.mean_busy if decode_urls else None,
            "engine_counters": _counter_delta(before, after) if urls else {},
            "requests": [r.to_json() for r in outcome.results],
            "itl_samples_s": [g for r in outcome.results if r.ok for g in r.itl_s],
            "errors": sorted({r.error for r in outcome.results if not r.ok})[:5],
            "load_avg_1m": [load_before, os.getloadavg()[0]],  # the machine's load, others' work included
        }
        if redis_url:
            run["block_size"] = block_size_of(redis_url)
        if workload.prefix_len and urls:
            num = len(workload.requests)
            run["prefix_reuse"] = prefix_reuse(before, after, num, workload.prefix_len, run["block_size"],
                                               workload.num_prefixes)
        runs.append(run)
        print(report.results_table([run]).splitlines()[-1], flush=True)
    return runs


def run_served(args: argparse.Namespace, targets: list[tuple[str, str | None]], workload: Workload,
               builder: PromptBuilder, levels: list[int | None], slo: SLO, model: str) -> list[dict[str, Any]]:
    """Every served target in turn; a launched one is stopped before the next starts."""
    runs: list[dict[str, Any]] = []
    for name, url in targets:
        if name in IN_PROCESS:
            continue
        if url is not None:
            runs += run_target(name, url, args.redis_url, args, workload, builder, levels, slo)
            continue
        print(f"pdserve bench: launching {name}...", flush=True)
        threads = args.threads or None
        with LaunchedStack(name, model, shlex.split(args.engine_args), threads) as stack:
            target_runs = run_target(name, stack.url, stack.redis_url, args, workload, builder, levels, slo)
        if args.ceiling and workload.name == "random":
            measure_ceilings(target_runs, workload, model)
        runs += target_runs
    return runs


def measure_ceilings(runs: list[dict[str, Any]], workload: Workload, model: str) -> None:
    """Sets ``run["ceiling"]``: the bare decode forward at the batch each run's decode instance ran.

    Timed right after the target's stack stopped, so under the machine's load of that moment
    rather than at the end of a long invocation. The batch is the decode instance's mean running
    batch while it was busy (rounded), contexts are the workload's prompt + half its output.
    """
    from ops.bench.serve_baselines import decode_ceiling

    contexts = [r.prompt_len + r.max_tokens // 2 for r in workload.requests]
    measured: dict[int, dict[str, Any]] = {}
    for run in runs:
        size = max(1, round(run["mean_decode_batch"] or run["concurrency"] or 1))
        if size not in measured:
            print(f"pdserve bench: bare decode forward, batch {size}...", flush=True)
            batch = [contexts[i % len(contexts)] for i in range(size)]
            measured[size] = decode_ceiling(model, batch, block_size=run.get("block_size", 16))
            measured[size].update(after_target=run["target"], load_avg_1m=os.getloadavg()[0])
        run["ceiling"] = measured[size]


def run_hf(args: argparse.Namespace, workload: Workload, levels: list[int | None], model: str) -> list[dict[str, Any]]:
    """transformers ``generate`` at ``--hf-batch-size``, else at each concurrency (16 without one)."""
    from ops.bench.serve_baselines import hf_generate_throughput

    results = []
    for size in [args.hf_batch_size] if args.hf_batch_size else sorted({lv or 16 for lv in levels}):
        print(f"pdserve bench: transformers generate, batch {size}...", flush=True)
        results.append({**hf_generate_throughput(model, workload.requests, size), "load_avg_1m": os.getloadavg()[0]})
    return results
