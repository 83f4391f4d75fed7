"""The router's HTTP surface: OpenAI-compatible endpoints plus health, readiness and metrics."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Message, Receive, Scope, Send

from router.admission import CLIENT_KEY
from router.dispatcher import EngineRequestError
from router.errors import APIError, bad_request, install_error_handlers, unexpected_error
from router.http_options import MAX_NAMING_REQUEST_ID_CHARS, printable_id
from router.lora_admin import install_lora_admin_routes
from router.openai_models import ChatCompletionRequest, CompletionRequest, check_unicode
from router.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from router.openapi import error_responses, generation_route, install_openapi
from router.responses_api import (
    DeletedResponse,
    ItemList,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from router.serving import (
    SERVER_SEND,
    ClientDisconnected,
    DisconnectWaiter,
    EventStreamResponse,
    engine_api_error,
    wait_for_disconnect,
)
from router.serving_chat import create_chat_completion
from router.serving_completions import create_completion
from router.serving_conversations import (
    ConversationObject,
    DeletedConversation,
    create_conversation,
    create_items,
    delete_conversation,
    delete_item,
    list_items,
    retrieve_conversation,
    retrieve_item,
    update_conversation,
)
from router.serving_embeddings import EmbeddingResponse, create_embedding
from router.serving_responses import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
    stream_response,
)
from router.serving_scores import (
    ClassificationResponse,
    RerankResponse,
    ScoreResponse,
    create_classification,
    create_rerank,
    create_score,
)
from router.serving_tokenize import install_tokenize_routes
from router.state import RouterState

Handler = Callable[[RouterState, Any, "str | None", DisconnectWaiter], Awaitable[Response]]


def _adapter_card(state: RouterState, name: str, created: int) -> ModelCard:
    """A LoRA adapter's card: its folder (as ``--lora-modules`` gives it; an adapter the instances serve
    without the router's flag, its name) and the base model it adapts, as vLLM shows them."""
    module = next((m for m in state.config.lora_modules if m.name == name), None)
    return ModelCard(id=name, created=created, max_model_len=state.max_model_len(), root=module.path if module else name,
                     parent=(module and module.base_model_name) or state.config.served_model_names[0])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def refuse_item_include(request: Request) -> None:
    """A 400 naming ``include`` where a request for items asks for more of them than what is stored (OpenAI's
    ``include`` values: log-probabilities, encrypted thinking, built-in tools' outputs): none is kept here."""
    for name in ("include", "include[]"):
        for value in request.query_params.getlist(name):
            raise bad_request(f"include: {value!r} is not served here (items are given as they are stored)",
                              param="include")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, read with a size limit (413) and parsed strictly (400)."""
    too_large = APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"invalid JSON body: {exc}", code="invalid_json") from None
    check_unicode(raw, body)
    return body


Endpoint = Callable[[Request], Awaitable[Response]]


class RouterApp(FastAPI):
    """The router's FastAPI app, which keeps the server's ``send`` in each HTTP scope before its
    middleware wraps it (``SERVER_SEND``): a streaming response sends its events straight to it.

    The generation endpoints (``direct_routes``: a POST path and its endpoint) are served below the
    framework: their endpoints read the body, check the key and answer every error themselves, and
    what FastAPI's routing and its middleware chain would add (ten nested calls, telemetry, query
    parameters parsed, dependencies solved) was about a fifth of the router's time per request. The
    same endpoints stay declared as FastAPI routes (for ``/openapi.json``), and any other method or
    path, a trailing slash included, goes through FastAPI as before. Errors there are answered as
    the app's handlers would. Every error response, on either path, is counted by ``count_error``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct_routes: dict[str, Endpoint] = {}
        self.count_error: Callable[[int], None] = lambda status: None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        scope[SERVER_SEND] = send
        # Behind ``--root-path`` the server puts the prefix before each path (as the ASGI spec has it); routes
        # match what follows it, as Starlette's routing matches them.
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        endpoint = self.direct_routes.get(path) if scope["method"] == "POST" else None
        if endpoint is not None:
            await self._serve_direct(endpoint, scope, receive, send)
            return
        count_error = self.count_error

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                count_error(message["status"])
            await send(message)

        # Counted here, outside the framework's middleware, a crash's 500 is counted too.
        await super().__call__(scope, receive, counting_send)

    async def _serve_direct(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self
        try:
            response = await endpoint(Request(scope, receive))
        except APIError as exc:
            response = exc.response()
        except Exception as exc:  # what ServerErrorMiddleware and the app's handlers would answer
            response = unexpected_error(exc)
        if response.status_code >= 400:
            self.count_error(response.status_code)
        await response(scope, receive, send)


def create_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    # /openapi.json only: the docs pages would load their scripts from a CDN.
    app = RouterApp(
        title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json"
    )
    app.state.router_state = state
    install_error_handlers(app)
    install_openapi(app)
    install_tokenize_routes(app, state)  # /tokenize, /detokenize, /version
    if state.config.allow_runtime_lora_updating:
        install_lora_admin_routes(app, state)  # /v1/load_lora_adapter, /v1/unload_lora_adapter

    def count_error(status: int) -> None:
        state.metrics.http_errors.labels(status=str(status)).inc()

    app.count_error = count_error

    async def generate(request: Request, handler: Handler, generates: bool = True, named: bool = True) -> Response:
        """``handler``'s answer to the request's JSON body. ``named``: the body takes vLLM's ``request_id``, which a
        client's ``X-Request-Id`` header overrides, as vLLM's server lets it (printable, 128 characters at most;
        another is left out)."""
        cache_salt = state.api_keys.check(request.headers.get("authorization"))
        headless = state.config.headless_architecture
        if generates and headless is not None:
            raise APIError(400, f"the model's checkpoint ({headless}) has no language-model output head: it "
                           "serves /v1/embeddings, /classify, /score and /rerank only", param="model",
                           code="model_not_supported")
        # Fair admission shares the engines per API key, else per client address.
        CLIENT_KEY.set(cache_salt or (request.client.host if request.client else "-"))
        state.admit()
        leave_now = True
        try:
            body = await read_json(request, state.config.max_body_bytes)
            header_id = printable_id(request.headers.get("x-request-id", "").encode("latin-1"), MAX_NAMING_REQUEST_ID_CHARS)
            if named and header_id is not None and isinstance(body, dict):
                body["request_id"] = header_id
            response = await handler(state, body, cache_salt, lambda: wait_for_disconnect(request.receive))
            if isinstance(response, EventStreamResponse):
                response.on_close = state.leave
                leave_now = False
            return response
        except EngineRequestError as exc:
            raise engine_api_error(exc) from None
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            if leave_now:
                state.leave()

    # Streamed completions are made of CompletionResponse objects, as OpenAI's are.
    @app.post(
        "/v1/completions", **generation_route(CompletionRequest, CompletionResponse, CompletionResponse)
    )
    async def completions(request: Request) -> Response:
        return await generate(request, create_completion)

    @app.post(
        "/v1/chat/completions",
        **generation_route(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(request, create_chat_completion)

    @app.post("/v1/responses", **generation_route(ResponsesRequest, ResponseObject, ResponseStreamEvent))
    async def responses(request: Request) -> Response:
        return await generate(request, create_response, named=False)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=error_responses())
    async def embeddings(request: Request) -> Response:
        return await generate(request, create_embedding, generates=False)

    # vLLM's pooling endpoints beside it: a sequence classifier's labels, pairs' scores, documents ranked.
    @app.post("/classify", response_model=ClassificationResponse, responses=error_responses())
    @app.post("/v1/classify", response_model=ClassificationResponse, responses=error_responses())
    async def classify(request: Request) -> Response:
        return await generate(request, create_classification, generates=False)

    @app.post("/score", response_model=ScoreResponse, responses=error_responses())
    @app.post("/v1/score", response_model=ScoreResponse, responses=error_responses())
    async def score(request: Request) -> Response:
        return await generate(request, create_score, generates=False)

    @app.post("/rerank", response_model=RerankResponse, responses=error_responses())
    @app.post("/v1/rerank", response_model=RerankResponse, responses=error_responses())
    @app.post("/v2/rerank", response_model=RerankResponse, responses=error_responses())
    async def rerank(request: Request) -> Response:
        return await generate(request, create_rerank, generates=False)

    app.direct_routes = {
        "/v1/completions": completions, "/v1/chat/completions": chat_completions, "/v1/responses": responses,
    }

    @app.get("/v1/models", response_model=ModelList, responses={401: error_responses()[401]})
    async def models(request: Request) -> JSONResponse:
        state.api_keys.check(request.headers.get("authorization"))
        created = int(time.time())
        base = state.config.served_model_names
        cards = [
            *(ModelCard(id=name, created=created, max_model_len=state.max_model_len(), root=name) for name in base),
            *(_adapter_card(state, name, created) for name in state.lora_names()),
        ]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={
        401: error_responses()[401], 404: error_responses()[404]})
    async def model_card(request: Request, model: str) -> JSONResponse:
        """One served model (the SDK's ``models.retrieve``); 404 for any other."""
        state.api_keys.check(request.headers.get("authorization"))
        name = state.check_model(model)
        created = int(time.time())
        card = (_adapter_card(state, name, created) if state.lora_name(name) is not None
                else ModelCard(id=name, created=created, max_model_len=state.max_model_len(), root=name))
        return JSONResponse(card.model_dump(mode="json"))

    # Stored responses (``router/response_store.py``): each readable by the API key that made it.
    errors = error_responses()
    not_found: dict[int | str, dict[str, Any]] = {status: errors[status] for status in (401, 404, 503)}

    def owner(request: Request) -> str:
        """The caller's API-key salt ("" with keys off): whose stored responses it may see."""
        return state.api_keys.check(request.headers.get("authorization")) or ""

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses={**not_found, 400: errors[400]})
    async def stored_response(
        request: Request, response_id: str, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        """The stored response; with ``stream``, a streaming background response's events again, those
        after ``starting_after`` (a sequence number), then the rest as they come."""
        if stream:
            return await stream_response(state, owner(request), response_id, starting_after,
                                         lambda: wait_for_disconnect(request.receive))
        return JSONResponse(await retrieve_response(state, owner(request), response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=not_found)
    async def remove_response(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse(await delete_response(state, owner(request), response_id))

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject,
              responses={**not_found, 400: errors[400]})
    async def cancel_background_response(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse(await cancel_response(state, owner(request), response_id))

    @app.get("/v1/responses/{response_id}/input_items", response_model=ItemList,
             responses={**not_found, 400: errors[400]})
    async def response_input_items(
        request: Request, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> JSONResponse:
        refuse_item_include(request)
        return JSONResponse(await list_input_items(state, owner(request), response_id, limit, order, after))

    # Conversations (``router/serving_conversations.py``): each the API key's that made it, as stored responses are.
    @app.post("/v1/conversations", response_model=ConversationObject, responses={**not_found, 400: errors[400]})
    async def new_conversation(request: Request) -> JSONResponse:
        body = await read_json(request, state.config.max_body_bytes)
        return JSONResponse(await create_conversation(state, owner(request), body))

    @app.get("/v1/conversations/{conversation_id}", response_model=ConversationObject, responses=not_found)
    async def conversation(request: Request, conversation_id: str) -> JSONResponse:
        return JSONResponse(await retrieve_conversation(state, owner(request), conversation_id))

    @app.post("/v1/conversations/{conversation_id}", response_model=ConversationObject,
              responses={**not_found, 400: errors[400]})
    async def change_conversation(request: Request, conversation_id: str) -> JSONResponse:
        body = await read_json(request, state.config.max_body_bytes)
        return JSONResponse(await update_conversation(state, owner(request), conversation_id, body))

    @app.delete("/v1/conversations/{conversation_id}", response_model=DeletedConversation, responses=not_found)
    async def remove_conversation(request: Request, conversation_id: str) -> JSONResponse:
        return JSONResponse(await delete_conversation(state, owner(request), conversation_id))

    @app.post("/v1/conversations/{conversation_id}/items", response_model=ItemList,
              responses={**not_found, 400: errors[400]})
    async def add_conversation_items(request: Request, conversation_id: str) -> JSONResponse:
        refuse_item_include(request)
        body = await read_json(request, state.config.max_body_bytes)
        return JSONResponse(await create_items(state, owner(request), conversation_id, body))

    @app.get("/v1/conversations/{conversation_id}/items", response_model=ItemList,
             responses={**not_found, 400: errors[400]})
    async def conversation_items(
        request: Request, conversation_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> JSONResponse:
        refuse_item_include(request)
        return JSONResponse(await list_items(state, owner(request), conversation_id, limit, order, after))

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses={**not_found, 400: errors[400]})
    async def conversation_item(request: Request, conversation_id: str, item_id: str) -> JSONResponse:
        refuse_item_include(request)
        return JSONResponse(await retrieve_item(state, owner(request), conversation_id, item_id))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", response_model=ConversationObject,
                responses=not_found)
    async def remove_conversation_item(request: Request, conversation_id: str, item_id: str) -> JSONResponse:
        return JSONResponse(await delete_item(state, owner(request), conversation_id, item_id))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        pool = state.pool
        body = {
            "status": "ready" if pool.ready() else "not ready",
            "prefill": len(pool.alive("prefill")),
            "decode": len(pool.alive("decode")),
            "registry": "disabled" if state.registry is None else "ok" if pool.registry_ok else "unreachable",
        }
        return JSONResponse(body, status_code=200 if pool.ready() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for role in ("prefill", "decode"):
            state.metrics.instances.labels(role=role).set(state.pool.num_instances(role))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
