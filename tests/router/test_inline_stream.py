"""Plain tokens sent from the receive loop (``router/inline_stream.py``): the send driver on its
own, then through the router over real ZMQ and Redis, with clients that read and one that stops
reading until the whole reply is written."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

import router.inline_stream as inline_stream
from common.protocol import RequestOutput
from common.registry import InstanceInfo
from router.choice_stream import ChoiceDelta, EndedInline
from router.dispatcher import EngineRequest, EngineRequestError
from router.inline_stream import InlineSink, start_send
from router.output_queue import AfterSends
from tests.router.fake_engine import FakeCluster, FakeEngine
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state, wait_until

REPLY_TEXT = "Once upon a time, a dragon learned to paint. Ça va? 你好 🎉 The end."
PROMPT = "Tell me a story about a dragon who learns to paint, in several short sentences please."


# -- the send driver --------------------------------------------------------------------------
class _Server:
    """An ASGI-like ``send`` whose writes wait on ``gate`` while it is set (a full socket)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.gate: asyncio.Future[None] | None = None
        self.finally_ran = 0

    async def send(self, message: dict[str, Any]) -> None:
        try:
            if self.gate is not None:
                await self.gate
            self.sent.append(message["body"])
        finally:
            self.finally_ran += 1


def _waiting_send() -> tuple[_Server, asyncio.Future[None], asyncio.Task[None]]:
    """A send started while the server's writes wait on the gate (in a running loop)."""
    server = _Server()
    gate = server.gate = asyncio.get_running_loop().create_future()
    task = start_send(server.send, {"body": b"a"})
    assert task is not None
    return server, gate, task


def test_a_send_that_need_not_wait_is_done_in_the_caller() -> None:
    async def main() -> None:
        server = _Server()
        assert start_send(server.send, {"body": b"a"}) is None
        assert server.sent == [b"a"]

    asyncio.run(main())


def test_a_send_that_waits_is_finished_by_a_task_once() -> None:
    async def main() -> None:
        server, gate, task = _waiting_send()
        for _ in range(3):
            await asyncio.sleep(0)
        assert server.sent == [] and not task.done()
        gate.set_result(None)
        await task
        assert server.sent == [b"a"] and server.finally_ran == 1

    asyncio.run(main())


def test_the_awaited_futures_exception_reaches_the_send() -> None:
    async def main() -> None:
        server, gate, task = _waiting_send()
        gate.set_exception(ConnectionResetError("gone"))
        with pytest.raises(ConnectionResetError, match="gone"):
            await task
        assert server.sent == [] and server.finally_ran == 1

    asyncio.run(main())


def test_cancelling_the_task_cancels_the_send_where_it_waits() -> None:
    async def main() -> None:
        server, gate, task = _waiting_send()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert server.sent == [] and server.finally_ran == 1

    asyncio.run(main())


class _StubRequest:
    request_id = "r"

    def __init__(self) -> None:
        self.sink: Any = None
        self.taken: list[RequestOutput] = []
        self.interrupted: list[BaseException] = []

    def set_sink(self, sink: Any) -> None:
        self.sink = sink

    def can_take_inline(self, output: RequestOutput) -> bool:
        return output.finish_reason != "error"

    def took_inline(self, output: RequestOutput, now: float) -> None:
        self.taken.append(output)

    def interrupt(self, exc: BaseException) -> None:
        self.interrupted.append(exc)


class _StubStream:
    index = 0

    def __init__(self) -> None:
        self.engine_request = _StubRequest()

    def process_plain(self, output: RequestOutput) -> str | ChoiceDelta:
        return f"t{output.new_token_ids[0]}"

    def process(self, output: RequestOutput) -> ChoiceDelta:
        return ChoiceDelta(index=0, text=f"t{output.new_token_ids[0]}", finish_reason=output.finish_reason)

    def observe_timing(self, output: RequestOutput, now: float) -> None:
        pass


