"""POST /v1/embeddings, as OpenAI's (and vLLM's, for its extras) answer it.

Each input (a text, a list of texts, token ids or lists of them) is one engine request that runs the
prompt's forward only and returns the last token's final hidden state (``GenerateRequest.pooling``); the
router turns it into the embedding the model's sentence-transformers config asks for (``router.pooling``).
Inputs go through fair admission as completions' prompts do, and run on prefill instances (prefix-aware)
where there are any, else on decode instances. An instance lost mid-request costs a retry elsewhere, as a
generation's would; a client that leaves aborts what is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from common.protocol import GenerateRequest
from common.sampling_params import SamplingParams
from router.admission import CLIENT_KEY
from router.auth import with_request_salt
from router.config import RequestLimits
from router.dispatcher import EngineRequest, EngineRequestError
from router.errors import bad_request
from router.openai_models import (
    ChatMessage,
    ChatTemplateOptions,
    CheckedRequest,
    PromptInput,
    parse_request,
    template_messages,
)
from router.pooling import encode_embedding
from router.serving import ClientDisconnected, DisconnectWaiter, response_ids
from router.state import RouterState

# Writing a response hands the event loop back after this many embeddings, or this long, whichever first.
YIELD_EVERY = 8
YIELD_AFTER_S = 0.001
# The one token a pooling request's forward samples, and drops (``common.engine.engine``).
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class EmbeddingRequest(CheckedRequest, ChatTemplateOptions):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: PromptInput | None = None
    # vLLM's chat form: one conversation rendered by the model's chat template, embedded as one input.
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = False  # vLLM's default for an embedding's conversation
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras: the tokenizer's BOS and the like around a text (default: yes for ``input``, no on top of
    # the chat template's for ``messages``); keep only a prompt's last k tokens.
    add_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31)
    # vLLM's: normalize or not, whatever the model's pooling says (``use_activation``, before it ``normalize``).
    use_activation: StrictBool | None = None
    normalize: StrictBool | None = None
    # vLLM's: the response's id is "embd-<request_id>"; a salt of the request's own for its prefix-cache blocks.
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's extras not implemented: refused unless they ask for what is done anyway.
    priority: Any = None
    embed_dtype: Any = None
    endianness: Any = None
    mm_processor_kwargs: Any = None

    def num_inputs(self) -> int:
        if self.input is None or isinstance(self.input, str) or not self.input or isinstance(self.input[0], int):
            return 1
        return len(self.input)

    def check(self, limits: RequestLimits) -> None:
        if (self.input is None) == (self.messages is None):
            raise bad_request("give exactly one of 'input' and 'messages'", param="input")
        self.check_template_options(self.messages)
        self.refuse_unless_nothing({"priority": 0, "embed_dtype": "float32", "mm_processor_kwargs": None},
                                   "embeddings run text only, at priority 0, as float32")
        if self.endianness not in (None, "native", "little"):
            raise bad_request("endianness is not supported (base64 embeddings are little-endian)", param="endianness")
        if None not in (self.use_activation, self.normalize) and self.use_activation != self.normalize:
            raise bad_request("use_activation and normalize disagree", param="normalize")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", param="input")
        if self.num_inputs() > limits.max_prompts_per_request:
            raise bad_request(f"input holds at most {limits.max_prompts_per_request} inputs "
                              f"(--max-prompts-per-request), got {self.num_inputs()}", param="input")
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or positive", param="truncate_prompt_tokens")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


async def create_embedding(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> Response:
    request = parse_request(EmbeddingRequest, body, state.config.limits)
    model = state.check_model(request.model)
    pooling = state.config.pooling
    pooling.check(request.dimensions)
    state.admission.check(CLIENT_KEY.get() or "-", request.num_inputs())
    max_model_len = state.max_model_len()
    truncate = request.truncate_prompt_tokens
    context = None if truncate is not None else max_model_len
    if request.messages is not None:
        prompts = [await state.prompts.tokenize_chat(
            template_messages(request.messages), context, request.chat_render(), bool(request.add_special_tokens))]
    else:
        assert request.input is not None
        prompts = await state.prompts.tokenize_completion(
            request.input, context, request.add_special_tokens is not False, field="input")
    if truncate is not None:
        keep = max_model_len - 1 if truncate == -1 else truncate
        prompts = [prompt[-keep:] for prompt in prompts]
    for i, prompt in enumerate(prompts):
        if len(prompt) >= max_model_len:  # the engines sample (and drop) one token after it
            param = "messages" if request.messages is not None else "input" if len(prompts) == 1 else f"input.{i}"
            raise bad_request(f"{param} has {len(prompt)} tokens; the model's context ({max_model_len}) holds at most "
                              f"{max_model_len - 1} for an embedding", param=param)
    response_id, engine_id = response_ids("embd", request.request_id)
    salt = with_request_salt(cache_salt, request.cache_salt)
    work = asyncio.ensure_future(_pool_all(state, engine_id, prompts, salt, state.lora_name(request.model)))
    gone = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise ClientDisconnected()
    num_tokens = sum(len(prompt) for prompt in prompts)
    normalize = request.normalize if request.use_activation is None else request.use_activation
    head = {"id": response_id, "object": "list", "created": int(time.time()), "model": model}
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens).model_dump()
    body = await response_body(head, work.result(), usage, lambda hidden: encode_embedding(
        pooling.embed(hidden, request.dimensions, normalize), request.encoding_format))
    return Response(body, media_type="application/json")


async def response_body(head: dict[str, Any], hidden_states: list[bytes], usage: dict[str, Any],
                        encode: Callable[[bytes], list[float] | str]) -> bytes:
    """The ``EmbeddingResponse`` JSON, written an embedding at a time, handing the event loop back between
    them: floats are slow to write (64 embeddings of 4,096 took 161 ms in one piece on this host), and the
    loop meanwhile streams every other request's tokens."""
    parts = [json.dumps(head)[:-1].encode(), b', "data": [']
    last_yield = time.perf_counter()
    for i, hidden in enumerate(hidden_states):
        if i:
            parts.append(b", ")
        parts.append(json.dumps({"object": "embedding", "embedding": encode(hidden), "index": i}).encode())
        if i % YIELD_EVERY == YIELD_EVERY - 1 or time.perf_counter() - last_yield > YIELD_AFTER_S:
            await asyncio.sleep(0)
            last_yield = time.perf_counter()
    parts.append(b'], "usage": ' + json.dumps(usage).encode() + b"}")
    return b"".join(parts)


