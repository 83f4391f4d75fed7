"""OpenAI's Responses API (``POST /v1/responses``) as a chat completion underneath.

A request's ``instructions`` and ``input`` items become chat messages (a user message's ``input_image`` parts
its images, as the chat completion's ``image_url`` parts; ``function_call`` and
``function_call_output`` items the assistant's tool calls and the tool's answers; a ``reasoning``
item the thinking of the assistant message after it), its function tools and ``text.format`` the chat
completion's ``tools`` and ``response_format``; the chat machinery then validates, templates, routes
and reads the answer (tool calls, ``--reasoning-parser``). Its message comes back as output items:
the thinking as a ``reasoning`` item, the text as a ``message``, each call as a ``function_call``.
Streamed, the answer's pieces become the API's typed events, in the order OpenAI sends them.

With ``previous_response_id`` the items of the stored response it names (its input items, then its
output) come before the request's own, and that response's ``instructions`` do not, as OpenAI
does; storing is ``router/response_store.py``'s, running in the background
``router/background_responses.py``'s. A tool the server does not run (web search, files, computers)
is a 400 naming the field.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, StrictStr

from router.config import RequestLimits
from router.errors import APIError, bad_request
from router.openai_models import CheckedRequest
from router.openai_responses import ChatMessageOut, DeltaToolCall, Usage
from router.reasoning_state import INCLUDE as REASONING_STATE
from router.reasoning_state import ReasoningSeal

# Request fields this server does not serve, each with the value that asks for nothing.
_NOT_SERVED: dict[str, Any] = {
    "prompt": None,  # a stored prompt template
}
# What ``include`` may ask for: the output text's log-probabilities (with ``top_logprobs`` alternatives a token).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
# What a Responses field is called in the chat completion it becomes, for the errors about it.
_CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(CheckedRequest):
    """The fields of ``POST /v1/responses`` this server reads; the others are refused or ignored as
    the chat completion's are."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # A string, or a list of items: checked by ``check``, so that a 400 names ``input`` itself.
    input: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]})
    instructions: StrictStr | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    truncation: StrictStr | None = None
    store: StrictBool | None = None  # None: stored, as OpenAI's default
    metadata: dict[str, StrictStr] | None = Field(default=None, max_length=16)
    user: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    prompt: Any = None
    background: StrictBool | None = None  # run after the request returns; read back with GET
    include: list[Any] | None = None
    reasoning: Any = None
    # OpenAI's bound on calls to its built-in tools, which are not run here (tools other than functions are refused):
    # taken, and with nothing to bound, as OpenAI's leaves function calls unbounded.
    max_tool_calls: StrictInt | None = Field(default=None, ge=0)
    top_logprobs: int | None = None
    mm_processor_kwargs: Any = None  # vLLM's: the image processor's settings for the input's images
    # The Responses field each chat message of ``chat_body`` came from (``input.3``, ``instructions``, or
    # ``previous_response_id`` for the stored conversation's), by the message's index: ``renamed``'s.
    _message_params: list[str] = PrivateAttr(default_factory=list)

    def check(self, limits: RequestLimits) -> None:
        if not (isinstance(self.input, str) or (
            isinstance(self.input, list) and self.input and all(isinstance(item, dict) for item in self.input)
        )):
            raise bad_request("input must be a string or a non-empty list of input items", param="input")
        self.refuse_unless_nothing(_NOT_SERVED, "not served here")
        if self.conversation is not None:
            if not isinstance(self.conversation_id, str):
                raise bad_request("conversation must be a conversation's id, or an object with its id", param="conversation")
            if self.previous_response_id is not None:
                raise bad_request("conversation and previous_response_id cannot both be given", param="conversation")
        for i, included in enumerate(self.include or ()):
            if included not in (OUTPUT_LOGPROBS, REASONING_STATE):
                raise bad_request(f"include: {included!r} is not served here (only {OUTPUT_LOGPROBS!r} and "
                                  f"{REASONING_STATE!r})",
                                  param=f"include.{i}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if self.top_logprobs and not self.wants_logprobs:
            raise bad_request(f"top_logprobs come with the output's log-probabilities: include {OUTPUT_LOGPROBS!r}",
                              param="top_logprobs")
        if self.wants_logprobs and self.tools:
            raise bad_request("the output's log-probabilities are served for answers of text alone, not with tools",
                              param="include")
        if self.reasoning is not None:
            if not isinstance(self.reasoning, dict):
                raise bad_request("reasoning must be an object", param="reasoning")
            for key, value in self.reasoning.items():
                if key in ("summary", "generate_summary") and value not in (None, "auto", "detailed"):
                    # (no second model call condenses the thinking: the summary is the thinking, whole)
                    raise bad_request(f"reasoning.{key} may be 'auto' or 'detailed' (the thinking, whole), not "
                                      f"{value!r}: a condensed summary is not written here", param=f"reasoning.{key}")
                if key not in ("effort", "summary", "generate_summary") and value is not None:
                    raise bad_request(f"reasoning.{key} is not served here", param=f"reasoning.{key}")
        if self.truncation not in (None, "disabled", "auto"):
            raise bad_request("truncation must be 'disabled' (a conversation too long is refused) or 'auto' (its "
                              "first items are dropped until it fits)", param="truncation")

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output text's log-probabilities are asked for (``include``)."""
        return OUTPUT_LOGPROBS in (self.include or ())

    @property
    def wants_summary(self) -> bool:
        """Whether reasoning items are to carry a summary (``reasoning.summary``): the thinking, whole."""
        reasoning = self.reasoning if isinstance(self.reasoning, dict) else {}
        return reasoning.get("summary", reasoning.get("generate_summary")) is not None

    @property
    def wants_reasoning_state(self) -> bool:
        """Whether reasoning items are to carry their ``encrypted_content`` (``router/reasoning_state.py``)."""
        return REASONING_STATE in (self.include or ())

    @property
    def conversation_id(self) -> str | None:
        """The conversation the request adds to (``conversation``: its id, or ``{"id": ...}``; ``check`` refuses
        anything else)."""
        conversation = self.conversation
        return conversation.get("id") if isinstance(conversation, dict) else conversation  # type: ignore[no-any-return]

    @property
    def continues(self) -> str:
        """The field that names what the request continues, for the errors about the items it brings."""
        return "conversation" if self.conversation is not None else "previous_response_id"

    def chat_body(self, earlier: list[dict[str, Any]] | None = None, dropped: int = 0,
                  seal: ReasoningSeal | None = None) -> dict[str, Any]:
        """The chat completion this request is, as a JSON body (validated by the chat path);
        ``earlier``: the items of the conversation it continues, before its own; ``dropped``: how many of the
        conversation's first items the model is not shown (``truncation: auto``), but system and developer messages;
        ``seal``: what opens reasoning items' ``encrypted_content``."""
        earlier = earlier or []
        messages, self._message_params = input_messages(
            [*earlier, *self.own_items()], self.instructions, len(earlier), dropped, self.continues, seal=seal)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": False}
        for name, chat_name in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                                ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"),
                                ("mm_processor_kwargs", "mm_processor_kwargs")):
            value = getattr(self, name)
            if value is not None:
                body[chat_name] = value
        if isinstance(self.reasoning, dict) and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        return body

    def turn_starts(self, earlier: list[dict[str, Any]]) -> list[int]:
        """Where the conversation (``earlier``, then this request's items) may start once its first items are
        dropped (``chat_body``'s ``dropped``): at each user message after its first item, the last one included."""
        items = [*earlier, *self.own_items()]
        return [i for i, item in enumerate(items)
                if i and item.get("type", "message") == "message" and item.get("role") == "user"]

    def own_items(self) -> list[dict[str, Any]]:
        """This request's input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return list(self.input)


def input_messages(items: list[dict[str, Any]], instructions: str | None = None, num_earlier: int = 0,
                   dropped: int = 0, earlier: str = "previous_response_id", field: str = "input",
                   seal: ReasoningSeal | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Input items (``num_earlier`` of them the conversation's before the request's own, named ``earlier`` in
    errors) as chat messages, after the ``instructions``; with the name of what each message came from
    (``field.N``, for the chat path's errors: ``renamed``). ``dropped``: as ``chat_body``'s. A 400 naming the
    first item that is not one."""
    messages: list[dict[str, Any]] = []
    params: list[str] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        params.append("instructions")
    thinking: str | None = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if i < dropped and not (kind == "message" and item.get("role") in ("system", "developer")):
            continue
        # (the earlier items were checked when they were stored)
        param = f"{field}.{i - num_earlier}" if i >= num_earlier else earlier
        num_messages = len(messages)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{param}.role must be user, system, developer or assistant", param=param)
            message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                       "content": _content(item.get("content"), param, role == "user")}
            if role == "assistant" and thinking is not None:
                message["reasoning_content"], thinking = thinking, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if thinking is not None:
                    message["reasoning_content"], thinking = thinking, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad_request(f"{param}.output must be a string", param=param)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise bad_request(f"{param}.content must be a list of reasoning text parts", param=param)
            thinking = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict)) or None
            sealed = item.get("encrypted_content")
            if thinking is None and sealed is not None and seal is not None:  # the thinking a client kept (``include``)
                thinking = seal.open(sealed)
                if thinking is None:
                    raise bad_request(f"{param}.encrypted_content is not one this deployment made (a reasoning "
                                      "item's, with include ['reasoning.encrypted_content'])",
                                      param=f"{param}.encrypted_content")
        else:
            raise bad_request(f"{param}: input items of type {kind!r} are not supported", param=param)
        params.extend([param] * (len(messages) - num_messages))  # the messages this item began
    return messages, params


