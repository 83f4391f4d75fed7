"""Tool calls read back out of the text a chat model wrote, in its chat template's format.

A parser turns a whole answer into its content and its calls (``extract``), or follows the answer
as it streams (``stream``): each ``feed`` gives the events that no later text can change (content
text, or a completed ``ToolCall``) and ``finish`` the rest. Text that is not a well-formed call
stays content, verbatim, so nothing the model wrote is lost.

``extract`` runs the stream over the whole text, so both give the same content and calls however
the text is cut into chunks. Content is stripped of leading and trailing whitespace: a stream
holds whitespace back until more content follows it, so the whitespace around calls and at the
end of an answer never reaches the client.

* ``hermes`` (Qwen2.5, Qwen3, Hermes, ChatML templates with tools): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the text.
* ``llama3_json`` (Llama 3.1, 3.2): the whole answer, after an optional ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}``, or several such objects separated by ``;``.
* ``mistral`` (Mistral 7B v0.3, Mixtral, Mistral Small/Nemo): ``[TOOL_CALLS]`` and the calls after it.

Parsing never raises on what a model writes.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as json.dumps(obj, ensure_ascii=False) writes it


Event = str | ToolCall


@dataclass(frozen=True)
class CallStart:
    """A call whose layout a grammar holds opens: its name is known, its arguments follow."""

    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of the open call's arguments, as written."""

    text: str


# What a reader of grammar-held calls gives: content text, a call opening, a piece of its arguments.
PieceEvent = str | CallStart | ArgumentsPiece


class ToolCallStream(Protocol):
    def feed(self, text: str) -> list[Event]:
        """The events that the text so far makes certain, in output order."""
        ...

    def finish(self) -> list[Event]:
        """The remaining events, at the end of generation."""
        ...


class ToolCallParser(Protocol):
    name: str
    tags: tuple[str, ...]  # what the parser must see in the streamed text (so not skipped as special tokens)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content (None when there is none) and its calls, in order."""
        ...

    def stream(self) -> ToolCallStream:
        """A fresh stream for one answer."""
        ...

    def new_call_id(self) -> str:
        """An id for a call, of the kind the format's chat templates take back."""
        ...

    def strict_tag(self, functions: list[dict[str, Any]], strict: frozenset[str], parallel: bool) -> dict[str, Any] | None:
        """A structural tag (xgrammar's form) holding each call the model writes in this format to one of
        ``functions`` (the chat template's), its arguments valid against the ``parameters`` of those named in
        ``strict`` (any object for the others), the text around calls free; one call at most unless
        ``parallel``. None where the format has none."""
        ...


def openai_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("number out of range")
    return value


# Strict JSON: NaN, Infinity and numbers that overflow a float would come back out of json.dumps
# as text that is not JSON.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def _call(obj: Any, args_key: str, alt_key: str) -> ToolCall | None:
    """The call a decoded JSON value describes, or None: a non-empty string ``name`` and an object
    of arguments under ``args_key`` (or ``alt_key``), possibly given as its JSON text."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj[args_key] if args_key in obj else obj.get(alt_key)
    try:
        if isinstance(args, str):
            args = _DECODER.decode(args.strip())
        if not isinstance(args, dict):
            return None
        text = json.dumps(args, ensure_ascii=False)
        # A lone surrogate (a "\ud800" escape) would make the response unencodable.
        name.encode("utf-8")
        text.encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return ToolCall(name, text)


class _Content:
    """Content text with the answer's leading and trailing whitespace taken out, as it streams:
    whitespace is held until non-whitespace follows it."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body):]
        self._started = True
        return out


def _add(events: list[Event], item: Event) -> None:
    """Appends an event, joining adjacent content and leaving out empty text."""
    if isinstance(item, str):
        if not item:
            return
        if events and isinstance(events[-1], str):
            events[-1] += item
            return
    events.append(item)


def _collect(stream: ToolCallStream, text: str) -> tuple[str | None, list[ToolCall]]:
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = _DECODER.decode(body.strip())
    except (ValueError, RecursionError):
        return None
    return _call(obj, "arguments", "parameters")


