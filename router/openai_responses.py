"""Response bodies and stream chunks of the OpenAI API, field for field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprobEntry(BaseModel):
    """vLLM's shape for one token of ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# One per prompt token, keyed by token id (the prompt's token and the top alternatives); None first.
PromptLogprobs = list[dict[str, PromptLogprobEntry] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's extra, present only when asked for.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)
    # vLLM's ``return_token_ids``: present only when asked for.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    """Also the stream chunk: streaming completions use the same object type."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # The thinking of a reasoning model, split off (``--reasoning-parser``); present only then.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    # Present only when the answer called tools (``router/tools.py``).
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's ``return_token_ids``: present only when asked for.
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's extra, present only when asked for.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)
    # vLLM's ``return_token_ids``: present only when asked for.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaToolCall(BaseModel):
    """A tool call's part: the first carries its id, type and name; arguments may come in pieces."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """Only the keys that are set appear: ``{"role": ...}`` first, then ``{"content": ...}`` or
    ``{"tool_calls": ...}``, then ``{}``."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's ``return_token_ids``: present only when asked for.
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    # vLLM's ``return_token_ids``: present only when asked for.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None
    # vLLM's: where the model came from, and for a LoRA adapter the model it adapts.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the router answers with (``router/errors.py``), also as an SSE event mid-stream."""

    error: ErrorInfo
