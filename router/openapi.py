"""The OpenAPI document served at ``/openapi.json``: each endpoint with its real request and
response models.

The generation endpoints read their bodies themselves (a size limit, strict JSON, 400s that name
the field), so FastAPI cannot see their request models; ``generation_route`` declares them by
reference and ``install_openapi`` adds their schemas to the document's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.openai_responses import ChatCompletionChunk, ErrorResponse
from router.responses_api import ResponsesRequest, ResponseStreamEvent

REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, ResponsesRequest)
# Sent only inside event streams, so no route's response model names it.
STREAM_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, ResponseStreamEvent)
_REF = "#/components/schemas/{model}"

_ERRORS = {
    400: "invalid request: the error's param names the field",
    401: "missing or wrong API key",
    404: "unknown model, or no such stored response",
    413: "request body too large",
    429: "too many requests in flight, or the fair queue is full: retry after Retry-After seconds",
    503: "no instance can serve the request, or the response store is unreachable",
}


def error_responses() -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}


def generation_route(
    request_model: type[BaseModel], response_model: type[BaseModel], chunk_model: type[BaseModel]
) -> dict[str, Any]:
    """Keyword arguments of ``app.post`` that document a generation endpoint whose streams are made
    of ``chunk_model`` objects."""
    # One event of the stream: before OpenAPI 3.2 (``itemSchema``), a server-sent event stream's
    # ``schema`` describes each event, as its fields (the SSE specification's), not the stream's text.
    stream_schema = {
        "type": "object",
        "description": f"with stream=true, each server-sent event: a {chunk_model.__name__}, then [DONE]",
        "properties": {
            "data": {"type": "string", "description": f"a {chunk_model.__name__} as JSON, or the last event's [DONE]"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
        "required": ["data"],
    }
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=request_model.__name__)}}
                },
            }
        },
        "responses": {
            200: {
                "model": response_model,
                "description": "the whole response, or with stream=true a stream of chunks",
                "content": {"text/event-stream": {"schema": stream_schema}},
            },
            **error_responses(),
        },
    }


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` serves) include ``REQUEST_MODELS`` and
    ``STREAM_MODELS``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = [(model, "validation") for model in REQUEST_MODELS]
            models += [(model, "serialization") for model in STREAM_MODELS]
            _, definitions = models_json_schema(models, ref_template=_REF)  # type: ignore[arg-type]
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(definitions.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