async def _pool_all(state: RouterState, engine_id: str, prompts: list[list[int]], cache_salt: str | None,
                    lora_name: str | None) -> list[bytes]:
    """Every prompt's pooled hidden state, in order: each sent when admission lets it, all running at once."""
    lane = state.admission.enter(CLIENT_KEY.get() or "-", [len(prompt) for prompt in prompts])
    running: list[asyncio.Future[bytes]] = []
    try:
        for i, prompt in enumerate(prompts):
            slot = await lane.next_slot()
            request = GenerateRequest(
                request_id=f"{engine_id}-{i}", prompt_token_ids=prompt, sampling_params=POOLING_PARAMS,
                reply_to=state.dispatcher.client.reply_address, cache_salt=cache_salt, arrival_time=time.time(),
                lora_name=lora_name, pooling="last",
            )
            try:
                [engine_request] = await state.dispatcher.submit_request(request)
            except BaseException:
                slot.release()
                raise
            state.metrics.prompt_tokens.inc(len(prompt))
            state.metrics.request_prompt_tokens.observe(len(prompt))
            running.append(asyncio.ensure_future(_pooled(state, engine_request, slot.release)))
        return list(await asyncio.gather(*running))
    finally:
        lane.close()
        for task in running:
            task.cancel()  # after a failure, the others' engine work is aborted (a no-op for those done)


async def _pooled(state: RouterState, engine_request: EngineRequest, release: Any) -> bytes:
    """One input's pooled hidden state, counted as a generation's end is (latency, success, cached tokens)."""
    sent = time.monotonic()
    try:
        async for output in engine_request.outputs():
            if output.embedding is not None:
                metrics = state.metrics
                metrics.e2e_latency.observe(time.monotonic() - sent)
                metrics.request_success.labels(finished_reason="stop").inc()
                metrics.cached_prompt_tokens.inc(output.num_cached_tokens)
                return output.embedding
        raise EngineRequestError(f"engine {engine_request.holders[-1].instance_id} finished an embedding without it")
    finally:
        engine_request.close()
        release()