class _HermesStream:
    def __init__(self) -> None:
        self._content = _Content()
        self._buf = ""
        self._inside = False
        self._scan = 0  # where in the buffer the closing tag may start, while inside a tag

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._buf.find(_HERMES_CLOSE, self._scan)
                if end < 0:
                    self._scan = max(0, len(self._buf) - len(_HERMES_CLOSE) + 1)
                    return events
                self._close(self._buf[:end], _HERMES_CLOSE, events)
                self._buf = self._buf[end + len(_HERMES_CLOSE):]
            else:
                start = self._buf.find(_HERMES_OPEN)
                if start < 0:
                    keep = len(self._buf) - _partial_suffix(self._buf, _HERMES_OPEN)
                    _add(events, self._content.push(self._buf[:keep]))
                    self._buf = self._buf[keep:]
                    return events
                _add(events, self._content.push(self._buf[:start]))
                self._buf = self._buf[start + len(_HERMES_OPEN):]
                self._inside, self._scan = True, 0

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._inside:
            self._close(self._buf, "", events)
        else:
            _add(events, self._content.push(self._buf))
        self._buf = ""
        return events

    def _close(self, body: str, close: str, events: list[Event]) -> None:
        """Ends a tag: its call, or its text as content when it holds none."""
        call = _hermes_call(body)
        _add(events, call if call is not None else self._content.push(_HERMES_OPEN + body + close))
        self._inside = False


_HERMES_BEGIN = '\n{"name": '  # after <tool_call>, as a strict function's structural tag writes it
_HERMES_ARGUMENTS = ', "arguments": '
_HERMES_END = "}\n" + _HERMES_CLOSE


