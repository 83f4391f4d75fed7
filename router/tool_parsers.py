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
* ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call>``, ``<function=NAME>``, a ``<parameter=KEY>`` element per
  argument (its value on lines of its own, typed by the function's schema), ``</function>``, ``</tool_call>``.
* ``llama3_json`` (Llama 3.1, 3.2): the whole answer, after an optional ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}``, or several such objects separated by ``;``.
* ``mistral`` (Mistral 7B v0.3, Mixtral, Mistral Small/Nemo): ``[TOOL_CALLS]`` and the calls after it.
* ``glm45`` / ``glm47`` (GLM-4.5 to 5): ``<tool_call>NAME``, ``<arg_key>`` and ``<arg_value>`` pairs, ``</tool_call>``.
* ``minimax_m2`` (MiniMax-M2): ``<minimax:tool_call>`` blocks of ``<invoke name=...>`` elements of ``<parameter>`` ones.
* ``deepseek_v3`` / ``deepseek_v31`` (DeepSeek-V3, R1-0528, V3.1): ``<｜tool▁calls▁begin｜>`` blocks of calls.
* ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|>`` sections of calls, each with the id the model wrote.
* ``seed_oss`` (Seed-OSS): Qwen3-Coder's calls inside ``<seed:tool_call>`` and ``</seed:tool_call>``.
* ``granite`` (Granite 3): ``<|tool_call|>`` (or ``<tool_call>``) and a JSON array of calls to the answer's end.
* ``pythonic`` / ``llama4_pythonic`` (pythonic templates of Llama 3.2 and Llama 4, ToolACE): the whole answer is a
  Python list of calls with keyword arguments of literal values, ``[get_time(zone="UTC"), f(n=1)]``.

Parsing never raises on what a model writes.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    # JSON text of an object: as json.dumps(obj, ensure_ascii=False) writes it, or (a call a grammar held, JSON
    # arguments) as the model wrote it
    arguments: str
    id: str | None = None  # the id the model wrote for it, in a format that has the model write ids (Kimi's)


Event = str | ToolCall


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
    holds_calls: bool  # whether ``call_tag`` gives a structural tag for the format

    @property
    def held_layout(self) -> HeldLayout | None:
        """How calls its tag held are written, for reading their arguments as they stream (``router/call_readers.py``)."""

    def layout_for(self, special: frozenset[str]) -> HeldLayout | None:
        """``held_layout`` where the tokenizer makes ``special`` of the format's tags special tokens."""
        ...

    def extract(self, text: str, functions: Sequence[dict[str, Any]] = ()) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content (None when there is none) and its calls, in order. ``functions``: the tools'
        (as the chat template gets them), for a format whose arguments take their types from the schemas."""
        ...

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        """A fresh stream for one answer; ``content``: where its content goes on from (a reader that hands the rest
        of an answer to the parser, ``router/call_readers.py``), else the answer's start."""
        ...

    def new_call_id(self, name: str, index: int) -> str:
        """An id for the answer's ``index``-th call (of ``name``), of the kind the format's chat templates take back."""
        ...

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """A structural tag (xgrammar's form) holding each call the model writes in this format to one of
        ``functions``, its arguments valid against the ``parameters`` of those named in ``held`` (any object for
        the others), the text around calls free; one call at most unless ``parallel``; with ``required``, the answer
        opens with a call. ``special``: the format's tags the tokenizer makes special tokens, held as those tokens. None
        where the format has none."""
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


class Content:
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


def add_event(events: list[Any], item: object) -> None:
    """Appends an event (a stream's, or a reader's of grammar-held calls: ``router/call_readers.py``), joining
    adjacent content and leaving out empty text."""
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


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = _DECODER.decode(body.strip())
    except (ValueError, RecursionError):
        return None
    return _call(obj, "arguments", "parameters")


def _one(read_call: Callable[[str], ToolCall | None]) -> Callable[[str], list[ToolCall] | None]:
    def read(body: str) -> list[ToolCall] | None:
        call = read_call(body)
        return None if call is None else [call]
    return read


class _TagStream:
    """Calls in tags (``<tool_call>`` and ``</tool_call>`` by default), each tag's body read by ``read_calls`` (one
    hermes JSON call by default; a format may hold several calls in one tag): content as soon as it cannot be part
    of a tag, a tag's calls whole once it closes, a body that holds no calls content."""

    def __init__(self, read_calls: Callable[[str], list[ToolCall] | None] = _one(_hermes_call),
                 open_tag: str = HERMES_OPEN, close_tag: str = HERMES_CLOSE, content: Content | None = None) -> None:
        self._read_calls = read_calls
        self._open, self._close_tag = open_tag, close_tag
        self._content = content or Content()
        self._buf = ""
        self._inside = False
        self._scan = 0  # where in the buffer the closing tag may start, while inside a tag

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._buf.find(self._close_tag, self._scan)
                if end < 0:
                    self._scan = max(0, len(self._buf) - len(self._close_tag) + 1)
                    return events
                self._close(self._buf[:end], self._close_tag, events)
                self._buf = self._buf[end + len(self._close_tag):]
            else:
                start = self._buf.find(self._open)
                if start < 0:
                    keep = len(self._buf) - partial_suffix(self._buf, self._open)
                    add_event(events, self._content.push(self._buf[:keep]))
                    self._buf = self._buf[keep:]
                    return events
                add_event(events, self._content.push(self._buf[:start]))
                self._buf = self._buf[start + len(self._open):]
                self._inside, self._scan = True, 0

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._inside:
            self._close(self._buf, "", events)
        else:
            add_event(events, self._content.push(self._buf))
        self._buf = ""
        return events

    def _close(self, body: str, close: str, events: list[Event]) -> None:
        """Ends a tag: its calls, or its text as content when it holds none."""
        calls = self._read_calls(body)
        if calls is None:
            add_event(events, self._content.push(self._open + body + close))
        else:
            events.extend(calls)
        self._inside = False


