"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response

from common.protocol import ImageInput
from router import harmony
from router.auth import with_request_salt
from router.chat_answer import AnswerReader, AnswerStream
from router.choice_stream import ChoiceDelta, ChoiceStream
from router.errors import bad_request
from router.images import ImageRef, ProcessedImage, check_image_count, truncate_images
from router.logprobs import TokenRenderer, chat_logprobs, prompt_logprobs
from router.openai_models import (
    ChatCompletionRequest,
    check_max_tokens,
    check_prompt_logprobs,
    check_total_tokens,
    parse_request,
)
from router.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    PromptLogprobs,
)
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
from router.tools import ToolPlan, tools_for_template


async def plan_chat(
    state: RouterState, body: Any, cache_salt: str | None
) -> tuple[ChatCompletionRequest, GenerationPlan, AnswerReader]:
    limits = state.config.limits
    request = parse_request(ChatCompletionRequest, body, limits)
    model = state.check_model(request.model)
    max_model_len = state.max_model_len()
    tool_plan = request.tool_plan()
    template_tools = tools_for_template(state, tool_plan)
    structured = request.structured_output()
    # Calls held by a structural tag in the template's own format: under "auto" with strict functions the text
    # around them stays free (the thinking too: not a grammar over the whole output, which ``answer_reader``
    # reads as content from its start); a "required" or named answer opens with its call.
    forced: str | None = None
    if state.harmony:
        # gpt-oss's harmony format: a grammar holds one message's body, whose header the prompt ends with, or (the
        # calls the model chooses) the whole answer, its messages read as they come.
        forced = harmony.forced_header(tool_plan, structured)
        native = harmony.call_tag(tool_plan, state.tags_lost_in_text) if tool_plan is not None else None
        tool_plan = replace(tool_plan, native=True) if tool_plan is not None and native is not None else tool_plan
    else:
        tool_plan = tool_plan.in_format(state) if tool_plan is not None else None
        native = tool_plan.native_output(state) if tool_plan is not None and tool_plan.native else None
    if native is not None:
        if structured is not None and structured[1] != "tool_choice":
            raise bad_request(f"strict functions constrain their calls; {structured[1]} cannot constrain the output "
                              "as well", param=structured[1])
        await check_grammar(native, "tools", state.prompts.is_token)
    elif structured is not None:
        await check_grammar(*structured, state.prompts.is_token)
    model_images = state.config.images
    image_options = model_images.options(request.mm_processor_kwargs)
    image_refs: list[ImageRef] | None = [] if model_images.processor is not None else None
    messages = request.template_messages(image_refs, model_images.refusal)
    check_image_count(image_refs or [], limits.max_images_per_prompt)
    render = request.chat_render(template_tools)
    if request.reasoning_effort is not None:
        if "reasoning_effort" not in (state.prompts.template_text() or ""):
            raise bad_request("this model's chat template takes no reasoning effort", param="reasoning_effort")
        render.kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    processed: list[ProcessedImage] = []
    if image_refs and model_images.processor is not None:
        # Processed before the prompt is rendered: a family whose processor expands an image in the text writes
        # what the processed image holds (Gemma 3's crops).
        processed = await model_images.processor.load_off_loop(image_refs, image_options)
        render = model_images.processor.chat_render(render, processed)
    prompt = await state.prompts.tokenize_chat(
        messages, request.context_check(max_model_len), render, request.add_special_tokens,
    )
    if forced is not None and render.add_generation_prompt:
        prompt = [*prompt, *state.prompts.encode(forced, add_special_tokens=False)]
    images: list[ImageInput] = []
    if image_refs and model_images.processor is not None:
        # Each image token the template wrote becomes its image's span: the checks below see the whole prompt.
        prompt, images = model_images.processor.expand(prompt, processed)
    num_tokens = len(prompt)
    prompt = request.truncated(prompt, max_model_len)
    images = truncate_images(images, num_tokens - len(prompt))
    defaults = state.config.sampling_defaults
    max_tokens = check_max_tokens(
        request.requested_max_tokens(), len(prompt), max_model_len, defaults.max_tokens, "messages"
    )
    check_total_tokens(request.n, [max_tokens], limits)
    state.prompts.check_special_token_spacing(request.spaces_between_special_tokens)
    params = request.sampling_params(
        max_tokens, request.requested_logprobs(), state.prompts.eos_token_ids, state.prompts.vocab_size,
        state.prompts.bad_word_sequences(request.bad_words), defaults,
    )
    if native is not None:
        params = msgspec.structs.replace(params, structured_output=native)
    check_prompt_logprobs(params, len(prompt))
    reader = answer_reader(state, request, tool_plan, prompt)
    response_id, engine_id = response_ids("chatcmpl", request.request_id)
    plan = GenerationPlan(
        request_id=response_id,
        engine_request_id=engine_id,
        model=model,
        prompts=[prompt],
        params=[params],
        text=request.text_options(params, keep_special_tokens=reader.needs_special_tokens),
        cache_salt=with_request_salt(cache_salt, request.cache_salt),
        lora_name=state.lora_name(model),
        images=[images] if images else [],
        beam_search=request.beam_search(),
    )
    return request, plan, reader


