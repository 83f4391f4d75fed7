"""The asynchronous load generator: streams requests to an OpenAI-compatible URL and times them.

Arrival: with a finite ``request_rate`` requests start at Poisson times (exponential gaps from a
seeded generator) whether or not earlier ones have finished (open loop); with ``concurrency``
at most that many are in flight, the next starting as one finishes (closed loop when the rate
is infinite, a cap on the Poisson stream otherwise). Per request it records the time to the
first chunk carrying content, the gaps between content chunks, the end-to-end time, and the
output tokens from the usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ops.bench.serve_metrics import RequestResult
from ops.bench.serve_workloads import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ClientConfig:
    base_url: str  # e.g. http://host:8000 (with or without /v1)
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    urgent_priority: int = 0  # the priority of an ``urgent`` request (0: none sent)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[self.endpoint]

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": req.max_tokens, "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **self.extra_body,
        }
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        if req.kind == "urgent" and self.urgent_priority:
            body["priority"] = self.urgent_priority
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        return body


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        parts.append(text or "")
    return "".join(parts)


async def send_one(
    client: httpx.AsyncClient, config: ClientConfig, req: BenchRequest, run_start: float
) -> RequestResult:
    """Stream one request; never raises (a failure is a result with ``ok=False``)."""
    result = RequestResult(ok=False, kind=req.kind, prompt_len=req.prompt_len, max_tokens=req.max_tokens)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    result.start_s = start - run_start
    last = start
    num_chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", config.url, json=config.payload(req), headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if num_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
        result.e2e_s = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        result.ok = num_chunks > 0
        if not result.ok:
            result.error = "the stream carried no content"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def poisson_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Start times (s from the run start) of ``num`` requests at ``rate`` per second; all 0 if infinite."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError("request rate must be positive")
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def _dispatch(
    client: httpx.AsyncClient,
    config: ClientConfig,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    concurrency: int | None,
    run_start: float,
) -> list[RequestResult]:
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        try:
            return await send_one(client, config, req, run_start)
        finally:
            if gate is not None:
                gate.release()

    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = run_start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        tasks.append(asyncio.create_task(one(req)))
    return list(await asyncio.gather(*tasks))


async def run_load(
    config: ClientConfig,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    concurrency: int | None = None,
    seed: int = 0,
    long_requests: Sequence[BenchRequest] = (),
    long_rate: float = math.inf,
) -> RunResult:
    """Run ``requests`` (and ``long_requests`` as a separate Poisson stream) and time them all."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        run_start = time.perf_counter()
        streams = [_dispatch(client, config, requests, poisson_offsets(len(requests), request_rate, seed),
                             concurrency, run_start)]
        if long_requests:  # the first one arrives one gap in, once the others are running
            offsets = poisson_offsets(len(long_requests) + 1, long_rate, seed + 1)[1:]
            streams.append(_dispatch(client, config, long_requests, offsets, None, run_start))
        parts = await asyncio.gather(*streams)
        duration = time.perf_counter() - run_start
    return RunResult([r for part in parts for r in part], duration)


async def first_model(base_url: str, api_key: str | None = None) -> str | None:
    """The first model id ``GET /v1/models`` lists, or None when the server does not say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        async with httpx.AsyncClient(timeout=30.0) as client:
            response = await client.get(url, headers=headers)
            return str(response.json()["data"][0]["id"])
    return None