class _StubWriter:
    def plain(self, stream: Any, text: str) -> bytes | None:
        return text.encode() or None

    def chunks(self, delta: ChoiceDelta) -> list[bytes]:
        return [delta.text.encode(), f"end:{delta.finish_reason}".encode()]


def _token(token_id: int, **kw: Any) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=[token_id], **kw)


def _run(after_sends: AfterSends) -> None:
    """What the receive loop does once a message's outputs are all handed on."""
    for after_send, output in after_sends:
        after_send(output, time.monotonic())
    after_sends.clear()


def test_the_sink_takes_nothing_while_its_send_waits_and_leaves_the_rest_to_the_task() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server, stream, counter, after_sends = _Server(), _StubStream(), [0], []
        sink = InlineSink(stream, _StubWriter(), counter, after_sends)  # type: ignore[arg-type]
        assert not sink(_token(1)), "a sink not attached took an output"
        sink.attach(server.send)
        assert stream.engine_request.sink is sink
        assert sink(_token(2)) and server.sent == [b"data: t2\n\n"]
        # The output is sent; its bookkeeping waits for the rest of the message's outputs.
        assert stream.engine_request.taken == [] and counter == [0]
        _run(after_sends)
        assert [o.new_token_ids for o in stream.engine_request.taken] == [[2]] and counter == [1]
        server.gate = loop.create_future()
        assert sink(_token(3)) and sink.busy
        # Behind a send that waits, the next output goes to the task, which waits for that send.
        assert not sink(_token(4))
        assert not sink(_token(5, finish_reason="stop")) and not sink(_token(6, logprobs=[]))
        server.gate.set_result(None)
        await sink.idle()
        assert not sink.busy and server.sent == [b"data: t2\n\n", b"data: t3\n\n"]
        assert sink(_token(7))
        _run(after_sends)
        assert counter == [3]
        # The last output: its chunks go out here, in one write, and the task is told to end.
        assert sink(_token(8, finish_reason="length"))
        _run(after_sends)
        assert counter == [4]
        assert [o.new_token_ids for o in stream.engine_request.taken] == [[2], [3], [7], [8]]
        assert server.sent[-1] == b"data: t8\n\ndata: end:length\n\n"
        assert [type(e) for e in stream.engine_request.interrupted] == [EndedInline]
        assert not sink(_token(9, finish_reason="error", error="boom"))  # errors go to the task
        sink.detach()
        assert stream.engine_request.sink is None and not sink(_token(10))

    asyncio.run(main())


def test_a_failed_send_of_the_sink_interrupts_the_request() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server, stream = _Server(), _StubStream()
        sink = InlineSink(stream, _StubWriter(), [0], [])  # type: ignore[arg-type]
        sink.attach(server.send)
        server.gate = loop.create_future()
        assert sink(_token(1))
        server.gate.set_exception(ConnectionResetError("gone"))
        await sink.idle()
        [error] = stream.engine_request.interrupted
        assert isinstance(error, EngineRequestError) and "ConnectionResetError('gone')" in str(error)

    asyncio.run(main())


def test_a_failure_in_the_sink_fails_the_request_not_the_receive_loop() -> None:
    class Broken(_StubStream):
        def process_plain(self, output: RequestOutput) -> str | ChoiceDelta:
            raise ValueError("detokenizer bug")

    async def main() -> None:
        server, stream = _Server(), Broken()
        sink = InlineSink(stream, _StubWriter(), [0], [])  # type: ignore[arg-type]
        sink.attach(server.send)
        assert sink(_token(1))  # taken, so that nothing after it is sent before the error
        [error] = stream.engine_request.interrupted
        assert isinstance(error, EngineRequestError) and "detokenizer bug" in str(error)
        assert server.sent == []

    asyncio.run(main())