async def create_chat_completion(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> Response:
    request, plan, reader = await plan_chat(state, body, cache_salt)
    renderer = TokenRenderer(state.prompts.tokenizer, request.return_tokens_as_token_ids) if request.logprobs else None
    if request.stream:
        return await sse_response(
            state, plan, wait_disconnect, request.stream_options,
            lambda include_usage, continuous: _ChatChunks(plan, renderer, include_usage, reader, continuous,
                                                          request.echoed_text(), request.return_token_ids),
        )
    results, usage = await collect(state, plan, wait_disconnect)
    response = ChatCompletionResponse(
        id=plan.request_id,
        created=plan.created,
        model=plan.model,
        choices=[
            ChatChoice(
                index=r.index,
                message=message,
                logprobs=chat_logprobs(renderer, r.logprobs) if renderer else None,
                finish_reason=finish_reason,  # type: ignore[arg-type]
                token_ids=r.token_ids if request.return_token_ids else None,
            )
            for r in results
            for message, finish_reason in [_echoed(reader.message(r.text, r.finish_reason), request.echoed_text())]
        ],
        usage=usage,
        prompt_logprobs=_prompt_logprobs(state, request, results),
        prompt_token_ids=plan.prompts[0] if request.return_token_ids else None,
    )
    return JSONResponse(response.model_dump(mode="json"))


def _echoed(answer: tuple[ChatMessageOut, str | None], echo: str | None) -> tuple[ChatMessageOut, str | None]:
    """An answer's message starting with the ``echo`` text (the final assistant message it goes on from)."""
    message, finish_reason = answer
    if echo is not None:
        message.content = echo + (message.content or "")
    return message, finish_reason


def answer_reader(
    state: RouterState, request: ChatCompletionRequest, tools: ToolPlan | None, prompt: list[int]
) -> AnswerReader:
    """How the request's answers are read: tools (the request's plan, in the format they will be written:
    ``ToolPlan.in_format``) read for calls unless ``tool_choice`` is "none"; the thinking split off unless a grammar
    holds the output, which is then content from its start."""
    free = request.structured_output() is None
    reasoning = state.reasoning_parser if free else None
    tools = tools if tools is not None and tools.parsed else None
    lost = state.tags_lost_in_text  # the parsers' tags the tokenizer marks special
    # (else a grammar holds the body of the message the prompt opened)
    in_harmony = state.harmony and (free or (tools is not None and tools.native))
    needs_special = bool(
        (tools is not None and tools.parser_reads and state.tool_parser is not None
         and lost.intersection(state.tool_parser.tags))
        or (reasoning is not None and lost.intersection(reasoning.tags))
        or (in_harmony and lost.intersection(harmony.TAGS))
    )
    # Where the parser is one the prompt decides: whether its last tokens' text ends with its open tag.
    prompt_opens = reasoning is not None and reasoning.starts_inside is None and reasoning.prompt_opens(
        state.prompts.tokenizer.decode(prompt[-16:], skip_special_tokens=False))
    return AnswerReader(tools, state.tool_parser, reasoning, needs_special, request.include_reasoning, in_harmony,
                        prompt_opens)


def _prompt_logprobs(
    state: RouterState, request: ChatCompletionRequest, results: list[ChoiceResult]
) -> PromptLogprobs | None:
    """The prompt's logprobs (they come with the first choice's first token)."""
    entries = next((r.prompt_logprobs for r in results if r.prompt_logprobs is not None), None)
    if entries is None:
        return None
    return prompt_logprobs(TokenRenderer(state.prompts.tokenizer, request.return_tokens_as_token_ids), entries)


class _ChatChunks:
    """The ``chat.completion.chunk`` chunks of a streaming chat completion (``ChunkWriter``)."""

    __slots__ = ("answers", "continuous", "echo", "exclude", "head", "include_usage", "inline", "plan", "reader",
                 "renderer", "tail", "token_ids", "usage")

    def __init__(
        self, plan: GenerationPlan, renderer: TokenRenderer | None, include_usage: bool, reader: AnswerReader,
        continuous: bool = False, echo: str | None = None, token_ids: bool = False,
    ) -> None:
        """``continuous``: every chunk carries its choice's usage so far (``sse_response``); ``echo``:
        each answer's first content, before anything the engines write (``echoed_text``); ``token_ids``
        (``return_token_ids``): the first chunk carries the prompt's ids, each delta its tokens' ids."""
        self.plan, self.renderer, self.include_usage, self.reader = plan, renderer, include_usage, reader
        self.continuous, self.echo, self.token_ids = continuous, echo, token_ids
        self.answers: dict[int, AnswerStream] = {}  # per choice, where the answer is read (not plain)
        self.inline = renderer is None and reader.plain and not token_ids
        self.usage = UsageTracker(plan)
        self.exclude = None if include_usage else {"usage"}
        # Per token, the content chunk is written from its fixed parts (the bytes pydantic writes,
        # without building its models): the router's CPU per streamed token is the cost of a stream.
        self.head = chunk_head(plan, "chat.completion.chunk")
        self.tail = b',"logprobs":null,"finish_reason":null}]' + (b',"usage":null}' if include_usage else b"}")

    def _chunk(
        self, index: int, delta: DeltaMessage, logprobs: Any = None, finish_reason: Any = None,
        token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
    ) -> bytes:
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                  token_ids=token_ids)
        plan = self.plan
        usage = self.usage.choice_usage(index) if self.continuous else None
        body = ChatCompletionChunk(id=plan.request_id, created=plan.created, model=plan.model, choices=[choice],
                                   usage=usage, prompt_token_ids=prompt_token_ids)
        return body.model_dump_json(exclude=self.exclude).encode()

    def _tail(self, index: int) -> bytes:
        """What a chunk written from fixed parts ends with: its usage so far, where every chunk has one."""
        if not self.continuous:
            return self.tail
        return b',"logprobs":null,"finish_reason":null}],"usage":%b}' % (
            self.usage.choice_usage(index).model_dump_json().encode())

    def opening(self) -> list[bytes]:
        plan = self.plan
        num_choices = len(plan.prompts) * plan.n
        prompt_ids = plan.prompts[0] if self.token_ids else None  # in the first chunk only
        out = [self._chunk(i, DeltaMessage(role="assistant", content=""), prompt_token_ids=None if i else prompt_ids)
               for i in range(num_choices)]
        if self.echo is not None:
            out += [self._content_chunk(i, self.echo) for i in range(num_choices)]
        return out

    def chunks(self, delta: ChoiceDelta) -> list[bytes]:
        if self.include_usage:
            self.usage.update(delta)
        if not self.reader.plain:
            return self._read_chunks(delta)
        out = []
        ids = delta.token_ids if self.token_ids and delta.token_ids else None
        if delta.text and self.renderer is None and ids is None:
            out.append(self._content_chunk(delta.index, delta.text))
        elif delta.text or delta.logprobs or ids:
            logprobs = chat_logprobs(self.renderer, delta.logprobs) if self.renderer else None
            text = delta.text if delta.text or delta.logprobs else None
            out.append(self._chunk(delta.index, DeltaMessage(content=text), logprobs, token_ids=ids))
        if delta.finish_reason is not None:
            out.append(self._chunk(delta.index, DeltaMessage(), finish_reason=delta.finish_reason))
        return out

    def _read_chunks(self, delta: ChoiceDelta) -> list[bytes]:
        """A delta of an answer that is read: its thinking, content and tool calls as they are certain."""
        answer = self.answers.get(delta.index)
        if answer is None:
            answer = self.answers[delta.index] = self.reader.stream()
        reasoning, content, calls = answer.feed(delta.text, delta.finish_reason is not None)
        out = []
        ids = delta.token_ids if self.token_ids and delta.token_ids else None
        if (reasoning or content) and not calls and not delta.logprobs and ids is None:  # most: from fixed parts
            fields = {"content": content} if content else {}
            fields.update({"reasoning_content": reasoning} if reasoning else {})
            out.append(b"%b%d,\"delta\":%b%b" % (self.head, delta.index, msgspec.json.encode(fields), self._tail(delta.index)))
        elif reasoning or content or calls or delta.logprobs or ids:
            logprobs = chat_logprobs(self.renderer, delta.logprobs) if self.renderer else None
            message = DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None)
            out.append(self._chunk(delta.index, message, logprobs, token_ids=ids))
        if delta.finish_reason is not None:
            out.append(self._chunk(delta.index, DeltaMessage(), finish_reason=answer.finish_reason(delta.finish_reason)))
        return out

    def plain(self, stream: ChoiceStream, text: str) -> bytes | None:
        if self.include_usage:
            self.usage.count(stream.index, stream.num_output_tokens, stream.num_cached_tokens)
        return self._content_chunk(stream.index, text) if text else None

    def _content_chunk(self, index: int, text: str) -> bytes:
        """A content chunk without logprobs, written from its fixed parts."""
        return b'%b%d,"delta":{"content":%b}%b' % (self.head, index, msgspec.json.encode(text), self._tail(index))

    def closing(self) -> list[bytes]:
        if not self.include_usage:
            return []
        plan = self.plan
        final = ChatCompletionChunk(
            id=plan.request_id, created=plan.created, model=plan.model, choices=[], usage=self.usage.usage()
        )
        return [final.model_dump_json().encode()]
