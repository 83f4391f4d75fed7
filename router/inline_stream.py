"""A streaming response's plain tokens, written from the engine-output receive loop.

The ordinary way a token reaches its client: the receive loop queues the engine's output and
wakes the response's task, which resumes through every frame between the ASGI server and the
queue (middleware, the endpoint, four generators), turns the output into text and an SSE event,
and sends it. At 512 streams one engine step is 512 such wake-ups in a row, and the last stream's
token waits for all of them.

``InlineSink`` takes that token in the receive loop instead: when the response's task is parked
waiting for its next output and the output carries no logprobs and no error, the sink runs the same
bookkeeping (``EngineRequest.took_inline``), the same detokenizer and stop-string check
(``ChoiceStream.process_plain``, or ``process`` for the last output) and the same chunk writer as
the task would, and hands the event to the server's ``send`` there and then. The bookkeeping (and a
plain token's timing metrics) wait until every output of its engine message is sent
(``EngineClient.after_sends``): nothing written needs them, and the message's last stream waited
for each stream's before it. When an output ends the stream (the engine finished it, or a stop
string hit), the sink sends its last chunks and interrupts the task (``EndedInline``), which sends
the response's end (usage, ``[DONE]``) and, for a stop string, aborts the engines. A disaggregated
request's first output (the prefill's), errors, migrations and logprobs still go through the task,
in order: the sink only takes an output when nothing is queued before it, and the task waits for a
send the sink started before it sends anything itself.

A send that cannot finish at once (the client reads slower than the stream: the server's write
buffer is full) goes on in a task of its own (``start_send``), and the sink takes nothing more until
it has finished. On uvicorn's httptools protocol, the router's, the sink writes a token's chunk to
the connection itself whenever that is all the server's ``send`` would do (``ChunkedBodyWriter``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from common.protocol import RequestOutput
from router.choice_stream import ChoiceDelta, ChoiceStream, EndedInline
from router.dispatcher import EngineRequestError
from router.output_queue import AfterSends

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]  # the ASGI send: a coroutine function


class TokenChunks(Protocol):
    """What the sink needs of an endpoint's chunk writer (``router.serving.ChunkWriter``)."""

    def plain(self, stream: ChoiceStream, text: str) -> bytes | None:
        """The JSON chunk of a plain token's ``text`` (None when there is none: text held back),
        ``stream``'s counts taken for the usage."""

    def chunks(self, delta: ChoiceDelta) -> list[bytes]:
        """Chunks of one delta (the last one's, here)."""


def sse_event(payload: bytes) -> bytes:
    return b"data: %b\n\n" % payload


def start_send(send: Send, message: dict[str, Any]) -> asyncio.Task[None] | None:
    """Run ``send(message)`` now, as far as it goes without waiting. None when it finished (the
    usual case); else the task that finishes it, resuming the send where it waited."""
    coro = send(message)
    try:
        awaited = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_finish_send(coro, awaited))