class ResponseObject(BaseModel):
    """The ``response`` object (``response_object``), for the API's schema."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response (``ResponseEvents``), for the API's schema."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key} must be a string", param=param)
    return value


def _content(content: Any, param: str, user: bool) -> str | list[dict[str, Any]]:
    """A message's content as the chat completion takes it: a string, or its ``input_text`` / ``output_text`` parts
    joined; a user message with ``input_image`` parts: the chat completion's parts, one for each, in order (an
    image by ``image_url``, a data URL or an http(s) URL; a ``file_id`` is not served)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}.content must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{param}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if isinstance(part, dict) and kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": _string(part, "text", where)})
        elif isinstance(part, dict) and kind == "input_image" and user:
            if part.get("file_id") is not None:
                raise bad_request(f"{where}.file_id: files are not served; send the image as image_url", param=where)
            image: dict[str, Any] = {"url": _string(part, "image_url", where)}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_image":
            raise bad_request(f"{where}: input_image parts are taken in user messages only", param=where)
        else:
            allowed = "input_text, output_text, input_image" if user else "input_text, output_text"
            raise bad_request(f"{where}: parts of type {kind!r} are not supported ({allowed})", param=where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool as the chat completion's (``strict`` where the caller set it: a strict function's
    calls are held to its schema, ``router/tools.py``); other tools are not run here."""
    if tool.get("type") != "function":
        raise bad_request(f"tools.{i}: only function tools are supported, not {tool.get('type')!r}", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools":  # (the chat completion's form: its tools' functions by name)
        tools = choice.get("tools")
        if isinstance(tools, list):
            tools = [{"type": "function", "function": {"name": t.get("name")}}
                     if isinstance(t, dict) and t.get("type") == "function" else t for t in tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": tools}}
    raise bad_request("tool_choice must be none, auto, required, {'type': 'function', 'name': ...} or "
                      "{'type': 'allowed_tools', 'mode': ..., 'tools': [...]}", param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format.type must be text, json_object or json_schema", param="text.format")


def renamed(exc: APIError, request: ResponsesRequest | None = None) -> APIError:
    """``exc`` from the chat path, its ``param`` named as the Responses request names it: a message's by the item
    it came from (``request``'s ``chat_body``), its content parts in the same order."""
    if exc.param is not None:
        head, dot, rest = exc.param.partition(".")
        index, dot2, tail = rest.partition(".")
        params = request._message_params if request is not None else []
        if head == "messages" and index.isdigit() and int(index) < len(params):
            exc.param = params[int(index)] + dot2 + tail
        elif head in _CHAT_PARAMS:
            exc.param = _CHAT_PARAMS[head] + dot + rest
        elif exc.param.startswith("tool_choice.allowed_tools."):  # (the Responses form has no allowed_tools level)
            exc.param = "tool_choice." + exc.param.removeprefix("tool_choice.allowed_tools.")
    return exc


def stored_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as stored, in the form ``input_items`` lists them: each with an id and its type, a
    message's text as a part."""
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    stored = []
    for item in items:
        kind = item.get("type", "message")
        item = {**item, "id": item.get("id") or new_id(prefixes.get(kind, "item")), "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        stored.append(item)
    return stored


# ---------------------------------------------------------------------------------- the output
def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, item_id: str | None = None, seal: ReasoningSeal | None = None,
                   summary: bool = False) -> dict[str, Any]:
    """A reasoning item; with ``seal``, its ``encrypted_content`` too; with ``summary``, its summary (the thinking,
    whole)."""
    item = {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
    if seal is not None:
        item["encrypted_content"] = seal.seal(text)
    if summary:
        item["summary"] = [{"type": "summary_text", "text": text}]
    return item


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def output_items(message: ChatMessageOut, status: str, logprobs: list[dict[str, Any]] | None = None,
                 seal: ReasoningSeal | None = None, summary: bool = False) -> list[dict[str, Any]]:
    """A whole answer's output items: its thinking (its ``encrypted_content`` too, with ``seal``; its summary with
    ``summary``), its text (with its tokens' ``logprobs`` where asked), its calls."""
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(message.reasoning_content, seal=seal, summary=summary))
    if message.content:
        items.append(message_item(message.content, status))
        items[-1]["content"][0]["logprobs"] = logprobs or []
    items += [call_item(call.id, call.function.name, call.function.arguments) for call in message.tool_calls or []]
    return items


def response_usage(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def response_object(
    request: ResponsesRequest, response_id: str, created: int, model: str, status: str,
    output: list[dict[str, Any]], usage: dict[str, Any] | None, store: bool,
) -> dict[str, Any]:
    """The ``response`` object; ``status``: in_progress, completed or incomplete (``max_output_tokens``);
    ``store``: whether it is (or, in progress, is to be) stored."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
        "text": request.text or {"format": {"type": "text"}}, "truncation": request.truncation or "disabled",
        "metadata": request.metadata or {}, "store": store, "background": bool(request.background), "user": request.user,
        "previous_response_id": request.previous_response_id, "max_tool_calls": request.max_tool_calls,
        "conversation": {"id": request.conversation_id} if request.conversation_id is not None else None,
    }


class ResponseEvents:
    """A streamed answer as the Responses API's events: each output item opened when its first piece
    comes (``output_item.added``, for text ``content_part.added``), its pieces as deltas, and closed
    (``...done``) when something else begins or the answer ends; the whole response last."""

    def __init__(self, request: ResponsesRequest, response_id: str, created: int, model: str, store: bool,
                 seal: ReasoningSeal | None = None) -> None:
        self.request, self.response_id, self.created, self.model = request, response_id, created, model
        self.store = store
        self._seal = seal  # where reasoning items carry their ``encrypted_content``
        self.status = "in_progress"
        self.output: list[dict[str, Any]] = []  # closed items
        self._open: dict[str, Any] | None = None  # the item being written: its dict, with its text so far
        self._calls: dict[int, dict[str, Any]] = {}  # streamed tool call index -> its item
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return msgspec.json.encode(event)

    def response(self, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object as it stands (whole once ``close_output`` ran)."""
        return response_object(self.request, self.response_id, self.created, self.model, self.status,
                               list(self.output), usage, self.store)

    def opening(self) -> list[bytes]:
        response = self.response()
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def reasoning(self, text: str) -> list[bytes]:
        out = self._text("reasoning", "response.reasoning_text.delta", text)
        if self.request.wants_summary:  # (the summary is the thinking: the same text, as its summary's)
            assert self._open is not None
            out.append(self._event("response.reasoning_summary_text.delta", item_id=self._open["id"],
                                   output_index=len(self.output), summary_index=0, delta=text))
        return out

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """Output text, with its tokens' log-probabilities where asked (kept on the item too)."""
        out = self._text("message", "response.output_text.delta", text, logprobs=logprobs or [])
        if logprobs:
            assert self._open is not None
            self._open["content"][0]["logprobs"] += logprobs
        return out

    def _text(self, kind: str, event: str, text: str, **fields: Any) -> list[bytes]:
        """``text`` added to the open ``kind`` item (opened first if another is open, or none)."""
        out = self._open_item(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        out.append(self._event(event, item_id=item["id"], output_index=len(self.output), content_index=0,
                               delta=text, **fields))
        return out

    def call(self, part: DeltaToolCall) -> list[bytes]:
        """A tool call's piece: the first with its id and name, then its arguments (whole or in pieces)."""
        out: list[bytes] = []
        item = self._calls.get(part.index)
        if item is None or item is not self._open:
            out += self._close()
            item = call_item(part.id or new_id("call"), part.function.name or "", "")
            item["status"] = "in_progress"
            self._calls[part.index], self._open = item, item
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=dict(item)))
        if part.function.arguments:
            item["arguments"] += part.function.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.output), delta=part.function.arguments))
        return out

    def close_output(self, finish_reason: str | None) -> list[bytes]:
        """The answer ended: its last item closed; the response is then whole (``response``)."""
        self.status = "incomplete" if finish_reason == "length" else "completed"
        return self._close(self.status)

    def failed(self, response: dict[str, Any]) -> bytes:
        """The last event of a response that failed: the response, with its error."""
        return self._event("response.failed", response=response)

    def final(self, response: dict[str, Any]) -> bytes:
        """The last event: the whole ``response``."""
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def _open_item(self, kind: str) -> list[bytes]:
        """Open a ``kind`` item unless one is open; closes whatever else is."""
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._close()
        item = message_item("", "in_progress") if kind == "message" else reasoning_item("")
        if kind == "reasoning":
            item["status"] = "in_progress"
        self._open = item
        index = len(self.output)
        out.append(self._event("response.output_item.added", output_index=index, item=_empty(item)))
        if kind == "reasoning" and self.request.wants_summary:
            out.append(self._event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                                   summary_index=0, part={"type": "summary_text", "text": ""}))
        if kind == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output)
        out = []
        if item["type"] == "message":
            item["status"] = status
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            item.update(reasoning_item(text, item["id"], self._seal, self.request.wants_summary))  # (whole, as closed)
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
            for part in item["summary"]:
                out.append(self._event("response.reasoning_summary_text.done", item_id=item["id"],
                                       output_index=index, summary_index=0, text=part["text"]))
                out.append(self._event("response.reasoning_summary_part.done", item_id=item["id"],
                                       output_index=index, summary_index=0, part=part))
        else:
            item["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    """A message or reasoning item as ``output_item.added`` shows it: before any of its text."""
    return {**item, "content": []}


class DeletedResponse(BaseModel):
    """What ``DELETE /v1/responses/{id}`` answers."""

    id: str
    object: str = "response.deleted"
    deleted: bool


class ItemList(BaseModel):
    """A page of items: a stored response's input items (``GET /v1/responses/{id}/input_items``), a conversation's
    (``router/serving_conversations.py``), or those a call added to it."""

    model_config = ConfigDict(extra="allow")

    object: str = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