# -- the body writer --------------------------------------------------------------------------
class _Transport:
    """Records what is written to the connection."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False


async def _started_cycle(headers: list[tuple[bytes, bytes]] | None = None) -> tuple[RequestResponseCycle, _Transport]:
    """uvicorn's httptools request cycle, its streaming response started (headers written)."""
    transport = _Transport()
    cycle = RequestResponseCycle(
        scope={"method": "POST", "path": "/v1/completions"}, transport=transport,  # type: ignore[arg-type, typeddict-item]
        flow=FlowControl(transport), logger=logging.getLogger("t"), access_logger=logging.getLogger("t"),  # type: ignore[arg-type]
        access_log=False, default_headers=[], message_event=asyncio.Event(), expect_100_continue=False,
        keep_alive=True, on_response=lambda: None,
    )
    await cycle.send({"type": "http.response.start", "status": 200, "headers": headers or []})
    transport.written.clear()
    return cycle, transport


def test_the_writer_writes_what_uvicorns_send_would_straight_to_the_connection() -> None:
    async def main() -> None:
        direct, by_writer = await _started_cycle()
        via_send, by_send = await _started_cycle()
        writer = inline_stream.ChunkedBodyWriter.for_send(direct.send)
        assert isinstance(writer, inline_stream.ChunkedBodyWriter)
        assert writer.event(b'{"t":"\xc3\xa7a"}') is None and writer.body(b"data: x\n\ndata: y\n\n") is None
        await via_send.send({"type": "http.response.body", "body": b'data: {"t":"\xc3\xa7a"}\n\n', "more_body": True})
        await via_send.send({"type": "http.response.body", "body": b"data: x\n\ndata: y\n\n", "more_body": True})
        assert by_writer.written == by_send.written and len(by_writer.written) == 2

    asyncio.run(main())


def test_the_writer_leaves_a_full_buffer_and_a_client_gone_to_send() -> None:
    async def main() -> None:
        cycle, transport = await _started_cycle()
        writer = inline_stream.ChunkedBodyWriter.for_send(cycle.send)
        cycle.flow.pause_writing()  # the connection's write buffer is above its high mark
        task = writer.event(b"1")
        assert task is not None and transport.written == [], "wrote past a paused connection"
        cycle.flow.resume_writing()
        await task
        assert transport.written == [b"9\r\ndata: 1\n\n\r\n"]
        cycle.disconnected = True
        assert writer.event(b"2") is None and writer.body(b"3") is None
        assert transport.written == [b"9\r\ndata: 1\n\n\r\n"], "wrote to a client gone"

    asyncio.run(main())


def test_the_writer_writes_itself_only_for_uvicorns_chunked_response() -> None:
    async def main() -> None:
        server = _Server()
        assert type(inline_stream.ChunkedBodyWriter.for_send(server.send)) is inline_stream.BodyWriter
        cycle, transport = await _started_cycle([(b"content-length", b"100")])  # not chunked
        writer = inline_stream.ChunkedBodyWriter.for_send(cycle.send)
        assert type(writer) is inline_stream.BodyWriter
        assert writer.event(b"1") is None and transport.written == [b"data: 1\n\n"]
        # A uvicorn whose cycle lacks what the per-token checks read: its own send, never a failure.
        changed, _ = await _started_cycle()
        del changed.disconnected
        assert type(inline_stream.ChunkedBodyWriter.for_send(changed.send)) is inline_stream.BodyWriter

    asyncio.run(main())


# -- through the router -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def reply_tokens(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(REPLY_TEXT, add_special_tokens=False))


@pytest.fixture(scope="module")
def stack(redis_url: str, prompts: Any, reply_tokens: list[int]) -> Iterator[tuple[RouterServer, FakeCluster]]:
    namespace = f"inline-{uuid.uuid4().hex[:8]}"
    state = make_state(prompts, redis_url=redis_url, namespace=namespace)
    with FakeCluster(redis_url, namespace, reply_tokens) as cluster, RouterServer(state) as server:
        server.wait_ready()
        yield server, cluster


