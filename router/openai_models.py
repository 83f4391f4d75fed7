"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated with pydantic.

Type errors come from pydantic; value ranges are checked once, by ``SamplingParams.validate()``.
Both become 400 errors naming the field (see ``parse_request``).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from common.sampling_params import MAX_LOGPROBS, SamplingParams
from router.errors import bad_request

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _GenerationRequest(BaseModel):
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
    # vLLM's extras
    top_k: int | None = Field(default=None, le=2**31)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop holds at most {MAX_STOP_STRINGS} sequences", param="stop")
        if any(not s for s in stops):
            raise bad_request("stop sequences must not be empty", param="stop")
        return stops

    def check(self) -> None:
        """Cross-field checks pydantic cannot express; raises a 400 ``APIError``."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, eos_token_id: int | None, vocab_size: int
    ) -> SamplingParams:
        """SamplingParams for one engine request (n=1; the router fans out ``n`` itself)."""
        stop_token_ids = list(self.stop_token_ids or [])
        if eos_token_id is not None and not self.ignore_eos and eos_token_id not in stop_token_ids:
            stop_token_ids.append(eos_token_id)
        params = SamplingParams(
            n=self.n if self.n is not None else 1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
        )
        try:
            params.validate(vocab_size=vocab_size)
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, param=message.split(" ", 1)[0]) from None
        return params


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    logprobs: int | None = None
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be empty", param="prompt")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError:
                raise bad_request(
                    "only text content parts are supported", param=f"messages.{index}.content.{j}"
                ) from None
        return "".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only the 'text' response_format is supported", param="response_format")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


RequestT = TypeVar("RequestT", bound=_GenerationRequest)


def parse_request(model: type[RequestT], body: Any) -> RequestT:
    """Validate a decoded JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"] if not str(part).startswith(("function-", "union")))
        raise bad_request(f"{loc or 'body'}: {first['msg']}", param=loc or None) from None
    request.check()
    return request


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