async def _finish_send(coro: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Drive ``coro`` to its end as a task would: wait for what it yielded, then resume it (the
    awaited future's result or exception reaches it there); a cancellation is thrown into it."""
    while True:
        try:
            if isinstance(awaited, asyncio.Future):
                awaited._asyncio_future_blocking = False
                await asyncio.wait([awaited])
            else:  # a bare yield: one turn of the loop
                await asyncio.sleep(0)
            awaited = coro.send(None)
        except StopIteration:
            return
        except asyncio.CancelledError as exc:
            try:
                awaited = coro.throw(exc)
            except StopIteration:
                return


class BodyWriter:
    """Writes a started response's body from the receive loop, ``more_body`` set: through the
    server's ``send`` (``start_send``); None when the write is done, else the task finishing it."""

    __slots__ = ("_send",)

    def __init__(self, send: Send) -> None:
        self._send = send

    def body(self, body: bytes) -> asyncio.Task[None] | None:
        return start_send(self._send, {"type": "http.response.body", "body": body, "more_body": True})

    def event(self, payload: bytes) -> asyncio.Task[None] | None:
        """One SSE event of ``payload``."""
        return self.body(sse_event(payload))


class ChunkedBodyWriter(BodyWriter):
    """``BodyWriter`` for uvicorn's httptools protocol (the router's), writing each body part to the
    connection itself where ``send`` would do exactly that and nothing else: the response started
    with chunked framing, not complete, the client connected and the connection's write buffer
    below its high mark. Then the bytes are those ``send`` writes (one chunk of HTTP/1.1 chunked
    framing); otherwise ``send`` runs (it waits for the buffer to drain, or drops the write of a
    client gone). Saves the send coroutine and its checks of the message, per streamed token.

    ``for_send`` makes one only for a ``send`` bound to the protocol's request cycle whose response
    started as expected; any other server gets a ``BodyWriter``."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, send: Send, cycle: Any) -> None:
        super().__init__(send)
        self._cycle, self._flow, self._transport = cycle, cycle.flow, cycle.transport

    @staticmethod
    def for_send(send: Send) -> BodyWriter:
        cycle = getattr(send, "__self__", None)
        try:
            from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

            usable = (
                type(cycle) is RequestResponseCycle
                and getattr(send, "__func__", None) is RequestResponseCycle.send
                and cycle.response_started is True
                and cycle.chunked_encoding is True
                and cycle.scope.get("method") != "HEAD"
                # What the per-token checks read, as this uvicorn's cycle has them.
                and all(isinstance(flag, bool) for flag in (
                    cycle.flow.write_paused, cycle.disconnected, cycle.response_complete))
                and callable(cycle.transport.write)
            )
        except (ImportError, AttributeError):  # another server, or a uvicorn whose cycle differs
            usable = False
        return ChunkedBodyWriter(send, cycle) if usable else BodyWriter(send)

    def body(self, body: bytes) -> asyncio.Task[None] | None:
        cycle = self._cycle
        if body and not (self._flow.write_paused or cycle.disconnected or cycle.response_complete):
            self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            return None
        return super().body(body)

    def event(self, payload: bytes) -> asyncio.Task[None] | None:
        cycle = self._cycle  # the same checks as ``body``'s, written out: this is per streamed token
        if not (self._flow.write_paused or cycle.disconnected or cycle.response_complete):
            # The event's framing and the chunk's in one step.
            self._transport.write(b"%x\r\ndata: %b\n\n\r\n" % (len(payload) + 8, payload))
            return None
        return super().body(sse_event(payload))


class InlineSink:
    """Takes one streaming choice's plain token outputs in the receive loop (see the module's
    docstring); ``writer`` makes their chunks as the task's would."""

    __slots__ = ("_after_sends", "_counter", "_pending", "_sender", "_stream", "_writer")

    def __init__(self, stream: ChoiceStream, writer: TokenChunks, counter: list[int], after_sends: AfterSends) -> None:
        self._stream = stream
        self._writer = writer
        self._counter = counter  # [outputs taken inline], shared by the app's sinks (a metric)
        # The receive loop's: a plain token's bookkeeping waits there until its message is all sent.
        self._after_sends = after_sends
        self._sender: BodyWriter | None = None  # the response's body, once started
        self._pending: asyncio.Task[None] | None = None

    def attach(self, send: Send) -> None:
        """Start taking outputs, sending with ``send`` (the response has started)."""
        self._sender = ChunkedBodyWriter.for_send(send)
        self._stream.engine_request.set_sink(self)

    def detach(self) -> None:
        """Take nothing more; the task sends the rest (after ``idle``)."""
        self._sender = None
        self._stream.engine_request.set_sink(None)

    @property
    def busy(self) -> bool:
        """A send the sink started has not finished."""
        return self._pending is not None

    async def idle(self) -> None:
        """Wait for the send the sink started, if any (before the task sends anything itself). Its
        failure reaches the task as the request's (``_fail``), not here."""
        while self._pending is not None:
            await asyncio.wait([self._pending])

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    def __call__(self, output: RequestOutput) -> bool:
        """Take ``output`` (True) or leave it to the task (False). Called by the output queue only
        while the task waits on it with nothing queued."""
        sender = self._sender
        if (
            sender is None
            or self._pending is not None
            or output.logprobs is not None
            or output.prompt_logprobs is not None
        ):
            return False
        request = self._stream.engine_request
        # Nothing may escape into the receive loop, which serves every request: a failure here
        # fails this request alone (an error event, then the end of the stream).
        try:
            if not request.can_take_inline(output):
                return False
            # Its bookkeeping waits until the engine message's outputs are all sent: nothing
            # written needs it, and the message's last stream waits for every stream's before it.
            self._after_sends.append((self._after_send, output))
            stream = self._stream
            if output.finish_reason is None:
                text = stream.process_plain(output)
                if isinstance(text, str):
                    payload = self._writer.plain(stream, text)
                    if payload is not None and (pending := sender.event(payload)) is not None:
                        self._wait_for(pending)
                    return True
                delta = text  # a stop string hit: the stream's last delta
            else:
                delta = stream.process(output)
            # The stream's end: its last chunks go out here, then the task ends the response (and,
            # for a stop string, aborts the engines, which have not finished).
            body = b"".join(map(sse_event, self._writer.chunks(delta)))
            if body and (pending := sender.body(body)) is not None:
                self._wait_for(pending)
            request.interrupt(EndedInline())
        except Exception as exc:
            self._fail(exc)
        return True

    def _after_send(self, output: RequestOutput, now: float) -> None:
        """The bookkeeping of an output taken, run by the receive loop once its message is all sent
        (and a plain token's timing: ``process`` observes the last output's itself)."""
        try:
            self._stream.engine_request.took_inline(output, now)
            if output.finish_reason is None:
                self._stream.observe_timing(output, now)
            self._counter[0] += 1
        except Exception as exc:
            self._fail(exc)

    def _wait_for(self, pending: asyncio.Task[None]) -> None:
        """Take nothing more until ``pending``, the send of the last output taken, has finished."""
        self._pending = pending
        pending.add_done_callback(self._sent)

    def _fail(self, exc: Exception) -> None:
        """The task raises it at its next wait (it is parked in one) and ends the stream with it."""
        logger.error("streaming %s failed in the receive loop", self._stream.engine_request.request_id,
                     exc_info=exc)
        self._stream.engine_request.interrupt(EngineRequestError(f"the router failed to stream a token: {exc!r}"))

    def _sent(self, task: asyncio.Task[None]) -> None:
        if self._pending is task:
            self._pending = None
        if not task.cancelled() and (exc := task.exception()) is not None and isinstance(exc, Exception):
            self._fail(exc)