# A held call as its structural tag writes it (``HermesParser.call_tag``), after <tool_call>:
# this, the name as a JSON string, ``HERMES_HELD_ARGUMENTS``, the arguments, ``}``, a newline, </tool_call>.
HERMES_HELD_BEGIN = '\n{"name": '
HERMES_HELD_ARGUMENTS = ', "arguments": '


@dataclass(frozen=True)
class XmlArguments:
    """How a format writes a call's arguments as XML elements, one per argument: ``key`` (a regex, from the end of the
    last element or the call's head, up to the value: group ``key``), the text that closes a value, and whether a
    value's first and last newlines are the layout's, not the value's."""

    key: str
    value_end: str
    trim_newlines: bool


@dataclass(frozen=True)
class HeldLayout:
    """How a format's calls are written, as its structural tag (``call_tag``) holds them and as its chat templates
    teach them (with the whitespace between their parts its parser takes): the text that opens them (each call's
    tag, or a block of calls), then regexes matched where the last left off: ``head`` from the opening
    to a call's arguments (group ``name``, and ``id`` where the model writes the call's id), ``end`` from its
    arguments to its end (its tag's, for a call in a tag of its own), and in a block ``next`` (another call's head)
    or ``close`` (the block's end). ``xml``: the arguments' XML elements; None: a JSON object. ``also``: other texts
    that open them as ``trigger`` does."""

    trigger: str  # ("": the answer's start, calls that open it)
    head: str
    end: str
    xml: XmlArguments | None = None
    next: str | None = None
    close: str | None = None
    also: tuple[str, ...] = ()


_WS = r"[ \n\r\t]*"
_NAME_CHARS = r"[^\s<>{}\[\]\"',:;]+"  # (``_NAME``'s)
# A JSON call's head as templates teach it, with any whitespace: ``{"name": "NAME", "arguments": `` (a name without
# escapes, its keys in that order; the parsers read the others whole).
_JSON_CALL_HEAD = rf'{_WS}\{{{_WS}"name"{_WS}:{_WS}"(?P<name>[^"\\\x00-\x1f]+)"{_WS},{_WS}"arguments"{_WS}:{_WS}'
# A hermes call in its tag: the head, the arguments, the object's own closing brace (which may be missing or doubled,
# as models slip: the arguments were whole) and </tool_call>.
_HERMES_LAYOUT = HeldLayout(HERMES_OPEN, _JSON_CALL_HEAD, rf"{_WS}(?:\}}{_WS}){{0,2}}{re.escape(HERMES_CLOSE)}")


class _Parser:
    """What the parsers share: ``extract`` runs ``stream`` over the whole text; OpenAI-style ids; no structural tag."""

    holds_calls = False
    held_layout: HeldLayout | None = None

    def layout_for(self, special: frozenset[str]) -> HeldLayout | None:
        return self.held_layout

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        raise NotImplementedError

    def extract(self, text: str, functions: Sequence[dict[str, Any]] = ()) -> tuple[str | None, list[ToolCall]]:
        return _collect(self.stream(functions), text)

    def new_call_id(self, name: str, index: int) -> str:
        return openai_call_id()

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        return None


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """What a held call's arguments hold to: the function's ``parameters``, any object without them."""
    return function.get("parameters") or {"type": "object"}


def _held_schema(function: dict[str, Any], held: frozenset[str]) -> dict[str, Any]:
    """A call's arguments' schema: the function's when it is ``held``, any object otherwise."""
    return arguments_schema(function) if function["name"] in held else {"type": "object"}


