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
from router.config import RequestLimits
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
    (CHAT, chat(logit_bias={"x": 5}), "logit_bias"),
    (CHAT, chat(logit_bias={"-1": 5}), "logit_bias"),
    (CHAT, chat(logit_bias={"1": 101}), "logit_bias"),
    (CHAT, chat(logit_bias={"1": -100.5}), "logit_bias"),
    (CHAT, chat(logit_bias={str(10**9): 1}), "logit_bias"),
    (CHAT, chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (COMPLETIONS, completion(logit_bias={"1": "big"}), "logit_bias"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
     "response_format"),
    (COMPLETIONS, completion(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "response_format"),
    (CHAT, chat(guided_json="{not json"), "guided_json"),
    (CHAT, chat(guided_json={"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}),
     "guided_json"),
    (COMPLETIONS, completion(guided_regex="[a-"), "guided_regex"),
    (COMPLETIONS, completion(guided_regex=""), "guided_regex"),
    (COMPLETIONS, completion(guided_choice=[]), "guided_choice"),
    (COMPLETIONS, completion(guided_choice=["a", 1]), "guided_choice"),
    (CHAT, chat(guided_choice=["a"], guided_regex="a"), "guided_choice"),
    (CHAT, chat(response_format={"type": "json_object"}, guided_json={"type": "object"}), "guided_json"),
    (CHAT, chat(guided_json=json.loads('{"type": "array", "items": ' * 70 + "{}" + "}" * 70)), "guided_json"),
    (CHAT, chat(guided_json="[" * 20_000 + "]" * 20_000), "guided_json"),
    (COMPLETIONS, completion(guided_grammar='root ::= "a" undefined'), "guided_grammar"),
    (COMPLETIONS, completion(guided_grammar='start: "a"'), "guided_grammar"),  # Lark: not converted
    (COMPLETIONS, completion(guided_grammar='expr ::= "a"'), "guided_grammar"),  # no root rule
    (COMPLETIONS, completion(guided_grammar=""), "guided_grammar"),
    (CHAT, chat(structured_outputs="json"), "structured_outputs"),
    (CHAT, chat(structured_outputs={"regex": "[a-"}), "structured_outputs.regex"),
    (CHAT, chat(structured_outputs={"choice": ["a"], "grammar": 'root ::= "a"'}), "structured_outputs.grammar"),
    (CHAT, chat(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
    (CHAT, chat(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag"),
    (CHAT, chat(structured_outputs={"structural_tag": "<a>"}), "structured_outputs.structural_tag"),
    (COMPLETIONS, completion(structural_tag=[]), "structural_tag"),
    (COMPLETIONS, completion(structural_tag={"type": "regex", "format": {}}), "structural_tag"),
    (CHAT, chat(response_format={"type": "structural_tag", "format": {"type": "nope"}}), "response_format"),
    (CHAT, chat(response_format={"type": "structural_tag", "structures": [], "triggers": ["<f"]}), "response_format"),
    (CHAT, chat(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}), "structural_tag"),
    (CHAT, chat(structural_tag={"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}), "structural_tag"),
    (CHAT, chat(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"],
                                "stop": True}), "structural_tag"),
    (CHAT, chat(structural_tag={"format": {"type": "json_schema", "json_schema": {"type": "nope"}}}), "structural_tag"),
    (CHAT, chat(structural_tag={"format": {"type": "const_string", "value": "a"}}, guided_regex="a"), "structural_tag"),
    (CHAT, chat(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
    (CHAT, chat(structured_outputs={"json": {"type": "object"}}, guided_regex="a"), "structured_outputs.json"),
    (COMPLETIONS, completion(allowed_token_ids=[]), "allowed_token_ids"),
    (COMPLETIONS, completion(allowed_token_ids=[10**9]), "allowed_token_ids"),
    (COMPLETIONS, completion(allowed_token_ids=["1"]), "allowed_token_ids"),
    (CHAT, chat(allowed_token_ids=[2], stop_token_ids=[2], min_tokens=1), "allowed_token_ids"),
    (CHAT, chat(bad_words="no"), "bad_words"),
    (CHAT, chat(bad_words=["  "]), "bad_words"),
    (CHAT, chat(bad_words=["x" * 300]), "bad_words"),
    (CHAT, chat(bad_words=[f"w{i}" for i in range(200)]), "bad_words"),
    (CHAT, chat(bad_words=["supercalifragilistic" * 12]), "bad_words"),  # over 64 tokens
    (CHAT, chat(tools=[{"type": "function"}]), "tools"),
    (CHAT, chat(stream="yes"), "stream"),
    (COMPLETIONS, {"model": SERVED_MODEL}, "prompt"),
    (COMPLETIONS, completion(prompt=""), "prompt"),
    (COMPLETIONS, completion(prompt=[]), "prompt"),
    (COMPLETIONS, completion(prompt=[10**9]), "prompt"),
    (COMPLETIONS, completion(prompt=[-1, 2]), "prompt"),
    (COMPLETIONS, completion(prompt={"text": "hi"}), "prompt"),
    (COMPLETIONS, completion(prompt="word " * 300), "prompt"),
    (COMPLETIONS, completion(prompt="\x16\x04"), "prompt"),  # characters the tokenizer drops: no tokens
    (COMPLETIONS, completion(logprobs=50), "logprobs"),
    (COMPLETIONS, completion(echo=True, logprobs=1, stream=True), "echo"),
    (COMPLETIONS, completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (CHAT, chat(prompt_logprobs=0, stream=True), "prompt_logprobs"),
    (COMPLETIONS, completion(prompt_logprobs=21), "prompt_logprobs"),
    (COMPLETIONS, completion(prompt_logprobs=-1), "prompt_logprobs"),
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


def post_raw(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    """``body`` as JSON with every non-ASCII character escaped, so lone surrogates travel as the
    valid JSON escapes they are (``"\\ud800"``)."""
    headers = {"content-type": "application/json"}
    return client.post(path, content=json.dumps(body).encode("ascii"), headers=headers)


LONE_SURROGATES = [
    # (path, body, the param the error must name exactly)
    (COMPLETIONS, completion(prompt="\ud800 hi"), "prompt"),
    (COMPLETIONS, completion(prompt=["fine", "bad \udfff"]), "prompt.1"),
    (COMPLETIONS, completion(stop="\udc00"), "stop"),
    (CHAT, chat(messages=[{"role": "user", "content": "hi \ud800 there"}]), "messages.0.content"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x\udbff"}]}]),
        "messages.0.content.0.text",
    ),
    (CHAT, chat(stop=["ok", "\ud83d"]), "stop.1"),  # the first half of an emoji, alone
    (CHAT, chat(user="\udc00"), "user"),
    (CHAT, chat(model="\ud800"), "model"),
    (CHAT, {**chat(), "\ud800extra": 1}, "body"),  # even an ignored key
]


@pytest.mark.parametrize(("path", "body", "param"), LONE_SURROGATES)
def test_lone_surrogate_gets_400_naming_the_field(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_openai_error(post_raw(client, path, body), 400)
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    assert "Unicode" in error["message"]


def test_utf8_encoded_surrogate_bytes_get_400(client: TestClient) -> None:
    raw = b'{"model": "%s", "prompt": "a \xed\xa0\x80 b"}' % SERVED_MODEL.encode()
    error = assert_openai_error(client.post(COMPLETIONS, content=raw), 400)
    assert error["param"] == "prompt" and error["code"] == "invalid_unicode"


def test_prompt_logprobs_that_would_not_fit_one_output_message_get_400() -> None:
    from common.sampling_params import SamplingParams
    from router.errors import APIError
    from router.openai_models import check_prompt_logprobs

    check_prompt_logprobs(SamplingParams(prompt_logprobs=20), 7000)
    with pytest.raises(APIError) as refused:
        check_prompt_logprobs(SamplingParams(prompt_logprobs=20), 8000)
    assert refused.value.status == 400 and refused.value.param == "prompt_logprobs"


def test_utf16_body_with_a_lone_surrogate_gets_400(client: TestClient) -> None:
    """The raw-bytes pre-check reads UTF-8; a UTF-16 document (which JSON decoding accepts) is walked."""
    raw = ('{"model": "' + SERVED_MODEL + '", "prompt": "a \\ud800 b"}').encode("utf-16")
    error = assert_openai_error(client.post(COMPLETIONS, content=raw), 400)
    assert error["param"] == "prompt" and error["code"] == "invalid_unicode"


def test_escaped_surrogate_pairs_are_valid_text(client: TestClient) -> None:
    """An emoji escaped as a surrogate pair is one valid character: the request goes through
    validation and tokenization (and only then finds no instance to run on)."""
    body = chat(messages=[{"role": "user", "content": "party \U0001f389"}], stop=["\U0001f389"])
    assert b"\\ud83c\\udf89" in json.dumps(body).encode("ascii")
    assert_openai_error(post_raw(client, CHAT, body), 503)


SMALL_LIMITS = RequestLimits(
    max_prompts_per_request=3,
    max_n=2,
    max_stop_strings=2,
    max_stop_string_chars=5,
    max_total_tokens_per_request=100,
)


@pytest.fixture(scope="module")
def limited_client(prompts: Any) -> Iterator[TestClient]:
    state = make_state(prompts, redis_url=None, limits=SMALL_LIMITS)
    with TestClient(create_app(state)) as test_client:
        yield test_client


OVER_LIMITS = [
    # (path, body, param, the flag the message must name)
    (COMPLETIONS, completion(prompt=["a", "b", "c", "d"]), "prompt", "--max-prompts-per-request"),
    (COMPLETIONS, completion(prompt=[[1], [2], [3], [4]]), "prompt", "--max-prompts-per-request"),
    (CHAT, chat(n=3), "n", "--max-n"),
    (CHAT, chat(stop=["a", "b", "c"]), "stop", "--max-stop-strings"),
    (CHAT, chat(stop="abcdef"), "stop", "--max-stop-string-chars"),
    (COMPLETIONS, completion(stop=["ok", "abcdef"]), "stop.1", "--max-stop-string-chars"),
    # n x prompts x max_tokens = 2 x 3 x 17 = 102
    (COMPLETIONS, completion(prompt=["a", "b", "c"], n=2, max_tokens=17), "max_tokens", "--max-total-tokens"),
    (CHAT, chat(n=2, max_completion_tokens=51), "max_tokens", "--max-total-tokens"),
    # without max_tokens a chat request may use all the context left: far more than 100 tokens
    (CHAT, chat(), "max_tokens", "--max-total-tokens"),
    (CHAT, chat(n=2, max_tokens=60), "max_tokens", "--max-total-tokens"),
]


@pytest.mark.parametrize(("path", "body", "param", "flag"), OVER_LIMITS)
def test_request_over_a_limit_gets_400_naming_the_limit(
    limited_client: TestClient, path: str, body: dict[str, Any], param: str, flag: str
) -> None:
    error = assert_openai_error(limited_client.post(path, json=body), 400)
    assert error["param"] == param, error
    assert flag in error["message"], error


AT_LIMITS = [
    (COMPLETIONS, completion(prompt=["a", "b", "c"], n=2, max_tokens=16)),  # 96 tokens
    (COMPLETIONS, completion(prompt=[[1], [2], [3]], max_tokens=33)),  # 99 tokens
    (CHAT, chat(n=2, max_tokens=50, stop=["abcde", "xy"])),  # 100 tokens
]


@pytest.mark.parametrize(("path", "body"), AT_LIMITS)
def test_request_at_the_limits_is_served(limited_client: TestClient, path: str, body: dict[str, Any]) -> None:
    error = assert_openai_error(limited_client.post(path, json=body), 503)  # valid; nothing to run it on
    assert error["code"] == "no_instances"


@pytest.mark.parametrize(
    ("path", "body", "param", "flag"),
    [
        (COMPLETIONS, completion(prompt=["hi"] * 1025), "prompt", "--max-prompts-per-request"),
        (CHAT, chat(n=17), "n", "--max-n"),
        (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", "--max-stop-strings"),
        (CHAT, chat(stop="x" * 257), "stop", "--max-stop-string-chars"),
        (COMPLETIONS, completion(prompt=["hi"] * 1024, n=16, max_tokens=200), "max_tokens", "--max-total"),
    ],
)
def test_default_limits(client: TestClient, path: str, body: dict[str, Any], param: str, flag: str) -> None:
    error = assert_openai_error(client.post(path, json=body), 400)
    assert error["param"] == param and flag in error["message"], error


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