class StrictHermesCalls:
    """A hermes answer whose calls a structural tag held (``HermesParser.strict_tag``: ``<tool_call>``, a newline,
    ``{"name": "...", "arguments": `` the arguments ``}``, a newline, ``</tool_call>``), read as it streams: each
    call opens once its name is read and its arguments go out as they are written, so a stream's pieces join into a
    whole response's arguments, character for character. The text around calls is content, as ``_HermesStream``
    gives it (the answer's leading and trailing whitespace out). A tag whose text leaves that layout (an engine that
    did not hold the answer to the grammar) is content, as the hermes parser leaves a malformed call; a call past
    ``max_calls`` too. An answer cut short inside a call ends with its arguments cut short, as OpenAI's are."""

    def __init__(self, max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        self._content = _Content()
        self._buf = ""
        self._tag = ""  # the open tag's text read so far, while no call has opened: content if the layout breaks
        self._state = "text"  # text, begin, name, key, arguments
        self.num_calls = 0

    def feed(self, text: str) -> list[PieceEvent]:
        self._buf += text
        events: list[PieceEvent] = []
        while self._buf and self._step(events):
            pass
        return events

    def finish(self) -> list[PieceEvent]:
        """What is left: content, unless the answer stopped inside a call's arguments (the end's start held back
        from them is dropped: the arguments end where they were certain)."""
        events: list[PieceEvent] = []
        if self._state != "arguments":
            _add_piece(events, self._content.push(self._tag + self._buf))
        self._buf = self._tag = ""
        self._state = "text"
        return events

    def _step(self, events: list[PieceEvent]) -> bool:
        """Reads what it can of the buffer; False when it must wait for more text."""
        if self._state == "text":
            start = self._buf.find(_HERMES_OPEN)
            if start < 0:
                keep = len(self._buf) - _partial_suffix(self._buf, _HERMES_OPEN)
                _add_piece(events, self._content.push(self._buf[:keep]))
                self._buf = self._buf[keep:]
                return False
            _add_piece(events, self._content.push(self._buf[:start]))
            self._tag, self._buf, self._state = _HERMES_OPEN, self._buf[start + len(_HERMES_OPEN):], "begin"
            if self._max_calls is not None and self.num_calls >= self._max_calls:
                self._off_layout(events)  # a call too many: content
            return True
        if self._state == "begin":
            return self._literal(_HERMES_BEGIN, "name", events)
        if self._state == "name":
            return self._name(events)
        if self._state == "key":
            return self._literal(_HERMES_ARGUMENTS, "arguments", events)
        end = self._buf.find(_HERMES_END)
        if end < 0:
            keep = len(self._buf) - _partial_suffix(self._buf, _HERMES_END)
            if keep:
                events.append(ArgumentsPiece(self._buf[:keep]))
            self._buf = self._buf[keep:]
            return False
        if end:
            events.append(ArgumentsPiece(self._buf[:end]))
        self._buf, self._state = self._buf[end + len(_HERMES_END):], "text"
        return True

    def _literal(self, literal: str, then: str, events: list[PieceEvent]) -> bool:
        if self._buf.startswith(literal):
            if then == "name":  # the tag's opening, before its call opens
                self._tag += literal
            self._buf = self._buf[len(literal):]
            self._state = then
            return True
        if literal.startswith(self._buf):
            return False  # the literal's start so far
        self._off_layout(events)
        return True

    def _name(self, events: list[PieceEvent]) -> bool:
        """The name's JSON string, whole; the call opens with it."""
        if not self._buf.startswith('"'):
            self._off_layout(events)
            return True
        escaped = False
        for i, c in enumerate(self._buf[1:], 1):
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                try:
                    name = json.loads(self._buf[: i + 1])
                except ValueError:
                    name = ""
                if not name:
                    self._off_layout(events)
                    return True
                events.append(CallStart(name))
                self.num_calls += 1
                self._buf, self._tag, self._state = self._buf[i + 1:], "", "key"
                return True
        return False

    def _off_layout(self, events: list[PieceEvent]) -> None:
        """The open tag is content (its text left the layout, or it is a call too many); reading goes on after
        its ``<tool_call>``. (Past a call's name, what follows is content.)"""
        if self._tag:
            _add_piece(events, self._content.push(_HERMES_OPEN))
        self._buf, self._tag, self._state = self._tag[len(_HERMES_OPEN):] + self._buf, "", "text"


def _add_piece(events: list[PieceEvent], text: str) -> None:
    """Appends content text, joined to content just before it; empty text left out."""
    if not text:
        return
    if events and isinstance(events[-1], str):
        events[-1] += text
        return
    events.append(text)


class _Parser:
    """What the parsers share: ``extract`` runs ``stream`` over the whole text; OpenAI-style ids."""

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return _collect(self.stream(), text)

    def new_call_id(self) -> str:
        return openai_call_id()

    def strict_tag(self, functions: list[dict[str, Any]], strict: frozenset[str], parallel: bool) -> dict[str, Any] | None:
        return None


def _arguments_schema(function: dict[str, Any], strict: frozenset[str]) -> dict[str, Any]:
    """What a call's arguments are held to: a strict function's ``parameters`` (any object without them),
    any object for the others."""
    if function["name"] in strict and function.get("parameters"):
        return function["parameters"]  # type: ignore[no-any-return]
    return {"type": "object"}


class HermesParser(_Parser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the answer; a tag
    left open at the end is a call when the rest of the answer is one."""

    name = "hermes"
    tags: tuple[str, ...] = (_HERMES_OPEN, _HERMES_CLOSE)

    def stream(self) -> ToolCallStream:
        return _HermesStream()

    def strict_tag(self, functions: list[dict[str, Any]], strict: frozenset[str], parallel: bool) -> dict[str, Any] | None:
        """From ``<tool_call>`` on, a call as the format's chat templates show it (``<tool_call>``, a newline, then
        ``{"name": ..., "arguments": ...}``, a newline, ``</tool_call>``): triggered tags, one per function."""
        tags = [{"begin": f'{_HERMES_OPEN}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": _arguments_schema(f, strict)},
                 "end": f"}}\n{_HERMES_CLOSE}"} for f in functions]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [_HERMES_OPEN], "tags": tags,
                                                     "stop_after_first": not parallel}}


_PYTHON_TAG = "<|python_tag|>"


def _llama_calls(text: str) -> list[ToolCall] | None:
    """The calls when the whole text is a ``;``-separated sequence of them, else None."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG):].lstrip()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        call = _call(obj, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        rest = text[pos:].lstrip()
        if not rest:
            return calls
        if rest[0] != ";":
            return None
        pos = len(text) - len(rest[1:].lstrip())


class _LlamaStream:
    def __init__(self) -> None:
        self._content = _Content()
        self._buf = ""
        self._mode: str | None = None  # None until the start is known, then "calls" or "content"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return self._text(text)
        self._buf += text
        if self._mode == "calls":
            return []
        start = self._buf.lstrip()
        if start.startswith(("{", _PYTHON_TAG)):
            self._mode = "calls"
            return []
        if not start or _PYTHON_TAG.startswith(start):
            return []
        self._mode = "content"
        text, self._buf = self._buf, ""
        return self._text(text)

    def finish(self) -> list[Event]:
        if self._mode == "content":
            return []
        text, self._buf = self._buf, ""
        calls = _llama_calls(text)
        if calls is None:
            return self._text(text)
        return [*calls]

    def _text(self, text: str) -> list[Event]:
        out = self._content.push(text)
        return [out] if out else []


class Llama3JsonParser(_Parser):
    """The whole answer as one or more ``{"name": ..., "parameters": {...}}`` objects separated by
    ``;``, after an optional ``<|python_tag|>``; anything else is content. A stream that starts
    like calls is held to the end."""

    name = "llama3_json"
    tags: tuple[str, ...] = ()  # (its <|python_tag|> prefix may be left out of the text: the calls are the same)

    def stream(self) -> ToolCallStream:
        return _LlamaStream()


def json_array_calls(text: str) -> list[ToolCall] | None:
    """The calls of a JSON array of ``{"name": ..., "arguments": {...}}`` objects (Mistral's form, and
    the answer a ``"required"`` tool choice is held to), or None when the text is not one."""
    try:
        items = _DECODER.decode(text.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item, "arguments", "parameters") for item in items]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"


