"""The router's HTTP front door as vLLM's flags set it: HTTPS, CORS and X-Request-Id headers, each through a real
router (uvicorn on a port) before fake engines, built as ``pdserve router`` builds its server."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.http_options import check_http_args
from router.main import build_parser
from tests.conftest import free_port
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack, wait_until

CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3}


@contextmanager
def _router(redis_url: str, prompts: Any, flags: list[str]) -> Iterator[tuple[RouterServer, FakeCluster]]:
    tokens = list(prompts.tokenizer.encode(" one two three", add_special_tokens=False))
    with fake_stack(redis_url, prompts, tokens, http_flags=flags) as stack:
        yield stack


def _self_signed(folder: Path) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1, made by the openssl command."""
    openssl = shutil.which("openssl")
    assert openssl, "the openssl command makes the test's certificate"
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(key), str(cert)


def test_https_serves_the_api_to_a_client_that_trusts_the_certificate(redis_url: str, prompts: Any,
                                                                      tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    with _router(redis_url, prompts, ["--ssl-keyfile", key, "--ssl-certfile", cert]) as (server, _):
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=cert))
        reply = client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
        assert reply.choices[0].message.content == " one two three"
        stream = client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " one two three"
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{server.url}/health")  # the system's CAs do not know it
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the port is no API
            assert httpx.get(server.url.replace("https://", "http://") + "/health").status_code >= 400


def test_https_checks_client_certificates_against_the_ca_given(redis_url: str, prompts: Any, tmp_path: Path) -> None:
    """``--ssl-cert-reqs 1``: a client may come without a certificate, but one it shows must be the CA's (2, required,
    is the same check with none refused)."""
    key, cert = _self_signed(tmp_path)  # the server's, and the one CA clients' certificates are checked against
    (tmp_path / "other").mkdir()
    other_key, other_cert = _self_signed(tmp_path / "other")
    flags = ["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", cert, "--ssl-cert-reqs", "1"]
    with _router(redis_url, prompts, flags) as (server, _):
        for client_cert in (None, (cert, key)):
            with httpx.Client(verify=_trusting(cert, client_cert)) as client:
                assert client.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=_trusting(cert, (other_cert, other_key))) as client:
            client.post(f"{server.url}/v1/chat/completions", json=CHAT)  # one the CA did not sign


def _trusting(ca: str, client_cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    """A client's TLS settings: trusting ``ca``, showing ``client_cert`` (certificate, key) where given."""
    context = ssl.create_default_context(cafile=ca)
    if client_cert is not None:
        context.load_cert_chain(*client_cert)
    return context


def test_cors_answers_only_the_origins_named(redis_url: str, prompts: Any) -> None:
    app, other = "https://app.example", "https://other.example"
    with _router(redis_url, prompts, ["--allowed-origins", f'["{app}"]']) as (server, _):
        preflight = {"Origin": app, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        response = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == app
        assert httpx.options(f"{server.url}/v1/chat/completions",
                             headers={**preflight, "Origin": other}).status_code == 400
        for body in (CHAT, {**CHAT, "stream": True}):  # the generation endpoints are served below FastAPI
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Origin": app})
            assert response.status_code == 200 and response.headers["access-control-allow-origin"] == app
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Origin": other})
            assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        error = httpx.post(f"{server.url}/v1/chat/completions", json={}, headers={"Origin": app})
        assert error.status_code == 400 and error.headers["access-control-allow-origin"] == app
    with _router(redis_url, prompts, []) as (server, _):  # none named: no CORS header at all
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"Origin": app})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_request_id_headers_echo_the_client_s_id_or_make_one(redis_url: str, prompts: Any) -> None:
    with _router(redis_url, prompts, ["--enable-request-id-headers"]) as (server, _):
        url = f"{server.url}/v1/chat/completions"
        for body in (CHAT, {**CHAT, "stream": True}):
            assert httpx.post(url, json=body, headers={"X-Request-Id": "trace-7"}).headers["x-request-id"] == "trace-7"
        made = {httpx.post(url, json=CHAT).headers["x-request-id"] for _ in range(2)}
        assert len(made) == 2 and all(len(i) == 32 and int(i, 16) >= 0 for i in made)
        for bad in ("x" * 257, "two words"):
            echoed = httpx.post(url, json=CHAT, headers={"X-Request-Id": bad}).headers["x-request-id"]
            assert echoed != bad and len(echoed) == 32
        assert httpx.get(f"{server.url}/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    with _router(redis_url, prompts, []) as (server, _):
        assert "x-request-id" not in httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).headers


