"""The generation endpoints are served below FastAPI's routing and middleware (``RouterApp``), and
answer exactly what FastAPI's route for them would: every error OpenAI-shaped, counted by status."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

import router.app
from router.app import RouterApp, create_app
from tests.router.router_harness import SERVED_MODEL, make_state

KEY = "key-a"
AUTH = {"Authorization": f"Bearer {KEY}"}


class _Seen:
    """ASGI middleware recording the paths that went through FastAPI's middleware chain."""

    def __init__(self, app: ASGIApp, paths: list[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def _crash(*_: Any, **__: Any) -> Any:
    raise RuntimeError("a bug in the handler")


@pytest.fixture
def app(prompts: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RouterApp, TestClient, list[str]]]:
    # A completion with this prompt crashes its handler (what a bug would do), a chat goes on.
    real = router.app.create_completion

    async def create_completion(state: Any, body: Any, *args: Any) -> Any:
        if isinstance(body, dict) and body.get("prompt") == "crash":
            _crash()
        return await real(state, body, *args)

    monkeypatch.setattr(router.app, "create_completion", create_completion)
    state = make_state(prompts, redis_url=None, max_body_bytes=4096, api_keys=[KEY])
    app = create_app(state)
    assert isinstance(app, RouterApp)
    seen: list[str] = []
    app.add_middleware(_Seen, paths=seen)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client, seen


# (path, headers, body): every way a generation request fails before it reaches an engine.
FAILING = [
    ("/v1/completions", AUTH, b"{not json"),  # 400 invalid_json
    ("/v1/completions", AUTH, b'{"model": "%s"}' % SERVED_MODEL.encode()),  # 400: no prompt
    ("/v1/chat/completions", AUTH, b'{"model": "%s", "messages": []}' % SERVED_MODEL.encode()),  # 400
    ("/v1/completions", {}, b'{"model": "%s", "prompt": "hi"}' % SERVED_MODEL.encode()),  # 401: no key
    ("/v1/completions", {"Authorization": "Bearer wrong"}, b"{}"),  # 401: wrong key
    ("/v1/completions", AUTH, b'{"model": "other", "prompt": "hi"}'),  # 404: unknown model
    ("/v1/completions", AUTH, b'{"prompt": "' + b"x" * 5000 + b'"}'),  # 413
    ("/v1/completions", AUTH, b'{"model": "%s", "prompt": "crash"}' % SERVED_MODEL.encode()),  # 500
    ("/v1/chat/completions", AUTH,  # 503: no engine registered
     b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % SERVED_MODEL.encode()),
]


def _errors(app: RouterApp) -> dict[str, float]:
    state = app.state.router_state
    return {sample.labels["status"]: sample.value for metric in state.metrics.http_errors.collect()
            for sample in metric.samples if sample.name.endswith("_total")}


def test_generation_requests_skip_the_framework_and_answer_as_its_route_would(
    app: tuple[RouterApp, TestClient, list[str]],
) -> None:
    router_app, client, seen = app
    direct = [client.post(path, headers=headers, content=body) for path, headers, body in FAILING]
    assert seen == [], f"a generation request went through FastAPI's middleware: {seen}"
    direct_errors = _errors(router_app)

    routes = router_app.direct_routes
    router_app.direct_routes = {}  # the same requests through FastAPI's routing and handlers
    try:
        framework = [client.post(path, headers=headers, content=body) for path, headers, body in FAILING]
    finally:
        router_app.direct_routes = routes
    assert len(seen) == len(FAILING)

    statuses = [r.status_code for r in direct]
    assert statuses == [400, 400, 400, 401, 401, 404, 413, 500, 503]
    for (path, _, body), a, b in zip(FAILING, direct, framework, strict=True):
        assert (a.status_code, a.json()) == (b.status_code, b.json()), f"{path} {body[:40]!r}"
        assert set(a.json()["error"]) == {"message", "type", "param", "code"}
        assert a.headers.get("retry-after") == b.headers.get("retry-after")
    assert direct[7].json()["error"]["message"] == "internal server error"  # no more said of a crash
    # Every error counted by status, once per request, on either path.
    assert direct_errors == {"400": 3.0, "401": 2.0, "404": 1.0, "413": 1.0, "500": 1.0, "503": 1.0}
    assert _errors(router_app) == {status: 2 * n for status, n in direct_errors.items()}


def test_other_methods_and_paths_still_go_through_fastapi(app: tuple[RouterApp, TestClient, list[str]]) -> None:
    router_app, client, seen = app
    assert client.get("/v1/completions").status_code == 405
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert client.post("/v1/nothing", headers=AUTH, content=b"{}").status_code == 404
    assert seen == ["/v1/completions", "/v1/models", "/v1/nothing"]
    assert _errors(router_app) == {"405": 1.0, "404": 1.0}
