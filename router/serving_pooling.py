"""What the pooling endpoints share (``/v1/embeddings``, ``/classify``, ``/score``, ``/rerank``).

A pooling request's every input is one engine request that runs the prompt's forward only and returns,
instead of a token, the last token's final hidden state (``GenerateRequest.pooling`` "last"), a sequence
classifier's logits of it ("classify"), or the mean, max or first of every position's ("mean", "max", "cls",
as the model's sentence-transformers config asks). Inputs go through fair admission as completions' prompts do and
run on prefill instances (prefix-aware) where there are any, else on decode instances. An instance lost
mid-request costs a retry elsewhere, as a generation's would; a client that leaves aborts what still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from pydantic import ConfigDict, Field, StrictBool, StrictStr

from common.protocol import GenerateRequest, PoolingKind
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
    template_messages,
)
from router.serving import ClientDisconnected, DisconnectWaiter
from router.state import RouterState

# The one token a pooling request's forward samples, and drops (``common.engine.engine``).
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
# Pooling runs text only, for every model (an image-text model's images reach generation alone).
POOLING_NO_IMAGES = "image parts are not supported here: pooling takes text only"


class PoolingRequest(CheckedRequest):
    """The fields every pooling endpoint's request has: the model, vLLM's truncation, id and salt extras,
    and those it refuses unless they ask for what is done (each subclass's ``check``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    user: str | None = None
    # vLLM's: keep only a prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31)
    # vLLM's: the response's id is "<prefix>-<request_id>"; a salt of the request's own for its prefix-cache blocks.
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's extras not implemented: refused unless they ask for what is done anyway.
    priority: Any = None
    mm_processor_kwargs: Any = None


class PoolingInputRequest(PoolingRequest, ChatTemplateOptions):
    """The inputs of ``/v1/embeddings`` and ``/classify``: texts or token ids (``input``), or vLLM's chat
    form (``messages``, one conversation rendered by the model's chat template), and vLLM's extras on them."""

    input: PromptInput | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = False  # vLLM's default for a pooled conversation
    # vLLM's: the tokenizer's BOS and the like around a text (default: yes for ``input``, no on top of the
    # chat template's for ``messages``).
    add_special_tokens: StrictBool | None = None

    def num_inputs(self) -> int:
        if self.input is None or isinstance(self.input, str) or not self.input or isinstance(self.input[0], int):
            return 1
        return len(self.input)

    def check(self, limits: RequestLimits) -> None:
        if (self.input is None) == (self.messages is None):
            raise bad_request("give exactly one of 'input' and 'messages'", param="input")
        self.check_template_options(self.messages)
        self.refuse_unless_nothing({"priority": 0, "mm_processor_kwargs": None}, "pooling runs text only, at priority 0")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", param="input")
        check_num_inputs(self.num_inputs(), limits, "input")
        check_truncation(self.truncate_prompt_tokens)

    async def prompts(self, state: RouterState) -> list[list[int]]:
        """Each input's token ids, truncated as asked, every one short enough to pool."""
        context = None if self.truncate_prompt_tokens is not None else state.max_model_len()
        if self.messages is not None:
            messages = template_messages(self.messages, None, POOLING_NO_IMAGES)
            prompts = [await state.prompts.tokenize_chat(messages, context, self.chat_render(),
                                                         bool(self.add_special_tokens))]
        else:
            assert self.input is not None
            prompts = await state.prompts.tokenize_completion(
                self.input, context, self.add_special_tokens is not False, field="input")
        params = ["messages"] if self.messages is not None else ["input"] if len(prompts) == 1 else None
        return fit_prompts(state, prompts, self.truncate_prompt_tokens, params or "input")


def check_num_inputs(count: int, limits: RequestLimits, param: str) -> None:
    if count > limits.max_prompts_per_request:
        raise bad_request(f"{param} holds at most {limits.max_prompts_per_request} inputs "
                          f"(--max-prompts-per-request), got {count}", param=param)


def check_truncation(truncate_prompt_tokens: int | None) -> None:
    if truncate_prompt_tokens == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or positive", param="truncate_prompt_tokens")


def fit_prompts(state: RouterState, prompts: list[list[int]], truncate: int | None,
                params: list[str] | str) -> list[list[int]]:
    """``prompts`` cut to their last ``truncate`` tokens (vLLM's ``truncate_prompt_tokens``; -1: as many as
    the context holds), then a 400 naming the first still too long to pool (``params``: each prompt's name
    in errors, or one name whose ``.i`` names the i-th)."""
    max_model_len = state.max_model_len()
    if truncate is not None:
        keep = max_model_len - 1 if truncate == -1 else truncate
        prompts = [prompt[-keep:] for prompt in prompts]
    for i, prompt in enumerate(prompts):
        if len(prompt) >= max_model_len:  # the engines sample (and drop) one token after it
            param = params[i] if isinstance(params, list) else f"{params}.{i}"
            raise bad_request(f"{param} has {len(prompt)} tokens; the model's context ({max_model_len}) holds at most "
                              f"{max_model_len - 1} for a pooling request", param=param)
    return prompts


async def pool(state: RouterState, engine_id: str, prompts: list[list[int]], pooling: PoolingKind,
               cache_salt: str | None, request_cache_salt: str | None, model: str | None,
               wait_disconnect: DisconnectWaiter) -> list[bytes]:
    """Every prompt's pooled output (float32 bytes), in order; ``ClientDisconnected`` (the engines' work
    aborted) if the client leaves first."""
    salt = with_request_salt(cache_salt, request_cache_salt)
    work = asyncio.ensure_future(_pool_all(state, engine_id, prompts, salt, state.lora_name(model), pooling))
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
    return work.result()


async def _pool_all(state: RouterState, engine_id: str, prompts: list[list[int]], cache_salt: str | None,
                    lora_name: str | None, pooling: PoolingKind) -> list[bytes]:
    """Every prompt's pooled output, in order: each sent when admission lets it, all running at once."""
    lane = state.admission.enter(CLIENT_KEY.get() or "-", [len(prompt) for prompt in prompts])
    running: list[asyncio.Future[bytes]] = []
    try:
        for i, prompt in enumerate(prompts):
            slot = await lane.next_slot()
            request = GenerateRequest(
                request_id=f"{engine_id}-{i}", prompt_token_ids=prompt, sampling_params=POOLING_PARAMS,
                reply_to=state.dispatcher.client.reply_address, cache_salt=cache_salt, arrival_time=time.time(),
                lora_name=lora_name, pooling=pooling,
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
    """One input's pooled output, counted as a generation's end is (latency, success, cached tokens)."""
    sent = time.monotonic()
    try:
        async for output in engine_request.outputs():
            if output.embedding is not None:
                metrics = state.metrics
                metrics.e2e_latency.observe(time.monotonic() - sent)
                metrics.request_success.labels(finished_reason="stop").inc()
                metrics.cached_prompt_tokens.inc(output.num_cached_tokens)
                return output.embedding
        raise EngineRequestError(f"engine {engine_request.holders[-1].instance_id} finished a pooling request "
                                 "without its output")
    finally:
        engine_request.close()
        release()
