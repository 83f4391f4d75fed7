"""gpt-oss's harmony format: an answer is a run of messages, each a header naming its channel (and, for a call,
its recipient) and a body, with special tokens between them, as the model's chat template ends its prompt:

    <|start|>assistant  (the prompt's end)
    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

A recipient may also follow the role (``<|start|>assistant to=functions.f<|channel|>commentary json``). What each
message is, as vLLM reads gpt-oss's answers (``--reasoning-parser openai_gptoss``, ``--tool-call-parser openai``):

* the ``analysis`` channel: the thinking (``reasoning_content``);
* a message to ``functions.NAME``, on any channel: a call of NAME, its body the arguments as written;
* a message to another recipient (the model's built-in browser or python tools, which this server does not run):
  thinking, as it is part of the model's own work;
* ``final``, ``commentary`` without a recipient (a preamble the user may see) and any other channel: content.

Text before any header (an answer that goes on from an assistant message's content) is content. Messages of one
kind are joined with a newline. The format is the chat template's, so it is read whenever the template writes it:
``writes_harmony``. Its tags are special tokens in gpt-oss's tokenizer, so its answers are detokenized with them.

A grammar holds either one message's body, whose header the prompt ends with (a named function's call, a structured
output's final message: ``forced_header``), or the whole answer, where the model chooses the call (``"required"``,
strict functions under ``"auto"``: ``call_tag``, each tag held as its token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.sampling_params import StructuredOutput
from router.call_readers import ArgumentsPiece, CallStart, Stepper
from router.errors import bad_request
from router.tool_parsers import add_event, arguments_schema, literal, partial_suffix, token

if TYPE_CHECKING:
    from router.tools import ToolPlan

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends a message's body: its own end tags, or the next message's start where the model left out the end.
_BODY_ENDS = (END, CALL, RETURN, START)
FUNCTIONS = "functions."
# The names the format goes by on the command line (vLLM's).
TOOL_CALL_PARSER = "openai"
REASONING_PARSER = "openai_gptoss"


def writes_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's)."""
    return chat_template is not None and all(tag in chat_template for tag in (START, CHANNEL, MESSAGE))


def check_parsers(chat_template: str | None, tool_call_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether the answers are read as harmony; ``ValueError`` where the parsers named do not fit the template."""
    harmony = writes_harmony(chat_template)
    for flag, name, ours in (("--tool-call-parser", tool_call_parser, TOOL_CALL_PARSER),
                             ("--reasoning-parser", reasoning_parser, REASONING_PARSER)):
        if name == ours and not harmony:
            raise ValueError(f"{flag} {ours} reads gpt-oss's harmony format, which this chat template does not write")
        if harmony and name not in (None, "none", ours):
            raise ValueError(f"this chat template writes gpt-oss's harmony format: {flag} {ours} reads it, not {name}")
    return harmony


@dataclass(frozen=True)
class Thinking:
    """A piece of the answer's thinking."""

    text: str


# What the reader gives: content text, thinking, a call opening, a piece of its arguments.
HarmonyEvent = str | Thinking | CallStart | ArgumentsPiece


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        """A header's text, from the role (or the answer's start) to ``<|message|>``."""
        role, _, rest = text.replace(CONSTRAIN, " ").partition(CHANNEL)
        words = rest.split()
        recipient = next((w[3:] for w in [*role.split(), *words] if w.startswith("to=")), None)
        channel = words[0] if words and not words[0].startswith("to=") else None
        return cls(channel, recipient or None)

    def kind(self) -> str:
        """``call``, ``thinking`` or ``content``."""
        if self.recipient is not None:
            return "call" if self.recipient.startswith(FUNCTIONS) else "thinking"
        return "thinking" if self.channel == "analysis" else "content"


def forced_header(tools: ToolPlan | None, structured: tuple[StructuredOutput, str] | None) -> str | None:
    """The header the prompt ends with where a grammar holds one message's body, the whole answer: a named
    function's call (its arguments held to its schema), or the final message (``response_format`` and the other
    structured outputs); None otherwise."""
    if tools is not None and tools.choice == "named":
        return f"{CHANNEL}commentary to={FUNCTIONS}{tools.function} {CONSTRAIN}json{MESSAGE}"
    if tools is not None and tools.choice == "required":
        return None
    return f"{CHANNEL}final{MESSAGE}" if structured is not None else None


def call_tag(tools: ToolPlan, special: frozenset[str]) -> StructuredOutput | None:
    """A structural tag over a whole answer whose calls are the model's to choose: a ``"required"`` answer (thinking
    and preambles, then a call of one of the functions, each held to its schema) or ``"auto"`` with strict functions
    (the same, or a final message; the strict functions' arguments held to their schemas, the others' any object).
    Every tag is held as its token (``special``: the format's tags the tokenizer makes special, as gpt-oss's does;
    a 400 where they are not). None for the other answers. The call ends the answer: the model ends it with
    ``<|call|>``, an end of sequence."""
    required = tools.choice == "required"
    if not required and not (tools.choice == "auto" and (tools.strict or tools.allowed is not None)):
        return None
    if not special.issuperset(TAGS):
        param, what = ("tool_choice", "tool_choice 'required'") if required else ("tools", "strict functions")
        raise bad_request(f"{what} in gpt-oss's harmony format need its tags to be special tokens of the tokenizer "
                          f"(gpt-oss's are); these are not: {', '.join(sorted(set(TAGS) - special))}", param=param)
    free = {"type": "any_tokens", "exclude_tokens": list(TAGS)}

    def message(channel: str) -> dict[str, Any]:  # a whole message, and the next one's start
        return {"type": "sequence", "elements": [token(CHANNEL), literal(channel), token(MESSAGE), free, token(END),
                                                 token(START), literal("assistant")]}

    def call(function: dict[str, Any]) -> dict[str, Any]:
        held = required or function["name"] in tools.strict
        schema = arguments_schema(function) if held else {"type": "object"}
        return {"type": "sequence", "elements": [
            token(CHANNEL), literal(f"commentary to={FUNCTIONS}{function['name']} "), token(CONSTRAIN), literal("json"),
            token(MESSAGE), {"type": "json_schema", "json_schema": schema}]}

    last = [call(f) for f in tools.callable_functions]
    if not required:
        last.append({"type": "sequence", "elements": [token(CHANNEL), literal("final"), token(MESSAGE), free]})
    spec = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "star", "content": {"type": "or", "elements": [message("analysis"), message("commentary")]}},
        {"type": "or", "elements": last}]}}
    return StructuredOutput(kind="structural_tag", spec=json.dumps(spec))


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
    return min(found) if found else None


