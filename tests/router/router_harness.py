"""A real router (uvicorn on a free port, in a thread) for end-to-end tests."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from router.app import create_app
from router.config import RouterConfig
from router.http_options import check_http_args, uvicorn_options, wrap_app
from router.main import UVICORN_SETTINGS, build_parser
from router.state import RouterState
from router.tokenization import PromptProcessor
from tests.conftest import free_port
from tests.router.fake_engine import FakeCluster

SERVED_MODEL = "test-model"


def make_state(prompts: PromptProcessor, **config: Any) -> RouterState:
    config.setdefault("served_model_names", [SERVED_MODEL])
    config.setdefault("refresh_interval_s", 0.1)
    return RouterState(RouterConfig(**config), prompts)


@contextmanager
def fake_stack(
    redis_url: str, prompts: PromptProcessor, reply_tokens: list[int], cluster_kw: dict[str, Any] | None = None,
    http_flags: list[str] | None = None, **config: Any,
) -> Iterator[tuple[RouterServer, FakeCluster]]:
    """A router in front of fake engines (one prefill and one decode unless ``cluster_kw`` says
    otherwise) answering with ``reply_tokens``, under a namespace of their own; ready. ``http_flags``: as
    ``RouterServer`` takes them."""
    namespace = f"fake-{uuid.uuid4().hex[:8]}"
    kw = cluster_kw or {}
    state = make_state(prompts, redis_url=redis_url, namespace=namespace, **config)
    with FakeCluster(redis_url, namespace, reply_tokens, **kw) as cluster, RouterServer(state, http_flags) as server:
        server.wait_ready(prefill=kw.get("num_prefill", 1), decode=kw.get("num_decode", 1))
        yield server, cluster


class RouterServer:
    """``http_flags``: the router's HTTP front-door flags (CORS, TLS, request ids), served as ``pdserve router``
    serves them; with TLS, ``url`` is https and ``verify`` the CA file to check the server against."""

    def __init__(self, state: RouterState, http_flags: list[str] | None = None) -> None:
        self.state = state
        self.port = free_port()
        args = build_parser().parse_args(http_flags or [])
        check_http_args(args)
        self.url = f"{'https' if args.ssl_certfile else 'http'}://127.0.0.1:{self.port}"
        self.verify: str | bool = args.ssl_certfile or True
        config = uvicorn.Config(wrap_app(create_app(state), args), host="127.0.0.1", port=self.port,
                                log_level="warning", **UVICORN_SETTINGS, **uvicorn_options(args))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="router", daemon=True)

    def __enter__(self) -> RouterServer:
        self._thread.start()
        assert wait_until(lambda: self._server.started, 10), "router did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def wait_ready(self, timeout_s: float = 30.0, prefill: int = 1, decode: int = 1) -> None:
        """Wait until the router sees ``prefill`` and ``decode`` instances alive. Ready alone is not
        enough: it needs only a decode instance, and the engines register in any order."""

        def seen() -> bool:
            body = httpx.get(f"{self.url}/ready", verify=self.verify).json()
            return body["status"] == "ready" and body["prefill"] >= prefill and body["decode"] >= decode

        assert wait_until(seen, timeout_s), f"the router did not see {prefill} prefill and {decode} decode"


def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