def calls_array_schema(functions: list[dict[str, Any]], held: frozenset[str], parallel: bool) -> dict[str, Any]:
    """A JSON array of ``{"name", "arguments"}`` calls of ``functions`` (one at most unless ``parallel``), the
    arguments of those ``held`` holding to their schemas."""
    calls = [{"type": "object", "properties": {"name": {"enum": [f["name"]]}, "arguments": _held_schema(f, held)},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _held(function: dict[str, Any], held: frozenset[str], style: str = "json") -> dict[str, Any]:
    """A call's arguments in a structural tag (``_held_schema``), written in ``style``."""
    schema = _held_schema(function, held)
    return {"type": "json_schema", "json_schema": schema, **({"style": style} if style != "json" else {})}


def literal(value: str) -> dict[str, Any]:
    """Text a structural tag's content must hold."""
    return {"type": "const_string", "value": value}


def token(tag: str) -> dict[str, Any]:
    """A token a structural tag must hold, as that token (xgrammar's token format)."""
    return {"type": "token", "token": tag}


def _edge(tag: str, special: frozenset[str]) -> str | dict[str, Any]:
    """A format's tag as a structural tag's ``begin`` or ``end``: that token where it is special, else text."""
    return token(tag) if tag in special else tag


def _marker(tag: str, special: frozenset[str]) -> dict[str, Any]:
    """A format's tag inside a structural tag's content: that token where the tokenizer makes it special, else text."""
    return token(tag) if tag in special else literal(tag)


def _triggered(tags: list[dict[str, Any]], trigger: str, special: frozenset[str], required: bool,
               stop_after_first: bool) -> dict[str, Any]:
    """A structural tag whose ``tags`` start where the text (or the token, where special) ``trigger`` comes, the text
    around them free; with ``required`` the answer opens with one."""
    form: dict[str, Any] = (
        {"type": "token_triggered_tags", "trigger_tokens": [trigger], "tags": tags} if trigger in special
        else {"type": "triggered_tags", "triggers": [trigger], "tags": tags})
    form.update(at_least_one=required, stop_after_first=stop_after_first)
    return {"type": "structural_tag", "format": form}


def _block(open_tag: str, close_tag: str, calls: list[dict[str, Any]], parallel: bool, required: bool,
           special: frozenset[str], line: str = "") -> dict[str, Any]:
    """A structural tag of one block (``open_tag`` ... ``close_tag``) holding ``calls``, one at most unless
    ``parallel``; ``line``: what comes after the open tag, between calls and before the close tag."""
    content: dict[str, Any] = {"type": "tags_with_separator", "tags": calls, "separator": line, "at_least_one": True,
                               "stop_after_first": not parallel}
    if line:
        content = {"type": "sequence", "elements": [literal(line), content, literal(line)]}
    block = {"type": "tag", "begin": _edge(open_tag, special), "content": content, "end": _edge(close_tag, special)}
    return _triggered([block], open_tag, special, required, stop_after_first=True)


class HermesParser(_Parser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the answer; a tag
    left open at the end is a call when the rest of the answer is one."""

    name = "hermes"
    tags: tuple[str, ...] = (HERMES_OPEN, HERMES_CLOSE)
    holds_calls = True
    held_layout = _HERMES_LAYOUT

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TagStream(content=content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """From ``<tool_call>`` on, a call as the format's chat templates show it (``<tool_call>``, a newline, then
        ``{"name": ..., "arguments": ...}``, a newline, ``</tool_call>``): triggered tags, one per function, the tags
        held as tokens where special."""
        return _tool_call_tags(functions, held, parallel, required, special, "json",
                               lambda name: f"{HERMES_HELD_BEGIN}{json.dumps(name)}{HERMES_HELD_ARGUMENTS}", "}\n")


def _tool_call_tags(functions: list[dict[str, Any]], held: frozenset[str], parallel: bool, required: bool,
                    special: frozenset[str], style: str, head: Callable[[str], str], tail: str,
                    text_trigger: str = "", wrap: tuple[str, str] = (HERMES_OPEN, HERMES_CLOSE)) -> dict[str, Any]:
    """Calls inside ``<tool_call>`` tags (or another ``wrap``): after the open tag, ``head(name)``, the arguments in
    ``style``, then ``tail`` and the close tag. Where the open tag is a token every tag begins with it, and what follows
    it is content; as text, each tag begins with its whole head (so the function is chosen as the text comes), and the
    tags start where the open tag and ``text_trigger`` come."""
    opener, closer = wrap

    def tag(f: dict[str, Any]) -> dict[str, Any]:
        if not special:  # all text: the head and the tail are the tag's own begin and end
            return {"type": "tag", "begin": opener + head(f["name"]), "content": _held(f, held, style),
                    "end": tail + closer}
        elements = [_held(f, held, style), *([literal(tail)] if tail else [])]
        if opener in special:
            begin: str | dict[str, Any] = _edge(opener, special)
            elements.insert(0, literal(head(f["name"])))
        else:
            begin = opener + head(f["name"])
        return {"type": "tag", "begin": begin, "content": {"type": "sequence", "elements": elements},
                "end": _edge(closer, special)}

    trigger = opener if opener in special else opener + text_trigger
    return _triggered([tag(f) for f in functions], trigger, special, required, stop_after_first=not parallel)


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


class _WholeAnswerStream:
    """An answer that is either calls throughout (read by ``read_calls`` once it ends) or content: it is held from
    the moment it opens with one of ``openers`` (after whitespace), and content streams as soon as it cannot."""

    def __init__(self, read_calls: Callable[[str], list[ToolCall] | None], openers: tuple[str, ...],
                 content: Content | None = None) -> None:
        self._read_calls, self._openers = read_calls, openers
        self._content = content or Content()
        self._buf = ""
        self._mode: str | None = None  # None until the start is known, then "calls" or "content"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return self._text(text)
        self._buf += text
        if self._mode == "calls":
            return []
        start = self._buf.lstrip()
        if start.startswith(self._openers):
            self._mode = "calls"
            return []
        if not start or any(opener.startswith(start) for opener in self._openers):
            return []
        self._mode = "content"
        text, self._buf = self._buf, ""
        return self._text(text)

    def finish(self) -> list[Event]:
        if self._mode == "content":
            return []
        text, self._buf = self._buf, ""
        calls = self._read_calls(text)
        if calls is None:
            return self._text(text)
        return [*calls]

    def _text(self, text: str) -> list[Event]:
        out = self._content.push(text)
        return [out] if out else []


# An answer of text under "auto" with strict functions, held so that the parser can read no calls out of it: empty,
# or not opening with "{", whitespace or "<|" (a call, spaced or after <|python_tag|>, would be read).
_LLAMA_TEXT = r"(?:[^{<\s][\s\S]*|<(?:[^|][\s\S]*)?)?"


_LLAMA_HEAD = _JSON_CALL_HEAD.replace('"arguments"', '"(?:parameters|arguments)"')  # (its parser takes either)


class Llama3JsonParser(_Parser):
    """The whole answer as one or more ``{"name": ..., "parameters": {...}}`` objects separated by
    ``;``, after an optional ``<|python_tag|>``; anything else is content. A stream that starts
    like calls is held to the end (the parser's; ``held_layout`` streams their arguments)."""

    name = "llama3_json"
    tags: tuple[str, ...] = ()  # (its <|python_tag|> prefix may be left out of the text: the calls are the same)
    holds_calls = True
    # Written freely: calls that open the answer, a "; " apart (its structural tag's are ``RequiredCalls``').
    held_layout = HeldLayout("", rf"{_WS}(?:{re.escape(_PYTHON_TAG)})?" + _LLAMA_HEAD, rf"{_WS}\}}",
                             next=rf"{_WS};" + _LLAMA_HEAD)

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _WholeAnswerStream(_llama_calls, ("{", _PYTHON_TAG), content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """The whole answer as the format's calls, since the parser reads calls only there: each ``{"name": NAME,
        "parameters": ARGS}`` as Llama 3's templates ask for them, several a ``; `` apart with parallel calls; under
        "auto" the answer may be text instead, of which no call can be read (``_LLAMA_TEXT``: it may not open with
        ``{``)."""
        calls = {"type": "tags_with_separator", "separator": "; ", "at_least_one": True, "stop_after_first": not parallel,
                 "tags": [{"type": "tag", "begin": f'{{"name": {json.dumps(f["name"])}, "parameters": ',
                           "content": _held(f, held), "end": "}"} for f in functions]}
        form = calls if required else {"type": "or", "elements": [calls, {"type": "regex", "pattern": _LLAMA_TEXT}]}
        return {"type": "structural_tag", "format": form}


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def _json_value(value: Any) -> bool:
    """Whether a Python literal is one JSON can write (a tuple as a list; no set, bytes, complex or infinite number;
    dicts keyed by strings)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_value(v) for k, v in value.items())
    return False


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls when the whole text (between Llama 4's ``<|python_start|>`` and ``<|python_end|>`` where written)
    is a Python list of calls, each a function's name and keyword arguments of literal values; None otherwise. The
    text is parsed (``ast``), never run."""
    text = text.strip()
    if text.startswith(_PYTHON_START):
        text = text[len(_PYTHON_START):].strip().removesuffix(_PYTHON_END)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # (**kwargs)
                return None
            try:
                value = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            if not _json_value(value):
                return None
            arguments[keyword.arg] = value
        call = _call({"name": node.func.id, "arguments": arguments}, "arguments", "parameters")
        if call is None:
            return None
        calls.append(call)
    return calls


class PythonicParser(_Parser):
    """The whole answer as a Python list of calls, ``[get_weather(city="Paris"), get_time()]``, keyword arguments of
    literal values (strings, numbers, ``True`` / ``False`` / ``None``, lists, dicts), between Llama 4's
    ``<|python_start|>`` and ``<|python_end|>`` or not; anything else is content. A stream that starts like calls is
    held to the end. The arguments come out as JSON (``True`` as ``true``, a tuple as a list); a value JSON cannot
    write (a set, bytes, a complex or infinite number) or a positional argument makes the answer content."""

    tags: tuple[str, ...] = ()  # (Llama 4's wrapper may be left out of the text: the calls are the same)

    def __init__(self, name: str) -> None:
        self.name = name

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _WholeAnswerStream(_pythonic_calls, ("[", _PYTHON_START), content)


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


class _TrailingCallsStream:
    """Content, then from the first of ``tags`` on calls to the end of the answer, read by ``read_calls`` once it
    ends (content, the tag kept, where they are none)."""

    def __init__(self, tags: tuple[str, ...], read_calls: Callable[[str], list[ToolCall] | None],
                 content: Content | None = None) -> None:
        self._tags, self._read_calls = tags, read_calls
        self._content = content or Content()
        self._buf = ""
        self._tag = ""
        self._calls: str | None = None  # what follows the tag, held to the end

    def feed(self, text: str) -> list[Event]:
        if self._calls is not None:
            self._calls += text
            return []
        self._buf += text
        found = [(i, tag) for tag in self._tags if (i := self._buf.find(tag)) >= 0]
        if found:
            start, self._tag = min(found)
            out, self._calls, self._buf = self._buf[:start], self._buf[start + len(self._tag):], ""
        else:
            keep = len(self._buf) - max(partial_suffix(self._buf, tag) for tag in self._tags)
            out, self._buf = self._buf[:keep], self._buf[keep:]
        events: list[Event] = []
        add_event(events, self._content.push(out))
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._calls is None:
            add_event(events, self._content.push(self._buf))
        else:
            calls = self._read_calls(self._calls)
            if calls is None:
                add_event(events, self._content.push(self._tag + self._calls))
            else:
                events.extend(calls)
        self._buf, self._calls = "", None
        return events


def _array_tag(tag: str, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool, required: bool,
               special: frozenset[str]) -> dict[str, Any]:
    """From ``tag`` on, one JSON array of ``{"name", "arguments"}`` calls to the answer's end (``json_array_calls``)."""
    array = {"type": "json_schema", "json_schema": calls_array_schema(functions, held, parallel)}
    return _triggered([{"type": "tag", "begin": _edge(tag, special), "content": array, "end": ""}], tag, special,
                      required, stop_after_first=True)


# Mistral v11's held calls: ``NAME[ARGS]{...}`` after each ``[TOOL_CALLS]``, to the answer's end.
_MISTRAL_V11_LAYOUT = HeldLayout(_MISTRAL_TAG, rf"{_WS}(?P<name>{_NAME_CHARS}){_WS}{re.escape(_MISTRAL_ARGS)}", "")


def _array_layout(*triggers: str) -> HeldLayout:
    """After one of ``triggers``, a JSON array of ``{"name": ..., "arguments": {...}}`` calls (``json_array_calls``)."""
    return HeldLayout(triggers[0], rf"{_WS}\[" + _JSON_CALL_HEAD, rf"{_WS}\}}", next=f"{_WS}," + _JSON_CALL_HEAD,
                      close=rf"{_WS}\]", also=triggers[1:])


_MISTRAL_ARRAY_LAYOUT = _array_layout(_MISTRAL_TAG)  # (tokenizers before v11)


class MistralParser(_Parser):
    """``[TOOL_CALLS]`` and the calls to the end of the answer: a JSON array of ``{"name": ...,
    "arguments": {...}}``, or (v11 tokenizers) ``name[ARGS]{...}``; the text before it is content.
    ``[TOOL_CALLS]`` is a special token: the router keeps special tokens' text for these answers."""

    name = "mistral"
    tags: tuple[str, ...] = (_MISTRAL_TAG, _MISTRAL_ARGS)
    holds_calls = True
    held_layout = None  # which form the calls take depends on the tokenizer: ``layout_for``

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TrailingCallsStream((_MISTRAL_TAG,), _mistral_calls, content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """From ``[TOOL_CALLS]`` on, the calls as the model's tokenizer version writes them: where ``[ARGS]`` is one of
        its special tokens (v11 on), ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (a tag per function), else one JSON array
        of ``{"name", "arguments"}`` objects. Each tag the tokenizer makes special is held as that token (xgrammar's
        token formats), not as text the model could also spell from smaller tokens."""
        if _MISTRAL_ARGS not in special:
            return _array_tag(_MISTRAL_TAG, functions, held, parallel, required, special)
        tags = [{"type": "tag", "begin": _edge(_MISTRAL_TAG, special), "end": "", "content": {
            "type": "sequence", "elements": [literal(f["name"]), _marker(_MISTRAL_ARGS, special), _held(f, held)]}}
            for f in functions]
        return _triggered(tags, _MISTRAL_TAG, special, required, stop_after_first=not parallel)

    def layout_for(self, special: frozenset[str]) -> HeldLayout | None:
        """How the calls are written where the tokenizer has ``special`` (``call_tag``): v11's ``NAME[ARGS]{...}``
        after each ``[TOOL_CALLS]``, else one JSON array of calls after it."""
        return _MISTRAL_V11_LAYOUT if _MISTRAL_ARGS in special else _MISTRAL_ARRAY_LAYOUT

    def new_call_id(self, name: str, index: int) -> str:
        """Nine letters and digits: Mistral's chat templates refuse any other id when a conversation
        brings the calls back."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


_GRANITE_TAGS = ("<|tool_call|>", HERMES_OPEN)


class GraniteParser(_Parser):
    """IBM Granite 3's calls: ``<|tool_call|>`` (or, as later Granite 3 models also write it, ``<tool_call>``) and a
    JSON array of ``{"name": ..., "arguments": {...}}`` to the end of the answer; the text before it is content, and
    an array that is not one is content with its tag."""

    name = "granite"
    tags: tuple[str, ...] = _GRANITE_TAGS[:1]
    holds_calls = True
    held_layout = _array_layout(*_GRANITE_TAGS)

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TrailingCallsStream(_GRANITE_TAGS, json_array_calls, content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """From ``<|tool_call|>`` on, the calls as one JSON array (held as that token where special)."""
        return _array_tag(_GRANITE_TAGS[0], functions, held, parallel, required, special)


_SEED_WRAP = ("<seed:tool_call>", "</seed:tool_call>")


# Qwen3-Coder's call: a <function=NAME> element holding <parameter=KEY> elements, each value on its own lines.
_XML_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>(.*?)</parameter>", re.DOTALL)


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (as vLLM's qwen3_coder parser reads it): a string as written;
    an integer, a number or a boolean where the text is one; ``null`` as None; an object, an array or an untyped
    value as the JSON the text is, else the text."""
    if text.lower() == "null":
        return None
    if xml_text_value(schema):
        return text
    kind = _xml_kind(schema)
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return text
    if kind == "number":
        try:
            number = _finite_float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), text)
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return text


def xml_value_json(text: str, schema: Any) -> str:
    """A parameter's value (``_xml_value``) as the JSON a call's arguments give it; the text as a string where the
    value holds what UTF-8 cannot encode (a lone surrogate's escape)."""
    value = json.dumps(_xml_value(text, schema), ensure_ascii=False)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(text, ensure_ascii=False)
    return value


def _xml_kind(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind


def xml_text_value(schema: Any) -> bool:
    """Whether a parameter of this schema is its text as written (``_xml_value``), whatever the text (but ``null``):
    a string, or a parameter the function does not declare."""
    return schema is None or _xml_kind(schema) == "string"


def _qwen_xml_call(body: str, functions: Sequence[dict[str, Any]]) -> ToolCall | None:
    """The call a ``<tool_call>`` body holds in Qwen3-Coder's form, its arguments typed by the function's schema,
    or None when the body is not one."""
    match = _XML_FUNCTION.fullmatch(body)
    if match is None:
        return None
    name, inner = match[1].strip(), match[2]
    schemas = parameter_schemas(functions, name)
    arguments: dict[str, Any] = {}
    pos = 0
    for parameter in _XML_PARAMETER.finditer(inner):
        if parameter.start() != pos:
            return None
        key, value = parameter[1].strip(), parameter[2]
        value = value.removeprefix("\n").removesuffix("\n")  # the value sits on lines of its own
        arguments[key] = _xml_value(value, schemas.get(key))
        pos = parameter.end()
    if inner[pos:].strip() or not name:
        return None
    return _call({"name": name, "arguments": arguments}, "arguments", "parameters")


class Qwen3CoderParser(_Parser):
    """Qwen3-Coder's (and Qwen3.5's) calls: ``<tool_call>``, ``<function=NAME>``, one ``<parameter=KEY>`` element per
    argument with its value on lines of its own, ``</function>``, ``</tool_call>``, anywhere in the answer. A value
    takes its type from the function's schema (``_xml_value``); a tag whose body is not such a call is content.
    ``seed_oss`` (ByteDance's Seed-OSS): the same calls inside ``<seed:tool_call>`` and ``</seed:tool_call>``."""

    holds_calls = True

    def __init__(self, name: str, wrap: tuple[str, str] = (HERMES_OPEN, HERMES_CLOSE)) -> None:
        self.name, self._wrap = name, wrap
        self.tags: tuple[str, ...] = wrap
        self.held_layout = HeldLayout(wrap[0], rf"{_WS}<function=(?P<name>[^<>\n]+)>",
                                      f"{_WS}</function>{_WS}{re.escape(wrap[1])}",
                                      XmlArguments(rf"{_WS}<parameter=(?P<key>[^<>\n]+)>", "</parameter>",
                                                   trim_newlines=True))

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TagStream(_one(functools.partial(_qwen_xml_call, functions=functions)), *self._wrap, content=content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """From ``<tool_call>`` and ``<function=`` on, a call as the format's chat templates show it, its parameters in
        xgrammar's ``qwen_xml`` style (the XML elements above, typed by the schema): triggered tags, one per function,
        the tags held as tokens where special (``held_layout``)."""
        return _tool_call_tags(functions, held, parallel, required, special, "qwen_xml",
                               lambda name: f"\n<function={name}>\n", "\n</function>\n", "\n<function=", self._wrap)


def parameter_schemas(functions: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schemas of a function's parameters, by name (none for a function the request does not offer)."""
    properties = next(((f.get("parameters") or {}).get("properties") for f in functions if f.get("name") == name), None)
    return properties if isinstance(properties, dict) else {}


def _typed_call(name: str, pairs: list[tuple[str, str]], functions: Sequence[dict[str, Any]]) -> ToolCall | None:
    """A call whose arguments are written as key and value texts, each value typed by its schema (``_xml_value``)."""
    schemas = parameter_schemas(functions, name)
    arguments = {key: _xml_value(value, schemas.get(key)) for key, value in pairs}
    return _call({"name": name, "arguments": arguments}, "arguments", "parameters")


def _pairs(pattern: re.Pattern[str], text: str) -> list[tuple[str, str]] | None:
    """Every match of ``pattern`` (key, value) in ``text``, back to back (whitespace between them), or None when
    anything else is there."""
    pairs, pos = [], 0
    for match in pattern.finditer(text):
        if text[pos:match.start()].strip():
            return None
        pairs.append((match[1].strip(), match[2]))
        pos = match.end()
    return pairs if not text[pos:].strip() else None


_NAME = re.compile(r"[^\s<>{}\[\]\"',:;]+")
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_call(body: str, functions: Sequence[dict[str, Any]]) -> ToolCall | None:
    """GLM's call: the function's name, then an ``<arg_key>`` and ``<arg_value>`` pair per argument (GLM-4.5 and
    4.6 put each on a line of its own, GLM-4.7 and 5 write them side by side)."""
    name, sep, rest = body.partition("<arg_key>")
    name = name.strip()
    pairs = _pairs(_GLM_ARGUMENT, sep + rest)
    if pairs is None or not _NAME.fullmatch(name):
        return None
    return _typed_call(name, pairs, functions)


class GlmParser(_Parser):
    """GLM-4.5, 4.6, 4.7 and 5's calls: ``<tool_call>NAME``, ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``
    per argument (with or without newlines between), ``</tool_call>``, anywhere in the answer. A value takes its type
    from the function's schema, as in Qwen3-Coder's calls; a tag whose body is not such a call is content."""

    # (GLM's tokenizers make all of them special tokens)
    tags: tuple[str, ...] = (HERMES_OPEN, HERMES_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    holds_calls = True
    held_layout = HeldLayout(HERMES_OPEN, rf"{_WS}(?P<name>{_NAME_CHARS})(?=[\s<])", f"{_WS}{re.escape(HERMES_CLOSE)}",
                             XmlArguments(f"{_WS}<arg_key>(?P<key>[^<>]*)</arg_key>{_WS}<arg_value>", "</arg_value>",
                                          trim_newlines=False))

    def __init__(self, name: str) -> None:
        self.name = name

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TagStream(_one(functools.partial(_glm_call, functions=functions)), content=content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """From ``<tool_call>`` on, one call per tag, its arguments in xgrammar's ``glm_xml`` style (the pairs, with or
        without whitespace between); ``<tool_call>`` and ``</tool_call>`` held as tokens where special."""
        tags = [{"type": "tag", "begin": _edge(HERMES_OPEN, special), "end": _edge(HERMES_CLOSE, special),
                 "content": {"type": "sequence", "elements": [literal(f["name"]), _held(f, held, "glm_xml")]}}
                for f in functions]
        return _triggered(tags, HERMES_OPEN, special, required, stop_after_first=not parallel)


_MINIMAX_OPEN = "<minimax:tool_call>"
_MINIMAX_CLOSE = "</minimax:tool_call>"
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"<>]*)">(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"<>]*)">(.*?)</parameter>', re.DOTALL)


def _minimax_calls(body: str, functions: Sequence[dict[str, Any]]) -> list[ToolCall] | None:
    """The ``<invoke>`` elements of a MiniMax-M2 tool-call block, each a call; None when the block holds anything
    else."""
    invokes = _pairs(_MINIMAX_INVOKE, body)
    if not invokes:
        return None
    calls = []
    for name, inner in invokes:
        pairs = _pairs(_MINIMAX_PARAMETER, inner)
        if pairs is None or not _NAME.fullmatch(name):
            return None
        call = _typed_call(name, [(k, v.removeprefix("\n").removesuffix("\n")) for k, v in pairs], functions)
        if call is None:
            return None
        calls.append(call)
    return calls


class MiniMaxM2Parser(_Parser):
    """MiniMax-M2's calls: a ``<minimax:tool_call>`` block holding one ``<invoke name="NAME">`` element per call, each
    with a ``<parameter name="KEY">VALUE</parameter>`` per argument, typed by the function's schema; a block that
    holds anything else is content."""

    name = "minimax_m2"
    tags: tuple[str, ...] = (_MINIMAX_OPEN, _MINIMAX_CLOSE)
    holds_calls = True
    _invoke = rf'{_WS}<invoke name="(?P<name>{_NAME_CHARS})">'
    held_layout = HeldLayout(_MINIMAX_OPEN, _invoke, f"{_WS}</invoke>",
                             XmlArguments(f'{_WS}<parameter name="(?P<key>[^"<>]*)">', "</parameter>",
                                          trim_newlines=True),
                             next=_invoke, close=f"{_WS}{re.escape(_MINIMAX_CLOSE)}")

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TagStream(functools.partial(_minimax_calls, functions=functions), _MINIMAX_OPEN, _MINIMAX_CLOSE, content=content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """One ``<minimax:tool_call>`` block of ``<invoke>`` elements, their parameters in xgrammar's ``minimax_xml``
        style."""
        invokes = [{"type": "tag", "begin": f'<invoke name="{f["name"]}">\n', "content": _held(f, held, "minimax_xml"),
                    "end": "</invoke>"} for f in functions]
        return _block(_MINIMAX_OPEN, _MINIMAX_CLOSE, invokes, parallel, required, special, line="\n")


_DEEPSEEK_OPEN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DEEPSEEK_CLOSE = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_DEEPSEEK_CALL_OPEN, _DEEPSEEK_SEP, _DEEPSEEK_CALL_CLOSE = (
    "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>")
_DEEPSEEK_CALL = re.compile(f"{_DEEPSEEK_CALL_OPEN}(.*?){_DEEPSEEK_SEP}(.*?){_DEEPSEEK_CALL_CLOSE}", re.DOTALL)
_DEEPSEEK_V3_ARGUMENTS = re.compile(r"([^\n]*)\n```json\n(.*)\n```", re.DOTALL)


def _deepseek_calls(body: str) -> list[ToolCall] | None:
    """The calls of a DeepSeek tool-call block: V3's (``function``, the separator, the name, then the arguments in
    a json code block) or V3.1's (the name, the separator, the arguments)."""
    found = _pairs(_DEEPSEEK_CALL, body)
    if not found:
        return None
    calls = []
    for left, right in found:
        name, arguments = left, right
        if left == "function" and (v3 := _DEEPSEEK_V3_ARGUMENTS.fullmatch(right.strip())):
            name, arguments = v3[1], v3[2]
        call = _call({"name": name.strip(), "arguments": arguments}, "arguments", "parameters")
        if call is None or not _NAME.fullmatch(call.name):
            return None
        calls.append(call)
    return calls


class DeepSeekParser(_Parser):
    """DeepSeek-V3's and V3.1's calls (R1-0528, V3-0324, V3.1, V3.2-Exp's chat templates): ``<｜tool▁calls▁begin｜>``,
    per call ``<｜tool▁call▁begin｜>``, the function and its JSON arguments around ``<｜tool▁sep｜>`` (V3:
    ``function<｜tool▁sep｜>NAME`` and a json code block; V3.1: ``NAME<｜tool▁sep｜>{...}``), ``<｜tool▁call▁end｜>``,
    then ``<｜tool▁calls▁end｜>``; a block that holds anything else is content."""

    tags: tuple[str, ...] = (_DEEPSEEK_OPEN, _DEEPSEEK_CLOSE, _DEEPSEEK_CALL_OPEN, _DEEPSEEK_SEP, _DEEPSEEK_CALL_CLOSE)
    holds_calls = True

    def __init__(self, name: str) -> None:
        self.name = name
        sep = re.escape(_DEEPSEEK_SEP)
        head = (rf"function{_WS}{sep}{_WS}(?P<name>{_NAME_CHARS})[ \t]*\n```json\n" if name == "deepseek_v3"
                else rf"(?P<name>{_NAME_CHARS}){_WS}{sep}")
        head = f"{_WS}{re.escape(_DEEPSEEK_CALL_OPEN)}{_WS}{head}"
        end = f"{_WS}{'```' + _WS if name == 'deepseek_v3' else ''}{re.escape(_DEEPSEEK_CALL_CLOSE)}"
        self.held_layout = HeldLayout(_DEEPSEEK_OPEN, head, end, next=head, close=f"{_WS}{re.escape(_DEEPSEEK_CLOSE)}")

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TagStream(_deepseek_calls, _DEEPSEEK_OPEN, _DEEPSEEK_CLOSE, content=content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """One block of calls in the form this parser's name says (``deepseek_v3``: V3's json code blocks; else
        V3.1's bare arguments), each tag held as its token where special."""
        def call(f: dict[str, Any]) -> dict[str, Any]:
            if self.name == "deepseek_v3":
                elements = [literal("function"), _marker(_DEEPSEEK_SEP, special), literal(f"{f['name']}\n```json\n"),
                            _held(f, held), literal("\n```")]
            else:
                elements = [literal(f["name"]), _marker(_DEEPSEEK_SEP, special), _held(f, held)]
            return {"type": "tag", "begin": _edge(_DEEPSEEK_CALL_OPEN, special),
                    "content": {"type": "sequence", "elements": elements}, "end": _edge(_DEEPSEEK_CALL_CLOSE, special)}

        return _block(_DEEPSEEK_OPEN, _DEEPSEEK_CLOSE, [call(f) for f in functions], parallel, required, special)


_KIMI_OPEN, _KIMI_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL_OPEN, _KIMI_ARGUMENTS, _KIMI_CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_CALL = re.compile(f"{re.escape(_KIMI_CALL_OPEN)}(.*?){re.escape(_KIMI_ARGUMENTS)}(.*?){re.escape(_KIMI_CALL_CLOSE)}",
                        re.DOTALL)
_KIMI_ID = re.compile(r"functions\.([^\s:]+):(\d+)")


def _kimi_calls(body: str) -> list[ToolCall] | None:
    """The calls of a Kimi K2 tool-call section, each with the id the model wrote (``functions.NAME:INDEX``)."""
    found = _pairs(_KIMI_CALL, body)
    if not found:
        return None
    calls = []
    for call_id, arguments in found:
        match = _KIMI_ID.fullmatch(call_id)
        call = _call({"name": match[1], "arguments": arguments}, "arguments", "parameters") if match else None
        if call is None or not _NAME.fullmatch(call.name):
            return None
        calls.append(ToolCall(call.name, call.arguments, call_id))
    return calls


class KimiK2Parser(_Parser):
    """Kimi K2's calls: ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>``, its id
    ``functions.NAME:INDEX``, ``<|tool_call_argument_begin|>``, its JSON arguments, ``<|tool_call_end|>``, then
    ``<|tool_calls_section_end|>``; a section that holds anything else is content. The id the model wrote is the call's
    id: Kimi's template writes a call back by its id, which names the function. Calls the router forces take ids of
    that form."""

    name = "kimi_k2"
    tags: tuple[str, ...] = (_KIMI_OPEN, _KIMI_CLOSE, _KIMI_CALL_OPEN, _KIMI_ARGUMENTS, _KIMI_CALL_CLOSE)
    holds_calls = True
    _head = (rf"{_WS}{re.escape(_KIMI_CALL_OPEN)}{_WS}(?P<id>functions\.(?P<name>[^\s:<>{{}}\[\]\"',;]+):[0-9]{{1,6}})"
             + _WS + re.escape(_KIMI_ARGUMENTS))
    held_layout = HeldLayout(_KIMI_OPEN, _head, f"{_WS}{re.escape(_KIMI_CALL_CLOSE)}", next=_head,
                             close=f"{_WS}{re.escape(_KIMI_CLOSE)}")

    def stream(self, functions: Sequence[dict[str, Any]] = (), content: Content | None = None) -> ToolCallStream:
        return _TagStream(_kimi_calls, _KIMI_OPEN, _KIMI_CLOSE, content=content)

    def call_tag(self, functions: list[dict[str, Any]], held: frozenset[str], parallel: bool,
                 required: bool, special: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """One section of calls, each ``functions.NAME:INDEX`` (any index) then its arguments, each tag held as its
        token where special."""
        calls = [{"type": "tag", "begin": _edge(_KIMI_CALL_OPEN, special), "end": _edge(_KIMI_CALL_CLOSE, special),
                  "content": {"type": "sequence", "elements": [
                      literal(f"functions.{f['name']}:"), {"type": "regex", "pattern": "[0-9]{1,6}"},
                      _marker(_KIMI_ARGUMENTS, special), _held(f, held)]}} for f in functions]
        return _block(_KIMI_OPEN, _KIMI_CLOSE, calls, parallel, required, special)

    def new_call_id(self, name: str, index: int) -> str:
        return f"functions.{name}:{index}"


PARSERS: dict[str, ToolCallParser] = {
    p.name: p for p in (HermesParser(), Qwen3CoderParser("qwen3_coder"), Qwen3CoderParser("seed_oss", _SEED_WRAP),
                        Llama3JsonParser(), MistralParser(), GlmParser("glm45"),
                        GlmParser("glm47"), MiniMaxM2Parser(), DeepSeekParser("deepseek_v3"), DeepSeekParser("deepseek_v31"),
                        KimiK2Parser(), PythonicParser("pythonic"), PythonicParser("llama4_pythonic"), GraniteParser())
}


def detect_parser(chat_template: str | None) -> str | None:
    """The parser for the tool-call format a chat template teaches its model, or None."""
    if not chat_template:
        return None
    if "[func_name1(" in chat_template:  # (the pythonic templates' example of a call list)
        return "llama4_pythonic" if "<|python_start|>" in chat_template or "<|header_start|>" in chat_template else "pythonic"
    if _GRANITE_TAGS[0] in chat_template:
        return "granite"
    if _SEED_WRAP[0] in chat_template:
        return "seed_oss"
    if HERMES_OPEN in chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if HERMES_OPEN in chat_template and "<arg_key>" in chat_template:
        return "glm45"
    if _MINIMAX_OPEN in chat_template:
        return "minimax_m2"
    if _KIMI_OPEN in chat_template:
        return "kimi_k2"
    if _DEEPSEEK_OPEN in chat_template:  # V3's templates write the arguments in a json code block
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if HERMES_OPEN in chat_template:
        return "hermes"
    if _MISTRAL_TAG in chat_template:
        return "mistral"
    if _PYTHON_TAG in chat_template or (
        "<|start_header_id|>" in chat_template and "parameters" in chat_template
    ):
        return "llama3_json"
    return None
