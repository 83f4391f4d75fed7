"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse, Response

from common.sampling_params import SamplingParams
from router.admission import CLIENT_KEY
from router.choice_stream import ChoiceDelta
from router.logprobs import TokenRenderer, completion_logprobs
from router.openai_models import CompletionRequest, check_max_tokens, check_total_tokens, parse_request
from router.openai_responses import CompletionChoice, CompletionResponse
from router.serving import (
    DisconnectWaiter,
    GenerationPlan,
    UsageTracker,
    collect,
    new_request_id,
    sse_response,
)
from router.state import RouterState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
BIG_PROMPT_LIST = 256


async def plan_completion(
    state: RouterState, body: Any, cache_salt: str | None
) -> tuple[CompletionRequest, GenerationPlan]:
    limits = state.config.limits
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > BIG_PROMPT_LIST:
        # Checking a long prompt list takes seconds of CPU: off the event loop, which serves others.
        request = await asyncio.to_thread(parse_request, CompletionRequest, body, limits)
    else:
        request = parse_request(CompletionRequest, body, limits)
    model = state.check_model(request.model)
    # A request the fair queue could not take now is refused before any tokenizing.
    state.admission.check(CLIENT_KEY.get() or "-", _num_prompts(request.prompt))  # one engine request per prompt
    max_model_len = state.max_model_len()
    prompts = await state.prompts.tokenize_completion(request.prompt, max_model_len)
    params = []
    by_max_tokens: dict[int, SamplingParams] = {}  # frozen: prompts with one max_tokens share them
    for prompt_ids in prompts:
        max_tokens = check_max_tokens(
            request.max_tokens, len(prompt_ids), max_model_len, DEFAULT_MAX_TOKENS, "prompt"
        )
        if max_tokens not in by_max_tokens:
            by_max_tokens[max_tokens] = request.sampling_params(
                max_tokens, request.logprobs, state.prompts.eos_token_id, state.prompts.vocab_size
            )
        params.append(by_max_tokens[max_tokens])
    check_total_tokens(request.n, [p.max_tokens for p in params], limits)
    plan = GenerationPlan(
        request_id=new_request_id("cmpl"),
        model=model,
        prompts=prompts,
        params=params,
        stop=request.stop_strings(),
        cache_salt=cache_salt,
    )
    return request, plan


def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _logprobs(renderer: TokenRenderer | None, delta_or_result: Any) -> Any:
    if renderer is None:
        return None
    return completion_logprobs(renderer, delta_or_result.logprobs, delta_or_result.text_offsets)


async def create_completion(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> Response:
    request, plan = await plan_completion(state, body, cache_salt)
    renderer = TokenRenderer(state.prompts.tokenizer) if request.logprobs is not None else None
    if request.stream:
        return await sse_response(
            state, plan, wait_disconnect, request.stream_options,
            lambda deltas, include_usage: _stream(plan, deltas, renderer, include_usage),
        )
    results, usage = await collect(state, plan, wait_disconnect)
    response = CompletionResponse(
        id=plan.request_id,
        created=plan.created,
        model=plan.model,
        choices=[
            CompletionChoice(
                index=r.index,
                text=r.text,
                logprobs=_logprobs(renderer, r),
                finish_reason=r.finish_reason,  # type: ignore[arg-type]
            )
            for r in results
        ],
        usage=usage,
    )
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(
    plan: GenerationPlan,
    deltas: AsyncGenerator[ChoiceDelta, None],
    renderer: TokenRenderer | None,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    usage = UsageTracker(plan)
    exclude = None if include_usage else {"usage"}
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            usage.update(delta)
            if not delta.text and not delta.logprobs and delta.finish_reason is None:
                continue
            chunk = CompletionResponse(
                id=plan.request_id,
                created=plan.created,
                model=plan.model,
                choices=[
                    CompletionChoice(
                        index=delta.index,
                        text=delta.text,
                        logprobs=_logprobs(renderer, delta),
                        finish_reason=delta.finish_reason,  # type: ignore[arg-type]
                    )
                ],
            )
            yield chunk.model_dump_json(exclude=exclude)
    if include_usage:
        final = CompletionResponse(
            id=plan.request_id, created=plan.created, model=plan.model, choices=[], usage=usage.usage()
        )
        yield final.model_dump_json()
