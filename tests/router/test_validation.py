"""Bad input always gets an OpenAI-style 4xx error naming the problem, never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import create_app
from tests.router.router_harness import SERVED_MODEL, make_state

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(prompts: Any) -> Iterator[TestClient]:
    state = make_state(prompts, redis_url=None, max_body_bytes=64 * 1024)
    with TestClient(create_app(state)) as test_client:
        yield test_client


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "messages": MESSAGES, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "prompt": "hello", **fields}


BAD_REQUESTS = [
    # (path, body, param the error must name)
    (CHAT, {"model": SERVED_MODEL}, "messages"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    (CHAT, chat(messages="hello"), "messages"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages.0.content.0",
    ),
    (CHAT, chat(temperature=-1), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n=100), "n"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens=-3), "max_tokens"),
    (CHAT, chat(max_tokens=10**9), "max_tokens"),
    (CHAT, chat(max_completion_tokens=100_000), "max_tokens"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(stop=123), "stop"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (CHAT, chat(presence_penalty=3), "presence_penalty"),
    (CHAT, chat(frequency_penalty=-2.5), "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat(top_k=-5), "top_k"),
    (CHAT, chat(min_p=2), "min_p"),
    (CHAT, chat(max_tokens=5, min_tokens=10), "min_tokens"),
    (CHAT, chat(seed="abc"), "seed"),
    (CHAT, chat(seed=2**70), "seed"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(stop_token_ids=[10**9]), "stop_token_ids"),
    (CHAT, chat(logit_bias={"1": 5}), "logit_bias"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools"),
    (CHAT, chat(stream="yes"), "stream"),
    (COMPLETIONS, {"model": SERVED_MODEL}, "prompt"),
    (COMPLETIONS, completion(prompt=""), "prompt"),
    (COMPLETIONS, completion(prompt=[]), "prompt"),
    (COMPLETIONS, completion(prompt=[10**9]), "prompt"),
    (COMPLETIONS, completion(prompt=[-1, 2]), "prompt"),
    (COMPLETIONS, completion(prompt={"text": "hi"}), "prompt"),
    (COMPLETIONS, completion(prompt="word " * 300), "prompt"),
    (COMPLETIONS, completion(logprobs=50), "logprobs"),
    (COMPLETIONS, completion(echo=True), "echo"),
    (COMPLETIONS, completion(best_of=3), "best_of"),
    (COMPLETIONS, completion(max_tokens=256), "max_tokens"),
]


def assert_openai_error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_field_gets_400_naming_it(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_openai_error(client.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param), error


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b"[1, 2]", b'"text"', b'{"temperature": NaN}', b"[" * 50_000]
)
def test_malformed_json_gets_400(client: TestClient, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    assert_openai_error(client.post(CHAT, content=raw, headers=headers), 400)


def test_unknown_model_gets_404(client: TestClient) -> None:
    error = assert_openai_error(client.post(CHAT, json=chat(model="gpt-17")), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


def test_unknown_route_and_wrong_method_are_openai_errors(client: TestClient) -> None:
    assert_openai_error(client.get("/v1/nothing-here"), 404)
    assert_openai_error(client.get(CHAT), 405)


def test_body_over_limit_gets_413(client: TestClient) -> None:
    huge = chat(messages=[{"role": "user", "content": "x" * 100_000}])
    assert_openai_error(client.post(CHAT, json=huge), 413)

    def chunks() -> Iterator[bytes]:  # no content-length: the limit holds while streaming the body
        yield json.dumps(huge).encode()

    assert_openai_error(client.post(CHAT, content=chunks()), 413)


def test_valid_request_without_instances_gets_503(client: TestClient) -> None:
    error = assert_openai_error(client.post(CHAT, json=chat()), 503)
    assert error["code"] == "no_instances"
    assert client.get("/ready").status_code == 503


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_fields = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
]
_fields += ["top_logprobs", "stream", "stream_options", "top_k", "min_p", "min_tokens", "presence_penalty"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from([CHAT, COMPLETIONS]), body=st.dictionaries(st.sampled_from(_fields), _json_values)
)
def test_fuzzed_bodies_never_get_a_5xx_for_bad_input(
    client: TestClient, path: str, body: dict[str, Any]
) -> None:
    response = client.post(path, json=body)
    if response.status_code >= 500:  # only "valid, but nothing to run it on" may be a 5xx here
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_instances", (
            response.text
        )
    else:
        assert response.status_code in (400, 404), response.text
