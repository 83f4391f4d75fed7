"""A tiny OpenAI-compatible streaming server in a thread, with scripted timing, for load-generator tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.conftest import free_port


@dataclass
class Script:
    """How the server answers: delays in seconds, ``tokens_per_chunk`` tokens in each content chunk."""

    first_token_delay_s: float = 0.0
    token_gap_s: float = 0.0
    tokens_per_chunk: int = 1
    empty_first_chunk: bool = True  # a role-only chunk before any content, as real servers send
    status: int = 200


@dataclass
class Record:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def make_app(script: Script, record: Record) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        record.bodies.append(body)
        record.starts.append(time.perf_counter())
        if script.status != 200:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=script.status)
        num_chunks = body["max_tokens"] // script.tokens_per_chunk

        async def events() -> AsyncIterator[str]:
            record.in_flight += 1
            record.max_in_flight = max(record.max_in_flight, record.in_flight)
            try:
                if script.empty_first_chunk:
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": ""}]}) + "\n\n"
                await asyncio.sleep(script.first_token_delay_s)
                for i in range(num_chunks):
                    if i:
                        await asyncio.sleep(script.token_gap_s)
                    text = " tok" * script.tokens_per_chunk
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"
                usage = {"prompt_tokens": 3, "completion_tokens": num_chunks * script.tokens_per_chunk}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                record.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class FakeServer:
    def __init__(self, script: Script) -> None:
        self.record = Record()
        self.port = free_port()
        config = uvicorn.Config(make_app(script, self.record), host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
