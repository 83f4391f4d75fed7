"""``POST /v1/responses``: a Responses request planned as the chat completion it is
(``router/responses_api.py``), answered whole or as the API's stream of typed events, and stored
once it has finished (``router/response_store.py``), or run in the background
(``router/background_responses.py``); the routes that read, cancel and remove stored ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi.responses import JSONResponse
from starlette.responses import Response

from common.protocol import PositionLogprobs
from router.background_responses import failed_by_loss, keep_lease, lapsed, leased, running
from router.chat_answer import AnswerReader, AnswerStream
from router.choice_stream import ChoiceDelta, ChoiceStream
from router.dispatcher import EngineRequestError
from router.errors import APIError, bad_request
from router.logprobs import TokenRenderer, chat_logprobs
from router.openai_models import StreamOptions, parse_request
from router.reasoning_state import ReasoningSeal
from router.response_store import ResponseStore, StoredResponse, unavailable
from router.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    new_id,
    output_items,
    renamed,
    response_object,
    response_usage,
    stored_items,
)
from router.serving import (
    ClientDisconnected,
    DisconnectWaiter,
    EventStreamResponse,
    GenerationPlan,
    UsageTracker,
    collect,
    merge_choices,
    sse_response,
    start_choices,
)
from router.serving_chat import plan_chat
from router.serving_conversations import add_items, conversation_items, page
from router.state import RouterState

logger = logging.getLogger(__name__)


def _seal(state: RouterState, request: ResponsesRequest) -> ReasoningSeal | None:
    """What gives the output's reasoning items their ``encrypted_content``, where ``include`` asks for it."""
    return state.reasoning_seal if request.wants_reasoning_state else None


def _renderer(state: RouterState, request: ResponsesRequest) -> TokenRenderer | None:
    """What writes the output's tokens and their alternatives, where their log-probabilities are asked for."""
    return TokenRenderer(state.prompts.tokenizer, False) if request.wants_logprobs else None


def _logprobs(renderer: TokenRenderer | None, positions: list[PositionLogprobs]) -> list[dict[str, Any]]:
    """The tokens' log-probabilities as the output text's ``logprobs`` (the chat completion's entries)."""
    if renderer is None or not positions:
        return []
    return [entry.model_dump() for entry in chat_logprobs(renderer, positions).content or ()]


