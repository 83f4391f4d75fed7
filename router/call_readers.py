"""Tool calls read as the answer streams: each call opens (``CallStart``) once its name is read, and its arguments go
out as they are written (``ArgumentsPiece``), so a stream's pieces join into a whole response's arguments, character
for character; the text around the calls is content. A whole response is read by the same reader (``read_pieces``).

* ``RequiredCalls``: a ``"required"`` answer, a JSON array of calls (``ToolPlan.structured_output``'s grammar), or
  Llama 3's calls as its structural tag holds them (``LLAMA3_CALLS``; under "auto", text instead).
* ``TaggedCalls``: calls in a format's own layout (hermes', Qwen3-Coder's and Seed-OSS's, GLM's, MiniMax-M2's,
  DeepSeek's, Kimi K2's, Mistral's (both forms), Granite's, Llama 3's written freely: their parsers' ``held_layout``), whether its structural tag held them or the model wrote
  them freely under ``"auto"`` (``calls_reader``). JSON arguments go out as written; XML ones (one element per
  argument) as the JSON object their parser makes of them, a string argument's text as it comes.

Text that leaves the layout is content, or the format's parser's to read (a freely written call in another layout):
nothing the model wrote is lost.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import regex

from router.tool_parsers import (
    Content,
    HeldLayout,
    Llama3JsonParser,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    add_event,
    parameter_schemas,
    partial_suffix,
    xml_text_value,
    xml_value_json,
)


@dataclass(frozen=True)
class CallStart:
    """A call opens: its name is known (and its id, where the model writes it), its arguments follow."""

    name: str
    call_id: str | None = None


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of the open call's arguments, as written."""

    text: str


# What a calls reader gives: content text, a call opening, a piece of its arguments.
PieceEvent = str | CallStart | ArgumentsPiece


E = TypeVar("E")


class Stepper(Generic[E]):
    """A reader of an answer as it streams (these, and gpt-oss's harmony format's): ``feed`` reads as far as the text
    so far allows (``_step`` until it must wait), ``finish`` the rest."""

    _buf: str

    def feed(self, text: str) -> list[E]:
        self._buf += text
        events: list[E] = []
        while self._buf and self._step(events):
            pass
        return events

    def finish(self) -> list[E]:
        raise NotImplementedError

    def _step(self, events: list[E]) -> bool:
        """Reads what it can of the buffer; False when it must wait for more text."""
        raise NotImplementedError


CallsReader = Stepper[PieceEvent]


def _closing_quote(text: str, start: int) -> int | None:
    """Where the JSON string whose characters begin at ``start`` of ``text`` closes (its closing quote), or None
    while it has not."""
    escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return i
    return None


class _JsonScan:
    """Where a JSON text written piece by piece leaves the value it is in: its first closing bracket or brace, outside
    strings, that nothing in the text opened."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def closer(self, text: str) -> int | None:
        """The closer's index in this piece (None while it has not come); the pieces before were read."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:
                    return i
                self._depth -= 1
        return None


@dataclass(frozen=True)
class CallsLayout:
    """Where a grammar holds calls of JSON objects one after another (``RequiredCalls``): the text before the first,
    a call's up to its name's string, between its name and its arguments, between two calls, and after the last
    (None: the calls end with the answer)."""

    open: str
    item: str
    key: str
    next: str
    close: str | None


# The grammar of a "required" answer (xgrammar's, from ``ToolPlan.structured_output``) writes the array with these
# separators and each call's keys in this order, and no other whitespace.
JSON_ARRAY = CallsLayout("[", '{"name": "', ', "arguments": ', ", ", "]")
# Llama 3's calls as its structural tag holds them (``Llama3JsonParser.call_tag``): the whole answer.
LLAMA3_CALLS = CallsLayout("", '{"name": "', ', "parameters": ', "; ", None)


