"""What both OpenAI endpoints share: fan-out of choices, merging their deltas, usage, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from fastapi.responses import StreamingResponse

from common.protocol import ImageInput, PositionLogprobs, PromptLogprob
from common.sampling_params import SamplingParams
from router import beam_search
from router.admission import CLIENT_KEY, Lane, Slot
from router.choice_stream import ChoiceDelta, ChoiceStream, TextOptions
from router.dispatcher import EngineRequestError
from router.errors import APIError
from router.inline_stream import InlineSink, TokenChunks, sse_event
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
    text: TextOptions
    cache_salt: str | None
    created: int = field(default_factory=lambda: int(time.time()))
    # The LoRA adapter the request's model names (``RouterState.lora_name``); None: the base model.
    lora_name: str | None = None
    # The engines' id of the request (with each prompt's index after it): unique whatever id the
    # client gave the response (``request_id``, vLLM's extra); by default the response's id.
    engine_request_id: str = ""
    # Each prompt's images (``router.images``: a chat's one prompt, for a model that takes them); empty: none.
    images: list[list[ImageInput]] = field(default_factory=list)
    # vLLM's ``use_beam_search``: each prompt's ``n`` best beams are its choices (``router/beam_search.py``).
    beam_search: beam_search.BeamSearch | None = None

    def __post_init__(self) -> None:
        self.engine_request_id = self.engine_request_id or self.request_id

    @property
    def n(self) -> int:
        return self.params[0].n


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """The response's id and the engines' id of a request: ``prefix-<client_id>`` (vLLM's
    ``request_id``) and a unique one beside it, or one new id for both."""
    engine_id = new_request_id(prefix)
    return (engine_id if client_id is None else f"{prefix}-{client_id}"), engine_id


class ChoicesSlot:
    """One admission slot shared by the ``n`` choices of one engine request: it is handed on
    when the last of them releases it (``release`` may be called more than once per choice)."""

    def __init__(self, slot: Slot, num_choices: int) -> None:
        self._slot = slot
        self._left = num_choices

    @property
    def released(self) -> bool:
        return self._slot.released

    def release(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._slot.release()


class PlanChoices:
    """A plan's engine requests, one per prompt (``{request_id}-{prompt index}``) carrying its
    ``n`` choices, which the engines fork so they share the prompt's KV blocks. Each is sent once
    admission lets it (``router/admission.py``): the first by ``start_choices``, so its errors
    become the HTTP status, the rest by ``merge_choices`` while the earlier ones run.
    ``close`` (idempotent) aborts what runs and gives up what waits."""

    def __init__(self, state: RouterState, plan: GenerationPlan, lane: Lane) -> None:
        self.state = state
        self.plan = plan
        self.lane = lane
        self.num_choices = len(plan.prompts) * plan.n
        self._next_prompt = 0
        self.started: list[tuple[ChoiceStream, ChoicesSlot]] = []  # by start_choices, not yet merged
        self._running: list[tuple[ChoiceStream, ChoicesSlot]] = []

    def has_more(self) -> bool:
        return self._next_prompt < len(self.plan.prompts)

    async def start_next(self) -> list[tuple[ChoiceStream, ChoicesSlot]]:
        """Wait for the next prompt's turn and send it; each choice's stream with the slot they
        share, which each choice releases when it ends."""
        slot = await self.lane.next_slot()
        p = self._next_prompt
        self._next_prompt += 1
        prompt, params = self.plan.prompts[p], self.plan.params[p]
        try:
            engine_requests = await self.state.dispatcher.submit(
                f"{self.plan.engine_request_id}-{p}", prompt, params, self.plan.cache_salt, self.plan.lora_name,
                self.plan.images[p] if self.plan.images else None,
            )
        except BaseException:
            slot.release()
            raise
        # Counted as each prompt goes out: a 100,000-prompt request costs the event loop nothing up front.
        self.state.metrics.prompt_tokens.inc(len(prompt))
        self.state.metrics.request_prompt_tokens.observe(len(prompt))
        if self.lane.closed:  # closed while this one was sent (a cancellation lost on the way): end it
            for engine_request in engine_requests:
                engine_request.close()
            slot.release()
            raise asyncio.CancelledError()
        shared = ChoicesSlot(slot, len(engine_requests))
        started = [
            (ChoiceStream(p * params.n + i, engine_request, self.state.prompts.tokenizer, prompt,
                          self.plan.text, self.state.metrics), shared)
            for i, engine_request in enumerate(engine_requests)
        ]
        self._running.extend(started)
        if len(self._running) > 64:  # keep only the unfinished ones for ``close``
            self._running = [(st, sl) for st, sl in self._running if not sl.released]
        return started

    def close(self) -> None:
        self.lane.close()
        for stream, slot in self._running:
            stream.close()
            slot.release()
        self._running.clear()


async def start_choices(
    state: RouterState, plan: GenerationPlan, wait_disconnect: DisconnectWaiter | None = None
) -> PlanChoices:
    """Queue the plan's engine requests for admission (429 when the queue is full) and send the
    first. A client that leaves while the first waits for its turn gives its place up at once
    (``ClientDisconnected``), instead of holding its queued prompts until they all ran."""
    costs = [len(prompt) for prompt in plan.prompts]
    choices = PlanChoices(state, plan, state.admission.enter(
        CLIENT_KEY.get() or "-", costs, plan.params[0].priority if plan.params else 0
    ))
    try:
        first = asyncio.ensure_future(choices.start_next())
        gone = asyncio.ensure_future(wait_disconnect()) if wait_disconnect is not None else None
        try:
            await asyncio.wait([t for t in (first, gone) if t is not None], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
            if gone is not None and not gone.done():
                gone.cancel()
        if not first.done() or first.cancelled():
            raise ClientDisconnected()
        choices.started.extend(first.result())
    except BaseException:
        choices.close()
        raise
    return choices


async def wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the ASGI server reports that the client went away (after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


_DONE = object()


DisconnectWaiter = Callable[[], Awaitable[None]]


def merge_choices(
    choices: PlanChoices, wait_disconnect: DisconnectWaiter | None = None
) -> AsyncGenerator[ChoiceDelta, None]:
    """Deltas of all choices as they come, starting the waiting ones as admission lets them. The
    first error (or a disconnect, as ``ClientDisconnected``) ends the merge; leaving it in any way
    aborts every unfinished choice and gives up those not started."""
    if choices.num_choices == 1 and len(choices.started) == 1:
        return _one_choice(choices, wait_disconnect)
    return _many_choices(choices, wait_disconnect)


async def _many_choices(
    choices: PlanChoices, wait_disconnect: DisconnectWaiter | None
) -> AsyncGenerator[ChoiceDelta, None]:
    """``merge_choices`` of several choices: one task per choice feeds a queue."""
    queue: asyncio.Queue[object] = asyncio.Queue()
    pumps: set[asyncio.Task[None]] = set()

    async def pump(stream: ChoiceStream, slot: ChoicesSlot) -> None:
        try:
            async for delta in stream.deltas():
                queue.put_nowait(delta)
            queue.put_nowait(_DONE)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            slot.release()

    def spawn(stream: ChoiceStream, slot: ChoicesSlot) -> None:
        task = asyncio.create_task(pump(stream, slot))
        pumps.add(task)
        task.add_done_callback(pumps.discard)

    async def start_rest() -> None:
        try:
            while choices.has_more():
                for stream, slot in await choices.start_next():
                    spawn(stream, slot)
        except APIError as exc:  # e.g. no instance left: the response has started, so it ends in error
            queue.put_nowait(EngineRequestError(exc.message, status=exc.status))
        except Exception as exc:
            queue.put_nowait(exc)

    async def watch(waiter: DisconnectWaiter) -> None:
        await waiter()
        queue.put_nowait(ClientDisconnected())

    for stream, slot in choices.started:
        spawn(stream, slot)
    choices.started.clear()
    helpers = [asyncio.create_task(start_rest())]
    if wait_disconnect is not None:
        helpers.append(asyncio.create_task(watch(wait_disconnect)))
    remaining = choices.num_choices
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
        for task in helpers:
            task.cancel()
        # Closed before the helpers are awaited: a helper that missed its cancellation must not
        # go on taking slots and sending prompts (start_next ends what it sends after this).
        choices.close()
        for task in helpers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for task in list(pumps):
            task.cancel()
        for task in list(pumps):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _one_choice(
    choices: PlanChoices, wait_disconnect: DisconnectWaiter | None
) -> AsyncGenerator[ChoiceDelta, None]:
    """``merge_choices`` of a request with one choice (most requests): its deltas are read where
    they are consumed, with no task and queue between (a task switch less per token). A
    disconnect interrupts the engine request's wait instead."""
    stream, slot = choices.started.pop()
    engine_request = stream.engine_request

    async def watch(waiter: DisconnectWaiter) -> None:
        await waiter()
        engine_request.interrupt(ClientDisconnected())

    watcher = asyncio.create_task(watch(wait_disconnect)) if wait_disconnect is not None else None
    try:
        async with contextlib.aclosing(stream.deltas()) as deltas:
            async for delta in deltas:
                yield delta
    finally:
        slot.release()
        choices.close()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its deltas (non-streaming responses)."""

    index: int
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    token_ids: list[int] = field(default_factory=list)


class UsageTracker:
    """Token counts per choice; prompt tokens count once per prompt, not once per sample."""

    def __init__(self, plan: GenerationPlan) -> None:
        self._plan = plan
        self._output: dict[int, int] = {}
        self._cached: dict[int, int] = {}

    def update(self, delta: ChoiceDelta) -> None:
        self.count(delta.index, delta.num_output_tokens, delta.num_cached_tokens)

    def count(self, index: int, num_output_tokens: int, num_cached_tokens: int) -> None:
        self._output[index] = num_output_tokens
        prompt_index = index // self._plan.n
        self._cached[prompt_index] = max(self._cached.get(prompt_index, 0), num_cached_tokens)

    def choice_usage(self, index: int) -> Usage:
        """Choice ``index``'s usage so far: its prompt's tokens and its own (``continuous_usage_stats``)."""
        prompt_index = index // self._plan.n
        num_prompt = len(self._plan.prompts[prompt_index])
        num_output = self._output.get(index, 0)
        return Usage(
            prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self._cached.get(prompt_index, 0)),
        )

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
    results: dict[int, ChoiceResult] = {}  # built as choices report, not all up front
    usage = UsageTracker(plan)
    if plan.beam_search is not None:
        deltas = beam_search.replay(await beam_search.search(state, plan, wait_disconnect))
    else:
        deltas = merge_choices(await start_choices(state, plan, wait_disconnect), wait_disconnect)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            result = results.get(delta.index) or results.setdefault(delta.index, ChoiceResult(index=delta.index))
            result.text += delta.text
            result.logprobs += delta.logprobs
            result.text_offsets += delta.text_offsets
            result.token_ids += delta.token_ids
            result.finish_reason = delta.finish_reason or result.finish_reason
            if delta.prompt_logprobs is not None:
                result.prompt_logprobs = delta.prompt_logprobs
            usage.update(delta)
    return [results.get(i) or ChoiceResult(index=i) for i in range(len(plan.prompts) * plan.n)], usage.usage()


def engine_api_error(exc: EngineRequestError) -> APIError:
    return APIError(exc.status, str(exc), code="engine_error")


# The scope key under which the app keeps the server's ``send`` (``router.app.RouterApp``).
SERVER_SEND = "pdserve.server_send"


class ChunkWriter(TokenChunks, Protocol):
    """An endpoint's JSON chunks of a streaming response (``plain``: see ``TokenChunks``)."""

    # Its chunks of a plain token may be sent from the receive loop (``router/inline_stream.py``).
    inline: bool

    def opening(self) -> list[bytes]:
        """Chunks before the first delta."""

    def chunks(self, delta: ChoiceDelta) -> list[bytes]:
        """Chunks of one delta (none, say, for a token whose text is held back)."""

    def closing(self) -> list[bytes]:
        """Chunks after the last delta."""