@pytest.fixture
def server(stack: tuple[RouterServer, FakeCluster]) -> RouterServer:
    return stack[0]


def _inline_count(server: RouterServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r"^pdserve:router_outputs_inline_total (\S+)$", text, re.MULTILINE)
    assert match is not None, "the router exports no pdserve:router_outputs_inline_total"
    return float(match.group(1))


def _client(server: RouterServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_streamed_chat_takes_plain_tokens_inline_and_loses_nothing(
    server: RouterServer, reply_tokens: list[int]
) -> None:
    before = _inline_count(server)
    chunks = list(_client(server).chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=100, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(reply_tokens)
    # The prefill's token goes through the request's task; those after it may not.
    assert _inline_count(server) > before


def test_streamed_completion_takes_plain_tokens_inline(server: RouterServer, reply_tokens: list[int]) -> None:
    before = _inline_count(server)
    stream = _client(server).completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=100, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == REPLY_TEXT
    taken = _inline_count(server) - before
    assert 0 < taken <= len(reply_tokens) - 1  # not the prefill's token
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_in_a_token_taken_inline_ends_the_stream_and_aborts_the_engine(
    server: RouterServer, stack: tuple[RouterServer, FakeCluster]
) -> None:
    before = _inline_count(server)
    chunks = list(_client(server).completions.create(
        model=SERVED_MODEL, prompt=PROMPT, max_tokens=100, stream=True, stop=["paint"]
    ))
    assert "".join(c.choices[0].text for c in chunks) == REPLY_TEXT.split("paint")[0]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert _inline_count(server) > before  # the tokens before the stop string's
    request_id = f"{chunks[0].id}-0"
    assert wait_until(lambda: request_id in stack[1].aborts()["decode-0"], 10), "the engine was not aborted"


def test_logprobs_stay_with_the_task(server: RouterServer) -> None:
    before = _inline_count(server)
    chunks = list(_client(server).completions.create(
        model=SERVED_MODEL, prompt=PROMPT, max_tokens=100, stream=True, logprobs=2
    ))
    assert "".join(c.choices[0].text for c in chunks) == REPLY_TEXT
    assert _inline_count(server) == before


class _LongContextEngine(FakeEngine):
    def info(self) -> InstanceInfo:
        info = super().info()
        info.max_model_len = 100_000
        return info


def test_a_client_that_stops_reading_gets_every_token_in_order(
    redis_url: str, prompts: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reads nothing until a send of the sink had to wait for the socket (the router's
    buffers made small, as on a slow network): the outputs behind it must wait for it, and the
    stream arrive whole and in order."""
    waited: list[int] = []
    finish_send = inline_stream._finish_send

    def counting(coro: Any, awaited: Any) -> Any:
        waited.append(1)
        return finish_send(coro, awaited)

    monkeypatch.setattr(inline_stream, "_finish_send", counting)
    # A slow network: small socket buffers on the router's side, so its writes fill them soon.
    made = HttpToolsProtocol.connection_made

    def small_buffers(self: HttpToolsProtocol, transport: Any) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        made(self, transport)

    monkeypatch.setattr(HttpToolsProtocol, "connection_made", small_buffers)
    words = [f" w{i}" for i in range(400)]
    reply = list(tokenizer.encode("".join(words), add_special_tokens=False))
    namespace = f"inline-slow-{uuid.uuid4().hex[:8]}"
    peers: dict[str, FakeEngine] = {}
    engines = [_LongContextEngine("decode", "decode-0", redis_url, namespace, reply, peers, token_delay_s=0.0)]
    for engine in engines:
        peers[engine.instance_id] = engine
        engine.start()
    try:
        with RouterServer(make_state(prompts, redis_url=redis_url, namespace=namespace)) as server:
            server.wait_ready(prefill=0)
            body = (b'{"model":"%s","prompt":"hi","max_tokens":%d,"stream":true}'
                    % (SERVED_MODEL.encode(), len(reply)))
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert wait_until(lambda: bool(waited), 120), "no send of the sink had to wait for the socket"
                received = bytearray()
                sock.settimeout(60)
                while not received.endswith(b"0\r\n\r\n"):
                    data = sock.recv(1 << 16)
                    assert data, "the router closed the connection early"
                    received += data
            finally:
                sock.close()
    finally:
        for engine in engines:
            engine.stop()
    texts = re.findall(rb'"text":"((?:[^"\\]|\\.)*)"', bytes(received))
    assert "".join(t.decode() for t in texts) == tokenizer.decode(reply)


def test_tokens_taken_inline_count_as_progress_for_the_request_timeout(
    redis_url: str, prompts: Any, reply_tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's task waits through every token taken inline: its timeout (no output for
    ``request_timeout_s``) must count from the last of them, not from when it began to wait."""
    ends: list[int] = []

    class CountedEnd(EndedInline):
        def __init__(self) -> None:
            super().__init__()
            ends.append(1)

    monkeypatch.setattr(inline_stream, "EndedInline", CountedEnd)
    namespace = f"inline-slowtok-{uuid.uuid4().hex[:8]}"
    state = make_state(prompts, redis_url=redis_url, namespace=namespace, request_timeout_s=1.0)
    with FakeCluster(redis_url, namespace, reply_tokens, token_delay_s=0.1), RouterServer(state) as server:
        server.wait_ready()
        chunks = list(_client(server).completions.create(
            model=SERVED_MODEL, prompt=PROMPT, max_tokens=100, stream=True
        ))  # about 3 s of tokens, 0.1 s apart
        assert "".join(c.choices[0].text for c in chunks) == REPLY_TEXT
        assert chunks[-1].choices[0].finish_reason == "stop"
        # 0.1 s apart, the task is parked for every output: all but the prefill's are taken inline
        # (and the decode instance's first, when it overtakes the prefill's), the last one too.
        assert _inline_count(server) >= len(reply_tokens) - 2
        assert ends == [1], "the output that ended the stream was not taken inline"


class _SlowStartEngine(FakeEngine):
    """Sends a request's first token 0.5 s after it came (the router's task is parked by then)."""

    def _generate(self, msg: Any, replies: Any, ctx: Any) -> None:
        super()._generate(msg, replies, ctx)
        active = self._active.get(msg.request_id)
        if active is not None:
            active.next_time = time.monotonic() + 0.5


def test_a_direct_requests_first_output_is_taken_inline_echo_and_usage_included(
    redis_url: str, prompts: Any, reply_tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a prefill instance the decode instance's first output needs no handoff: the sink
    takes it too, and with it the prompt's echo and the usage's cached tokens."""
    firsts_inline: list[bool] = []
    can_take_inline = EngineRequest.can_take_inline

    def recording(self: EngineRequest, output: RequestOutput) -> bool:
        first = not self._first_seen
        taken = can_take_inline(self, output)
        if first:
            firsts_inline.append(taken)
        return taken

    monkeypatch.setattr(EngineRequest, "can_take_inline", recording)
    namespace = f"inline-direct-{uuid.uuid4().hex[:8]}"
    peers: dict[str, FakeEngine] = {}
    engine = _SlowStartEngine("decode", "decode-0", redis_url, namespace, reply_tokens, peers, token_delay_s=0.02)
    peers[engine.instance_id] = engine
    engine.start()
    try:
        with RouterServer(make_state(prompts, redis_url=redis_url, namespace=namespace)) as server:
            server.wait_ready(prefill=0)
            chunks = list(_client(server).completions.create(
                model=SERVED_MODEL, prompt=PROMPT, max_tokens=100, stream=True, echo=True,
                stream_options={"include_usage": True},
            ))
    finally:
        engine.stop()
    assert firsts_inline == [True], "the first output was not taken inline"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + REPLY_TEXT
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(reply_tokens)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 16
