"""Sends a chaos run's requests at a fixed concurrency and keeps each answer's text.

Streaming and non-streaming requests to both endpoints go through the serving benchmark's
``ClientConfig`` (URL and body). A request counts as completed only when its answer is whole: a
200, no error object, and for a stream the closing ``[DONE]`` (a stream cut short by a dying
process is a failure, not a short answer). Times are seconds since ``zero``, a ``time.monotonic()``
reading shared with the fault injector, so requests and faults sit on one clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ops.bench.chaos_workload import ChaosRequest
from ops.bench.serve_client import ClientConfig, _chunk_text


@dataclass
class ChaosResult:
    """One request's answer as the client saw it."""

    request_index: int
    ok: bool = False
    text: str = ""
    num_tokens: int | None = None  # usage.completion_tokens, when the server sent it
    num_chunks: int = 0  # streamed chunks that carried text
    finish_reason: str | None = None
    start_s: float = math.nan
    end_s: float = math.nan
    error: str = ""

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["latency_s"] = self.latency_s
        return data


@dataclass(frozen=True)
class ClientSettings:
    base_url: str
    model: str | None
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0

    def config(self, endpoint: str) -> ClientConfig:
        return ClientConfig(self.base_url, self.model, endpoint, self.api_key, 0.0, self.ignore_eos, self.timeout_s)


def request_body(settings: ClientSettings, req: ChaosRequest) -> dict[str, Any]:
    """The JSON body: greedy, the serving benchmark's fields, ``stream`` as the request asks."""
    body = settings.config(req.endpoint).payload(req.bench_request())
    if not req.stream:
        body["stream"] = False
        body.pop("stream_options", None)
    return body


def _finish_reason(chunk: dict[str, Any]) -> str | None:
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


def _answer_text(body: dict[str, Any]) -> str:
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message")
    return str((message.get("content") if isinstance(message, dict) else choice.get("text")) or "")


async def _read_stream(response: httpx.Response, result: ChaosResult) -> None:
    parts: list[str] = []
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"])[:300]
            return
        text = _chunk_text(chunk)
        if text:
            parts.append(text)
            result.num_chunks += 1
        result.finish_reason = _finish_reason(chunk) or result.finish_reason
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            result.num_tokens = int(usage["completion_tokens"])
    result.text = "".join(parts)
    result.ok = done
    if not done:
        result.error = "the stream ended without [DONE]"


async def send_request(
    client: httpx.AsyncClient, settings: ClientSettings, req: ChaosRequest, zero: float
) -> ChaosResult:
    """Send one request and read its whole answer; never raises (a failure is ``ok=False``)."""
    result = ChaosResult(req.request_index)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    url = settings.config(req.endpoint).url
    result.start_s = time.monotonic() - zero
    try:
        async with client.stream("POST", url, json=request_body(settings, req), headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
            elif req.stream:
                await _read_stream(response, result)
            else:
                answer = json.loads(await response.aread())
                result.text = _answer_text(answer)
                result.num_tokens = (answer.get("usage") or {}).get("completion_tokens")
                result.finish_reason = _finish_reason(answer)
                result.ok = bool(answer.get("choices"))
                result.error = "" if result.ok else "the answer has no choices"
    except (httpx.HTTPError, json.JSONDecodeError, OSError, ValueError, AttributeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.end_s = time.monotonic() - zero
    return result


async def run_pass(
    settings: ClientSettings, requests: Sequence[ChaosRequest], concurrency: int, zero: float,
    on_done: Callable[[ChaosResult], None] | None = None,
) -> list[ChaosResult]:
    """Every request, at most ``concurrency`` in flight, in list order; results in the same order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(settings.timeout_s, connect=30.0)

    async def one(client: httpx.AsyncClient, req: ChaosRequest) -> ChaosResult:
        async with gate:
            result = await send_request(client, settings, req, zero)
        if on_done is not None:
            on_done(result)
        return result

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        return list(await asyncio.gather(*(one(client, r) for r in requests)))


class Progress:
    """Prints ``done/total`` (and failures) about every tenth of a pass."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total = name, total
        self.num_done = self.num_failed = 0
        self.step = max(1, total // 10)

    def __call__(self, result: ChaosResult) -> None:
        self.num_done += 1
        self.num_failed += 0 if result.ok else 1
        if self.num_done % self.step == 0 or self.num_done == self.total:
            print(f"  {self.name}: {self.num_done}/{self.total} done, {self.num_failed} failed "
                  f"(t={result.end_s:.0f}s)", flush=True)