@dataclass
class HarmonyStream(Stepper[HarmonyEvent]):
    """One answer read as it streams: ``feed`` gives the events no later text can change, ``finish`` the rest.
    ``max_calls``: calls past it are left out (``parallel_tool_calls`` false)."""

    max_calls: int | None = None
    _state: str = "start"  # "start", "header", "body", "between" (after a message's end)
    _buf: str = ""
    _kind: str = "content"  # the body's
    _skip: bool = False  # a call past max_calls: its body is left out
    _num_calls: int = 0
    _written: set[str] = field(default_factory=set)  # the kinds of the messages that wrote text

    def finish(self) -> list[HarmonyEvent]:
        """The rest: a body cut short is kept as far as it got; a header cut short wrote nothing."""
        events: list[HarmonyEvent] = []
        if self._state == "start" and self._buf:
            self._open_body("content", events)
        if self._state == "body":
            self._body_text(self._buf, events)
        self._buf = ""
        return events

    def _step(self, events: list[HarmonyEvent]) -> bool:
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith((CHANNEL, "to=")):
                self._state, self._buf = "header", head
            elif not head or CHANNEL.startswith(head) or "to=".startswith(head):
                return False  # not decided yet
            else:
                self._open_body("content", events)
            return True
        if self._state == "header":
            end = self._buf.find(MESSAGE)
            if end < 0:
                return False
            header, self._buf = Header.parse(self._buf[:end]), self._buf[end + len(MESSAGE):]
            kind = header.kind()
            if kind == "call":
                assert header.recipient is not None
                self._skip = self.max_calls is not None and self._num_calls >= self.max_calls
                if not self._skip:
                    self._num_calls += 1
                    events.append(CallStart(header.recipient[len(FUNCTIONS):]))
            self._open_body(kind, events)
            return True
        if self._state == "body":
            found = _first(self._buf, _BODY_ENDS)
            if found is None:
                keep = len(self._buf) - max(partial_suffix(self._buf, tag) for tag in _BODY_ENDS)
                self._body_text(self._buf[:keep], events)
                self._buf = self._buf[keep:]
                return False
            i, tag = found
            self._body_text(self._buf[:i], events)
            self._buf = self._buf[i + (0 if tag == START else len(tag)):]
            self._state = "between"
            return True
        # Between messages: the next one's start, whitespace, or text outside any message (content).
        head = self._buf.lstrip()
        if head.startswith(START):
            self._state, self._buf = "header", head[len(START):]
        elif not head or START.startswith(head):
            return False
        else:
            self._buf = head
            self._open_body("content", events)
        return True

    def _open_body(self, kind: str, events: list[HarmonyEvent]) -> None:
        if kind != "call" and kind in self._written:
            self._emit(kind, "\n", events)
        self._state, self._kind = "body", kind

    def _body_text(self, text: str, events: list[HarmonyEvent]) -> None:
        if text:
            self._emit(self._kind, text, events)

    def _emit(self, kind: str, text: str, events: list[HarmonyEvent]) -> None:
        if kind == "call":
            if not self._skip:
                events.append(ArgumentsPiece(text))
            return
        self._written.add(kind)
        if kind == "thinking":
            if events and isinstance(events[-1], Thinking):
                events[-1] = Thinking(events[-1].text + text)
            else:
                events.append(Thinking(text))
        else:
            add_event(events, text)


def read_harmony(text: str, max_calls: int | None = None) -> list[HarmonyEvent]:
    """A whole answer's events: those its stream gives, whatever the chunking."""
    stream = HarmonyStream(max_calls)
    return [*stream.feed(text), *stream.finish()]
