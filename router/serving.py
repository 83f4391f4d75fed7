"""What both OpenAI endpoints share: fan-out of choices, merging their deltas, usage, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

from common.protocol import PositionLogprobs
from common.sampling_params import SamplingParams
from router.choice_stream import ChoiceDelta, ChoiceStream
from router.dispatcher import EngineRequestError
from router.errors import APIError
from router.openai_responses import PromptTokensDetails, Usage
from router.state import RouterState


class ClientDisconnected(Exception):
    """The HTTP client went away; the request's engine work has been aborted."""


@dataclass
class GenerationPlan:
    """A validated request: one entry per prompt, each sampled ``n`` times."""

    request_id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # per prompt, n as requested
    stop: list[str]
    cache_salt: str | None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params[0].n


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def start_choices(state: RouterState, plan: GenerationPlan) -> list[ChoiceStream]:
    """Send every choice as its own n=1 engine request (``{request_id}-{index}``, seed + i)."""
    streams: list[ChoiceStream] = []
    try:
        for p, (prompt, params) in enumerate(zip(plan.prompts, plan.params, strict=True)):
            for i in range(params.n):
                index = p * params.n + i
                seed = None if params.seed is None else _wrap_int64(params.seed + i)
                engine_params = msgspec.structs.replace(params, n=1, seed=seed)
                engine_request = await state.dispatcher.submit(
                    f"{plan.request_id}-{index}", prompt, engine_params, plan.cache_salt
                )
                streams.append(
                    ChoiceStream(
                        index, engine_request, state.prompts.tokenizer, prompt, plan.stop, state.metrics
                    )
                )
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    for prompt in plan.prompts:
        state.metrics.prompt_tokens.inc(len(prompt))
        state.metrics.request_prompt_tokens.observe(len(prompt))
    return streams


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


async def wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the ASGI server reports that the client went away (after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


_DONE = object()


DisconnectWaiter = Callable[[], Awaitable[None]]


async def merge_choices(
    streams: list[ChoiceStream], wait_disconnect: DisconnectWaiter | None = None
) -> AsyncGenerator[ChoiceDelta, None]:
    """Deltas of all choices as they come. The first error (or a disconnect, as
    ``ClientDisconnected``) ends the merge; leaving it in any way aborts every unfinished choice."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: ChoiceStream) -> None:
        try:
            async for delta in stream.deltas():
                queue.put_nowait(delta)
            queue.put_nowait(_DONE)
        except Exception as exc:
            queue.put_nowait(exc)

    async def watch(waiter: DisconnectWaiter) -> None:
        await waiter()
        queue.put_nowait(ClientDisconnected())

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    if wait_disconnect is not None:
        tasks.append(asyncio.create_task(watch(wait_disconnect)))
    remaining = len(streams)
    try:
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                assert isinstance(item, ChoiceDelta)
                yield item
    finally:
        for stream in streams:
            stream.close()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its deltas (non-streaming responses)."""

    index: int
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class UsageTracker:
    """Token counts per choice; prompt tokens count once per prompt, not once per sample."""

    def __init__(self, plan: GenerationPlan) -> None:
        self._plan = plan
        self._output: dict[int, int] = {}
        self._cached: dict[int, int] = {}

    def update(self, delta: ChoiceDelta) -> None:
        self._output[delta.index] = delta.num_output_tokens
        prompt_index = delta.index // self._plan.n
        self._cached[prompt_index] = max(self._cached.get(prompt_index, 0), delta.num_cached_tokens)

    def usage(self) -> Usage:
        num_prompt = sum(len(p) for p in self._plan.prompts)
        num_output = sum(self._output.values())
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_output,
            total_tokens=num_prompt + num_output,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached.values())),
        )


async def collect(
    state: RouterState, plan: GenerationPlan, wait_disconnect: DisconnectWaiter
) -> tuple[list[ChoiceResult], Usage]:
    """Run a non-streaming request to the end; raises ``ClientDisconnected`` or ``EngineRequestError``."""
    streams = await start_choices(state, plan)
    results = {s.index: ChoiceResult(index=s.index) for s in streams}
    usage = UsageTracker(plan)
    deltas = merge_choices(streams, wait_disconnect)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            result = results[delta.index]
            result.text += delta.text
            result.logprobs += delta.logprobs
            result.text_offsets += delta.text_offsets
            result.finish_reason = delta.finish_reason or result.finish_reason
            usage.update(delta)
    return [results[i] for i in sorted(results)], usage.usage()


def engine_api_error(exc: EngineRequestError) -> APIError:
    return APIError(exc.status, str(exc), code="engine_error")


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def stream_errors(chunks: AsyncGenerator[str, None]) -> AsyncIterator[bytes]:
    """Server-sent events from JSON chunks; a failure mid-stream becomes an error event, then
    ``[DONE]``. Closing this stream (client gone) closes ``chunks``, which aborts the engines."""
    try:
        try:
            async for payload in chunks:
                yield _sse(payload)
        except ClientDisconnected:
            return
        except EngineRequestError as exc:
            yield _sse(msgspec.json.encode(engine_api_error(exc).body()).decode())
        yield b"data: [DONE]\n\n"
    finally:
        await chunks.aclose()


async def sse_response(
    state: RouterState,
    plan: GenerationPlan,
    wait_disconnect: DisconnectWaiter,
    stream_options: Any,
    write: Callable[[AsyncGenerator[ChoiceDelta, None], bool], AsyncGenerator[str, None]],
) -> StreamingResponse:
    """Start every choice and send the JSON chunks ``write(deltas, include_usage)`` makes as SSE."""
    include_usage = bool(stream_options and stream_options.include_usage)
    streams = await start_choices(state, plan)
    chunks = write(merge_choices(streams, wait_disconnect), include_usage)
    return StreamingResponse(stream_errors(chunks), media_type="text/event-stream")