class RequiredCalls(CallsReader):
    """A ``"required"`` answer, ``[{"name": "...", "arguments": ...}, ...]`` (or calls in another ``layout``: Llama
    3's), read as it streams: each call opens when its name's string closes, and its arguments go out as they are
    written (so a stream's pieces join into a whole response's arguments, character for character).

    Text that leaves that layout (an engine that did not hold the answer to the grammar), or a call
    past ``max_calls``, is content from there on, the array's text before it included while no call
    has opened: nothing the model wrote is lost. An answer cut short ends with its last call's
    arguments cut short, as a named call's are, and as OpenAI's are at ``finish_reason: length``."""

    def __init__(self, max_calls: int | None = None, layout: CallsLayout = JSON_ARRAY, trim: bool = False) -> None:
        self._max_calls = max_calls
        self._layout = layout
        # ``trim``: content as a format's parser gives it, the answer's leading and trailing whitespace out (Llama
        # 3's text under "auto", as its parser's stream leaves it).
        self._content = Content() if trim else None
        self._buf = ""  # text not read yet
        self._unspent = ""  # read, but part of no call yet: content if the layout breaks
        self._state = "open"  # open, item, name, key, arguments, close, next, done, content
        self._scan = _JsonScan()
        self.num_calls = 0

    def finish(self) -> list[PieceEvent]:
        """What is left: content where the answer stopped outside a call's arguments."""
        rest = "" if self._state in ("arguments", "done") else self._unspent + self._buf
        self._buf = self._unspent = ""
        self._state = "done"
        events: list[PieceEvent] = []
        self._add_content(events, rest)
        return events

    def _add_content(self, events: list[PieceEvent], text: str) -> None:
        add_event(events, self._content.push(text) if self._content is not None else text)

    def _step(self, events: list[PieceEvent]) -> bool:
        """Reads what it can of the buffer; False when it must wait for more text."""
        state = self._state
        if state == "content":
            self._add_content(events, self._unspent + self._buf)
            self._buf = self._unspent = ""
            return False
        layout = self._layout
        if state == "open":
            return self._literal(layout.open, "item")
        if state == "item":
            if self._max_calls is not None and self.num_calls >= self._max_calls:
                self._state = "content"
                return True
            return self._literal(layout.item, "name")
        if state == "name":
            return self._name(events)
        if state == "key":
            return self._literal(layout.key, "arguments")
        if state == "arguments":
            return self._arguments(events)
        if state == "close":
            return self._literal("}", "next")
        if state == "next":
            if layout.close is not None and self._buf.startswith(layout.close):
                return self._literal(layout.close, "done")
            return self._literal(layout.next, "item")
        self._state = "content"  # text after the array's end
        return True

    def _literal(self, literal: str, then: str) -> bool:
        if self._buf.startswith(literal):
            if then == "name" or self.num_calls == 0:  # the array's and an item's opening, not a call's
                self._unspent += literal
            self._buf = self._buf[len(literal):]
            self._state = then
            return True
        if not literal.startswith(self._buf):
            self._state = "content"
            return True
        return False  # the literal's start so far

    def _name(self, events: list[PieceEvent]) -> bool:
        end = _closing_quote(self._buf, 0)
        if end is None:
            return False
        try:
            name = json.loads('"' + self._buf[: end + 1])
        except ValueError:
            self._state = "content"
            return True
        events.append(CallStart(name))
        self.num_calls += 1
        self._buf, self._unspent = self._buf[end + 1:], ""
        self._state = "key"
        return True

    def _arguments(self, events: list[PieceEvent]) -> bool:
        """The arguments' JSON value, up to the call's closing brace (not its own)."""
        i = self._scan.closer(self._buf)
        if i is None:
            events.append(ArgumentsPiece(self._buf))
            self._buf = ""
            return False
        if i:
            events.append(ArgumentsPiece(self._buf[:i]))
        self._buf, self._unspent = self._buf[i:], ""
        self._state = "close"
        return True


