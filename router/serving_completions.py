"""POST /v1/completions."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response

from common.sampling_params import SamplingParams
from router.admission import CLIENT_KEY
from router.auth import with_request_salt
from router.choice_stream import ChoiceDelta, ChoiceStream
from router.logprobs import TokenRenderer, completion_logprobs, echo_logprobs, prompt_logprobs
from router.openai_models import (
    CompletionRequest,
    check_max_tokens,
    check_prompt_logprobs,
    check_total_tokens,
    parse_request,
)
from router.openai_responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from router.serving import (
    ChoiceResult,
    DisconnectWaiter,
    GenerationPlan,
    UsageTracker,
    chunk_head,
    collect,
    response_ids,
    sse_response,
)
from router.state import RouterState
from router.structured_output import check_grammar

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
    structured = request.structured_output()
    if structured is not None:
        await check_grammar(*structured, state.prompts.is_token)
    # A request the fair queue could not take now is refused before any tokenizing.
    state.admission.check(CLIENT_KEY.get() or "-", _num_prompts(request.prompt))  # one engine request per prompt
    max_model_len = state.max_model_len()
    prompts = await state.prompts.tokenize_completion(
        request.prompt, request.context_check(max_model_len), request.add_special_tokens
    )
    prompts = [request.truncated(prompt_ids, max_model_len) for prompt_ids in prompts]
    params = []
    by_max_tokens: dict[int, SamplingParams] = {}  # frozen: prompts with one max_tokens share them
    state.prompts.check_special_token_spacing(request.spaces_between_special_tokens)
    bad_words = state.prompts.bad_word_sequences(request.bad_words)
    for prompt_ids in prompts:
        max_tokens = check_max_tokens(
            request.max_tokens, len(prompt_ids), max_model_len, DEFAULT_MAX_TOKENS, "prompt"
        )
        if max_tokens not in by_max_tokens:
            by_max_tokens[max_tokens] = request.sampling_params(
                max_tokens, request.logprobs, state.prompts.eos_token_ids, state.prompts.vocab_size, bad_words,
                state.config.sampling_defaults,
            )
        params.append(by_max_tokens[max_tokens])
    check_total_tokens(request.n, [p.max_tokens for p in params], limits)
    if params and params[0].prompt_logprobs is not None:
        for prompt_ids, prompt_params in zip(prompts, params, strict=True):
            check_prompt_logprobs(prompt_params, len(prompt_ids))
    response_id, engine_id = response_ids("cmpl", request.request_id)
    plan = GenerationPlan(
        request_id=response_id,
        engine_request_id=engine_id,
        model=model,
        prompts=prompts,
        params=params,
        text=request.text_options(params[0]),
        cache_salt=with_request_salt(cache_salt, request.cache_salt),
        lora_name=state.lora_name(model),
        beam_search=request.beam_search(),
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
    renderer = (
        TokenRenderer(state.prompts.tokenizer, request.return_tokens_as_token_ids)
        if request.logprobs is not None else None
    )
    echo = _prompt_texts(state, request, plan) if request.echo else None
    if request.stream:
        return await sse_response(
            state, plan, wait_disconnect, request.stream_options,
            lambda include_usage, continuous: _CompletionChunks(plan, renderer, include_usage, echo, continuous,
                                                                request.return_token_ids),
        )
    results, usage = await collect(state, plan, wait_disconnect)
    response = CompletionResponse(
        id=plan.request_id,
        created=plan.created,
        model=plan.model,
        choices=_choices(state, request, plan, results, renderer, echo),
        usage=usage,
    )
    return JSONResponse(response.model_dump(mode="json"))


def _prompt_texts(state: RouterState, request: CompletionRequest, plan: GenerationPlan) -> list[str]:
    """Each prompt's text, as given, or decoded from its token ids (``echo``; a truncated prompt's
    kept tokens)."""
    if request.truncate_prompt_tokens is not None:
        return [state.prompts.tokenizer.decode(ids) for ids in plan.prompts]
    if isinstance(request.prompt, str):
        return [request.prompt]
    if request.prompt and isinstance(request.prompt[0], str):
        return list(request.prompt)  # type: ignore[arg-type]
    return [state.prompts.tokenizer.decode(ids) for ids in plan.prompts]


def _choices(
    state: RouterState,
    request: CompletionRequest,
    plan: GenerationPlan,
    results: list[ChoiceResult],
    renderer: TokenRenderer | None,
    echo: list[str] | None,
) -> list[CompletionChoice]:
    """Choice ``i`` of prompt ``p`` is index ``p * n + i``; a prompt's logprobs come with its first
    choice's first token and belong to all its choices."""
    by_prompt = {r.index // plan.n: r.prompt_logprobs for r in results if r.prompt_logprobs is not None}
    token_renderer = renderer
    if token_renderer is None and by_prompt:
        token_renderer = TokenRenderer(state.prompts.tokenizer, request.return_tokens_as_token_ids)
    choices = []
    for r in results:
        p = r.index // plan.n
        entries = by_prompt.get(p)
        logprobs = _logprobs(renderer, r)
        text = r.text
        if echo is not None:
            text = echo[p] + r.text
            if renderer is not None and logprobs is not None:
                head = echo_logprobs(renderer, plan.prompts[p], entries or [None] * len(plan.prompts[p]))
                logprobs = CompletionLogprobs(
                    tokens=head.tokens + logprobs.tokens,
                    token_logprobs=head.token_logprobs + logprobs.token_logprobs,
                    top_logprobs=head.top_logprobs + logprobs.top_logprobs,
                    text_offset=head.text_offset + [o + len(echo[p]) for o in logprobs.text_offset],
                )
        choices.append(CompletionChoice(
            index=r.index,
            text=text,
            logprobs=logprobs,
            finish_reason=r.finish_reason,  # type: ignore[arg-type]
            prompt_logprobs=(
                prompt_logprobs(token_renderer, entries)
                if request.prompt_logprobs is not None and entries is not None and token_renderer is not None
                else None
            ),
            prompt_token_ids=plan.prompts[p] if request.return_token_ids else None,
            token_ids=r.token_ids if request.return_token_ids else None,
        ))
    return choices


class _CompletionChunks:
    """The ``text_completion`` chunks of a streaming completion (``ChunkWriter``)."""

    __slots__ = ("continuous", "echo", "echoed", "exclude", "head", "include_usage", "inline", "plan", "renderer",
                 "started", "tail", "token_ids", "usage")

    def __init__(
        self, plan: GenerationPlan, renderer: TokenRenderer | None, include_usage: bool, echo: list[str] | None,
        continuous: bool = False, token_ids: bool = False,
    ) -> None:
        """``continuous``: every chunk carries its choice's usage so far (``sse_response``); ``token_ids``
        (``return_token_ids``): a choice's first chunk carries its prompt's ids, each chunk its tokens'."""
        self.plan, self.renderer, self.include_usage, self.echo = plan, renderer, include_usage, echo
        self.continuous, self.token_ids = continuous, token_ids
        self.started: set[int] = set()  # choices whose first chunk went out (``token_ids``)
        self.inline = renderer is None and not token_ids
        self.usage = UsageTracker(plan)
        self.echoed: set[int] = set()  # choices whose prompt text went out (``echo``: before their first text)
        self.exclude = None if include_usage else {"usage"}
        # Per token, the chunk is written from its fixed parts (the bytes pydantic writes, without
        # building its models): the router's CPU per streamed token is the cost of a stream.
        self.head = chunk_head(plan, "text_completion")
        self.tail = b',"usage":null}' if include_usage else b"}"

    def opening(self) -> list[bytes]:
        return []

    def chunks(self, delta: ChoiceDelta) -> list[bytes]:
        if self.include_usage:
            self.usage.update(delta)
        if self.echo is not None:
            delta.text = self._echoed(delta.index, delta.text)
        ids = delta.token_ids if self.token_ids else None
        if not delta.text and not delta.logprobs and delta.finish_reason is None and not ids:
            return []
        if self.renderer is None and not self.token_ids:
            finish = b"null" if delta.finish_reason is None else b'"%s"' % delta.finish_reason.encode()
            return [self._text_chunk(delta.index, delta.text, finish)]
        prompt_ids = None
        if self.token_ids and delta.index not in self.started:
            self.started.add(delta.index)
            prompt_ids = self.plan.prompts[delta.index // self.plan.n]
        plan = self.plan
        chunk = CompletionResponse(
            id=plan.request_id,
            created=plan.created,
            model=plan.model,
            choices=[
                CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=_logprobs(self.renderer, delta),
                    finish_reason=delta.finish_reason,  # type: ignore[arg-type]
                    prompt_token_ids=prompt_ids,
                    token_ids=ids,
                )
            ],
            usage=self.usage.choice_usage(delta.index) if self.continuous else None,
        )
        return [chunk.model_dump_json(exclude=self.exclude).encode()]

    def plain(self, stream: ChoiceStream, text: str) -> bytes | None:
        if self.include_usage:
            self.usage.count(stream.index, stream.num_output_tokens, stream.num_cached_tokens)
        if self.echo is not None:
            text = self._echoed(stream.index, text)
        return self._text_chunk(stream.index, text, b"null") if text else None

    def _echoed(self, index: int, text: str) -> str:
        """``text``, after the prompt's if it is the choice's first (``echo``)."""
        if self.echo is None or index in self.echoed:
            return text
        self.echoed.add(index)
        return self.echo[index // self.plan.n] + text

    def _text_chunk(self, index: int, text: str, finish: bytes) -> bytes:
        """A chunk without logprobs, written from its fixed parts; ``finish`` as JSON."""
        tail = self.tail
        if self.continuous:  # every chunk with its choice's usage so far
            tail = b',"usage":%b}' % self.usage.choice_usage(index).model_dump_json().encode()
        return b'%b%d,"text":%b,"logprobs":null,"finish_reason":%b}]%b' % (
            self.head, index, msgspec.json.encode(text), finish, tail)

    def closing(self) -> list[bytes]:
        if not self.include_usage:
            return []
        plan = self.plan
        final = CompletionResponse(
            id=plan.request_id, created=plan.created, model=plan.model, choices=[], usage=self.usage.usage()
        )
        return [final.model_dump_json().encode()]