def test_behind_a_proxy_s_path_prefix_the_api_is_served_and_links_carry_the_prefix(
    redis_url: str, prompts: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--root-path /llm``: the proxy strips the prefix; the generation endpoints still answer on their direct
    path below FastAPI (not FastAPI's slower routing), and /openapi.json names the prefix for clients built from it."""
    from router.app import RouterApp

    direct: list[str] = []
    serve_direct = RouterApp._serve_direct

    async def counted(self, endpoint, scope, receive, send):  # type: ignore[no-untyped-def]
        direct.append(scope["path"])
        await serve_direct(self, endpoint, scope, receive, send)

    monkeypatch.setattr(RouterApp, "_serve_direct", counted)
    with _router(redis_url, prompts, ["--root-path", "/llm"]) as (server, _):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert client.chat.completions.create(**CHAT).choices[0].message.content == " one two three"  # type: ignore[call-overload]
        assert direct == ["/llm/v1/chat/completions"]
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == SERVED_MODEL
        assert httpx.get(f"{server.url}/openapi.json").json()["servers"] == [{"url": "/llm"}]


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-cert-reqs", "2"], "--ssl-ca-certs and --ssl-cert-reqs need HTTPS"),
    (["--allow-credentials"], "--allow-credentials needs --allowed-origins"),
    (["--root-path", "llm/"], "--root-path 'llm/': a path that starts with '/'"),
    (["--ssl-keyfile", "/nonexistent/k.pem", "--ssl-certfile", "/nonexistent/c.pem"], "--ssl-keyfile .*no such file"),
])
def test_http_flags_that_do_not_fit_together_are_refused_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        check_http_args(build_parser().parse_args(flags))


def test_origins_must_be_a_json_list_and_vllm_s_auto_tool_choice_flag_is_taken(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "https://app.example"])
    assert "expected a JSON list of strings" in capsys.readouterr().err
    args = build_parser().parse_args(["--allowed-origins", '["*"]', "--enable-auto-tool-choice"])
    assert args.allowed_origins == ["*"] and args.enable_auto_tool_choice


@pytest.mark.parametrize("workers", [1, 2])
def test_pdserve_router_serves_https_cors_and_request_ids_from_its_flags(  # type: ignore[no-untyped-def]
    redis_url: str, prompts: Any, tokenizer_dir: Path, tmp_path: Path, workers: int,
) -> None:
    """The command itself, one process or two behind one port: its flags reach the server it runs."""
    from common.model.loader import model_identity

    key, cert = _self_signed(tmp_path)
    tokens = list(prompts.tokenizer.encode(" one two three", add_special_tokens=False))
    # The fakes say they serve the router process's model: it would leave out instances of another.
    with fake_stack(redis_url, prompts, tokens, {"model_id": model_identity(tokenizer_dir)}) as (server, _):
        port = free_port()
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "router", "--model", str(tokenizer_dir), "--served-model-name",
             SERVED_MODEL, "--redis-url", redis_url, "--namespace", server.state.config.namespace, "--port", str(port),
             "--workers", str(workers), "--log-level", "warning", "--ssl-keyfile", key, "--ssl-certfile", cert,
             "--allowed-origins", '["https://app.example"]', "--enable-request-id-headers"],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        try:
            url = f"https://127.0.0.1:{port}"

            def ready() -> bool:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                try:
                    body = httpx.get(f"{url}/ready", timeout=2, verify=cert).json()
                except (httpx.HTTPError, ValueError):
                    return False
                return bool(body.get("prefill", 0) >= 1 and body.get("decode", 0) >= 1)

            assert wait_until(ready, 90, interval_s=0.3), "the router did not come up over HTTPS"
            response = httpx.post(f"{url}/v1/chat/completions", json=CHAT, verify=cert,
                                  headers={"Origin": "https://app.example", "X-Request-Id": "cli-1"})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == " one two three"
            assert response.headers["access-control-allow-origin"] == "https://app.example"
            assert response.headers["x-request-id"] == "cli-1"
            preflight = httpx.options(f"{url}/v1/chat/completions", verify=cert, headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST", "X-Request-Id": "cli-2"})
            assert preflight.status_code == 200 and preflight.headers["x-request-id"] == "cli-2"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