def _escaped(text: str) -> str:
    """Text as it stands inside a JSON string (each character escaped on its own, so pieces join into the whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class TaggedCalls(CallsReader):
    """An answer whose calls are written in a format's layout (``HeldLayout``: calls in tags of their own, or in a
    block), read as it streams. Each call opens once its head (its name, and its id where written) is read, and JSON
    arguments' opening brace. Its arguments go out as they are written where they are JSON. Where they are XML
    elements, they go out as the JSON object the format's parser makes of them (``_xml_value``; keys in the order
    written): a key as soon as its element opens, a string's text as it comes, any other value once its element
    closes. Either way a stream's pieces join into a whole response's arguments, character for character.

    Text outside the calls is content, as the format's parser's stream gives it (the answer's leading and trailing
    whitespace out). Where an opening's text leaves the layout before a call opens, the format's parser reads the
    answer from that opening on, its calls whole (``fallback``: an answer the model wrote freely), or, without one,
    the opening is content and reading goes on after it (an engine that did not hold the answer to the tag). Past a
    call's head, what leaves the layout is read as text from there: the call's arguments end where they left it. A
    call past ``max_calls`` (``parallel_tool_calls: false``) and all after it are content where a tag held them;
    written freely, each such call is left out, as the parser's are. An answer cut short inside a call ends with its
    arguments cut short, as OpenAI's are."""

    def __init__(self, layout: HeldLayout, functions: Sequence[dict[str, Any]], max_calls: int | None = None,
                 fallback: Callable[[Content], ToolCallStream] | None = None) -> None:
        self._layout = layout
        self._triggers = (layout.trigger, *layout.also)
        # A call with JSON arguments opens with them: its head is read once their "{" follows.
        opens = "" if layout.xml is not None else r"(?=[ \n\r\t]*\{)"
        self._head, self._end = regex.compile(layout.head + opens), regex.compile(layout.end)
        self._next = regex.compile(layout.next + opens) if layout.next is not None else None
        self._close = regex.compile(layout.close) if layout.close is not None else None
        self._key = regex.compile(layout.xml.key) if layout.xml is not None else None
        self._functions = functions
        self._max_calls = max_calls
        self._fallback = fallback
        self._parser: ToolCallStream | None = None  # the fallback's stream, once it reads the rest
        self._dropped = False  # whether the open call is one past ``max_calls`` that is left out
        self._content = Content()
        self._buf = ""
        self._tag: str | None = None  # the opening read, while no call has opened after it: content if the layout breaks
        self._state = "text"  # text, head, next, arguments (JSON), params, value (XML), end, content, parser
        self.num_calls = 0
        # The open call's arguments:
        self._scan: _JsonScan | None = None  # JSON, once its "{" is read
        self._schemas: dict[str, Any] = {}  # XML: the function's parameters' schemas
        self._num_keys = 0
        self._parts: list[str] = []  # the open element's text so far
        self._value_schema: Any = None
        # A string value written as it comes: whether its opening quote went out, whether its first character (a
        # newline the layout trims) is still to come, and its text read but not written yet.
        self._quoted = False
        self._lead = False
        self._unsent = ""

    def finish(self) -> list[PieceEvent]:
        """What is left: content, unless the answer stopped inside a call or a block of calls."""
        events: list[PieceEvent] = []
        if self._parser is not None:
            self._parsed(events, self._parser.finish())
        elif self._state in ("text", "head", "content"):
            add_event(events, self._content.push((self._tag or "") + self._buf))
        self._buf, self._tag = "", None
        self._state = "text"
        return events

    def _step(self, events: list[PieceEvent]) -> bool:
        state = self._state
        if self._parser is not None:
            self._parsed(events, self._parser.feed(self._buf))
            self._buf = ""
            return False
        if state == "content":
            add_event(events, self._content.push(self._buf))
            self._buf = ""
            return False
        if state == "text":
            if not self._triggers:  # (calls that open the answer: none after)
                add_event(events, self._content.push(self._buf))
                self._buf = ""
                return False
            found = [(i, t) for t in self._triggers if (i := self._buf.find(t)) >= 0]
            if not found:
                keep = len(self._buf) - max(partial_suffix(self._buf, t) for t in self._triggers)
                add_event(events, self._content.push(self._buf[:keep]))
                self._buf = self._buf[keep:]
                return False
            start, trigger = min(found)
            add_event(events, self._content.push(self._buf[:start]))
            self._tag, self._buf, self._state = trigger, self._buf[start + len(trigger):], "head"
            if not trigger:  # the answer's start opens the calls, once
                self._triggers = ()
            return True
        if state == "head":
            return self._match(events, [(self._head, self._open)])
        if state == "next":  # another call, or the block's close (calls to the answer's end have none)
            assert self._next is not None
            return self._match(events, [(self._next, self._open),
                                        *([(self._close, lambda _m, _e: self._to("text"))] if self._close else [])])
        if self._dropped and state in ("arguments", "params", "value"):
            events = []  # (a call too many, written freely: read, and left out)
        if state == "arguments":
            return self._json(events)
        if state == "params":
            assert self._key is not None
            return self._match(events, [(self._key, self._open_value), (self._end, self._end_xml)])
        if state == "value":
            return self._value_text(events)
        return self._match(events, [(self._end, lambda _m, _e: self._to("next" if self._next else "text"))])

    def _to(self, state: str) -> None:
        self._state = state

    def _match(self, events: list[PieceEvent], choices: list[tuple[regex.Pattern[str], Any]]) -> bool:
        """The first pattern the buffer opens with, whole, taken (and its action run); False while one may still come;
        text that can open with none left the layout."""
        waiting = False
        for pattern, action in choices:
            m = pattern.match(self._buf, partial=True)
            if m is not None and not m.partial:
                self._buf = self._buf[m.end():]
                action(m, events)
                return True
            waiting = waiting or m is not None
        if waiting:
            return False
        if self._tag is not None and self._fallback is not None:  # no call opened after the opening: the parser's
            self._parser = self._fallback(self._content)
            self._buf, self._tag, self._state = self._tag + self._buf, None, "parser"
            return True
        if self._tag is not None:  # no call opened after the opening: it is content, and reading goes on after it
            add_event(events, self._content.push(self._tag))
        self._tag, self._state = None, "text"
        return True

    def _parsed(self, events: list[PieceEvent], parsed: list[str | ToolCall]) -> None:
        """The fallback parser's events: its content, and each call whole."""
        for event in parsed:
            if isinstance(event, str):
                add_event(events, event)
            elif self._max_calls is None or self.num_calls < self._max_calls:
                events += [CallStart(event.name, event.id), ArgumentsPiece(event.arguments)]
                self.num_calls += 1

    def _open(self, m: regex.Match[str], events: list[PieceEvent]) -> None:
        if self._max_calls is not None and self.num_calls >= self._max_calls and self._fallback is None:
            self._buf, self._tag, self._state = (self._tag or "") + m[0] + self._buf, None, "content"  # from here
            return
        name = m["name"]
        self._dropped = self._max_calls is not None and self.num_calls >= self._max_calls
        if not self._dropped:
            events.append(CallStart(name, m.groupdict().get("id")))
            self.num_calls += 1
        self._tag = None
        if self._key is None:
            self._scan, self._state = None, "arguments"
            return
        self._schemas, self._num_keys, self._state = parameter_schemas(self._functions, name), 0, "params"
        if not self._dropped:
            events.append(ArgumentsPiece("{"))

    def _json(self, events: list[PieceEvent]) -> bool:
        """JSON arguments: an object, as written (the whitespace before it left out)."""
        if self._scan is None:  # (the head was read where "{" follows)
            self._buf, self._scan = self._buf.lstrip()[1:], _JsonScan()
            events.append(ArgumentsPiece("{"))
        i = self._scan.closer(self._buf)
        if i is None:
            if self._buf:
                events.append(ArgumentsPiece(self._buf))
            self._buf = ""
            return False
        events.append(ArgumentsPiece(self._buf[: i + 1]))
        self._buf, self._state = self._buf[i + 1:], "end"
        return True

    def _end_xml(self, _m: regex.Match[str], events: list[PieceEvent]) -> None:
        events.append(ArgumentsPiece("}"))
        self._state = "next" if self._next else "text"

    def _open_value(self, m: regex.Match[str], events: list[PieceEvent]) -> None:
        key = m["key"].strip()
        events.append(ArgumentsPiece(f"{', ' if self._num_keys else ''}{json.dumps(key, ensure_ascii=False)}: "))
        self._num_keys += 1
        self._parts, self._value_schema, self._state = [], self._schemas.get(key), "value"
        self._quoted, self._lead, self._unsent = False, self._layout.xml is not None and self._layout.xml.trim_newlines, ""

    def _value_text(self, events: list[PieceEvent]) -> bool:
        """An XML argument's text, up to its element's end."""
        assert self._layout.xml is not None
        value_end = self._layout.xml.value_end
        end = self._buf.find(value_end)
        if end < 0:
            keep = len(self._buf) - partial_suffix(self._buf, value_end)
            self._parts.append(self._buf[:keep])
            self._stream_value(events, self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        trim = self._layout.xml.trim_newlines
        last = self._buf[:end]
        self._buf = self._buf[end + len(value_end):]
        if self._quoted:  # the rest of the string, its last newline the layout's
            rest = self._unsent + last
            events.append(ArgumentsPiece(_escaped(rest.removesuffix("\n") if trim else rest) + '"'))
        else:
            text = "".join(self._parts) + last
            if trim:
                text = text.removeprefix("\n").removesuffix("\n")
            events.append(ArgumentsPiece(xml_value_json(text, self._value_schema)))
        self._state = "params"
        return True

    def _stream_value(self, events: list[PieceEvent], added: str) -> None:
        """A string argument's text as it comes (``added``: what came now), but what may yet not be its own: a first
        and a last newline where the layout trims them, and text that may still be all ``null`` (which is null)."""
        assert self._layout.xml is not None
        if not added or not xml_text_value(self._value_schema):
            return
        if self._lead:
            added, self._lead = added.removeprefix("\n"), False
        pending = self._unsent + added
        ready = pending[:-1] if self._layout.xml.trim_newlines and pending.endswith("\n") else pending
        if not self._quoted:
            if "null".startswith(ready.lower()):
                self._unsent = pending
                return
            events.append(ArgumentsPiece('"' + _escaped(ready)))
            self._quoted = True
        elif ready:
            events.append(ArgumentsPiece(_escaped(ready)))
        self._unsent = pending[len(ready):]


def calls_reader(parser: ToolCallParser, functions: Sequence[dict[str, Any]], max_calls: int | None = None,
                 special: frozenset[str] = frozenset(), held: bool = True) -> CallsReader | None:
    """The reader of an answer's calls in the parser's format, their arguments read as they are written (``special``:
    the format's tags the tokenizer makes special tokens). ``held``: the parser's structural tag held the calls;
    else the model wrote them freely (``"auto"``), and what leaves the layout before a call opens is read by the
    parser. None where the parser reads the calls whole (a format without a layout: the pythonic ones)."""
    if isinstance(parser, Llama3JsonParser) and held:
        return RequiredCalls(max_calls, LLAMA3_CALLS, trim=True)
    layout = parser.layout_for(special)
    if layout is None:
        return None
    return TaggedCalls(layout, functions, max_calls, None if held else functools.partial(parser.stream, functions))


def read_pieces(reader: CallsReader, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when there is none) and calls, as a reader of grammar-held calls reads them
    when it streams."""
    content: list[str] = []
    calls: list[tuple[CallStart, list[str]]] = []
    for event in reader.feed(text) + reader.finish():
        if isinstance(event, CallStart):
            calls.append((event, []))
        elif isinstance(event, ArgumentsPiece):
            calls[-1][1].append(event.text)
        else:
            content.append(event)
    return "".join(content) or None, [ToolCall(start.name, "".join(pieces), start.call_id) for start, pieces in calls]


