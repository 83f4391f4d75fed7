"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated with pydantic.

Type errors come from pydantic; value ranges are checked once, by ``SamplingParams.validate()``;
what one request may ask for in all is bounded by the router's ``RequestLimits``. All become 400
errors naming the field (see ``parse_request``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from common.protocol import MAX_PROMPT_LOGPROB_ENTRIES
from common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutput,
)
from router import structured_output
from router.beam_search import BeamSearch
from router.choice_stream import TextOptions
from router.config import RequestLimits
from router.errors import bad_request
from router.images import NO_IMAGES, ImageRef
from router.sampling_defaults import SamplingDefaults
from router.tools import ToolPlan, template_tool_calls

_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: StrictBool = False


# vLLM's extras this server does not implement, each with the value that asks for nothing: any other
# value is refused, not ignored.
_NOT_IMPLEMENTED_EXTRAS: dict[str, Any] = {
    "logits_processors": None,
    "mm_processor_kwargs": None,
    # Structured-output and serving knobs of vLLM's, and OpenAI's fields for other modalities.
    "guided_whitespace_pattern": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "prediction": None,
    "audio": None,
}


# Beam search reads 2 * width alternatives a step from the engines, which report at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# What a beam search does not take, each with the value that asks for nothing (``_check_beam_search``).
_NOT_WITH_BEAM_SEARCH: dict[str, Any] = {
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}


class CheckedRequest(BaseModel):
    """A request body ``parse_request`` reads: its types by pydantic, then ``check``."""

    def check(self, limits: RequestLimits) -> None:
        """A 400 naming the first field the types let through but the server refuses."""

    def refuse_unless_nothing(self, fields: dict[str, Any], why: str) -> None:
        """A 400 naming the first of ``fields`` (name -> the value that asks for nothing) given any
        other value: refused, never ignored."""
        for name, nothing in fields.items():
            value = getattr(self, name)
            if value is not None and value != nothing:
                raise bad_request(f"{name} is not supported ({why})", param=name)


