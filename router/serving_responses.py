"""``POST /v1/responses``: a Responses request planned as the chat completion it is
(``router/responses_api.py``), answered whole or as the API's stream of typed events."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response

from router.chat_answer import AnswerReader, AnswerStream
from router.choice_stream import ChoiceDelta, ChoiceStream
from router.errors import APIError
from router.openai_models import StreamOptions, parse_request
from router.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    new_id,
    output_items,
    renamed,
    response_object,
    response_usage,
)
from router.serving import DisconnectWaiter, GenerationPlan, UsageTracker, collect, sse_response
from router.serving_chat import plan_chat
from router.state import RouterState


def _reasoning_tokens(state: RouterState, reasoning: str | None) -> int:
    """The thinking's tokens, counted by tokenizing its text (the answer's own ids are not kept)."""
    return len(state.prompts.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


async def create_response(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> Response:
    request = parse_request(ResponsesRequest, body, state.config.limits)
    try:
        _, plan, reader = await plan_chat(state, request.chat_body(), cache_salt)
    except APIError as exc:
        raise renamed(exc) from None
    response_id = new_id("resp")
    if request.stream:
        events = ResponseEvents(request, response_id, plan.created, plan.model)
        return await sse_response(
            state, plan, wait_disconnect, StreamOptions(include_usage=True),
            lambda include_usage, continuous: _ResponseChunks(state, plan, reader, events),
        )
    results, usage = await collect(state, plan, wait_disconnect)
    [result] = results
    message, _ = reader.message(result.text, result.finish_reason)
    status = "incomplete" if result.finish_reason == "length" else "completed"
    reasoning_tokens = _reasoning_tokens(state, message.reasoning_content)
    return JSONResponse(response_object(
        request, response_id, plan.created, plan.model, status, output_items(message, status),
        response_usage(usage, reasoning_tokens),
    ))


class _ResponseChunks:
    """The chunk writer (``ChunkWriter``) of a streamed response: each delta read as the chat path
    reads it (thinking, content, tool calls), then written as events."""

    inline = False  # every delta goes through ``chunks``: its pieces are events, not one chunk

    def __init__(self, state: RouterState, plan: GenerationPlan, reader: AnswerReader, events: ResponseEvents) -> None:
        self.state, self.events, self.usage = state, events, UsageTracker(plan)
        self.answer: AnswerStream = reader.stream()
        self.finish_reason: str | None = None
        self.reasoning = ""

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
        if content:
            out += self.events.content(content)
        for call in calls:
            out += self.events.call(call)
        if finished:
            self.finish_reason = delta.finish_reason
        return out

    def plain(self, stream: ChoiceStream, text: str) -> bytes | None:
        raise AssertionError("a response's stream is not written inline")

    def closing(self) -> list[bytes]:
        usage = response_usage(self.usage.usage(), _reasoning_tokens(self.state, self.reasoning))
        return self.events.closing(self.finish_reason, usage)
