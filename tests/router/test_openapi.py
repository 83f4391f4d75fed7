"""/openapi.json describes the endpoints with the request and response models the router really uses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from tests.router.router_harness import make_state


@pytest.fixture(scope="module")
def document(prompts: Any) -> Iterator[dict[str, Any]]:
    state = make_state(prompts, redis_url=None, api_keys=["secret"])
    with TestClient(create_app(state)) as client:
        response = client.get("/openapi.json")  # the document needs no key; the API does
        assert response.status_code == 200, response.text
        assert client.get("/v1/models").status_code == 401
        yield response.json()


def _resolve(document: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/components/schemas/"), ref
    schemas = document["components"]["schemas"]
    name = ref.rsplit("/", 1)[1]
    assert name in schemas, f"dangling reference {ref}"
    return dict(schemas[name])


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


@pytest.mark.parametrize(
    ("path", "request_model", "response_model", "required", "fields"),
    [
        (
            "/v1/completions",
            "CompletionRequest",
            "CompletionResponse",
            ["prompt"],
            {"prompt", "echo", "logprobs"},
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            "ChatCompletionResponse",
            ["messages"],
            {"messages", "max_completion_tokens", "top_logprobs"},
        ),
    ],
)
def test_generation_endpoints_list_their_request_and_response_models(
    document: dict[str, Any],
    path: str,
    request_model: str,
    response_model: str,
    required: list[str],
    fields: set[str],
) -> None:
    operation = document["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    request_schema = _resolve(document, body["content"]["application/json"]["schema"]["$ref"])
    assert request_schema["title"] == request_model
    assert request_schema["required"] == required
    shared = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "seed", "stop_token_ids"}
    assert shared | fields <= set(request_schema["properties"])

    ok = operation["responses"]["200"]["content"]
    assert _resolve(document, ok["application/json"]["schema"]["$ref"])["title"] == response_model
    # Each server-sent event, as an event's fields (what a client that reads the stream sees), not text.
    event = ok["text/event-stream"]["schema"]
    assert event["type"] == "object" and event["required"] == ["data"]
    assert event["properties"]["data"]["type"] == "string"
    error = operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert set(_resolve(document, error)["properties"]) == {"error"}


def test_the_responses_endpoint_lists_its_request_response_and_event_models(document: dict[str, Any]) -> None:
    operation = document["paths"]["/v1/responses"]["post"]
    request_schema = _resolve(document, operation["requestBody"]["content"]["application/json"]["schema"]["$ref"])
    assert request_schema["title"] == "ResponsesRequest" and request_schema["required"] == ["input"]
    assert {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "stream"} <= set(
        request_schema["properties"])
    ok = operation["responses"]["200"]["content"]
    assert _resolve(document, ok["application/json"]["schema"]["$ref"])["title"] == "ResponseObject"
    assert "ResponseStreamEvent" in ok["text/event-stream"]["schema"]["description"]
    assert "ResponseStreamEvent" in document["components"]["schemas"]


def test_every_reference_in_the_document_resolves(document: dict[str, Any]) -> None:
    refs = set(_refs(document))
    assert "#/components/schemas/ChatMessage" in refs  # the request models' own parts are there too
    for ref in refs:
        _resolve(document, ref)
    assert "ChatCompletionChunk" in document["components"]["schemas"]  # what chat streams are made of
    assert {"/v1/models", "/health", "/ready", "/metrics"} <= set(document["paths"])
