"""The SSE response: frames, the error event, a client gone, and what it closes however it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from router.dispatcher import EngineRequestError
from router.serving import ClientDisconnected, EventStreamResponse


def _run(response: EventStreamResponse, fail_on: str | None = None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == fail_on:
            raise OSError("connection reset")
        sent.append(message)

    asyncio.run(response({"type": "http"}, receive, send))
    return sent


def _chunks(closed: list[str], payloads: list[bytes], end: BaseException | None = None) -> AsyncGenerator[bytes, None]:
    async def gen() -> AsyncGenerator[bytes, None]:
        try:
            for payload in payloads:
                yield payload
            if end is not None:
                raise end
        finally:
            closed.append("chunks")

    return gen()


def _response(closed: list[str], payloads: list[bytes], end: BaseException | None = None) -> EventStreamResponse:
    response = EventStreamResponse(_chunks(closed, payloads, end), close=lambda: closed.append("choices"))
    response.on_close = lambda: closed.append("leave")
    return response


def test_each_chunk_is_one_event_then_done() -> None:
    closed: list[str] = []
    sent = _run(_response(closed, [b'{"a":1}', b'{"b":2}']))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]
    assert closed == ["chunks", "leave", "choices"]


def test_an_engine_failure_mid_stream_is_an_error_event_then_done() -> None:
    closed: list[str] = []
    sent = _run(_response(closed, [b'{"a":1}'], EngineRequestError("engine d0 failed", status=502)))
    last = sent[-1]["body"]
    assert last.startswith(b"data: {") and b"engine d0 failed" in last and last.endswith(b"data: [DONE]\n\n")
    assert sent[-1]["more_body"] is False
    assert closed == ["chunks", "leave", "choices"]


def test_a_client_gone_ends_the_body_without_done() -> None:
    closed: list[str] = []
    sent = _run(_response(closed, [b'{"a":1}'], ClientDisconnected()))
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert closed == ["chunks", "leave", "choices"]


def test_a_response_whose_chunks_never_started_still_closes_the_choices_and_leaves() -> None:
    """A generator closed before its first step runs no ``finally``: the choices are closed anyway."""
    closed: list[str] = []
    with pytest.raises(OSError):
        _run(_response(closed, [b'{"a":1}']), fail_on="http.response.start")
    assert closed == ["leave", "choices"]


def test_events_go_straight_to_the_servers_send_past_the_middleware() -> None:
    """``RouterApp`` keeps the server's ``send`` in the scope; a middleware wrapping ``send`` sees the
    response start and its end, not every event, and the client gets them all, in order."""
    from starlette.routing import Route

    from router.app import RouterApp

    closed: list[str] = []
    app = RouterApp(routes=[Route("/s", lambda request: _response(closed, [b'{"a":1}', b'{"b":2}']))])
    wrapped: list[str] = []

    class Spy:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def spying(message: dict[str, Any]) -> None:
                wrapped.append(message["type"])
                await send(message)

            await self.inner(scope, receive, spying)

    app.add_middleware(Spy)
    server: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        server.append(message)

    scope = {"type": "http", "method": "GET", "path": "/s", "raw_path": b"/s", "query_string": b"",
             "headers": [], "root_path": "", "scheme": "http", "server": ("test", 80), "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    assert [m.get("body") for m in server[1:]] == [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
    assert wrapped == ["http.response.start", "http.response.body"]  # the start and the end only
    assert closed == ["chunks", "leave", "choices"]