def chunk_head(plan: GenerationPlan, object_name: str) -> bytes:
    """What a chunk of ``object_name`` starts with, up to its first choice's index, as pydantic
    writes it: a writer makes a plain token's chunk from fixed parts, without building models."""
    return msgspec.json.encode(
        {"id": plan.request_id, "object": object_name, "created": plan.created, "model": plan.model}
    )[:-1] + b',"choices":[{"index":'


async def _chunks(
    writer: ChunkWriter, deltas: AsyncGenerator[ChoiceDelta, None], finish: Callable[[], Awaitable[None]] | None,
) -> AsyncGenerator[bytes, None]:
    for chunk in writer.opening():
        yield chunk
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            for chunk in writer.chunks(delta):
                yield chunk
    if finish is not None:
        await finish()
    for chunk in writer.closing():
        yield chunk


class EventStreamResponse(StreamingResponse):
    """Server-sent events from JSON chunks, each sent as it comes; a failure mid-stream becomes an
    error event, then ``[DONE]``. However the response ends (finished, failed, client gone,
    cancelled), ``on_close`` runs and ``chunks`` is closed, which aborts the engines.

    One loop from the chunks to ``send``, where ``StreamingResponse`` would take three generators
    and a task listening for the disconnect: the chunks come from ``merge_choices``, which already
    ends with ``ClientDisconnected`` when the client goes. Per streamed token, that is the router's
    CPU. With a ``sink``, plain tokens skip even that loop: the receive loop sends them."""

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        close: Callable[[], None] | None = None,
        sink: InlineSink | None = None,
    ) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.chunks = chunks
        # What ``chunks`` closes when it ran (it may not have: a generator closed before its first
        # step runs no ``finally``), called once more at the end whatever happened. Idempotent.
        self.close_choices = close
        self.sink = sink
        self.on_close: Callable[[], None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sink = self.sink
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = b"data: [DONE]\n\n"
            # Each event goes to the server's own ``send`` where the app left it (``SERVER_SEND``):
            # the middleware between wrap ``send`` to see the response start, which went through them
            # above, and would otherwise run once per streamed token for nothing.
            send_event = scope.get(SERVER_SEND, send)
            if sink is not None:
                sink.attach(send_event)
            try:
                async for payload in self.chunks:
                    if sink is not None and sink.busy:
                        await sink.idle()  # what the sink sent came before this
                    await send_event({"type": "http.response.body", "body": sse_event(payload), "more_body": True})
            except ClientDisconnected:
                last = b""
            except EngineRequestError as exc:
                last = sse_event(msgspec.json.encode(engine_api_error(exc).body())) + last
            if sink is not None:
                sink.detach()
                await sink.idle()
            await send({"type": "http.response.body", "body": last, "more_body": False})
        finally:
            if sink is not None:
                sink.detach()
                sink.cancel()  # a send to a client that went away
            if self.on_close is not None:
                self.on_close()  # first: the awaits below may be cancelled again when the client went away
            if self.close_choices is not None:
                self.close_choices()
            await self.chunks.aclose()


async def sse_response(
    state: RouterState,
    plan: GenerationPlan,
    wait_disconnect: DisconnectWaiter,
    stream_options: Any,
    writer_for: Callable[[bool, bool], ChunkWriter],
    finish: Callable[[], Awaitable[None]] | None = None,
) -> EventStreamResponse:
    """Start every choice and send the JSON chunks of ``writer_for(include_usage, continuous_usage)``
    as SSE (``continuous_usage``: every chunk with its choice's usage so far, vLLM's
    ``continuous_usage_stats``, which needs ``include_usage``). ``finish``, when given, is awaited
    once every choice has ended, before the writer's closing chunks."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and bool(stream_options.continuous_usage_stats)
    if plan.beam_search is not None:  # the whole answer at the end, as vLLM streams a beam search
        beams = await beam_search.search(state, plan, wait_disconnect)
        return EventStreamResponse(_chunks(writer_for(include_usage, continuous), beam_search.replay(beams), finish))
    choices = await start_choices(state, plan, wait_disconnect)
    writer = writer_for(include_usage, continuous)
    sink = None
    if writer.inline and choices.num_choices == 1 and len(choices.started) == 1:
        sink = InlineSink(choices.started[0][0], writer, state.metrics.inline_outputs, state.client.after_sends)
    chunks = _chunks(writer, merge_choices(choices, wait_disconnect), finish)
    return EventStreamResponse(chunks, close=choices.close, sink=sink)