class _GenerationRequest(CheckedRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's for chat; vLLM takes it for completions too. With ``guided_*``: ``structured_output``.
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, le=2**31)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None  # vLLM's first field for it, a structural tag's JSON text
    structured_outputs: Any = None  # vLLM's newer form of the guided_* fields
    # The prompt tokens' logprobs with this many top alternatives (vLLM's extra; not with stream).
    prompt_logprobs: int | None = Field(default=None, ge=-(2**31), le=2**31)
    # How tokens become text (vLLM's extras): the matched stop string (or stop token's text) kept at
    # the end; special tokens' text kept, and false: adjacent special tokens' texts side by side (a
    # tokenizer that spaces them apart refuses false: ``PromptProcessor.check_special_token_spacing``).
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    # Only the prompt's last k tokens are kept (-1: as many as the context holds); a longer prompt is
    # cut to them instead of refused.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31)
    # Lower first, in the engines' queues (vLLM's extra; needs ``--scheduling-policy priority``).
    priority: StrictInt = Field(default=0, ge=-(2**31), lt=2**31)
    # vLLM's: the response's id is "chatcmpl-<request_id>" ("cmpl-" for completions).
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    # vLLM's: a salt of the request's own for its prefix-cache blocks, on top of its API key's: only
    # requests with the same salt (and key) share cached blocks.
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    # The prompt's and each choice's token ids in the response (vLLM's extra).
    return_token_ids: StrictBool = False
    # Logprobs name each token as "token_id:<id>" (vLLM's extra).
    return_tokens_as_token_ids: StrictBool = False
    # Only these tokens may be sampled; these words may not be written (vLLM's extras).
    allowed_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[StrictStr] | None = Field(default=None, max_length=MAX_BAD_WORDS // 2)
    # vLLM's beam search (``router/beam_search.py``): ``n`` beams, scored by ``length_penalty``.
    use_beam_search: StrictBool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    # vLLM extras not implemented (``_NOT_IMPLEMENTED_EXTRAS``): declared so that they are refused,
    # not silently ignored
    logits_processors: Any = None
    mm_processor_kwargs: Any = None  # taken by chat completions (their images), where the model takes images
    guided_whitespace_pattern: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    prediction: Any = None
    audio: Any = None
    # Taken where they ask for what this server does: xgrammar's grammars, text out.
    guided_decoding_backend: Any = None
    modalities: Any = None
    _not_implemented_extras: ClassVar[dict[str, Any]] = _NOT_IMPLEMENTED_EXTRAS
    # What ``check`` read from response_format / guided_*: the spec and the field it came from.
    _structured: tuple[StructuredOutput, str] | None = PrivateAttr(default=None)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def context_check(self, max_model_len: int) -> int | None:
        """The context length to hold a prompt's text to before it is tokenized: none when it is
        to be truncated (``truncated``)."""
        return None if self.truncate_prompt_tokens is not None else max_model_len

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (all of them when unset)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

    def text_options(self, params: SamplingParams, keep_special_tokens: bool = False) -> TextOptions:
        """How the choices' tokens become text; ``params``: the engine requests' (their stop tokens);
        ``keep_special_tokens``: whatever ``skip_special_tokens`` says (a parser reads them)."""
        return TextOptions(
            stop=tuple(self.stop_strings()),
            stop_token_ids=frozenset(params.stop_token_ids),
            include_stop=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
        )

    def num_prompts(self) -> int:
        return 1

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check(self, limits: RequestLimits) -> None:
        """Cross-field checks pydantic cannot express, and the request ``limits``; raises a 400
        ``APIError``. Needs no tokenizer, so a request over a limit costs no tokenization."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        if any(not (key.isascii() and key.isdigit()) for key in self.logit_bias or ()):
            raise bad_request("logit_bias keys must be token ids (non-negative integers)", param="logit_bias")
        self._structured = structured_output.from_request(
            self.response_format,
            {name: getattr(self, name) for name in (*structured_output.GUIDED_FIELDS, "structured_outputs")},
        )
        self.refuse_unless_nothing(self._not_implemented_extras, "not yet implemented")
        if self.priority != 0 and not limits.priority_scheduling:
            raise bad_request("priority needs --scheduling-policy priority (router and engines); the server "
                              "takes requests first come, first served", param="priority")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise bad_request("guided_decoding_backend: this server's grammars are xgrammar's ('auto' or "
                              "'xgrammar')", param="guided_decoding_backend")
        if self.modalities not in (None, ["text"]):
            raise bad_request("modalities: this server writes text only", param="modalities")
        if self.n is not None and self.n > limits.max_n:
            raise bad_request(f"n must be at most {limits.max_n} (--max-n), got {self.n}", param="n")
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        self._check_stop(limits)
        self._check_beam_search()
        requested = self.requested_max_tokens()
        if requested is not None:
            check_total_tokens(self.n, [requested] * self.num_prompts(), limits)

    def _check_beam_search(self) -> None:
        """A 400 naming the first field a beam search does not take: the search ranks the model's raw
        log-probabilities, so whatever would change them, or what it draws from them, is refused."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise bad_request("length_penalty is only used with use_beam_search", param="length_penalty")
            return
        if (self.n or 1) > MAX_BEAM_WIDTH:
            raise bad_request(f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search: each "
                              f"step reads 2 * n logprobs, at most {MAX_LOGPROBS}", param="n")
        self.refuse_unless_nothing(_NOT_WITH_BEAM_SEARCH, "with use_beam_search")
        if self.top_k not in (None, 0, -1):
            raise bad_request("top_k is not supported with use_beam_search", param="top_k")
        if self.temperature not in (None, 0.0, 1.0):
            raise bad_request("temperature is not supported with use_beam_search (the search ranks the raw "
                              "log-probabilities: leave it unset, 0 or 1)", param="temperature")
        if self._structured is not None:
            raise bad_request(f"{self._structured[1]} is not supported with use_beam_search", param=self._structured[1])
        for name in ("stop", "bad_words", "logit_bias", "allowed_token_ids"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported with use_beam_search", param=name)

    def beam_search(self) -> BeamSearch | None:
        """The search the request asks for (after ``check``), or None."""
        return BeamSearch(length_penalty=self.length_penalty) if self.use_beam_search else None

    def engine_prompt_logprobs(self) -> int | None:
        """How many top alternatives the engine reports per prompt token (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The output's grammar spec and the field that asked for it (after ``check``)."""
        return self._structured

    def _check_stop(self, limits: RequestLimits) -> None:
        stops = self.stop_strings()
        if len(stops) > limits.max_stop_strings:
            raise bad_request(
                f"stop holds at most {limits.max_stop_strings} sequences (--max-stop-strings), "
                f"got {len(stops)}",
                param="stop",
            )
        for i, stop in enumerate(stops):
            param = "stop" if isinstance(self.stop, str) else f"stop.{i}"
            if not stop:
                raise bad_request("stop sequences must not be empty", param=param)
            if len(stop) > limits.max_stop_string_chars:
                raise bad_request(
                    f"stop sequences are at most {limits.max_stop_string_chars} characters long "
                    f"(--max-stop-string-chars), got {len(stop)}",
                    param=param,
                )

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, eos_token_ids: Sequence[int], vocab_size: int,
        bad_words_token_ids: list[list[int]] | None = None, defaults: SamplingDefaults | None = None,
    ) -> SamplingParams:
        """SamplingParams for one engine request (n=1; the router fans out ``n`` itself);
        ``bad_words_token_ids``: ``bad_words`` tokenized (``PromptProcessor.bad_word_sequences``); ``defaults``:
        the model's generation config's, for each parameter the request leaves unset (else OpenAI's)."""
        d = defaults or SamplingDefaults()
        stop_token_ids = list(self.stop_token_ids or [])
        if not self.ignore_eos:  # (the engines stop on them anyway; named here, their text is left out)
            stop_token_ids += [eos for eos in eos_token_ids if eos not in stop_token_ids]
        params = SamplingParams(
            n=self.n if self.n is not None else 1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            temperature=_first(self.temperature, d.temperature, 1.0),
            top_p=_first(self.top_p, d.top_p, 1.0),
            top_k=_first(self.top_k, d.top_k, 0),
            min_p=_first(self.min_p, d.min_p, 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=_first(self.repetition_penalty, d.repetition_penalty, 1.0),
            seed=self.seed,
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs(),
            logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
            structured_output=self._structured[0] if self._structured is not None else None,
            allowed_token_ids=self.allowed_token_ids,
            priority=self.priority,
            bad_words_token_ids=bad_words_token_ids or [],
        )
        try:
            params.validate(vocab_size=vocab_size)
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param=message.split(" ", 1)[0]) from None
        return params


def _first(value: Any, default: Any, openai_default: Any) -> Any:
    """The request's value, else the model's default, else OpenAI's."""
    return value if value is not None else default if default is not None else openai_default


_PROMPT_LIST_ARMS: dict[type, TypeAdapter[Any]] = {
    int: TypeAdapter(list[int]), str: TypeAdapter(list[str]), list: TypeAdapter(list[list[int]])
}


def _validate_prompt(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A prompt list is validated against the one shape its first item names. The plain union would
    try each shape in turn, and a shape that fails collects an error for every item: seconds of CPU
    under the GIL (the event loop's too) for a list of 100,000 prompts."""
    if isinstance(value, list) and value:
        arm = _PROMPT_LIST_ARMS.get(type(value[0]))
        if arm is not None:
            return arm.validate_python(value)
    return handler(value)


PromptInput = Annotated[str | list[int] | list[str] | list[list[int]], WrapValidator(_validate_prompt)]


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    logprobs: int | None = None
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: the tokenizer's BOS and the like around a text prompt.
    add_special_tokens: StrictBool = True

    def num_prompts(self) -> int:
        """Prompts in ``prompt``; pydantic has made a list's items all of one type."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return 1
        return len(self.prompt)

    def engine_prompt_logprobs(self) -> int | None:
        """An echoed prompt's logprobs come from the engine's prompt logprobs too."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

    def check(self, limits: RequestLimits) -> None:
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if self.num_prompts() > limits.max_prompts_per_request:
            raise bad_request(
                f"prompt holds at most {limits.max_prompts_per_request} prompts "
                f"(--max-prompts-per-request), got {self.num_prompts()}",
                param="prompt",
            )
        super().check(limits)
        if self.echo and self.stream and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported when stream is true", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI's "detail": the model's processor decides the size

    url: StrictStr


class ImagePart(BaseModel):
    """OpenAI's image part; vLLM's plain-string ``image_url`` too."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["image_url"]
    image_url: StrictStr | _ImageURL

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    def text(self, index: int) -> str:
        """The content's text (its text parts joined); a 400 naming an image part (``NO_IMAGES``)."""
        content = self.template_content(index, None)
        assert isinstance(content, str)  # without images, always
        return content

    def template_content(
        self, index: int, images: list[ImageRef] | None, no_images: str = NO_IMAGES
    ) -> str | list[dict[str, Any]]:
        """The content as the chat template takes it: text (its text parts joined), or, for a message with
        images, its parts in order, each image as ``{"type": "image"}`` (transformers' convention, which
        image-text models' templates read) and its URL appended to ``images``. ``images`` None: the model
        takes no images, and an image part is refused with ``no_images``. Images come in user messages only
        (vLLM takes them in others too)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(self.content):
            param = f"messages.{index}.content.{j}"
            if part.get("type") == "image_url":
                if images is None:
                    raise bad_request(no_images, param=param)
                if self.role != "user":
                    raise bad_request(f"images are taken in user messages only, not in a {self.role} message",
                                      param=param)
                try:
                    url = ImagePart.model_validate(part).url
                except ValidationError:
                    raise bad_request("image_url must be a URL (data: or http(s)), or an object with one as 'url'",
                                      param=f"{param}.image_url") from None
                images.append(ImageRef(f"{param}.image_url", url))
                parts.append({"type": "image"})
                continue
            try:
                text = TextPart.model_validate(part).text
            except ValidationError:
                kinds = "text and image_url" if images is not None else "text"
                raise bad_request(f"only {kinds} content parts are supported", param=param) from None
            texts.append(text)
            parts.append({"type": "text", "text": text})
        return parts if any(part["type"] == "image" for part in parts) else "".join(texts)


# apply_chat_template's own parameters and the variables it sets: not for chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(frozen=True)
class ChatRender:
    """How the chat template renders a conversation, beyond its messages."""

    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # the template's own variables
    documents: list[dict[str, str]] | None = None
    # The rendered text with each image's placeholder replaced by its image's text before it is tokenized (Gemma
    # 3's images, as its processor expands them: ``router.images.ImageProcessor.chat_render``); a 400 of its own.
    image_text: Callable[[str], str] | None = None


def template_messages(
    messages: list[ChatMessage], images: list[ImageRef] | None = None, no_images: str = NO_IMAGES
) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content (parts, for a message with images:
    ``ChatMessage.template_content``), an earlier call's arguments as an object, and the fields
    templates read when a message has them (a participant's ``name``, the thinking of an earlier
    answer as ``reasoning_content``, which Qwen3's template leaves out of old turns). ``images``: where
    the image parts' URLs are collected, in order, for a model that takes them; None refuses them
    with ``no_images``."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.template_content(i, images, no_images)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = template_tool_calls(i, m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = (m.model_extra or {}).get("reasoning_content")
        if isinstance(reasoning, str):
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


class ChatTemplateOptions(BaseModel):
    """vLLM's chat-template extras, for chat completions and ``/tokenize``."""

    model_config = ConfigDict(extra="ignore")

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that take them (retrieval)

    def check_template_options(self, messages: list[ChatMessage] | None) -> None:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise bad_request(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            if messages and messages[-1].role != "assistant":
                raise bad_request(
                    "continue_final_message needs the last message to be the assistant's", param="continue_final_message"
                )
        for key in self.chat_template_kwargs or {}:
            if key in _RESERVED_TEMPLATE_KWARGS:
                raise bad_request(
                    f"{key!r} is the chat template's own parameter, not one chat_template_kwargs may set",
                    param=f"chat_template_kwargs.{key}",
                )

    def chat_render(self, tools: list[dict[str, Any]] | None = None) -> ChatRender:
        return ChatRender(tools, self.add_generation_prompt, self.continue_final_message,
                          dict(self.chat_template_kwargs or {}), self.documents)


class ChatCompletionRequest(_GenerationRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # OpenAI's: set as the chat template's ``reasoning_effort`` (gpt-oss's reads it), for templates that read one.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's: the tokenizer's BOS and the like on top of what the chat template writes.
    add_special_tokens: StrictBool = False
    # vLLM's: false leaves a reasoning model's thinking (``--reasoning-parser``) out of the answer.
    include_reasoning: StrictBool = True
    # Refused, not ignored: OpenAI's deprecated form of tools, and vLLM's chat extras not implemented.
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    # vLLM's: an answer that goes on from a final assistant message (``continue_final_message``)
    # starts with that message's text.
    echo: StrictBool | None = False
    # What ``check`` read from tools / tool_choice (``router/tools.py``).
    _tools: ToolPlan | None = PrivateAttr(default=None)
    # vLLM's mm_processor_kwargs: the image processor's settings for this request's images
    # (``router.images.ImageProcessor.options``).
    _not_implemented_extras: ClassVar[dict[str, Any]] = {
        name: nothing for name, nothing in _NOT_IMPLEMENTED_EXTRAS.items() if name != "mm_processor_kwargs"}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported (deprecated by OpenAI): use tools and tool_choice", param=name)
        if self.chat_template is not None:
            raise bad_request(
                "a request may not bring its own chat template; the server's is set by --chat-template",
                param="chat_template",
            )
        self.check_template_options(self.messages)
        self._tools = ToolPlan.from_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        forced = self._tools.structured_output() if self._tools is not None else None
        if forced is not None:
            if self._structured is not None:
                raise bad_request(
                    f"tool_choice {self.tool_choice!r} constrains the output; {self._structured[1]} cannot as well",
                    param=self._structured[1],
                )
            self._structured = (forced, "tool_choice")
            if self.use_beam_search:
                raise bad_request(f"tool_choice {self.tool_choice!r} is not supported with use_beam_search",
                                  param="tool_choice")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_plan(self) -> ToolPlan | None:
        """The request's tools and tool choice (after ``check``); None without tools."""
        return self._tools

    def template_messages(
        self, images: list[ImageRef] | None = None, no_images: str = NO_IMAGES
    ) -> list[dict[str, Any]]:
        return template_messages(self.messages, images, no_images)

    def echoed_text(self) -> str | None:
        """With ``echo``, the text each answer starts with: the last message's, where it is the
        assistant's (the role answers take), as vLLM echoes; else None."""
        if not self.echo:
            return None
        last = self.messages[-1]
        return (last.text(len(self.messages) - 1) or None) if last.role == "assistant" else None


RequestT = TypeVar("RequestT", bound=CheckedRequest)


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def find_invalid_unicode(value: Any) -> tuple[str, str] | None:
    """``(param, message)`` for the first string or object key of a decoded JSON value that holds a
    lone surrogate, else None. JSON can escape one (``"\\ud800"``) but it is not Unicode text: the
    tokenizer, the stop checker and every UTF-8 encoder downstream would fail on it."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        param = ".".join(str(part) for part in path) or "body"
        if isinstance(item, str):
            if _has_surrogate(item):
                return param, f"{param} is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)"
        elif isinstance(item, dict):
            children: list[tuple[tuple[str | int, ...], Any]] = []
            for key, child in item.items():
                if _has_surrogate(key):
                    return param, f"an object key in {param} is not valid Unicode: it holds a lone surrogate"
                children.append(((*path, key), child))
            stack.extend(reversed(children))  # depth first, in document order
        elif isinstance(item, list) and not set(map(type, item)) <= _SCALAR_TYPES:  # skips token ids fast
            stack.extend(((*path, i), item[i]) for i in range(len(item) - 1, -1, -1))
    return None


# A UTF-8 JSON document holds a lone surrogate only as an escape of one of U+D800..U+DFFF or as the
# bytes that would encode one (0xED 0xA0-0xBF ..., which ``json.loads`` lets through): a body with
# neither needs no walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_unicode(raw: bytes, body: Any) -> None:
    """A 400 naming the field when the JSON document ``raw`` (decoded: ``body``) holds a lone surrogate."""
    if json.detect_encoding(raw) == "utf-8" and _SURROGATE_ESCAPE.search(raw) is None:
        return
    invalid = find_invalid_unicode(body)
    if invalid is not None:
        param, message = invalid
        raise bad_request(message, param=param, code="invalid_unicode")


def parse_request(model: type[RequestT], body: Any, limits: RequestLimits) -> RequestT:
    """Validate a decoded JSON body (Unicode checked by ``check_unicode``) against ``model`` and
    ``limits``; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"] if not str(part).startswith(("function-", "union")))
        raise bad_request(f"{loc or 'body'}: {first['msg']}", param=loc or None) from None
    request.check(limits)
    return request


def check_prompt_logprobs(params: SamplingParams, num_prompt_tokens: int) -> None:
    """A 400 when a prompt's logprobs would not fit one engine output message."""
    k = params.prompt_logprobs
    if k is not None and num_prompt_tokens * (1 + k) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise bad_request(
            f"prompt_logprobs: a prompt of {num_prompt_tokens} tokens with {k} alternatives each exceeds "
            f"{MAX_PROMPT_LOGPROB_ENTRIES} entries; ask for fewer alternatives",
            param="prompt_logprobs",
        )


def check_total_tokens(n: int | None, max_tokens_per_prompt: list[int], limits: RequestLimits) -> None:
    """A 400 when ``n`` samples of every prompt, each up to its ``max_tokens``, could produce more
    tokens than ``limits.max_total_tokens_per_request``."""
    limit = limits.max_total_tokens_per_request
    total = (n or 1) * sum(max_tokens_per_prompt)
    if limit and total > limit:
        raise bad_request(
            f"this request may produce {total} tokens (n={n or 1} x {len(max_tokens_per_prompt)} "
            f"prompt(s) x max_tokens), more than the limit of {limit} (--max-total-tokens-per-request); "
            "lower max_tokens or n",
            param="max_tokens",
        )


def check_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, default: int | None, prompt_param: str
) -> int:
    """The request's ``max_tokens`` (``default`` or all the room left when unset), or a 400 when the
    prompt plus it exceed the context window."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens but this model's maximum context length is "
            f"{max_model_len} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for "
            "the completion); reduce the prompt or max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested
