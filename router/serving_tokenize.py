"""POST /tokenize, POST /detokenize and GET /version, shaped as vLLM's, so its users' tools carry over.

``/tokenize`` takes a completions ``prompt`` (text) or chat ``messages`` (rendered by the model's
chat template) and answers the token ids, their count and the context window; it never refuses a
text for being longer than the window, since finding that out is what it is for. ``/detokenize``
turns token ids back into text. Both need the API key, as the generation endpoints do.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from router.config import RequestLimits
from router.errors import bad_request
from router.images import ImageRef, ProcessedImage, check_image_count
from router.openai_models import (
    ChatMessage,
    ChatTemplateOptions,
    CheckedRequest,
    parse_request,
    template_messages,
)
from router.openapi import error_responses
from router.state import RouterState
from router.tools import ToolPlan, require_rendered


class _UtilityRequest(CheckedRequest):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None


class TokenizeRequest(_UtilityRequest, ChatTemplateOptions):
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    return_token_strs: StrictBool = False
    tools: list[Any] | None = None  # rendered with messages, as a chat completion renders them
    mm_processor_kwargs: Any = None  # the image processor's settings for the messages' images, as a chat completion's

    def check(self, limits: RequestLimits) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        if self.mm_processor_kwargs is not None and self.messages is None:
            raise bad_request("mm_processor_kwargs go with messages (their images)", param="mm_processor_kwargs")
        self.check_template_options(self.messages)
        if self.tools and self.messages is None:
            raise bad_request("tools go with messages", param="tools")


class DetokenizeRequest(_UtilityRequest):
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


async def tokenize(state: RouterState, body: Any) -> TokenizeResponse:
    request = parse_request(TokenizeRequest, body, state.config.limits)
    state.check_model(request.model)
    prompts = state.prompts
    if request.messages is not None:
        tools = ToolPlan.from_request(request.tools, "none", None)  # counted, not called: no parser needed
        if tools is not None:
            require_rendered(prompts)
        model_images = state.config.images
        image_options = model_images.options(request.mm_processor_kwargs)
        image_refs: list[ImageRef] | None = [] if model_images.processor is not None else None
        messages = template_messages(request.messages, image_refs, model_images.refusal)
        check_image_count(image_refs or [], state.config.limits.max_images_per_prompt)
        render = request.chat_render(tools.tools if tools is not None else None)
        processed: list[ProcessedImage] = []
        if image_refs and model_images.processor is not None:
            processed = await model_images.processor.load_off_loop(image_refs, image_options)
            render = model_images.processor.chat_render(render, processed)
        token_ids = await prompts.tokenize_for_count(
            None, messages, add_special_tokens=bool(request.add_special_tokens), render=render,
        )
        if image_refs and model_images.processor is not None:  # the ids the engines would take, as vLLM's
            token_ids, _ = model_images.processor.expand(token_ids, processed)
    else:
        add_special = request.add_special_tokens is None or request.add_special_tokens
        token_ids = await prompts.tokenize_for_count(request.prompt, None, add_special_tokens=add_special)
    token_strs = prompts.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(token_ids), max_model_len=state.max_model_len(), tokens=token_ids, token_strs=token_strs
    )


async def detokenize(state: RouterState, body: Any) -> DetokenizeResponse:
    request = parse_request(DetokenizeRequest, body, state.config.limits)
    state.check_model(request.model)
    return DetokenizeResponse(prompt=await state.prompts.detokenize(request.tokens, param="tokens"))


def install_tokenize_routes(app: FastAPI, state: RouterState) -> None:
    """Adds ``/tokenize``, ``/detokenize`` and ``/version`` to ``app``."""
    from router.app import read_json  # here: router.app imports this module to call this function

    errors = error_responses()
    client_errors: dict[int | str, dict[str, Any]] = {s: errors[s] for s in (400, 401, 404, 413)}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=client_errors)
    async def tokenize_route(request: Request) -> JSONResponse:
        state.api_keys.check(request.headers.get("authorization"))
        body = await read_json(request, state.config.max_body_bytes)
        return JSONResponse((await tokenize(state, body)).model_dump(mode="json"))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=client_errors)
    async def detokenize_route(request: Request) -> JSONResponse:
        state.api_keys.check(request.headers.get("authorization"))
        body = await read_json(request, state.config.max_body_bytes)
        return JSONResponse((await detokenize(state, body)).model_dump(mode="json"))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> JSONResponse:
        return JSONResponse(VersionResponse(version=pdserve_version()).model_dump())