def _mistral_calls(text: str) -> list[ToolCall] | None:
    """The calls after ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}`` (tokenizers before
    v11), or ``name[ARGS]{...}`` runs, each after its own ``[TOOL_CALLS]`` (v11 on); None when the
    text is neither."""
    text = text.strip()
    if text.startswith("["):
        return json_array_calls(text)
    calls: list[ToolCall] = []
    for part in text.split(_MISTRAL_TAG):
        name, sep, arguments = part.partition(_MISTRAL_ARGS)
        call = _call({"name": name.strip(), "arguments": arguments.strip()}, "arguments", "parameters") if sep else None
        if call is None:
            return None
        calls.append(call)
    return calls


class _MistralStream:
    def __init__(self) -> None:
        self._content = _Content()
        self._buf = ""
        self._calls: str | None = None  # what follows [TOOL_CALLS], held to the end

    def feed(self, text: str) -> list[Event]:
        if self._calls is not None:
            self._calls += text
            return []
        self._buf += text
        start = self._buf.find(_MISTRAL_TAG)
        if start >= 0:
            out, self._calls, self._buf = self._buf[:start], self._buf[start + len(_MISTRAL_TAG):], ""
        else:
            keep = len(self._buf) - _partial_suffix(self._buf, _MISTRAL_TAG)
            out, self._buf = self._buf[:keep], self._buf[keep:]
        events: list[Event] = []
        _add(events, self._content.push(out))
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._calls is None:
            _add(events, self._content.push(self._buf))
        else:
            calls = _mistral_calls(self._calls)
            if calls is None:
                _add(events, self._content.push(_MISTRAL_TAG + self._calls))
            else:
                events.extend(calls)
        self._buf, self._calls = "", None
        return events


class MistralParser(_Parser):
    """``[TOOL_CALLS]`` and the calls to the end of the answer: a JSON array of ``{"name": ...,
    "arguments": {...}}``, or (v11 tokenizers) ``name[ARGS]{...}``; the text before it is content.
    ``[TOOL_CALLS]`` is a special token: the router keeps special tokens' text for these answers."""

    name = "mistral"
    tags: tuple[str, ...] = (_MISTRAL_TAG,)

    def stream(self) -> ToolCallStream:
        return _MistralStream()

    def new_call_id(self) -> str:
        """Nine letters and digits: Mistral's chat templates refuse any other id when a conversation
        brings the calls back."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


PARSERS: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def detect_parser(chat_template: str | None) -> str | None:
    """The parser for the tool-call format a chat template teaches its model, or None."""
    if not chat_template:
        return None
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if _MISTRAL_TAG in chat_template:
        return "mistral"
    if _PYTHON_TAG in chat_template or (
        "<|start_header_id|>" in chat_template and "parameters" in chat_template
    ):
        return "llama3_json"
    return None