def _reasoning_tokens(state: RouterState, reasoning: str | None) -> int:
    """The thinking's tokens, counted by tokenizing its text (the answer's own ids are not kept)."""
    return len(state.prompts.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


Saver = Callable[[dict[str, Any]], Awaitable[bool]]


async def create_response(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> Response:
    request = parse_request(ResponsesRequest, body, state.config.limits)
    owner = cache_salt or ""
    earlier = await _earlier_items(state, request, owner)
    try:
        plan, reader = await _plan_in_context(state, request, earlier, cache_salt)
    except APIError as exc:
        raise renamed(exc, request) from None
    if request.wants_logprobs and not reader.plain:
        raise bad_request("the output's log-probabilities are served for answers of text alone, not for a model "
                          "whose answers a reasoning or tool-call parser reads", param="include")
    response_id = new_id("resp")
    store = state.responses is not None and request.store is not False
    own = stored_items(request.own_items())  # (the same ids in the stored response and in its conversation)
    save = _saver(state, owner, earlier, own, store, request.conversation_id)
    if request.background:
        started = await _start_background(state, request, response_id, plan, reader, owner, earlier, own)
        if request.stream:  # its events as they are logged; a client that goes leaves it running
            return EventStreamResponse(tail_events(state, owner, response_id, -1, wait_disconnect))
        return JSONResponse(started)
    if request.stream:
        events = ResponseEvents(request, response_id, plan.created, plan.model, store, _seal(state, request))
        chunks = _ResponseChunks(state, plan, reader, events, save, _renderer(state, request))
        return await sse_response(
            state, plan, wait_disconnect, StreamOptions(include_usage=True), lambda include_usage, continuous: chunks,
            finish=chunks.finish,
        )
    response = await _answer(state, request, response_id, plan, reader, wait_disconnect, store)
    if save is not None:
        response["store"] = await save(response)
    return JSONResponse(response)


async def _plan_in_context(
    state: RouterState, request: ResponsesRequest, earlier: list[dict[str, Any]], cache_salt: str | None
) -> tuple[GenerationPlan, AnswerReader]:
    """The chat path's plan for the request's conversation. Where it does not fit the context (the prompt, with the
    room ``max_output_tokens`` asks for) and ``truncation`` is ``"auto"``, the fewest of its first items are dropped
    that let it fit, the conversation starting at a user message (system and developer messages kept: the
    instructions stay); where even its last user message on does not fit, the 400 the whole conversation got."""
    try:
        _, plan, reader = await plan_chat(state, request.chat_body(earlier, seal=state.reasoning_seal), cache_salt)
        return plan, reader
    except APIError as exc:
        if request.truncation != "auto" or exc.code != "context_length_exceeded":
            raise
        too_long = exc

    async def fitting(dropped: int) -> tuple[GenerationPlan, AnswerReader] | None:
        try:
            _, plan, reader = await plan_chat(state, request.chat_body(earlier, dropped, state.reasoning_seal),
                                              cache_salt)
        except APIError as exc:
            if exc.code != "context_length_exceeded":
                raise
            return None
        return plan, reader

    starts = request.turn_starts(earlier)
    best: tuple[GenerationPlan, AnswerReader] | None = None
    low, high = 0, len(starts) - 1  # the first start that fits (a later one drops more, so fits too)
    while low <= high:
        middle = (low + high) // 2
        found = await fitting(starts[middle])
        if found is None:
            low = middle + 1
        else:
            best, high = found, middle - 1
    if best is None:
        raise too_long
    return best


async def _answer(
    state: RouterState, request: ResponsesRequest, response_id: str, plan: GenerationPlan, reader: AnswerReader,
    wait_disconnect: DisconnectWaiter, store: bool,
) -> dict[str, Any]:
    """The whole response, once the engines have answered."""
    results, usage = await collect(state, plan, wait_disconnect)
    [result] = results
    message, _ = reader.message(result.text, result.finish_reason)
    status = "incomplete" if result.finish_reason == "length" else "completed"
    reasoning_tokens = _reasoning_tokens(state, message.reasoning_content)
    logprobs = _logprobs(_renderer(state, request), result.logprobs)
    return response_object(
        request, response_id, plan.created, plan.model, status,
        output_items(message, status, logprobs, _seal(state, request), request.wants_summary),
        response_usage(usage, reasoning_tokens), store,
    )


async def _start_background(
    state: RouterState, request: ResponsesRequest, response_id: str, plan: GenerationPlan, reader: AnswerReader,
    owner: str, earlier: list[dict[str, Any]], own: list[dict[str, Any]],
) -> dict[str, Any]:
    """Store the response in progress, and run it in this process (``router/background_responses.py``); once it
    ends, its items go to its conversation, if it has one."""
    if state.responses is None or request.store is False:
        raise bad_request("background needs the response stored: store true, on a router with --response-ttl > 0",
                          param="background")
    responses = state.responses
    record = leased(StoredResponse(owner, response_object(
        request, response_id, plan.created, plan.model, "in_progress", [], None, True), [*earlier, *own],
        streamed=bool(request.stream)))
    state.admit()  # a seat among the requests in flight until it ends (the request's own is left as it returns)
    if not await responses.save(record):
        state.leave()
        raise unavailable()

    async def run(cancelled: asyncio.Event) -> None:
        lease = asyncio.create_task(keep_lease(responses, record, cancelled))

        async def until_cancelled() -> None:
            await cancelled.wait()

        events = ResponseEvents(request, response_id, plan.created, plan.model, True, _seal(state, request))
        log = _EventLog(responses, response_id)
        try:
            if request.stream:
                response = await _stream_to_log(state, plan, reader, events, log, until_cancelled,
                                                _renderer(state, request))
            else:
                response = await _answer(state, request, response_id, plan, reader, until_cancelled, True)
        except ClientDisconnected:  # cancelled, here or through another process: its stream just ends
            response = {**record.response, "status": "cancelled"}
        except (EngineRequestError, APIError) as exc:  # an engine's error, or none to run it on
            response = {**record.response, "status": "failed", "error": {"code": "server_error", "message": str(exc)}}
            if request.stream:
                await log.append([events.failed(response)])
        finally:
            lease.cancel()
            state.leave()
        ended = msgspec.structs.replace(record, response=response, lease_until=0.0)
        with contextlib.suppress(Exception):  # the store down: readers find the lease lapsed, then failed
            # Only over the running record: not if deleted meanwhile, nor over a cancel or a lapse marked failed
            # since (a client may have been told so).
            await responses.update(response_id, owner, lambda r: ended if running(r) else None)
        if request.conversation_id is not None:
            with contextlib.suppress(APIError):  # the store down: the items are not added (the record was not saved)
                await _add_to_conversation(state, owner, request.conversation_id, own, response)

    state.background.start(response_id, run)
    return record.response


class _EventLog:
    """A streaming background response's events, appended to its log in the store as they come (the
    record's final state is saved after its last event: a reader that finds the record ended has the
    whole log). An event Redis did not take is counted all the same: readers then find the record ended
    without it, and end there."""

    def __init__(self, store: ResponseStore, response_id: str) -> None:
        self.store, self.response_id, self.next = store, response_id, 0

    async def append(self, events: list[bytes]) -> None:
        first, self.next = self.next, self.next + len(events)
        if not await self.store.append_events(self.response_id, first, events):
            logger.warning("response %s: events %d-%d not logged (the store is unreachable)", self.response_id,
                           first, self.next - 1)


async def _stream_to_log(
    state: RouterState, plan: GenerationPlan, reader: AnswerReader, events: ResponseEvents, log: _EventLog,
    until_cancelled: DisconnectWaiter, renderer: TokenRenderer | None,
) -> dict[str, Any]:
    """Run a streaming background response: its events, as a streamed response writes them, into ``log``;
    returns the whole response (its last event's)."""
    writer = _ResponseChunks(state, plan, reader, events, None, renderer)
    choices = await start_choices(state, plan, until_cancelled)
    try:
        await log.append(writer.opening())
        async with contextlib.aclosing(merge_choices(choices, until_cancelled)) as deltas:
            async for delta in deltas:
                await log.append(writer.chunks(delta))
        await writer.finish()
        await log.append(writer.closing())
    finally:
        choices.close()
    assert writer.response is not None
    return writer.response


# The events after which a response's stream has nothing more to say.
_LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_POLL_S = (0.02, 0.25)  # how often a reader looks for new events: at first, and at most after backing off


class _EventKind(msgspec.Struct):
    type: str


_kind_decoder = msgspec.json.Decoder(_EventKind)


async def tail_events(
    state: RouterState, owner: str, response_id: str, after: int, wait_disconnect: DisconnectWaiter
) -> AsyncGenerator[bytes, None]:
    """A streaming background response's events numbered after ``after``, from its log, then as they are
    logged, up to its last (completed, incomplete or failed). A response cancelled ends after its
    events so far; one whose router process stopped ends with ``response.failed`` once its lease lapsed
    (and is stored so). Ends when the client goes (``ClientDisconnected``); the response runs on."""
    store = _store(state, response_id)
    disconnect = asyncio.ensure_future(wait_disconnect())
    delay = _POLL_S[0]
    ended: StoredResponse | None = None  # the record, once it was found ended
    try:
        while True:
            new = await store.read_events(response_id, after)
            for event in new:
                after += 1
                yield event
                if _kind_decoder.decode(event).type in _LAST_EVENTS:
                    return
            if new:
                delay = _POLL_S[0]
                continue
            if ended is not None:  # the log read to its end after the record ended: nothing more will come
                if ended.response.get("status") == "failed":
                    yield msgspec.json.encode({"type": "response.failed", "sequence_number": after + 1,
                                               "response": ended.response})
                return
            record = await store.load(response_id, owner)
            if record is None:  # deleted, or expired
                return
            record = await _failed_if_lapsed(store, record)
            if not running(record):  # its last events were logged before it was saved ended: read them
                ended = record
                continue
            done, _ = await asyncio.wait({disconnect}, timeout=delay)
            if done:
                raise ClientDisconnected
            delay = min(2 * delay, _POLL_S[1])
    finally:
        disconnect.cancel()


async def stream_response(state: RouterState, owner: str, response_id: str, starting_after: int | None,
                          wait_disconnect: DisconnectWaiter) -> EventStreamResponse:
    """``GET /v1/responses/{id}?stream=true``: a streaming background response's events again, after
    ``starting_after`` (a sequence number; none: from the first)."""
    record = await _stored(state, owner, response_id)
    if not record.streamed:
        raise bad_request(f"response '{response_id}' was not created with background and stream true: only those "
                          "can be streamed again", param="stream")
    after = -1 if starting_after is None else starting_after
    if after < -1:
        raise bad_request("starting_after must be a sequence number, 0 or more", param="starting_after")
    return EventStreamResponse(tail_events(state, owner, response_id, after, wait_disconnect))


async def _earlier_items(state: RouterState, request: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    """The items of the conversation the request continues: the ``conversation``'s, or the response
    ``previous_response_id`` names (its input items, then its output)."""
    if request.conversation_id is not None:
        return await conversation_items(state, owner, request.conversation_id)
    previous_id = request.previous_response_id
    if previous_id is None:
        return []
    if state.responses is None:
        raise bad_request("previous_response_id: this router stores no responses (--response-ttl 0, or no Redis)",
                          param="previous_response_id")
    previous = await state.responses.load(previous_id, owner)
    if previous is None:
        raise APIError(400, f"previous response '{previous_id}' not found (never stored, expired or deleted)",
                       param="previous_response_id", code="previous_response_not_found")
    return [*previous.items, *previous.response["output"]]


def _saver(state: RouterState, owner: str, earlier: list[dict[str, Any]], own: list[dict[str, Any]], store: bool,
           conversation_id: str | None) -> Saver | None:
    """What a finished response is saved by: stored with every item it answered (``store``), and its own input and
    output items added to its conversation. None where neither."""
    if not store and conversation_id is None:
        return None

    async def save(response: dict[str, Any]) -> bool:
        """Save the finished ``response``; whether it was stored (False: not asked, or Redis unreachable)."""
        stored = False
        if store:
            assert state.responses is not None
            stored = await state.responses.save(StoredResponse(owner, {**response, "store": True}, [*earlier, *own]))
        if conversation_id is not None:
            await _add_to_conversation(state, owner, conversation_id, own, response)
        return stored

    return save


async def _add_to_conversation(state: RouterState, owner: str, conversation_id: str, own: list[dict[str, Any]],
                               response: dict[str, Any]) -> None:
    """A response that ended with an answer (completed, or cut short) adds its input and output items to its
    conversation; one that failed or was cancelled adds nothing, nor one whose conversation was deleted meanwhile.
    The store unreachable: a 503 (the answer is not given as if its conversation held it)."""
    if response.get("status") not in ("completed", "incomplete"):
        return
    try:
        await add_items(state, owner, conversation_id, [*own, *response["output"]])
    except APIError as exc:
        if exc.status != 404:
            raise
        logger.info("conversation %s was deleted before response %s ended", conversation_id, response.get("id"))


class _ResponseChunks:
    """The chunk writer (``ChunkWriter``) of a streamed response: each delta read as the chat path
    reads it (thinking, content, tool calls), then written as events."""

    inline = False  # every delta goes through ``chunks``: its pieces are events, not one chunk

    def __init__(
        self, state: RouterState, plan: GenerationPlan, reader: AnswerReader, events: ResponseEvents,
        save: Saver | None, renderer: TokenRenderer | None = None,
    ) -> None:
        self.state, self.events, self.usage, self.save = state, events, UsageTracker(plan), save
        self.renderer = renderer  # the output's log-probabilities, where asked (a plain answer's)
        self.answer: AnswerStream = reader.stream()
        self.finish_reason: str | None = None
        self.reasoning = ""
        self._closing: list[bytes] = []
        self.response: dict[str, Any] | None = None  # the whole response, once ``finish`` ran

    def opening(self) -> list[bytes]:
        return self.events.opening()

    def chunks(self, delta: ChoiceDelta) -> list[bytes]:
        self.usage.update(delta)
        finished = delta.finish_reason is not None
        reasoning, content, calls = self.answer.feed(delta.text, finished)
        out = []
        if reasoning:
            self.reasoning += reasoning
            out += self.events.reasoning(reasoning)
        logprobs = _logprobs(self.renderer, delta.logprobs)
        if content or logprobs:
            out += self.events.content(content, logprobs)
        for call in calls:
            out += self.events.call(call)
        if finished:
            self.finish_reason = delta.finish_reason
        return out

    def plain(self, stream: ChoiceStream, text: str) -> bytes | None:
        raise AssertionError("a response's stream is not written inline")

    async def finish(self) -> None:
        """Once the answer ended: the whole response, stored (when asked) before the last event says so."""
        self._closing = self.events.close_output(self.finish_reason)
        response = self.events.response(response_usage(self.usage.usage(), _reasoning_tokens(self.state, self.reasoning)))
        if self.save is not None:
            response["store"] = await self.save(response)
        self._closing.append(self.events.final(response))
        self.response = response

    def closing(self) -> list[bytes]:
        return self._closing


# ----------------------------------------------------------------------------- stored responses
def _store(state: RouterState, response_id: str) -> ResponseStore:
    if state.responses is None:
        raise APIError(404, f"no response '{response_id}': this router stores no responses", code="not_found")
    return state.responses


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response '{response_id}' (never stored, expired or deleted)", code="not_found")


async def _stored(state: RouterState, owner: str, response_id: str) -> StoredResponse:
    record = await _store(state, response_id).load(response_id, owner)
    if record is None:
        raise _not_found(response_id)
    return record


async def _failed_if_lapsed(store: ResponseStore, record: StoredResponse) -> StoredResponse:
    """``record``, or, for a background response whose process stopped vouching for it, that response
    failed (and stored so)."""
    if not lapsed(record):
        return record
    # Failed only if still lapsed as it is written: a renewal or an end saved since the read stands.
    updated = await store.update(record.response["id"], record.owner,
                                 lambda r: failed_by_loss(r) if lapsed(r) else None)
    return failed_by_loss(record) if updated is None else updated


async def retrieve_response(state: RouterState, owner: str, response_id: str) -> dict[str, Any]:
    record = await _stored(state, owner, response_id)
    return (await _failed_if_lapsed(_store(state, response_id), record)).response


async def cancel_response(state: RouterState, owner: str, response_id: str) -> dict[str, Any]:
    """Stop a background response: marked cancelled at once; the process running it (this one, or
    another that sees the mark at its next renewal) stops its engine requests. A response that has
    ended is returned as it is."""
    record = await _stored(state, owner, response_id)
    if not record.response.get("background"):
        raise bad_request(f"response '{response_id}' was not created with background: true; only those can be "
                          "cancelled", param="response_id")
    if not running(record):
        return record.response

    def cancel(current: StoredResponse) -> StoredResponse | None:  # unless it ended since it was read
        if not running(current):
            return None
        return failed_by_loss(current) if lapsed(current) else msgspec.structs.replace(
            current, response={**current.response, "status": "cancelled"})

    updated = await _store(state, response_id).update(response_id, owner, cancel)
    if updated is None:
        raise _not_found(response_id)  # deleted meanwhile
    if not running(updated):  # cancelled, or failed by a lapse: stop it here at once if it runs here
        state.background.cancel(response_id)
    return updated.response


async def delete_response(state: RouterState, owner: str, response_id: str) -> dict[str, Any]:
    if not await _store(state, response_id).delete(response_id, owner):  # there and the caller's, or a 404
        raise _not_found(response_id)
    state.background.cancel(response_id)  # running here: it stops (elsewhere: at its next renewal)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def list_input_items(
    state: RouterState, owner: str, response_id: str, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """The input items a stored response answered (the whole conversation before its output), a page
    of ``limit`` after the item ``after``, newest first unless ``order`` is ``asc``."""
    return page((await _stored(state, owner, response_id)).items, limit, order, after, "this response")
