"""The router's HTTP front door, set by vLLM's server flags: CORS, TLS, a root path behind a proxy, and an
``X-Request-Id`` on every response.

``add_http_args`` declares the flags, ``wrap_app`` puts the ASGI layers they ask for around the app (none by
default), and ``uvicorn_options`` gives the server its TLS settings and root path. ``pdserve router`` uses all three; a
test builds its server from the same three.

Chosen where vLLM differs: vLLM answers every origin's CORS requests unless told otherwise
(``--allowed-origins`` defaults to ``["*"]``). Here no CORS header is sent unless ``--allowed-origins`` names
origins: a browser page from another origin may read a router's answers only where its operator said so.
"""

from __future__ import annotations

import argparse
import json
import ssl
import uuid
from pathlib import Path
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A client's own id is echoed only if it is this long at most and printable ASCII; else the router makes one.
MAX_REQUEST_ID_CHARS = 256
# ... and names the request (its response's id, vLLM's ``request_id``) only if this long at most.
MAX_NAMING_REQUEST_ID_CHARS = 128


def printable_id(value: bytes | None, limit: int) -> str | None:
    """A header's value as an id: printable ASCII without spaces, ``limit`` characters at most; else None."""
    if value is None or not value or len(value) > limit or not value.isascii() or not all(32 < c < 127 for c in value):
        return None
    return value.decode()


def json_list_arg(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's ``--allowed-origins`` and its siblings take them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"https://example.com\"]', "
                                         f"got {text!r}")
    return value


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allowed-origins", type=json_list_arg, default=[], metavar="JSON",
                   help="origins whose browser pages may read the API's answers (CORS), as a JSON list; '[\"*\"]': "
                   "any (default: none, no CORS header sent)")
    p.add_argument("--allowed-methods", type=json_list_arg, default=["*"], metavar="JSON",
                   help="with --allowed-origins: the methods allowed (default: all)")
    p.add_argument("--allowed-headers", type=json_list_arg, default=["*"], metavar="JSON",
                   help="with --allowed-origins: the request headers allowed (default: all)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="with --allowed-origins: allow cookies and authorization headers from those origins")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the server's private key (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the server's certificate chain (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="HTTPS: the CA certificates client certificates are checked "
                   "against")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                   help="HTTPS: whether a client certificate is needed: 0 none, 1 optional, 2 required (default: 0)")
    p.add_argument("--root-path", default="",
                   help="the path prefix a proxy in front serves the API under, and strips (vLLM's flag; FastAPI's "
                   "root_path): links the app writes, /openapi.json's among them, carry it")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer every request with an X-Request-Id header: the client's own (printable, 256 "
                   "characters at most), else a new one")


def check_http_args(args: argparse.Namespace) -> None:
    """``SystemExit`` naming the flag where the HTTP options do not fit together, before anything loads."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise SystemExit("--ssl-keyfile and --ssl-certfile go together: HTTPS needs both the key and the certificate")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path and not Path(path).is_file():
            raise SystemExit(f"{flag} {path}: no such file")
    if not args.ssl_certfile and (args.ssl_ca_certs or args.ssl_cert_reqs):
        raise SystemExit("--ssl-ca-certs and --ssl-cert-reqs need HTTPS (--ssl-keyfile, --ssl-certfile)")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise SystemExit("--ssl-cert-reqs needs --ssl-ca-certs: the CAs client certificates are checked against")
    if not args.allowed_origins and args.allow_credentials:
        raise SystemExit("--allow-credentials needs --allowed-origins")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise SystemExit(f"--root-path {args.root_path!r}: a path that starts with '/' and does not end with one")


def http_flags(args: argparse.Namespace) -> list[str]:
    """The command-line flags that give a router ``args``' HTTP options (``pdserve up`` passes them on), files
    as absolute paths."""
    flags: list[str] = []
    if args.allowed_origins:
        flags += ["--allowed-origins", json.dumps(args.allowed_origins), "--allowed-methods",
                  json.dumps(args.allowed_methods), "--allowed-headers", json.dumps(args.allowed_headers)]
    if args.allow_credentials:
        flags.append("--allow-credentials")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", str(Path(getattr(args, name)).resolve())]
    if args.ssl_cert_reqs:
        flags += ["--ssl-cert-reqs", str(args.ssl_cert_reqs)]
    if args.root_path:
        flags += ["--root-path", args.root_path]
    if args.enable_request_id_headers:
        flags.append("--enable-request-id-headers")
    return flags


def wrap_app(app: ASGIApp, args: argparse.Namespace) -> ASGIApp:
    """``app`` behind the layers the flags ask for, outermost last: CORS, then request ids (so the answers CORS
    gives itself, to a preflight, carry an id too)."""
    if args.allowed_origins:
        app = CORSMiddleware(app, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                             allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    if args.enable_request_id_headers:
        app = RequestIdHeaders(app)
    return app


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's settings from the flags: TLS, and the root path ({} for neither)."""
    options: dict[str, Any] = {"root_path": args.root_path} if args.root_path else {}
    if args.ssl_certfile:
        options.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                       ssl_cert_reqs=args.ssl_cert_reqs)
    return options


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return printable_id(value, MAX_REQUEST_ID_CHARS)
    return None


class RequestIdHeaders:
    """Adds ``X-Request-Id`` to every HTTP response: the request's own, else a new uuid (vLLM's
    ``--enable-request-id-headers``). Only the start of a response is touched; its body passes as it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = (b"x-request-id", (_client_request_id(scope) or uuid.uuid4().hex).encode())

        async def with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, with_request_id)
