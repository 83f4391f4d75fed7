"""An engine's HTTP side port: ``/metrics`` for Prometheus, ``/health`` and ``/ready`` for probes.

``/health`` answers 200 while the process serves HTTP at all (liveness). ``/ready`` answers 200
only while ``ready()`` says so (the engine is loaded, registered, and not draining), else 503: what
the compose health checks and the Kubernetes readiness probes ask. The server starts after the
model has loaded, so a probe that gets any answer knows the weights are in memory.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

logger = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not worth a line
        pass


def health_app(registry: CollectorRegistry, ready: Callable[[], bool]) -> Callable[[dict, StartResponse], Iterable[bytes]]:
    """The WSGI app: ``/health``, ``/ready``, and the registry's exposition on every other path.

    ``ready`` is called from the server's threads on each ``/ready``; an exception counts as not ready.
    """
    metrics = make_wsgi_app(registry)

    def reply(start_response: StartResponse, ok: bool, body: dict[str, Any]) -> list[bytes]:
        data = json.dumps(body).encode()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    def app(environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/health":
            return reply(start_response, True, {"status": "ok"})
        if path == "/ready":
            try:
                ok = bool(ready())
            except Exception:
                logger.debug("readiness check failed", exc_info=True)
                ok = False
            return reply(start_response, ok, {"ready": ok})
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


def serve_health_and_metrics(
    host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool]
) -> WSGIServer:
    """Serve ``health_app`` on ``host:port`` from a daemon thread; returns the server (``shutdown()`` stops it)."""
    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    server = make_server(host, port, health_app(registry, ready), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server
